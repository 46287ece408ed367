"""``dpkfc-med tune``: hyperparameter tuning whose guarantee covers the tuning and the selection.

The procedure of :mod:`dpkfc_med.privacy.selection` (Papernot & Steinke 2022):

1. **Plan** from the config, the total target epsilon and the trial-count distribution: every
   trial's training noise ``sigma`` and validation-score noise, so that the whole tuning --
   a random number of trials, only the best released -- spends at most the target.
2. **Draw** the number of trials ``K`` and each trial's hyperparameters (uniformly from the
   grid) from OS entropy, and write them to the tuning ledger (:data:`TUNING_LEDGER`, with
   every trial's score: custodian only) *before* the
   first trial: from then on the whole planned epsilon counts as spent, so a killed tuning can
   never under-report. Grid keys that change the data, the split, the unit, the accountant or
   the mechanism are refused (:data:`GRID_REFUSED`), and every grid value is checked against
   the config before ``K`` is drawn.
3. **Run** each trial as an ordinary private run (its own ledger, checkpoint and report, under
   ``private_not_for_release/trials/``; every trial keeps the tuning's name, so only its
   custodian folder names its index) at that ``sigma``, releasing its last epoch's weights
   (no epoch chosen on private data), then **score** it: the sum of per-unit validation scores
   in ``[0, 1]`` (sensitivity 1) plus Gaussian noise, divided by the number of validation units.
   The validation units are disjoint from the training units.
4. **Release** only the trial with the best noisy score: its model (``model.pt``), its
   hyperparameters and its noisy score, with ``tuning_report.{json,md}``.

Every trial's own run directory, score and report, the number of trials and the released
trial's index stay with the data custodian: releasing them would be more than the analysis
covers. ``--resume`` continues a stopped tuning with the
same ``K`` and trials (an interrupted trial resumes within its own plan).
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import math
import secrets
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpkfc_med.methods import Method
from dpkfc_med.privacy.selection import TrialCount, TuningPlan, plan_tuning
from dpkfc_med.report.custodian import CONFIG_PATHS, PRIVATE_DIR
from dpkfc_med.report.numbers import format_epsilon
from dpkfc_med.report.status import RunStatus
from dpkfc_med.training.config import ConfigError, RunConfig, apply_overrides, config_from_dict
from dpkfc_med.utils import write_json

__all__ = [
    "GRID_ALLOWED",
    "GRID_REFUSED",
    "TUNING_LEDGER",
    "parse_grid",
    "released_model",
    "run_tuning",
    "score_noisily",
]

TUNING_LEDGER = f"{PRIVATE_DIR}/tuning.json"
"""The tuning's ledger: every trial's values and noisy score (custodian only, like a run's)."""
TUNING_SCHEMA = "dpkfc_med.tuning/1"
TRIALS_DIR = f"{PRIVATE_DIR}/trials"
GRID_REFUSED: dict[str, str] = {
    "name": "names the tuning and its released model, not a trial",
    "data": "selects, reads, splits or groups the private data, i.e. the units and the "
    "privacy unit themselves",
    "training.seed": "draws the split (train, validation, test) and the data subset: another "
    "seed moves validation units into training, and the noisy score is no longer on units "
    "disjoint from the trial's training",
    "training.batch_size": "sets the sample rate q = B / N",
    "training.epochs": "sets the number of noisy steps",
    "training.select_epoch": "every trial releases its last epoch; choosing an epoch on the "
    "private validation split is not covered",
    "privacy": "target, delta, noise, accountant and randomness are the tuning's plan, one "
    "for every trial (secure_rng and reproducible_noise decide whether the noise is secret)",
    "probes.allow_public_overlap": "lets the preconditioner depend on private training "
    "images, which no guarantee covers",
    **{
        key: "holds a path, and the grid is published in tuning_report.json (paths stay with "
        "the custodian)"
        for key in CONFIG_PATHS
        if not key.startswith(("data.", "output."))
    },
    "output": "every trial's folder is the tuning's (under private_not_for_release/trials/)",
}
"""Grid keys (a key and everything under it) that would change the data, the split, the unit,
the accountant or the mechanism, with why: every trial must be the same mechanism on the same
units for the selection bound to hold, and a trial must be scored on units it did not train
on. Everything else (learning rate, optimizer, method among the private ones, clip norm,
clipping mode, model, probes, preconditioner, data-free pretraining...) may be tuned."""

GRID_ALLOWED = ("privacy.max_grad_norm", "privacy.clipping")
"""Keys under a refused section that may be tuned: the noise is ``sigma C`` whatever ``C``, and
every clipping mode computes the same clipped sum."""


def _refusal(key: str, choices: Sequence[str]) -> str | None:
    """Why ``--grid key=choices`` is refused (with the fix), or ``None``."""
    why = None
    if key == "method" and Method.NONPRIVATE.value in choices:
        why = "nonprivate has no guarantee to select under"
    for refused, reason in GRID_REFUSED.items():
        if why is not None or key in GRID_ALLOWED:
            break
        if key == refused or key.startswith(refused + "."):
            why = reason
        elif refused.startswith(key + "."):  # a whole section, e.g. training={seed: 1}
            why = f"sets {refused} too, which {reason}"
    if why is None:
        return None
    return (
        f"--grid {key}: {why}; every trial must run the same private mechanism (sample rate, "
        "steps, units, split, delta) for the tuning's bound to hold: set it once in the config, "
        "and tune e.g. training.lr, training.optimizer, privacy.max_grad_norm, "
        "preconditioner.damping_a or method instead"
    )


def parse_grid(items: Sequence[str]) -> dict[str, list[str]]:
    """``["training.lr=0.05,0.1", ...]`` -> ``{"training.lr": ["0.05", "0.1"], ...}``.

    Raises:
        ConfigError: a malformed item, a key of :data:`GRID_REFUSED` (named, with why and the
            fix), or a non-private ``method``; every problem at once.
    """
    grid: dict[str, list[str]] = {}
    problems = []
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        choices = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key or not choices:
            problems.append(f"--grid {item!r}: use KEY=V1,V2,... (e.g. training.lr=0.05,0.1)")
        elif (problem := _refusal(key, choices)) is not None:
            problems.append(problem)
        else:
            grid[key] = choices
    if problems:
        raise ConfigError(problems, "the --grid options")
    return grid


def score_noisily(scores: np.ndarray, noise_multiplier: float) -> float:
    """``(sum(scores) + N(0, noise_multiplier^2)) / len(scores)``, noise from OS entropy.

    ``scores`` are per-unit values in ``[0, 1]``, so the sum has sensitivity 1 and the noise
    multiplier is its standard deviation. The number of validation units is public, as the
    number of training units is.
    """
    s = np.clip(np.asarray(scores, dtype=np.float64), 0.0, 1.0)
    if s.size == 0:
        raise ValueError("the validation split has no unit to score the trial on")
    rng = np.random.default_rng(secrets.randbits(128))
    return float((s.sum() + rng.normal(0.0, noise_multiplier)) / s.size)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _trial_config(
    base: Mapping[str, Any], params: Mapping[str, str], plan: TuningPlan, run_dir: Path
) -> RunConfig:
    raw = copy.deepcopy(dict(base))
    apply_overrides(raw, [f"{k}={v}" for k, v in params.items()])
    raw.setdefault("privacy", {})
    raw["privacy"]["noise_multiplier"] = plan.noise_multiplier
    # the trial's own plan is checked against what its training spends alone
    raw["privacy"]["target_epsilon"] = plan.training_epsilon * 1.01 + 1e-3
    raw.setdefault("training", {})["select_epoch"] = "last"
    raw.setdefault("output", {})["dir"] = str(run_dir)
    # Every trial keeps the tuning's name: the released model.pt embeds its config, and a name
    # holding the trial's index would show that at least index + 1 trials ran (the bound
    # assumes the number of trials stays hidden). Only the trial's folder (custodian) names it.
    return config_from_dict(raw, f"the grid values {dict(params)}")


def _grid_problems(base: RunConfig, grid: Mapping[str, Sequence[str]]) -> list[str]:
    """Every grid value the config refuses, checked before the budget is spent on ``K``."""
    problems = []
    for key, values in grid.items():
        if (problem := _refusal(key, [str(v) for v in values])) is not None:
            problems.append(problem)
            continue
        for value in values:
            raw = copy.deepcopy(base.to_dict())
            try:
                config_from_dict(apply_overrides(raw, [f"{key}={value}"]))
            except ConfigError as err:
                problems += [f"--grid {key}={value}: {p}" for p in err.problems]
    return list(dict.fromkeys(problems))


def released_model(cfg: RunConfig, task: Any, model_pt: Path) -> torch.nn.Module:
    """The network of ``cfg`` holding the weights a run released in ``model_pt``."""
    from dpkfc_med.training.setup import build_run_model

    model, _ = build_run_model(cfg, task, finetune=False)
    model.load_state_dict(torch.load(model_pt, map_location="cpu", weights_only=False)["model"])
    return model


def _plan(cfg: RunConfig, target: float, count: TrialCount) -> tuple[TuningPlan, int, Any]:
    from dpkfc_med.tasks.build import build_task
    from dpkfc_med.training.opening import plan_privacy

    task = build_task(cfg, public_probes=False)
    n_units = len(task.train_set)  # type: ignore[arg-type]
    n_val = len(task.extra["splits"]["val"])
    batch = min(cfg.training.batch_size, n_units)
    steps_per_epoch = max(1, math.ceil(n_units / batch))
    base = plan_privacy(cfg, n_units, steps_per_epoch)  # q, T and delta of every trial
    plan = plan_tuning(target, base.delta, base.sample_rate, base.planned_steps, count)
    return plan, n_val, task


def run_tuning(
    cfg: RunConfig,
    *,
    target_epsilon: float,
    grid: Mapping[str, Sequence[str]],
    trials: TrialCount,
    out: str | Path,
    resume: bool = False,
    rng: np.random.Generator | None = None,
) -> dict[str, Any]:
    """Plan, draw, run and score the trials, release the best; returns the tuning record.

    Args:
        cfg: the base run configuration (a private method).
        target_epsilon: what the whole tuning may spend.
        grid: key -> values; each trial draws one value per key uniformly.
        trials: the distribution of the number of trials.
        out: the tuning's folder.
        resume: continue the tuning in ``out``.
        rng: tests only: a seeded generator for ``K`` and the trials' values (the default
            draws from OS entropy).

    Raises:
        ConfigError: a non-private method, an existing tuning without ``resume``, or
            ``resume`` without one.
    """
    from dpkfc_med.tasks.build import build_task
    from dpkfc_med.training.run import train

    out = Path(out)
    ledger_path = out / TUNING_LEDGER
    if not cfg.method_enum.private:
        raise ConfigError(["method: tuning is for private methods (dp-sgd, dp-kfc, ...)"])
    if ledger_path.is_file() and not resume:
        raise ConfigError(
            [
                f"--out {out}: already holds a tuning ({ledger_path}); pass --resume to continue "
                "it within its budget, or choose another --out (a new tuning spends a new budget)"
            ]
        )
    if resume and not ledger_path.is_file():
        raise ConfigError([f"--resume: no tuning to continue in {out} (no {TUNING_LEDGER})"])
    if not resume and (problems := _grid_problems(cfg, grid)):
        raise ConfigError(problems, "the --grid values (nothing drawn, nothing spent)")
    task = None  # the data of every trial (the grid never changes it), loaded once
    if resume:
        record = json.loads(ledger_path.read_text(encoding="utf-8"))
    else:
        plan, n_val, task = _plan(cfg, target_epsilon, trials)
        draw = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
        k = trials.sample(draw)
        chosen = [
            {key: str(values[int(draw.integers(len(values)))]) for key, values in grid.items()}
            for _ in range(k)
        ]
        record = {
            "schema": TUNING_SCHEMA,
            "created": _now(),
            "config": cfg.to_dict(),
            "plan": plan.to_dict(),
            "grid": {k2: list(v) for k2, v in grid.items()},
            "count": k,
            "validation_units": n_val,
            "epsilon_spent": plan.epsilon,  # the whole procedure, from the moment K is drawn
            "trials": [
                {"index": i, "params": p, "status": "planned", "score": None}
                for i, p in enumerate(chosen)
            ],
            "selected": None,
        }
        out.mkdir(parents=True, exist_ok=True)
        write_json(ledger_path, record)
    p = record["plan"]
    plan = TuningPlan(
        **{k2: v for k2, v in p.items() if k2 not in ("trials", "trials_in_words")},
        trials=TrialCount(**{k2: p["trials"][k2] for k2 in ("kind", "mu", "eta", "gamma")}),
    )
    base = record["config"]
    for trial in record["trials"]:
        if trial["status"] == "scored":
            continue
        run_dir = out / TRIALS_DIR / f"trial_{trial['index']}"
        tcfg = _trial_config(base, trial["params"], plan, run_dir)
        trial["status"] = "running"
        write_json(ledger_path, record)
        status = None
        if (run_dir / "run.json").is_file():
            status = json.loads((run_dir / "run.json").read_text(encoding="utf-8")).get("status")
        if status != RunStatus.COMPLETE:  # a stopped trial continues within its own plan
            again = status is not None or (run_dir / "ledger.json").is_file()
            train(tcfg, resume=again)
        task = task if task is not None else build_task(tcfg, public_probes=False)
        model = released_model(tcfg, task, run_dir / "model.pt")
        scores = task.unit_scores(model, "val", torch.device("cpu"), tcfg.training.eval_batch_size)
        trial["score"] = score_noisily(scores, plan.score_noise)
        trial["status"] = "scored"
        write_json(ledger_path, record)
    done = [t for t in record["trials"] if t["status"] == "scored"]
    if done:
        best = max(done, key=lambda t: t["score"])
        record["selected"] = best["index"]
        src = out / TRIALS_DIR / f"trial_{best['index']}" / "model.pt"
        shutil.copyfile(src, out / "model.pt")
    record["finished"] = _now()
    write_json(ledger_path, record)
    _write_report(record, out)
    return record


def _write_report(record: Mapping[str, Any], out: Path) -> None:
    """The shareable tuning report: the mechanism, the spent epsilon and the released trial."""
    p = record["plan"]
    sel = record["selected"]
    chosen = None if sel is None else record["trials"][sel]
    shareable = {
        "schema": TUNING_SCHEMA,
        "created": str(record.get("created", ""))[:10],
        "epsilon": p["epsilon"],
        "target_epsilon": p["target_epsilon"],
        "delta": p["delta"],
        "accountant": "RDP (dp_accounting RepeatAndSelectDpEvent; Papernot & Steinke 2022)",
        "trials_distribution": p["trials_in_words"],
        "expected_trials": p["trials"]["mean"],
        "trial": {
            "sample_rate": p["sample_rate"],
            "steps": p["steps"],
            "noise_multiplier": p["noise_multiplier"],
            "score_noise_multiplier": p["score_noise"],
            "epsilon_one_trial": p["trial_epsilon"],
        },
        "grid": record["grid"],
        "released": None
        if chosen is None
        else {"params": chosen["params"], "noisy_validation_score": chosen["score"]},
        "guarantee": _guarantee(record),
        "not_covered": [
            "The number of training and validation units (treated as public).",
            f"Everything under {PRIVATE_DIR}/: every trial's run, model, report and score "
            "(releasing them is more than the tuning's analysis covers).",
            "Tuning done outside this command (e.g. the grid itself, if chosen by looking at "
            "the private data).",
        ],
    }
    write_json(out / "tuning_report.json", shareable)
    (out / "tuning_report.md").write_text(_markdown(shareable), encoding="utf-8")


def _guarantee(record: Mapping[str, Any]) -> str:
    p = record["plan"]
    eps, delta = format_epsilon(p["epsilon"]), f"{p['delta']:g}"
    return (
        f"The whole tuning -- a random number of trials ({p['trials_in_words']}), each a private "
        f"training run (noise multiplier {p['noise_multiplier']:.4g}, {p['steps']} Poisson-"
        f"sampled steps at rate {p['sample_rate']:.4g}) scored on the validation units with "
        f"Gaussian noise, and the release of the best trial's model, hyperparameters and noisy "
        f"score -- is ({eps}, {delta})-differentially private with respect to adding or "
        "removing one unit of the training or validation split."
    )


def _values(values: Sequence[Any]) -> str:
    """A grid's values as typed (``[0.05, 0.1]``), not as a list of strings."""
    return "[" + ", ".join(str(v) for v in values) + "]"


def _markdown(r: Mapping[str, Any]) -> str:
    t = r["trial"]
    lines = [
        "# Tuning report",
        "",
        f"**Epsilon {format_epsilon(r['epsilon'])} at delta {r['delta']:g}** for the whole "
        f"tuning (target {format_epsilon(r['target_epsilon'])}; {r['accountant']}): the best of "
        f"a random number of private trials ({r['trials_distribution']}; expected "
        f"{r['expected_trials']:.3g} trials), one trial alone epsilon "
        f"{format_epsilon(t['epsilon_one_trial'])}; the total covers the number of trials, "
        "every trial's training and noisy score, the selection of the best trial and the "
        "released model.",
        "",
        r["guarantee"],
        "",
        "## Mechanism",
        "",
        f"- trials: {r['trials_distribution']} (expected {r['expected_trials']:.3g})",
        f"- each trial: {t['steps']} steps at sample rate {t['sample_rate']:.4g}, noise "
        f"multiplier {t['noise_multiplier']:.4g}; validation score noise multiplier "
        f"{t['score_noise_multiplier']:.4g}; one trial alone: epsilon "
        f"{format_epsilon(t['epsilon_one_trial'])}",
        "- grid: " + "; ".join(f"{k} in {_values(v)}" for k, v in r["grid"].items()),
        "",
        "## Released",
        "",
    ]
    if r["released"] is None:
        lines.append("Nothing: no trial was drawn (the trial count was 0).")
    else:
        params = ", ".join(f"{k}={v}" for k, v in r["released"]["params"].items()) or "base"
        lines.append(
            f"`model.pt`: the best trial ({params}), noisy validation score "
            f"{r['released']['noisy_validation_score']:.3f}."
        )
    lines += ["", "## Not covered", "", *[f"- {item}" for item in r["not_covered"]], ""]
    return "\n".join(lines)
