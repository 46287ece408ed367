r"""Kronecker factor estimation from a probe batch (never from private data).

For every covered layer the probe pass captures the inputs ``a`` and output errors ``delta``
in the adapter layout ``[M, T, G, n]`` and estimates (KFAC-expand, Eschenhagen et al. 2023)

.. math::

    A_g = \frac{1}{M T} \sum_{m,t} a_{m,t,g} a_{m,t,g}^\top, \qquad
    G_g = \frac{1}{M} \sum_{m,t} \delta_{m,t,g} \delta_{m,t,g}^\top,

or (KFAC-reduce) with ``a`` averaged and ``delta`` summed over positions first. ``delta`` is the
gradient of the **sum** of per-sample losses, so it is a per-sample error and ``G`` keeps the
per-sample scale (the authors' code used a mean-reduced loss, which shrinks ``G`` by ``1/M^2``
and lets it collapse below the damping).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor, nn

from dpkfc_med.curvature.adapters import LayerAdapter, adapter_for, supported_layer_types

__all__ = [
    "CapturedLayer",
    "FactorReduction",
    "KroneckerFactors",
    "capture_layers",
    "covered_layers",
    "estimate_factors",
]

LossFn = Callable[[Tensor, Tensor], Tensor]
"""``(outputs, targets) -> per-sample losses [M]``."""


class FactorReduction(str, Enum):
    """How positions (tokens, voxels) enter the factors."""

    EXPAND = "expand"
    REDUCE = "reduce"


@dataclass
class KroneckerFactors:
    """Factors of one layer: full ``[G, n, n]`` or diagonal ``[G, n]`` when too large."""

    a: Tensor
    g: Tensor
    num_samples: int

    @property
    def a_is_diagonal(self) -> bool:
        """Whether ``a`` holds only the diagonal."""
        return self.a.dim() == 2

    @property
    def g_is_diagonal(self) -> bool:
        """Whether ``g`` holds only the diagonal."""
        return self.g.dim() == 2


@dataclass
class CapturedLayer:
    """Inputs and output errors of one layer on one probe chunk, in adapter layout."""

    name: str
    module: nn.Module
    adapter: LayerAdapter
    a: Tensor  # [M, T, G, n_a]
    delta: Tensor  # [M, T, G, n_g]


def covered_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Modules with a registered adapter and a trainable weight, by dotted name."""
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if adapter_for(module) is not None and isinstance(w, Tensor) and w.requires_grad:
            out[name] = module
    return out


@contextlib.contextmanager
def _hooks(layers: dict[str, nn.Module]) -> Iterator[dict[str, list[tuple[Tensor, Tensor]]]]:
    store: dict[str, list[tuple[Tensor, Tensor]]] = {n: [] for n in layers}
    handles = []
    for name, module in layers.items():

        def hook(mod: nn.Module, inputs: tuple[Tensor, ...], output: Tensor, name: str = name):
            store[name].append((inputs[0].detach(), output))

        handles.append(module.register_forward_hook(hook))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def capture_raw(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    loss_fn: LossFn,
    modules: dict[str, nn.Module],
    *,
    need_errors: bool = True,
) -> dict[str, list[tuple[Tensor, Tensor | None]]]:
    """Inputs and output errors ``(x, dy)`` of ``modules`` on one probe chunk.

    Uses ``torch.autograd.grad`` with respect to the module outputs only, so no parameter's
    ``.grad`` (or Opacus ``grad_sample``) is read or written. Without ``need_errors`` only a
    forward pass runs (``dy`` is ``None``): enough for the ``A`` factors.
    """
    if not need_errors:
        with _hooks(modules) as store, torch.no_grad():
            model(inputs)
        return {n: [(x, None) for x, _ in store[n]] for n in modules}
    with _hooks(modules) as store, torch.enable_grad():
        outputs = model(inputs)
        loss = loss_fn(outputs, targets).sum()
        outs = [o for n in modules for (_, o) in store[n]]
        errs = torch.autograd.grad(loss, outs, allow_unused=True) if outs else ()
    result: dict[str, list[tuple[Tensor, Tensor | None]]] = {}
    idx = 0
    for name in modules:
        pairs: list[tuple[Tensor, Tensor | None]] = []
        for x, out in store[name]:
            dy = errs[idx]
            idx += 1
            # A module whose output does not reach the loss has zero error.
            pairs.append((x, torch.zeros_like(out) if dy is None else dy.detach()))
        result[name] = pairs
    return result


def capture_layers(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    loss_fn: LossFn,
    layers: dict[str, nn.Module],
    *,
    need_errors: bool = True,
    max_positions: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[CapturedLayer]:
    """Every covered layer's ``a`` and per-sample ``delta`` (adapter layout) on one chunk.

    A generator, one layer (call) at a time: a layer's unfolded patches are formed only when
    it is reached and its raw input is released once yielded, so a consumer that drops each
    item before taking the next holds one layer's patches at a time, not every layer's (the
    UNet 3D's refresh at 64^3 would otherwise hold all 18 at once).

    Args:
        model: the network (plain module; Opacus hooks must be disabled by the caller).
        inputs: probe inputs ``[M, ...]``.
        targets: probe targets.
        loss_fn: per-sample loss ``[M]``; the sum over samples is differentiated.
        layers: covered layers by name.
        need_errors: run the backward pass (else ``delta`` is an empty tensor).
        max_positions: keep at most this many random positions of each convolution's ``a``
            (``delta`` keeps all positions); ``None`` keeps all.
        generator: draws those positions.
    """
    raw = capture_raw(model, inputs, targets, loss_fn, layers, need_errors=need_errors)
    for name, module in layers.items():
        adapter = adapter_for(module)
        assert adapter is not None  # guaranteed by covered_layers
        pairs = raw.pop(name)
        while pairs:
            x, dy = pairs.pop(0)
            yield from _pieces(name, module, adapter, x, dy, max_positions, generator)
            del x, dy


PATCH_ELEMENTS = 1 << 24
"""Patch elements one captured piece may hold (64 MiB in float32): a call whose probes'
patches exceed it is yielded a few probes at a time (at least one), so the refresh's patch
memory does not grow with ``chunk_size`` (a transposed 3D convolution at 32^3 positions and
1729 inputs has 57 M patch elements per probe at the default ``max_positions``)."""


def _pieces(
    name: str,
    module: nn.Module,
    adapter: LayerAdapter,
    x: Tensor,
    dy: Tensor | None,
    max_positions: int | None,
    generator: torch.Generator | None,
) -> Iterator[CapturedLayer]:
    """One call's ``a``/``delta`` in pieces of probes whose patches fit :data:`PATCH_ELEMENTS`.

    Every piece draws the same positions as a single whole-call draw would (each starts from
    the generator's state before the call; the generator ends as after one draw), so the sum
    of the pieces' outer products equals the whole call's up to float summation order.
    """
    state = generator.get_state() if generator is not None else None
    start, b = 0, x.shape[0]
    step = 1  # the first piece measures one probe's patches
    while start < b:
        gen = generator
        if start > 0 and generator is not None:
            gen = torch.Generator(device=generator.device)
            gen.set_state(state)  # type: ignore[arg-type]
        sl = slice(start, start + step)
        a = adapter.activations(module, x[sl], max_positions=max_positions, generator=gen)
        d = adapter.errors(module, dy[sl]) if dy is not None else a.new_zeros(0)
        if start == 0:
            per_probe = max(a[:1].numel(), 1)
            step = b - 1 if (b - 1) * per_probe <= PATCH_ELEMENTS else PATCH_ELEMENTS // per_probe
            step = max(step, 1)
            start = 1
        else:
            start += step
        yield CapturedLayer(name, module, adapter, a, d)
        del a, d


def _accumulate(
    acc: dict[str, list[Tensor]],
    key: str,
    a: Tensor,
    d: Tensor,
    reduction: FactorReduction,
    max_dim: int,
    dtype: torch.dtype,
) -> None:
    # One chunk's outer products are summed in the model's dtype (a float32 sum of a few
    # thousand terms is accurate to ~1e-6 relative, far below the damping) and only the
    # per-chunk sums are accumulated in `dtype`: float64 einsums cost 2-3x on CPU.
    if reduction is FactorReduction.REDUCE:
        a = a.mean(dim=1, keepdim=True)
        d = d.sum(dim=1, keepdim=True) if d.numel() else d
    t = a.shape[1]
    a_sum = (
        torch.einsum("mtgi,mtgi->gi", a, a)
        if a.shape[-1] > max_dim
        else torch.einsum("mtgi,mtgj->gij", a, a)
    ) / t
    if d.numel() == 0:  # A-only estimation: no backward pass was run
        g_sum = a.new_zeros(0)
    elif d.shape[-1] > max_dim:
        g_sum = torch.einsum("mtgi,mtgi->gi", d, d)
    else:
        g_sum = torch.einsum("mtgi,mtgj->gij", d, d)
    a_sum, g_sum = a_sum.to(dtype), g_sum.to(dtype)
    if key in acc:
        acc[key][0] += a_sum
        acc[key][1] += g_sum
    else:
        acc[key] = [a_sum, g_sum]


def estimate_factors(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    loss_fn: LossFn,
    *,
    layers: dict[str, nn.Module] | None = None,
    reduction: FactorReduction | str = FactorReduction.EXPAND,
    chunk_size: int = 64,
    max_factor_dim: int = 4096,
    dtype: torch.dtype = torch.float64,
    need_g: bool = True,
    max_positions: int | None = None,
    position_seed: int = 0,
) -> dict[str, KroneckerFactors]:
    """Estimate ``A`` and ``G`` for every covered layer from probes.

    Args:
        model: the network at its current (released) parameters.
        inputs: probe inputs ``[M, C, *spatial]`` (or token ids ``[M, T]``).
        targets: probe targets (class ids ``[M]`` or label maps ``[M, *spatial]``).
        loss_fn: per-sample loss ``(outputs, targets) -> [M]``.
        layers: layers to cover (default: :func:`covered_layers`).
        reduction: ``"expand"`` (default) or ``"reduce"`` for weight-shared positions.
        chunk_size: probes per forward/backward pass (bounds memory).
        max_factor_dim: factors with more rows than this are kept diagonal, so a large
            Conv3d fan-in (e.g. 256 channels x 27 taps = 6912) never allocates a dense
            ``n x n`` matrix or an ``O(n^3)`` eigendecomposition.
        dtype: dtype of the returned factors and of the sum over chunks (each chunk's sum
            of outer products is formed in the model's dtype).
        need_g: estimate ``G`` (a backward pass); without it only a forward pass runs and
            ``g`` is an empty tensor (A-only preconditioning).
        max_positions: with ``"expand"``, a convolution's ``A`` averages over at most this
            many positions per probe, drawn uniformly without replacement (an unbiased
            estimate of the all-position mean at a fraction of the memory and time); ``G``
            always sums over all positions. ``None`` uses all positions.
        position_seed: seeds those draws (probes and seeds only: no private data).

    Returns:
        Factors by layer name. A module called several times per forward (weight sharing)
        contributes all calls to one pair of factors.
    """
    reduction = FactorReduction(reduction)
    layers = covered_layers(model) if layers is None else layers
    unsupported = [
        f"{name!r} ({type(m).__name__}) has no curvature adapter; supported types: "
        f"{sorted(t.__name__ for t in supported_layer_types())}. Leave it out of `layers`: "
        "its parameters are then preconditioned by the fallback (identity or diagonal) and "
        "stay inside the clipped norm, or register an adapter with "
        "dpkfc_med.curvature.adapters.register_adapter"
        for name, m in layers.items()
        if adapter_for(m) is None
    ]
    if unsupported:
        raise ValueError("cannot estimate Kronecker factors:\n  " + "\n  ".join(unsupported))
    acc: dict[str, list[Tensor]] = {}
    m_total = inputs.shape[0]
    if m_total == 0:
        raise ValueError("estimate_factors: the probe batch is empty; ask for num_probes >= 1")
    if reduction is FactorReduction.REDUCE:
        max_positions = None  # a per-sample mean over a subset would bias the reduce factor
    gen = torch.Generator().manual_seed(position_seed)
    for start in range(0, m_total, chunk_size):
        x, y = inputs[start : start + chunk_size], targets[start : start + chunk_size]
        for cap in capture_layers(
            model,
            x,
            y,
            loss_fn,
            layers,
            need_errors=need_g,
            max_positions=max_positions,
            generator=gen,
        ):
            _accumulate(acc, cap.name, cap.a, cap.delta, reduction, max_factor_dim, dtype)
            del cap  # before the next layer's patches are formed
    out: dict[str, KroneckerFactors] = {}
    for name in list(acc):  # in place and popped: never two copies of every factor at once
        a_sum, g_sum = acc.pop(name)
        out[name] = KroneckerFactors(a_sum.div_(m_total), g_sum.div_(m_total), m_total)
    return out
