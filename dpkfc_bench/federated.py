"""Federated demo: MSD hippocampus split over 3 Flower sites, each site private (DP-KFC).

    python -m dpkfc_bench federated                 # 3 sites, 10 rounds x 4 local epochs
    python -m dpkfc_bench federated --rounds 5 --local-epochs 8   # the committed run

Every site trains on every third training case of the shipped hippocampus config's split
(``data.shard``) with the shipped recipe except the batch (16 expected patients per step: a
site holds about 51), at the config's epsilon per site, spread over all rounds. The federated
model is scored on the test cases of seed 0's split, as is the shipped config trained as
shipped on all of that split's training cases in one run (the segmentation benchmark's shipped
study, ``segmentation_hippocampus.json``), whose test Dice is shown next to it. Writes ``dpkfc_bench/results/federated_hippocampus.{json,md}``.

The server never sees a test figure: each site evaluates the federated model on its own test
cases and keeps the result under its ``private_not_for_release/``. Here every site holds the
same test cases (seed 0's split of one public dataset) and this script is the custodian of
every site, so it reads site 0's evaluation.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import yaml

from dpkfc_bench.harness import RESULTS, ROOT, display_path, runs_dir, save_results


def render(result: dict, out: Path) -> None:
    """Write ``out`` (JSON) and its Markdown, with the pooled shipped run looked up again."""
    seg = RESULTS / "segmentation_hippocampus.json"
    shipped = json.loads(seg.read_text(encoding="utf-8")).get("shipped", {}) if seg.exists() else {}
    pooled = shipped.get(result["config"])  # the shipped config trained as shipped
    result["pooled_private_test_dice"] = None if pooled is None else pooled["test"]["mean_dice"]
    save_results(out, result)
    if "target_epsilon_per_site" not in result:  # written before the field existed
        cfg = yaml.safe_load((ROOT / result["config"]).read_text(encoding="utf-8"))
        result["target_epsilon_per_site"] = cfg["privacy"]["target_epsilon"]
    eps = result["target_epsilon_per_site"]
    lines = [
        f"## Federated hippocampus: {result['sites']} sites x {result['rounds']} rounds x "
        f"{result['local_epochs']} local epochs (DP-KFC, epsilon {eps:g} per site)",
        "",
        f"Each site: every {result['sites']}-th training case of seed 0's split, expected batch "
        f"{result['batch_per_site']} patients, the shipped recipe otherwise; FedAvg of the "
        "released site models after every round.",
        "",
        "| site | epsilon spent (PRV) | noisy steps |",
        "|---|---|---|",
        *[f"| {m['site']} | {m['epsilon']:.3f} | {m['steps']} |" for m in result["per_site"]],
        "",
        f"Federated model, test mean Dice: "
        f"{result['federated_test'].get('mean_dice', float('nan')):.3f} (test cases of seed 0's "
        f"split; {result['minutes']:.0f} min on 2 CPU cores shared with other benchmarks).",
    ]
    if pooled is not None:
        lines.append(
            "Pooled private model (the same config trained as shipped on all of seed 0's "
            f"training cases in one run, the same test cases): {pooled['test']['mean_dice']:.3f}."
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    from dpkfc_med.training.config import load_config
    from dpkfc_med.training.federated import run_federated

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--config", type=Path, default=ROOT / "dpkfc_bench/hippocampus_unet_3d_recipe_base.yaml"
    )
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--runs-dir", type=Path, default=runs_dir("federated"))
    p.add_argument("--out", type=Path, default=RESULTS / "federated_hippocampus.json")
    p.add_argument("--render", action="store_true", help="only rewrite the Markdown of --out")
    args = p.parse_args(argv)
    if args.render:
        render(json.loads(args.out.read_text(encoding="utf-8")), args.out)
        return 0
    run = args.runs_dir / args.config.stem
    shutil.rmtree(run, ignore_errors=True)
    cfg = load_config(
        args.config,
        [f"output.dir={run}", f"training.batch_size={args.batch}", "training.progress=false"],
    )
    t0 = time.time()
    rec = run_federated(cfg, sites=args.sites, rounds=args.rounds, local_epochs=args.local_epochs)
    minutes = (time.time() - t0) / 60
    result = {
        "config": display_path(args.config),  # the segmentation study's key of the config
        "sites": args.sites,
        "rounds": args.rounds,
        "local_epochs": args.local_epochs,
        "batch_per_site": args.batch,
        "target_epsilon_per_site": cfg.privacy.target_epsilon,
        "minutes": minutes,
        "per_site": rec["history"][-1]["sites"],
        # custodian-only at site 0 (the same test cases as every site's): read as its custodian
        "federated_test": json.loads(
            (cfg.run_dir() / rec["site_evaluations"][0]).read_text(encoding="utf-8")
        )["metrics"],
    }
    render(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
