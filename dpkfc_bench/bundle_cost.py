"""A Model Zoo bundle trained by MONAI alone against the same bundle through the private engine.

    python -m dpkfc_bench bundle-cost [--train 16] [--epochs 2] [--repeats 2] [--threads 2]

The bundle is ``tests/bundle/zoo_bundle`` made Model Zoo-sized: a 3D UNet of widths
``--channels`` with residual units and BatchNorm, DiceCE, Adam, ``RandCropByPosNegLabeld`` of
``--crops`` patches of ``--patch``^3 per item, ``--batch`` items per batch (16 crops of 32^3
per step by default), ``CacheDataset`` with ``cache_rate`` 1, on the first ``--train`` bundled
hippocampus cases. Arms, each timed per iteration inside the
trainer's own ``run()`` (Ignite events), the first iteration of each run left out as warm-up:

- ``monai``: the bundle's own ``train#trainer`` (``SupervisedTrainer``), non-private, its
  ``ValidationHandler`` dropped, exactly as ``python -m monai.bundle run`` builds it;
- ``nonprivate``, ``dp-sgd``, ``dp-kfc``: ``dpkfc-med bundle train`` of the same bundle
  (``PrivateTrainer``, Poisson sampling of items at the bundle's batch size, the model fixer's
  GroupNorm; DP-KFC's preconditioner refreshes included).

Batches differ (MONAI: fixed batches of ``--batch`` items; the engine: Poisson batches of that
expected size), so the figure compared is the time per crop (sample the network sees): the median over
iterations of iteration time / crops in it, and the whole run's time / crops. Results:
``dpkfc_bench/results/cost_cpu_bundle.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "tests" / "bundle" / "zoo_bundle"
OUT = ROOT / "dpkfc_bench" / "results" / "cost_cpu_bundle"
ARMS = ("monai", "nonprivate", "dp-sgd", "dp-kfc")


class _Timer:
    """Per-iteration wall time and crop count, attached to any Ignite engine."""

    def __init__(self, crops: Any) -> None:
        self.crops, self.rows, self._t0 = crops, [], 0.0

    def attach(self, engine: Any) -> None:
        from ignite.engine import Events

        engine.add_event_handler(Events.ITERATION_STARTED, self._start)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._stop)

    def _start(self, engine: Any) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, engine: Any) -> None:
        self.rows.append((time.perf_counter() - self._t0, int(self.crops(engine))))


SIZE: list[str] = []
"""Overrides that make the test bundle Model Zoo-sized (set from the command line)."""


def _sized(patch: int, crops: int, batch: int, channels: str) -> list[str]:
    """A Model Zoo-sized UNet (residual units, BatchNorm) on ``crops`` patches per item."""
    shape = f"[{patch},{patch},{patch}]"
    widths = [int(c) for c in channels.split(",")]
    return [
        f"network_def#channels={widths}",
        f"network_def#strides={[2] * (len(widths) - 1)}",
        "network_def#num_res_units=2",
        f"train#preprocessing#transforms#2#spatial_size={shape}",
        f"train#preprocessing#transforms#3#spatial_size={shape}",
        f"train#preprocessing#transforms#3#num_samples={crops}",
        f"train#dataloader#batch_size={batch}",
        f"_meta_#network_data_format#inputs#image#spatial_shape={shape}",
        f"_meta_#network_data_format#outputs#pred#spatial_shape={shape}",
    ]


def _overrides(data: str, train: int, epochs: int) -> list[str]:
    return [
        f"dataset_dir={data}",
        f"num_train={train}",
        f"train#trainer#max_epochs={epochs}",
        "train#dataset#cache_rate=1.0",
        "validate#dataset#data=$[]",
        *SIZE,
    ]


def _monai(data: str, train: int, epochs: int) -> list[tuple[float, int]]:
    from dpkfc_med.bundle.zoo import load_bundle

    parser = load_bundle(BUNDLE, _overrides(data, train, epochs))
    parser["train#handlers"] = [
        h for h in parser["train#handlers"] if "ValidationHandler" not in str(h.get("_target_"))
    ]
    trainer = parser.get_parsed_content("train#trainer")
    timer = _Timer(lambda e: len(e.state.output) if isinstance(e.state.output, list) else 0)
    timer.attach(trainer)
    trainer.run()
    return timer.rows


def _engine(method: str, data: str, train: int, epochs: int, out: Path) -> list[tuple[float, int]]:
    from dpkfc_med.bundle.zoo import prepare_bundle
    from dpkfc_med.training.run import train as run_train

    b = prepare_bundle(
        BUNDLE,
        epsilon=8,
        method=method,
        out=out,
        overrides=_overrides(data, train, epochs),
        settings=["training.progress=false", "training.eval_every=1000"],
    )
    timer = _Timer(lambda e: e.state.step_samples)
    run_train(
        b.cfg, task=b.task, network=(b.network, b.fixes), handlers=[timer, *b.handlers],
        decollate=True,
    )  # fmt: skip
    return timer.rows


def _summary(rows: list[tuple[float, int]]) -> dict[str, Any]:
    timed = [(t, n) for t, n in rows[1:] if n > 0]  # the first iteration is warm-up
    return {
        "iterations": len(rows),
        "crops": sum(n for _, n in timed),
        "ms_per_crop_median": 1e3 * statistics.median(t / n for t, n in timed),
        "ms_per_crop_total": 1e3 * sum(t for t, _ in timed) / max(1, sum(n for _, n in timed)),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    from dpkfc_med.data import resolve_data_path

    torch.set_num_threads(args.threads)
    SIZE[:] = _sized(args.patch, args.crops, args.batch, args.channels)
    data = str(resolve_data_path("msd_hippocampus", kind="dir"))
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for r in range(args.repeats):
        for arm in ARMS:  # interleaved, so machine load falls on every arm alike
            tmp = Path(tempfile.mkdtemp(prefix="bundle_cost_"))
            try:
                rows = (
                    _monai(data, args.train, args.epochs)
                    if arm == "monai"
                    else _engine(arm, data, args.train, args.epochs, tmp / "run")
                )
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            results[arm].append(_summary(rows))
            print(f"repeat {r + 1} {arm}: {results[arm][-1]}", flush=True)
    base = statistics.median(s["ms_per_crop_median"] for s in results["monai"])
    table = {
        arm: {
            "ms_per_crop_median": statistics.median(s["ms_per_crop_median"] for s in runs),
            "ms_per_crop_total": statistics.median(s["ms_per_crop_total"] for s in runs),
            "ratio_to_monai": statistics.median(s["ms_per_crop_median"] for s in runs) / base,
            "runs": runs,
        }
        for arm, runs in results.items()
    }
    return {
        "protocol": __doc__.split("\n\n", 2)[2].strip(),
        "settings": vars(args),
        "torch": torch.__version__,
        "arms": table,
    }


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        "# A Model Zoo bundle: MONAI alone against the private engine (CPU)",
        "",
        f"`python -m dpkfc_bench bundle-cost --train {s['train']} --epochs {s['epochs']} "
        f"--repeats {s['repeats']} --threads {s['threads']} --patch {s['patch']} --crops "
        f"{s['crops']} --batch {s['batch']} --channels {s['channels']}`; torch "
        f"{result['torch']}, 2 CPU cores. Time per "
        "crop (the samples the network sees), median over iterations (first one left out), "
        "median over repeats; the ratio is to MONAI alone.",
        "",
        "| arm | ms per crop (median) | ms per crop (whole run) | / MONAI alone |",
        "|---|---|---|---|",
    ]
    names = {
        "monai": "MONAI alone (`SupervisedTrainer`, non-private)",
        "nonprivate": "engine, non-private",
        "dp-sgd": "engine, DP-SGD",
        "dp-kfc": "engine, DP-KFC (refreshes included)",
    }
    for arm, row in result["arms"].items():
        lines.append(
            f"| {names[arm]} | {row['ms_per_crop_median']:.0f} | {row['ms_per_crop_total']:.0f} "
            f"| {row['ratio_to_monai']:.2f}x |"
        )
    lines += ["", "## Reading", "", result.get("reading", "(not written yet)"), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpkfc_bench bundle-cost", description=__doc__)
    p.add_argument("--train", type=int, default=16, help="training items (hippocampus cases)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--patch", type=int, default=32, help="crop edge (voxels)")
    p.add_argument("--crops", type=int, default=4, help="crops per item (num_samples)")
    p.add_argument("--batch", type=int, default=4, help="items per batch (expected, private)")
    p.add_argument("--channels", default="16,32,64,128", help="UNet widths")
    p.add_argument("--out", default=str(OUT), help="results path without suffix")
    p.add_argument("--reading", default=None, help="the Reading paragraph (Markdown only)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.reading is not None and out.with_suffix(".json").is_file():
        result = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
        result["reading"] = args.reading
    else:
        result = run(args)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    out.with_suffix(".md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))
    return 0
