"""The task kinds: the one home of the ``data.task`` vocabulary.

Example:
    >>> TaskKind("segmentation") is TaskKind.SEGMENTATION
    True
    >>> TaskKind.CLASSIFICATION == "classification", f"{TaskKind.SEGMENTATION}"
    (True, 'segmentation')
"""

from __future__ import annotations

from enum import Enum

__all__ = ["TASK_KINDS", "TaskKind"]


class TaskKind(str, Enum):
    """What a run learns (``data.task`` of a run config, ``task.kind`` of a report).

    Compares equal to, hashes like and formats as its plain string value, so YAML and JSON
    strings keep working.

    Attributes:
        CLASSIFICATION: One label per image; targets ``[M]``.
        SEGMENTATION: One label per voxel (or pixel); targets ``[M, *spatial]``.
    """

    CLASSIFICATION = "classification"
    SEGMENTATION = "segmentation"

    def __str__(self) -> str:
        return self.value


TASK_KINDS: tuple[str, ...] = tuple(k.value for k in TaskKind)
"""The accepted ``data.task`` values, in declaration order."""
