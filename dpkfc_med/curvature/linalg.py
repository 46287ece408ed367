r"""Eigendecompositions of probe factors that fall back instead of crashing a run.

Every eigendecomposition of a Kronecker factor (``A``, ``G`` or a ``conv_a="kron"`` part
``A_C`` / ``A_K``) goes through :func:`robust_eigh`. LAPACK's and cuSOLVER's symmetric
solvers occasionally fail to converge on float32 probe factors (clustered or exactly-zero
eigenvalues); a preconditioner refresh is probe-only, so such a failure must degrade the
preconditioner, never end the training run. Each fallback is returned as an
:class:`EighFallback` record (for ``KroneckerPreconditioner.summary()["eig_fallbacks"]``)
and logged as a warning on the ``dpkfc_med`` logger.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["JITTERS", "SAFE_OPERATOR", "EighFallback", "robust_eigh"]

log = logging.getLogger("dpkfc_med")

#: Diagonal jitters tried after the float64 retry, relative to the factor's mean eigenvalue
#: (``tr F / n``), smallest first: each moves the solver off the failing spectrum while the
#: jitter, subtracted again from the eigenvalues, leaves the decomposition itself unchanged.
JITTERS: tuple[float, ...] = (1e-6, 1e-4, 1e-2)

#: :attr:`EighFallback.used` of the last resort (see :func:`robust_eigh`, step 4).
SAFE_OPERATOR = "isotropic (mean eigenvalue times identity)"


@dataclass(frozen=True)
class EighFallback:
    """One factor whose decomposition needed more than ``eigh`` in the configured dtype.

    Attributes:
        layer: dotted module name (``""`` outside a preconditioner build).
        factor: ``"A"``, ``"G"``, or a ``conv_a="kron"`` part of ``A``: ``"A_C"``, ``"A_K"``.
        shape: shape of the decomposed matrix, ``[G, n, n]``.
        dtype: the configured (first tried) dtype, e.g. ``"float32"``.
        failed: the attempts that failed, in order, each ``"<attempt>: <reason>"``.
        used: the attempt that produced the result: ``"float64"``,
            ``"float64 + jitter 1e-06 * mean eigenvalue"``, or :data:`SAFE_OPERATOR`.
    """

    layer: str
    factor: str
    shape: tuple[int, ...]
    dtype: str
    failed: tuple[str, ...]
    used: str

    @property
    def safe_operator(self) -> bool:
        """Whether every decomposition failed and the isotropic last resort was used."""
        return self.used == SAFE_OPERATOR

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable view (one entry of ``summary()["eig_fallbacks"]``)."""
        return {
            "layer": self.layer,
            "factor": self.factor,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "failed": list(self.failed),
            "used": self.used,
            "safe_operator": self.safe_operator,
        }


def _solver_failure(err: RuntimeError) -> bool:
    """Whether ``err`` is a solver failure (not, e.g., out of memory, which must propagate)."""
    if isinstance(err, torch.linalg.LinAlgError):
        return True
    # Some CUDA builds raise a plain RuntimeError for cuSOLVER / MAGMA failures.
    msg = str(err).lower()
    return any(key in msg for key in ("cusolver", "magma", "converge"))


def _reason(err: RuntimeError) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__.lstrip('_')}: {first[:200]}"


def _attempt(matrix: Tensor) -> tuple[tuple[Tensor, Tensor] | None, str]:
    """``torch.linalg.eigh(matrix)`` or ``None`` and why it failed."""
    try:
        evals, evecs = torch.linalg.eigh(matrix)
    except RuntimeError as err:
        if not _solver_failure(err):
            raise
        return None, _reason(err)
    # cuSOLVER has returned NaN instead of raising on ill-conditioned inputs
    if not (bool(torch.isfinite(evals).all()) and bool(torch.isfinite(evecs).all())):
        return None, "non-finite eigenpairs"
    return (evals, evecs), ""


def robust_eigh(
    matrix: Tensor,
    *,
    layer: str = "",
    part: str = "",
    record: list[EighFallback] | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Eigenvalues ``[G, n]`` (ascending) and eigenvectors ``[G, n, n]`` of ``matrix``.

    ``matrix`` is a batch of symmetric factors ``F`` ``[G, n, n]`` in the configured
    ``eig_dtype``. The attempts, in order, until one gives finite eigenpairs:

    1. ``torch.linalg.eigh(matrix)``; when it succeeds the result is exactly that
       (bit-identical to a direct call) and nothing is recorded.
    2. The same in float64 (skipped when ``matrix`` already is float64).
    3. float64 ``eigh`` of :math:`F + \epsilon \bar\lambda I` for each
       :math:`\epsilon` in :data:`JITTERS`, with :math:`\bar\lambda = \operatorname{tr} F / n`
       the mean eigenvalue; :math:`\epsilon \bar\lambda` is subtracted from the eigenvalues
       again, so in exact arithmetic this is ``F``'s decomposition (a multiple of ``I``
       shifts eigenvalues and keeps eigenvectors); only the solver's path differs.
    4. The safe operator: all eigenvalues :math:`\bar\lambda` (0 for a non-finite or
       non-positive trace) and eigenvectors ``I``, the decomposition of
       :math:`\bar\lambda I`, the multiple of the identity nearest to ``F`` (same trace).
       The preconditioner then uses the damped identity scaled by the factor's mean
       diagonal, :math:`((1 + \pi) \bar\lambda)^{-1/2} I`, i.e. no curvature for this factor
       (the DP-SGD direction, up to the scale rule), and the identity for a zero factor:
       finite and positive definite. A non-finite ``matrix`` goes straight to this step.

    Attempts 2-4 apply to the whole batch and return results in ``matrix``'s dtype.

    Privacy guarantee:
        Every factor decomposed here is built from synthetic probes and already released
        parameters only. Which attempt succeeds, the operator it yields and the record of
        it in the privacy report are functions of those public quantities: post-processing,
        no privacy cost, whatever fallback is taken.

    Args:
        matrix: ``[G, n, n]`` symmetric factors (any leading batch shape works).
        layer: dotted module name, for the record and the warning.
        part: which factor (``"A"``, ``"G"``, ``"A_C"``, ``"A_K"``), likewise.
        record: list that receives an :class:`EighFallback` whenever attempt 1 fails.

    Returns:
        ``(eigenvalues [G, n], eigenvectors [G, n, n])``, as ``torch.linalg.eigh``.
    """
    failed: list[str] = []
    finite = bool(torch.isfinite(matrix).all())
    if finite:
        got, why = _attempt(matrix)
        if got is not None:
            return got
        failed.append(f"{_dtype_name(matrix.dtype)}: {why}")
    else:
        # LAPACK may not even terminate on NaN input; nothing to retry
        failed.append("non-finite factor: decompositions skipped")
    m64 = matrix.to(torch.float64)
    n = matrix.shape[-1]
    mean = torch.diagonal(m64, dim1=-2, dim2=-1).sum(-1) / n  # = mean eigenvalue, [G]
    result: tuple[Tensor, Tensor] | None = None
    used = SAFE_OPERATOR
    if finite and matrix.dtype != torch.float64:
        result, why = _attempt(m64)
        used = "float64"
        if result is None:
            failed.append(f"float64: {why}")
    if finite and result is None:
        # relative to the mean eigenvalue, so the jitter means the same for every layer;
        # a zero factor (trace 0) gets an absolute one
        unit = torch.where(mean > 0, mean, torch.ones_like(mean))
        eye = torch.eye(n, dtype=torch.float64, device=matrix.device)
        for eps in JITTERS:
            jitter = eps * unit  # [G]
            got, why = _attempt(m64 + jitter[..., None, None] * eye)
            used = f"float64 + jitter {eps:g} * mean eigenvalue"
            if got is not None:
                result = (got[0] - jitter[..., None], got[1])
                break
            failed.append(f"{used}: {why}")
    if result is None:
        used = SAFE_OPERATOR
        level = torch.where(torch.isfinite(mean), mean.clamp_min(0), torch.zeros_like(mean))
        eye = torch.eye(n, dtype=torch.float64, device=matrix.device)
        shape = matrix.shape
        result = (level[..., None].expand(shape[:-1]).contiguous(), eye.expand(shape).contiguous())
    entry = EighFallback(
        layer, part, tuple(matrix.shape), _dtype_name(matrix.dtype), tuple(failed), used
    )
    if record is not None:
        record.append(entry)
    log.warning(
        "preconditioner %s factor %s %s: eigh fell back to %s after: %s "
        "(probe-only computation; the privacy guarantee is unaffected)",
        layer or "<unnamed>",
        part or "?",
        list(matrix.shape),
        used,
        "; ".join(failed),
    )
    return result[0].to(matrix.dtype), result[1].to(matrix.dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
