"""Experiment tracking (TensorBoard or MLflow) in two streams: shareable and custodian.

* The **shareable stream** is a view of the shareable privacy report: the epsilon after every
  noisy step (the RDP bound, and the stated accountant's on its step grid), the recipe (the
  run config without its paths, the privacy plan) and the released model's version (the
  SHA-256 of ``model.pt``, the package version, the run's status). It is written once, after
  the report, from ``privacy_report.json`` and ``model.pt`` alone, so it holds nothing the
  report's split did not already pass, and no time finer than the run's end: per-step wall
  times would give away step durations, which follow the secret Poisson batch sizes.
* The **custodian stream** is written live by MONAI's own handlers on the private trainer:
  the un-noised training loss and clipping diagnostics after every step, and the epoch's
  metrics (the spent epsilon and the un-noised validation score). Its default place is under
  the run's ``private_not_for_release/``; it goes elsewhere only where the user names a
  ``custodian_uri``.

``MLFLOW_TRACKING_URI`` is ignored: each stream goes only where :func:`plan_tracking` says.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from ignite.engine import Events

from dpkfc_med.engines.trainer import PrivacyEvents, PrivateTrainer
from dpkfc_med.report.custodian import PRIVATE_DIR

__all__ = [
    "CUSTODIAN_SUFFIX",
    "TRACKING_DIR",
    "TRACKING_EXTRA",
    "CustodianTracking",
    "ShareableTracking",
    "Tracking",
    "TrackingBackend",
    "TrackingPlan",
    "mlflow_location",
    "plan_tracking",
    "shareable_records",
]

log = logging.getLogger("dpkfc_med")

TRACKING_DIR = "tracking"
"""Folder of each stream's default place: ``<run>/tracking`` and ``<run>/private_not_for_release/
tracking``."""

TRACKING_EXTRA = "pip install 'dpkfc-med[tracking]'"
"""How to install the tracking packages (TensorBoard, MLflow)."""

CUSTODIAN_SUFFIX = f"-{PRIVATE_DIR}"
"""Appended to the custodian stream's MLflow run name, so a server's listing says what it is."""

_MLFLOW_DB = "mlflow.db"


class TrackingBackend(str, Enum):
    """Where the streams are written: nowhere, TensorBoard event files or an MLflow store."""

    NONE = "none"
    TENSORBOARD = "tensorboard"
    MLFLOW = "mlflow"


class Tracking(str, Enum):
    """The two streams of a run."""

    SHAREABLE = "shareable"
    CUSTODIAN = "custodian"


@dataclass(frozen=True)
class TrackingPlan:
    """Where a run's two streams go.

    Attributes:
        backend: TensorBoard or MLflow.
        shareable: the shareable stream's folder (TensorBoard) or tracking URI (MLflow).
        custodian: the custodian stream's folder or tracking URI.
        custodian_explicit: ``custodian`` was given by the user (``tracking.custodian_uri``),
            so the un-noised statistics may leave ``private_not_for_release/``.
        experiment: the MLflow experiment (both streams).
        run_name: the shareable stream's MLflow run name; the custodian's adds
            :data:`CUSTODIAN_SUFFIX`.
    """

    backend: TrackingBackend
    shareable: str
    custodian: str
    custodian_explicit: bool
    experiment: str
    run_name: str

    def location(self, stream: Tracking) -> str:
        """The folder or URI of one stream."""
        return self.shareable if stream is Tracking.SHAREABLE else self.custodian


def mlflow_location(value: str) -> tuple[str, str | None]:
    """``(tracking URI, artifact location)`` of a ``tracking.uri``-style value for MLflow.

    A folder becomes a SQLite store in it (``<folder>/mlflow.db``, artifacts in
    ``<folder>/artifacts``): MLflow refuses its file store from 3.13 on, and so does MONAI's
    ``MLFlowHandler``. A URI (``sqlite:///...``, ``http(s)://...``, ``databricks``) is kept;
    a server chooses its artifact location itself.

    Raises:
        ValueError: for a ``file://`` URI, naming the fix.
    """
    if value.startswith("file:"):
        raise ValueError(
            f"{value!r}: MLflow's file store is refused by MLflow (3.13 and later) and by MONAI's "
            "MLFlowHandler; give a folder (an MLflow SQLite store, mlflow.db, is made in it), a "
            "sqlite:///PATH/mlflow.db or a tracking server's http(s):// URI"
        )
    if "://" not in value and value != "databricks" and not value.startswith("databricks:"):
        folder = Path(value).expanduser().resolve()
        return f"sqlite:///{folder / _MLFLOW_DB}", (folder / "artifacts").as_uri()
    if value.startswith("sqlite:///"):
        folder = Path(value[len("sqlite:///") :]).parent
        return value, (folder / "artifacts").resolve().as_uri()
    return value, None


def plan_tracking(
    backend: str | TrackingBackend,
    run_dir: Path,
    *,
    uri: str | None = None,
    custodian_uri: str | None = None,
    experiment: str = "dpkfc-med",
    run_name: str = "run",
) -> TrackingPlan | None:
    """Where the two streams of a run in ``run_dir`` go (``None`` when tracking is off).

    Args:
        backend: ``none``, ``tensorboard`` or ``mlflow``.
        run_dir: the run directory.
        uri: the shareable stream's folder or MLflow URI; default ``<run_dir>/tracking``.
        custodian_uri: the custodian stream's; default
            ``<run_dir>/private_not_for_release/tracking``.
        experiment: the MLflow experiment.
        run_name: the MLflow run name.

    Raises:
        ModuleNotFoundError: the backend's package is missing, naming the extra to install.
    """
    backend = TrackingBackend(backend)
    if backend is TrackingBackend.NONE:
        return None
    _require(backend)
    shareable = uri or str(run_dir / TRACKING_DIR)
    custodian = custodian_uri or str(run_dir / PRIVATE_DIR / TRACKING_DIR)
    return TrackingPlan(
        backend, shareable, custodian, custodian_uri is not None, experiment, run_name
    )


def _require(backend: TrackingBackend) -> None:
    """Import the backend's packages now, so a missing one stops the run before any step."""
    try:
        if backend is TrackingBackend.MLFLOW:
            import mlflow  # noqa: F401
        else:
            import tensorboard  # noqa: F401
    except ImportError as err:
        raise ModuleNotFoundError(
            f"tracking.backend={backend.value!r} needs the {err.name} package: {TRACKING_EXTRA} "
            "(or set tracking.backend to none)"
        ) from None


@contextlib.contextmanager
def _without_tracking_env() -> Iterator[None]:
    """Hide ``MLFLOW_TRACKING_URI`` while MONAI's handler picks its store.

    MONAI's ``MLFlowHandler`` lets that variable override its ``tracking_uri``; a shell that
    points at a shared server would then receive the custodian stream.
    """
    saved = os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["MLFLOW_TRACKING_URI"] = saved


def _mlflow_handler(location: str, plan: TrackingPlan, run_name: str, **kw: Any) -> Any:
    """MONAI's ``MLFlowHandler`` writing to ``location`` and nowhere else."""
    from monai.handlers import MLFlowHandler

    tracking_uri, artifacts = mlflow_location(location)
    if tracking_uri.startswith("sqlite:///"):
        Path(tracking_uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    with _without_tracking_env():
        return MLFlowHandler(
            tracking_uri=tracking_uri,
            artifact_location=artifacts,
            experiment_name=plan.experiment,
            run_name=run_name,
            **kw,
        )


def _scalars(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a (nested) mapping, keyed ``a/b``."""
    out: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_scalars(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isfinite(value):
                out[name] = float(value)
    return out


class CustodianTracking:
    """The custodian stream, live: loss and clipping diagnostics per step, metrics per epoch.

    MONAI's ``TensorBoardStatsHandler`` or ``MLFlowHandler`` on the private trainer. After
    every step: ``loss`` (the batch's mean, un-noised) and the clipping diagnostics
    (``clipping/clipped_fraction``, the norms, per-layer shares, the batch's unit count, which
    the shareable stream never holds); after every epoch: ``engine.state.metrics`` (the spent
    epsilon and, on validated epochs, the un-noised validation score). Closed when the run
    completes or stops.

    Args:
        plan: where the streams go.
    """

    def __init__(self, plan: TrackingPlan) -> None:
        self.plan = plan
        self.handler: Any = None

    def attach(self, engine: PrivateTrainer) -> None:
        """Attach MONAI's handler to a private trainer."""
        where = self.plan.custodian
        if self.plan.backend is TrackingBackend.TENSORBOARD:
            from monai.handlers import TensorBoardStatsHandler

            self.handler = TensorBoardStatsHandler(
                log_dir=where, iteration_event_writer=self._write_step
            )
        else:
            self.handler = _mlflow_handler(
                where,
                self.plan,
                self.plan.run_name + CUSTODIAN_SUFFIX,
                iteration_logger=self._log_step,
                experiment_param={"dpkfc_med.stream": Tracking.CUSTODIAN.value},
            )
        self.handler.attach(engine)
        engine.add_event_handler(Events.COMPLETED, self.close)
        engine.add_event_handler(PrivacyEvents.RUN_STOPPED, self.close)
        if self.plan.custodian_explicit:
            log.warning(
                "tracking.custodian_uri: the custodian stream (un-noised losses, validation "
                "scores, clipping diagnostics) goes to %s, outside %s/; it is not covered by "
                "the privacy guarantee",
                where,
                PRIVATE_DIR,
            )

    @staticmethod
    def step_values(engine: PrivateTrainer) -> dict[str, float]:
        """The step's loss and clipping diagnostics (un-noised private statistics)."""
        values: dict[str, Any] = {"loss": engine.state.step_loss}
        diagnostics = getattr(engine.optimizer, "last_diagnostics", None)
        if engine.private and diagnostics is not None and diagnostics.batch_units:
            values["clipping"] = diagnostics.as_dict()
        return _scalars(values)

    def _write_step(self, engine: Any, writer: Any) -> None:  # MONAI's writer signature
        for tag, value in self.step_values(engine).items():
            writer.add_scalar(tag, value, engine.state.iteration)
        writer.flush()

    def _log_step(self, engine: PrivateTrainer) -> None:
        self.handler._log_metrics(self.step_values(engine), step=engine.state.iteration)

    def close(self, engine: PrivateTrainer) -> None:
        """Flush and close the stream (the run completed or stopped)."""
        if self.handler is not None:
            self.handler.close()


def shareable_records(report: Mapping[str, Any]) -> dict[str, Any]:
    """What the shareable stream holds, read off a shareable report only.

    Args:
        report: the shareable privacy report (``privacy_report.json``).

    Returns:
        ``{"epsilon": {name: [(step, value), ...]}, "params": {...}, "tags": {...}}``:
        ``epsilon_rdp`` after every noisy step and ``epsilon_<accountant>`` on the stated
        accountant's step grid; the recipe (the report's run config, which has no paths, and
        its privacy plan); the release (status, schema, config digest). Nothing else of the
        report is read: an allowlist, so a field added to the report later stays out.
    """
    history = report.get("history") or {}
    privacy = report.get("privacy") or {}
    series: dict[str, list[tuple[int, float]]] = {}
    steps = list(history.get("step") or [])
    rdp = list(history.get("epsilon_rdp") or [])
    if rdp and len(rdp) == len(steps):
        series["epsilon_rdp"] = [(int(s), float(e)) for s, e in zip(steps, rdp)]
    exact = list(history.get("epsilon") or [])
    grid = list(history.get("epsilon_step") or [])
    if exact and len(exact) == len(grid):
        name = f"epsilon_{history.get('epsilon_accountant') or privacy.get('accountant')}"
        series[name] = [(int(s), float(e)) for s, e in zip(grid, exact)]
    params: dict[str, Any] = {
        f"config.{k}": v for k, v in _flat((report.get("run") or {}).get("config") or {}).items()
    }
    for key in (
        "method",
        "accountant",
        "target_epsilon",
        "delta",
        "sampler",
        "sample_rate",
        "noise_multiplier",
        "max_grad_norm",
        "planned_steps",
        "neighbouring_relation",
    ):
        if privacy.get(key) is not None:
            params[f"privacy.{key}"] = privacy[key]
    run = report.get("run") or {}
    tags = {
        "dpkfc_med.stream": Tracking.SHAREABLE.value,
        "status": report.get("status"),
        "report.schema": report.get("schema"),
        "config_sha256": run.get("config_sha256"),
        "privacy.steps": privacy.get("steps"),
    }
    for name, value in (privacy.get("epsilon") or {}).items():
        tags[f"privacy.epsilon.{name}"] = value
    return {
        "epsilon": series,
        "params": params,
        "tags": {k: v for k, v in tags.items() if v is not None},
    }


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{path}."))
        else:
            out[path] = value
    return out


class ShareableTracking:
    """The shareable stream, written once after the privacy report (completed or stopped).

    Attach after :class:`~dpkfc_med.engines.handlers.PrivacyReportHandler`: it reads the
    report the run just wrote (:func:`shareable_records`) and ``model.pt`` (its SHA-256 is the
    released model's version). A failure here is logged, never raised: the run, its report and
    its model are already final.

    Args:
        plan: where the streams go.
        run_dir: the run directory (its ``privacy_report.json`` and ``model.pt``).
    """

    def __init__(self, plan: TrackingPlan, run_dir: Path) -> None:
        self.plan, self.run_dir = plan, Path(run_dir)

    def attach(self, engine: PrivateTrainer) -> None:
        """Attach after the report handler."""
        engine.add_event_handler(Events.COMPLETED, self)
        engine.add_event_handler(PrivacyEvents.RUN_STOPPED, self)

    def __call__(self, engine: Any = None) -> None:
        """Write the stream from the report on disk; log (not raise) a failure."""
        try:
            self.write(engine)
        except Exception as err:  # the run is final: a tracking failure must not undo it
            log.error(
                "the shareable tracking stream was not written to %s (%s: %s); the run, its "
                "report and its model are unaffected",
                self.plan.shareable,
                type(err).__name__,
                err,
            )

    def write(self, engine: Any = None) -> None:
        """Write the stream (raises on failure)."""
        report_path = self.run_dir / "privacy_report.json"
        report = json.loads(report_path.read_text(encoding="utf-8"))
        records = shareable_records(report)
        model = self.run_dir / "model.pt"
        if model.is_file():
            records["tags"]["model.sha256"] = hashlib.sha256(model.read_bytes()).hexdigest()
        from importlib.metadata import PackageNotFoundError, version

        with contextlib.suppress(PackageNotFoundError):
            records["tags"]["dpkfc_med.version"] = version("dpkfc-med")
        artifacts = [self.run_dir / f"privacy_report.{ext}" for ext in ("json", "md")]
        if self.plan.backend is TrackingBackend.TENSORBOARD:
            self._tensorboard(records)
        else:
            self._mlflow(records, [a for a in artifacts if a.is_file()], engine)

    def _tensorboard(self, records: dict[str, Any]) -> None:
        # Written by hand with the SummaryWriter MONAI's handler uses: MONAI's handlers write
        # the engine's state at its events, live, with each step's wall time.
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=self.plan.shareable)
        try:
            for name, points in records["epsilon"].items():
                for step, value in points:
                    writer.add_scalar(f"privacy/{name}", value, step)
            writer.add_text("recipe", _markdown_table(records["params"]))
            writer.add_text("release", _markdown_table(records["tags"]))
        finally:
            writer.close()

    def _mlflow(
        self, records: dict[str, Any], artifacts: list[Path], engine: PrivateTrainer
    ) -> None:
        import time

        from mlflow.entities import Metric, Param, RunTag

        handler = _mlflow_handler(self.plan.shareable, self.plan, self.plan.run_name)
        # MONAI's handler makes the experiment and the run and closes it; the values go in
        # batches (MLflow takes at most 100 params and 1000 metrics a request), with one
        # timestamp: the run's end, so no step's duration can be read off them.
        handler.start(engine)
        client, run_id = handler.client, handler.cur_run.info.run_id
        now = int(time.time() * 1000)
        metrics = [
            Metric(name, value, now, step)
            for name, points in records["epsilon"].items()
            for step, value in points
        ]
        params = [Param(k, _param_text(v)) for k, v in records["params"].items()]
        tags = [RunTag(k, str(v)) for k, v in records["tags"].items()]
        for i in range(0, len(params), 100):
            client.log_batch(run_id, params=params[i : i + 100])
        for i in range(0, len(tags), 100):
            client.log_batch(run_id, tags=tags[i : i + 100])
        for i in range(0, len(metrics), 1000):
            client.log_batch(run_id, metrics=metrics[i : i + 1000])
        for path in artifacts:
            client.log_artifact(run_id, str(path))
        handler.close()


def _param_text(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text[:6000]  # MLflow's limit on a param's value


def _markdown_table(values: Mapping[str, Any]) -> str:
    rows = "\n".join(f"| {k} | {_param_text(v)} |" for k, v in values.items())
    return "| field | value |\n|---|---|\n" + rows
