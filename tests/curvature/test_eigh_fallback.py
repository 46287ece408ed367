"""Eigendecomposition fallbacks: float64 retry, jitter ladder, isotropic last resort.

``torch.linalg.eigh`` is replaced by a stand-in that raises ``LinAlgError`` as told (for
float32 inputs, or for the first N calls) and records its inputs; every fallback is compared
with a direct float64 computation or with the closed form of the safe operator.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from dpkfc_med.curvature.linalg import JITTERS, SAFE_OPERATOR, robust_eigh
from dpkfc_med.curvature.preconditioner import (
    KroneckerPreconditioner,
    LowRankA,
    PreconditionerConfig,
    inverse_sqrt,
    inverse_sqrt_with_spectrum,
)
from tests.conftest import per_sample_ce, tiny_cnn_2d

REAL_EIGH = torch.linalg.eigh
CONVERGENCE = (
    "linalg.eigh: The algorithm failed to converge because the input matrix is "
    "ill-conditioned or has too many repeated eigenvalues (error code: 3)."
)


class FlakyEigh:
    """Stand-in for ``torch.linalg.eigh`` that fails as told and keeps its inputs."""

    def __init__(self, fail_dtypes=(), fail_first=0, always=False, error=None):
        self.fail_dtypes, self.fail_first, self.always = fail_dtypes, fail_first, always
        self.error = error or torch.linalg.LinAlgError(CONVERGENCE)
        self.inputs: list[torch.Tensor] = []

    def __call__(self, matrix, *args, **kwargs):
        self.inputs.append(matrix.clone())
        if self.always or matrix.dtype in self.fail_dtypes or len(self.inputs) <= self.fail_first:
            raise self.error
        return REAL_EIGH(matrix, *args, **kwargs)


@pytest.fixture
def flaky(monkeypatch):
    def install(**kwargs):
        fake = FlakyEigh(**kwargs)
        monkeypatch.setattr(torch.linalg, "eigh", fake)
        return fake

    return install


def _spd(g, n, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(g, n, n, generator=gen, dtype=torch.float64)
    return (m @ m.transpose(1, 2) / n + 0.01 * torch.eye(n, dtype=torch.float64)).to(dtype)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_robust_eigh_is_eigh_when_it_succeeds(caplog):
    f = _spd(2, 7)
    record = []
    with caplog.at_level(logging.WARNING, logger="dpkfc_med"):
        evals, evecs = robust_eigh(f, layer="l", part="A", record=record)
    want = REAL_EIGH(f)
    assert torch.equal(evals, want[0]) and torch.equal(evecs, want[1])
    assert record == [] and caplog.records == []


def test_float64_retry_gives_the_float64_inverse_root(flaky, caplog):
    """float32 fails: the float64 decomposition, cast back; the same U as a float64 build."""
    f = _spd(2, 9)
    fake = flaky(fail_dtypes=(torch.float32,))
    record = []
    with caplog.at_level(logging.WARNING, logger="dpkfc_med"):
        evals, evecs = robust_eigh(f, layer="conv1", part="G", record=record)
    want = REAL_EIGH(f.double())
    assert evals.dtype == evecs.dtype == torch.float32
    assert torch.equal(evals, want[0].float()) and torch.equal(evecs, want[1].float())
    assert [m.dtype for m in fake.inputs] == [torch.float32, torch.float64]
    (entry,) = record
    assert (entry.layer, entry.factor, entry.used, entry.shape) == (
        "conv1",
        "G",
        "float64",
        (2, 9, 9),
    )
    assert entry.dtype == "float32" and not entry.safe_operator
    assert entry.failed == (f"float32: LinAlgError: {CONVERGENCE}",)
    assert "conv1 factor G" in caplog.text and "fell back to float64" in caplog.text
    # the damped inverse root through the retry against a direct float64 computation
    u32, ev32 = inverse_sqrt_with_spectrum(f, 0.01)
    u64, ev64 = inverse_sqrt_with_spectrum(f.double(), 0.01)
    assert u32.dtype == torch.float32
    # 9e-8 here; float32's own decomposition is 3e-6 away, so this tells the two apart
    assert _rel(u32, u64) < 5e-7, _rel(u32, u64)
    torch.testing.assert_close(ev32.double(), ev64, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("level", range(len(JITTERS)))
def test_jitter_ladder_is_used_and_recorded(flaky, level):
    """float32 and float64 fail, then the first ``level`` jitters: the next one is used."""
    f = _spd(3, 6)
    fake = flaky(fail_first=2 + level)
    record = []
    evals, evecs = robust_eigh(f, layer="fc", part="A", record=record)
    eps = JITTERS[level]
    (entry,) = record
    assert entry.used == f"float64 + jitter {eps:g} * mean eigenvalue"
    assert len(entry.failed) == 2 + level
    assert entry.failed[1].startswith("float64: LinAlgError")
    assert all(s.startswith("float64 + jitter") for s in entry.failed[2:])
    # what was decomposed: F + eps * mean_eig(F) * I, in float64
    mean = torch.diagonal(f.double(), dim1=-2, dim2=-1).mean(-1)
    jittered = fake.inputs[-1]
    assert jittered.dtype == torch.float64
    torch.testing.assert_close(
        jittered - f.double(), eps * mean[:, None, None] * torch.eye(6, dtype=torch.float64)
    )
    # the jitter is subtracted again: F's own decomposition (to float32 rounding)
    lam, vec = REAL_EIGH(f.double())
    torch.testing.assert_close(evals.double(), lam, rtol=1e-6, atol=1e-6)
    rebuilt = (evecs.double() * evals.double()[:, None]) @ evecs.double().transpose(-1, -2)
    assert _rel(rebuilt, f) < 1e-6


def test_jitter_path_inverse_root_matches_float64(flaky):
    f = _spd(1, 8)
    flaky(fail_first=2)
    record = []
    u, _ = inverse_sqrt_with_spectrum(f, 0.1, layer="l", part="A", record=record)
    assert record[0].used.startswith("float64 + jitter 1e-06")
    want = inverse_sqrt(f.double(), 0.1)
    assert _rel(u, want) < 1e-6


def test_last_resort_is_the_damped_isotropic_operator(flaky, caplog):
    """Every eigh fails: U = ((1 + damping) mean_eig)^{-1/2} I, finite and positive definite."""
    f = _spd(2, 5)
    fake = flaky(always=True)
    record = []
    damping = 0.1
    with caplog.at_level(logging.WARNING, logger="dpkfc_med"):
        u, evals = inverse_sqrt_with_spectrum(f, damping, layer="enc.0", part="A", record=record)
    assert len(fake.inputs) == 2 + len(JITTERS)
    mean = torch.diagonal(f.double(), dim1=-2, dim2=-1).mean(-1)
    want = ((1 + damping) * mean)[:, None, None].rsqrt() * torch.eye(5, dtype=torch.float64)
    torch.testing.assert_close(u.double(), want, rtol=1e-6, atol=0)
    assert bool(torch.isfinite(u).all())
    assert bool((torch.linalg.eigvalsh(u.double()) > 0).all())  # positive definite
    torch.testing.assert_close(evals.double(), mean[:, None].expand(2, 5), rtol=1e-6, atol=1e-7)
    (entry,) = record
    assert entry.used == SAFE_OPERATOR and entry.safe_operator
    assert entry.to_dict()["safe_operator"] is True
    assert len(entry.failed) == 2 + len(JITTERS)
    assert SAFE_OPERATOR in caplog.text and "enc.0 factor A" in caplog.text
    # low-rank A: U_A = c I with the same c
    low, ev = LowRankA.from_factor(f, damping, 2, layer="enc.1", record=record)
    torch.testing.assert_close(low.dense().double(), want, rtol=1e-6, atol=1e-7)
    assert record[-1].layer == "enc.1" and record[-1].safe_operator
    # a zero factor still maps to the identity
    assert torch.equal(inverse_sqrt(torch.zeros(1, 3, 3), damping), torch.eye(3)[None])


def test_non_finite_factor_skips_the_solver_and_gets_the_safe_operator(flaky):
    f = _spd(1, 4)
    f[0, 1, 2] = f[0, 2, 1] = float("nan")
    fake = flaky()
    record = []
    u, _ = inverse_sqrt_with_spectrum(f, 0.1, layer="l", part="G", record=record)
    assert fake.inputs == []  # LAPACK is never handed NaN
    assert record[0].failed == ("non-finite factor: decompositions skipped",)
    mean = torch.diagonal(f, dim1=-2, dim2=-1).mean()
    torch.testing.assert_close(u[0], (1.1 * mean).rsqrt() * torch.eye(4))
    low, _ = LowRankA.from_factor(torch.full((1, 6, 6), float("inf")), 0.1, 2)
    assert torch.equal(low.dense(), torch.eye(6)[None])


def test_cusolver_runtime_errors_fall_back_but_other_errors_propagate(flaky):
    f = _spd(1, 4)
    cusolver = RuntimeError("cusolver error: CUSOLVER_STATUS_EXECUTION_FAILED, when calling ...")
    flaky(fail_dtypes=(torch.float32,), error=cusolver)
    record = []
    robust_eigh(f, record=record)
    assert record[0].failed == (
        "float32: RuntimeError: cusolver error: CUSOLVER_STATUS_EXECUTION_FAILED, when calling ...",
    )
    flaky(always=True, error=RuntimeError("boom: not a solver failure"))
    with pytest.raises(RuntimeError, match="boom"):
        robust_eigh(f)


def _probes(n=32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


CONFIGS = {
    "ag-full": dict(factors="ag", rank_a=None),
    "ag-kron": dict(factors="ag", conv_a="kron"),
    "a-lowrank": dict(factors="a", rank_a=8),
}
PARTS = {
    "ag-full": {(n, p) for n in ("0", "2", "6") for p in ("A", "G")},
    "ag-kron": {("0", "A_C"), ("0", "A_K"), ("2", "A_C"), ("2", "A_K"), ("6", "A")}
    | {(n, "G") for n in ("0", "2", "6")},
    "a-lowrank": {("0", "A"), ("2", "A"), ("6", "A")},
}


@pytest.mark.parametrize("kind", CONFIGS)
def test_from_probes_survives_an_eigh_that_always_fails(kind, flaky, caplog):
    """A whole build with no working eigh: finite operators, and the summary lists each."""
    torch.manual_seed(0)
    net = tiny_cnn_2d()
    x, y = _probes()
    cfg = PreconditionerConfig(calibration_samples=8, **CONFIGS[kind])
    assert (
        KroneckerPreconditioner.from_probes(net, x, y, per_sample_ce, cfg).summary()[
            "eig_fallbacks"
        ]
        == []
    )
    flaky(always=True)
    with caplog.at_level(logging.WARNING, logger="dpkfc_med"):
        pre = KroneckerPreconditioner.from_probes(net, x, y, per_sample_ce, cfg)
    summary = pre.summary()
    fallbacks = summary["eig_fallbacks"]
    assert {(r["layer"], r["factor"]) for r in fallbacks} == PARTS[kind]
    assert all(r["safe_operator"] and r["used"] == SAFE_OPERATOR for r in fallbacks)
    assert all(r["dtype"] == "float32" and len(r["failed"]) == 5 for r in fallbacks)
    assert len([r for r in caplog.records if "eigh fell back" in r.getMessage()]) == len(fallbacks)
    json.dumps(summary, allow_nan=False, default=str)  # the report writer's rules
    # every operator is c I (positive c), and transformed gradients stay finite
    for block in pre.blocks.values():
        ops = [block.u_a, block.u_g]
        if block.a_kron is not None:
            ops += [block.a_kron.u_c[None], block.a_kron.u_k[None]]
        if block.a_low is not None:
            ops.append(block.a_low.dense())
        for u in (u for u in ops if u is not None):
            assert bool(torch.isfinite(u).all()), block.name
            eye = torch.eye(u.shape[-1]) * u[:, :1, :1]
            torch.testing.assert_close(u, eye, msg=block.name)
            assert bool((u[:, 0, 0] > 0).all()), block.name
    assert pre.info["scale"] > 0 and torch.isfinite(torch.tensor(pre.info["scale"]))
    grads = {p: torch.randn(4, *p.shape) for p in net.parameters()}
    assert all(bool(torch.isfinite(g).all()) for g in pre.transform_param_grads(grads).values())


def _dense_a(block):
    return block.a_low.dense() if block.a_low is not None else block.u_a


def test_from_probes_float64_retry_matches_a_float64_build(flaky):
    """eig_dtype float32 failing everywhere gives the operators of eig_dtype float64."""
    torch.manual_seed(0)
    net = tiny_cnn_2d()
    x, y = _probes()
    kw = dict(factors="ag", calibration_samples=8, rank_a=8, scaling="none")
    direct = KroneckerPreconditioner.from_probes(
        net, x, y, per_sample_ce, PreconditionerConfig(eig_dtype="float64", **kw)
    )
    flaky(fail_dtypes=(torch.float32,))
    retried = KroneckerPreconditioner.from_probes(
        net, x, y, per_sample_ce, PreconditionerConfig(eig_dtype="float32", **kw)
    )
    fallbacks = retried.summary()["eig_fallbacks"]
    assert {(r["layer"], r["factor"]) for r in fallbacks} == PARTS["ag-full"]
    assert {r["used"] for r in fallbacks} == {"float64"}
    for name, want in direct.blocks.items():
        got = retried.blocks[name]
        # float32 rounding of the same float64 eigenpairs (about 1e-7)
        assert _rel(_dense_a(got), _dense_a(want)) < 1e-6, name
        assert _rel(got.u_g, want.u_g) < 1e-6, name


def test_identity_preconditioner_summary_has_no_fallbacks():
    assert KroneckerPreconditioner.identity(tiny_cnn_2d()).summary()["eig_fallbacks"] == []
