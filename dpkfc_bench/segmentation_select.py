"""The segmentation study's choices: learning-rate grid, best runs, best recipes, gaps.

One rule for every method: the (learning rate, clip norm) with the best seed-0 validation Dice
on the grid (widened at an edge), evaluated on the evaluation seeds; the gap fraction of a
method at an epsilon is (Dice - DP-SGD Dice) / (non-private Dice - DP-SGD Dice).
"""

from __future__ import annotations

import math
from typing import Any

from dpkfc_bench.harness import mean_std
from dpkfc_bench.segmentation_levers import METHODS, PRIVATE


def clip_scale(key: dict[str, Any]) -> float:
    """The key's clip-norm scale (x the config's ``privacy.max_grad_norm``; 1 when absent)."""
    return float(key.get("clip", 1.0))


def lr_grid(data: dict[str, Any], eps: float | None) -> list[float]:
    """The learning-rate grid at ``eps``: ``--lrs``, plus the points widening added there."""
    extra = (data.get("widened") or {}).get(eps_key(eps), [])
    return sorted({*(data.get("lrs") or []), *extra})


def eps_key(eps: float | None) -> str:
    return "nonprivate" if eps is None else f"{eps:g}"


def widen(data: dict[str, Any], eps: float | None, methods: list[str]) -> float | None:
    """A learning rate one grid step (x3) beyond an edge where some method's best sits."""
    grid = lr_grid(data, eps)
    if len(grid) < 2:
        return None
    best = {best_lr(data, m, eps) for m in methods}
    if grid[-1] in best:
        return _step(grid[-1], up=True) if grid[-1] < 1 else None
    if grid[0] in best:
        return _step(grid[0], up=False)
    return None


def _step(lr: float, *, up: bool) -> float:
    """The neighbour of ``lr`` on the 1-3-10 grid (0.03 -> 0.1 up, 0.003 -> 0.001 down)."""
    e = math.floor(math.log10(lr))
    mantissa = lr / 10**e
    if up:
        return float(f"{(3 if mantissa < 2 else 10) * 10**e:.3g}")
    return float(f"{(1 if mantissa > 2 else 0.3) * 10**e:.3g}")


def clip_grid(data: dict[str, Any], eps: float | None) -> list[float]:
    """The clip-norm scales tuned at ``eps``: ``--clip-scales`` of the study run there."""
    if eps is None:
        return [1.0]
    return sorted((data.get("clip_scales") or {}).get(eps_key(eps)) or [1.0])


def best_run(
    data: dict[str, Any], method: str, eps: float | None, clip: float | None = None
) -> dict[str, Any] | None:
    """The tuning run on the (learning rate, clip scale) grid with the best validation Dice.

    ``clip`` restricts the grid to one clip scale (the lever study runs at the config's).
    """
    lrs = set(lr_grid(data, eps))
    clips = set(clip_grid(data, eps)) if clip is None else {clip}
    tune = [
        r
        for r in data["runs"]
        if r.get("study", "main") == "main"
        and r["phase"] == "tune"
        and r["method"] == method
        and r["eps"] == eps
        and (not lrs or r["lr"] in lrs)
        and clip_scale(r) in clips
    ]
    # Dice to the reported 3 decimals, ties to the config's clip norm: a method that clips every
    # unit under Adam is invariant to C, and its x0.25 runs differ from the x1 runs by float
    # rounding only.
    return (
        max(tune, key=lambda r: (round(r["val"]["mean_dice"], 3), clip_scale(r) == 1.0))
        if tune
        else None
    )


def best_lr(
    data: dict[str, Any], method: str, eps: float | None, clip: float | None = None
) -> float | None:
    """The learning rate of the best tuning run (see :func:`best_run`)."""
    best = best_run(data, method, eps, clip)
    return None if best is None else best["lr"]


def eval_runs(data: dict[str, Any], method: str, eps: float | None) -> list[dict[str, Any]]:
    best = best_run(data, method, eps)
    seeds = set(data.get("seeds") or [])
    return [
        r
        for r in data["runs"]
        if best is not None
        and r.get("study", "main") == "main"
        and r["phase"] == "eval"
        and r["method"] == method
        and r["eps"] == eps
        and r["lr"] == best["lr"]
        and clip_scale(r) == clip_scale(best)
        and (not seeds or r["seed"] in seeds)
    ]


def evaluated(data: dict[str, Any]) -> list[str]:
    """The private methods with evaluation runs at some epsilon, in the tables' order."""
    eps_list = data.get("epsilons") or []
    return [m for m in PRIVATE if any(eval_runs(data, m, e) for e in eps_list)]


def best_recipe(data: dict[str, Any], method: str, eps: float) -> dict[str, Any] | None:
    """The method's best seed-0 run at ``eps``: its main-study point or any of its lever runs.

    One rule for every method: the highest validation Dice (to the reported 3 decimals) among
    the main study's chosen (learning rate, clip norm) and every lever run of the method at
    that epsilon (each lever at that method's own chosen learning rate); ties go to the main
    study (the fewer changes), then to the earlier lever.
    """
    main = best_run(data, method, eps)
    levers = [
        r
        for r in data["runs"]
        if r.get("study") == "levers"
        and r["phase"] == "tune"
        and r["method"] == method
        and r["eps"] == eps
    ]
    cands = ([main] if main is not None else []) + levers
    if not cands:
        return None
    return max(cands, key=lambda r: (round(r["val"]["mean_dice"], 3), r is main))


def _recipe_evals(data: dict[str, Any], best: dict[str, Any]) -> list[dict[str, Any]]:
    """Evaluation runs (seeds of the study) of the recipe ``best`` stands for."""
    if best.get("study", "main") == "main":
        return eval_runs(data, best["method"], best["eps"])
    seeds = set(data.get("seeds") or [])
    return [
        r
        for r in data["runs"]
        if r.get("study") == "levers"
        and r["phase"] == "eval"
        and r["lever"] == best["lever"]
        and r["method"] == best["method"]
        and r["eps"] == best["eps"]
        and r["lr"] == best["lr"]
        and clip_scale(r) == clip_scale(best)
        and (not seeds or r["seed"] in seeds)
    ]


def best_recipe_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per epsilon and private method: the best recipe, its test Dice and the gap it closes.

    The gap is measured between the best-recipe DP-SGD row and non-private training.
    """
    nonprivate = eval_runs(data, "nonprivate", None)
    top = mean_std([r["test"]["mean_dice"] for r in nonprivate])[0] if nonprivate else None
    rows = []
    for eps in data.get("epsilons") or []:
        per: dict[str, dict[str, Any]] = {}
        for method in METHODS[1:]:
            best = best_recipe(data, method, eps)
            if best is None:
                continue
            runs = _recipe_evals(data, best)
            dice = mean_std([r["test"]["mean_dice"] for r in runs]) if runs else None
            per[method] = {"eps": eps, "method": method, "best": best, "runs": runs, "dice": dice}
        floor = (per.get("dp-sgd") or {}).get("dice")
        for row in per.values():
            gap = None
            if row["dice"] and floor and top is not None and top > floor[0]:
                gap = (row["dice"][0] - floor[0]) / (top - floor[0])
            rows.append({**row, "gap": gap})
    return rows


def gap_fractions(data: dict[str, Any]) -> dict[float, dict[str, float]]:
    """Per epsilon: each private method's fraction of the (non-private - DP-SGD) test-Dice gap."""
    out: dict[float, dict[str, float]] = {}
    nonprivate = eval_runs(data, "nonprivate", None)
    if not nonprivate:
        return out
    top = mean_std([r["test"]["mean_dice"] for r in nonprivate])[0]
    for eps in data.get("epsilons") or []:
        sgd = eval_runs(data, "dp-sgd", eps)
        if not sgd:
            continue
        floor = mean_std([r["test"]["mean_dice"] for r in sgd])[0]
        out[eps] = {}
        for method in PRIVATE:
            runs = eval_runs(data, method, eps)
            if runs and top > floor:
                dice = mean_std([r["test"]["mean_dice"] for r in runs])[0]
                out[eps][method] = (dice - floor) / (top - floor)
    return out
