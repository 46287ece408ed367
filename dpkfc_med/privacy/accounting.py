"""The privacy ledger: immutable mechanism events and epsilon from several accountants.

Every noisy step is one Poisson-subsampled Gaussian mechanism with sample rate ``q`` and noise
multiplier ``sigma`` (noise std ``sigma * C`` on a sum of per-unit contributions clipped to
``C``). The ledger records runs of identical steps and answers epsilon at ``delta`` with

* ``prv``: Opacus' PRV accountant (Gopi et al. 2021), upper bound of its estimate -- primary;
* ``rdp``: Opacus' RDP analysis (Mironov 2017) over :data:`RDP_ALPHAS` -- cross-check, and
  cheap enough to answer after every step (:func:`rdp_epsilon`);
* ``pld``: Google's ``dp_accounting`` privacy-loss-distribution accountant -- an independent
  implementation used to cross-check the Opacus figures.

Neighbouring relation: add/remove one privacy unit (a sample, or a patient when units are
patients). Sampling must be Poisson with the recorded rate; the engine guarantees it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis
from opacus.accountants.utils import get_noise_multiplier

from dpkfc_med.utils import atomic_write_bytes, check_choice

__all__ = [
    "Accountant",
    "GaussianSteps",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "calibrate_remaining",
    "epsilon_for",
    "rdp_epsilon",
]

LEDGER_SCHEMA = "dpkfc_med.ledger/1"


class Accountant(str, Enum):
    """Accountants that can answer epsilon."""

    PRV = "prv"
    RDP = "rdp"
    PLD = "pld"


@dataclass(frozen=True)
class GaussianSteps:
    """``steps`` identical Poisson-subsampled Gaussian mechanisms."""

    sample_rate: float
    noise_multiplier: float
    steps: int


RDP_ALPHAS: list[float] = [
    *RDPAccountant.DEFAULT_ALPHAS,
    *range(64, 257, 4),
    *(320, 384, 512, 768, 1024, 2048),
]
"""RDP orders searched: Opacus' defaults (1.1 to 63) extended to 2048. Early in a run (few
steps, large sigma) the best order lies above 63, where Opacus' defaults give a looser bound
and warn "Optimal order is the largest alpha"; any order > 1 gives a valid bound, so a wider
search can only tighten the cross-check."""


def _prv_epsilon(events: list[GaussianSteps], delta: float) -> float:
    prv = PRVAccountant()
    prv.history = [(e.noise_multiplier, e.sample_rate, e.steps) for e in events]
    with _quiet_prv_domain():
        return float(prv.get_epsilon(delta=delta))


@contextlib.contextmanager
def _quiet_prv_domain() -> Iterator[None]:
    """Silence one Opacus-internal warning of the PRV accountant.

    Opacus' PRV accountant bounds its discretisation domain with an RDP bound over Opacus'
    default orders (``opacus/accountants/analysis/prv/domain.py``); for large noise (e.g. the
    upper end of the noise calibration's search) that bound's best order is the largest one and
    Opacus warns "Optimal order is the largest alpha" on every call. The warning is about the
    domain bound, not about the PRV epsilon (whose error bounds Opacus accounts for), so it is
    filtered here and only here; our RDP cross-check searches wider orders (``RDP_ALPHAS``).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        # q = 1 (every unit in every batch): numpy warns on log(1 - q) = -inf inside Opacus'
        # PRV, whose result is still right (its where() discards that branch)
        warnings.filterwarnings(
            "ignore", message="divide by zero encountered in log", category=RuntimeWarning
        )
        yield


def _pld_epsilon(events: list[GaussianSteps], delta: float) -> float:
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    acc = PLDAccountant(value_discretization_interval=1e-4)
    for e in events:
        event = dp_accounting.PoissonSampledDpEvent(
            e.sample_rate, dp_accounting.GaussianDpEvent(e.noise_multiplier)
        )
        acc.compose(event, e.steps)
    return float(acc.get_epsilon(delta))


def epsilon_for(
    events: list[GaussianSteps], delta: float, accountant: Accountant | str = Accountant.PRV
) -> float:
    """Epsilon at ``delta`` spent by ``events`` (0 when nothing was spent)."""
    kind = check_choice("accountant", accountant, Accountant)
    return _epsilon_cached(tuple(e for e in events if e.steps > 0), float(delta), kind)


@functools.lru_cache(maxsize=256)
def _epsilon_cached(events: tuple[GaussianSteps, ...], delta: float, kind: Accountant) -> float:
    # PRV and PLD take ~0.05-3 s per call; runs ask for the same history repeatedly.
    if not events:
        return 0.0
    if any(e.noise_multiplier <= 0 for e in events):
        return math.inf
    if kind is Accountant.PLD:
        return _pld_epsilon(list(events), delta)
    if kind is Accountant.RDP:
        return rdp_epsilon(list(events), delta)
    return _prv_epsilon(list(events), delta)


def rdp_epsilon(events: list[GaussianSteps], delta: float) -> float:
    """RDP epsilon at ``delta`` spent by ``events``, cheap enough to ask after every step.

    Equal, bit for bit, to Opacus' ``RDPAccountant.get_epsilon(delta, alphas=RDP_ALPHAS)`` on
    the same history (this is ``epsilon_for(events, delta, "rdp")``): the RDP of ``k``
    identical steps is ``k`` times that of one step (composition, Mironov 2017), and the
    one-step RDP curve of each ``(q, sigma)`` is computed once and cached, so a call costs one
    sum over the orders instead of the accountant's per-order series (tens of microseconds
    instead of tens of milliseconds).

    Privacy guarantee:
        The value is a valid upper bound on the epsilon of the recorded mechanisms at
        ``delta`` (RDP to (epsilon, delta) conversion of Balle et al. 2020); it is usually
        looser than the PRV accountant's.
    """
    events = [e for e in events if e.steps > 0]
    if not events:
        return 0.0
    if any(e.noise_multiplier <= 0 for e in events):
        return math.inf
    # Same expression as RDPAccountant.get_privacy_spent: sum of compute_rdp(...) * steps.
    rdp = sum([_rdp_one_step(e.sample_rate, e.noise_multiplier) * e.steps for e in events])
    eps, _ = rdp_analysis.get_privacy_spent(orders=RDP_ALPHAS, rdp=rdp, delta=delta)
    return float(eps)


@functools.lru_cache(maxsize=64)
def _rdp_one_step(sample_rate: float, noise_multiplier: float) -> np.ndarray:
    rdp = np.asarray(
        rdp_analysis.compute_rdp(
            q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=RDP_ALPHAS
        )
    )
    rdp.setflags(write=False)  # shared by every caller through the cache
    return rdp


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: Accountant | str = Accountant.PRV,
) -> float:
    """Smallest noise multiplier whose epsilon after ``steps`` is at most ``target_epsilon``.

    Uses Opacus' binary search; the result is re-checked so the plan never exceeds the target.
    """
    kind = check_choice("accountant", accountant, Accountant)
    opacus_kind = "rdp" if kind is Accountant.RDP else "prv"
    with _quiet_prv_domain():
        sigma = get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=opacus_kind,
            epsilon_tolerance=0.005,
        )
    sigma = float(sigma)
    # Opacus stops inside its tolerance band; never hand back a plan above the target.
    while epsilon_for([GaussianSteps(sample_rate, sigma, steps)], delta, kind) > target_epsilon:
        sigma *= 1.01
    return sigma


def calibrate_remaining(
    *,
    spent: list[GaussianSteps],
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: Accountant | str = Accountant.PRV,
    tolerance: float = 0.005,
) -> float:
    """Smallest noise multiplier for ``steps`` more steps so the *composed* ledger stays in budget.

    The epsilon of ``spent`` followed by ``steps`` Poisson-subsampled Gaussian steps at
    ``sample_rate`` is at most ``target_epsilon`` (found by bisection on ``log sigma``; epsilon
    decreases in sigma). Used to re-plan a resumed run over what is left of its budget.

    Raises:
        ValueError: the spent events alone already reach the target (nothing is left to plan).
    """
    kind = check_choice("accountant", accountant, Accountant)
    spent = [e for e in spent if e.steps > 0]
    if not spent:
        return calibrate_noise_multiplier(
            target_epsilon=target_epsilon,
            delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=kind,
        )
    used = epsilon_for(spent, delta, kind)
    if used >= target_epsilon:
        raise ValueError(
            f"the {sum(e.steps for e in spent)} steps already spent cost epsilon {used:.4f} >= "
            f"target {target_epsilon}: no budget is left for more steps"
        )

    def eps(sigma: float) -> float:
        return epsilon_for([*spent, GaussianSteps(sample_rate, sigma, steps)], delta, kind)

    lo, hi = 0.1, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 4
        if hi > 1e4:
            raise ValueError(
                f"no noise multiplier up to 1e4 keeps {steps} more steps within the target"
            )
    while eps(lo) <= target_epsilon and lo > 1e-3:
        hi, lo = lo, lo / 4
    # invariant: eps(hi) <= target < eps(lo)
    while eps(hi) < target_epsilon - tolerance and hi / lo > 1.0 + 1e-4:
        mid = math.sqrt(lo * hi)
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi


class PrivacyLedger:
    """Append-only record of the mechanisms a run executed.

    The ledger is written to disk (atomically) *before* each noisy update is applied, so a
    crash or interrupt can only over-report, never under-report, the budget spent.

    Args:
        delta: the delta at which epsilon is reported.
        path: optional JSON file kept in sync with every record.
    """

    def __init__(self, delta: float, path: str | Path | None = None) -> None:
        if not 0 < delta < 1:
            raise ValueError(f"privacy.delta={delta!r}: must be in (0, 1), e.g. 1e-5")
        self.delta = delta
        self.path = Path(path) if path is not None else None
        self.events: list[GaussianSteps] = []
        self.meta: dict[str, Any] = {}

    @property
    def steps(self) -> int:
        """Noisy steps recorded."""
        return sum(e.steps for e in self.events)

    def record(self, sample_rate: float, noise_multiplier: float, steps: int = 1) -> None:
        """Record ``steps`` more mechanisms (merged with the last run when identical)."""
        last = self.events[-1] if self.events else None
        if last and last.sample_rate == sample_rate and last.noise_multiplier == noise_multiplier:
            self.events[-1] = GaussianSteps(sample_rate, noise_multiplier, last.steps + steps)
        else:
            self.events.append(GaussianSteps(sample_rate, noise_multiplier, steps))
        self.save()

    def prefix(self, steps: int) -> list[GaussianSteps]:
        """The events of the first ``steps`` noisy steps (the ledger as it was after them)."""
        if not 0 <= steps <= self.steps:
            raise ValueError(f"steps={steps}: must be in [0, {self.steps}] (the steps recorded)")
        out: list[GaussianSteps] = []
        left = steps
        for e in self.events:
            if left <= 0:
                break
            take = min(e.steps, left)
            out.append(GaussianSteps(e.sample_rate, e.noise_multiplier, take))
            left -= take
        return out

    def epsilon(
        self, accountant: Accountant | str = Accountant.PRV, delta: float | None = None
    ) -> float:
        """Epsilon spent at ``delta`` (default: the ledger's delta)."""
        return epsilon_for(self.events, self.delta if delta is None else delta, accountant)

    def all_epsilons(self) -> dict[str, float]:
        """Epsilon from every accountant, and the most conservative of them."""
        out = {k.value: self.epsilon(k) for k in Accountant}
        out["max"] = max(out.values())
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON view (schema ``dpkfc_med.ledger/1``)."""
        return {
            "schema": LEDGER_SCHEMA,
            "delta": self.delta,
            "events": [asdict(e) for e in self.events],
            "steps": self.steps,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str | Path | None = None) -> PrivacyLedger:
        """Inverse of :meth:`to_dict`."""
        if data.get("schema") != LEDGER_SCHEMA:
            raise ValueError(
                f"ledger schema {data.get('schema')!r} is not {LEDGER_SCHEMA!r}; "
                "the file was written by another version"
            )
        led = cls(float(data["delta"]), path)
        led.events = [GaussianSteps(**e) for e in data["events"]]
        led.meta = dict(data.get("meta", {}))
        return led

    @classmethod
    def load(cls, path: str | Path) -> PrivacyLedger:
        """Read a ledger file and keep writing to it."""
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")), path)

    def save(self) -> None:
        """Atomically rewrite the ledger file (no-op without a path)."""
        if self.path is None:
            return
        atomic_write_bytes(self.path, json.dumps(self.to_dict(), indent=1).encode())
