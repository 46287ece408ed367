"""The segmentation study's Markdown summary and figure, generated from its result JSON."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from dpkfc_bench.harness import fmt_mean_std, mean_std, table
from dpkfc_bench.segmentation_levers import LEVERS, METHODS, PRIVATE, lever_clip
from dpkfc_bench.segmentation_select import (
    best_lr,
    best_recipe_rows,
    clip_scale,
    eval_runs,
    evaluated,
    gap_fractions,
)


def _best_recipe_lines(data: dict[str, Any]) -> list[str]:
    rows = best_recipe_rows(data)
    if not rows:
        return []
    base_clip = (data.get("config_contents") or {}).get("privacy", {}).get("max_grad_norm")
    lines = [
        "",
        "Best recipe per method and epsilon: the highest seed-0 validation Dice among the main "
        "study's chosen point and every lever run of that method at that epsilon (one rule for "
        "every method; DP-KFC has more candidates, its preconditioner levers), evaluated on "
        "the test cases of seeds "
        f"{data.get('seeds')}; gap closed = (Dice - best-recipe DP-SGD) / (non-private - "
        "best-recipe DP-SGD):",
        "",
        "| epsilon | method | recipe | lr | clip norm | val Dice (seed 0) | test mean Dice "
        "| gap closed | seeds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        best, dice = row["best"], row["dice"]
        recipe = "main study point" if best.get("study", "main") == "main" else best["lever"]
        test = f"{dice[0]:.3f} +- {dice[1]:.3f}" if dice else "not evaluated"
        gap = (
            "-" if row["gap"] is None or row["method"] == "dp-sgd" else f"{100 * row['gap']:.0f} %"
        )
        seeds = ",".join(str(r["seed"]) for r in row["runs"]) or "-"
        lines.append(
            f"| {row['eps']:g} | {row['method']} | {recipe} | {best['lr']:g} | "
            f"{clip_cell(base_clip, best)} | {best['val']['mean_dice']:.3f} | {test} | {gap} "
            f"| {seeds} |"
        )
    return lines


def compact_table(data: dict[str, Any]) -> list[str]:
    """Test mean Dice per method (rows) and epsilon (columns), with the gap closed."""
    eps_list = data.get("epsilons") or []
    gaps = gap_fractions(data)
    lines = table(["method", *(f"epsilon {e:g}" for e in eps_list)])
    nonprivate = eval_runs(data, "nonprivate", None)
    if nonprivate:
        dice = fmt_mean_std([r["test"]["mean_dice"] for r in nonprivate])
        lines.append("| non-private | " + " | ".join([dice] * len(eps_list)) + " |")
    for method in evaluated(data):
        cells = []
        for eps in eps_list:
            runs = eval_runs(data, method, eps)
            if not runs:
                cells.append("-")
                continue
            gap = gaps.get(eps, {}).get(method)
            extra = (
                f" ({100 * gap:.0f} % of the gap)" if gap is not None and method != "dp-sgd" else ""
            )
            cells.append(fmt_mean_std([r["test"]["mean_dice"] for r in runs]) + extra)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def clip_cell(base_clip: float | None, run: dict[str, Any]) -> str:
    """The run's clip norm: the config's times the run's and its lever's scales ("-": none)."""
    if run["eps"] is None:
        return "-"
    scale = clip_scale(run) * lever_clip(run.get("lever"))
    return f"{base_clip * scale:g}" if base_clip is not None else f"x{scale:g}"


def summarize(data: dict[str, Any]) -> str:
    """Markdown: test Dice per epsilon and method, gap fractions, HD95, evidence, tuning, levers."""
    names = data.get("class_names") or []
    fmt = fmt_mean_std

    def hd(runs: list[dict[str, Any]]) -> str:
        vals = [
            np.nanmean([v for v in r["test"].get("hd95_per_class", {}).values()])
            for r in runs
            if r["test"].get("hd95_per_class")
        ]
        return f"{np.mean(vals):.2f}" if vals else "-"

    gaps = gap_fractions(data)
    base_clip = (data.get("config_contents") or {}).get("privacy", {}).get("max_grad_norm")
    lines = [
        f"## {data.get('config')} (test cases; mean +- std over seeds {data.get('seeds')})",
        "",
        *compact_table(data),
        "",
        "| method | target epsilon | lr (chosen on val) | clip norm (chosen on val) | test mean Dice | "
        + " | ".join(f"Dice {n}" for n in names)
        + " | HD95 mm (mean of classes) | gap closed | eps spent | minutes per run | runs |",
        "|---|---|---|---|---|" + "---|" * len(names) + "---|---|---|---|---|",
    ]
    rows: list[tuple[str, float | None]] = [("nonprivate", None)]
    rows += [(m, e) for e in data.get("epsilons") or [] for m in PRIVATE]
    for method, eps in rows:
        runs = eval_runs(data, method, eps)
        if not runs:
            continue
        per_class = [fmt([r["test"]["dice_per_class"][n] for r in runs]) for n in names]
        spent = [r["epsilon_spent"] for r in runs if r.get("epsilon_spent") is not None]
        gap = gaps.get(eps, {}).get(method) if eps is not None else None
        lines.append(
            f"| {method} | {'-' if eps is None else f'{eps:g}'} | {runs[0]['lr']:g} | "
            f"{clip_cell(base_clip, runs[0])} | {fmt([r['test']['mean_dice'] for r in runs])} | "
            + " | ".join(per_class)
            + f" | {hd(runs)} | {'-' if gap is None else f'{100 * gap:.0f} %'} | "
            f"{f'{max(spent):.3f}' if spent else '-'} | "
            f"{np.mean([r['seconds'] for r in runs]) / 60:.1f} | {len(runs)} |"
        )
    lines += _best_recipe_lines(data)
    if data.get("notes"):  # what the study did not run, in words (kept with the results)
        lines += ["", "Notes on this study:", ""] + [f"- {n}" for n in data["notes"]]
    lines += _evidence_lines(data)
    lines += [
        "",
        "Tuning runs (seed 0, validation mean Dice):",
        "",
        "| method | target epsilon | lr | clip norm | val mean Dice |",
        "|---|---|---|---|---|",
    ]
    for r in data["runs"]:
        if r.get("study", "main") == "main" and r["phase"] == "tune":
            eps = "-" if r["eps"] is None else f"{r['eps']:g}"
            lines.append(
                f"| {r['method']} | {eps} | {r['lr']:g} | {clip_cell(base_clip, r)} | "
                f"{r['val']['mean_dice']:.3f} |"
            )
    all_levers = [r for r in data["runs"] if r.get("study") == "levers"]
    for eps in sorted({r["eps"] for r in all_levers}, reverse=True):
        lever_runs = [r for r in all_levers if r["eps"] == eps and r["phase"] == "tune"]
        lines += [
            "",
            f"Lever study (epsilon {eps:g}, seed 0, validation mean Dice; one change from the "
            "shipped config; each method at its learning rate chosen above at the config's clip "
            "norm):",
            "",
            "| lever | " + " | ".join(METHODS[1:]) + " | clipped fraction (dp-sgd / dp-kfc) |",
            "|---|---|---|---|",
        ]
        shipped = [
            r
            for r in data["runs"]
            if r.get("study", "main") == "main"
            and r["phase"] == "tune"
            and r["eps"] == eps
            and clip_scale(r) == 1.0
            and r["lr"] == best_lr(data, r["method"], eps, 1.0)
        ]
        for lever in LEVERS:
            cells, clipped = [], []
            for method in METHODS[1:]:
                pool = shipped if lever == "shipped" else lever_runs
                r = next((x for x in pool if x["lever"] == lever and x["method"] == method), None)
                cells.append("-" if r is None else f"{r['val']['mean_dice']:.3f}")
                frac = (r or {}).get("evidence", {}).get("mean_clipped_fraction")
                clipped.append("-" if frac is None else f"{frac:.2f}")
            if any(c != "-" for c in cells):
                lines.append(f"| {lever} | " + " | ".join(cells) + f" | {' / '.join(clipped)} |")
        lines += _lever_snr_lines(shipped, lever_runs, eps)
    lines += _lever_eval_lines(data)
    if data.get("shipped"):
        lines += [
            "",
            "Shipped configs trained as shipped (noise from OS entropy, 2 torch threads, seed 0's "
            "split), then `dpkfc-med evaluate RUN --data FOLDER` on a folder of the run's test "
            "cases only. Minutes include data-free pretraining and exclude the evaluation; "
            "the load on the 2 cores during each run is in the notes above:",
            "",
            "| config | eps spent | minutes (2 threads) | test Dice | Dice on the unseen-case "
            "folder (cases) | HD95 mm per class |",
            "|---|---|---|---|---|---|",
        ]
        earlier = [(r["config"] + " (earlier version)", r) for r in data.get("shipped_history", [])]
        for name, r in [*data["shipped"].items(), *earlier]:
            u = r["unseen_folder"]
            hd95 = ", ".join(f"{k} {v:.2f}" for k, v in (u.get("hd95_per_class") or {}).items())
            lines.append(
                f"| {name} | {r['epsilon_spent']:.3f} | {r['minutes']:.1f} | "
                f"{r['test']['mean_dice']:.3f} | {u['mean_dice']:.3f} ({u['n']}) | {hd95} |"
            )
    env = data.get("environment", {})
    devices = sorted({r.get("device", "cpu") for r in data["runs"]})
    lines += [
        "",
        f"Machine: {env.get('platform')}, {data.get('workers', 1)} runs in parallel with one "
        f"torch thread each, training on {' and '.join(devices)}; git commits of the runs {', '.join(data.get('git_commits') or [str(data.get('git_commit'))])} "
        "(later commits add studies and options; the code of the runs already made is unchanged).",
    ]
    return "\n".join(lines) + "\n"


def _lever_eval_lines(data: dict[str, Any]) -> list[str]:
    """Levers evaluated on the evaluation seeds: test Dice and the gap closed, per epsilon."""
    runs = [r for r in data["runs"] if r.get("study") == "levers" and r["phase"] == "eval"]
    if not runs:
        return []
    nonprivate = eval_runs(data, "nonprivate", None)
    top = mean_std([r["test"]["mean_dice"] for r in nonprivate])[0] if nonprivate else None
    lines = [
        "",
        "Levers evaluated on the evaluation seeds (test cases of each seed's split; the lever "
        "at the learning rate and clip norm of its seed-0 run; gap closed against the main "
        "study's DP-SGD and non-private rows at that epsilon):",
        "",
        "| epsilon | lever | method | lr | clip norm | test mean Dice | gap closed | seeds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base_clip = (data.get("config_contents") or {}).get("privacy", {}).get("max_grad_norm")
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["eps"], r["lever"], r["method"], r["lr"], clip_scale(r)), []).append(r)
    for (eps, lever, method, lr, _), rs in sorted(
        groups.items(), key=lambda kv: (-kv[0][0], kv[0][1], kv[0][2])
    ):
        dice = [r["test"]["mean_dice"] for r in rs]
        m, sd = mean_std(dice)
        sgd = eval_runs(data, "dp-sgd", eps)
        floor = mean_std([r["test"]["mean_dice"] for r in sgd])[0] if sgd else None
        gap = (
            f"{100 * (m - floor) / (top - floor):.0f} %"
            if top is not None and floor is not None and top > floor
            else "-"
        )
        lines.append(
            f"| {eps:g} | {lever} | {method} | {lr:g} | {clip_cell(base_clip, rs[0])} | "
            f"{m:.3f} +- {sd:.3f} | {gap} | {','.join(str(r['seed']) for r in rs)} |"
        )
    return lines


def _lever_snr_lines(
    shipped: list[dict[str, Any]], lever_runs: list[dict[str, Any]], eps: float
) -> list[str]:
    """Per-layer SNR of every lever run (covered layers; not DP: un-noised statistics)."""
    rows = [(r, "shipped") for r in shipped] + [(r, r["lever"]) for r in lever_runs]
    rows = [(r, name) for r, name in rows if (r.get("evidence") or {}).get("mean_layer_snr")]
    if not rows:
        return []
    # the layers every run reports under one name (DP-KFC's fallback parameters are named
    # apart, so the norm affines drop out and the covered layers remain)
    layers = [
        k
        for k in rows[0][0]["evidence"]["mean_layer_snr"]
        if all(k in r["evidence"]["mean_layer_snr"] for r, _ in rows)
    ]
    out = [
        "",
        f"Per-layer SNR of the lever runs at epsilon {eps:g} (squared norm of the clipped batch "
        "sum / expected squared norm of the noise on the layer, mean over steps; un-noised "
        "private statistics, not DP):",
        "",
        "| lever | method | " + " | ".join(layers) + " |",
        "|---|---|" + "---|" * len(layers),
    ]
    order = {name: i for i, name in enumerate(LEVERS)}
    for r, name in sorted(rows, key=lambda x: (order.get(x[1], 99), x[0]["method"])):
        snr = r["evidence"]["mean_layer_snr"]
        cells = [f"{snr[k]:.2g}" if snr.get(k) is not None else "-" for k in layers]
        out.append(f"| {name} | {r['method']} | " + " | ".join(cells) + " |")
    return out


def _evidence_lines(data: dict[str, Any]) -> list[str]:
    """Per-layer share of the clipped norm and SNR, seed-1 evaluation runs, per epsilon."""
    lines: list[str] = []
    for eps in data.get("epsilons") or []:
        runs = {m: eval_runs(data, m, eps) for m in PRIVATE}
        first = {
            m: next((r for r in rs if r["seed"] == min(x["seed"] for x in rs)), None)
            for m, rs in runs.items()
            if rs
        }
        if len(first) < 2 or "dp-kfc" not in first:
            continue
        ev = {m: r.get("evidence") or {} for m, r in first.items() if r}
        shown = [m for m in PRIVATE if m in ev]
        layers = list((ev.get("dp-kfc") or {}).get("mean_layer_share") or {})
        if not layers:
            continue
        seed = first["dp-kfc"]["seed"]
        lines += [
            "",
            f"Per-layer evidence at epsilon {eps:g} (seed {seed}, means over steps; computed from "
            "un-noised private statistics, not DP): share of the clipped squared norm, and SNR = "
            "squared norm of the clipped batch sum / expected squared norm of the noise on the "
            "layer. Clipped fraction: "
            + ", ".join(
                f"{m} {e.get('mean_clipped_fraction', float('nan')):.2f}" for m, e in ev.items()
            ),
            "",
            "| layer | "
            + " | ".join(f"{what} {m}" for what in ("share", "SNR") for m in shown)
            + " |",
            "|---|" + "---|" * (2 * len(shown)),
        ]
        for layer in layers:
            cells = []
            for field in ("mean_layer_share", "mean_layer_snr"):
                for m in shown:
                    v = (ev.get(m, {}).get(field) or {}).get(layer)
                    cells.append("-" if v is None else f"{v:.3g}")
            lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return lines


def plot(data: dict[str, Any], path: Path) -> None:
    """Test Dice against epsilon (left) and the gap fraction per epsilon (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps_list = sorted(data.get("epsilons") or [])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    nonprivate = eval_runs(data, "nonprivate", None)
    if nonprivate:
        m, s = mean_std([r["test"]["mean_dice"] for r in nonprivate])
        ax.axhspan(m - s, m + s, color="grey", alpha=0.2)
        ax.axhline(m, color="grey", label="non-private")
    shown = evaluated(data)
    for method in shown:
        xs, ms, ss = [], [], []
        for eps in eps_list:
            runs = eval_runs(data, method, eps)
            if runs:
                m, s = mean_std([r["test"]["mean_dice"] for r in runs])
                xs.append(eps), ms.append(m), ss.append(s)
        if xs:
            ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, label=method)
    for method in METHODS[1:]:  # each method's best recipe (lever or main point) per epsilon
        pts = [
            (r["eps"], *r["dice"])
            for r in best_recipe_rows(data)
            if r["method"] == method and r["dice"] is not None
        ]
        if pts:
            xs, ms, ss = zip(*sorted(pts))
            ax.errorbar(
                xs, ms, yerr=ss, marker="s", ls="--", capsize=3, label=f"{method}, best recipe"
            )
    ax.set_xscale("log")
    ax.set_xticks(eps_list, [f"{e:g}" for e in eps_list])
    ax.set_xlabel("epsilon (one patient = one unit)")
    ax.set_ylabel("test mean Dice (mean +- std over seeds)")
    ax.legend()
    gaps = gap_fractions(data)
    width = 0.8 / max(1, len(shown))
    for i, method in enumerate(shown):
        vals = [100 * gaps.get(e, {}).get(method, math.nan) for e in eps_list]
        offset = (i - (len(shown) - 1) / 2) * width
        bx.bar(np.arange(len(eps_list)) + offset, vals, width, label=method)
    bx.axhline(100, color="grey", lw=0.8)
    bx.set_xticks(np.arange(len(eps_list)), [f"{e:g}" for e in eps_list])
    bx.set_xlabel("epsilon")
    bx.set_ylabel("% of the (non-private - DP-SGD) gap closed")
    bx.legend()
    fig.suptitle("MSD hippocampus, MONAI 3D UNet")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
