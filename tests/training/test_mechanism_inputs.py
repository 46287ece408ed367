"""What the mechanism refuses, and the noisy step it takes on an empty Poisson batch.

Refused: loaders that sample on their own (not Poisson), and training settings read off the
private images' headers.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from dpkfc_med.cli import main
from dpkfc_med.privacy import PrivacyEngine
from tests.conftest import tiny_cnn_2d
from tests.training.test_cli_classification import _report


def test_loaders_with_their_own_sampling_are_refused():
    data = TensorDataset(torch.randn(8, 1, 8, 8), torch.randint(0, 2, (8,)))
    weighted = DataLoader(data, batch_size=4, sampler=WeightedRandomSampler([1.0] * 8, 8))
    engine = PrivacyEngine(seed=0)
    with pytest.raises(ValueError, match=r"WeightedRandomSampler: .*\(Poisson sampling\)"):
        engine.make_private(
            module=tiny_cnn_2d(2),
            optimizer=torch.optim.SGD(tiny_cnn_2d(2).parameters(), lr=0.1),
            data_loader=weighted,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            delta=1e-5,
            method="dp-sgd",
        )


def test_segmentation_probe_settings_never_come_from_private_headers(tmp_path, capsys):
    from tests.training.test_segmentation import CONFIG, TINY, _folder, _sets

    folder = _folder(tmp_path / "data", "none")
    (folder / "dataset.json").unlink()  # no declared labels either
    out = tmp_path / "run"
    # 4 cases: fractions and the default seed that give every split a case
    unset = [
        "data.spacing=null",
        "data.patch_size=null",
        "data.num_classes=null",
        "data.split_fractions=[0.5,0.25,0.25]",
    ]
    args = ["train", str(CONFIG), "--out", str(out), "--data", str(folder)]
    code = main([*args, *_sets([*TINY, *unset])])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    for field, hint in (
        ("data.spacing", "median here is [1.0, 1.0, 1.0]"),
        ("data.patch_size", "would be [16, 16, 16]"),
        ("data.num_classes", "suggests 3"),
    ):
        assert f"{field}: required" in err and hint in err, (field, err)
    # with the values stated in the config the same folder trains
    fractions = "data.split_fractions=[0.5,0.25,0.25]"
    assert main([*args, *_sets([*TINY, "data.num_classes=3", "data.max_eval=1", fractions])]) == 0
    rep = _report(out)
    assert rep["data"]["spacing_source"] == "data.spacing"
    assert rep["data"]["num_classes_source"] == "data.num_classes"


@pytest.mark.parametrize("method", ["dp-sgd", "dp-kfc"])
def test_an_empty_poisson_batch_is_a_noisy_step_for_any_layer(method):
    """PReLU's per-sample gradient comes from functorch, which cannot vmap over 0 samples."""
    from torch import nn

    from dpkfc_med.engines import noise_only_step
    from tests.conftest import GaussianProbes, per_sample_ce

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.PReLU(),
        nn.GroupNorm(2, 4),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 2),
    )
    data = TensorDataset(torch.randn(8, 1, 8, 8), torch.randint(0, 2, (8,)))
    engine = PrivacyEngine()
    kw = {}
    if method == "dp-kfc":
        kw = {"probe_source": GaussianProbes((1, 8, 8)), "probe_loss": per_sample_ce}
    pm, popt, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        delta=1e-5,
        method=method,
        refresh_every=0,
        **kw,
    )
    before = [p.detach().clone() for p in model.parameters()]
    popt.zero_grad(set_to_none=True)
    noise_only_step(popt)
    assert engine.ledger.steps == 1 and popt.steps_taken == 1
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # noised
    # the next real batch still works after an empty one
    x, y = data.tensors
    popt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(pm(x), y).backward()
    popt.step()
    assert engine.ledger.steps == 2
