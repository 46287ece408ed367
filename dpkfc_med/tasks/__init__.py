"""Tasks: what a run learns (:class:`TaskKind`), the task interface and each kind's builder.

``classification/`` and ``segmentation/`` implement :class:`~dpkfc_med.tasks.base.Task`;
:func:`~dpkfc_med.tasks.build.register_task` gives a kind its builder and
:func:`~dpkfc_med.tasks.build.build_task` builds the task of a run config. Only the
vocabulary loads with this package (the run config reads it); the rest loads on first use.
"""

from typing import Any

from dpkfc_med.tasks.kinds import TASK_KINDS, TaskKind

__all__ = ["TASK_KINDS", "Task", "TaskKind", "build_task", "register_task"]


def __getattr__(name: str) -> Any:
    if name == "Task":
        from dpkfc_med.tasks.base import Task

        return Task
    if name in ("build_task", "register_task"):
        from dpkfc_med.tasks import build

        return getattr(build, name)
    raise AttributeError(f"module 'dpkfc_med.tasks' has no attribute {name!r}")
