"""Cost of private training: step time and peak memory of DP-KFC vs Opacus DP-SGD.

Run from the repository root::

    python -m dpkfc_bench cost --quick           # smoke size, < 3 min on 2 CPU cores
    python -m dpkfc_bench cost                   # full size (batch 256 / 64 / 8), CPU
    python -m dpkfc_bench cost --device cuda     # full size on one GPU (dpkfc_bench/gpu_cost.sh)

Options: ``--models small_cnn,densenet121_2d,unet_3d``, ``--steps N`` (timed steps per method
and round), ``--rounds R``, ``--warmup W``, ``--threads T`` (default 2), ``--batch-sizes
256,64,8`` (one per model), ``--kfc-probes M`` / ``--kfc-chunk K`` (override the dp-kfc
probe budget), ``--profile`` (torch.profiler tables of the opacus and dp-kfc steps and of one
refresh), ``--no-memory``, ``--out FILE.json``, ``--md FILE.md``. Results go to
``dpkfc_bench/results/cost_{device}{_quick}.json`` and a Markdown table next to it.

What is measured, per model (same initial weights, same fixed batch, same batch size):

* ``nonprivate``: plain ``torch.optim.SGD`` step;
* ``opacus``: ``opacus.PrivacyEngine.make_private`` (hooks mode, flat clipping; our code is
  not involved);
* ``dp-sgd``: ``dpkfc_med.privacy.engine.PrivacyEngine`` with ``method="dp-sgd"``;
* ``opacus-ghost``: the same with ``grad_sample_mode="ghost"`` (Opacus' fast gradient
  clipping: per-sample norms in the first backward pass, ghost norms for Linear layers, the
  clipped sum from a second backward pass of the reweighted loss), with a per-sample
  cross-entropy criterion;
* ``dp-kfc``: the same engine with ``method="dp-kfc"``, the default ``PreconditionerConfig``
  and an ``ImageProbeSource`` with the data's spatial shape, channels and classes;
  ``dp-sgd`` and ``dp-kfc`` use the product's default ``clipping="auto"``,
  ``dp-kfc-per_sample`` and ``dp-kfc-ghost`` force the other two modes.

A step is ``zero_grad + forward + loss + backward + optimizer.step`` on one pre-generated
batch (the Poisson loaders returned by the engines are bypassed so that the batch size is
constant; the engines are still built with a ``DataLoader`` over a synthetic ``TensorDataset``
whose expected batch size is the benchmark batch). The dp-kfc engine is built with
``refresh_every=0`` so that no refresh happens inside a timed step; the refresh
(``engine.refresh_preconditioner()``) is timed separately and amortised over the engine's
default refresh period.

Timing: after ``warmup`` untimed steps per method, ``rounds`` round-robin rounds each time
``steps`` consecutive steps of every method (the order rotates every round), so that drift of
the machine load hits all methods alike; each step is timed on its own
(``torch.cuda.synchronize`` before and after on GPU); the median over all timed steps is
reported. The load average at start and end is recorded; on a CPU shared with other jobs
(load above the number of cores) two torch threads wait on each other at every parallel
region and steps measured 5-10x slower than with one thread, so use ``--threads 1`` there.

Peak memory: every (model, method) pair runs in a fresh process. One child interpreter
(``python -m dpkfc_bench cost --_memory-child SPEC``) imports the libraries once and forks a
new process per pair (Linux; elsewhere one child interpreter per pair). That process builds
model and batch, sets the method up (for dp-kfc including the initial refresh, from one
chunk of probes: same per-chunk peak, fewer chunks) and runs a few steps. On CUDA the number
is ``torch.cuda.max_memory_allocated`` over the steps (peak statistics reset after set-up).
On CPU it is the peak resident set size during the steps (``VmHWM`` of ``/proc/self/status``,
reset through ``/proc/self/clear_refs`` after set-up) minus the resident set size right after
model and batch construction (after ``gc`` and ``malloc_trim``); without ``clear_refs``,
``getrusage().ru_maxrss`` is used and the number is an upper bound. The set-up peak is
reported separately.

Deviations from the default preconditioner are recorded per model and flagged in the tables:
``chunk_size`` is lowered when the estimated refresh memory (unfolded patches of every covered
layer of one chunk, float32 plus the float64 copy of the largest) would not fit in 30% of the
available memory (result-neutral: the factors are the same sums); ``--quick`` and CPU full mode
use fewer probes (and, in quick mode, a smaller ``max_factor_dim``) for DenseNet and UNet so
that the run fits its time budget. With fewer probes than the default, the default refresh
time is extrapolated (probe sampling and factor passes scale with the number of probes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from dpkfc_bench import harness
from dpkfc_bench.cost_cases import (
    CASES,
    DEFAULT_MODELS,
    LR,
    MAX_GRAD_NORM,
    METHODS,
    NOISE_MULTIPLIER,
    REFRESH_MEMORY_FRACTION,
    STEP_MEMORY_FRACTION,
    TARGETS,
    Case,
    auto_refresh_plan,
    build_network,
    default_kfc_config,
    default_refresh_every,
    layer_footprint,
    make_batch,
    refresh_bytes_per_probe,
    step_bytes_per_sample,
    transform_macs,
)
from dpkfc_bench.cost_markdown import analyse, render_markdown
from dpkfc_bench.cost_memory import measure_memory, memory_child_main, trim
from dpkfc_bench.cost_timing import measure_timing, setup_method, timed
from dpkfc_med.curvature.families import Family
from dpkfc_med.engines.precision import Precision


def _calibrate_batch(
    case: Case,
    batch: int,
    shape: tuple[int, ...],
    device: torch.device,
    seed: int,
    max_step_s: float,
    log: Callable[[str], None],
) -> tuple[int, float, list[dict[str, Any]]]:
    """Halve the batch until an Opacus step takes at most ``max_step_s`` (CPU full mode)."""
    trace = []
    while True:
        model, _ = build_network(case, seed, shape)
        x, y = make_batch(case, batch, shape, seed)
        runner = setup_method(
            "opacus", case, model.to(device), x.to(device), y.to(device), shape, seed
        )
        runner.step()
        t = timed(runner.step, device)
        trace.append({"batch": batch, "opacus_step_s": t})
        log(f"  calibration: opacus step at batch {batch}: {t:.2f} s")
        del runner, model, x, y
        trim()
        if t <= max_step_s or batch <= 1:
            return batch, t, trace
        batch = max(1, batch // 2)


@dataclass
class Plan:
    """What one model's measurement will use."""

    shape: tuple[int, ...]
    batch_requested: int
    batch: int
    kfc: dict[str, Any]
    notes: list[str]
    batch_note: str = ""
    calibration: list[dict[str, Any]] = field(default_factory=list)
    footprint: dict[str, Any] = field(default_factory=dict)
    refresh_plan: dict[str, Any] = field(default_factory=dict)
    steps: int = 8
    rounds: int = 5
    warmup: int = 3


def plan_model(
    case: Case, args: argparse.Namespace, device: torch.device, batch_override: int | None, log
) -> Plan:
    """Shape, batch, dp-kfc overrides, steps and rounds for one model (see module docstring)."""
    quick = args.quick
    setting = case.quick if quick else case.full
    kfc = dict(setting.kfc)
    notes = [setting.why] if setting.why else []
    if device.type == "cpu" and not quick and case.cpu_full_kfc:
        kfc.update(case.cpu_full_kfc)
        notes.append(case.cpu_full_why)
    if args.kfc_probes is not None:
        kfc["num_probes"] = args.kfc_probes
        notes.append("--kfc-probes given")
    if args.kfc_family is not None:
        kfc["family"] = args.kfc_family
        notes.append(f"--kfc-family {args.kfc_family} given")
    if args.kfc_conv_a is not None:
        kfc["conv_a"] = args.kfc_conv_a
        notes.append(f"--kfc-conv-a {args.kfc_conv_a} given")
    if args.kfc_rank_a != -1:
        kfc["rank_a"] = args.kfc_rank_a
        notes.append(f"--kfc-rank-a {args.kfc_rank_a} given")
    requested = batch_override or setting.batch
    plan = Plan(setting.shape, requested, requested, kfc, notes)
    plan.rounds = args.rounds if args.rounds is not None else (3 if quick else 5)
    plan.steps = args.steps if args.steps is not None else (2 if quick else 8)
    plan.warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    rows = layer_footprint(case, setting.shape, args.seed)
    per_probe = refresh_bytes_per_probe(
        rows, kfc.get("max_positions", default_kfc_config()["max_positions"])
    )
    per_sample = step_bytes_per_sample(rows)
    avail = harness.available_bytes(device)
    default_chunk = int(default_kfc_config()["chunk_size"])
    chunk = min(default_chunk, int(kfc.get("num_probes", default_kfc_config()["num_probes"])))
    if args.kfc_chunk is not None:
        kfc["chunk_size"] = chunk = args.kfc_chunk
        notes.append("--kfc-chunk given")
    elif avail is not None and chunk * per_probe > REFRESH_MEMORY_FRACTION * avail:
        while chunk > 1 and chunk * per_probe > REFRESH_MEMORY_FRACTION * avail:
            chunk //= 2
        kfc["chunk_size"] = chunk
        notes.append(
            f"chunk_size lowered to {chunk} because one probe needs about "
            f"{per_probe / 2**30:.2f} GiB in the refresh (activations, errors, one layer's patches) "
            f"and {REFRESH_MEMORY_FRACTION:.0%} of the {avail / 2**30:.1f} GiB available allows "
            f"{int(REFRESH_MEMORY_FRACTION * avail // max(per_probe, 1))} (result-neutral)"
        )
    plan.footprint = {
        "refresh_bytes_per_probe_est": per_probe,
        "step_unfold_bytes_per_sample_est": per_sample,
        "available_bytes_at_plan": avail,
        "largest_layer": max(rows, key=lambda r: r["T"] * r["G"] * (r["n_a"] + r["n_g"]))
        if rows
        else None,
        "macs_per_sample": transform_macs(rows, kfc),
    }
    if device.type == "cpu" and not quick and batch_override is None:
        if avail is not None:
            while plan.batch > 1 and 3 * plan.batch * per_sample > STEP_MEMORY_FRACTION * avail:
                plan.batch //= 2
            if plan.batch != requested:
                plan.batch_note = (
                    f"largest unfolded layer input {per_sample / 2**20:.0f} MiB per sample; "
                    f"batch halved to fit {STEP_MEMORY_FRACTION:.0%} of available memory"
                )
        batch, t_step, plan.calibration = _calibrate_batch(
            case, plan.batch, setting.shape, device, args.seed, args.max_step_s, log
        )
        if batch != plan.batch:
            plan.batch_note = "; ".join(
                s
                for s in (
                    plan.batch_note,
                    f"an Opacus step at batch {plan.batch} took > {args.max_step_s:g} s on this "
                    "CPU; halved until it did not",
                )
                if s
            )
            plan.batch = batch
        per_step = max(t_step, 1e-3) * 1.3  # dp-kfc is somewhat slower than opacus
        if args.warmup is None and per_step > 2.0:
            plan.warmup = 1  # slow steps: one warm-up step already reaches steady state
        if args.steps is None and args.rounds is None:
            while len(METHODS) * (plan.warmup + plan.rounds * plan.steps) * per_step > (
                args.model_budget_s
            ) and (plan.steps > 1 or plan.rounds > 3):
                if plan.steps > 1:
                    plan.steps -= 1
                else:
                    plan.rounds -= 1
    plan.refresh_plan = auto_refresh_plan(rows, kfc, plan.batch, extrapolated=not quick)
    return plan


def _methods(args: argparse.Namespace) -> tuple[str, ...]:
    """The methods to measure (``--methods``), in the table's order."""
    chosen = [m.strip() for m in args.methods.split(",")]
    unknown = sorted(set(chosen) - set(METHODS))
    if unknown:
        raise SystemExit(
            f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}"
        )
    return tuple(m for m in METHODS if m in chosen)


def _memory_job(case: Case, plan: Plan, method: str, args: argparse.Namespace) -> dict:
    kfc = dict(plan.kfc)
    if method.startswith("dp-kfc"):
        # One chunk of probes: the refresh's peak is per chunk, and the step does not depend
        # on how many probes built the preconditioner.
        default = default_kfc_config()
        chunk = int(kfc.get("chunk_size", default["chunk_size"]))
        kfc["num_probes"] = min(int(kfc.get("num_probes", default["num_probes"])), chunk)
    return {
        "model": case.key,
        "method": method,
        "batch": plan.batch,
        "shape": list(plan.shape),
        "seed": args.seed,
        "device": args.device,
        "threads": args.threads,
        "steps": args.memory_steps or (1 if args.quick else 2),
        "kfc": kfc,
        "precision": args.precision,
    }


def run(args: argparse.Namespace, save: Callable[[dict[str, Any]], None] | None = None) -> dict:
    """Run the benchmark described by the parsed CLI arguments."""
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        if not args.silent:
            print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    quick = args.quick
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CASES]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {', '.join(CASES)}")
    overrides: list[int | None] = (
        [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else [None] * len(keys)
    )
    if len(overrides) != len(keys):
        raise SystemExit("--batch-sizes needs one batch size per model")
    warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    refresh_reps = args.refresh_reps
    if refresh_reps is None:
        refresh_reps = 1 if quick or device.type == "cpu" else 3
    refresh_every = default_refresh_every()
    default_cfg = default_kfc_config()
    result: dict[str, Any] = {
        "benchmark": "cost",
        "command": args.command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": 0.0,
        "config": {
            "quick": quick,
            "device": str(device),
            "precision": args.precision,
            "threads": args.threads,
            "seeds": {
                "model_init": args.seed,
                "batch": args.seed + 1000,
                "noise": args.seed,
                "probes": args.seed,
            },
            "warmup": warmup,
            "refresh_reps": refresh_reps,
            "memory_steps": args.memory_steps or (1 if quick else 2),
            "methods": list(METHODS),
            "noise_multiplier": NOISE_MULTIPLIER,
            "max_grad_norm": MAX_GRAD_NORM,
            "lr": LR,
            "batch_sizes": {},
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
        },
        "targets": TARGETS,
        "refresh_every_default": refresh_every,
        "preconditioner_config": ", ".join(f"{k}={v}" for k, v in default_cfg.items()),
        "memory_method": "not measured",
        "machine": harness.machine(device),
        "versions": harness.versions(),
        "git_commit": harness.git_commit(),
        "package_source": harness.package_digest(),
        "loadavg_start": harness.loadavg(),
        "loadavg_end": None,
        "models": [],
    }
    plans: dict[str, Plan] = {}
    for key, b_override in zip(keys, overrides):
        case = CASES[key]
        plan = plan_model(case, args, device, b_override, log)
        plans[key] = plan
        log(
            f"[{key}] input {plan.shape}, batch {plan.batch}, {plan.rounds} rounds x "
            f"{plan.steps} steps, dp-kfc overrides {plan.kfc or 'none'}"
        )
        mr = measure_timing(
            case,
            batch=plan.batch,
            shape=plan.shape,
            device=device,
            warmup=plan.warmup,
            rounds=plan.rounds,
            steps=plan.steps,
            refresh_reps=refresh_reps,
            seed=args.seed,
            kfc=plan.kfc,
            methods=_methods(args),
            extrapolate=not quick,
            profile_steps=args.profile_steps if args.profile else 0,
            precision=args.precision,
            log=log,
        )
        mr.update(
            {
                "description": case.description,
                "task": case.task,
                "batch_requested": plan.batch_requested,
                "batch_note": plan.batch_note,
                "batch_calibration": plan.calibration,
                "kfc_overrides": plan.kfc,
                "kfc_notes": plan.notes,
                "kfc_default_probes": default_cfg["num_probes"],
                "memory_footprint_estimate": plan.footprint,
                "refresh_plan": plan.refresh_plan,
                "epoch_samples": case.epoch_samples,
                "epoch_data": case.epoch_data,
            }
        )
        mr["analysis"] = analyse(mr, refresh_every)
        result["models"].append(mr)
        result["config"]["batch_sizes"][key] = plan.batch
        result["wall_s"] = time.perf_counter() - t_start
        if save is not None:
            save(result)  # partial results survive an interrupted run
    if not args.no_memory:
        log("[memory] one fresh process per (model, method)")
        jobs = [_memory_job(CASES[k], plans[k], m, args) for k in keys for m in _methods(args)]
        memory = measure_memory(jobs, args.memory_timeout_s, log)
        result["memory_method"] = next((r["how"] for r in memory if "how" in r), "failed")
        for mr in result["models"]:
            mr["memory"] = [r for r in memory if r.get("model") == mr["model"]]
            mr["analysis"] = analyse(mr, refresh_every)
    result["loadavg_end"] = harness.loadavg()
    result["wall_s"] = time.perf_counter() - t_start
    return result


def _default_out(device: str, quick: bool) -> Path:
    return harness.RESULTS / f"cost_{device}{'_quick' if quick else ''}.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """CLI (see the module docstring)."""
    p = argparse.ArgumentParser(
        description="Step time and peak memory of nonprivate / opacus / dp-sgd / dp-kfc.",
    )
    p.add_argument("--quick", action="store_true", help="small inputs and batches, few steps")
    p.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help="comma list of " + ", ".join(CASES) + " (default: all but the BraTS-size cases)",
    )
    p.add_argument(
        "--methods", default=",".join(METHODS), help="comma list of " + ", ".join(METHODS)
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--precision",
        default="float32",
        choices=[p.value for p in Precision],
        help="forward pass of every method: float32, or bf16 autocast (training.precision)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per method and round")
    p.add_argument("--rounds", type=int, default=None, help="round-robin rounds")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per method")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--batch-sizes", default=None, help="one batch size per model, comma list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kfc-probes", type=int, default=None, help="dp-kfc num_probes override")
    p.add_argument("--kfc-chunk", type=int, default=None, help="dp-kfc chunk_size override")
    p.add_argument(
        "--kfc-conv-a", default=None, choices=["full", "kron"], help="dp-kfc conv_a override"
    )
    p.add_argument(
        "--kfc-family",
        default=None,
        choices=[f.value for f in Family],
        help="dp-kfc preconditioner family override",
    )
    p.add_argument(
        "--kfc-rank-a",
        type=lambda v: None if v.lower() in ("none", "null", "dense") else int(v),
        default=-1,  # not given (argparse passes only string defaults through type)
        help="dp-kfc rank_a override (an integer, or none for the dense U_A)",
    )
    p.add_argument("--refresh-reps", type=int, default=None, help="timed refreshes (GPU 3, else 1)")
    p.add_argument(
        "--memory-steps", type=int, default=None, help="steps per memory process (2; quick 1)"
    )
    p.add_argument("--memory-timeout-s", type=float, default=1800.0)
    p.add_argument("--no-memory", action="store_true", help="skip the memory processes")
    p.add_argument("--max-step-s", type=float, default=20.0, help="CPU full mode batch rule")
    p.add_argument(
        "--model-budget-s",
        type=float,
        default=300.0,
        help="CPU full mode: fewer steps/rounds so that one model's timing fits this budget",
    )
    p.add_argument("--profile", action="store_true", help="torch.profiler tables")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON output (default dpkfc_bench/results/...)")
    p.add_argument("--md", default=None, help="Markdown output (default: next to --out)")
    p.add_argument("--silent", action="store_true")
    p.add_argument(
        "--render",
        default=None,
        metavar="FILE.json",
        help="only recompute ratios/verdicts of an existing result and rewrite its Markdown",
    )
    p.add_argument("--_memory-child", dest="memory_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    args.command = " ".join(["python -m dpkfc_bench cost", *given])
    if args.memory_child is None and args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    if args.memory_child is not None:
        memory_child_main(args.memory_child)
        return
    if args.render is not None:
        src = Path(args.render)
        result = json.loads(src.read_text(encoding="utf-8"))
        for mr in result["models"]:
            mr["analysis"] = analyse(mr, result["refresh_every_default"])
        harness.save_results(src, result)
        target = Path(args.md) if args.md else src.with_suffix(".md")
        target.write_text(render_markdown(result), encoding="utf-8")
        print(f"rewrote {src} analysis and {target}")
        return
    out = Path(args.out) if args.out else _default_out(args.device, args.quick)
    md = Path(args.md) if args.md else out.with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    md.parent.mkdir(parents=True, exist_ok=True)
    prof_path = out.with_name(out.stem + "_profile.txt")

    def save(result: dict[str, Any]) -> None:
        profiles = {mr["model"]: mr.pop("profile") for mr in result["models"] if "profile" in mr}
        if profiles:
            old = (
                prof_path.read_text(encoding="utf-8")
                if prof_path.exists() and result["models"][:-1]
                else ""
            )
            prof_path.write_text(
                old
                + "".join(
                    f"=== {k} ===\n" + "\n\n".join(v.values()) + "\n\n" for k, v in profiles.items()
                ),
                encoding="utf-8",
            )
            result["profile_file"] = os.path.relpath(prof_path, harness.ROOT)
        harness.save_results(out, result)
        md.write_text(render_markdown(result), encoding="utf-8")

    result = run(args, save)
    save(result)
    print(render_markdown(result))
    print(f"wrote {out} and {md} ({result['wall_s']:.0f} s)")
