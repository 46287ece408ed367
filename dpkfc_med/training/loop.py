"""The training run: plan, train with DP (or not), checkpoint, evaluate, report.

Order of operations (so that bad input never leaves anything that looks like a run):

1. load and validate data, build and fix the model, check the privacy plan;
2. only then create the run directory, mark it ``incomplete`` and start the ledger;
3. train; the ledger file is rewritten before every noisy update, a checkpoint (model,
   optimizer, accountant/ledger and RNG states) is written atomically after every epoch;
4. evaluate the best-validation model on the test split, write metrics, model and the
   privacy report, and mark the run ``complete``.

An exception or Ctrl-C writes the report with ``status: incomplete`` (the privacy spent is the
ledger's, which is never behind) and re-raises.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
import json
import logging
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader

from dpkfc_med.models import (
    build_model,
    check_input_size,
    make_private_compatible,
    validate_private_compatible,
)
from dpkfc_med.privacy.accounting import (
    GaussianSteps,
    PrivacyLedger,
    calibrate_noise_multiplier,
    epsilon_for,
)
from dpkfc_med.privacy.adambc import DPAdamBC, noise_variance_of
from dpkfc_med.privacy.engine import PrivacyEngine
from dpkfc_med.training.config import ConfigError, Method, RunConfig
from dpkfc_med.training.tasks import Task, build_task

__all__ = ["PlanError", "RunResult", "plan_privacy", "train"]

log = logging.getLogger("dpkfc_med")

GUARANTEE = (
    "Each training step adds Gaussian noise of standard deviation sigma*C to the sum of "
    "per-unit gradients clipped to L2 norm C (after the probe-only preconditioner), with units "
    "drawn by Poisson sampling at rate q. The released model and everything derived from it are "
    "({eps}, {delta})-differentially private with respect to adding or removing one {unit} "
    "(PRV accountant). The preconditioner is computed from synthetic probes and previously "
    "released parameters only, so it is post-processing and costs no budget."
)
TUNING = (
    "Hyperparameters (learning rate, clip norm, damping, epochs) were set in the configuration "
    "before this run. Any tuning done by looking at results on the private data (including this "
    "run's validation split, which is also used here to select the reported epoch) is NOT "
    "covered by the stated epsilon."
)


class PlanError(ValueError):
    """The privacy plan is impossible or exceeds the target."""


@dataclass
class RunResult:
    """What a finished run returns."""

    run_dir: Path
    status: str
    epsilon: float | None
    metrics: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    os.close(fd)
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _write_json(path: Path, obj: Any) -> None:
    _atomic_write_bytes(path, json.dumps(obj, indent=1, default=_json_default).encode())


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    return str(o)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(["training.device=cuda: no CUDA device is available; use cpu or auto"])
    return torch.device(name)


def plan_privacy(cfg: RunConfig, num_units: int, steps_per_epoch: int) -> dict[str, Any]:
    """The privacy plan: delta, sample rate, planned steps and the noise multiplier.

    Raises:
        PlanError: the target cannot be met (naming the field and the fix), or a given noise
            multiplier would exceed the target.
    """
    p = cfg.privacy
    q = 1.0 / steps_per_epoch
    steps = int(cfg.training.epochs * steps_per_epoch)
    delta = p.delta if p.delta is not None else min(1e-5, 1.0 / num_units)
    if delta > 1.0 / num_units:
        raise PlanError(
            f"privacy.delta={delta:g} exceeds 1/N = {1.0 / num_units:.3g} for N={num_units} "
            "training units; such a delta permits leaking a whole record: use delta <= 1/N"
        )
    if p.noise_multiplier is not None:
        eps = epsilon_for([GaussianSteps(q, p.noise_multiplier, steps)], delta, p.accountant)
        if eps > p.target_epsilon:
            raise PlanError(
                f"the plan ({steps} steps at sample rate {q:.4g}, noise_multiplier "
                f"{p.noise_multiplier}) spends epsilon {eps:.3f} > privacy.target_epsilon="
                f"{p.target_epsilon}; raise the noise multiplier, train fewer epochs, or set "
                "privacy.noise_multiplier: null to calibrate it"
            )
        sigma = p.noise_multiplier
    else:
        try:
            sigma = calibrate_noise_multiplier(
                target_epsilon=p.target_epsilon,
                delta=delta,
                sample_rate=q,
                steps=steps,
                accountant=p.accountant,
            )
        except Exception as err:  # Opacus raises a bare ValueError when no sigma fits
            raise PlanError(
                f"no noise multiplier reaches privacy.target_epsilon={p.target_epsilon} at "
                f"delta={delta:g} with {steps} steps at sample rate {q:.4g} ({err}); raise the "
                "target epsilon, lower training.epochs or training.batch_size"
            ) from None
        if sigma > 1e3:
            raise PlanError(
                f"privacy.target_epsilon={p.target_epsilon} needs noise multiplier {sigma:.3g}: "
                "the updates would be pure noise; raise the target epsilon or use more data"
            )
    return {
        "delta": delta,
        "sample_rate": q,
        "planned_steps": steps,
        "noise_multiplier": float(sigma),
    }


def _build_model(cfg: RunConfig, task: Task) -> tuple[nn.Module, list[dict[str, Any]]]:
    model, _ = build_model(
        cfg.model.name,
        spatial_dims=task.spatial_dims,
        in_channels=task.in_channels,
        out_channels=task.num_classes,
        dp_fix=False,
        **cfg.model.kwargs,
    )
    model, fixes = make_private_compatible(model, norm=cfg.model.norm)
    validate_private_compatible(model)
    check_input_size(model, (task.in_channels, *task.spatial_shape))
    return model, [dataclasses.asdict(f) for f in fixes]


def _make_optimizer(cfg: RunConfig, model: nn.Module) -> torch.optim.Optimizer:
    t = cfg.training
    if t.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    if t.optimizer == "adambc":  # noise variance and default floor are set once sigma is known
        gamma = t.adambc_gamma if t.adambc_gamma is not None else 1e-8
        return DPAdamBC(model.parameters(), lr=t.lr, gamma=gamma, weight_decay=t.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay
    )


class _Run:
    """State of one training run (kept small: the engine owns privacy state)."""

    def __init__(self, cfg: RunConfig, task: Task, run_dir: Path, device: torch.device) -> None:
        self.cfg, self.task, self.run_dir, self.device = cfg, task, run_dir, device
        self.history: dict[str, list[Any]] = {
            "step": [],
            "epsilon": [],
            "loss": [],
            "val_epoch": [],
            "val_metric": [],
            "val_metric_name": task.selection_metric,  # type: ignore[dict-item]
        }
        self.diag: list[dict[str, Any]] = []
        self.eps_shown = 0.0
        self.epoch = 0
        self.best: dict[str, Any] = {"epoch": -1, "metric": -math.inf, "state": None}


def train(
    cfg: RunConfig,
    *,
    data_path: str | None = None,
    resume: bool = False,
    stop_after_epochs: int | None = None,
) -> RunResult:
    """Run the configured training end to end and write the run directory.

    Args:
        cfg: the validated configuration.
        data_path: override of ``cfg.data.path``.
        resume: continue an interrupted run in ``cfg.run_dir()`` from its last checkpoint;
            the ledger continues exactly (steps spent after the checkpoint stay spent).
        stop_after_epochs: stop (as if interrupted) after this many epochs of this session;
            used by tests and by users who train in slices.

    Returns:
        :class:`RunResult` with the status, epsilon and final metrics.
    """
    if cfg.training.threads:
        torch.set_num_threads(cfg.training.threads)
    device = _device(cfg.training.device)
    method = cfg.method_enum
    # ---------------------------------------------------------------- 1. validate all input
    task = build_task(cfg, data_path)
    _seed_everything(cfg.training.seed)
    model, fixes = _build_model(cfg, task)
    model.to(device)
    n_units = len(task.train_set)  # type: ignore[arg-type]
    if n_units == 0:
        raise PlanError("the training split is empty")
    batch = min(cfg.training.batch_size, n_units)
    steps_per_epoch = max(1, math.ceil(n_units / batch))
    plan = plan_privacy(cfg, n_units, steps_per_epoch) if method.private else None
    run_dir = cfg.run_dir()
    ckpt_path = run_dir / "checkpoint.pt"
    if resume and not ckpt_path.is_file():
        raise ConfigError(
            [f"--resume: no checkpoint at {ckpt_path}; start the run without --resume"]
        )
    if not resume and (run_dir / "run.json").is_file():
        status = json.loads((run_dir / "run.json").read_text()).get("status")
        raise ConfigError(
            [
                f"output.dir: {run_dir} already holds a run (status {status!r}); pass --resume to "
                "continue it or choose another --out"
            ]
        )
    # ---------------------------------------------------------------- 2. start the run
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json(run_dir / "run.json", {"status": "incomplete", "started": _now(), "name": cfg.name})
    _atomic_write_bytes(
        run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False).encode()
    )
    _setup_logging(run_dir)
    state = _Run(cfg, task, run_dir, device)
    optimizer = _make_optimizer(cfg, model)
    train_loader = DataLoader(
        task.train_set,
        batch_size=batch,
        shuffle=not method.private,
        generator=torch.Generator().manual_seed(cfg.training.seed),
        collate_fn=task.extra.get("collate"),
    )
    engine: PrivacyEngine | None = None
    pmodel: nn.Module = model
    popt: Any = optimizer
    loader: Any = train_loader
    ledger_path = run_dir / "ledger.json"
    if method.private:
        assert plan is not None
        engine = PrivacyEngine(
            accountant=cfg.privacy.accountant,
            secure_mode=cfg.privacy.secure_rng,
            seed=None if cfg.privacy.secure_rng else cfg.training.seed,
        )
        previous: PrivacyLedger | None = (
            PrivacyLedger.load(ledger_path) if resume and ledger_path.is_file() else None
        )
        kw: dict[str, Any] = {}
        if method.preconditioned:
            kw = {
                "probe_source": task.probe_source(cfg),
                "probe_loss": task.probe_loss,
                "preconditioner": cfg.preconditioner_config(),
                "refresh_every": cfg.probes.refresh_every,
                "refresh_budget": cfg.probes.refresh_budget,
                "probe_seed": cfg.probes.seed,
            }
        pmodel, popt, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=train_loader,
            noise_multiplier=plan["noise_multiplier"],
            max_grad_norm=cfg.privacy.max_grad_norm,
            delta=plan["delta"],
            method="dp-sgd" if method is Method.DP_SGD else "dp-kfc",
            max_steps=plan["planned_steps"],
            ledger_path=None if resume else ledger_path,
            **kw,
        )
        plan_r = engine.refresh_plan
        if plan_r.get("rule") == "auto":
            log.info(
                "preconditioner refresh every %d steps (refresh_every: auto; refreshes "
                "estimated at %.1f%% of training time, budget %g%%; set probes.refresh_every "
                "to an integer to choose the period yourself)",
                plan_r["refresh_every"],
                100 * plan_r["estimated_share"],
                100 * plan_r["budget"],
            )
        if isinstance(optimizer, DPAdamBC):
            phi = noise_variance_of(
                popt.noise_multiplier, popt.max_grad_norm, popt.expected_batch_size
            )
            gamma = cfg.training.adambc_gamma
            for group in optimizer.param_groups:
                group["noise_variance"] = phi
                group["gamma"] = gamma if gamma is not None else (phi if phi > 0 else 1e-8)
            log.info("DP-AdamBC: noise variance (sigma C / B)^2 = %.3g subtracted", phi)
        if resume:
            _restore(state, ckpt_path, model, popt, engine, previous, ledger_path)
        else:
            engine.ledger.save()  # type: ignore[union-attr]
    elif resume:
        _restore(state, ckpt_path, model, popt, None, None, ledger_path)
    # ---------------------------------------------------------------- 3. train
    status = "incomplete"
    try:
        epochs_this_session = 0
        while state.epoch < cfg.training.epochs:
            if engine is not None and popt.steps_taken >= plan["planned_steps"]:  # type: ignore[index]
                break
            _train_epoch(state, pmodel, popt, loader, engine)
            state.epoch += 1
            epochs_this_session += 1
            metric = task.evaluate(model, "val", device, cfg.training.eval_batch_size)
            value = metric.get(task.selection_metric, float("nan"))
            state.history["val_epoch"].append(state.epoch)
            state.history["val_metric"].append(value)
            log.info("epoch %d: val %s = %.4f", state.epoch, task.selection_metric, value)
            if not (value <= state.best["metric"]):  # nan-safe: first epoch always selected
                state.best = {
                    "epoch": state.epoch,
                    "metric": value,
                    "state": copy.deepcopy(model.state_dict()),
                }
            _checkpoint(state, ckpt_path, model, popt, engine)
            if stop_after_epochs is not None and epochs_this_session >= stop_after_epochs:
                break
        else:
            status = "complete"
        if state.epoch >= cfg.training.epochs or (
            engine is not None and popt.steps_taken >= plan["planned_steps"]  # type: ignore[index]
        ):
            status = "complete"
    except (KeyboardInterrupt, Exception):  # incl. BudgetExhaustedError: report what was spent
        _fill_epsilon(state, engine)
        _finish(state, model, engine, plan, fixes, "incomplete", evaluate=False)
        raise
    return _finish(state, model, engine, plan, fixes, status, evaluate=status == "complete")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _setup_logging(run_dir: Path) -> None:
    log.setLevel(logging.INFO)
    log.propagate = False  # the progress bar owns the console; the log goes to the run dir
    for h in list(log.handlers):
        if isinstance(h, logging.FileHandler):
            log.removeHandler(h)
    fh = logging.FileHandler(run_dir / "train.log")
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(fh)


def _train_epoch(
    state: _Run, pmodel: nn.Module, popt: Any, loader: Any, engine: PrivacyEngine | None
) -> None:
    from tqdm import tqdm

    cfg, task = state.cfg, state.task
    pmodel.train()
    bar = tqdm(
        loader,
        desc=f"epoch {state.epoch + 1}/{cfg.training.epochs}",
        disable=not cfg.training.progress,
        leave=False,
        dynamic_ncols=True,
    )
    t0, seen = time.perf_counter(), 0
    for batch in bar:
        if engine is not None and popt.max_steps is not None and popt.steps_taken >= popt.max_steps:
            break
        x, y, units = task.unpack(batch)
        x, y = x.to(state.device), y.to(state.device)
        popt.zero_grad(set_to_none=True)
        if len(x) == 0:
            loss_value = float("nan")
            # An empty Poisson batch is still a noisy step (noise only): take it.
            if engine is not None:
                out = pmodel(x)
                (out.sum() * 0).backward()
                popt.step()
        else:
            out = pmodel(x)
            loss = task.loss(out, y)
            loss.backward()
            if units is not None and engine is not None:
                popt.set_unit_ids(units.to(state.device))
            popt.step()
            loss_value = float(loss.detach())
        seen += len(x)
        step = popt.steps_taken if engine is not None else len(state.history["step"]) + 1
        state.history["step"].append(step)
        state.history["loss"].append(loss_value)
        if engine is not None and popt.last_diagnostics.batch_units:
            state.diag.append(popt.last_diagnostics.as_dict())
        rate = seen / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix(loss=f"{loss_value:.3f}", eps=f"{state.eps_shown:.2f}", img_s=f"{rate:.0f}")
    _fill_epsilon(state, engine)
    log.info("epoch %d done: %d samples, %.1f s", state.epoch + 1, seen, time.perf_counter() - t0)


def _fill_epsilon(state: _Run, engine: PrivacyEngine | None) -> None:
    """Epsilon history for the steps of the epoch just run.

    Accountants cost up to seconds per call, so epsilon is computed once per epoch, and each
    step of the epoch is given the value at the epoch's end: an upper bound on what had been
    spent after that step (epsilon grows with the steps), never an under-statement.
    """
    if engine is None:
        return
    eps = engine.get_epsilon()
    missing = len(state.history["step"]) - len(state.history["epsilon"])
    state.history["epsilon"].extend([eps] * missing)
    state.eps_shown = eps


def _checkpoint(
    state: _Run, path: Path, model: nn.Module, popt: Any, engine: PrivacyEngine | None
) -> None:
    opt = popt.original_optimizer if hasattr(popt, "original_optimizer") else popt
    _atomic_torch_save(
        {
            "epoch": state.epoch,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "engine": engine.state_dict() if engine is not None else None,
            "history": state.history,
            "diag": state.diag,
            "best": state.best,
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
            "python_rng": random.getstate(),
        },
        path,
    )


def _restore(
    state: _Run,
    path: Path,
    model: nn.Module,
    popt: Any,
    engine: PrivacyEngine | None,
    previous: PrivacyLedger | None,
    ledger_path: Path,
) -> None:
    ck = torch.load(path, map_location=state.device, weights_only=False)
    model.load_state_dict(ck["model"])
    opt = popt.original_optimizer if hasattr(popt, "original_optimizer") else popt
    opt.load_state_dict(ck["optimizer"])
    state.epoch = int(ck["epoch"])
    state.history, state.diag, state.best = ck["history"], ck["diag"], ck["best"]
    torch.set_rng_state(ck["torch_rng"])
    np.random.set_state(ck["numpy_rng"])
    random.setstate(ck["python_rng"])
    if engine is not None and ck["engine"] is not None:
        engine.load_state_dict(ck["engine"])
        assert engine.ledger is not None
        # Steps recorded on disk after the checkpoint were spent: never forget them.
        if previous is not None and previous.steps > engine.ledger.steps:
            engine.ledger.events = list(previous.events)
            popt.steps_taken = previous.steps
        engine.ledger.path = ledger_path
        engine.ledger.save()


def _finish(
    state: _Run,
    model: nn.Module,
    engine: PrivacyEngine | None,
    plan: dict[str, Any] | None,
    fixes: list[dict[str, Any]],
    status: str,
    *,
    evaluate: bool,
) -> RunResult:
    from dpkfc_med.report import collect_environment, write_report

    cfg, task, run_dir = state.cfg, state.task, state.run_dir
    metrics: dict[str, Any] = {"val": None, "test": None, "selected_epoch": state.best["epoch"]}
    if evaluate:
        final_state = copy.deepcopy(model.state_dict())
        if state.best["state"] is not None:
            model.load_state_dict(state.best["state"])
        metrics["val"] = task.evaluate(model, "val", state.device, cfg.training.eval_batch_size)
        metrics["test"] = task.evaluate(model, "test", state.device, cfg.training.eval_batch_size)
        _atomic_torch_save(
            {
                "model": model.state_dict(),
                "final_model": final_state,
                "config": cfg.to_dict(),
                "task": _task_meta(task),
                "selected_epoch": state.best["epoch"],
            },
            run_dir / "model.pt",
        )
        _write_json(run_dir / "metrics.json", metrics)
        if hasattr(task, "after_training"):
            task.after_training(model, run_dir, state.device)  # type: ignore[attr-defined]
    report = build_report(state, model, engine, plan, fixes, status, metrics, collect_environment)
    write_report(report, run_dir)
    _write_json(run_dir / "run.json", {"status": status, "finished": _now(), "name": cfg.name})
    eps = report["privacy"]["epsilon"]["prv"] if report["privacy"]["epsilon"] else None
    return RunResult(run_dir, status, eps, metrics, report)


def _task_meta(task: Task) -> dict[str, Any]:
    return {
        "kind": task.kind,
        "spatial_dims": task.spatial_dims,
        "in_channels": task.in_channels,
        "num_classes": task.num_classes,
        "spatial_shape": list(task.spatial_shape),
        "label_names": task.label_names,
    }


def _diag_summary(diag: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not diag:
        return None
    keys = ("clipped_fraction", "median_transformed_norm", "median_raw_norm")
    out: dict[str, Any] = {f"mean_{k}": float(np.nanmean([d[k] for d in diag])) for k in keys}
    layers: dict[str, list[float]] = {}
    for d in diag:
        for k, v in d["layer_share"].items():
            layers.setdefault(k, []).append(v)
    out["mean_layer_share"] = {k: float(np.mean(v)) for k, v in layers.items()}
    out["steps"] = len(diag)
    out["note"] = (
        "computed from un-noised private statistics; not covered by the privacy guarantee; "
        "for the data custodian only"
    )
    return out


def build_report(
    state: _Run,
    model: nn.Module,
    engine: PrivacyEngine | None,
    plan: dict[str, Any] | None,
    fixes: list[dict[str, Any]],
    status: str,
    metrics: dict[str, Any],
    collect_environment: Any,
) -> dict[str, Any]:
    """The privacy-report dict (schema ``dpkfc_med.privacy_report/1``)."""
    from dpkfc_med.report import REPORT_SCHEMA

    cfg, task = state.cfg, state.task
    method = cfg.method_enum
    n_units = len(task.train_set)  # type: ignore[arg-type]
    privacy: dict[str, Any] = {
        "method": method.value,
        "private": method.private,
        "accountant": cfg.privacy.accountant,
        "epsilon": None,
        "target_epsilon": cfg.privacy.target_epsilon if method.private else None,
        "delta": None,
        "sampler": None,
        "sample_rate": None,
        "expected_batch_size": None,
        "noise_multiplier": None,
        "max_grad_norm": None,
        "steps": len(state.history["step"]),
        "planned_steps": None,
        "epochs": state.epoch,
        "secure_rng": bool(cfg.privacy.secure_rng and method.private),
        "neighbouring_relation": f"add or remove one {task.privacy_unit}",
        "guarantee": "NO PRIVACY GUARANTEE: non-private training.",
        "hyperparameter_tuning": TUNING,
        "ledger": {"events": [], "steps": 0, "note": "non-private run: no mechanism was executed"},
    }
    pre = None
    if engine is not None and plan is not None and engine.ledger is not None:
        eps = engine.ledger.all_epsilons()
        ledger = engine.ledger
        privacy.update(
            {
                "epsilon": eps,
                "delta": ledger.delta,
                "sampler": "poisson",
                "sample_rate": engine.sample_rate,
                "expected_batch_size": ledger.meta.get("expected_batch_size"),
                "noise_multiplier": engine.noise_multiplier,
                "max_grad_norm": engine.max_grad_norm,
                "steps": ledger.steps,
                "planned_steps": plan["planned_steps"],
                "epochs": ledger.steps * engine.sample_rate,
                "guarantee": GUARANTEE.format(
                    eps=f"{math.ceil(eps['prv'] * 1000) / 1000:.3f}",
                    delta=f"{ledger.delta:g}",
                    unit=task.privacy_unit,
                ),
                "ledger": ledger.to_dict(),
            }
        )
        if method.preconditioned:
            prov = engine.provenance()
            public = method is Method.DP_KFC_PUBLIC
            src = prov.get("probe_source") or {}
            pre = {
                "uses_private_data": False,
                "external_data": (
                    {"path": src.get("path"), "sha256": src.get("sha256"), "note": src.get("note")}
                    if public
                    else None
                ),
                "probe_source": src,
                "refresh_every": prov["refresh_every"],
                "refresh_plan": prov.get("refresh_plan", {}),
                "refreshes": prov["refreshes"],
                "covered_layers": prov["covered_layers"],
                "config": (prov.get("preconditioner") or {}).get("config", {}),
                "coverage": (prov.get("preconditioner") or {}).get("coverage", []),
            }
    return {
        "schema": REPORT_SCHEMA,
        "status": status,
        "created": _now(),
        "run": {
            "name": cfg.name,
            "run_dir": str(state.run_dir),
            "config_sha256": cfg.sha256(),
            "config": cfg.to_dict(),
            "seed": cfg.training.seed,
            "device": str(state.device),
        },
        "task": {
            "kind": task.kind,
            "spatial_dims": task.spatial_dims,
            "num_classes": task.num_classes,
            "label_names": task.label_names,
        },
        "data": {
            **task.data_record,
            "num_train_units": n_units,
            "privacy_unit": task.privacy_unit,
            "max_samples_per_unit": task.max_samples_per_unit,
        },
        "model": {
            "name": cfg.model.name,
            "num_params": sum(p.numel() for p in model.parameters()),
            "fixes": fixes,
        },
        "privacy": privacy,
        "preconditioner": pre,
        "training": {
            "optimizer": cfg.training.optimizer,
            "lr": cfg.training.lr,
            "momentum": cfg.training.momentum,
            "weight_decay": cfg.training.weight_decay,
            "epochs_planned": cfg.training.epochs,
            "expected_batch_size": cfg.training.batch_size,
            "selected_epoch": state.best["epoch"],
            "model_selection": f"best validation {task.selection_metric} over epochs",
        },
        "history": {k: v for k, v in state.history.items()},
        "metrics": {"val": metrics.get("val"), "test": metrics.get("test")},
        "diagnostics": _diag_summary(state.diag),
        "environment": collect_environment(Path(__file__).resolve().parents[2]),
    }
