"""MONAI transformer blocks rewritten so that Opacus' per-sample hooks see every parameter.

Three patterns in MONAI's ``ViT``, ``UNETR`` and ``SwinUNETR`` stop per-sample gradients:

* **raw parameters on a module with children**: ``ViT.cls_token`` and
  ``PatchEmbeddingBlock.position_embeddings`` are ``nn.Parameter`` s used directly in a
  ``forward`` that also calls trainable layers. Opacus then sends the whole module to
  functorch (recomputing its children per sample), which fails on ``ViT``'s tuple output;
* **a trainable module holding a buffer**: Swin's ``WindowAttention`` owns the relative
  position bias table next to its index buffer, which Opacus refuses;
* **parameters the forward never uses**: a ``TransformerBlock`` without cross attention still
  builds ``norm_cross_attn``, which then never gets a per-sample gradient (they are frozen);
* **channels-last feature maps**: SwinUNETR's encoders convolve the transformer's hidden
  states rearranged to channels-first, a non-contiguous view, and Opacus' convolution
  per-sample formula (``opacus.utils.tensor_utils.unfold2d``/``unfold3d``) returns wrong
  gradients for such inputs; every convolution of a SwinUNETR gets a pre-hook that makes its
  input contiguous (the same values);
* **a batch folded with windows**: inside ``WindowAttention`` the leading axis is
  ``samples x windows``, so a per-"sample" gradient there would be per window.

Each raw parameter moves into a leaf module of its own (:class:`PositionEmbedding`,
:class:`ClassToken`, :class:`RelativePositionBias`) with an exact Opacus grad sampler
(registered with ``opacus.grad_sample.register_grad_sampler``), and the owning MONAI class is
swapped for a subclass whose ``forward`` is MONAI's with the parameter use replaced by a call
of the leaf. The window attention unfolds its batch back to ``[samples, windows * tokens, C]``
before ``qkv`` and ``proj`` (both act on each token alone, so this is a view) and before the
bias, so every hook sees one row per sample; the number of samples comes from a forward
pre-hook on the enclosing ``SwinTransformerBlock``, whose input is still ``[B, D, H, W, C]``.
The forwards are written here because MONAI's use the parameters inline; the arithmetic is
MONAI's, term for term (``tests/models/test_models_attention.py`` checks outputs against the
unfixed network).
"""

from __future__ import annotations

from typing import Any

import torch
from monai.networks.blocks.patchembedding import PatchEmbeddingBlock
from monai.networks.blocks.transformerblock import TransformerBlock
from monai.networks.nets.swin_unetr import SwinTransformerBlock, SwinUNETR, WindowAttention
from monai.networks.nets.vit import ViT
from opacus.grad_sample import register_grad_sampler
from torch import Tensor, nn

__all__ = [
    "ClassToken",
    "PositionEmbedding",
    "RelativePositionBias",
    "hoist_token_parameters",
]


class PositionEmbedding(nn.Module):
    """``x + weight`` with a learnt ``weight`` of shape ``[1, T, D]`` (broadcast over samples)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        """``[B, T, D] -> [B, T, D]``."""
        return x + self.weight


class ClassToken(nn.Module):
    """Prepend a learnt token ``weight`` ``[1, 1, D]`` to every sample's token sequence."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        """``[B, T, D] -> [B, T + 1, D]``."""
        return torch.cat((self.weight.expand(x.shape[0], -1, -1), x), dim=1)


class RelativePositionBias(nn.Module):
    """Add Swin's relative position bias ``table[index]`` to attention logits.

    The index is a constant of the window size (not data): it is kept as a plain tensor
    rather than a buffer, because Opacus refuses trainable layers that hold buffers.
    """

    def __init__(self, table: nn.Parameter, index: Tensor) -> None:
        super().__init__()
        self.weight = table
        self.index = index.detach().clone()

    def _flat_index(self, n: int) -> Tensor:
        """The first ``n x n`` entries of the index, flat, on the table's device.

        Cached: the forward and the grad sampler ask for it at every step.
        """
        cached = getattr(self, "_flat", None)
        device = self.weight.device
        if cached is None or cached.numel() != n * n or cached.device != device:
            cached = self.index[:n, :n].reshape(-1).to(device)
            self._flat = cached
        return cached

    def bias(self, n: int) -> Tensor:
        """``[heads, n, n]``: the bias of an ``n``-token window."""
        return self.weight[self._flat_index(n)].reshape(n, n, -1).permute(2, 0, 1)

    def forward(self, attn: Tensor) -> Tensor:
        """``[B, W, heads, n, n] -> [B, W, heads, n, n]``: logits plus the bias."""
        return attn + self.bias(attn.shape[-1])


@register_grad_sampler(PositionEmbedding)
def _position_grad_sample(
    module: PositionEmbedding, activations: list[Tensor], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradient of ``weight``: the output error summed over broadcast axes."""
    w = module.weight
    if not w.requires_grad:
        return {}
    g = backprops  # [B, *S]; ``weight`` broadcasts against one sample's [*S], right-aligned
    extra = g.dim() - 1 - w.dim()
    if extra > 0:
        g = g.sum(dim=tuple(range(1, 1 + extra)))
    elif extra < 0:
        g = g.reshape(g.shape[0], *([1] * -extra), *g.shape[1:])
    dims = tuple(i + 1 for i, s in enumerate(w.shape) if s == 1 and g.shape[i + 1] != 1)
    if dims:
        g = g.sum(dim=dims, keepdim=True)
    return {w: g}


@register_grad_sampler(ClassToken)
def _class_token_grad_sample(
    module: ClassToken, activations: list[Tensor], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradient of the token: the output error at position 0."""
    w = module.weight
    return {w: backprops[:, :1].reshape(backprops.shape[0], *w.shape)} if w.requires_grad else {}


@register_grad_sampler(RelativePositionBias)
def _relative_bias_grad_sample(
    module: RelativePositionBias, activations: list[Tensor], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradient of the table: output errors summed over windows, scattered by index."""
    w = module.weight
    if not w.requires_grad:
        return {}
    b, n = backprops.shape[0], backprops.shape[-1]
    g = backprops.sum(1).permute(0, 2, 3, 1).reshape(b, n * n, -1)  # [B, n*n, heads]
    out = torch.zeros(b, *w.shape, dtype=g.dtype, device=g.device)
    return {w: out.index_add_(1, module._flat_index(n), g)}


class PrivatePatchEmbeddingBlock(PatchEmbeddingBlock):
    """MONAI ``PatchEmbeddingBlock`` whose position embedding is a :class:`PositionEmbedding`."""

    position_embedding: PositionEmbedding

    def forward(self, x: Tensor) -> Tensor:
        """Patch embedding, flattened to tokens for ``proj_type="conv"``, plus positions."""
        x = self.patch_embeddings(x)
        if getattr(self, "proj_type", "conv") == "conv":
            x = x.flatten(2).transpose(-1, -2)
        return self.dropout(self.position_embedding(x))


class PrivateViT(ViT):
    """MONAI ``ViT`` whose class token (classification) is a :class:`ClassToken`."""

    def forward(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        """``(output, hidden states of every block)``, as MONAI's ``ViT``."""
        x = self.patch_embedding(x)
        token = getattr(self, "class_token", None)
        if isinstance(token, ClassToken):
            x = token(x)
        hidden_states_out = []
        for blk in self.blocks:
            x = blk(x)
            hidden_states_out.append(x)
        x = self.norm(x)
        if hasattr(self, "classification_head"):
            x = self.classification_head(x[:, 0])
        return x, hidden_states_out


class PrivateWindowAttention(WindowAttention):
    """MONAI Swin ``WindowAttention`` with per-sample rows for ``qkv``, ``proj`` and the bias.

    ``samples`` is set before each call by the enclosing block's pre-hook
    (:func:`_record_samples`); the input's leading axis is ``samples * windows``.
    """

    relative_position_bias: RelativePositionBias
    samples: int | None = None

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """``[B * W, n, C] -> [B * W, n, C]``: window self-attention, as MONAI's."""
        bw, n, c = x.shape
        b = self.samples
        if b is None or b < 1 or bw % b:
            raise RuntimeError(
                f"{type(self).__name__} got {bw} windows but the number of samples is "
                f"{b}; call it through its SwinTransformerBlock (whose pre-hook sets it)"
            )
        w, heads = bw // b, self.num_heads
        qkv = self.qkv(x.reshape(b, w * n, c))
        qkv = qkv.reshape(bw, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = self.relative_position_bias((q @ k.transpose(-2, -1)).view(b, w, heads, n, n))
        if mask is not None:
            attn = attn.view(-1, mask.shape[0], heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
        attn = self.attn_drop(self.softmax(attn.reshape(bw, heads, n, n))).to(v.dtype)
        x = (attn @ v).transpose(1, 2).reshape(b, w * n, c)
        return self.proj_drop(self.proj(x)).reshape(bw, n, c)


def _record_samples(block: nn.Module, args: tuple[Any, ...]) -> None:
    """Forward pre-hook of a ``SwinTransformerBlock``: tell its attention the batch size."""
    attn = block.attn
    assert isinstance(attn, PrivateWindowAttention)
    attn.samples = int(args[0].shape[0])


def contiguous_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Forward pre-hook: pass a non-contiguous first input on as a contiguous copy."""
    x = args[0]
    if isinstance(x, Tensor) and not x.is_contiguous():
        return (x.contiguous(), *args[1:])
    return None


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _take_parameter(module: nn.Module, name: str) -> nn.Parameter:
    param = module._parameters.pop(name)
    assert isinstance(param, nn.Parameter)
    return param


def hoist_token_parameters(model: nn.Module) -> list[tuple[str, str, str, str]]:
    """Rewrite MONAI's ViT, patch embedding and Swin window attention in place (see module doc).

    Args:
        model: Any network; only exact MONAI ``ViT``, ``PatchEmbeddingBlock``,
            ``TransformerBlock``, ``WindowAttention`` and ``SwinTransformerBlock`` instances are
            touched (a subclass may have its own forward).

    Returns:
        ``(path, before, after, why)`` per rewritten module, in module order.
    """
    fixes: list[tuple[str, str, str, str]] = []
    for path, module in list(model.named_modules()):
        kind = type(module)
        if kind is PatchEmbeddingBlock and "position_embeddings" in module._parameters:
            pos = _take_parameter(module, "position_embeddings")
            module.__class__ = PrivatePatchEmbeddingBlock
            module.position_embedding = PositionEmbedding(pos)
            fixes.append(
                (
                    path,
                    "PatchEmbeddingBlock (position_embeddings parameter)",
                    "PrivatePatchEmbeddingBlock (position_embedding.weight)",
                    "a parameter used next to trainable layers hides them from Opacus' hooks",
                )
            )
        elif kind is ViT:
            module.__class__ = PrivateViT
            after = "PrivateViT"
            if "cls_token" in module._parameters:
                module.class_token = ClassToken(_take_parameter(module, "cls_token"))
                after += " (class_token.weight)"
            fixes.append(
                (
                    path,
                    "ViT (cls_token parameter)" if "class_token" in after else "ViT",
                    after,
                    "a parameter used next to trainable layers hides them from Opacus' hooks",
                )
            )
        elif kind is WindowAttention:
            table = _take_parameter(module, "relative_position_bias_table")
            index = module.relative_position_index
            module.__class__ = PrivateWindowAttention
            module.relative_position_bias = RelativePositionBias(table, index)
            fixes.append(
                (
                    path,
                    "WindowAttention (bias table next to an index buffer; batch x windows rows)",
                    "PrivateWindowAttention (relative_position_bias.weight; per-sample rows)",
                    "Opacus refuses trainable layers with buffers and would clip per window",
                )
            )
        elif kind is TransformerBlock and not module.with_cross_attention:
            unused = [p for p in module.norm_cross_attn.parameters() if p.requires_grad]
            if unused:
                for p in unused:
                    p.requires_grad_(False)
                fixes.append(
                    (
                        f"{path}.norm_cross_attn" if path else "norm_cross_attn",
                        "LayerNorm (trainable, unused without cross attention)",
                        "LayerNorm (frozen)",
                        "a parameter the forward never uses gets no per-sample gradient",
                    )
                )
        elif kind is SwinUNETR:
            convs = [m for m in module.modules() if isinstance(m, _CONVS)]
            added = [
                m
                for m in convs
                if contiguous_input not in m._forward_pre_hooks.values()
                and m.register_forward_pre_hook(contiguous_input) is not None
            ]
            if added:
                fixes.append(
                    (
                        path,
                        f"SwinUNETR ({len(added)} convolutions on channels-last views)",
                        "SwinUNETR (contiguous convolution inputs)",
                        "Opacus' convolution per-sample formula is wrong on non-contiguous inputs",
                    )
                )
        elif kind is SwinTransformerBlock and type(module.attn) in (
            WindowAttention,
            PrivateWindowAttention,
        ):
            if _record_samples not in module._forward_pre_hooks.values():
                module.register_forward_pre_hook(_record_samples)
    return fixes


class ViTClassifier(nn.Module):
    """A MONAI ``ViT`` (``classification=True``) that returns the class logits ``[B, K]`` only.

    MONAI's ``ViT`` returns ``(logits, hidden states)``; losses and metrics want the logits.
    """

    def __init__(self, vit: ViT) -> None:
        super().__init__()
        self.vit = vit

    def forward(self, x: Tensor) -> Tensor:
        """``[B, C, *S] -> [B, K]``."""
        return self.vit(x)[0]
