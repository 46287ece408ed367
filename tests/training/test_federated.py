"""``dpkfc-med federated``: two Flower sites on loopback, two FedAvg rounds, private sites.

One federated run (module fixture) serves every check. Every process it starts records each
dataset it builds: a ``sitecustomize`` on ``PYTHONPATH`` wraps the task builder and the
MedMNIST loader in the spawned server and sites, and the same wrappers are patched into this
process (which orchestrates the run).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import textwrap
from pathlib import Path

import pytest

from dpkfc_med.cli import main
from dpkfc_med.privacy.accounting import PrivacyLedger, epsilon_for
from dpkfc_med.tasks import build as task_build
from dpkfc_med.tasks.classification import task as tasks
from dpkfc_med.training.federated import SITE_EVALUATION
from tests.training.test_cli_classification import _config

PRIVATE = "private_not_for_release"

RECORDER = textwrap.dedent(
    '''
    """Test hook: log which process builds a task or loads MedMNIST data."""
    import importlib.abc
    import importlib.util
    import json
    import multiprocessing
    import os
    import sys

    LOG = os.environ.get("DPKFC_TEST_DATA_LOG")


    def recorded(what, fn):
        def wrapper(*args, **kwargs):
            cfg = args[0] if args and hasattr(args[0], "data") else None
            entry = {
                "who": multiprocessing.current_process().name,
                "what": what,
                "shard": None if cfg is None else cfg.data.shard,
            }
            with open(LOG, "a") as f:
                f.write(json.dumps(entry) + "\\n")
            return fn(*args, **kwargs)

        return wrapper


    def patch(task_build):
        task_build.TASK_BUILDERS["classification"] = recorded(
            "task", task_build.TASK_BUILDERS["classification"]
        )
        tasks = sys.modules["dpkfc_med.tasks.classification.task"]  # imported by build
        tasks.load_medmnist = recorded("load_medmnist", tasks.load_medmnist)


    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "dpkfc_med.tasks.build":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec


    if LOG:
        sys.meta_path.insert(0, Hook())
    '''
)


@pytest.fixture(scope="module")
def federated_run(tmp_path_factory):
    """Two sites, two rounds: ``(out, cfg_path, stdout, data_log)``."""
    tmp_path = tmp_path_factory.mktemp("fed")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(RECORDER, encoding="utf-8")
    log = tmp_path / "data_log.jsonl"
    log.touch()
    cfg = _config(
        tmp_path,
        privacy={"accountant": "rdp"},
        training={"threads": 1},
        probes={"num_probes": 16, "refresh_every": 2},
    )
    out = tmp_path / "fed"
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DPKFC_TEST_DATA_LOG", str(log))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]))
        spec = {"__file__": str(hooks / "sitecustomize.py")}
        exec(compile(RECORDER, spec["__file__"], "exec"), spec)  # the wrappers, here too
        mp.setitem(
            task_build.TASK_BUILDERS,
            "classification",
            spec["recorded"]("task", task_build.TASK_BUILDERS["classification"]),
        )
        mp.setattr(tasks, "load_medmnist", spec["recorded"]("load_medmnist", tasks.load_medmnist))
        argv = ["federated", str(cfg), "--out", str(out), "--sites", "2", "--rounds", "2"]
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(argv)
    assert code == 0, stderr.getvalue()
    calls = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    return out, cfg, stdout.getvalue(), calls


def test_two_sites_two_rounds(federated_run, capsys):
    """Each site's ledger composes both rounds within its target; the preconditioners agree;
    the sites hold disjoint halves of the training split; the server keeps the FedAvg model."""
    out, cfg, stdout, _ = federated_run
    assert "site 0: epsilon" in stdout
    rec = json.loads((out / "server" / "federated.json").read_text(encoding="utf-8"))
    assert [h["round"] for h in rec["history"]] == [1, 2]
    assert (out / "server" / "model.pt").is_file()
    for h in rec["history"]:
        fps = [m["fingerprint"] for m in h["sites"]]
        assert fps[0] != 0.0 and fps[0] == pytest.approx(fps[1], rel=1e-9)
    units = []
    for k in (0, 1):
        site = out / f"site_{k}"
        rep = json.loads((site / "privacy_report.json").read_text(encoding="utf-8"))
        p = rep["privacy"]
        assert rep["status"] == "complete" and rep["data"]["shard"]["site"] == k
        assert p["steps"] == p["planned_steps"] == 2 * p["steps_per_epoch"]  # both rounds
        ledger = PrivacyLedger.load(site / "ledger.json")
        assert ledger.steps == p["steps"]
        assert epsilon_for(ledger.events, ledger.delta, "rdp") == pytest.approx(p["epsilon"]["rdp"])
        assert p["epsilon"]["rdp"] <= 4.0 + 1e-9
        units.append(rep["data"]["num_train_units"])
        assert rec["history"][-1]["sites"][k]["steps"] == p["steps"]
    assert sum(units) == 96  # the two shards partition the 96 training images
    # a second run into the same folder is refused before anything starts
    again = ["federated", str(cfg), "--out", str(out), "--sites", "2", "--rounds", "2"]
    assert main(again) == 2
    assert "server exists: a federated run starts in a new folder" in capsys.readouterr().err


def test_server_holds_no_site_data(federated_run):
    """Only site k's process builds a dataset, and only shard k of it: neither the server nor
    the orchestrating process loads any site's split (audit: the server loaded every site's)."""
    _, _, _, calls = federated_run
    assert calls, "no dataset was built at all: the recorder is not installed"
    who = {c["who"] for c in calls}
    assert who == {"federated-site-0", "federated-site-1"}, calls
    for c in calls:
        if c["what"] == "task":
            k = int(c["who"].rsplit("-", 1)[1])
            assert c["shard"] == [k, 2], c


def _shareable_texts(out: Path) -> dict[Path, str]:
    """Every text file of the run outside the custodian folders."""
    texts = {}
    for f in sorted(out.rglob("*")):
        if not f.is_file() or PRIVATE in f.relative_to(out).parts:
            continue
        if f.suffix in {".json", ".md", ".html", ".yaml", ".txt", ".csv", ".log"}:
            texts[f] = f.read_text(errors="replace")
    return texts


def test_test_metrics_stay_with_each_site_custodian(federated_run):
    """The federated model is evaluated by each site on its own data, in its own process; the
    un-noised figures (AUROC, per-class sensitivity, confusion matrix) appear only under that
    site's ``private_not_for_release/``; the server's files hold no metric (audit: they did)."""
    out, _, _, _ = federated_run
    rec = json.loads((out / "server" / "federated.json").read_text(encoding="utf-8"))
    assert "test" not in rec
    assert rec["site_evaluations"] == [f"site_{k}/{SITE_EVALUATION}" for k in (0, 1)]
    texts = _shareable_texts(out)
    server = {f: t for f, t in texts.items() if f.parent == out / "server"}
    assert set(server) == {out / "server" / "federated.json", out / "server" / "federated.md"}
    for f, text in server.items():
        for word in ("auroc", "sensitivity", "confusion", "accuracy", "dice"):
            assert word not in text.lower(), (f, word)
    for k in (0, 1):
        ev = json.loads((out / f"site_{k}" / SITE_EVALUATION).read_text(encoding="utf-8"))
        assert ev["site"] == k and ev["split"] == "test" and ev["not_dp"] is True
        m = ev["metrics"]
        assert {"auroc", "per_class", "confusion_matrix"} <= set(m)
        sens = [c["sensitivity"] for c in m["per_class"].values()]
        secrets = [json.dumps(m["confusion_matrix"]), json.dumps(m["confusion_matrix"], indent=1)]
        secrets += [
            repr(v) for v in [m["auroc"], *sens] if isinstance(v, float) and len(repr(v)) > 6
        ]
        assert not math.isnan(m["auroc"])
        for f, text in texts.items():
            compact = text.replace(" ", "").replace("\n", "")
            for s in secrets:
                assert s not in text and s.replace(" ", "").replace("\n", "") not in compact, (
                    f,
                    s,
                )


def test_federated_refuses_a_non_private_method(tmp_path, capsys):
    cfg = _config(tmp_path, method="nonprivate")
    code = main(
        ["federated", str(cfg), "--out", str(tmp_path / "f"), "--sites", "2", "--rounds", "1"]
    )
    assert code == 2
    assert "federated sites train privately; use dp-sgd or dp-kfc" in capsys.readouterr().err
