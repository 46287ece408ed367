"""Pretrained weights, frozen layers and LoRA under DP-SGD and DP-KFC (``model.pretrained``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_med.curvature.preconditioner import PreconditionerConfig
from dpkfc_med.models import validate_private_compatible
from dpkfc_med.models.finetune import (
    PretrainedWeightsError,
    apply_finetune,
    load_pretrained,
    released_state_dict,
)
from dpkfc_med.privacy.engine import PrivacyEngine
from dpkfc_med.training.config import ConfigError, config_from_dict
from tests.conftest import (
    SHARED_DATA,
    GaussianProbes,
    per_sample_ce,
    summed_clipped,
    tiny_cnn_2d,
    tiny_cnn_3d,
)

PNEUMONIA = Path(SHARED_DATA) / "medmnist" / "pneumoniamnist.npz"
C = 0.5
# tiny_cnn_2d: 0 conv (bias), 2 conv (no bias), 3 GroupNorm, 6 Linear (the output layer)
ALL = {"0.weight", "0.bias", "2.weight", "3.weight", "3.bias", "6.weight", "6.bias"}
LORA_TRAINED = {
    "0.lora_A.default.weight",
    "0.lora_B.default.weight",
    "2.lora_A.default.weight",
    "2.lora_B.default.weight",
    "6.weight",
    "6.bias",
}


def _trainable(net: nn.Module) -> set[str]:
    return {n for n, p in net.named_parameters() if p.requires_grad}


def _save(state: dict, path: Path) -> Path:
    torch.save(state, path)
    return path


# ------------------------------------------------------------------------- loading weights


def test_class_count_mismatch_names_the_key_and_the_fix(tmp_path):
    torch.manual_seed(0)
    path = _save(tiny_cnn_2d(num_classes=2).state_dict(), tmp_path / "public.pt")
    with pytest.raises(PretrainedWeightsError, match=r"6\.weight .*pretrained_skip: \['\^6\\\."):
        load_pretrained(tiny_cnn_2d(num_classes=3), path)


def test_missing_and_unexpected_keys_are_named(tmp_path):
    state = tiny_cnn_2d().state_dict()
    state["extra.weight"] = state.pop("3.bias")
    path = _save({"model": state}, tmp_path / "model.pt")
    with pytest.raises(PretrainedWeightsError) as err:
        load_pretrained(tiny_cnn_2d(), path)
    text = str(err.value)
    assert "missing from the file, first: ['3.bias']" in text
    assert "unexpected key(s) in the file, first: ['extra.weight']" in text


def test_pretrained_skip_reinitialises_only_the_matched_keys(tmp_path):
    torch.manual_seed(1)
    public = tiny_cnn_2d(num_classes=2)
    path = _save({"model": public.state_dict()}, tmp_path / "model.pt")
    torch.manual_seed(2)
    net = tiny_cnn_2d(num_classes=3)
    fresh = {k: v.clone() for k, v in net.state_dict().items()}
    record = load_pretrained(net, path, skip=[r"^6\."], source="public chest X-rays")
    for key, value in net.state_dict().items():
        expected = fresh[key] if key.startswith("6.") else public.state_dict()[key]
        assert torch.equal(value, expected), key
    assert record["reinitialised"] == ["6.weight", "6.bias"]
    assert record["format"] == "run model.pt" and record["source"] == "public chest X-rays"
    assert record["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    # a re-initialised layer always trains, whatever the mode
    apply_finetune(net, "last_layers", last=1, keep_trainable=record["reinitialised"])
    assert _trainable(net) == {"6.weight", "6.bias"}


def test_pretrained_class_map_starts_each_class_from_a_public_one(tmp_path):
    """A 3-class head from a 2-class one: class 0 <- 0, classes 1 and 2 <- the merged 1."""
    torch.manual_seed(1)
    public = tiny_cnn_2d(num_classes=2).eval()
    path = _save({"model": public.state_dict()}, tmp_path / "model.pt")
    net = tiny_cnn_2d(num_classes=3).eval()
    record = load_pretrained(net, path, class_map=[0, 1, 1])
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        want, got = public(x), net(x)
    torch.testing.assert_close(got, want[:, [0, 1, 1]])
    assert record["class_mapped"] == ["6.bias", "6.weight"] and record["reinitialised"] == []
    with pytest.raises(PretrainedWeightsError, match=r"\[2\] are not classes of it"):
        load_pretrained(tiny_cnn_2d(num_classes=3), path, class_map=[0, 1, 2])
    with pytest.raises(PretrainedWeightsError, match="no tensor of the file differs"):
        load_pretrained(tiny_cnn_2d(num_classes=2), path, class_map=[0, 1])


def test_a_bundle_folder_loads_its_models_model_pt(tmp_path):
    torch.manual_seed(4)
    public = tiny_cnn_2d()
    (tmp_path / "bundle" / "models").mkdir(parents=True)
    _save(public.state_dict(), tmp_path / "bundle" / "models" / "model.pt")
    net = tiny_cnn_2d()
    assert load_pretrained(net, tmp_path / "bundle")["format"] == "MONAI bundle"
    assert all(torch.equal(v, public.state_dict()[k]) for k, v in net.state_dict().items())


# ------------------------------------------------------------------------- finetune modes


@pytest.mark.parametrize(
    ("mode", "trained"),
    [
        ("full", ALL),
        ("last_layers", {"3.weight", "3.bias", "6.weight", "6.bias"}),  # last 2 modules
        ("norms_and_biases", {"0.bias", "3.weight", "3.bias", "6.weight", "6.bias"}),
        ("lora", LORA_TRAINED),
    ],
)
def test_each_mode_freezes_exactly_the_intended_parameters(mode, trained):
    net = tiny_cnn_2d()
    record = apply_finetune(net, mode, last=2, lora_rank=2)
    assert _trainable(net) == trained
    n_trained = sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert record.trainable_params == n_trained
    assert record.frozen_params == sum(p.numel() for p in net.parameters()) - n_trained


def test_first_and_last_layers_trains_both_ends_once():
    net = tiny_cnn_2d()
    record = apply_finetune(net, "first_and_last_layers", last=1)
    assert _trainable(net) == {"0.weight", "0.bias", "6.weight", "6.bias"}
    assert record.trainable_params == 4 * 1 * 9 + 4 + 6 * 4 * 4 * 3 + 3
    overlap = tiny_cnn_2d()  # the ends overlap: each module once
    assert apply_finetune(overlap, "first_and_last_layers", last=3).trainable_params == sum(
        p.numel() for p in overlap.parameters()
    )


@pytest.mark.parametrize("mode", ["full", "norms_and_biases", "lora"])
def test_parameters_the_builder_froze_stay_frozen(mode):
    net = tiny_cnn_2d()
    net[0].bias.requires_grad_(False)  # e.g. an unused attention norm the DP fixer froze
    apply_finetune(net, mode, lora_rank=2)
    names = {"0.bias", "0.base_layer.bias"}
    assert not any(p.requires_grad for n, p in net.named_parameters() if n in names)


def test_lora_on_conv3d_and_explicit_targets():
    net = tiny_cnn_3d()
    apply_finetune(net, "lora", lora_rank=2, lora_targets=["Conv3d"])
    assert _trainable(net) == {
        "0.lora_A.default.weight",
        "0.lora_B.default.weight",
        "2.lora_A.default.weight",
        "2.lora_B.default.weight",
        "5.weight",
        "5.bias",
    }
    with pytest.raises(ValueError, match=r"'norm': it matches no layer name"):
        apply_finetune(tiny_cnn_3d(), "lora", lora_targets=["norm"])


# ----------------------------------------------------------------- privacy with frozen layers


def _private(mode: str, method: str, n: int = 8, *, last: int = 2, optimizer: str = "sgd"):
    """A tiny CNN in fine-tuning ``mode`` behind the privacy engine, and a batch of ``n``."""
    torch.manual_seed(3)
    net = tiny_cnn_2d()
    record = apply_finetune(net, mode, last=last, lora_rank=2, lora_alpha=4.0)
    validate_private_compatible(net)
    frozen = {n: p.detach().clone() for n, p in net.named_parameters() if not p.requires_grad}
    g = torch.Generator().manual_seed(0)
    x, y = 20 * torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    opt = (
        torch.optim.Adam(net.parameters(), lr=0.1)
        if optimizer == "adam"
        else torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    )
    engine = PrivacyEngine(seed=1)
    pm, popt, _ = engine.make_private(
        module=net,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=n),
        noise_multiplier=1.0,
        max_grad_norm=C,
        delta=1e-5,
        method=method,
        probe_source=GaussianProbes((1, 8, 8), num_classes=3),
        probe_loss=per_sample_ce,
        preconditioner=(
            PreconditionerConfig(num_probes=32, chunk_size=32) if method == "dp-kfc" else None
        ),
        backward_reduction="sum",
    )
    return engine, net, pm, popt, x, y, frozen, record


def _backward(pm, x, y):
    return lambda: F.cross_entropy(pm(x), y, reduction="sum").backward()


@pytest.mark.parametrize("method", ["dp-sgd", "dp-kfc"])
@pytest.mark.parametrize("mode", ["last_layers", "norms_and_biases", "lora"])
def test_sensitivity_and_frozen_parameters(mode, method):
    """Removing one unit moves the clipped sum by at most C; frozen weights never move."""
    engine, net, pm, popt, x, y, frozen, record = _private(mode, method)
    trained = {id(p) for p in net.parameters() if p.requires_grad}
    assert {id(p) for p in popt.params} == trained
    full = summed_clipped(popt, _backward(pm, x, y))
    assert full.numel() == record.trainable_params
    for i in range(len(x)):
        keep = torch.arange(len(x)) != i
        neighbour = summed_clipped(popt, _backward(pm, x[keep], y[keep]))
        assert float((full - neighbour).norm()) <= C * (1 + 1e-5)
    before = {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}
    for _ in range(2):
        popt.zero_grad()
        _backward(pm, x, y)()
        popt.step()
    for name, p in net.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
            assert p.grad is None, name
        else:
            assert not torch.equal(p, before[name]), name
    if method == "dp-kfc":
        prov = engine.provenance()
        covered = set(prov["covered_layers"])
        assert prov["preconditioner"]["coverage_shares"]["trainable"] == record.trainable_params
        if mode == "lora":
            assert {"0.lora_A.default", "0.lora_B.default", "2.lora_B.default"} <= covered
            assert not any("base_layer" in name for name in covered)
        else:
            assert "2" not in covered  # a frozen layer gets no curvature block


def test_lora_release_merges_base_plus_scaled_b_a():
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    plain = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    apply_finetune(net, "lora", lora_rank=2, lora_alpha=6.0)
    with torch.no_grad():  # B starts at zero: give the adapters a value
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.normal_()
    released = released_state_dict(net)
    assert set(released) == set(plain.state_dict())
    for i in (0, 2):
        layer = net[i]
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        expected = layer.base_layer.weight + (6.0 / 2) * b @ a
        torch.testing.assert_close(released[f"{i}.weight"], expected)
        assert torch.equal(released[f"{i}.bias"], layer.base_layer.bias)
    plain.load_state_dict(released)
    x = torch.randn(7, 5)
    torch.testing.assert_close(plain(x), net(x))


def test_lora_release_of_convolutions_is_a_plain_network():
    torch.manual_seed(6)
    net = tiny_cnn_3d()
    apply_finetune(net, "lora", lora_rank=2)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.normal_()
    plain = tiny_cnn_3d()
    plain.load_state_dict(released_state_dict(net))
    x = torch.randn(3, 1, 4, 8, 8)
    torch.testing.assert_close(plain(x), net(x))


# --------------------------------------------------------------------------------- config


def test_config_refuses_pretraining_over_loaded_weights():
    base = {"data": {"path": "x.npz", "task": "segmentation"}}
    with pytest.raises(ConfigError, match="would overwrite the loaded weights"):
        config_from_dict({**base, "model": {"pretrained": "w.pt"}, "pretrain": {"steps": 5}})
    with pytest.raises(ConfigError, match=r"training.finetune='lora_all': not allowed"):
        config_from_dict({**base, "training": {"finetune": "lora_all"}})
    with pytest.raises(ConfigError, match=r"model.pretrained_skip: '\(' is not a regular"):
        config_from_dict({**base, "model": {"pretrained": "w.pt", "pretrained_skip": ["("]}})


# --------------------------------------------------------------------------- end to end


@pytest.mark.skipif(not PNEUMONIA.is_file(), reason="PneumoniaMNIST not available")
def test_cli_fine_tunes_a_first_runs_model_and_reports_the_weights(tmp_path):
    from dpkfc_med.cli import main
    from dpkfc_med.report import check_report

    def config(name: str, **extra) -> Path:
        cfg = {
            "name": name,
            "method": "dp-sgd",
            "data": {"path": str(PNEUMONIA), "max_train": 48, "max_eval": 32},
            "model": {"name": "small_cnn"},
            "privacy": {"target_epsilon": 8.0},
            "training": {"epochs": 1, "batch_size": 16, "progress": False},
        }
        for key, value in extra.items():
            cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and key in cfg else value
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
        return path

    # the first run stands for a public release: another file (weights trained on this run's
    # own data are refused, tests/models/test_pretrained_provenance.py)
    first = tmp_path / "first"
    public = {"path": str(PNEUMONIA.with_name("pneumoniamnist_balanced.npz"))}
    assert main(["train", str(config("first", data=public)), "--out", str(first)]) == 0
    weights = first / "model.pt"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    second = tmp_path / "second"
    cfg = config(
        "second",
        method="dp-kfc",
        model={"pretrained": str(weights), "pretrained_source": "a public release"},
        training={"finetune": "last_layers", "finetune_last": 2},
        probes={"num_probes": 16, "refresh_every": 2},
    )
    assert main(["train", str(cfg), "--out", str(second)]) == 0
    text = (second / "privacy_report.json").read_text(encoding="utf-8")
    report = json.loads(text)
    check_report(report)
    model = report["model"]
    assert model["finetune"] == "last_layers"
    assert model["pretrained"]["sha256"] == digest
    assert model["pretrained"]["source"] == "a public release"
    assert model["trainable_params"] == 512 * 32 + 32 + 32 * 2 + 2  # the two Linear layers
    assert model["trainable_params"] + model["frozen_params"] == model["num_params"]
    item = [s for s in report["privacy"]["not_covered"] if digest in s]
    assert item and "fine-tuning only" in item[0] and "public" in item[0]
    assert str(weights) not in text and str(first) not in text  # paths: custodian only
    custodian = json.loads(
        (second / "private_not_for_release/custodian_report.json").read_text(encoding="utf-8")
    )
    assert str(weights) in json.dumps(custodian)
    # the released model is a plain network: evaluation loads it
    assert main(["evaluate", str(second)]) == 0
