"""``training.max_physical_batch``: a Poisson batch in chunks of whole units, one mechanism.

The chunks' clipped sums add up before the one noise draw, so a step taken in chunks must
equal the step taken on the whole batch (same noise seed), and count once in the ledger.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from dpkfc_med.curvature.preconditioner import PreconditionerConfig
from dpkfc_med.engines import PrivateTrainer
from dpkfc_med.privacy.engine import PrivacyEngine
from tests.conftest import GaussianProbes, per_sample_ce, tiny_cnn_2d

METHODS = {
    "dp-sgd": None,
    "dp-kfc": PreconditionerConfig(num_probes=16, chunk_size=16),
}
UNITS = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3, 4, 5])


def _step(method: str, clipping: str, limit: int | None) -> tuple[dict, int]:
    torch.manual_seed(3)
    net = tiny_cnn_2d()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(len(UNITS), 1, 8, 8, generator=g), torch.randint(0, 3, (10,), generator=g)
    batch = {"image": x, "label": y, "unit": UNITS}
    pm, popt, _ = PrivacyEngine(seed=1).make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
        data_loader=DataLoader([(x[0], y[0])] * 12, batch_size=6),
        noise_multiplier=1.0,
        max_grad_norm=0.3,
        delta=1e-5,
        method=method,
        probe_source=GaussianProbes((1, 8, 8), num_classes=3),
        probe_loss=per_sample_ce,
        preconditioner=METHODS[method],
        clipping=clipping,
        backward_reduction="sum",
    )
    trainer = PrivateTrainer(
        device="cpu",
        max_epochs=1,
        train_data_loader=[batch],
        network=pm,
        optimizer=popt,
        per_sample_loss=per_sample_ce,
        privacy_engine=object(),
        unpack=lambda b: (b["image"], b["label"], b["unit"]),
        max_physical_batch=limit,
    )
    trainer.run()
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return state, popt.steps_taken


@pytest.mark.parametrize("clipping", ["per_sample", "ghost"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_step_in_chunks_of_units_is_the_whole_batch_step(method, clipping):
    whole, steps = _step(method, clipping, None)
    assert steps == 1
    for limit in (1, 2, 4):
        chunked, chunk_steps = _step(method, clipping, limit)
        assert chunk_steps == 1  # one noisy step in the ledger, not one per chunk
        for key, value in whole.items():
            torch.testing.assert_close(chunked[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_unit_is_never_split_between_chunks():
    trainer = PrivateTrainer.__new__(PrivateTrainer)
    trainer.max_physical_batch, trainer.privacy_engine = 2, object()
    chunks = trainer._unit_chunks(UNITS, len(UNITS))
    seen = [set(UNITS[c].tolist()) for c in chunks]
    assert [len(s) for s in seen] == [2, 2, 2]
    assert sorted(torch.cat(chunks).tolist()) == list(range(len(UNITS)))
    assert all(a.isdisjoint(b) for i, a in enumerate(seen) for b in seen[i + 1 :])
