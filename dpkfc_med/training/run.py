"""A run from a config: validate, open, build the private engine, train, release, report.

Order of operations (so that bad input never leaves anything that looks like a run):

1. load and validate data, build and fix the model, decide how the run opens (fresh, from its
   checkpoint, or from its ledger alone) and check the privacy plan (:mod:`.opening`);
2. only then create the run directory, mark it ``incomplete``, append the config and the plan
   to ``config_history.yaml`` / ``plan.json`` and start (or continue) the ledger;
3. train with :class:`~dpkfc_med.engines.PrivateTrainer` and its handlers: the ledger is
   rewritten before every noisy update, a checkpoint (model, optimizer, ledger, schedule) is
   written atomically after every epoch and on Ctrl-C/SIGTERM;
4. evaluate the selected model, write the model, the shareable privacy report and the
   custodian report (``private_not_for_release/``), and mark the run ``complete``.

An exception or interrupt writes the report with ``status: incomplete`` (the privacy spent is
the ledger's, which is never behind), says what was spent and how to continue, and re-raises.
"""

from __future__ import annotations

import copy
import logging
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Events
from torch import nn
from torch.utils.data import DataLoader

from dpkfc_med.engines import PrivateTrainer, RunInterrupted
from dpkfc_med.engines.handlers import (
    BudgetSafeCheckpointer,
    EpochSelectionHandler,
    HistoryHandler,
    LrScheduleHandler,
    ModelReleaseHandler,
    PrivacyBudgetHandler,
    PrivacyReportHandler,
    ProgressBarHandler,
    RunLog,
    WeightAverageHandler,
    atomic_torch_save,
)
from dpkfc_med.engines.handlers.tracking import (
    CustodianTracking,
    ShareableTracking,
    TrackingPlan,
    plan_tracking,
)
from dpkfc_med.engines.precision import (
    Precision,
    backend_settings,
    check_precision,
    resolve_device,
)
from dpkfc_med.engines.schedule import WeightAverage
from dpkfc_med.models.finetune import finetune_report, released_state_dict
from dpkfc_med.privacy.adambc import DPAdamBC
from dpkfc_med.privacy.engine import PrivacyEngine
from dpkfc_med.report import (
    collect_environment,
    shareable_config,
    split_report,
    write_report,
)
from dpkfc_med.report.custodian import PRIVATE_DIR
from dpkfc_med.report.record import Mechanism, RunRecord, build_report
from dpkfc_med.report.sections import (
    DataSection,
    HistorySnapshot,
    ModelSection,
    RunSection,
    TaskSection,
    TrainingSection,
    snapshot_ledger,
)
from dpkfc_med.report.status import RunStatus
from dpkfc_med.tasks.base import Task
from dpkfc_med.tasks.build import build_task
from dpkfc_med.training.config import ConfigError, Method, RunConfig
from dpkfc_med.training.opening import (
    PlanError,
    RunPlan,
    carry_ledger,
    open_run,
    start_run_files,
    stored_plans,
)
from dpkfc_med.training.pretrain import pretrain
from dpkfc_med.training.run_folder import (
    CHECKPOINT,
    LEDGER,
    RUN_JSON,
    check_output_dir,
    discard_run_dir,
    nothing_spent,
    now,
    setup_logging,
    stopped_message,
)
from dpkfc_med.training.setup import (
    build_run_model,
    head_first_handler,
    make_optimizer,
    recipe_before_task,
    seed_everything,
    settle_recipe,
    task_record,
)
from dpkfc_med.utils import write_json

__all__ = ["RunInterrupted", "RunResult", "train"]

log = logging.getLogger("dpkfc_med")


@dataclass
class RunResult:
    """What a finished run returns."""

    run_dir: Path
    status: str
    epsilon: float | None
    metrics: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)
    custodian: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Run:
    """What one run is made of (the engine and its handlers own what changes while it trains)."""

    cfg: RunConfig
    task: Task
    run_dir: Path
    device: torch.device
    precision: Precision
    model: nn.Module
    fixes: list[dict[str, Any]]
    plan: RunPlan
    run_log: RunLog
    average: WeightAverage | None = None
    backends: dict[str, bool] = field(default_factory=dict)
    trainer: Any = None

    def released(self) -> nn.Module:
        """The network that is validated, selected and released: the weight average if on."""
        return self.average.module if self.average is not None else self.model

    def finished(self, trainer: Any) -> bool:
        """Every epoch done, or every planned step taken."""
        if trainer.state.epoch >= self.cfg.training.epochs:
            return True
        return self.plan.all_spent(trainer.steps_taken)


def train(
    cfg: RunConfig,
    *,
    data_path: str | None = None,
    resume: bool = False,
    stop_after_epochs: int | None = None,
    instrument: Callable[[PrivacyEngine, Any], None] | None = None,
    task: Task | None = None,
    network: tuple[nn.Module, list[dict[str, Any]]] | None = None,
    handlers: Sequence[Any] = (),
    decollate: bool = False,
) -> RunResult:
    """Run the configured training end to end and write the run directory.

    Args:
        cfg: the validated configuration.
        data_path: override of ``cfg.data.path``.
        resume: continue the run in ``cfg.run_dir()``: from its last checkpoint, or -- when it
            stopped before the first one -- from the initial model with the spent steps carried
            in the ledger. The plan continues exactly unless ``training.epochs`` or
            ``privacy.noise_multiplier`` changed; then the remaining steps are re-planned so
            that the whole ledger stays within the target (:mod:`.opening`). Other changes are
            refused.
        stop_after_epochs: stop (as if interrupted) after this many epochs of this call;
            for training in slices (resume with ``resume=True``).
        instrument: called once as ``instrument(engine, private_optimizer)`` after the
            mechanism is wired and before the first step (private methods only); the
            empirical privacy audit uses it to add its canaries to the exact mechanism.
        task: the task, built elsewhere (a MONAI bundle's data and loss,
            :mod:`dpkfc_med.bundle.zoo`); default :func:`~.tasks.build_task` of ``cfg``.
        network: ``(model, fixes)``, the DP-compatible network built elsewhere with its fixes;
            default :func:`~.setup.build_run_model` of ``cfg``.
        handlers: more handlers for the trainer (MONAI's ``StatsHandler``, ...), attached after
            the run's own; what they record from private data is the custodian's.
        decollate: per-sample ``engine.state.output`` (MONAI's default; a bundle's handlers
            expect it).

    Returns:
        :class:`RunResult` with the status, epsilon and final metrics.
    """
    if cfg.training.threads:
        torch.set_num_threads(cfg.training.threads)
    device = resolve_device(cfg.training.device)
    try:
        precision = check_precision(cfg.training.precision, device)
    except ValueError as err:
        raise ConfigError([str(err)]) from None
    # ---------------------------------------------------------------- 1. validate all input
    run_dir = cfg.run_dir()
    # a failure before any noisy step then leaves nothing (building the task may write into
    # the run folder already: a DICOM folder's conversion cache)
    fresh = not run_dir.exists()
    try:
        cfg = recipe_before_task(cfg)  # recipe: auto chooses crops per unit before the task
        task = build_task(cfg, data_path) if task is None else task
        seed_everything(cfg.training.seed)
        model, fixes = build_run_model(cfg, task) if network is None else network
        model.to(device)
        n_units = len(task.train_set)  # type: ignore[arg-type]
        if n_units == 0:
            raise PlanError("the training split is empty")
        cfg, batch = settle_recipe(cfg, task, model, n_units)
        steps_per_epoch = max(1, math.ceil(n_units / batch))
        tracking = _tracking(cfg, run_dir)  # a missing package stops the run before its folder
        opening = open_run(cfg, task, run_dir, resume, n_units, steps_per_epoch)
        check_output_dir(run_dir)
    except Exception:  # a refusal after the task wrote into a new folder (a DICOM cache)
        if fresh and run_dir.exists() and nothing_spent(run_dir, 0):
            discard_run_dir(run_dir)
        raise
    # ---------------------------------------------------------------- 2. start the run
    run: _Run | None = None
    try:
        start_run_files(cfg, task, run_dir, opening)
        setup_logging(run_dir)
        if opening.privacy is not None:
            log.info("privacy plan (%s): %s", opening.kind, opening.privacy.describe())
        run = _Run(
            cfg, task, run_dir, device, precision, model, fixes, opening,
            RunLog(selection_metric=task.selection_metric),
        )  # fmt: skip
        if cfg.pretrain.steps and not opening.from_checkpoint:  # a checkpoint holds its weights
            run.run_log.pretrain = pretrain(cfg, task, model, device)
        if cfg.training.ema_decay is not None:  # copied before any wrapper hooks the model
            run.average = WeightAverage(model, cfg.training.ema_decay)
        run.trainer = _build_trainer(run, batch, steps_per_epoch, instrument, decollate)
        for handler in handlers:
            handler.attach(run.trainer)
        # ---------------------------------------------------------------- 3. train
        trainer = run.trainer
        release = ModelReleaseHandler(lambda: _release(run), run.finished)
        release.attach(trainer)  # before the report, which lists the release's metrics
        reporter = PrivacyReportHandler(lambda st: _finish(run, st, release.metrics), run.finished)
        reporter.attach(trainer)  # last: it sees every other handler's state
        if tracking is not None:  # after the report: the shareable stream is read off it
            ShareableTracking(tracking, run_dir).attach(trainer)
        if stop_after_epochs is not None:
            trainer.add_event_handler(
                Events.EPOCH_COMPLETED(once=trainer.state.epoch + stop_after_epochs),
                lambda engine: engine.terminate(),
            )
        with backend_settings(device) as run.backends:
            if run.finished(trainer):  # a resumed run whose last epoch was already done
                release.completed(trainer)
                reporter.completed(trainer)
            else:
                trainer.run()
    except KeyboardInterrupt:
        if run is None:
            raise
        raise RunInterrupted(
            stopped_message(run.run_dir, run.cfg, run.trainer, "interrupted")
        ) from None
    except Exception as err:  # incl. BudgetExhaustedError: the report says what was spent
        began = run.trainer.state.iteration if run is not None and run.trainer is not None else 0
        if fresh and nothing_spent(run_dir, began):
            discard_run_dir(run_dir)
            note = (
                "stopped before the first noisy step: nothing was spent, and the new run folder "
                f"{run_dir} was removed; fix the error and run the same command again"
            )
            if hasattr(err, "add_note"):  # shown after the error (the CLI prints notes)
                err.add_note(note)
            else:  # Python 3.10
                print(note, file=sys.stderr)
        elif run is not None:
            print(
                stopped_message(run.run_dir, run.cfg, run.trainer, "stopped by an error"),
                file=sys.stderr,
            )
        raise
    return reporter.result


def _build_trainer(
    run: _Run,
    batch: int,
    steps_per_epoch: int,
    instrument: Callable[[PrivacyEngine, Any], None] | None,
    decollate: bool = False,
) -> PrivateTrainer:
    """The private (or plain) mechanism wired into a trainer with the run's handlers."""
    cfg, task, model, device, plan = run.cfg, run.task, run.model, run.device, run.plan.privacy
    method = cfg.method_enum
    optimizer = make_optimizer(cfg, model)
    loader: Any = DataLoader(
        task.train_set,
        batch_size=batch,
        shuffle=not method.private,
        generator=torch.Generator().manual_seed(cfg.training.seed),
        collate_fn=task.extra.get("collate"),
    )
    engine: PrivacyEngine | None = None
    network: nn.Module = model
    popt: Any = optimizer
    ledger_path = run.run_dir / LEDGER
    if method.private:
        assert plan is not None
        engine, network, popt, loader = _make_private(run, optimizer, loader)
    total_steps = plan.planned_steps if plan is not None else cfg.training.epochs * steps_per_epoch
    log_ = run.run_log
    handlers: list[Any] = [LrScheduleHandler(
        cfg.training.lr, total_steps, cfg.training.lr_schedule, cfg.training.warmup_steps
    )]  # fmt: skip
    if cfg.training.head_first_epochs:
        handlers.append(head_first_handler(model, cfg))
    if plan is not None:
        handlers.append(PrivacyBudgetHandler(log_, plan.planned_steps))
    handlers.append(HistoryHandler(log_))
    if run.average is not None:
        handlers.append(WeightAverageHandler(run.average))
    handlers.append(ProgressBarHandler(log_, cfg.training.progress))
    handlers.append(
        EpochSelectionHandler(
            log_,
            evaluate=lambda m: task.evaluate(m, "val", device, cfg.training.eval_batch_size).get(
                task.selection_metric, float("nan")
            ),
            released=run.released,
            eval_every=cfg.training.eval_every,
            select_epoch=cfg.training.select_epoch,
            finished=run.finished,
        )
    )
    tracking = _tracking(cfg, run.run_dir)
    if tracking is not None:  # after validation and the epsilon: it logs both per epoch
        handlers.append(CustodianTracking(tracking))
    checkpointer = BudgetSafeCheckpointer(run.run_dir / CHECKPOINT, log_, model, run.average)
    handlers.append(checkpointer)
    trainer = PrivateTrainer(
        device=device,
        max_epochs=cfg.training.epochs,
        train_data_loader=loader,
        network=network,
        optimizer=popt,
        per_sample_loss=task.per_sample_loss,
        privacy_engine=engine,
        unpack=task.unpack,
        precision=run.precision,
        epoch_length=steps_per_epoch,
        train_handlers=handlers,
        decollate=decollate,
        max_physical_batch=cfg.training.max_physical_batch,
    )
    if run.plan.from_checkpoint:
        checkpointer.restore(trainer, run.plan.previous, ledger_path)
    elif engine is not None and run.plan.previous is not None:
        # ledger only: the initial model, the spent steps carried
        carry_ledger(engine, popt, run.plan.previous, ledger_path)
    elif engine is not None:
        engine.ledger.save()  # type: ignore[union-attr]
    if engine is not None and instrument is not None:
        instrument(engine, popt)
    return trainer


def _tracking(cfg: RunConfig, run_dir: Path) -> TrackingPlan | None:
    """Where the run's tracking streams go (``tracking``), or ``None`` when off."""
    t = cfg.tracking
    try:
        return plan_tracking(
            t.backend,
            run_dir,
            uri=t.uri,
            custodian_uri=t.custodian_uri,
            experiment=t.experiment,
            run_name=cfg.name,
        )
    except ModuleNotFoundError as err:
        raise ConfigError([str(err)]) from None


def _make_private(
    run: _Run, optimizer: Any, loader: Any
) -> tuple[PrivacyEngine, nn.Module, Any, Any]:
    """The privacy engine's mechanism: Poisson loader, per-sample wrapper, private optimizer."""
    cfg, task, plan = run.cfg, run.task, run.plan.privacy
    assert plan is not None
    method = cfg.method_enum
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
    if method.scaled:
        kw = {"stp_eps": cfg.privacy.stp_eps}
    if method.preconditioned and cfg.training.progress:  # the first refresh can take minutes
        print(
            f"{method.value}: building the preconditioner from {cfg.probes.num_probes} synthetic "
            "probes (no data) before the first step ...",
            file=sys.stderr,
            flush=True,
        )
    network, popt, private_loader = engine.make_private(
        module=run.model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=plan.noise_multiplier,
        max_grad_norm=cfg.privacy.max_grad_norm,
        delta=plan.delta,
        method=method.mechanism or method,  # private methods always have one
        max_steps=plan.planned_steps,
        backward_reduction="sum",  # per-sample errors exact whatever the batch size
        ledger_path=None if run.plan.previous is not None else run.run_dir / LEDGER,
        clipping=cfg.privacy.clipping,
        mechanism_extra={
            "precision": run.precision,
            "unit": task.privacy_unit,
            "max_samples_per_unit": task.max_samples_per_unit,
        },
        **kw,
    )
    if method.preconditioned and cfg.training.progress and engine.refreshes:
        print(
            f"{method.value}: preconditioner built in {engine.refreshes[0]['seconds']:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    plan_r = engine.refresh_plan
    if plan_r.get("rule") == "auto":
        log.info(
            "preconditioner refresh every %d steps (refresh_every: auto; refreshes estimated at "
            "%.1f%% of training time, budget %g%%; set probes.refresh_every to an integer to "
            "choose the period yourself)",
            plan_r["refresh_every"],
            100 * plan_r["estimated_share"],
            100 * plan_r["budget"],
        )
    if isinstance(optimizer, DPAdamBC):  # the engine set its noise variance
        phi = optimizer.param_groups[0]["noise_variance"]
        log.info("DP-AdamBC: noise variance (sigma C / B)^2 = %.3g subtracted", phi)
    return engine, network, popt, private_loader


def _release(run: _Run) -> dict[str, Any]:
    """Evaluate the selected weights, write ``model.pt`` and the custodian's metrics."""
    cfg, task, model, run_dir = run.cfg, run.task, run.model, run.run_dir
    best = run.run_log.best
    final_state = copy.deepcopy(released_state_dict(run.released()))
    if best.state is not None:
        model.load_state_dict(best.state)
    bs = cfg.training.eval_batch_size
    metrics: dict[str, Any] = {"selected_epoch": best.epoch}
    metrics["val"] = task.evaluate(model, "val", run.device, bs, full=True)
    metrics["test"] = task.evaluate(model, "test", run.device, bs, full=True)
    atomic_torch_save(
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
        task.after_training(model, run_dir / PRIVATE_DIR, run.device)  # type: ignore[attr-defined]
    return metrics


def _finish(run: _Run, status: RunStatus | str, released: dict[str, Any] | None) -> RunResult:
    """Freeze the run record and write the report (with the release's metrics, if released)."""
    status = RunStatus(status)
    if released is None or status is not RunStatus.COMPLETE:  # a stop lists no release
        released = {"val": None, "test": None, "selected_epoch": run.run_log.best.epoch}
    metrics: dict[str, Any] = released
    full = build_report(_record(run, status, metrics))
    report, custodian = split_report(full)
    write_report(report, run.run_dir, custodian=custodian)
    write_json(
        run.run_dir / RUN_JSON, {"status": status.value, "finished": now(), "name": run.cfg.name}
    )
    eps = report["privacy"]["epsilon"]["prv"] if report["privacy"]["epsilon"] else None
    return RunResult(run.run_dir, status, eps, metrics, report, custodian)


def _record(run: _Run, status: RunStatus, metrics: dict[str, Any]) -> RunRecord:
    """The frozen record of the run the report is built from."""
    cfg, task, trainer, log_ = run.cfg, run.task, run.trainer, run.run_log
    method = cfg.method_enum
    engine = trainer.privacy_engine
    mechanism = None
    if engine is not None and engine.ledger is not None and run.plan.privacy is not None:
        mechanism = Mechanism(
            ledger=snapshot_ledger(engine.ledger),
            accountant=engine.accountant.value,
            target_epsilon=cfg.privacy.target_epsilon,
            planned_steps=int(run.plan.privacy.planned_steps),
            sample_rate=engine.sample_rate,
            noise_multiplier=engine.noise_multiplier,
            max_grad_norm=engine.max_grad_norm,
            randomness=engine.randomness,
            batch_size=cfg.training.batch_size,
            seed=cfg.training.seed,
            provenance=engine.provenance() if method.preconditioned else None,
            public_probes=method is Method.DP_KFC_PUBLIC,
        )
    t = cfg.training
    average = run.average
    return RunRecord(
        status=status,
        method=method.value,
        accountant=cfg.privacy.accountant,
        privacy_unit=task.privacy_unit,
        run=RunSection(
            name=cfg.name,
            run_dir=str(run.run_dir),
            config_sha256=cfg.sha256(),
            config=cfg.to_dict(),
            seed=t.seed,
            device=str(run.device),
            precision=run.precision.value,
            backends=run.backends or None,
        ),
        task=TaskSection(task.kind, task.spatial_dims, task.num_classes, task.label_names),
        data=DataSection(
            record=task.data_record,
            num_train_units=len(task.train_set),  # type: ignore[arg-type]
            privacy_unit=task.privacy_unit,
            # a bound read off the private data (images per patient) stays with the custodian
            max_samples_per_unit=task.max_samples_per_unit if task.max_samples_public else None,
        ),
        model=ModelSection(
            name=cfg.model.name,
            num_params=sum(p.numel() for p in run.model.parameters()),
            fixes=run.fixes,
            finetune=finetune_report(run.model),  # mode, trainable / frozen counts, weights
        ),
        training=TrainingSection(
            optimizer=t.optimizer,
            lr=t.lr,
            momentum=t.momentum,
            weight_decay=t.weight_decay,
            pretraining=log_.pretrain,
            recipe_mode=t.recipe,
            recipe_fields=cfg.recipe_rows,
            lr_schedule=t.lr_schedule,
            warmup_steps=t.warmup_steps,
            average_decay=None if average is None else average.decay,
            epochs_planned=t.epochs,
            batch_size=t.batch_size,
            selected_epoch=log_.best.epoch,
            select_epoch=t.select_epoch,
            selection_metric=task.selection_metric,
        ),
        history=HistorySnapshot.of(log_.history.as_dict()),
        metrics=metrics,
        diagnostics=log_.diag,
        plan_history=stored_plans(run.run_dir),
        environment=collect_environment(Path(__file__).resolve().parents[2]),
        mechanism=mechanism,
        secure_rng=bool(cfg.privacy.secure_rng),
        unit_note=getattr(task, "unit_note", None),
        # an epoch an interrupt or error cut short does not count
        epochs=max(0, trainer.state.epoch - (trainer.state.stop_error is not None)),
    )
