"""Staged fine-tuning (``training.head_first_epochs``): the head learns alone, then the rest."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import yaml

from dpkfc_med.engines.handlers.staged import HeadFirstHandler, head_parameters
from dpkfc_med.models.finetune import apply_finetune
from dpkfc_med.training.config import ConfigError, config_from_dict
from tests.conftest import SHARED_DATA, summed_clipped, tiny_cnn_2d
from tests.training.test_finetune import C
from tests.training.test_finetune import _private as finetune_private

PNEUMONIA = Path(SHARED_DATA) / "medmnist" / "pneumoniamnist.npz"
HEAD = {"6.weight", "6.bias"}  # tiny_cnn_2d's output layer


def _private(mode: str, method: str, optimizer: str = "sgd"):
    _, net, pm, popt, x, y, _, _ = finetune_private(mode, method, last=1, optimizer=optimizer)
    return net, pm, popt, x, y


def _backward(pm, x, y):
    return lambda: F.cross_entropy(pm(x), y, reduction="sum").backward()


def _hold_all_but_head(net, popt) -> None:
    popt.hold = frozenset(id(p) for n, p in net.named_parameters() if n not in HEAD)


def test_holding_the_body_clips_as_training_the_head_alone(float64):
    """DP-SGD: the held step's clipped sum is last_layers' exactly, zero on the body."""
    net, pm, popt, x, y = _private("full", "dp-sgd")
    _hold_all_but_head(net, popt)
    held = summed_clipped(popt, _backward(pm, x, y))
    head_net, head_pm, head_popt, _, _ = _private("last_layers", "dp-sgd")
    alone = summed_clipped(head_popt, _backward(head_pm, x, y))
    sizes = [p.numel() for p in popt.params]
    parts = dict(zip([n for n, p in net.named_parameters()], torch.split(held, sizes)))
    assert torch.cat([parts[n] for n in ("6.weight", "6.bias")]).allclose(alone, atol=1e-12)
    assert all(float(v.abs().max()) == 0.0 for n, v in parts.items() if n not in HEAD)
    assert float(alone.norm()) > 0
    # per-unit norms were taken over the head only: some units clipped there
    assert float(alone.norm()) <= len(x) * C * (1 + 1e-9)


@pytest.mark.parametrize("method", ["dp-sgd", "dp-kfc"])
def test_held_step_moves_only_the_head_and_removing_a_unit_moves_it_by_at_most_c(method):
    net, pm, popt, x, y = _private("full", method, optimizer="adam")
    _hold_all_but_head(net, popt)
    full = summed_clipped(popt, _backward(pm, x, y))
    for i in range(len(x)):
        keep = torch.arange(len(x)) != i
        neighbour = summed_clipped(popt, _backward(pm, x[keep], y[keep]))
        assert float((full - neighbour).norm()) <= C * (1 + 1e-5)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    popt.zero_grad()
    _backward(pm, x, y)()
    popt.step()
    inner = popt.original_optimizer
    for name, p in net.named_parameters():
        if name in HEAD:
            assert not torch.equal(p, before[name]) and p in inner.state, name
        else:  # no update, no Adam moments built from its pure-noise coordinates
            assert torch.equal(p, before[name]) and p not in inner.state, name
    popt.hold = frozenset()  # the second stage: every parameter learns
    popt.zero_grad()
    _backward(pm, x, y)()
    popt.step()
    assert all(not torch.equal(p, before[n]) for n, p in net.named_parameters())


def test_handler_follows_the_epoch_with_a_plain_optimizer_too():
    net = tiny_cnn_2d()
    head = head_parameters(net, 1)
    assert [id(p) for p in head] == [id(net[6].weight), id(net[6].bias)]
    assert {id(p) for p in head_parameters(net, 2)} == {
        id(p) for p in (*head, *net[3].parameters())
    }
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    handler = HeadFirstHandler(net, head, epochs=2)
    engine = SimpleNamespace(state=SimpleNamespace(epoch=1), optimizer=opt)
    handler(engine)
    assert {n for n, p in net.named_parameters() if p.requires_grad} == HEAD
    engine.state.epoch = 3
    handler(engine)
    assert all(p.requires_grad for p in net.parameters())
    # a frozen parameter of the fine-tuning mode is neither head nor released later
    frozen = tiny_cnn_2d()
    apply_finetune(frozen, "norms_and_biases")
    staged = HeadFirstHandler(frozen, head_parameters(frozen, 1), epochs=1)
    assert {id(p) for p in staged.others} == {
        id(p) for n, p in frozen.named_parameters() if p.requires_grad and n not in HEAD
    }


def test_config_names_what_a_staged_fine_tuning_needs():
    base = {"data": {"path": "x.npz"}, "training": {"epochs": 4}}
    with pytest.raises(ConfigError, match=r"head_first_epochs=2: a staged fine-tuning needs"):
        config_from_dict({**base, "training": {"epochs": 4, "head_first_epochs": 2}})
    weights = {"model": {"pretrained": "w.pt"}}
    with pytest.raises(ConfigError, match=r"must be fewer than training.epochs=4"):
        config_from_dict({**base, **weights, "training": {"epochs": 4, "head_first_epochs": 4}})
    with pytest.raises(ConfigError, match=r"both stages would train the same modules"):
        config_from_dict(
            {**base, **weights,
             "training": {"epochs": 4, "head_first_epochs": 1, "finetune": "last_layers"}}
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"head_first_epochs=-1: must be >= 0"):
        config_from_dict({**base, "training": {"head_first_epochs": -1}})
    ok = config_from_dict({**base, **weights, "training": {"epochs": 4, "head_first_epochs": 3}})
    assert ok.training.head_first_epochs == 3


@pytest.mark.skipif(not PNEUMONIA.is_file(), reason="PneumoniaMNIST not available")
def test_a_staged_run_holds_the_body_for_its_first_epochs_and_says_so(tmp_path):
    from dpkfc_med.bundle.metadata import pretrained_block
    from dpkfc_med.cli import main
    from dpkfc_med.report import check_report
    from dpkfc_med.training.config import load_config
    from dpkfc_med.training.run import train

    first = tmp_path / "public"
    public = {
        "name": "public",
        "method": "nonprivate",
        "data": {"path": str(PNEUMONIA.with_name("pneumoniamnist_balanced.npz")),
                 "max_train": 48, "max_eval": 32},
        "model": {"name": "small_cnn"},
        "training": {"epochs": 1, "batch_size": 16, "progress": False},
    }  # fmt: skip
    path = tmp_path / "public.yaml"
    path.write_text(yaml.safe_dump(public), encoding="utf-8")
    assert main(["train", str(path), "--out", str(first)]) == 0
    staged = {
        **public,
        "name": "staged",
        "method": "dp-kfc",
        "data": {"path": str(PNEUMONIA), "max_train": 48, "max_eval": 32},
        "model": {"name": "small_cnn", "pretrained": str(first / "model.pt"),
                  "pretrained_source": "a public release"},
        "privacy": {"target_epsilon": 8.0, "accountant": "rdp"},
        "training": {"epochs": 2, "batch_size": 16, "progress": False, "head_first_epochs": 1},
        "probes": {"num_probes": 16},
        "output": {"dir": str(tmp_path / "staged")},
    }  # fmt: skip
    path = tmp_path / "staged.yaml"
    path.write_text(yaml.safe_dump(staged), encoding="utf-8")
    moved: list[set[str]] = []

    def instrument(engine, popt):
        names = {id(p): n for n, p in engine.module._module.named_parameters()}
        last = {id(p): p.detach().clone() for p in popt.params}

        def record(opt):
            moved.append({names[id(p)] for p in opt.params if not torch.equal(p, last[id(p)])})
            last.update({id(p): p.detach().clone() for p in opt.params})

        popt.post_step_hooks.append(record)

    result = train(load_config(path), instrument=instrument)
    report = json.loads((result.run_dir / "privacy_report.json").read_text(encoding="utf-8"))
    check_report(report)
    stage = report["model"]["head_first"]
    assert stage["epochs"] == 1 and len(stage["modules"]) == 1
    head = {f"{stage['modules'][0]}.{k}" for k in ("weight", "bias")}
    assert stage["params"] == sum(p.numel() for n, p in _small_cnn_params() if n in head)
    per_epoch = 3  # q = 1/ceil(48/16): three Poisson steps an epoch
    assert len(moved) == 2 * per_epoch
    assert all(s and s <= head for s in moved[:per_epoch])  # the head alone learned
    assert all(s - head for s in moved[per_epoch:])  # then the body too
    text = (result.run_dir / "privacy_report.md").read_text(encoding="utf-8")
    assert f"full, after 1 epoch in which only {stage['modules'][0]} (" in text
    exported = pretrained_block(report["model"])
    assert exported is not None
    assert exported["fine_tuning"] == "full, after 1 epoch(s) of the head alone"


def _small_cnn_params():
    from dpkfc_med.models import build_model

    net, _ = build_model(
        "small_cnn", spatial_dims=2, in_channels=1, out_channels=2, input_size=(28, 28)
    )
    return net.named_parameters()
