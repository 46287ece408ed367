"""Per-sample gradients in preconditioned coordinates, computed inside Opacus' hooks.

:class:`PreconditionedGradSampleModule` is an Opacus ``GradSampleModule`` whose grad samplers
for covered layers (Linear, ConvNd, ConvTransposeNd) produce ``s U_G g_i U_A`` directly from
the captured activations and output errors: from the layer's rows without a bias column
(``KroneckerBlock.sample_grads``: ``(U_G delta)(U_A a)^T`` summed over positions, or the
transform of the per-sample gradient, whichever is cheaper; a ``conv_a="kron"`` layer mixes its
input's channels by ``U_C`` first), written straight into per-parameter buffers. Transposed
convolutions transform per-sample gradients formed on their input grid. Linear and
normalisation layers without a block (:meth:`PreconditionedGradSampleModule.set_blocks`) use
Opacus' own samplers unchanged; every convolution without one gets an identity block (the
adapter's rows pad as the layer does, where Opacus' formula pads with zeros, and cost less to
form; 3D convolutions with several input channels per group take the layer's own kernel), so
DP-SGD through this module equals Opacus' to float rounding. Everything downstream (clipping,
noise, accounting) sees ordinary ``grad_sample`` tensors. Autograd does not form the batch
gradient of Linear and (transposed) convolution layers while the hooks capture: the optimizer
never reads it (see :func:`_detach_parameters`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from opacus.grad_sample import GradSampleModule
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient, prepare_layer
from torch import Tensor, nn
from torch.nn.utils import parametrize

from dpkfc_med.curvature.adapters import (
    LayerAdapter,
    adapter_for,
    kernel_per_sample_wins,
    supported_layer_types,
)
from dpkfc_med.curvature.kernels import grads_sq
from dpkfc_med.curvature.preconditioner import KroneckerBlock, raw_norms_sq
from dpkfc_med.privacy.ghost import MAX_GHOST_POSITIONS, Clipping, GhostRows, ghost_path_wins
from dpkfc_med.utils import check_choice

__all__ = ["PreconditionedGradSampleModule", "RAW_NORM_SAMPLES", "raw_norm_samples"]

RAW_NORM_SAMPLES = 16
"""At most this many samples per step have their raw (untransformed) per-sample norms kept
for diagnostics."""


def raw_norm_samples(batch: int) -> int:
    """Samples (the first ones) whose raw norms a step of ``batch`` samples keeps.

    At most one in 16 of the batch (at least one): the raw norms of a preconditioned layer
    cost an extra per-sample-gradient product, 25 % of DP-SGD's for 16 of a batch of 64.
    """
    return min(RAW_NORM_SAMPLES, max(1, batch // 16))


# Opacus' own table (its formulas plus any registered with register_grad_sampler), read at
# call time so that samplers registered after this import still apply.
_OPACUS_SAMPLERS = GradSampleModule.GRAD_SAMPLERS
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

# Benign: the first layer's input never requires grad, so torch warns for every Opacus hook.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients")


SINGLE_CHUNK_ELEMENTS = 1 << 20
"""A layer whose rows for the whole batch have at most this many elements (4 MiB in float32:
a Linear layer, a small late convolution) is transformed in one chunk: splitting it saves
no memory worth having and makes its matmuls slower."""


CHUNK_ELEMENTS = 1 << 24
"""Rows (elements) one chunk of a large layer may hold, 64 MiB in float32: a sample whose rows
alone exceed it (a 3D convolution at 32^3 positions and 433 inputs: 14 M) is unfolded and
transformed on its own."""


def _sample_chunk(batch: int, row_elements: int | None = None) -> int:
    """Samples per unfold in a covered layer's sampler (``row_elements``: rows per sample).

    The factored path holds the unfolded input, its transform and the transformed errors at
    once; in quarters of the batch (at least 16 samples) that stays below the single
    full-batch unfold Opacus' own conv sampler makes, at the price of a few more (still large)
    matrix products. A chunk also holds at most :data:`CHUNK_ELEMENTS` rows (but at least one
    sample), so a 3D layer's transient does not grow with the batch.
    """
    if row_elements is None:
        return max(RAW_NORM_SAMPLES, -(-batch // 4))
    if batch * row_elements <= SINGLE_CHUNK_ELEMENTS:
        return max(batch, 1)
    quarters = max(RAW_NORM_SAMPLES, -(-batch // 4))
    return max(1, min(quarters, CHUNK_ELEMENTS // max(row_elements, 1)))


def ghost_eligible(module: nn.Module, block: KroneckerBlock | None) -> bool:
    """Whether ``module``'s clipping can use ghost norms.

    It must have row and error-row forms (Linear, ConvNd, attention projections; not
    transposed convolutions), and its transform, if any, must act on rows (not the diagonal
    family's elementwise one).
    """
    adapter = adapter_for(module)
    return (
        adapter is not None
        and adapter.rows is not None
        and adapter.error_rows is not None
        and adapter.param_grads is None
        and (block is None or block.u_elem is None)
    )


def ghost_chosen(
    mode: str, block: KroneckerBlock, positions: int, device_type: str = "cpu"
) -> bool:
    """``privacy.clipping`` ``mode``'s choice for one eligible layer at ``positions`` (T).

    ``auto`` weighs multiply-adds on a CPU. On a GPU it keeps per-sample gradients: there the
    ghost path's extra kernel launches, not arithmetic, set the cost, and it was the slowest
    mode on every model measured (dpkfc_bench/results/gpu_h200.md).
    """
    if mode == "per_sample":
        return False
    if mode == "ghost":
        return positions <= MAX_GHOST_POSITIONS
    if device_type == "cuda":
        return False
    g, n_a, n_g = block.dims
    base = positions * g * n_a * n_g  # the raw outer product, in both of block.cost's paths
    factored, materialized = block.cost(1, positions)  # both == base without a transform
    return ghost_path_wins(
        positions=positions,
        groups=g,
        n_a=n_a,
        n_g=n_g,
        factored=factored - base,
        materialized=materialized - base,
    )


def _ghost_sampler(
    module: nn.Module,
    adapter: LayerAdapter,
    x: Tensor,
    backprops: Tensor,
    block: KroneckerBlock,
    kept: dict[nn.Module, Tensor],
    store: dict[nn.Module, GhostRows],
) -> dict[nn.Parameter, Tensor]:
    """Keep ``module``'s input and output error for ghost clipping; no per-sample gradients."""
    assert adapter.rows is not None and adapter.error_rows is not None
    m = raw_norm_samples(x.shape[0])
    kept[module] = (
        raw_norms_sq(block, adapter.rows(module, x[:m]), adapter.error_rows(module, backprops[:m]))
        if x.shape[0]
        else x.new_zeros(0)
    )
    entry = GhostRows(module, block, [(x, backprops)])
    weight = module.weight
    # Opacus counts the uses of a layer left in this backward pass; the last use closes it
    uses_left = int(getattr(weight, "_forward_counter", 1))
    previous = store.get(module)
    if previous is None:
        store[module] = entry
    elif previous.closed:
        raise ValueError(
            f"layer {type(module).__name__}: a second backward pass reached ghost clipping "
            "before the optimizer step; take a step (or zero_grad) after every backward pass, "
            "or set privacy.clipping: per_sample"
        )
    else:  # a further use of the layer in the same pass: its positions join the sum
        previous.extend(entry)
    store[module].closed = uses_left <= 1
    for p in module.parameters(recurse=False):
        if p.requires_grad:  # what Opacus promotes to grad_sample at the end of the pass
            p._current_grad_sample = None  # type: ignore[attr-defined]
    return {}


def _preconditioned_sampler(
    module: nn.Module,
    activations: list[Tensor],
    backprops: Tensor,
    block: KroneckerBlock | None,
    kept: dict[nn.Module, Tensor],
    ghost: tuple[str, dict[nn.Module, GhostRows]] | None = None,
) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradients of ``module``, in ``block``'s coordinates when it has one.

    The raw squared norms of the first :func:`raw_norm_samples` samples go to
    ``kept[module]`` (diagnostics). ``ghost``: ``(privacy.clipping mode, store)``; a layer
    the mode sends to ghost clipping keeps its rows in the store and returns no per-sample
    gradients.
    """
    adapter = adapter_for(module)
    if ghost is not None and ghost[0] != "per_sample" and ghost_eligible(module, block):
        assert adapter is not None
        ghost_block = block or KroneckerBlock(
            name=type(module).__name__, module=module, adapter=adapter
        )
        g, _, n_g = ghost_block.dims
        positions = math.prod(backprops.shape[1:]) // (g * n_g)
        if ghost_chosen(ghost[0], ghost_block, positions, backprops.device.type):
            return _ghost_sampler(
                module, adapter, activations[0], backprops, ghost_block, kept, ghost[1]
            )
    if block is None and isinstance(module, _CONVS):
        # An identity block: the adapter's rows instead of Opacus' conv formula, for three
        # reasons. Opacus' formula unfolds with zero padding whatever the layer's
        # padding_mode (reflect, replicate, circular); the adapter's rows pad as the layer
        # does. Its position-major unfold copies every sample's patches (a 1x1 convolution's
        # input too), where the adapter's channel-first rows are a view for 1x1 kernels and
        # a faster copy otherwise (docs/privacy.md, clipping). And for 3D convolutions with
        # several input channels per group the layer's own kernel forms the raw per-sample
        # gradients several times faster still. Equal to Opacus' to float rounding.
        assert adapter is not None
        block = KroneckerBlock(name=type(module).__name__, module=module, adapter=adapter)
    if block is None:
        if type(module) in _OPACUS_SAMPLERS:
            if isinstance(module, _CONVS):
                # Opacus' unfold is wrong on non-contiguous (channels-last) inputs.
                activations = [activations[0].contiguous(), *activations[1:]]
            return _OPACUS_SAMPLERS[type(module)](module, activations, backprops)
        # No Opacus formula (ConvTranspose): Opacus' functorch path (prepared in add_hooks) is
        # cheaper than unfolding the zero-inserted input when no transform is needed.
        return ft_compute_per_sample_gradient(module, activations, backprops)
    assert adapter is not None
    x = activations[0]
    m = raw_norm_samples(x.shape[0])
    if adapter.param_grads is not None or adapter.rows is None or adapter.error_rows is None:
        # Direct per-sample gradients (transposed convs: no zero-inserted unfold), then the
        # literal transform s U_G g U_A.
        raw = block.raw_grads(x, backprops, chunk=_sample_chunk(x.shape[0]))
        kept[module] = raw[:m].pow(2).flatten(1).sum(1)
        return adapter.to_params(module, block.transform_grads(raw))
    # Rows without a bias column, written straight into per-parameter buffers: no
    # concatenation of a ones column and no split copies afterwards.
    b = x.shape[0]
    weight: nn.Parameter = module.weight  # type: ignore[assignment]
    bias: nn.Parameter | None = getattr(module, "bias", None)
    w_out = x.new_empty(b, *weight.shape)
    b_out = x.new_empty(b, *bias.shape) if bias is not None and bias.requires_grad else None
    kron = block.a_kron
    g, n_a, n_g = block.dims
    positions = math.prod(backprops.shape[1:]) // (g * n_g)  # T
    step = _sample_chunk(b, positions * g * n_a)
    # raw per-sample gradients from the layer's own kernel where that beats the unfold
    kernel = (
        adapter.per_sample_grads
        if adapter.per_sample_grads is not None
        and kron is None
        and kernel_per_sample_wins(module)
        and (block.is_identity or block.choose_path(b, positions) == "materialized")
        else None
    )
    raw_parts: list[Tensor] = []
    for start in range(0, b, step):
        sl = slice(start, start + step)
        xs, need = x[sl], max(m - start, 0)
        n = xs.shape[0]
        outs = (
            w_out[sl].view(n, g, n_g, -1),
            None if b_out is None else b_out[sl].view(n, g, n_g),
        )
        if kernel is not None:
            raw_w, raw_b = kernel(module, xs, backprops[sl])
            if need:
                raw_parts.append(grads_sq(raw_w[:need], None if raw_b is None else raw_b[:need]))
            block.transform_raw(raw_w, raw_b, outs)
            continue
        err = adapter.error_rows(module, backprops[sl])
        if kron is not None:
            # kron U_A: U_C on the input channels, then Opacus-sized products and U_K
            rows = adapter.rows(module, kron.mix_channels(xs))
            _, _, raw_sq = block.sample_grads(rows, err, mixed=True, out=outs)
            if need:
                raw_sq = raw_norms_sq(block, adapter.rows(module, xs[:need]), err[:need])
        else:
            rows = adapter.rows(module, xs)
            _, _, raw_sq = block.sample_grads(rows, err, raw_norms=need, out=outs)
        if raw_sq is not None:
            raw_parts.append(raw_sq)
    kept[module] = torch.cat(raw_parts) if raw_parts else x.new_zeros(0)
    out = {weight: w_out} if weight.requires_grad else {}
    if b_out is not None:
        out[bias] = b_out  # type: ignore[index]
    return out


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _param_dtype(module: nn.Module) -> torch.dtype | None:
    """The floating dtype of ``module``'s own trainable parameters (None without any)."""
    for p in module.parameters(recurse=False):
        if p.requires_grad and p.is_floating_point():
            return p.dtype
    return None


def _in_dtype(t: Any, dtype: torch.dtype | None) -> Any:
    """``t`` cast to ``dtype`` when it is a floating tensor of another dtype; else ``t``."""
    if dtype is None or not isinstance(t, Tensor) or not t.is_floating_point() or t.dtype == dtype:
        return t
    return t.to(dtype)


def _adopt_fresh(
    module: nn.Module, grads: dict[nn.Parameter, Tensor], inputs: list[Tensor]
) -> dict[nn.Parameter, Tensor]:
    """Hand a layer's first per-sample gradients of a pass to Opacus without its copy.

    Opacus accumulates each result into ``p._current_grad_sample``, which it first creates as
    a zero-filled ``[max_batch_len, ...]`` tensor and copies into: a fill and a copy per
    parameter per step. A full-batch result that shares no memory with the hook's inputs
    becomes that tensor itself (a later use of the layer in the same pass adds to it as
    before); the others go through Opacus' path.
    """
    batch = getattr(module, "max_batch_len", None)
    taken = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, Tensor)}
    rest: dict[nn.Parameter, Tensor] = {}
    for p, gs in grads.items():
        if (
            p.requires_grad
            and not hasattr(p, "_current_grad_sample")
            and gs.shape[0] == batch
            and gs.untyped_storage().data_ptr() not in taken
        ):
            p._current_grad_sample = gs  # type: ignore[attr-defined]
        else:
            rest[p] = gs
    return rest


_DETACHED_TYPES = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
"""Layer types whose ``forward`` reads only ``self.weight`` and ``self.bias`` (so a detached
copy of both is the same layer to every other part of the pass)."""

_STASH = "_dpkfc_params_in_forward"


def _detach_parameters(gsm: PreconditionedGradSampleModule, module: nn.Module) -> list[Any]:
    """Forward hooks that keep autograd from forming ``module``'s batch gradient.

    Under DP training the batch gradient that autograd accumulates into ``p.grad`` during
    ``backward()`` is never used: the optimizer replaces it with the clipped, noised sum of
    the per-sample gradients, which the backward hooks form from the layer's input and
    output error alone. Forming it costs a weight-gradient product per layer and leaves the
    un-noised private sum in ``p.grad`` until the step. While the hooks capture, a layer whose
    input requires grad runs its forward on detached views of its trainable parameters (same
    storage, same values), and its parameters are put back before any other forward hook sees
    the layer (also when the forward raises). The output error, and so every per-sample
    gradient, is unchanged. A layer whose input needs no gradient (a network's first layer)
    keeps its parameters attached: its output error exists only through them.
    """

    def swap(mod: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if not (
            gsm.hooks_enabled
            and torch.is_grad_enabled()
            and mod.training
            and isinstance(x, Tensor)
            and x.requires_grad
        ):
            return
        kept = {}
        for name, p in mod._parameters.items():
            if p is not None and p.requires_grad:
                kept[name] = p
                mod._parameters[name] = p.detach()  # type: ignore[assignment]
        mod.__dict__[_STASH] = kept

    def restore(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        kept = mod.__dict__.pop(_STASH, None)
        if kept:
            mod._parameters.update(kept)

    return [
        module.register_forward_pre_hook(swap),
        # first among the forward hooks, so Opacus' capture sees the real parameters
        module.register_forward_hook(restore, prepend=True, always_call=True),
    ]


class PreconditionedGradSampleModule(GradSampleModule):
    """Opacus ``GradSampleModule`` with preconditioned grad samplers for covered layers.

    The preconditioner reaches the hooks through :meth:`set_blocks` (a mapping from covered
    modules to their blocks, empty for DP-SGD), and the hooks hand back the raw per-sample
    norms they kept in :attr:`raw_norms_sq`; nothing is stored on the wrapped modules.

    Attributes:
        blocks: Covered module -> its :class:`~dpkfc_med.curvature.KroneckerBlock`.
        raw_norms_sq: Covered module -> raw squared norms of the first
            :func:`raw_norm_samples` samples of the latest backward pass (diagnostics).
    """

    GRAD_SAMPLERS: dict[Any, Any] = {}

    def __init__(self, *args: Any, clipping: str = "per_sample", **kwargs: Any) -> None:
        self.blocks: dict[nn.Module, KroneckerBlock] = {}
        self.raw_norms_sq: dict[nn.Module, Tensor] = {}
        self.ghost_rows: dict[nn.Module, GhostRows] = {}
        self.clipping = check_choice("privacy.clipping", clipping, Clipping).value
        super().__init__(*args, **kwargs)

    def set_clipping(self, mode: str) -> None:
        """``privacy.clipping``: ``auto``, ``ghost`` or ``per_sample`` (:mod:`.ghost`)."""
        self.clipping = check_choice("privacy.clipping", mode, Clipping).value
        self.ghost_rows.clear()

    def set_blocks(self, blocks: dict[nn.Module, KroneckerBlock]) -> None:
        """Compute the per-sample gradients of ``blocks``' modules in their coordinates.

        Modules left out (all of them with an empty mapping) get Opacus' raw per-sample
        gradients. Raw norms kept under the previous blocks are dropped.
        """
        self.blocks = dict(blocks)
        self.raw_norms_sq.clear()

    def _sample(
        self, module: nn.Module, activations: list[Tensor], backprops: Tensor
    ) -> dict[nn.Parameter, Tensor]:
        out = _preconditioned_sampler(
            module,
            activations,
            backprops,
            self.blocks.get(module),
            self.raw_norms_sq,
            (self.clipping, self.ghost_rows),
        )
        return _adopt_fresh(module, out, [*activations, backprops])

    def rearrange_grad_samples(
        self, *, module: nn.Module, backprops: Tensor, loss_reduction: str, batch_first: bool
    ) -> tuple[list[Tensor], Tensor]:
        """Opacus' rearrangement, with activations and errors in the parameters' dtype.

        Under mixed precision (bfloat16 autocast) a layer's captured input and output error
        are bfloat16 while its parameters are float32. Every sampler -- Opacus', functorch's
        and the preconditioned one, ghost norms included -- then works in float32, so norms,
        transforms and the clipped sum do not round to bfloat16.

        A low-precision output error of a *mean*-reduced loss is refused: it carries
        ``(1/B) g`` rounded to bfloat16, whose rounding depends on the secret batch size
        ``B``, so a unit's clipped contribution would depend on how many other units were
        drawn. Backpropagate the sum of per-sample losses instead (``backward_reduction=
        "sum"`` in :meth:`~dpkfc_med.privacy.PrivacyEngine.make_private`).

        Raises:
            RuntimeError: a bfloat16 / float16 output error under a mean-reduced loss.
        """
        if loss_reduction == "mean" and backprops.dtype in _LOW_PRECISION:
            raise RuntimeError(
                f"{type(module).__name__}: output errors arrive in {backprops.dtype} from a "
                "batch-mean loss; their rounding of (1/B) g depends on the secret Poisson batch "
                "size B, which breaks the per-unit sensitivity bound. Call make_private(..., "
                "backward_reduction='sum') and backward() the sum of per-sample losses (the "
                "update is still averaged over the expected batch), or train in float32"
            )
        dtype = _param_dtype(module)
        activations, backprops = super().rearrange_grad_samples(
            module=module,
            backprops=_in_dtype(backprops, dtype),
            loss_reduction=loss_reduction,
            batch_first=batch_first,
        )
        return [_in_dtype(a, dtype) for a in activations], backprops

    def add_hooks(self, *args: Any, **kwargs: Any) -> None:
        """Prepare functorch for covered types Opacus has no formula for, then add hooks.

        The sampler table is built here, per instance, from Opacus' table as it is now (so
        samplers registered after import apply) and the preconditioned sampler for every
        covered layer type. Preparation copies the layer, so it must happen before hooks are
        registered (as Opacus does for the layers it sends to functorch).
        """
        self.GRAD_SAMPLERS = {
            **_OPACUS_SAMPLERS,
            **{t: self._sample for t in supported_layer_types()},
        }
        for m in self._module.modules():
            if type(m) in self.GRAD_SAMPLERS and type(m) not in _OPACUS_SAMPLERS:
                if any(p.requires_grad for p in m.parameters(recurse=False)):
                    prepare_layer(m)
        super().add_hooks(*args, **kwargs)
        # Opacus removes every handle in this list in remove_hooks()
        handles = self._module.autograd_grad_sample_hooks
        for m in self._module.modules():
            if type(m) in _DETACHED_TYPES and not parametrize.is_parametrized(m):
                handles.extend(_detach_parameters(self, m))

    def disable_hooks(self) -> None:
        """Stop capturing (used during probe passes, which must not touch ``grad_sample``)."""
        self.hooks_enabled = False

    def enable_hooks(self) -> None:
        """Resume capturing."""
        self.hooks_enabled = True
