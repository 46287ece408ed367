"""The cost benchmark's timing: every method set up on one model, stepped round-robin.

A step is ``zero_grad + forward + loss + backward + optimizer.step`` on one fixed batch; the
DP-KFC refresh is timed on its own and, with fewer probes than the default, extrapolated to
the default probe count (see :mod:`dpkfc_bench.cost`).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_bench import cost_cases as cases
from dpkfc_bench.cost_cases import (
    CLIPPING,
    DELTA,
    LR,
    MAX_GRAD_NORM,
    METHODS,
    NOISE_MULTIPLIER,
    OPACUS_MODES,
    Case,
    PerSampleCE,
    default_kfc_config,
    probe_loss,
    summed_train_loss,
    train_loss,
)
from dpkfc_bench.harness import error_text


@dataclass
class Runner:
    """One method set up on its own copy of the model."""

    method: str
    step: Callable[[], None]
    optimizer: Any
    engine: Any = None
    setup_s: float = 0.0

    def release(self) -> None:
        """Drop per-sample gradients and grads held since the last step (outside timing)."""
        self.optimizer.zero_grad(set_to_none=True)


def setup_method(
    method: str,
    case: Case,
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    shape: tuple[int, ...],
    seed: int,
    kfc: dict[str, Any] | None = None,
    precision: str = "float32",
) -> Runner:
    """Wrap ``model`` (modified in place) for ``method`` and return its step function.

    Args:
        kfc: ``PreconditionerConfig`` field overrides for dp-kfc (default: none).
        precision: ``training.precision`` of the forward pass, for every method alike
            (``bf16``: bfloat16 autocast; Opacus' hooks then keep bfloat16 per-sample
            gradients, ours cast them to float32).
    """
    from dpkfc_med.engines.precision import check_precision, forward_autocast

    prec = check_precision(precision, x.device)
    t0 = time.perf_counter()
    batch = x.shape[0]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn: Callable[[Tensor, Tensor], Any] = train_loss
    # The engines see a synthetic dataset whose expected batch size is the benchmark batch.
    loader = DataLoader(TensorDataset(x.cpu(), y.cpu()), batch_size=batch)
    engine: Any = None
    common: dict[str, Any] = {
        "module": model,
        "optimizer": opt,
        "data_loader": loader,
        "noise_multiplier": NOISE_MULTIPLIER,
        "max_grad_norm": MAX_GRAD_NORM,
    }
    if method == "nonprivate":
        net, popt = model, opt
    elif method in OPACUS_MODES:
        from opacus import PrivacyEngine as OpacusEngine

        engine = OpacusEngine(accountant="prv")
        noise = torch.Generator(device=x.device).manual_seed(seed)
        if method == "opacus":
            net, popt, _ = engine.make_private(**common, noise_generator=noise)
        else:  # Opacus' two backward passes run inside the criterion's backward()
            net, popt, loss_fn, _ = engine.make_private(
                **common, criterion=PerSampleCE(), grad_sample_mode="ghost", noise_generator=noise
            )
    elif method == "dp-sgd" or method.startswith("dp-kfc"):
        from dpkfc_med.privacy.engine import PrivacyEngine

        engine = PrivacyEngine(seed=seed)
        # as the training loop: backward on the sum of per-sample losses, update averaged over
        # the expected batch (exact per-sample errors under bf16, whatever the batch size)
        kwargs: dict[str, Any] = {
            "clipping": CLIPPING.get(method, "auto"),
            "backward_reduction": "sum",
        }
        loss_fn = summed_train_loss
        if method.startswith("dp-kfc"):
            from dpkfc_med.curvature.preconditioner import PreconditionerConfig
            from dpkfc_med.probes import ImageProbeSource

            kwargs |= {
                "probe_source": ImageProbeSource(
                    shape, channels=case.in_channels, num_classes=case.num_classes, task=case.task
                ),
                "probe_loss": probe_loss,
                "preconditioner": PreconditionerConfig(**(kfc or {})),
                "refresh_every": 0,  # refreshes are timed separately (see module docstring)
                "probe_seed": seed,
            }
        net, popt, _ = engine.make_private(
            **common, delta=DELTA, method="dp-sgd" if method == "dp-sgd" else "dp-kfc", **kwargs
        )
        if x.is_cuda:
            # The engine seeds a CPU generator, but Opacus draws the noise on the parameters'
            # device with it (torch.normal refuses a CPU generator for CUDA tensors).
            popt.generator = torch.Generator(device=x.device).manual_seed(seed)
    else:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")

    def step() -> None:
        popt.zero_grad(set_to_none=True)
        with forward_autocast(prec, x.device):
            out = net(x)
        loss = loss_fn(out.float(), y)
        loss.backward()
        popt.step()

    return Runner(method, step, popt, engine, time.perf_counter() - t0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def _summary(times: list[float]) -> dict[str, Any]:
    qs = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return {
        "median_ms": 1e3 * statistics.median(times),
        "mean_ms": 1e3 * statistics.fmean(times),
        "p10_ms": 1e3 * qs[0],
        "p90_ms": 1e3 * qs[-1],
        "min_ms": 1e3 * min(times),
        "n": len(times),
        "all_ms": [round(1e3 * t, 4) for t in times],
    }


# ----------------------------------------------------------------------------- timing


def measure_timing(
    case: Case,
    *,
    batch: int,
    shape: tuple[int, ...],
    device: str | torch.device = "cpu",
    methods: tuple[str, ...] = METHODS,
    warmup: int = 2,
    rounds: int = 5,
    steps: int = 5,
    refresh_reps: int = 3,
    seed: int = 0,
    kfc: dict[str, Any] | None = None,
    extrapolate: bool = True,
    profile_steps: int = 0,
    precision: str = "float32",
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Time every method alternately on one model and time the dp-kfc refresh.

    Args:
        case: the model.
        batch: batch size (all methods).
        shape: spatial input shape.
        device: ``"cpu"`` or ``"cuda"``.
        methods: methods to measure.
        warmup: untimed steps per method before the rounds.
        rounds: round-robin rounds.
        steps: consecutive timed steps per method and round.
        refresh_reps: timed ``refresh_preconditioner()`` calls after the rounds.
        seed: model, batch, noise and probe seed.
        kfc: ``PreconditionerConfig`` overrides for dp-kfc.
        extrapolate: extrapolate the refresh time to the default number of probes.
        profile_steps: profile this many opacus and dp-kfc steps (0: no profile).
        precision: the forward pass's ``training.precision`` (every method).
        log: progress printer.

    Returns:
        ``{"methods": {method: timing summary}, "errors": {method: message}, "refresh":
        {...} or None, ...}``.
    """
    device = torch.device(device)
    base, built_by = cases.build_network(case, seed, shape)
    base = base.to(device)
    x, y = cases.make_batch(case, batch, shape, seed)
    x, y = x.to(device), y.to(device)
    runners: dict[str, Runner] = {}
    errors: dict[str, str] = {}
    for m in methods:
        try:
            runners[m] = setup_method(
                m, case, copy.deepcopy(base), x, y, shape, seed, kfc, precision
            )
            log(f"  set up {m} in {runners[m].setup_s:.2f} s")
        except Exception as exc:  # noqa: BLE001 - record and measure the other methods
            errors[m] = error_text(exc)
            log(f"  set up {m} FAILED: {errors[m]}")
    active = tuple(m for m in methods if m in runners)
    for m in active:
        try:
            for _ in range(warmup):
                runners[m].step()
            runners[m].release()
        except Exception as exc:  # noqa: BLE001
            errors[m] = error_text(exc)
            log(f"  warm-up of {m} FAILED: {errors[m]}")
    active = tuple(m for m in active if m not in errors)
    sync(device)
    times: dict[str, list[float]] = {m: [] for m in active}
    order_log = []
    for r in range(rounds):
        order = active[r % len(active) :] + active[: r % len(active)] if active else ()
        order_log.append(list(order))
        for m in order:
            for _ in range(steps):
                times[m].append(timed(runners[m].step, device))
            runners[m].release()
        log(
            f"  round {r + 1}/{rounds}: "
            + ", ".join(f"{m} {1e3 * statistics.median(times[m]):.1f} ms" for m in active)
        )
    out: dict[str, Any] = {
        "model": case.key,
        "built_by": built_by,
        "params": sum(p.numel() for p in base.parameters()),
        "batch": batch,
        "shape": list(shape),
        "warmup": warmup,
        "rounds": rounds,
        "steps_per_round": steps,
        "round_orders": order_log,
        "methods": {m: _summary(times[m]) for m in active},
        "errors": errors,
        "setup_s": {m: runners[m].setup_s for m in runners},
        "refresh": None,
    }
    if "dp-kfc" in runners:
        try:
            out["refresh"] = _measure_refresh(
                runners["dp-kfc"].engine, refresh_reps, device, log, extrapolate
            )
        except Exception as exc:  # noqa: BLE001
            errors["dp-kfc refresh"] = error_text(exc)
            log(f"  refresh FAILED: {errors['dp-kfc refresh']}")
    if profile_steps > 0:
        out["profile"] = {
            m: _profile(runners[m], profile_steps, device)
            for m in ("opacus", "dp-kfc")
            if m in active
        }
        if "dp-kfc" in active:
            out["profile"]["dp-kfc refresh"] = _profile_refresh(runners["dp-kfc"].engine, device)
    return out


def _measure_refresh(
    engine: Any, reps: int, device: torch.device, log: Callable, extrapolate: bool = True
) -> dict:
    """Time ``engine.refresh_preconditioner()``; the first (cold) one ran in make_private."""
    initial = dict(engine.refreshes[0])
    info0 = engine.preconditioner.info
    calls = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        pre = engine.refresh_preconditioner()
        sync(device)
        total = time.perf_counter() - t0
        info = pre.info
        calls.append(
            {
                "seconds": total,
                "factors_s": info["seconds_factors"],
                "inverse_s": info["seconds_inverse"],
                "calibration_s": info["seconds_total"]
                - info["seconds_factors"]
                - info["seconds_inverse"],
                "probe_sampling_and_attach_s": total - info["seconds_total"],
            }
        )
        log(f"  refresh {len(calls)}/{reps}: {total:.2f} s")
    pre = engine.preconditioner
    cfg = pre.config
    cov = pre.coverage()
    out: dict[str, Any] = {
        "initial_s": initial["seconds"],
        "initial_parts_s": {
            "factors": info0["seconds_factors"],
            "inverse": info0["seconds_inverse"],
            "total_in_from_probes": info0["seconds_total"],
        },
        "calls": calls,
        "median_s": statistics.median(c["seconds"] for c in calls) if calls else initial["seconds"],
        "factors": getattr(cfg.factors, "value", cfg.factors),
        "num_probes": cfg.num_probes,
        "chunk_size": cfg.chunk_size,
        "max_factor_dim": cfg.max_factor_dim,
        "eig_dtype": cfg.eig_dtype,
        "covered_layers": len(pre.blocks),
        "fallback_params": len(pre.fallbacks),
        "full_factors": sum(int(r["A"] == "full") + int(r["G"] == "full") for r in cov),
        "diagonal_factors": sum(int(r["A"] == "diagonal") + int(r["G"] == "diagonal") for r in cov),
        "largest_full_factor": max(
            [r["A_dim"] for r in cov if r["A"] == "full"]
            + [r["G_dim"] for r in cov if r["G"] == "full"]
            or [0]
        ),
    }
    # Extrapolate to the default number of probes: probe sampling and the factor passes
    # scale with the probes; the inverse roots do not; calibration uses min(16, probes).
    default = default_kfc_config()
    m_def, m_used = int(default["num_probes"]), int(cfg.num_probes)
    out["median_s_default_probes"] = out["median_s"]
    out["extrapolated"] = False
    if m_used != m_def and extrapolate:
        last = calls[-1] if calls else None
        if last is not None:
            c_def = min(int(default["calibration_samples"]), m_def)
            c_used = min(int(cfg.calibration_samples), m_used)
            out["median_s_default_probes"] = (
                (last["factors_s"] + last["probe_sampling_and_attach_s"]) * m_def / m_used
                + last["inverse_s"]
                + last["calibration_s"] * c_def / max(c_used, 1)
            )
            out["extrapolated"] = True
    return out


def _profile(runner: Runner, steps: int, device: torch.device, rows: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    runner.step()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            runner.step()
        sync(device)
    runner.release()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=50)
    return f"{runner.method}: {steps} profiled steps, sorted by {key}\n{table}"


def _profile_refresh(engine: Any, device: torch.device, rows: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        engine.refresh_preconditioner()
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=50)
    return f"dp-kfc refresh_preconditioner(), sorted by {key}\n{table}"
