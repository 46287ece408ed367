"""Regression tests of the audit's findings: resume, crashes, replayable noise, shareable part."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from dpkfc_med.privacy import PrivacyEngine
from dpkfc_med.privacy.accounting import PrivacyLedger
from dpkfc_med.report import CUSTODIAN_ONLY, PRIVATE_DIR, REPORT_FILES
from dpkfc_med.training.config import ConfigError, load_config
from dpkfc_med.training.run import RunInterrupted, train
from tests.conftest import tiny_cnn_2d
from tests.training.test_cli_classification import PNEUMONIA, _config, _report


class _HardKill(BaseException):
    """Stands in for kill -9: no handler of the trainer runs (not Exception, not Ctrl-C)."""


def _stop_at(step: int, exc: type[BaseException]):
    def instrument(engine, popt):
        def hook(opt):
            if opt.steps_taken == step:
                raise exc()

        popt.post_step_hooks.append(hook)

    return instrument


def _ledger(run: Path) -> PrivacyLedger:
    return PrivacyLedger.load(run / "ledger.json")


def test_resume_with_more_epochs_replans_within_the_target(tmp_path):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 3})
    run = tmp_path / "r"
    train(load_config(cfg_path, [f"output.dir={run}"]), stop_after_epochs=1)
    original = (run / "config.yaml").read_text(encoding="utf-8")
    more = load_config(cfg_path, [f"output.dir={run}", "training.epochs=8"])
    result = train(more, resume=True)
    assert result.status == "complete"
    ledger = _ledger(run)
    assert ledger.steps == 24  # 8 epochs of 3 steps
    for accountant in ("prv", "pld"):
        assert ledger.epsilon(accountant) <= 4.0  # never past the target, composed
    first, later = ledger.events[0], ledger.events[-1]
    assert first.steps == 3 and later.noise_multiplier > first.noise_multiplier
    # config.yaml is the config the run now follows; every session's config is appended
    assert (run / "config.yaml").read_text(encoding="utf-8") != original
    assert (
        yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))["training"]["epochs"] == 8
    )
    sessions = list(yaml.safe_load_all((run / "config_history.yaml").read_text(encoding="utf-8")))
    assert [s["training"]["epochs"] for s in sessions] == [3, 8]
    plans = json.loads((run / "plan.json").read_text(encoding="utf-8"))["plans"]
    assert [p["kind"] for p in plans] == ["start", "checkpoint"]
    assert plans[1]["changed_fields"] == ["training.epochs"]
    assert plans[1]["plan"]["spent_steps"] == 3  # the first session's epoch
    rep = _report(run)
    assert rep["privacy"]["steps"] == 24 and rep["privacy"]["epsilon"]["prv"] <= 4.0
    assert len(rep["privacy"]["plan_history"]) == 2


def test_resume_refuses_changes_to_the_mechanism_naming_them(tmp_path):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 3})
    run = tmp_path / "r"
    train(load_config(cfg_path, [f"output.dir={run}"]), stop_after_epochs=1)
    before = _ledger(run).steps
    changed = load_config(
        cfg_path,
        [f"output.dir={run}", "training.batch_size=16", "privacy.max_grad_norm=2.0"],
    )
    with pytest.raises(ConfigError, match=r"privacy\.max_grad_norm: 1\.0 -> 2\.0") as err:
        train(changed, resume=True)
    assert "training.batch_size: 32 -> 16" in str(err.value)
    assert _ledger(run).steps == before  # nothing was spent by the refused attempt


def test_resume_after_a_hard_kill_before_the_first_checkpoint(tmp_path):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 3})
    run = tmp_path / "r"
    cfg = load_config(cfg_path, [f"output.dir={run}"])
    with pytest.raises(_HardKill):
        train(cfg, instrument=_stop_at(2, _HardKill))
    assert not (run / "checkpoint.pt").exists()
    spent = _ledger(run)
    assert spent.steps == 2
    # a fresh start in the same folder says what was spent and how to go on
    with pytest.raises(ConfigError, match=r"2 noisy steps already spent, epsilon .*--resume"):
        train(cfg)
    result = train(cfg, resume=True)  # the ledger alone is enough
    assert result.status == "complete"
    ledger = _ledger(run)
    assert ledger.steps == 2 + 9  # the spent steps, then a whole plan from the initial model
    assert ledger.events[0] == spent.events[0]
    assert ledger.epsilon("prv") <= 4.0 and ledger.epsilon("pld") <= 4.0
    assert [
        p["kind"] for p in json.loads((run / "plan.json").read_text(encoding="utf-8"))["plans"]
    ] == [
        "start",
        "ledger",
    ]


def test_interrupt_writes_a_checkpoint_and_says_what_was_spent(tmp_path):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 3})
    run = tmp_path / "r"
    cfg = load_config(cfg_path, [f"output.dir={run}"])
    with pytest.raises(RunInterrupted, match=r"2 noisy steps spent, epsilon .* --resume"):
        train(cfg, instrument=_stop_at(2, KeyboardInterrupt))
    ck = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ck["mid_epoch"] is True and ck["engine"]["steps_taken"] == 2
    assert _report(run)["status"] == "incomplete"
    result = train(cfg, resume=True)
    assert result.status == "complete" and _ledger(run).steps == 9  # the plan, exactly


def test_noise_is_not_replayable_from_the_published_seed(tmp_path):
    def noisy_step(engine):
        torch.manual_seed(0)
        model = tiny_cnn_2d(2)
        data = TensorDataset(torch.randn(16, 1, 8, 8), torch.randint(0, 2, (16,)))
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        pm, popt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=DataLoader(data, batch_size=16),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            delta=1e-5,
            method="dp-sgd",
        )
        x, y = data.tensors
        torch.nn.functional.cross_entropy(pm(x), y).backward()
        popt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()]), engine

    a, ea = noisy_step(PrivacyEngine())
    b, _ = noisy_step(PrivacyEngine())
    assert not torch.equal(a, b)  # same seed everywhere else, different noise
    state = ea.state_dict()
    assert state["noise_generator"] is None and state["sample_generator"] is None
    assert ea.randomness == "os-entropy" and not ea.reproducible
    c, ec = noisy_step(PrivacyEngine(seed=3))
    d, _ = noisy_step(PrivacyEngine(seed=3))
    assert torch.equal(c, d) and ec.reproducible  # research mode replays, by name only


def test_reproducible_noise_is_named_in_the_report_headline(tmp_path):
    cfg_path = _config(
        tmp_path, method="dp-sgd", training={"epochs": 1}, privacy={"reproducible_noise": True}
    )
    run = tmp_path / "r"
    train(load_config(cfg_path, [f"output.dir={run}"]))
    rep = _report(run)
    assert rep["privacy"]["randomness"] == {
        "source": "seeded",
        "valid_dp_release": False,
        "note": "seeded from the published training.seed: replayable",
    }
    md = (run / REPORT_FILES["markdown"]).read_text(encoding="utf-8")
    assert md.split("\n\n")[1].startswith("> **NOT A VALID DP RELEASE:**")
    assert rep["privacy"]["guarantee"].startswith("NOT A VALID DP RELEASE")
    with pytest.raises(ConfigError, match="reproducible_noise=true contradicts"):
        load_config(cfg_path, ["privacy.secure_rng=true"])


def test_shareable_part_holds_no_unnoised_private_statistic(tmp_path):
    cfg_path = _config(tmp_path, training={"epochs": 1})
    run = tmp_path / "r"
    result = train(load_config(cfg_path, [f"output.dir={run}"]))
    data_sha = hashlib.sha256(PNEUMONIA.read_bytes()).hexdigest()
    losses = [f"{v:.6f}" for v in result.custodian["history"]["loss"] if v == v]
    assert losses
    counts = result.custodian["data"]["class_counts"]
    shareable = [run / REPORT_FILES[k] for k in ("json", "markdown", "html")]
    for path in shareable:
        text = path.read_text(encoding="utf-8")
        assert data_sha not in text, path
        assert "confusion" not in text, path
        assert json.dumps(counts) not in text and json.dumps(counts, indent=2) not in text
    rep = _report(run)
    for dotted in CUSTODIAN_ONLY:
        node = rep
        for part in dotted.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        assert node == {} or node is None, dotted
    json_text = json.dumps(rep["history"])
    assert not any(v in json_text for v in losses)
    private = json.loads((run / PRIVATE_DIR / "custodian_report.json").read_text(encoding="utf-8"))
    assert [f"{v:.6f}" for v in private["history"]["loss"] if v == v] == losses
    assert private["data"]["sha256"] and private["metrics"]["test"]
    listed = " ".join(rep["privacy"]["not_covered"])
    for words in ("Hyperparameter tuning", "number of training units N", PRIVATE_DIR):
        assert words in listed


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
    from dpkfc_med.cli import main
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
