r"""Per-layer adapters: layer inputs and output errors in one shared ``[B, T, G, n]`` layout.

Every weight layer the preconditioner covers is viewed as a (grouped) matrix product

.. math::

    y_{b,t,g} = W_g \, a_{b,t,g}, \qquad W_g \in \mathbb{R}^{n_g \times n_a},

with ``B`` samples, ``T`` positions (sequence tokens, output voxels of a convolution), ``G``
independent weight groups (``groups`` of a convolution, 1 otherwise), ``a`` the input (conv:
the unfolded patch, Grosse & Martens 2016 "KFC") with a homogeneous 1 appended when the layer
has a bias, and ``delta = dL/dy`` the output error. The per-sample gradient of group ``g`` is
then

.. math::

    \nabla_{W_g} \ell_b = \sum_t \delta_{b,t,g} \, a_{b,t,g}^\top
    \in \mathbb{R}^{n_g \times n_a},

and each adapter knows how to map that ``[B, G, n_g, n_a]`` tensor to and from the layer's own
parameter tensors. Adding a layer type means adding one adapter (and its brute-force test).

Transposed convolutions reuse the convolution path: ``conv_transpose(x, W)`` equals a stride-1
convolution of the zero-inserted, re-padded input with the flipped, channel-swapped kernel.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "LayerAdapter",
    "adapter_for",
    "kernel_per_sample_wins",
    "register_adapter",
    "supported_layer_types",
    "unfold_channels_first",
    "unfold_nd",
]


@dataclass(frozen=True)
class LayerAdapter:
    """How one layer type maps to the shared ``[B, T, G, n]`` layout.

    Attributes:
        name: short adapter name shown in coverage summaries.
        activations: ``(module, x, *, max_positions=None, generator=None) -> a`` with ``a``
            of shape ``[B, T, G, n_a]`` (bias column included as a trailing 1 when the layer
            has a bias); convolutions keep only ``max_positions`` random positions when ``T``
            is larger (factor estimation on large volumes).
        errors: ``(module, dy) -> delta`` of shape ``[B, T, G, n_g]``.
        to_params: ``(module, grads [B, G, n_g, n_a]) -> {param: [B, *param.shape]}``.
        from_params: ``(module, {param: [B, *param.shape]}) -> [B, G, n_g, n_a]``.
        dims: ``module -> (G, n_a, n_g)``.
        param_grads: optional ``(module, x, dy) -> {param: [B, *param.shape]}``, the raw
            per-sample gradients computed without the ``[B, T, G, n_a]`` unfold. Layers whose
            unfold is wasteful (transposed convolutions: 1 - 1/prod(stride) of it is inserted
            zeros) provide it, and per-sample transforms then start from it.
        rows: optional ``(module, x) -> a`` of shape ``[B, G, T, n_w]``: the same inputs
            as ``activations`` in the per-step layout, without the bias coordinate and
            possibly a strided view (a convolution's channel-first unfold, transposed). Layers
            that provide it (with ``error_rows``) keep their weight as ``[G * n_g, n_w]`` in
            row-major order, so per-sample gradients ``[B, G, n_g, n_w]`` reshape to the
            weight without a copy; the training-step sampler uses this path.
        error_rows: ``(module, dy) -> delta`` of shape ``[B, G, T, n_g]`` (a view of ``dy``).
        summed_grad: optional ``(module, x, dy) -> [G, n_g, n_a]``, the gradient summed over
            the batch (bias column last) by the layer's own weight-gradient kernel, without
            an unfold; ghost clipping's weighted sum uses it (errors scaled per sample).
        per_sample_grads: optional ``(module, x, dy) -> (w [B, G, n_g, n_w], b [B, G, n_g]
            or None)``, raw per-sample gradients by the layer's own weight-gradient kernel
            (the batch as groups), without an unfold; the sampler's materialized path uses it
            where :func:`kernel_per_sample_wins` says it is faster.
    """

    name: str
    activations: Callable[..., Tensor]
    errors: Callable[[nn.Module, Tensor], Tensor]
    to_params: Callable[[nn.Module, Tensor], dict[nn.Parameter, Tensor]]
    from_params: Callable[[nn.Module, dict[nn.Parameter, Tensor]], Tensor]
    dims: Callable[[nn.Module], tuple[int, int, int]]
    param_grads: Callable[[nn.Module, Tensor, Tensor], dict[nn.Parameter, Tensor]] | None = None
    rows: Callable[[nn.Module, Tensor], Tensor] | None = None
    error_rows: Callable[[nn.Module, Tensor], Tensor] | None = None
    summed_grad: Callable[[nn.Module, Tensor, Tensor], Tensor] | None = None
    per_sample_grads: Callable[[nn.Module, Tensor, Tensor], tuple[Tensor, Tensor | None]] | None = (
        None
    )


_ADAPTERS: dict[type[nn.Module], LayerAdapter] = {}


def register_adapter(*layer_types: type[nn.Module]) -> Callable[[LayerAdapter], LayerAdapter]:
    """Register an adapter for exact layer types (subclasses are not matched implicitly)."""

    def deco(adapter: LayerAdapter) -> LayerAdapter:
        for t in layer_types:
            _ADAPTERS[t] = adapter
        return adapter

    return deco


def supported_layer_types() -> tuple[type[nn.Module], ...]:
    """Layer types with a registered adapter."""
    return tuple(_ADAPTERS)


def adapter_for(module: nn.Module) -> LayerAdapter | None:
    """The adapter for ``module``'s exact type, or ``None`` when the layer is not covered."""
    return _ADAPTERS.get(type(module))


def _has_bias(module: Any) -> bool:
    return getattr(module, "bias", None) is not None and module.bias.requires_grad  # type: ignore[union-attr]


def _append_one(a: Tensor) -> Tensor:
    ones = torch.ones(*a.shape[:-1], 1, dtype=a.dtype, device=a.device)
    return torch.cat([a, ones], dim=-1)


def _split_bias(
    module: nn.Module, grads: Tensor, weight_shape_fn: Callable[[Tensor], Tensor]
) -> dict[nn.Parameter, Tensor]:
    """Split ``[B, G, n_g, n_a(+1)]`` into weight and bias per-sample gradients."""
    out: dict[nn.Parameter, Tensor] = {}
    b = grads.shape[0]
    if _has_bias(module):
        out[module.bias] = grads[..., -1].reshape(b, -1)  # type: ignore[index]
        grads = grads[..., :-1]
    if module.weight.requires_grad:  # type: ignore[union-attr]
        out[module.weight] = weight_shape_fn(grads)  # type: ignore[index]
    return out


def _join_bias(module: Any, grads: dict[nn.Parameter, Tensor], w: Tensor) -> Tensor:
    """Inverse of :func:`_split_bias`: ``w`` is ``[B, G, n_g, n_a]`` without the bias column."""
    if _has_bias(module):
        bias = grads[module.bias].reshape(w.shape[0], w.shape[1], w.shape[2], 1)  # type: ignore[index]
        w = torch.cat([w, bias], dim=-1)
    return w


# --------------------------------------------------------------------------------------- Linear


def _linear_activations(module: Any, x: Tensor, **sampling: Any) -> Tensor:
    # Token counts are small next to voxel grids: positions are never subsampled here.
    a = x.reshape(x.shape[0], -1, x.shape[-1]).unsqueeze(2)
    return _append_one(a) if _has_bias(module) else a


def _linear_errors(module: Any, dy: Tensor) -> Tensor:
    return dy.reshape(dy.shape[0], -1, dy.shape[-1]).unsqueeze(2)


def _linear_rows(module: Any, x: Tensor) -> Tensor:
    return x.reshape(x.shape[0], 1, -1, x.shape[-1])


def _linear_error_rows(module: Any, dy: Tensor) -> Tensor:
    return dy.reshape(dy.shape[0], 1, -1, dy.shape[-1])


def _linear_to_params(module: Any, grads: Tensor) -> dict[nn.Parameter, Tensor]:
    return _split_bias(module, grads, lambda g: g[:, 0])


def _linear_from_params(module: Any, grads: dict[nn.Parameter, Tensor]) -> Tensor:
    w = grads[module.weight].unsqueeze(1)  # type: ignore[index]
    return _join_bias(module, grads, w)


def _linear_dims(module: Any) -> tuple[int, int, int]:
    return 1, module.in_features + int(_has_bias(module)), module.out_features  # type: ignore[operator]


LINEAR = register_adapter(nn.Linear)(
    LayerAdapter(
        "linear",
        _linear_activations,
        _linear_errors,
        _linear_to_params,
        _linear_from_params,
        _linear_dims,
        rows=_linear_rows,
        error_rows=_linear_error_rows,
    )
)


# ------------------------------------------------------------------------------------ ConvNd


def _patch_view(
    x: Tensor, kernel_size: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...]
) -> Tensor:
    """View ``[B, C, L1..Ln, k1..kn]`` of an already padded ``[B, C, *S]`` tensor (no copy)."""
    for d in range(len(kernel_size)):
        span = dilation[d] * (kernel_size[d] - 1) + 1
        x = x.unfold(2 + d, span, stride[d])
        if dilation[d] > 1:
            x = x[..., :: dilation[d]]
    return x


def unfold_nd(
    x: Tensor,
    kernel_size: tuple[int, ...],
    stride: tuple[int, ...],
    dilation: tuple[int, ...],
    *,
    max_positions: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Unfold an already padded ``[B, C, *S]`` tensor into patches ``[B, L, C, prod(k)]``.

    One implementation for 1D/2D/3D (``torch.nn.functional.unfold`` is 2D-only); the patch
    order (channel, then kernel offsets in row-major order) matches ``weight.flatten(1)``.

    With ``max_positions`` smaller than the number of output positions ``L``, only that many
    positions, drawn uniformly without replacement by ``generator``, are copied out of the
    (view-only) unfold: the patch tensor then costs ``max_positions`` rows instead of ``L``.
    """
    n = len(kernel_size)
    b, c = x.shape[:2]
    x = _patch_view(x, kernel_size, stride, dilation)
    grid = tuple(x.shape[2 : 2 + n])
    num_pos = math.prod(grid)
    k = math.prod(kernel_size)
    if max_positions is not None and num_pos > max_positions:
        flat = torch.randperm(num_pos, generator=generator)[:max_positions].sort().values
        index = torch.unravel_index(flat.to(x.device), grid)
        # advanced indexing of the adjacent L dims: [B, C, P, k1..kn] -> [B, P, C, k1..kn]
        picked = x[(slice(None), slice(None), *index)]  # type: ignore[index]
        return picked.transpose(1, 2).reshape(b, max_positions, c, k)
    # x: [B, C, L1..Ln, k1..kn] -> [B, L1..Ln, C, k1..kn]
    perm = [0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n)]
    x = x.permute(perm)
    return x.reshape(b, num_pos, c, k)


def unfold_channels_first(
    x: Tensor, kernel_size: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...]
) -> Tensor:
    """Unfold an already padded ``[B, C, *S]`` tensor into ``[B, C * prod(k), L]``.

    What ``torch.nn.functional.unfold`` returns in 2D, for 1D/2D/3D. Copying the patch view
    in this order keeps the input's memory order along the positions (on CPU faster than the
    position-major copy of :func:`unfold_nd` and than ``F.unfold`` itself).
    """
    n = len(kernel_size)
    b, c = x.shape[:2]
    x = _patch_view(x, kernel_size, stride, dilation)
    num_pos = math.prod(x.shape[2 : 2 + n])
    perm = [0, 1, *range(2 + n, 2 + 2 * n), *range(2, 2 + n)]
    return x.permute(perm).reshape(b, c * math.prod(kernel_size), num_pos)


def _conv_padded_input(module: Any, x: Tensor) -> Tensor:
    # `_reversed_padding_repeated_twice` holds the exact (possibly asymmetric, for "same")
    # padding the layer applies, in F.pad order, for every padding mode.
    pad = module._reversed_padding_repeated_twice  # type: ignore[union-attr]
    mode = module.padding_mode  # type: ignore[union-attr]
    if any(pad):
        x = F.pad(x, list(pad), mode="constant" if mode == "zeros" else mode)
    return x


def _conv_activations(module: Any, x: Tensor, **sampling: Any) -> Tensor:
    x = _conv_padded_input(module, x)
    patches = unfold_nd(x, module.kernel_size, module.stride, module.dilation, **sampling)  # type: ignore[arg-type]
    b, num_pos, c, k = patches.shape
    g = module.groups  # type: ignore[union-attr]
    a = patches.reshape(b, num_pos, g, (c // g) * k)
    return _append_one(a) if _has_bias(module) else a


def _conv_rows(module: Any, x: Tensor) -> Tensor:
    x = _conv_padded_input(module, x)
    cols = unfold_channels_first(x, module.kernel_size, module.stride, module.dilation)
    b, n, num_pos = cols.shape
    g = module.groups
    return cols.reshape(b, g, n // g, num_pos).transpose(-1, -2)


def _conv_error_rows(module: Any, dy: Tensor) -> Tensor:
    b, c = dy.shape[:2]
    g = module.groups
    return dy.reshape(b, g, c // g, -1).transpose(-1, -2)


def _conv_errors(module: Any, dy: Tensor) -> Tensor:
    b, c = dy.shape[:2]
    g = module.groups  # type: ignore[union-attr]
    d = dy.reshape(b, c, -1).transpose(1, 2)  # [B, T, C_out]
    return d.reshape(b, d.shape[1], g, c // g)


def _conv_to_params(module: Any, grads: Tensor) -> dict[nn.Parameter, Tensor]:
    shape = module.weight.shape  # type: ignore[union-attr]
    return _split_bias(module, grads, lambda w: w.reshape(w.shape[0], *shape))


def _conv_from_params(module: Any, grads: dict[nn.Parameter, Tensor]) -> Tensor:
    g = module.groups  # type: ignore[union-attr]
    w = grads[module.weight]  # type: ignore[index]
    b, c_out = w.shape[:2]
    w = w.reshape(b, g, c_out // g, -1)
    return _join_bias(module, grads, w)


def _conv_weight_backward(
    module: Any, x: Tensor, dy: Tensor, weight: Tensor, groups: int, bias: bool
) -> tuple[Tensor, Tensor | None]:
    # The convolution's own weight-gradient kernel (oneDNN / cuDNN) on the padded input,
    # without the [B, T, n_a] unfold of the row path; a value, not part of any graph.
    n = len(module.kernel_size)
    with torch.no_grad():
        _, gw, gb = torch.ops.aten.convolution_backward(
            dy,
            _conv_padded_input(module, x),
            weight,
            [weight.shape[0]] if bias else None,
            module.stride,
            [0] * n,
            module.dilation,
            False,
            [0] * n,
            groups,
            [False, True, bias],
        )
    return gw, gb


def _conv_summed_grad(module: Any, x: Tensor, dy: Tensor) -> Tensor:
    # the batch's summed gradient, bias column last
    has_bias = _has_bias(module)
    gw, gb = _conv_weight_backward(module, x, dy, module.weight, module.groups, has_bias)
    g, _, n_g = _conv_dims(module)
    w = gw.reshape(g, n_g, -1)
    return torch.cat([w, gb.reshape(g, n_g, 1)], dim=-1) if gb is not None else w


def _conv_per_sample_grads(module: Any, x: Tensor, dy: Tensor) -> tuple[Tensor, Tensor | None]:
    # Per-sample weight gradients as one grouped convolution's weight gradient: the batch
    # becomes B x groups groups of the input, the weight is repeated per sample.
    b, g, (_, _, n_g) = x.shape[0], module.groups, _conv_dims(module)
    gw, _ = _conv_weight_backward(
        module,
        x.reshape(1, -1, *x.shape[2:]),
        dy.reshape(1, -1, *dy.shape[2:]),
        module.weight.detach().repeat(b, *[1] * (module.weight.dim() - 1)),
        b * g,
        False,
    )
    w = gw.reshape(b, g, n_g, -1)
    bias = dy.flatten(2).sum(-1).reshape(b, g, n_g) if _has_bias(module) else None
    return w, bias


def kernel_per_sample_wins(module: nn.Module) -> bool:
    """Whether a convolution's per-sample gradients are faster from its kernel than unfolded.

    From CPU timings of both (oneDNN): the kernel wins for 3D convolutions with several input
    channels per group; it loses for a 3D convolution on one input channel, whose unfold is
    small, and gave no gain in whole training steps of 2D networks. Shapes only, never data.
    """
    return isinstance(module, nn.Conv3d) and module.in_channels // module.groups > 1


def _conv_dims(module: Any) -> tuple[int, int, int]:
    w = module.weight  # type: ignore[union-attr]
    g = module.groups  # type: ignore[union-attr]
    n_a = math.prod(w.shape[1:]) + int(_has_bias(module))
    return g, n_a, w.shape[0] // g


CONV = register_adapter(nn.Conv1d, nn.Conv2d, nn.Conv3d)(
    LayerAdapter(
        "conv",
        _conv_activations,
        _conv_errors,
        _conv_to_params,
        _conv_from_params,
        _conv_dims,
        rows=_conv_rows,
        error_rows=_conv_error_rows,
        summed_grad=_conv_summed_grad,
        per_sample_grads=_conv_per_sample_grads,
    )
)


# --------------------------------------------------------------------------- ConvTransposeNd


def _convt_activations(module: Any, x: Tensor, **sampling: Any) -> Tensor:
    n = x.dim() - 2
    stride, dil = module.stride, module.dilation  # type: ignore[union-attr]
    k, pad, opad = module.kernel_size, module.padding, module.output_padding  # type: ignore[union-attr]
    b, c = x.shape[:2]
    # Zero insertion: input samples land every `stride` positions.
    size = [(s - 1) * st + 1 for s, st in zip(x.shape[2:], stride)]
    z = x.new_zeros(b, c, *size)
    z[(slice(None), slice(None), *[slice(None, None, st) for st in stride])] = x
    # Re-pad: dil*(k-1)-pad on both sides, plus output_padding on the far side (negative crops).
    pads: list[int] = []
    for d in reversed(range(n)):
        lo = dil[d] * (k[d] - 1) - pad[d]
        pads += [lo, lo + opad[d]]
    z = F.pad(z, pads)
    patches = unfold_nd(z, k, (1,) * n, dil, **sampling)
    _, num_pos, _, kk = patches.shape
    g = module.groups  # type: ignore[union-attr]
    a = patches.reshape(b, num_pos, g, (c // g) * kk)
    return _append_one(a) if _has_bias(module) else a


def _convt_param_grads(module: Any, x: Tensor, dy: Tensor) -> dict[nn.Parameter, Tensor]:
    """Per-sample ConvTranspose gradients on the input grid (no zero insertion).

    ``y[o] = sum_{p, k: o = p*stride - pad + k*dil} W[:, :, k]^T x[p]``, so
    ``dW[ci, co, k] = sum_p x[ci, p] dy[co, p*stride - pad + k*dil]``: for each kernel offset,
    one batched matrix product of the input with a strided view of the (re-padded) output
    error. Cost ``B * T_in * C_in * C_out/g * prod(k)``, ``prod(stride)`` times less than the
    unfold of the zero-inserted input, and no patch tensor is materialised.
    """
    out: dict[nn.Parameter, Tensor] = {}
    b = x.shape[0]
    if _has_bias(module):
        out[module.bias] = dy.reshape(b, dy.shape[1], -1).sum(-1)
    if not module.weight.requires_grad:
        return out
    n = x.dim() - 2
    stride, dil = module.stride, module.dilation
    k, pad, opad = module.kernel_size, module.padding, module.output_padding
    g = module.groups
    c_in, c_out = x.shape[1], dy.shape[1]
    n_in = x.shape[2:]
    # Pad so that index p*stride + k*dil of the padded error is dy[p*stride - pad + k*dil]:
    # `pad` zeros in front; at the back, what the last patch needs beyond dy (crop if negative).
    pads: list[int] = []
    for d in reversed(range(n)):
        pads += [pad[d], pad[d] - opad[d]]
    dyp = F.pad(dy, pads)
    xg = x.reshape(b, g, c_in // g, -1)
    grads = []
    for offset in itertools.product(*(range(kd) for kd in k)):
        view = dyp[
            (
                slice(None),
                slice(None),
                *[
                    slice(o * dl, o * dl + (m - 1) * st + 1, st)
                    for o, dl, m, st in zip(offset, dil, n_in, stride)
                ],
            )
        ]
        view = view.reshape(b, g, c_out // g, -1)
        grads.append(torch.matmul(xg, view.transpose(-1, -2)))  # [B, g, C_in/g, C_out/g]
    w = torch.stack(grads, dim=-1).reshape(b, c_in, c_out // g, *k)
    out[module.weight] = w
    return out


def _convt_to_params(module: Any, grads: Tensor) -> dict[nn.Parameter, Tensor]:
    w_shape = module.weight.shape  # [C_in, C_out/g, *k]
    g = module.groups  # type: ignore[union-attr]
    n = len(w_shape) - 2
    c_in, c_out_g, ks = w_shape[0], w_shape[1], tuple(w_shape[2:])

    def weight(w: Tensor) -> Tensor:
        b = w.shape[0]
        w = w.reshape(b, g, c_out_g, c_in // g, *ks).flip(list(range(4, 4 + n)))
        w = w.transpose(2, 3)  # [B, g, C_in/g, C_out/g, *k]
        return w.reshape(b, c_in, c_out_g, *ks)

    return _split_bias(module, grads, weight)


def _convt_from_params(module: Any, grads: dict[nn.Parameter, Tensor]) -> Tensor:
    w = grads[module.weight]  # type: ignore[index]
    g = module.groups  # type: ignore[union-attr]
    b, c_in, c_out_g = w.shape[:3]
    ks = tuple(w.shape[3:])
    n = len(ks)
    w = w.reshape(b, g, c_in // g, c_out_g, *ks).transpose(2, 3).flip(list(range(4, 4 + n)))
    w = w.reshape(b, g, c_out_g, -1)
    return _join_bias(module, grads, w)


def _convt_dims(module: Any) -> tuple[int, int, int]:
    w = module.weight  # type: ignore[union-attr]
    g = module.groups  # type: ignore[union-attr]
    n_a = (w.shape[0] // g) * math.prod(w.shape[2:]) + int(_has_bias(module))
    return g, n_a, w.shape[1]


CONV_TRANSPOSE = register_adapter(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)(
    LayerAdapter(
        "conv_transpose",
        _convt_activations,
        _conv_errors,
        _convt_to_params,
        _convt_from_params,
        _convt_dims,
        _convt_param_grads,
    )
)
