"""The release handler: the model is released only when the run is finished, before its report."""

from __future__ import annotations

import pytest
import torch
from ignite.engine import Events

from dpkfc_med.engines.handlers import (
    ModelReleaseHandler,
    PrivacyReportHandler,
    atomic_torch_save,
)
from dpkfc_med.engines.trainer import unwrapped
from dpkfc_med.privacy.accounting import PrivacyLedger


def _wire(engine, tmp_path):
    """Release (writes model.pt) then report, as a run attaches them; what each saw."""
    seen: dict[str, object] = {}

    def finished(e) -> bool:
        return e.state.epoch >= e.state.max_epochs

    def release() -> dict[str, float]:
        # the spend this model carries is on disk before the model is
        seen["ledger_steps"] = PrivacyLedger.load(tmp_path / "ledger.json").steps
        seen["steps"] = engine.steps_taken
        atomic_torch_save({"model": unwrapped(engine.network).state_dict()}, tmp_path / "model.pt")
        return {"test": 0.75}

    def finish(status: str) -> str:
        seen["report"] = (status, (tmp_path / "model.pt").exists(), releaser.metrics)
        return status

    releaser = ModelReleaseHandler(release, finished)
    releaser.attach(engine)
    PrivacyReportHandler(finish, finished).attach(engine)
    return releaser, seen


def test_a_finished_run_is_released_after_its_spend_and_before_its_report(trainer, tmp_path):
    engine = trainer(epochs=2)
    releaser, seen = _wire(engine, tmp_path)
    engine.run()
    assert seen["ledger_steps"] == seen["steps"] == 8
    assert seen["report"] == ("complete", True, {"test": 0.75})
    released = torch.load(tmp_path / "model.pt", weights_only=True)["model"]
    for k, v in unwrapped(engine.network).state_dict().items():
        assert torch.equal(released[k], v), k


def test_a_deliberate_stop_releases_nothing(trainer, tmp_path):
    engine = trainer(epochs=3)
    releaser, seen = _wire(engine, tmp_path)
    engine.add_event_handler(Events.EPOCH_COMPLETED(once=1), lambda e: e.terminate())
    engine.run()
    assert releaser.metrics is None and seen["report"] == ("incomplete", False, None)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_an_interrupt_or_error_releases_nothing(trainer, tmp_path, stop):
    engine = trainer(epochs=1)
    releaser, seen = _wire(engine, tmp_path)

    def fail(e) -> None:
        if e.steps_taken == 2:
            raise stop("stop")

    engine.add_event_handler(Events.ITERATION_COMPLETED, fail)
    with pytest.raises(stop):
        engine.run()
    assert releaser.metrics is None and seen["report"] == ("incomplete", False, None)
