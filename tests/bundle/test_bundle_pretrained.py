"""``dpkfc-med bundle train BUNDLE --pretrained``: private fine-tuning from a bundle's weights.

The test bundle is ``zoo_bundle/`` (a 3D UNet of 4 and 8 channels) on a few hippocampus
cases; its ``models/model.pt`` is written by each test: a state dict of the DP-fixed network
(as a Model Zoo bundle ships it, here wrapped as ``{"state_dict": ...}``), or the weights of a
bundle this project exported. The custodian key of the data tags is a temporary file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from dpkfc_med.bundle.zoo import BundleConfigError, prepare_bundle
from dpkfc_med.cli import main
from dpkfc_med.data import resolve_data_path
from dpkfc_med.models.pretrained import KEY_ENV, PretrainedWeightsError

BUNDLE = Path(__file__).parent / "zoo_bundle"
SOURCE = "public hippocampus release v1 (contrast-shifted)"


@pytest.fixture(scope="module", autouse=True)
def custodian_key(tmp_path_factory):
    """This module's custodian key (never the user's own)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, str(tmp_path_factory.mktemp("key") / "custodian.key"))
        yield


@pytest.fixture(scope="module")
def data_dir() -> str:
    return str(resolve_data_path("msd_hippocampus", kind="dir"))


def _overrides(data_dir: str, num_train: int = 3) -> list[str]:
    one_val = "$[{'image': i, 'label': l} for i, l in zip(@images[-1:], @labels[-1:])]"
    return [f"dataset_dir={data_dir}", f"num_train={num_train}", "train#trainer#max_epochs=1",
            f"validate#dataset#data={one_val}"]  # fmt: skip


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _bundle_with_weights(tmp_path: Path, data_dir: str, train: dict | None = None) -> Path:
    """A copy of the test bundle whose models/model.pt holds non-initial weights."""
    bundle = tmp_path / "public_bundle"
    shutil.copytree(BUNDLE, bundle)
    if train is not None:
        config = json.loads((bundle / "configs" / "train.json").read_text(encoding="utf-8"))
        (bundle / "configs" / "train.json").write_text(
            json.dumps({**config, **train}), encoding="utf-8"
        )
    fresh = prepare_bundle(BUNDLE, epsilon=8, overrides=_overrides(data_dir))
    gen = torch.Generator().manual_seed(7)
    state = {
        k: (v + torch.randn(v.shape, generator=gen)) if v.is_floating_point() else v
        for k, v in fresh.network.state_dict().items()
    }
    (bundle / "models").mkdir()
    torch.save({"state_dict": state}, bundle / "models" / "model.pt")
    return bundle


def _cli_train(bundle: Path, data_dir: str, out: Path, *extra: str, num_train: int = 3) -> int:
    # DP-SGD: the start is the same for every method, and DP-KFC's probes cost minutes here
    args = ["bundle", "train", str(bundle), "--epsilon", "8", "--method", "dp-sgd"]
    args += ["--out", str(out)]
    for o in _overrides(data_dir, num_train):
        args += ["--override", o]
    # one small epoch, no data-free pretraining (the rule's 1000 steps for a fresh start)
    one_epoch = ["--set", "training.epochs=1", "--set", "training.batch_size=2"]
    one_epoch += ["--set", "pretrain.steps=0"]
    return main([*args, "--set", "training.progress=false", *one_epoch, *extra])


def test_bare_pretrained_loads_the_bundles_own_weights_before_the_first_step(tmp_path, data_dir):
    """Every tensor of models/model.pt is in the network handed to the engine; pretraining off."""
    bundle = _bundle_with_weights(
        tmp_path, data_dir, train={"private_training": {"pretrain": {"steps": 5}}}
    )
    b = prepare_bundle(bundle, epsilon=8, overrides=_overrides(data_dir), pretrained=True)
    file = torch.load(bundle / "models" / "model.pt", weights_only=True)["state_dict"]
    loaded = b.network.state_dict()
    assert sorted(loaded) == sorted(file)
    mismatched = [k for k, v in file.items() if not torch.equal(loaded[k], v)]
    assert mismatched == []
    assert b.cfg.model.pretrained == str(bundle / "models" / "model.pt")
    assert b.cfg.pretrain.steps == 0  # the bundle asked for 5: the weights would be overwritten
    assert b.options["pretrained"] == str(bundle / "models" / "model.pt")


def test_report_names_the_weights_by_digest_and_unstated_source(tmp_path, data_dir, caplog, capsys):
    """CLI run: digest = sha256 of the file, "not stated" in the report and a console warning."""
    bundle = _bundle_with_weights(tmp_path, data_dir)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="dpkfc_med"):
        assert _cli_train(bundle, data_dir, out, "--pretrained") == 0
    assert any("is not stated" in r.getMessage() for r in caplog.records)
    report = json.loads((out / "privacy_report.json").read_text(encoding="utf-8"))
    weights = report["model"]["pretrained"]
    assert weights["sha256"] == _sha256(bundle / "models" / "model.pt")
    assert weights["source"] == "not stated"
    assert "path" not in weights  # a path is custodian-only
    shown = (out / "privacy_report.md").read_text(encoding="utf-8")
    assert weights["sha256"] in shown and "source as stated: not stated" in shown
    assert "the guarantee covers the private fine-tuning only" in shown


def test_private_training_names_the_weights_and_their_source(tmp_path, data_dir):
    """private_training: {pretrained: PATH relative to the bundle, pretrained_source: ...}."""
    bundle = _bundle_with_weights(
        tmp_path,
        data_dir,
        train={
            "private_training": {
                "pretrained": "models/model.pt",
                "pretrained_source": SOURCE,
                "model": {"pretrained_skip": ["^model\\.2\\."]},
            }
        },
    )
    b = prepare_bundle(bundle, epsilon=8, overrides=_overrides(data_dir))
    assert b.cfg.model.pretrained == str(bundle / "models" / "model.pt")
    assert b.cfg.model.pretrained_source == SOURCE
    assert b.cfg.model.pretrained_skip == ["^model\\.2\\."]
    file = torch.load(bundle / "models" / "model.pt", weights_only=True)["state_dict"]
    loaded = b.network.state_dict()
    kept = [k for k in file if not k.startswith("model.2.")]
    assert kept and all(torch.equal(loaded[k], file[k]) for k in kept)
    assert not any(torch.equal(loaded[k], v) for k, v in file.items() if k.startswith("model.2."))
    # any other model field still comes from the bundle's components
    config = json.loads((bundle / "configs" / "train.json").read_text(encoding="utf-8"))
    config["private_training"]["model"]["name"] = "unet"
    (bundle / "configs" / "train.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(BundleConfigError, match=r"private_training#model: comes from the bundle"):
        prepare_bundle(bundle, epsilon=8, overrides=_overrides(data_dir))


def test_missing_model_pt_names_the_path_and_the_fix(tmp_path, data_dir, capsys):
    bundle = tmp_path / "no_weights"
    shutil.copytree(BUNDLE, bundle)
    out = tmp_path / "run"
    assert _cli_train(bundle, data_dir, out, "--pretrained") == 2
    err = capsys.readouterr().err
    assert f"{bundle / 'models' / 'model.pt'}: no such file" in err
    assert "--pretrained PATH" in err and "monai.bundle download" in err
    assert not out.exists()
    with pytest.raises(BundleConfigError, match=r"elsewhere\.pt: no such file or folder"):
        prepare_bundle(bundle, epsilon=8, overrides=_overrides(data_dir),
                       pretrained=str(tmp_path / "elsewhere.pt"))  # fmt: skip
    with pytest.raises(BundleConfigError, match=r"--pretrained-source: .* but none are loaded"):
        prepare_bundle(bundle, epsilon=8, overrides=_overrides(data_dir), pretrained_source=SOURCE)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, data_dir) -> Path:
    """A bundle this project trained (3 cases, privately) and exported."""
    root = tmp_path_factory.mktemp("exported")
    assert _cli_train(BUNDLE, data_dir, root / "run") == 0
    assert main(["bundle", "export", str(root / "run"), str(root / "bundle")]) == 0
    return root / "bundle"


def test_exported_weights_are_refused_on_their_own_data(exported, tmp_path, data_dir):
    """The exported metadata's data tag shows the same fingerprint: refused, named, nothing left."""
    same = prepare_bundle(BUNDLE, epsilon=8, overrides=_overrides(data_dir))
    fingerprint = same.task.data_record["sha256"]["train#dataset#data"]
    meta = json.loads((exported / "configs" / "metadata.json").read_text(encoding="utf-8"))
    tag = meta["differential_privacy"]["training_data_tag"]
    assert fingerprint not in json.dumps(meta)  # the fingerprint itself stays custodian-only
    assert len(tag["tags"]) == 1
    weights = exported / "models" / "model.pt"
    out = tmp_path / "run"
    with pytest.raises(PretrainedWeightsError, match=rf"SHA-256 {fingerprint[:16]}\.\.\."):
        prepare_bundle(BUNDLE, epsilon=8, overrides=_overrides(data_dir), pretrained=str(weights))
    # the exported bundle with a train config: bare --pretrained is its own models/model.pt
    trainable = tmp_path / "exported_with_train"
    shutil.copytree(exported, trainable)
    shutil.copyfile(BUNDLE / "configs" / "train.json", trainable / "configs" / "train.json")
    assert _cli_train(trainable, data_dir, out, "--pretrained") == 2
    assert not out.exists()
    # under another custodian's key the tag cannot be compared: nothing is refused
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, str(tmp_path / "other.key"))
        b = prepare_bundle(BUNDLE, epsilon=8, overrides=_overrides(data_dir),
                           pretrained=str(weights))  # fmt: skip
    assert b.cfg.model.pretrained == str(weights)


def test_exported_weights_fine_tune_other_data_with_lora_and_export_for_monai_alone(
    exported, tmp_path, data_dir
):
    """Other data trains; the LoRA-merged export loads into MONAI and names the start."""
    from monai.bundle import ConfigParser

    weights = exported / "models" / "model.pt"
    out = tmp_path / "run"
    # GroupNorm of 4 groups in every layer: MONAI's norm argument says it, so the export needs
    # MONAI alone (the BatchNorm fix gives each width its own group count, which it cannot);
    # the public weights load all the same (a norm's affine is per channel)
    extra = ["--override", "network_def#norm=['group', {'num_groups': 4}]"]
    extra += ["--pretrained", str(weights), "--pretrained-source", SOURCE]
    extra += ["--set", "training.finetune=lora", "--set", "training.lora_rank=2"]
    assert _cli_train(BUNDLE, data_dir, out, *extra, num_train=4) == 0
    report = json.loads((out / "privacy_report.json").read_text(encoding="utf-8"))
    assert report["model"]["pretrained"]["sha256"] == _sha256(weights)
    assert report["model"]["finetune"] == "lora"
    assert main(["bundle", "export", str(out), str(tmp_path / "fine_tuned")]) == 0
    fine_tuned = tmp_path / "fine_tuned"
    meta = json.loads((fine_tuned / "configs" / "metadata.json").read_text(encoding="utf-8"))
    start = meta["differential_privacy"]["pretrained_weights"]
    assert start["sha256"] == _sha256(weights) and start["source"] == SOURCE
    assert "covers the private fine-tuning only" in start["covered"]
    assert _sha256(weights) in meta["description"]
    assert "dpkfc-med" not in meta["required_packages_version"]  # MONAI alone
    readme = (fine_tuned / "docs" / "README.md").read_text(encoding="utf-8")
    assert _sha256(weights) in readme and SOURCE in readme
    # MONAI builds network_def and loads the merged weights strictly: no adapter key is left
    parser = ConfigParser()
    parser.read_config(str(fine_tuned / "configs" / "inference.yaml"))
    net = parser.get_parsed_content("network_def")
    released = torch.load(fine_tuned / "models" / "model.pt", weights_only=True)
    net.load_state_dict(released, strict=True)
    assert not any("lora" in k for k in released)
    public = torch.load(weights, weights_only=True)
    moved = [k for k in public if not torch.equal(public[k], released[k])]
    # the adapters' B A merged into the convolutions' weights; frozen norms unchanged
    assert {"model.0.conv.weight", "model.1.submodule.conv.weight"} <= set(moved)
    assert [k for k in public if ".adn." in k] and not [k for k in moved if ".adn." in k]
