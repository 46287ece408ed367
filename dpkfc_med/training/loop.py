"""The training run: plan, train with DP (or not), checkpoint, evaluate, report.

Order of operations (so that bad input never leaves anything that looks like a run):

1. load and validate data, build and fix the model, decide how the run opens (fresh, from its
   checkpoint, or from its ledger alone) and check the privacy plan (:mod:`.plan`);
2. only then create the run directory, mark it ``incomplete``, append the config and the plan
   to ``config_history.yaml`` / ``plan.json`` and start (or continue) the ledger;
3. train; the ledger file is rewritten before every noisy update, a checkpoint (model,
   optimizer, ledger, schedule) is written atomically after every epoch and on Ctrl-C/SIGTERM;
4. evaluate the best-validation model, write the model, the shareable privacy report and the
   custodian report (``private_not_for_release/``), and mark the run ``complete``.

An exception or interrupt writes the report with ``status: incomplete`` (the privacy spent is
the ledger's, which is never behind), says what was spent and how to continue, and re-raises.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as _dt
import io
import json
import logging
import math
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
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
from dpkfc_med.models.finetune import finetune_report, prepare_finetune, released_state_dict
from dpkfc_med.privacy.accounting import Accountant, PrivacyLedger, rdp_epsilon
from dpkfc_med.privacy.adambc import DPAdamBC
from dpkfc_med.privacy.engine import PrivacyEngine
from dpkfc_med.report.custodian import PRIVATE_DIR
from dpkfc_med.report.history import epsilon_history, epsilon_rule, on_epsilon_grid
from dpkfc_med.report.numbers import format_epsilon
from dpkfc_med.report.render import plural
from dpkfc_med.report.wording import NO_GUARANTEE, NOT_VALID, PRIVATE_PRECONDITIONER
from dpkfc_med.training.config import ConfigError, Method, RunConfig, config_from_dict
from dpkfc_med.training.plan import (
    PlanError,
    config_changes,
    describe_plan,
    plan_privacy,
    resume_replans,
)
from dpkfc_med.training.precision import (
    Precision,
    backend_settings,
    check_precision,
    forward_autocast,
)
from dpkfc_med.training.pretrain import PretrainSpec, pretrain_synthetic
from dpkfc_med.training.schedule import WeightAverage, lr_factor
from dpkfc_med.training.tasks import Task, build_task
from dpkfc_med.utils import atomic_write_bytes, write_json

__all__ = [
    "PlanError",
    "RunInterrupted",
    "RunResult",
    "build_run_model",
    "noise_only_step",
    "plan_privacy",
    "task_record",
    "train",
]

CHECKPOINT = "checkpoint.pt"
LEDGER = "ledger.json"
RUN_JSON = "run.json"
PLAN_JSON = "plan.json"
CONFIG_HISTORY = "config_history.yaml"
PRETRAIN_CACHE = ".pretrain_cache"  # pretrain.cache_dir: auto, beside the run directory

log = logging.getLogger("dpkfc_med")

GUARANTEE = (
    "Each training step adds Gaussian noise of standard deviation sigma*C to the sum of "
    "per-unit gradients clipped to L2 norm C (after the probe-only preconditioner), with units "
    "drawn by Poisson sampling at rate q. The released model and everything derived from it are "
    "({eps}, {delta})-differentially private with respect to adding or removing one {unit} "
    "(PRV accountant). The preconditioner is computed from synthetic probes and previously "
    "released parameters only, so it is post-processing and costs no budget."
)
SEEDED_GUARANTEE = (
    f"{NOT_VALID}: no differential-privacy guarantee holds. The noise and the Poisson "
    "sampling were seeded from training.seed = {seed} (privacy.reproducible_noise: true), which "
    "this report publishes, so anyone can replay them. Research use only."
)
TUNING_LAST = (
    "Hyperparameters (learning rate, clip norm, damping, epochs) were set in the configuration "
    "before this run, and the last epoch's weights are released (no epoch was chosen on the "
    "validation split). Any tuning done by looking at results on the private data is NOT "
    "covered by the stated epsilon, unless the run is a trial of `dpkfc-med tune`, whose own "
    "report covers the tuning."
)
TUNING = (
    "Hyperparameters (learning rate, clip norm, damping, epochs) were set in the configuration "
    "before this run. Any tuning done by looking at results on the private data (including this "
    "run's validation split, which is also used here to select the reported epoch) is NOT "
    "covered by the stated epsilon."
)


@dataclass
class RunResult:
    """What a finished run returns."""

    run_dir: Path
    status: str
    epsilon: float | None
    metrics: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)
    custodian: dict[str, Any] = field(default_factory=dict)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


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


def build_run_model(
    cfg: RunConfig, task: Task, *, finetune: bool = True
) -> tuple[nn.Module, list[dict[str, Any]]]:
    """The run's network, made DP-compatible and checked against the task's input size.

    Args:
        cfg: The run config.
        task: The task (input channels, classes, spatial shape).
        finetune: Load ``model.pretrained`` and apply ``training.finetune`` (freezing, LoRA
            adapters); ``False`` builds the plain network of a released ``model.pt``.

    Returns:
        The model and its fixes as dictionaries (the report's ``model.fixes``).
    """
    model, _ = build_model(
        cfg.model.name,
        spatial_dims=task.spatial_dims,
        in_channels=task.in_channels,
        out_channels=task.num_classes,
        dp_fix=False,
        input_size=task.spatial_shape,
        **cfg.model.kwargs,
    )
    model, fixes = make_private_compatible(model, norm=cfg.model.norm)
    if finetune:  # model.pretrained and training.finetune, before any privacy wrapper
        prepare_finetune(model, cfg.model, cfg.training)
    validate_private_compatible(model)
    check_input_size(model, (task.in_channels, *task.spatial_shape))
    return model, [dataclasses.asdict(f) for f in fixes]


def _make_optimizer(cfg: RunConfig, model: nn.Module) -> torch.optim.Optimizer:
    t = cfg.training
    if t.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    if t.optimizer == "adambc":  # noise variance (and the default floor) set by the engine
        return DPAdamBC(
            model.parameters(), lr=t.lr, gamma=t.adambc_gamma, weight_decay=t.weight_decay
        )
    return torch.optim.SGD(
        model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay
    )


class _Run:
    """State of one training run (kept small: the engine owns privacy state)."""

    def __init__(self, cfg: RunConfig, task: Task, run_dir: Path, device: torch.device) -> None:
        self.cfg, self.task, self.run_dir, self.device = cfg, task, run_dir, device
        self.history: dict[str, list[Any]] = {
            "step": [],
            "epsilon_step": [],  # steps whose exact epsilon the report lists (report.history)
            "loss": [],
            "val_epoch": [],
            "val_metric": [],
            "val_metric_name": task.selection_metric,  # type: ignore[dict-item]
        }
        self.diag: list[dict[str, Any]] = []
        self.bar_epsilon: dict[str, str] = {}  # the progress bar's epsilon fields
        self.epoch = 0
        self.best: dict[str, Any] = {"epoch": -1, "metric": -math.inf, "state": None}
        self.ema: WeightAverage | None = None
        self.pretrain: dict[str, Any] | None = None  # provenance of data-free pretraining
        self.total_steps = 0  # planned optimizer steps (the lr schedule's horizon)
        self.precision = Precision.FLOAT32  # the training forward pass (training.precision)
        self.backends: dict[str, bool] = {}  # CUDA backend settings in force while training

    def eval_model(self, model: nn.Module) -> nn.Module:
        """The network that is validated, selected and released: the weight average if on."""
        return self.ema.module if self.ema is not None else model


def train(
    cfg: RunConfig,
    *,
    data_path: str | None = None,
    resume: bool = False,
    stop_after_epochs: int | None = None,
    instrument: Callable[[PrivacyEngine, Any], None] | None = None,
) -> RunResult:
    """Run the configured training end to end and write the run directory.

    Args:
        cfg: the validated configuration.
        data_path: override of ``cfg.data.path``.
        resume: continue the run in ``cfg.run_dir()``: from its last checkpoint, or -- when it
            stopped before the first one -- from the initial model with the spent steps carried
            in the ledger. The plan continues exactly unless ``training.epochs`` or
            ``privacy.noise_multiplier`` changed; then the remaining steps are re-planned so
            that the whole ledger stays within the target (:mod:`.plan`). Other changes are
            refused.
        stop_after_epochs: stop (as if interrupted) after this many epochs of this call;
            for training in slices (resume with ``resume=True``).
        instrument: called once as ``instrument(engine, private_optimizer)`` after the
            mechanism is wired and before the first step (private methods only); the
            empirical privacy audit uses it to add its canaries to the exact mechanism.

    Returns:
        :class:`RunResult` with the status, epsilon and final metrics.
    """
    if cfg.training.threads:
        torch.set_num_threads(cfg.training.threads)
    device = _device(cfg.training.device)
    try:
        precision = check_precision(cfg.training.precision, device)
    except ValueError as err:
        raise ConfigError([str(err)]) from None
    method = cfg.method_enum
    # ---------------------------------------------------------------- 1. validate all input
    task = build_task(cfg, data_path)
    _seed_everything(cfg.training.seed)
    model, fixes = build_run_model(cfg, task)
    model.to(device)
    n_units = len(task.train_set)  # type: ignore[arg-type]
    if n_units == 0:
        raise PlanError("the training split is empty")
    batch = min(cfg.training.batch_size, n_units)
    if batch < cfg.training.batch_size:
        print(
            f"training.batch_size={cfg.training.batch_size} is more than the {n_units} training "
            f"units: every step draws each unit with probability 1 (q = 1, expected batch "
            f"{n_units}); lower training.batch_size for subsampling, which amplifies privacy",
            file=sys.stderr,
            flush=True,
        )
    steps_per_epoch = max(1, math.ceil(n_units / batch))
    run_dir = cfg.run_dir()
    opening = _open_run(cfg, task, run_dir, resume, n_units, steps_per_epoch)
    plan = opening.plan
    _check_output_dir(run_dir)
    # ---------------------------------------------------------------- 2. start the run
    _start_run_files(cfg, task, run_dir, opening)
    _setup_logging(run_dir)
    if plan is not None:
        log.info("privacy plan (%s): %s", opening.kind, describe_plan(plan))
    state = _Run(cfg, task, run_dir, device)
    state.precision = precision
    if cfg.pretrain.steps and opening.kind != "checkpoint":  # a checkpoint holds its weights
        state.pretrain = _pretrain(cfg, task, model, device)
    state.total_steps = (
        plan["planned_steps"] if plan is not None else cfg.training.epochs * steps_per_epoch
    )
    if cfg.training.ema_decay is not None:  # copied before any wrapper hooks the model
        state.ema = WeightAverage(model, cfg.training.ema_decay)
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
    ckpt_path, ledger_path = run_dir / CHECKPOINT, run_dir / LEDGER
    if method.private:
        assert plan is not None
        engine = PrivacyEngine(
            accountant=cfg.privacy.accountant,
            secure_mode=cfg.privacy.secure_rng,
            seed=cfg.training.seed if cfg.privacy.reproducible_noise else None,
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
            backward_reduction="sum",  # per-sample errors exact whatever the batch size
            ledger_path=None if opening.previous is not None else ledger_path,
            clipping=cfg.privacy.clipping,
            mechanism_extra={
                "precision": precision,
                "unit": task.privacy_unit,
                "max_samples_per_unit": task.max_samples_per_unit,
            },
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
        if isinstance(optimizer, DPAdamBC):  # the engine set its noise variance
            phi = optimizer.param_groups[0]["noise_variance"]
            log.info("DP-AdamBC: noise variance (sigma C / B)^2 = %.3g subtracted", phi)
        if opening.kind == "checkpoint":
            _restore(state, ckpt_path, model, popt, engine, opening.previous, ledger_path)
        elif opening.previous is not None:  # ledger only: initial model, spent steps carried
            _carry_ledger(engine, popt, opening.previous, ledger_path)
        else:
            engine.ledger.save()  # type: ignore[union-attr]
        if instrument is not None:
            instrument(engine, popt)
    elif opening.kind == "checkpoint":
        _restore(state, ckpt_path, model, popt, None, None, ledger_path)
    # ---------------------------------------------------------------- 3. train
    status = "incomplete"
    try:
        with _sigterm_as_interrupt(), backend_settings(device) as state.backends:
            epochs_this_session = 0
            while state.epoch < cfg.training.epochs:
                if engine is not None and popt.steps_taken >= plan["planned_steps"]:  # type: ignore[index]
                    break
                _train_epoch(state, pmodel, popt, loader, engine)
                state.epoch += 1
                epochs_this_session += 1
                last = state.epoch >= cfg.training.epochs or (
                    engine is not None and popt.steps_taken >= plan["planned_steps"]  # type: ignore[index]
                )
                if state.epoch % cfg.training.eval_every == 0 or last:
                    chosen = state.eval_model(model)
                    metric = task.evaluate(chosen, "val", device, cfg.training.eval_batch_size)
                    value = metric.get(task.selection_metric, float("nan"))
                    state.history["val_epoch"].append(state.epoch)
                    state.history["val_metric"].append(value)
                    log.info("epoch %d: val %s = %.4f", state.epoch, task.selection_metric, value)
                    latest = cfg.training.select_epoch == "last"
                    if latest or not (value <= state.best["metric"]):  # nan-safe: first is kept
                        state.best = {
                            "epoch": state.epoch,
                            "metric": value,
                            "state": copy.deepcopy(chosen.state_dict()),
                        }
                _checkpoint(state, ckpt_path, model, popt, engine)
                if stop_after_epochs is not None and epochs_this_session >= stop_after_epochs:
                    break
        if state.epoch >= cfg.training.epochs or (
            engine is not None and popt.steps_taken >= plan["planned_steps"]  # type: ignore[index]
        ):
            status = "complete"
    except KeyboardInterrupt:
        # Ctrl-C or SIGTERM: keep the model of the steps already paid for, then say so.
        _checkpoint(state, ckpt_path, model, popt, engine, mid_epoch=True)
        _fill_epsilon(state, engine)
        _finish(state, model, engine, plan, fixes, "incomplete", evaluate=False)
        raise RunInterrupted(_stopped_message(cfg, state, engine, "interrupted")) from None
    except Exception:  # incl. BudgetExhaustedError: report what was spent
        _fill_epsilon(state, engine)
        _finish(state, model, engine, plan, fixes, "incomplete", evaluate=False)
        print(_stopped_message(cfg, state, engine, "stopped by an error"), file=sys.stderr)
        raise
    return _finish(state, model, engine, plan, fixes, status, evaluate=status == "complete")


class RunInterrupted(KeyboardInterrupt):
    """Training was interrupted (Ctrl-C, SIGTERM); the message says what was spent, what next."""


@dataclass
class _Opening:
    """How a run starts: fresh, from its checkpoint, or from its ledger alone."""

    kind: str  # "start" | "checkpoint" | "ledger"
    plan: dict[str, Any] | None
    previous: PrivacyLedger | None = None
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)


def _spent_text(run_dir: Path) -> str:
    ledger_path = run_dir / LEDGER
    if not ledger_path.is_file():
        return "no privacy budget spent"
    ledger = PrivacyLedger.load(ledger_path)
    if ledger.steps == 0:
        return "no noisy step taken yet"
    eps = ledger.epsilon()
    spent = plural("noisy step", ledger.steps)
    return f"{spent} already spent, epsilon {format_epsilon(eps)} (PRV)"


def _open_run(
    cfg: RunConfig,
    task: Task,
    run_dir: Path,
    resume: bool,
    n_units: int,
    steps_per_epoch: int,
) -> _Opening:
    """Decide how the run starts and with which plan; refuse anything that would overspend."""
    private = cfg.method_enum.private
    ckpt_path, ledger_path, run_json = run_dir / CHECKPOINT, run_dir / LEDGER, run_dir / RUN_JSON
    exists = run_json.is_file() or ledger_path.is_file()
    if not resume:
        if exists:
            status = json.loads(run_json.read_text()).get("status") if run_json.is_file() else None
            raise ConfigError(
                [
                    f"output.dir: {run_dir} already holds a run (status {status!r}; "
                    f"{_spent_text(run_dir)}); pass --resume to continue it within its budget, "
                    "or choose another --out (a new run on the same data spends a new budget "
                    "on top of this one)"
                ]
            )
        plan = plan_privacy(cfg, n_units, steps_per_epoch) if private else None
        return _Opening("start", plan)
    if not exists and not ckpt_path.is_file():
        raise ConfigError(
            [
                f"--resume: nothing to resume in {run_dir} (no {LEDGER}, no {CHECKPOINT}); start "
                "the run without --resume"
            ]
        )
    if run_json.is_file() and json.loads(run_json.read_text()).get("status") == "complete":
        raise ConfigError(
            [
                f"--resume: the run in {run_dir} is already complete ({_spent_text(run_dir)}); "
                "its model and report are final. Train more by starting a new run with --out "
                "(it spends a new budget on the same data)"
            ]
        )
    changes: list[tuple[str, Any, Any]] = []
    original_path = run_dir / "config.yaml"
    if original_path.is_file():
        original = config_from_dict(yaml.safe_load(original_path.read_text()), str(original_path))
        changes = config_changes(original, cfg)
        _check_same_data(changes, task, run_dir)
    replan = resume_replans(changes, str(run_dir))
    _announce_changes(changes, run_dir)
    if not private:
        if not ckpt_path.is_file():
            raise ConfigError(
                [
                    f"--resume: no checkpoint at {ckpt_path} (the non-private run stopped before "
                    "its first epoch ended; it spent no privacy budget); start it again without "
                    "--resume after removing the folder, or choose another --out"
                ]
            )
        return _Opening("checkpoint", None, changes=changes)
    previous = PrivacyLedger.load(ledger_path) if ledger_path.is_file() else None
    spent = list(previous.events) if previous is not None else []
    done = sum(e.steps for e in spent)
    full = int(cfg.training.epochs * steps_per_epoch)
    if ckpt_path.is_file():
        stored = _plans(run_dir)
        if not replan and stored:
            # the same plan, continued: record the steps already spent when it resumes
            plan = {**stored[-1]["plan"], "spent_steps": done}
            plan["steps_remaining"] = max(0, int(plan["planned_steps"]) - done)
        else:
            plan = plan_privacy(
                cfg, n_units, steps_per_epoch, spent=spent, steps=max(0, full - done)
            )
            text = f"--resume {run_dir}: re-planned within the target: {describe_plan(plan)}"
            print(text, file=sys.stderr, flush=True)
            log.warning(text)
        return _Opening("checkpoint", plan, previous, changes)
    # Stopped before the first checkpoint: restart from the initial model; the steps already
    # spent stay in the ledger and the new plan fits in what is left of the target.
    plan = plan_privacy(cfg, n_units, steps_per_epoch, spent=spent, steps=full)
    if previous is None:
        return _Opening("start", plan, None, changes)
    if previous.delta != plan["delta"]:
        raise PlanError(
            f"the ledger's delta {previous.delta:g} differs from the plan's {plan['delta']:g}; "
            "resume with the original data and privacy.delta"
        )
    return _Opening("ledger", plan, previous, changes)


def _announce_changes(changes: list[tuple[str, Any, Any]], run_dir: Path) -> None:
    """Say on the console (and in the log) every field a resume changes against the run's."""
    if not changes:
        return
    lines = [f"  {path}: {before!r} -> {after!r}" for path, before, after in changes]
    text = (
        f"--resume {run_dir}: this resume changes {plural('field', len(changes))} of the "
        "run's stored configuration:\n" + "\n".join(lines) + "\n(to continue the run exactly as "
        f"it was, use `dpkfc-med train --resume --out {run_dir}` without a config)"
    )
    print(text, file=sys.stderr, flush=True)
    log.warning(text)


def _check_same_data(changes: list[tuple[str, Any, Any]], task: Task, run_dir: Path) -> None:
    """A moved data folder/file is fine; different data is not."""
    if not any(path == "data.path" for path, _, _ in changes):
        return
    plans = _plans(run_dir)
    before = plans[0].get("data_sha256") if plans else None
    now = task.data_record.get("sha256")
    if before is None or before != now:
        raise ConfigError(
            [
                f"--resume {run_dir}: data.path changed and the data's fingerprint differs from "
                "the one the run started with (or was not recorded); resume with the original "
                "data, or start a new run with --out"
            ]
        )


def _plans(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / PLAN_JSON
    if not path.is_file():
        return []
    return list(json.loads(path.read_text()).get("plans", []))


def _check_output_dir(run_dir: Path) -> None:
    """Refuse an output directory the run cannot write, before anything is written.

    Creates ``run_dir`` (and missing parents) and writes and removes one probe file; on failure
    removes the folders it created and raises, so a refused run leaves nothing behind.

    Raises:
        ConfigError: naming ``output.dir`` / ``--out``, the directory, the operating system's
            reason and the fix.
    """
    created: list[Path] = []
    node = run_dir
    while not node.exists() and node != node.parent:
        created.append(node)
        node = node.parent
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=run_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        for folder in created:  # deepest first; only the empty folders made here
            with contextlib.suppress(OSError):
                folder.rmdir()
        reason = err.strerror or type(err).__name__
        where = f" ({err.filename})" if err.filename and str(err.filename) != str(run_dir) else ""
        raise ConfigError(
            [
                f"output.dir: cannot write the run directory {run_dir}: {reason}{where}; "
                "choose a writable folder with --out (or output.dir in the config), or make "
                "this one writable (e.g. chmod u+w on it or its parent); nothing was written"
            ]
        ) from None


def _start_run_files(cfg: RunConfig, task: Task, run_dir: Path, opening: _Opening) -> None:
    """Mark the run incomplete and append (never overwrite) its config and plan history."""
    run_dir.mkdir(parents=True, exist_ok=True)
    run_json = run_dir / RUN_JSON
    started = (
        json.loads(run_json.read_text()).get("started") if run_json.is_file() else None
    ) or _now()
    write_json(run_json, {"status": "incomplete", "started": started, "name": cfg.name})
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    # the configuration the run now follows (every start's and resume's is kept in the config
    # history); `train --resume --out DIR` continues from it
    atomic_write_bytes(run_dir / "config.yaml", text.encode())
    plans = _plans(run_dir)
    session = len(plans)
    changed = [f"{p}: {a!r} -> {b!r}" for p, a, b in opening.changes]
    header = (
        f"# session {session} ({opening.kind}) at {_now()}"
        + (f"; changed: {'; '.join(changed)}" if changed else "")
        + "\n"
    )
    with open(run_dir / CONFIG_HISTORY, "a", encoding="utf-8") as fh:
        fh.write(("---\n" if session else "") + header + text)
        fh.flush()
        os.fsync(fh.fileno())
    entry = {
        "session": session,
        "kind": opening.kind,
        "time": _now(),
        "changed_fields": [p for p, _, _ in opening.changes],
        "plan": opening.plan,
        "data_sha256": task.data_record.get("sha256"),
    }
    write_json(run_dir / PLAN_JSON, {"plans": [*plans, entry]})


def _carry_ledger(
    engine: PrivacyEngine, popt: Any, previous: PrivacyLedger, ledger_path: Path
) -> None:
    """Continue the on-disk ledger (a run that stopped before its first checkpoint)."""
    assert engine.ledger is not None
    meta = dict(engine.ledger.meta)
    engine.ledger = PrivacyLedger(previous.delta, ledger_path)
    engine.ledger.events = list(previous.events)
    engine.ledger.meta = {**previous.meta, **meta}
    popt.steps_taken = previous.steps
    engine.ledger.save()
    log.info(
        "resumed from the ledger alone: %d noisy steps already spent; training restarts from "
        "the initial model",
        previous.steps,
    )


def _stopped_message(cfg: RunConfig, state: _Run, engine: PrivacyEngine | None, how: str) -> str:
    out = state.run_dir
    if engine is None or engine.ledger is None:
        return (
            f"{how}: the non-private run in {out} is marked incomplete; continue it with "
            f"`dpkfc-med train --resume --out {out}`"
        )
    eps = engine.ledger.epsilon()
    return (
        f"{how}: {plural('noisy step', engine.ledger.steps)} spent, epsilon "
        f"{format_epsilon(eps)} of the "
        f"target {cfg.privacy.target_epsilon:g} (PRV; {out / LEDGER}). The run is marked "
        f"incomplete and keeps its budget: continue it as it was with `dpkfc-med train "
        f"--resume --out {out}` (its own stored configuration). Starting it again elsewhere "
        "spends a new budget on the same data."
    )


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM (a scheduler's kill) into KeyboardInterrupt, so it checkpoints too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


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
    try:  # batches of a Poisson epoch (1/q); the last one also lists its epsilon
        batches: int | None = len(loader)
    except TypeError:
        batches = None
    for index, batch in enumerate(bar):
        if engine is not None and popt.max_steps is not None and popt.steps_taken >= popt.max_steps:
            break
        x, y, units = task.unpack(batch)
        x, y = x.to(state.device), y.to(state.device)
        taken = popt.steps_taken if engine is not None else len(state.history["step"])
        factor = lr_factor(
            taken, state.total_steps, cfg.training.lr_schedule, cfg.training.warmup_steps
        )
        for group in popt.param_groups:
            group["lr"] = cfg.training.lr * factor
        popt.zero_grad(set_to_none=True)
        if len(x) == 0:
            loss_value = float("nan")
            if engine is not None:
                noise_only_step(popt)
        else:
            with forward_autocast(state.precision, state.device):
                out = pmodel(x)
            per_sample = task.per_sample_loss(_float32(out), y)
            # private: the sum, so each sample's error is its own loss gradient (the update is
            # averaged over the expected batch by the optimizer, make_private's
            # backward_reduction="sum"); a batch mean would round (1/B) g under bf16
            (per_sample.sum() if engine is not None else per_sample.mean()).backward()
            if units is not None and engine is not None:
                popt.set_unit_ids(units.to(state.device))
            popt.step()
            loss_value = float(per_sample.detach().mean())
        if state.ema is not None:
            state.ema.update(_unwrapped(pmodel))
        seen += len(x)
        step = popt.steps_taken if engine is not None else len(state.history["step"]) + 1
        state.history["step"].append(step)
        state.history["loss"].append(loss_value)
        if engine is not None and popt.last_diagnostics.batch_units:
            state.diag.append(popt.last_diagnostics.as_dict())
        if engine is not None:
            _track_epsilon(state, engine, epoch_end=index + 1 == batches)
        rate = seen / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix(loss=f"{loss_value:.3f}", **state.bar_epsilon, img_s=f"{rate:.0f}")
    _fill_epsilon(state, engine)
    log.info("epoch %d done: %d samples, %.1f s", state.epoch + 1, seen, time.perf_counter() - t0)


def _float32(out: Any) -> Any:
    """A network output (tensor, or tuple/list of them) with low-precision floats in float32."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() and out.dtype != torch.float64 else out
    if isinstance(out, (tuple, list)):
        return type(out)(_float32(o) for o in out)
    return out


def _pretrain(cfg: RunConfig, task: Task, model: nn.Module, device: torch.device) -> dict[str, Any]:
    """Data-free pretraining on synthetic shapes (config only; see :mod:`.pretrain`)."""
    from dpkfc_med.probes.presets import get_preset

    p = cfg.pretrain
    alpha = (
        cfg.probes.alpha if cfg.probes.alpha is not None else get_preset(cfg.probes.preset).alpha
    )
    return pretrain_synthetic(
        model,
        PretrainSpec(steps=p.steps, batch_size=p.batch_size, lr=p.lr, seed=p.seed),
        loss=task.loss,
        spatial_shape=task.spatial_shape,
        num_classes=task.num_classes,
        spacing=task.spacing or (1.0,) * len(task.spatial_shape),
        alpha=alpha,
        device=device,
        cache_dir=(cfg.run_dir().parent / PRETRAIN_CACHE if p.cache_dir == "auto" else p.cache_dir),
        loss_id=f"{type(task).__module__}.{type(task).__qualname__}.loss",
        channels=task.in_channels,
    )


def _unwrapped(pmodel: nn.Module) -> nn.Module:
    """The network inside Opacus' ``GradSampleModule`` (itself when not wrapped)."""
    return getattr(pmodel, "_module", pmodel)


def noise_only_step(popt: Any) -> None:
    """Take the noisy step of an empty Poisson batch: zero clipped sum, full noise, one ledger step.

    An empty batch is part of the sampled mechanism and must still be noised and accounted.
    No forward/backward pass runs: per-sample gradient hooks of some layers (those Opacus
    computes with ``functorch.vmap``, e.g. ``PReLU``) cannot take a batch of zero samples, so
    every parameter is given an empty per-sample gradient ``[0, *shape]`` directly.
    """
    for p in popt.params:
        p.grad_sample = p.new_zeros((0, *p.shape))
    popt.step()


def _track_epsilon(state: _Run, engine: PrivacyEngine, *, epoch_end: bool = False) -> None:
    """After every noisy step: refresh the progress bar's epsilon and list grid steps.

    The bar shows ``eps_rdp``, the RDP accountant's epsilon after this very step (an upper bound
    on what was spent, cheap to compute), and -- when the stated accountant is another one --
    its exact value at the latest listed step, e.g. ``eps_prv=0.319@16``: fresh values after
    every step, none of them below what was spent at the step it names.
    """
    ledger = engine.ledger
    assert ledger is not None
    state.bar_epsilon["eps_rdp"] = format_epsilon(rdp_epsilon(ledger.events, ledger.delta))
    if epoch_end or on_epsilon_grid(ledger.steps, epsilon_rule(engine.accountant)):
        _list_epsilon(state, engine)


def _list_epsilon(state: _Run, engine: PrivacyEngine) -> None:
    """Add the current step to the epsilon history (exact value of the stated accountant)."""
    ledger = engine.ledger
    assert ledger is not None
    steps = state.history["epsilon_step"]
    if ledger.steps == 0 or (steps and steps[-1] >= ledger.steps):
        return
    steps.append(ledger.steps)
    eps = engine.get_epsilon()  # cached: the report asks again for this very ledger prefix
    if engine.accountant is not Accountant.RDP:
        name = engine.accountant.value
        state.bar_epsilon[f"eps_{name}"] = f"{format_epsilon(eps)}@{ledger.steps}"


def _fill_epsilon(state: _Run, engine: PrivacyEngine | None) -> None:
    """List the last step taken in the epsilon history (end of an epoch, or a stop)."""
    if engine is not None:
        _list_epsilon(state, engine)


def _checkpoint(
    state: _Run,
    path: Path,
    model: nn.Module,
    popt: Any,
    engine: PrivacyEngine | None,
    *,
    mid_epoch: bool = False,
) -> None:
    """Model, optimizer, engine (ledger, schedule) and history, written atomically.

    ``mid_epoch``: written on an interrupt inside an epoch; a resume repeats that epoch from
    its start (the plan's step cap still holds).
    """
    opt = popt.original_optimizer if hasattr(popt, "original_optimizer") else popt
    _atomic_torch_save(
        {
            "epoch": state.epoch,
            "mid_epoch": mid_epoch,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "engine": engine.state_dict() if engine is not None else None,
            "history": state.history,
            "diag": state.diag,
            "best": state.best,
            "ema": state.ema.state_dict() if state.ema is not None else None,
            "pretrain": state.pretrain,
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
    if "epsilon_step" not in state.history:  # a checkpoint from before per-step epsilon
        old = state.history.pop("epsilon", [])
        state.history["epsilon_step"] = [
            s for s in state.history["step"][: len(old)] if on_epsilon_grid(s, "geometric")
        ]
    state.pretrain = ck.get("pretrain")
    if state.ema is not None and ck.get("ema") is not None:
        state.ema.load_state_dict(ck["ema"])
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
    from dpkfc_med.report import (
        collect_environment,
        not_covered,
        shareable_config,
        split_report,
        write_report,
    )

    cfg, task, run_dir = state.cfg, state.task, state.run_dir
    metrics: dict[str, Any] = {"val": None, "test": None, "selected_epoch": state.best["epoch"]}
    if evaluate:
        final_state = copy.deepcopy(released_state_dict(state.eval_model(model)))
        if state.best["state"] is not None:
            model.load_state_dict(state.best["state"])
        bs = cfg.training.eval_batch_size
        metrics["val"] = task.evaluate(model, "val", state.device, bs, full=True)
        metrics["test"] = task.evaluate(model, "test", state.device, bs, full=True)
        _atomic_torch_save(
            {
                # shareable: no path, and not the epoch chosen on private validation data
                # (that stays in the custodian part's metrics.json)
                "model": released_state_dict(model),  # LoRA merged: a plain network
                "final_model": final_state,
                "config": shareable_config(cfg.to_dict()),
                "task": task_record(task),
            },
            run_dir / "model.pt",
        )
        write_json(run_dir / PRIVATE_DIR / "metrics.json", metrics)
        if hasattr(task, "after_training"):
            # split.json and overlays show private records: custodian part only
            task.after_training(model, run_dir / PRIVATE_DIR, state.device)  # type: ignore[attr-defined]
    full = build_report(state, model, engine, plan, fixes, status, metrics, collect_environment)
    full["privacy"]["not_covered"] = not_covered(full)
    report, custodian = split_report(full)
    write_report(report, run_dir, custodian=custodian)
    write_json(run_dir / RUN_JSON, {"status": status, "finished": _now(), "name": cfg.name})
    eps = report["privacy"]["epsilon"]["prv"] if report["privacy"]["epsilon"] else None
    return RunResult(run_dir, status, eps, metrics, report, custodian)


def _unit_note(task: Task, privacy: dict[str, Any]) -> dict[str, Any] | None:
    """The task's statement about the unit (several images per patient), with group privacy."""
    note = getattr(task, "unit_note", None)
    if not note:
        return None
    out = dict(note)
    k = int(out.get("images_per_patient") or 1)
    eps = (privacy.get("epsilon") or {}).get(privacy.get("accountant", "prv"))
    if k > 1 and eps is not None and privacy.get("delta") is not None:
        from dpkfc_med.units import group_privacy

        eps_k, delta_k = group_privacy(eps, privacy["delta"], k)
        out["per_patient"] = {"epsilon": eps_k, "delta": delta_k, "images_per_patient": k}
        out["statement"] = (
            f"The privacy unit is one image, but {out.get('dataset', 'this dataset')} holds up "
            f"to {k} images per patient ({out.get('source', 'see the dataset description')}). "
            f"Per patient, group privacy gives only about (epsilon, delta) = "
            f"({format_epsilon(eps_k)}, {delta_k:.3g}) = (k eps, k e^((k-1) eps) delta) with "
            f"k = {k}. Give a unit-id mapping (data.unit_ids) to protect patients directly."
        )
    return out


def task_record(task: Task) -> dict[str, Any]:
    """The task's public description kept in ``run.json`` (shapes, classes, unit, metric)."""
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
    snr: dict[str, list[float]] = {}
    for d in diag:
        for k, v in d.get("layer_snr", {}).items():
            snr.setdefault(k, []).append(v)
    out["mean_layer_snr"] = {k: float(np.mean(v)) for k, v in snr.items()}
    out["steps"] = len(diag)
    out["note"] = (
        "computed from un-noised private statistics; not covered by the privacy guarantee; "
        "for the data custodian only"
    )
    return out


def _history(state: _Run, engine: PrivacyEngine | None) -> dict[str, Any]:
    """The run's history, its epsilon curves rebuilt from the ledger (report.history)."""
    history = {k: v for k, v in state.history.items() if k != "epsilon_step"}
    if engine is None or engine.ledger is None:
        return {**history, "epsilon": [], "epsilon_step": [], "epsilon_rdp": []}
    curves = epsilon_history(
        engine.ledger, state.history["step"], state.history["epsilon_step"], engine.accountant
    )
    return {**history, **curves}


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
    """The privacy-report dict (schema ``dpkfc_med.privacy_report/2``)."""
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
        "randomness": {"source": "none", "valid_dp_release": False},
        "neighbouring_relation": f"add or remove one {task.privacy_unit}",
        "guarantee": f"{NO_GUARANTEE}: non-private training.",
        "hyperparameter_tuning": TUNING if cfg.training.select_epoch != "last" else TUNING_LAST,
        "ledger": {"events": [], "steps": 0, "note": "non-private run: no mechanism was executed"},
        "plan_history": [  # the data fingerprint stays in the run's working files
            {k: v for k, v in e.items() if k != "data_sha256"} for e in _plans(state.run_dir)
        ],
        "headline_warnings": [],
    }
    pre = None
    if engine is not None and plan is not None and engine.ledger is not None:
        eps = engine.ledger.all_epsilons()
        ledger = engine.ledger
        sigmas = [e.noise_multiplier for e in ledger.events] or [engine.noise_multiplier]
        source = engine.randomness
        warnings = []
        if source == "seeded":
            warnings.append(
                f"{NOT_VALID}: the noise and the Poisson sampling were seeded from "
                f"training.seed = {cfg.training.seed} (privacy.reproducible_noise: true), which "
                "this report publishes; anyone can replay them. Research use only."
            )
        # The looser cross-check accountants (RDP above PRV on every run calibrated to PRV)
        # are not a warning: the report states them on a neutral line under the verdict.
        privacy.update(
            {
                "randomness": {
                    "source": source,
                    "valid_dp_release": source != "seeded",
                    "note": {
                        "os-entropy": "PyTorch generators seeded from OS entropy; the seeds "
                        "are never written anywhere",
                        "os-csprng": "every draw from the OS CSPRNG (os.urandom), with "
                        "floating-point hardening",
                        "seeded": "seeded from the published training.seed: replayable",
                    }[source],
                },
                "headline_warnings": warnings,
                "epsilon": eps,
                "delta": ledger.delta,
                "sampler": "poisson",
                # One definition everywhere: q = 1/ceil(N/B), expected batch round(q N).
                "sample_rate": engine.sample_rate,
                "batch_size": min(cfg.training.batch_size, n_units),
                "steps_per_epoch": math.ceil(n_units / min(cfg.training.batch_size, n_units)),
                "expected_batch_size": ledger.meta.get("expected_batch_size"),
                "noise_multiplier": min(sigmas),
                "noise_multipliers": sorted(set(sigmas)),
                "max_grad_norm": engine.max_grad_norm,
                "processes": {
                    "world_size": int(ledger.meta.get("world_size", 1)),
                    "backend": ledger.meta.get("backend"),
                },
                "steps": ledger.steps,
                "planned_steps": plan["planned_steps"],
                "epochs": ledger.steps * engine.sample_rate,
                "guarantee": (
                    SEEDED_GUARANTEE.format(seed=cfg.training.seed)
                    if source == "seeded"
                    else GUARANTEE.format(
                        eps=format_epsilon(eps["prv"]),
                        delta=f"{ledger.delta:g}",
                        unit=task.privacy_unit,
                    )
                ),
                "ledger": ledger.to_dict(),
            }
        )
        if method.preconditioned:
            prov = engine.provenance()
            public = method is Method.DP_KFC_PUBLIC
            src = prov.get("probe_source") or {}
            overlap = bool(src.get("uses_private_data"))
            if overlap:
                warnings.append(
                    f"{PRIVATE_PRECONDITIONER}: the public proxy shares images with the "
                    "private training set (probes.allow_public_overlap: true); the "
                    "preconditioner depends on private records, which the stated guarantee "
                    "does NOT cover."
                )
            pre = {
                "uses_private_data": overlap,
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
                "coverage_shares": (prov.get("preconditioner") or {}).get("coverage_shares"),
                "eig_fallbacks": [
                    {**fb, "refresh_step": r["step"]}
                    for r in prov["refreshes"]
                    for fb in r.get("eig_fallbacks", [])
                ],
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
            "precision": state.precision.value,
            **({"backends": state.backends} if state.backends else {}),
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
            # a bound read off the private data (images per patient) stays with the custodian
            "max_samples_per_unit": task.max_samples_per_unit if task.max_samples_public else None,
            "unit_note": _unit_note(task, privacy),
        },
        "model": {
            "name": cfg.model.name,
            "num_params": sum(p.numel() for p in model.parameters()),
            "fixes": fixes,
            **finetune_report(model),  # finetune mode, trainable / frozen counts, weights
        },
        "privacy": privacy,
        "preconditioner": pre,
        "training": {
            "optimizer": cfg.training.optimizer,
            "lr": cfg.training.lr,
            "momentum": cfg.training.momentum,
            "weight_decay": cfg.training.weight_decay,
            "pretraining": state.pretrain,
            "lr_schedule": cfg.training.lr_schedule,
            "warmup_steps": cfg.training.warmup_steps,
            "weight_average": (
                None
                if state.ema is None
                else {
                    "decay": state.ema.decay,
                    "note": "exponential moving average of the released weights after each "
                    "noisy step (post-processing); validated, selected and released",
                }
            ),
            "epochs_planned": cfg.training.epochs,
            "batch_size": cfg.training.batch_size,  # B; the expected batch is privacy's q N
            "selected_epoch": state.best["epoch"],
            "select_epoch": cfg.training.select_epoch,
            "model_selection": (
                "the last epoch (post-processing)"
                if cfg.training.select_epoch == "last"
                else f"best validation {task.selection_metric} over epochs"
            ),
        },
        "history": _history(state, engine),
        "metrics": {"val": metrics.get("val"), "test": metrics.get("test")},
        "diagnostics": _diag_summary(state.diag),
        "environment": collect_environment(Path(__file__).resolve().parents[2]),
    }
