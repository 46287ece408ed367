"""Budget-safe checkpoints: after every epoch and on an interrupt, restored on resume.

A checkpoint holds the model, the optimizer, the privacy engine (ledger, preconditioner
schedule), the run's history, the weight average and the random states, written atomically.
On resume the ledger on disk wins when it holds more steps than the checkpoint (steps spent
after the last checkpoint stay spent), so a resumed run never under-reports.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ignite.engine import Events

from dpkfc_med.engines.handlers.history import RunLog
from dpkfc_med.engines.schedule import WeightAverage
from dpkfc_med.engines.trainer import PrivacyEvents, PrivateTrainer
from dpkfc_med.privacy.accounting import PrivacyLedger
from dpkfc_med.utils import atomic_write_bytes

__all__ = ["BudgetSafeCheckpointer", "atomic_torch_save"]


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file, then rename: never a half-written file."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def _base_optimizer(opt: Any) -> Any:
    return opt.original_optimizer if hasattr(opt, "original_optimizer") else opt


class BudgetSafeCheckpointer:
    """Write the run's checkpoint after every epoch and when an interrupt stops it.

    Args:
        path: The checkpoint file (``checkpoint.pt`` in the run directory).
        run_log: The run's history.
        model: The network whose weights are saved (not the per-sample wrapper).
        average: The weight average, if the run keeps one.
    """

    def __init__(
        self, path: Path, run_log: RunLog, model: torch.nn.Module, average: WeightAverage | None
    ) -> None:
        self.path, self.run_log, self.model, self.average = path, run_log, model, average

    def attach(self, engine: PrivateTrainer) -> None:
        """Attach after the validation handler (the checkpoint keeps its choice)."""
        engine.add_event_handler(Events.EPOCH_COMPLETED, self.save)
        engine.add_event_handler(PrivacyEvents.RUN_STOPPED, self.stopped)

    def stopped(self, engine: PrivateTrainer) -> None:
        """Ctrl-C or SIGTERM: keep the model of the steps already paid for."""
        if isinstance(engine.state.stop_error, KeyboardInterrupt):
            self.save(engine, mid_epoch=True)

    def save(self, engine: PrivateTrainer, *, mid_epoch: bool = False) -> None:
        """Write the checkpoint; ``mid_epoch``: a resume repeats the epoch from its start."""
        epoch = engine.state.epoch - 1 if mid_epoch else engine.state.epoch
        pe = engine.privacy_engine
        atomic_torch_save(
            {
                "epoch": max(0, epoch),
                "mid_epoch": mid_epoch,
                "model": self.model.state_dict(),
                "optimizer": _base_optimizer(engine.optimizer).state_dict(),
                "engine": pe.state_dict() if pe is not None else None,
                "nonprivate_steps": engine.nonprivate_steps,
                **self.run_log.state_dict(),
                "ema": self.average.state_dict() if self.average is not None else None,
                "torch_rng": torch.get_rng_state(),
                "numpy_rng": np.random.get_state(),
                "python_rng": random.getstate(),
            },
            self.path,
        )

    def restore(
        self, engine: PrivateTrainer, previous: PrivacyLedger | None, ledger_path: Path
    ) -> int:
        """Load the checkpoint into the trainer; returns the epochs it had completed.

        Args:
            engine: The trainer, its privacy engine already wired.
            previous: The ledger on disk (it wins when it holds more steps).
            ledger_path: Where the ledger continues to be written.
        """
        ck = torch.load(self.path, map_location=engine.state.device, weights_only=False)
        self.model.load_state_dict(ck["model"])
        _base_optimizer(engine.optimizer).load_state_dict(ck["optimizer"])
        self.run_log.load_state_dict(ck)
        if self.average is not None and ck.get("ema") is not None:
            self.average.load_state_dict(ck["ema"])
        torch.set_rng_state(ck["torch_rng"])
        np.random.set_state(ck["numpy_rng"])
        random.setstate(ck["python_rng"])
        epoch = int(ck["epoch"])
        engine.nonprivate_steps = int(ck.get("nonprivate_steps", len(self.run_log.history.step)))
        engine.state.epoch = epoch
        engine.state.iteration = epoch * int(engine.state.epoch_length or 0)
        pe = engine.privacy_engine
        if pe is not None and ck["engine"] is not None:
            pe.load_state_dict(ck["engine"])
            # Steps recorded on disk after the checkpoint were spent: never forget them.
            if previous is not None and previous.steps > pe.ledger.steps:
                pe.ledger.events = list(previous.events)
                popt: Any = engine.optimizer  # private: the engine's optimizer counts steps
                popt.steps_taken = previous.steps
            pe.ledger.path = ledger_path
            pe.ledger.save()
        return epoch
