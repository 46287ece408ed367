"""How a run ended: the one home of the report's and the run folder's ``status`` values.

A leaf module (it imports nothing from dpkfc_med), so the engine's report handler, the training
run that writes ``run.json``, the bundle exporter and the report's own schema and sentences all
name the same two values.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["RunStatus"]


class RunStatus(str, Enum):
    """How a run ended (``status`` of the privacy report and of ``run.json``).

    A plain string compares equal to its member (``RunStatus.COMPLETE == "complete"``), so
    values read back from JSON need no conversion.

    Attributes:
        COMPLETE: Every planned step taken (or every epoch): the model is released.
        INCOMPLETE: Stopped before the plan's end (a deliberate stop, an interrupt or an
            error); the privacy spent so far is as stated and ``--resume`` continues it.
    """

    COMPLETE = "complete"
    INCOMPLETE = "incomplete"

    def __str__(self) -> str:
        """The plain value, as in the report (``"complete"``), also inside f-strings."""
        return self.value
