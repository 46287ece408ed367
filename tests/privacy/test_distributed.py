"""Private training over 2 gloo processes on loopback: one mechanism, one noise draw, one ledger.

Each test spawns two processes (bounded in time) that run the engine on the same data; the
results come back through files and are checked against brute force in this process. Jobs may
give rank 1 another mechanism (``"rank1"``: clip norm, sigma, model seed, caller's fields),
which both ranks must refuse before the first step; a ``"train"`` job runs
:func:`~dpkfc_med.training.distributed.train_on_this_rank` on a tiny config, rank 1 holding the
same units in reverse order.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from dpkfc_med.privacy.distributed import (
    MechanismMismatchError,
    ShardedPoissonSampler,
    World,
    check_mechanism_on_every_rank,
    mechanism_differences,
)
from dpkfc_med.privacy.engine import PrivacyEngine
from tests.conftest import GaussianProbes, per_sample_ce

N, BATCH, C = 40, 10, 1.0  # q = 1/4, global expected batch 10


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 12, generator=g), torch.randint(0, 3, (N,), generator=g)


def _model(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 3))


def _engine(
    method, model, *, sigma, seed=5, secure=False, ledger=None, clip=C, extra=None, reverse=False
):
    x, y = _data()
    if reverse:  # the same units in another order
        x, y = x.flip(0), y.flip(0)
    eng = PrivacyEngine(seed=None if secure else seed, secure_mode=secure)
    pm, popt, loader = eng.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),  # parameters stay put
        data_loader=DataLoader(TensorDataset(x, y, torch.arange(N)), batch_size=BATCH),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        delta=1e-5,
        method=method,
        probe_source=GaussianProbes((12,)),
        probe_loss=per_sample_ce,
        ledger_path=ledger,
        **({} if extra is None else {"mechanism_extra": extra}),
    )
    return eng, pm, popt, loader


def _steps(pm, popt, loader, *, steps, zero_loss=False, die_at=None):
    """Run ``steps`` private steps; record this rank's drawn indices and the released grads."""
    drawn, grads = [], []
    it = iter(loader)
    for k in range(steps):
        xb, y, idx = next(it)
        if die_at is not None and k == die_at:
            os._exit(3)  # a crashed rank: no clean-up, no message
        popt.zero_grad()
        out = pm(xb)
        loss = F.cross_entropy(out, y) if len(idx) else out.sum()  # mean over the local batch
        (loss * 0.0 if zero_loss else loss).backward()
        popt.step()
        drawn.append(idx.tolist())
        grads.append(torch.cat([p.grad.reshape(-1) for p in pm.parameters()]).clone())
    return drawn, grads


def _run_train_job(rank, out, job):
    """Train the job's config on this rank; rank 1's units are rank 0's in reverse order."""
    from dpkfc_med.tasks.build import build_task
    from dpkfc_med.training.config import load_config
    from dpkfc_med.training.distributed import train_on_this_rank

    result: dict = {"rank": rank}
    try:
        cfg = load_config(job["train"])
        task = build_task(cfg)
        if rank == 1:  # the same N units, read in another order (another folder listing)
            task.train_set = Subset(task.train_set, list(range(len(task.train_set)))[::-1])
        train_on_this_rank(cfg, task=task)
    except Exception as err:
        result["error"] = f"{type(err).__name__}: {err}"
        result["refused"] = isinstance(err, MechanismMismatchError)
    (out / f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    return "error" not in result or result["refused"]


def _run_job(rank, out, job):
    out.mkdir(parents=True, exist_ok=True)
    if "train" in job:
        return _run_train_job(rank, out, job)
    result: dict = {"rank": rank, "steps": 0}
    popt = None
    try:
        ledger = out / f"ledger_rank{rank}.json"
        own = {**job, **job.get("rank1", {})} if rank == 1 else job
        eng, pm, popt, loader = _engine(
            job["method"],
            _model(own.get("model_seed", 1)),
            sigma=own["sigma"],
            secure=job.get("secure", False),
            ledger=ledger,
            clip=own.get("clip", C),
            extra=own.get("extra"),
            reverse=own.get("reverse", False),
        )
        result["world"] = [eng.world.rank, eng.world.size, eng.world.backend]
        result["expected_batch_size"] = popt.expected_batch_size
        result["sample_rate"] = eng.sample_rate
        drawn, grads = _steps(
            pm,
            popt,
            loader,
            steps=job["steps"],
            zero_loss=job.get("zero_loss", False),
            die_at=job.get("die_at") if rank == 1 else None,
        )
        result.update(drawn=drawn, epsilon=eng.get_epsilon(), steps=popt.steps_taken)
        torch.save(grads, out / f"grads_rank{rank}.pt")
        if popt.preconditioner is not None:
            result["fingerprint"] = popt.preconditioner.fingerprint()
    except Exception as err:  # the surviving rank of a crash: say what it saw
        result["error"] = f"{type(err).__name__}: {err}"
        result["refused"] = isinstance(err, MechanismMismatchError)
        result["steps"] = 0 if popt is None else popt.steps_taken
    (out / f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    return "error" not in result


def _worker(rank, port, out, jobs):
    """Both ranks run every job in turn, in one process group (one spawn for many checks)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=20),
    )
    ok = all([_run_job(rank, Path(out) / name, job) for name, job in jobs.items()])
    if ok:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(folder, jobs):
    ctx = mp.start_processes(
        _worker, args=(_free_port(), str(folder), jobs), nprocs=2, join=False, start_method="spawn"
    )
    for p in ctx.processes:
        p.join(timeout=180)
        assert not p.is_alive(), "a rank did not finish within 180 s"
    out = {}
    for name in jobs:
        out[name] = {}
        for rank in (0, 1):
            f = folder / name / f"rank{rank}.json"
            out[name][rank] = json.loads(f.read_text(encoding="utf-8")) if f.exists() else None
    return out


JOBS = {
    "sum-dp-sgd": {"method": "dp-sgd", "sigma": 0.0, "steps": 3},
    "sum-dp-kfc": {"method": "dp-kfc", "sigma": 0.0, "steps": 3},
    "noise-seeded": {"method": "dp-sgd", "sigma": 2.0, "steps": 2, "zero_loss": True},
    "noise-os-entropy": {
        "method": "dp-sgd",
        "sigma": 2.0,
        "steps": 2,
        "zero_loss": True,
        "secure": True,
    },
    "agree-extra": {"method": "dp-kfc", "sigma": 1.0, "steps": 1, "extra": {"unit": "patient"}},
    "differ-clip": {"method": "dp-sgd", "sigma": 1.0, "steps": 1, "rank1": {"clip": 10.0}},
    "differ-sigma-model": {
        "method": "dp-kfc",
        "sigma": 1.0,
        "steps": 1,
        "rank1": {"sigma": 0.5, "model_seed": 2},
    },
    "differ-extra": {
        "method": "dp-sgd",
        "sigma": 1.0,
        "steps": 1,
        "extra": {"precision": "float32", "unit": "patient"},
        "rank1": {"extra": {"precision": "bf16", "unit": "patient"}},
    },
    "differ-order": {"method": "dp-sgd", "sigma": 1.0, "steps": 1, "rank1": {"reverse": True}},
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every job of :data:`JOBS` on 2 gloo processes: ``(folder, results)``."""
    from tests.training.test_cli_classification import _config

    folder = tmp_path_factory.mktemp("dist")
    run = {"dir": str(folder / "train-order" / "run")}
    train = _config(folder, method="dp-sgd", training={"epochs": 1, "threads": 1}, output=run)
    return folder, _spawn(folder, {**JOBS, "train-order": {"train": str(train)}})


def _brute(model, x, y, units):
    """Clipped per-sample gradient sum over ``units`` divided by the global expected batch."""
    total = None
    for i in units:
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum").backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        g = g * min(1.0, C / (float(g.norm()) + 1e-6))
        total = g if total is None else total + g
    return total / BATCH


@pytest.mark.parametrize("method", ["dp-sgd", "dp-kfc"])
def test_global_clipped_sum_equals_one_process_over_the_union(method, two_ranks):
    """sigma 0: the released gradient is the clipped sum over both ranks' units / q N."""
    folder, results = two_ranks
    tmp_path = folder / f"sum-{method}"
    r0, r1 = results[f"sum-{method}"][0], results[f"sum-{method}"][1]
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r0["world"] == [0, 2, "gloo"] and r1["world"][:2] == [1, 2]
    assert r0["expected_batch_size"] == r1["expected_batch_size"] == BATCH  # global q N
    g0 = torch.load(tmp_path / "grads_rank0.pt")
    g1 = torch.load(tmp_path / "grads_rank1.pt")
    x, y = _data()
    for k in range(3):
        a, b = r0["drawn"][k], r1["drawn"][k]
        assert all(i % 2 == 0 for i in a) and all(i % 2 == 1 for i in b)  # owned units only
        torch.testing.assert_close(g0[k], g1[k], rtol=0, atol=0)  # the same update everywhere
        if method == "dp-sgd":
            want = _brute(_model().double(), x.double(), y, a + b)
            torch.testing.assert_close(g0[k].double(), want, rtol=1e-4, atol=1e-6)
    if method == "dp-kfc":
        assert r0["fingerprint"] == pytest.approx(r1["fingerprint"], rel=1e-12)
    assert r0["epsilon"] > 0 or r0["epsilon"] == float("inf")


@pytest.mark.parametrize("secure", [False, True], ids=["seeded", "os-entropy"])
def test_noise_is_drawn_once_and_spent_once(secure, two_ranks):
    """Zero gradients: the update is pure noise with std sigma C / (q N), not sqrt(2) times
    that; rank 0 alone keeps the ledger, and spends what one process with N units would."""
    sigma = 2.0
    name = "noise-os-entropy" if secure else "noise-seeded"
    folder, results = two_ranks
    tmp_path, res = folder / name, results[name]
    assert "error" not in res[0] and "error" not in res[1], res
    g0 = torch.load(tmp_path / "grads_rank0.pt")
    g1 = torch.load(tmp_path / "grads_rank1.pt")
    noise = torch.stack(g0)
    torch.testing.assert_close(noise, torch.stack(g1), rtol=0, atol=0)
    want = sigma * C / BATCH
    assert float(noise.std()) == pytest.approx(want, rel=0.08)  # 2 x 643 draws
    assert not torch.equal(g0[0], g0[1])  # fresh noise every step
    assert (tmp_path / "ledger_rank0.json").is_file()
    assert not (tmp_path / "ledger_rank1.json").exists()
    ledger = json.loads((tmp_path / "ledger_rank0.json").read_text(encoding="utf-8"))
    assert ledger["meta"]["world_size"] == 2 and ledger["meta"]["backend"] == "gloo"
    assert ledger["steps"] == 2
    eng, pm, popt, loader = _engine("dp-sgd", _model(), sigma=sigma)
    _steps(pm, popt, loader, steps=2)
    assert res[0]["sample_rate"] == eng.sample_rate == 1 / 4
    assert res[0]["epsilon"] == pytest.approx(eng.get_epsilon(), rel=1e-12)


def test_ranks_with_the_same_mechanism_train(two_ranks):
    """Identical ranks (caller's fields included) pass the check and take their steps."""
    folder, results = two_ranks
    res = results["agree-extra"]
    assert all("error" not in res[r] and res[r]["steps"] == 1 for r in (0, 1)), res


@pytest.mark.parametrize(
    ("job", "wanted"),
    [
        ("differ-clip", [r"rank 1 has max_grad_norm=10\.0 where rank 0 has 1\.0"]),
        (
            "differ-sigma-model",
            [
                r"rank 1 has noise_multiplier=0\.5 where rank 0 has 1\.0",
                r"rank 1 has model_initial_parameters='[0-9a-f]{16}' where rank 0 has '[0-9a-f]",
            ],
        ),
        ("differ-extra", [r"rank 1 has precision='bf16' where rank 0 has 'float32'"]),
        # make_private itself, not only dpkfc-med train, compares the units in order
        ("differ-order", [r"rank 1 has unit_ids='[0-9a-f]{16}' where rank 0 has '[0-9a-f]"]),
    ],
)
def test_ranks_with_another_mechanism_are_refused_before_any_step(job, wanted, two_ranks):
    """Audit defect 5: a rank with C = 10 (or another sigma, initial model, precision) while
    rank 0 and its ledger say C = 1 stops the run on *both* ranks before the first step,
    naming the field, the values and the ranks; no ledger step is written."""
    folder, results = two_ranks
    res = results[job]
    for rank in (0, 1):
        assert res[rank] is not None and res[rank].get("refused"), res
        assert res[rank]["steps"] == 0
        assert "every process must run the same config" in res[rank]["error"]
        for pattern in wanted:
            assert re.search(pattern, res[rank]["error"]), (pattern, res[rank]["error"])
    assert res[0]["error"] == res[1]["error"]  # one verdict, on every rank
    ledger = folder / job / "ledger_rank0.json"
    assert not ledger.exists() or json.loads(ledger.read_text(encoding="utf-8"))["steps"] == 0
    if job == "differ-sigma-model":  # the other fields agree and are not named
        assert "max_grad_norm" not in res[0]["error"]
        assert "model_architecture" not in res[0]["error"]


def test_ranks_holding_the_units_in_another_order_are_refused_before_any_step(two_ranks):
    """Audit round 3: two ranks with the same N but the units in another order were accepted,
    so a unit could be drawn by both ranks (2 C). Both ranks refuse, naming both digests and
    the fix; rank 0's run spends nothing."""
    folder, results = two_ranks
    res = results["train-order"]
    for rank in (0, 1):
        assert res[rank] is not None and res[rank].get("refused"), res
    error = res[0]["error"]
    assert error == res[1]["error"]  # one verdict, on every rank
    digests = re.findall(r"digest ([0-9a-f]{16})|rank 0's have ([0-9a-f]{16})", error)
    assert len({d for pair in digests for d in pair if d}) == 2, error
    assert "rank 1's training units have digest" in error and "same order" in error
    assert "data.path contents" in error and "no step was taken" in error
    run = folder / "train-order" / "run"
    assert not (run / "model.pt").exists()
    ledger = run / "ledger.json"
    assert not ledger.exists() or json.loads(ledger.read_text(encoding="utf-8"))["steps"] == 0


def test_unit_ids_are_read_in_item_order_from_every_kind_of_training_set():
    """The ids each dataset type exposes (``names``, ``ids``, ``records``' case ids, a Subset's
    indices); a dataset without ids falls back to its tensors, which see another order too."""
    from dpkfc_med.bundle.zoo_task import _UnitItems
    from dpkfc_med.data import load_segmentation_folder, resolve_data_path
    from dpkfc_med.data.medmnist import TensorImageDataset
    from dpkfc_med.data.units import UnitImageDataset
    from dpkfc_med.data.volumes import VolumeDataset
    from dpkfc_med.privacy.distributed import unit_ids, unit_ids_digest

    x, y = _data()
    groups = [torch.tensor([0, 1]), torch.tensor([2]), torch.tensor([3, 4])]
    patients = UnitImageDataset(x, y, groups, ["p1", "p0", "p2"])
    bundle = _UnitItems({"b": [{}], "a": [{}], "c": [{}]}, None, seed=0)
    root = resolve_data_path("msd_hippocampus", kind="dir")
    first = sorted(p.name.removesuffix(".nii.gz") for p in (root / "labelsTr").iterdir())[:3]
    volumes = VolumeDataset(load_segmentation_folder(root, case_ids=first), spatial_size=8)
    assert unit_ids(patients) == (["p1", "p0", "p2"], "names")
    assert unit_ids(bundle) == (["a", "b", "c"], "ids")
    assert unit_ids(volumes) == (first, "records[i]['case_id']")
    assert unit_ids(Subset(patients, [2, 0])) == (["p2", "p1"], "names through Subset.indices")
    images = TensorImageDataset(x, y)
    assert unit_ids(images) is None and unit_ids(TensorDataset(x, y)) is None
    for ds in (patients, bundle, volumes, images, TensorDataset(x, y)):
        n = len(ds)
        digest, source = unit_ids_digest(ds)
        assert unit_ids_digest(Subset(ds, list(range(n))))[0] == digest, source  # same order
        assert unit_ids_digest(Subset(ds, list(range(n))[::-1]))[0] != digest, source
    assert (
        "no unit ids" in unit_ids_digest(images)[1]
        and "images and labels" in (unit_ids_digest(images)[1])
    )


def test_mechanism_differences_name_every_field_value_and_rank():
    base = {"max_grad_norm": 1.0, "sample_rate": 0.25, "precision": "float32"}
    per_rank = [
        base,
        {**base, "max_grad_norm": 10.0},
        {**base, "max_grad_norm": 10.0, "sample_rate": 0.5},
        {k: v for k, v in base.items() if k != "precision"},
    ]
    assert mechanism_differences(per_rank) == [
        "ranks 1, 2 have max_grad_norm=10.0 where rank 0 has 1.0",
        "rank 2 has sample_rate=0.5 where rank 0 has 0.25",
        "rank 3 has no precision where rank 0 has 'float32'",
    ]
    assert mechanism_differences([base, dict(base), {**base, "x": float("nan")}]) == [
        "rank 2 has x=nan where rank 0 has none"
    ]
    assert mechanism_differences([{"x": float("nan")}, {"x": float("nan")}]) == []
    check_mechanism_on_every_rank({"max_grad_norm": 1.0})  # one process: nothing to compare


def test_a_crashed_rank_leaves_a_ledger_that_covers_every_release(tmp_path):
    """Rank 1 dies before step 2: rank 0's all-reduce fails, and its ledger holds step 1."""
    res = _spawn(tmp_path, {"crash": {"method": "dp-sgd", "sigma": 1.0, "steps": 3, "die_at": 1}})
    res = res["crash"]
    tmp_path = tmp_path / "crash"
    assert res[1] is None  # died without a word
    assert "error" in res[0] and res[0]["steps"] == 1
    eng, pm, popt, loader = _engine("dp-sgd", _model(), sigma=1.0)
    _steps(pm, popt, loader, steps=1)
    from dpkfc_med.privacy.accounting import PrivacyLedger

    ledger = PrivacyLedger.load(tmp_path / "ledger_rank0.json")
    assert ledger.epsilon("prv") >= eng.get_epsilon() * (1 - 1e-12)


def test_sharded_sampler_is_poisson_over_all_units():
    """The ranks' shards partition the units; each unit is drawn at rate q; empty steps stay."""
    n, q = 7, 0.3
    shards = [
        ShardedPoissonSampler(
            num_samples=n,
            sample_rate=q,
            world=World(r, 3),
            generator=torch.Generator().manual_seed(r),
            steps=4000,
        )
        for r in range(3)
    ]
    assert sorted(i for s in shards for i in s.shard.tolist()) == list(range(n))
    counts = torch.zeros(n)
    empty = 0
    for s in shards:
        batches = list(s)
        assert len(batches) == len(s) == 4000  # no step is skipped
        empty += sum(1 for b in batches if not b)
        for b in batches:
            counts[b] += 1
    assert empty > 0
    torch.testing.assert_close(counts / 4000, torch.full((n,), q), atol=0.03, rtol=0)
