"""A run's task from its config: each ``data.task``'s builder, the data-field checks, shards.

:func:`build_task` validates the data fields that apply to the task, builds the task (loading
and validating every case or image), takes a site's shard for federated runs, and for
``dp-kfc-public`` loads the public proxy and refuses one that overlaps the private data.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch.utils.data import Subset

from dpkfc_med.methods import Method
from dpkfc_med.training.config import ConfigError, RunConfig
from dpkfc_med.training.tasks import Task, classification_task

__all__ = ["TASK_BUILDERS", "build_task"]


def _segmentation_task(cfg: RunConfig, data_path: str | None = None) -> Task:
    # Imported when used: MONAI transforms and readers are only needed for segmentation.
    from dpkfc_med.training.segmentation_build import build

    return build(cfg, data_path)


TASK_BUILDERS: dict[str, Callable[[RunConfig, str | None], Task]] = {
    "classification": classification_task,
    "segmentation": _segmentation_task,
}
"""The builder of each ``data.task``."""


def _data_field_problems(cfg: RunConfig) -> list[str]:
    d, problems = cfg.data, []
    if d.task != "classification":
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
    builder = TASK_BUILDERS.get(cfg.data.task)
    if builder is None:
        raise ConfigError([f"data.task={cfg.data.task!r}: no pipeline registered"])
    task = builder(cfg, None if data_path is None else str(data_path))
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
