"""The cost benchmark's verdicts and tables: ratios against Opacus, the amortised refresh.

:func:`analyse` turns one model's measurement into ratios, the refresh's share of training
time and a verdict per target; :func:`render_markdown` writes a whole result as Markdown.
"""

from __future__ import annotations

import math
from typing import Any

from dpkfc_bench.cost_cases import (
    LR,
    MAX_GRAD_NORM,
    METHODS,
    NOISE_MULTIPLIER,
    OPACUS_MODES,
    STEP_NEUTRAL_OVERRIDES,
    TARGETS,
)

NON_DEFAULT = " (non-default config, see notes)"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or b <= 0:
        return None
    return a / b


def _fastest(values: dict[str, Any]) -> float | None:
    """The smaller of Opacus' modes (hooks, ghost) that were measured."""
    have = [values[m] for m in OPACUS_MODES if values.get(m) is not None]
    return min(have) if have else None


def analyse(mr: dict[str, Any], refresh_every: int | str) -> dict[str, Any]:
    """Ratios vs Opacus, amortised refresh cost and target verdicts for one model.

    ``refresh_every="auto"`` amortises at the model's ``refresh_plan`` period (the engine's
    deterministic choice for this model and batch); the share at the shortest auto period
    (``AUTO_REFRESH_BASE`` steps) is kept for comparison.
    """
    from dpkfc_med.curvature.cost import AUTO_REFRESH_BASE

    if refresh_every == "auto":
        refresh_every = int((mr.get("refresh_plan") or {}).get("refresh_every", AUTO_REFRESH_BASE))
    refresh_every = int(refresh_every)
    t = {m: s["median_ms"] for m, s in mr["methods"].items()}
    mem = {r["method"]: r.get("primary_mib") for r in mr.get("memory", []) if "error" not in r}
    names = [m for m in METHODS if m in t or m in mem]
    ratios = {
        "time": {m: _ratio(t.get(m), t.get("opacus")) for m in names},
        "memory": {m: _ratio(mem.get(m), mem.get("opacus")) for m in names},
        "time_vs_fastest_opacus": {m: _ratio(t.get(m), _fastest(t)) for m in names},
        "memory_vs_fastest_opacus": {m: _ratio(mem.get(m), _fastest(mem)) for m in names},
        "time_vs_nonprivate": {m: _ratio(t.get(m), t.get("nonprivate")) for m in names},
        "time_dpkfc_vs_dpsgd": _ratio(t.get("dp-kfc"), t.get("dp-sgd")),
        "memory_dpkfc_vs_dpsgd": _ratio(mem.get("dp-kfc"), mem.get("dp-sgd")),
    }
    refresh = mr.get("refresh")
    amort: dict[str, Any] | None = None
    if refresh is not None and "dp-kfc" in t:
        r_s = refresh["median_s_default_probes"]
        step_s = t["dp-kfc"] / 1e3
        steps_epoch = math.ceil(mr["epoch_samples"] / mr["batch"])
        per_epoch = math.ceil(steps_epoch / refresh_every) if refresh_every > 0 else 1
        cap = TARGETS["refresh_share_max"]
        amort = {
            "refresh_every": refresh_every,
            "refresh_s": r_s,
            "refresh_extrapolated": refresh["extrapolated"],
            "share_at_default_period": r_s / (refresh_every * step_s + r_s),
            "share_at_base_period": r_s / (AUTO_REFRESH_BASE * step_s + r_s),
            "base_period": AUTO_REFRESH_BASE,
            "epoch_samples": mr["epoch_samples"],
            "epoch_data": mr["epoch_data"],
            "steps_per_epoch": steps_epoch,
            "refreshes_per_epoch": per_epoch,
            "epoch_training_s": steps_epoch * step_s,
            "epoch_refresh_s": per_epoch * r_s,
            "epoch_share": per_epoch * r_s / (steps_epoch * step_s + per_epoch * r_s),
            "refresh_every_for_target": math.ceil(r_s * (1 - cap) / (cap * step_s)),
        }
    overrides = set(mr.get("kfc_overrides", {}))
    step_note = NON_DEFAULT if overrides - STEP_NEUTRAL_OVERRIDES else ""
    if overrides - {"chunk_size", "num_probes"}:
        refresh_note = NON_DEFAULT
    elif amort and amort["refresh_extrapolated"]:
        refresh_note = " (refresh extrapolated to the default number of probes, see notes)"
    else:
        refresh_note = NON_DEFAULT if "num_probes" in overrides else ""
    verdict = {
        "step": _verdict(ratios["time"].get("dp-kfc"), TARGETS["step_ratio_max"], step_note),
        "memory": _verdict(ratios["memory"].get("dp-kfc"), TARGETS["memory_ratio_max"], step_note),
        "refresh": _verdict(
            amort["share_at_default_period"] if amort else None,
            TARGETS["refresh_share_max"],
            refresh_note,
            strict=True,
        ),
    }
    if "opacus-ghost" in t:  # the fastest-competitor targets (results with both Opacus modes)
        verdict |= {
            "fastest_step": _verdict(
                ratios["time_vs_fastest_opacus"].get("dp-kfc"),
                TARGETS["fastest_step_ratio_max"],
                step_note,
            ),
            "fastest_memory": _verdict(
                ratios["memory_vs_fastest_opacus"].get("dp-kfc"),
                TARGETS["fastest_memory_ratio_max"],
                step_note,
            ),
            "nonprivate_step": _verdict(
                ratios["time_vs_nonprivate"].get("dp-kfc"),
                TARGETS["nonprivate_step_ratio_max"],
                step_note,
            ),
        }
    return {"ratios": ratios, "refresh_amortised": amort, "targets": verdict}


def _period_text(mr: dict[str, Any], am: dict[str, Any]) -> str:
    plan = mr.get("refresh_plan") or {}
    if plan.get("refresh_every") == am["refresh_every"] and "estimated_share" in plan:
        return (
            f"refresh_every=auto: every {am['refresh_every']} steps, estimated "
            f"{100 * plan['estimated_share']:.1f}% from multiply-adds"
        )
    return f"refresh_every={am['refresh_every']}"


def _verdict(value: float | None, limit: float, note: str, strict: bool = False) -> str:
    if value is None:
        return "not measured"
    ok = value < limit if strict else value <= limit
    return ("met" if ok else "missed") + note


def _fmt(v: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{suffix}"


def _model_markdown(mr: dict[str, Any]) -> list[str]:
    an = mr["analysis"]
    n_timed = next(iter(mr["methods"].values()))["n"] if mr["methods"] else 0
    lines = [
        f"## {mr['model']}: batch {mr['batch']}, input {'x'.join(map(str, mr['shape']))}",
        "",
        f"{mr['description']}; {mr['params']:,} parameters; {mr['built_by']}. "
        f"Batch requested {mr['batch_requested']}, used {mr['batch']}"
        + (f" ({mr['batch_note']})" if mr.get("batch_note") else "")
        + f". {n_timed} timed steps per method ({mr['rounds']} rounds x "
        f"{mr['steps_per_round']}, {mr['warmup']} warm-up).",
        "",
    ]
    if mr.get("kfc_overrides"):
        why = "; ".join(mr.get("kfc_notes", []))
        lines += [
            "dp-kfc config differs from the default: "
            + ", ".join(f"`{k}={v}`" for k, v in mr["kfc_overrides"].items())
            + (f" -- {why}" if why else "")
            + ".",
            "",
        ]
    lines += [
        "| method | median step ms | p10-p90 ms | vs Opacus | peak memory MiB | vs Opacus |",
        "|---|---|---|---|---|---|",
    ]
    mem = {r["method"]: r for r in mr.get("memory", [])}
    for m in [m for m in METHODS if m in mr["methods"] or m in mem or m in mr.get("errors", {})]:
        s = mr["methods"].get(m)
        mrow = mem.get(m, {})
        mem_txt = "error" if "error" in mrow else _fmt(mrow.get("primary_mib"))
        if s is None:
            err = mr["errors"].get(m, "not run")
            lines.append(f"| {m} | failed: {err} | | | {mem_txt} | |")
            continue
        lines.append(
            f"| {m} | {s['median_ms']:.2f} | {s['p10_ms']:.2f}-{s['p90_ms']:.2f} | "
            f"{_fmt(an['ratios']['time'].get(m), '.2f', 'x')} | {mem_txt} | "
            f"{_fmt(an['ratios']['memory'].get(m), '.2f', 'x')} |"
        )
    lines.append("")
    for r in mr.get("memory", []):
        if "error" in r:
            lines.append(f"Memory of {r['method']} failed: {r['error']}")
    for k, v in mr.get("errors", {}).items():
        lines.append(f"Error ({k}): {v}")
    if any("error" in r for r in mr.get("memory", [])) or mr.get("errors"):
        lines.append("")
    ref, am = mr.get("refresh"), an.get("refresh_amortised")
    if ref and am:
        c = ref["calls"][-1] if ref["calls"] else {}
        if not c:  # no timed repeat: show the parts of the cold first refresh
            p = ref["initial_parts_s"]
            c = {
                "factors_s": p["factors"],
                "inverse_s": p["inverse"],
                "calibration_s": p["total_in_from_probes"] - p["factors"] - p["inverse"],
                "probe_sampling_and_attach_s": ref["initial_s"] - p["total_in_from_probes"],
            }
        extra = (
            f" (measured {ref['median_s']:.3f} s with {ref['num_probes']} probes, extrapolated to "
            f"the default {mr['kfc_default_probes']})"
            if am["refresh_extrapolated"]
            else ""
        )
        lines += [
            f"Refresh (`engine.refresh_preconditioner()`, factors={ref.get('factors')}, "
            f"{ref['num_probes']} probes in chunks of "
            f"{ref['chunk_size']}, {ref['covered_layers']} covered layers, {ref['full_factors']} "
            f"full and {ref['diagonal_factors']} diagonal factors, largest full "
            f"{ref['largest_full_factor']}, {ref['fallback_params']} fallback parameters): "
            f"{am['refresh_s']:.3f} s{extra}; cold first refresh {ref['initial_s']:.3f} s. Last "
            f"call: probe sampling + attach {_fmt(c.get('probe_sampling_and_attach_s'), '.3f')} s, "
            f"factors {_fmt(c.get('factors_s'), '.3f')} s, inverse roots + spectra "
            f"{_fmt(c.get('inverse_s'), '.3f')} s, scale calibration "
            f"{_fmt(c.get('calibration_s'), '.3f')} s.",
            "",
            f"Amortised at the default refresh period ({_period_text(mr, am)}): "
            f"{100 * am['share_at_default_period']:.1f}% of training time "
            f"({100 * am.get('share_at_base_period', am['share_at_default_period']):.1f}% at "
            f"refresh_every={am.get('base_period', am['refresh_every'])}). Per epoch of "
            f"{am['epoch_data']} at batch {mr['batch']}: {am['steps_per_epoch']} steps = "
            f"{am['epoch_training_s']:.1f} s training + {am['refreshes_per_epoch']} refreshes = "
            f"{am['epoch_refresh_s']:.1f} s ({100 * am['epoch_share']:.1f}%). refresh_every >= "
            f"{am['refresh_every_for_target']} would keep refreshes under "
            f"{100 * TARGETS['refresh_share_max']:.0f}%.",
            "",
        ]
    macs = (mr.get("memory_footprint_estimate") or {}).get("macs_per_sample")
    if macs:
        raw, extra = sum(m["raw"] for m in macs), sum(m["transform"] for m in macs)
        top = max(macs, key=lambda m: m["transform"])
        lines += [
            f"Where dp-kfc's extra time goes (multiply-adds per sample, covered layers): "
            f"per-sample gradients {raw / 1e6:.1f} M (DP-SGD computes these too), DP-KFC "
            f"transform {extra / 1e6:.1f} M ({extra / max(raw, 1):.2f}x the per-sample gradients); "
            f"largest transform: `{top['layer']}` ({top['type']}) {top['transform'] / 1e6:.1f} M "
            f"vs {top['raw'] / 1e6:.1f} M for its per-sample gradient. A layer's per-sample "
            "gradients cost what its forward pass does, so the non-private forward and backward "
            f"of these layers is about {3 * raw / 1e6:.1f} M: the transform alone puts dp-kfc at "
            f"no less than {1 + extra / max(3 * raw, 1):.2f}x non-private time at equal "
            "arithmetic speed.",
            "",
        ]
    share = am["share_at_default_period"] if am else None
    lines += [
        "| target | value | verdict |",
        "|---|---|---|",
        f"| dp-kfc step <= {TARGETS['step_ratio_max']}x Opacus | "
        f"{_fmt(an['ratios']['time'].get('dp-kfc'), '.2f', 'x')} | {an['targets']['step']} |",
        f"| dp-kfc peak memory <= {TARGETS['memory_ratio_max']}x Opacus | "
        f"{_fmt(an['ratios']['memory'].get('dp-kfc'), '.2f', 'x')} | {an['targets']['memory']} |",
        f"| refresh < {100 * TARGETS['refresh_share_max']:.0f}% of training time | "
        f"{_fmt(None if share is None else 100 * share, '.1f', '%')} | "
        f"{an['targets']['refresh']} |",
    ]
    if "fastest_step" in an["targets"]:
        r, tg = an["ratios"], an["targets"]
        lines += [
            f"| dp-kfc step <= {TARGETS['fastest_step_ratio_max']}x Opacus' fastest mode | "
            f"{_fmt(r['time_vs_fastest_opacus'].get('dp-kfc'), '.2f', 'x')} | "
            f"{tg['fastest_step']} |",
            f"| dp-kfc peak memory <= {TARGETS['fastest_memory_ratio_max']}x Opacus' fastest "
            f"mode | {_fmt(r['memory_vs_fastest_opacus'].get('dp-kfc'), '.2f', 'x')} | "
            f"{tg['fastest_memory']} |",
            f"| dp-kfc step <= {TARGETS['nonprivate_step_ratio_max']}x non-private | "
            f"{_fmt(r['time_vs_nonprivate'].get('dp-kfc'), '.2f', 'x')} | "
            f"{tg['nonprivate_step']} |",
        ]
    lines.append("")
    return lines


def _load_warning(result: dict[str, Any]) -> str:
    cpus = result["machine"]["cpu_count"] or 1
    loads = [v[0] for v in (result["loadavg_start"], result["loadavg_end"]) if v]
    if result["machine"]["device"] == "cpu" and loads and max(loads) > cpus:
        return (
            f" -- **the {cpus} CPUs were oversubscribed by other processes during this run "
            "(load above the CPU count): step times are inflated and noisy, compare ratios "
            "with care**"
        )
    return ""


def render_markdown(result: dict[str, Any]) -> str:
    """Human-readable tables of a result dict."""
    cfg, mach = result["config"], result["machine"]
    lines = [
        f"# Cost benchmark ({'quick' if cfg['quick'] else 'full'}, {mach['device']})",
        "",
        f"Generated by `{result['command']}` on {result['date']} in {result['wall_s']:.0f} s.",
        "",
        f"- Machine: {mach.get('cpu_model', mach['processor'])}, {mach['cpu_count']} CPUs, "
        f"torch threads {mach['torch_threads']}, GPU: {mach['gpu'] or 'none'}; "
        f"{mach['platform']}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()),
        f"- Git commit: {result['git_commit'] or 'unavailable'}; package source sha256 "
        f"{result.get('package_source', {}).get('sha256', 'n/a')[:16]} (newest file "
        f"{result.get('package_source', {}).get('newest_mtime', 'n/a')}); seeds {cfg['seeds']}",
        f"- Load average (1/5/15 min) at start {result['loadavg_start']}, at end "
        f"{result['loadavg_end']}" + _load_warning(result),
        f"- Step = zero_grad + forward + loss + backward + optimizer.step on one fixed batch "
        f"(forward in {_precision_text(cfg)}); "
        f"SGD lr {LR}; sigma {NOISE_MULTIPLIER}, C {MAX_GRAD_NORM}. Methods timed round-robin "
        "(order rotating per round); median over all timed steps.",
        f"- Peak memory: {result['memory_method']}; each (model, method) in a fresh process.",
        f"- dp-kfc: `PreconditionerConfig()` defaults ({result['preconditioner_config']}) unless "
        "a model's notes say otherwise; refresh timed separately, amortised at the default "
        f"refresh_every={result['refresh_every_default']} (per model below).",
        f"- Targets: dp-kfc step <= {TARGETS['step_ratio_max']}x Opacus, peak memory <= "
        f"{TARGETS['memory_ratio_max']}x Opacus, refresh < "
        f"{100 * TARGETS['refresh_share_max']:.0f}% of training time.",
        "",
    ]
    for mr in result["models"]:
        lines += _model_markdown(mr)
    rows = []
    for mr in result["models"]:
        r = mr["analysis"]["ratios"]
        rows.append(
            f"| {mr['model']} | {_fmt(r['time'].get('dp-sgd'), '.2f', 'x')} | "
            f"{_fmt(r['time_dpkfc_vs_dpsgd'], '.2f', 'x')} | "
            f"{_fmt(r['memory'].get('dp-sgd'), '.2f', 'x')} | "
            f"{_fmt(r['memory_dpkfc_vs_dpsgd'], '.2f', 'x')} |"
        )
    lines += [
        "## Other ratios",
        "",
        "| model | dp-sgd / opacus time | dp-kfc / dp-sgd time | dp-sgd / opacus memory | "
        "dp-kfc / dp-sgd memory |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]
    return "\n".join(lines)


def _precision_text(cfg: dict[str, Any]) -> str:
    if cfg.get("precision", "float32") == "bf16":
        return "bfloat16 autocast for every method; our engines' per-sample gradients in float32"
    return "float32"
