"""A tiny private (or plain) trainer for the handler tests: a 3 -> 2 linear net, 16 samples."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_med.engines import PrivateTrainer
from dpkfc_med.privacy.engine import PrivacyEngine


def per_sample_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def make_trainer(
    tmp_path: Path,
    *,
    private: bool = True,
    epochs: int = 1,
    batch_size: int = 4,
    accountant: str = "rdp",
    seed: int = 0,
    model: nn.Module | None = None,
) -> PrivateTrainer:
    """A trainer over 16 samples of a 3 -> 2 linear net: DP-SGD (noise 1, clip 1) or plain SGD.

    ``epoch_length`` is ``16 / batch_size`` steps in both cases.
    """
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 3, generator=gen), torch.randint(0, 2, (16,), generator=gen)
    if model is None:
        torch.manual_seed(seed)
        model = nn.Linear(3, 2)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.1)
    network: nn.Module = model
    engine = None
    if private:
        engine = PrivacyEngine(seed=seed, accountant=accountant)
        network, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            delta=1e-5,
            method="dp-sgd",
            ledger_path=tmp_path / "ledger.json",
            backward_reduction="sum",
        )
    return PrivateTrainer(
        device="cpu",
        max_epochs=epochs,
        train_data_loader=loader,
        network=network,
        optimizer=optimizer,
        per_sample_loss=per_sample_ce,
        privacy_engine=engine,
        epoch_length=16 // batch_size,
    )


@pytest.fixture
def trainer(tmp_path: Path) -> Callable[..., PrivateTrainer]:
    """``trainer(**kw)``: :func:`make_trainer` in this test's ``tmp_path``."""
    return lambda **kw: make_trainer(tmp_path, **kw)
