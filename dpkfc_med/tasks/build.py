"""A run's task from its config: the registry of task builders, the data-field checks, shards.

Each :class:`~dpkfc_med.tasks.kinds.TaskKind` has one builder, registered with
:func:`register_task`; :func:`build_task` validates the data fields that apply to the task,
calls the builder of ``data.task`` (loading and validating every case or image), takes a
site's shard for federated runs, and for ``dp-kfc-public`` loads the public proxy and refuses
one that overlaps the private data.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch.utils.data import Subset

from dpkfc_med.errors import ConfigError
from dpkfc_med.methods import Method
from dpkfc_med.tasks.base import RunConfig, Task
from dpkfc_med.tasks.classification.task import classification_task
from dpkfc_med.tasks.kinds import TaskKind

__all__ = ["TASK_BUILDERS", "TaskBuilder", "build_task", "register_task", "task_builder"]

TaskBuilder = Callable[["RunConfig", "str | None"], Task]
"""``builder(cfg, data_path) -> Task``: the task of ``cfg`` (``data_path`` overrides the folder)."""

TASK_BUILDERS: dict[TaskKind, TaskBuilder] = {}
"""The builder of each task kind (``data.task``), filled by :func:`register_task`."""


def register_task(kind: TaskKind | str, builder: TaskBuilder) -> TaskBuilder:
    """Register ``builder`` as the one builder of the task kind ``kind``.

    Raises:
        ValueError: ``kind`` is no :class:`TaskKind`, or already has a builder.
    """
    kind = TaskKind(kind)
    if kind in TASK_BUILDERS:
        raise ValueError(f"task kind {kind.value!r} already has a builder registered")
    TASK_BUILDERS[kind] = builder
    return builder


def task_builder(kind: TaskKind | str) -> TaskBuilder:
    """The registered builder of ``kind``.

    Raises:
        ConfigError: ``kind`` has no builder (naming the kinds that have one).
    """
    try:
        return TASK_BUILDERS[TaskKind(kind)]
    except (KeyError, ValueError):
        known = ", ".join(repr(k.value) for k in TASK_BUILDERS)
        raise ConfigError(
            [f"data.task={str(kind)!r}: no task builder registered; known: {known}"]
        ) from None


def _segmentation_task(cfg: RunConfig, data_path: str | None = None) -> Task:
    # Imported when used: MONAI transforms and readers are only needed for segmentation.
    from dpkfc_med.tasks.segmentation.build import build

    return build(cfg, data_path)


register_task(TaskKind.CLASSIFICATION, classification_task)
register_task(TaskKind.SEGMENTATION, _segmentation_task)


def _data_field_problems(cfg: RunConfig) -> list[str]:
    d, problems = cfg.data, []
    if d.task != TaskKind.CLASSIFICATION:
        # data.num_classes is shared: a segmentation folder without dataset.json labels needs it
        if d.unit_ids is not None:
            problems.append(
                f"data.unit_ids: applies to classification only; a {d.task} folder has one "
                "unit per case: drop the field"
            )
    elif d.slices.axis is not None:
        problems.append(
            "data.slices: applies to segmentation (2D training on slices of volumes); drop "
            "it for classification"
        )
    if d.num_classes is not None and (isinstance(d.num_classes, bool) or d.num_classes < 2):
        problems.append(f"data.num_classes={d.num_classes!r}: must be an integer >= 2 (or null)")
    if d.shard is not None:
        ok = (
            isinstance(d.shard, list | tuple)
            and len(d.shard) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in d.shard)
            and 0 <= d.shard[0] < d.shard[1]
        )
        if not ok:
            problems.append(
                f"data.shard={d.shard!r}: must be [k, n] with 0 <= k < n (site k of n), or null"
            )
    return problems


def build_task(
    cfg: RunConfig, data_path: str | Path | None = None, *, public_probes: bool = True
) -> Task:
    """Load and validate the private data of ``cfg`` into a task.

    Args:
        cfg: The run configuration.
        data_path: Another dataset of the same task (evaluation); default ``cfg.data.path``.
        public_probes: For ``dp-kfc-public``, load the public proxy now and refuse one that
            overlaps the private training data, so that the run never starts; kept in
            ``task.extra["public_source"]``. Evaluation passes ``False``.

    Raises:
        ConfigError: A data field that does not apply, or a public proxy that overlaps.
        DataValidationError: Bad data or unit-id mapping (every problem named).
    """
    if problems := _data_field_problems(cfg):
        raise ConfigError(problems, "data")
    task = task_builder(cfg.data.task)(cfg, None if data_path is None else str(data_path))
    if cfg.data.shard is not None:
        k, n = cfg.data.shard
        units = len(task.train_set)  # type: ignore[arg-type]
        if n > units:
            raise ConfigError(
                [f"data.shard={[k, n]}: {n} shards of {units} training units leave some empty"],
                "data",
            )
        task.train_set = Subset(task.train_set, list(range(k, units, n)))
        task.data_record["shard"] = {"site": k, "sites": n, "units_of_all_sites": units}
    if public_probes and cfg.method_enum is Method.DP_KFC_PUBLIC:
        task.extra["public_source"] = task.probe_source(cfg)
    return task
