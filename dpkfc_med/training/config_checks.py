"""The value rules of a run config: allowed choices, positive fields and cross-field checks.

:func:`value_problems` lists every problem of a built :class:`~.config.RunConfig` at once
(``config_from_dict`` reports them together with the structural ones).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, NamedTuple

from dpkfc_med.curvature.cost import refresh_settings_problems
from dpkfc_med.curvature.preconditioner import PreconditionerConfig
from dpkfc_med.engines.handlers.tracking import TrackingBackend, mlflow_location
from dpkfc_med.engines.precision import Precision
from dpkfc_med.methods import METHODS
from dpkfc_med.models.finetune import FinetuneMode
from dpkfc_med.models.fix import NormChoice
from dpkfc_med.privacy.accounting import Accountant
from dpkfc_med.privacy.adambc import NATURAL_STEP_REFUSED
from dpkfc_med.privacy.ghost import Clipping
from dpkfc_med.privacy.stp import GHOST_REFUSED
from dpkfc_med.probes.sources import NoiseKind, TargetRule
from dpkfc_med.recipe.rule import RECIPES
from dpkfc_med.tasks.kinds import TASK_KINDS, TaskKind
from dpkfc_med.utils import did_you_mean

__all__ = [
    "CHOICES",
    "POSITIVE",
    "Attributed",
    "attribute_overrides",
    "config_changes",
    "flatten",
    "value_problems",
]


CHOICES: dict[str, list[str]] = {
    "method": list(METHODS),
    "data.task": list(TASK_KINDS),
    "data.slices.pick": ["random", "even"],
    "training.optimizer": ["sgd", "adam", "adambc"],
    "training.recipe": list(RECIPES),
    "training.lr_schedule": ["constant", "cosine"],
    "training.device": ["cpu", "cuda", "auto"],
    "training.precision": [p.value for p in Precision],
    "training.select_epoch": ["best_val", "last"],
    "privacy.accountant": [a.value for a in Accountant if a is not Accountant.PLD],
    "privacy.clipping": [c.value for c in Clipping],
    # white probes are the method dp-kfc-white (one way to ask for them)
    "probes.kind": [k.value for k in NoiseKind if k is not NoiseKind.WHITE],
    "probes.target": [t.value for t in TargetRule],
    "model.norm": [n.value for n in NormChoice],
    "training.finetune": [m.value for m in FinetuneMode],
    "tracking.backend": [b.value for b in TrackingBackend],
}
POSITIVE = {
    "privacy.target_epsilon",
    "privacy.max_grad_norm",
    "privacy.stp_eps",
    "training.epochs",
    "training.batch_size",
    "training.lr",
    "training.adambc_gamma",
    "training.eval_batch_size",
    "training.max_physical_batch",
    "training.eval_every",
    "probes.num_probes",
    "data.patches_per_unit",
    "data.augmentations_per_unit",
    "data.slices.per_unit",
    "pretrain.batch_size",
    "pretrain.lr",
    "training.finetune_last",
    "training.lora_rank",
    "training.lora_alpha",
}


def _check_values(cfg: Any, problems: list[str]) -> None:
    flat = flatten(cfg.to_dict())
    for path, allowed in CHOICES.items():
        v = flat.get(path)
        if isinstance(v, str) and v not in allowed:
            problems.append(
                f"{path}={v!r}: not allowed{did_you_mean(v, allowed)}; choose one of {allowed}"
            )
    for path in POSITIVE:
        v = flat.get(path)
        if (
            isinstance(v, (int, float))
            and not isinstance(v, bool)
            and not (v > 0 and math.isfinite(v))
        ):
            problems.append(f"{path}={v!r}: must be a positive number")
    if not cfg.data.path:
        problems.append("data.path: required (a MedMNIST .npz, a MedMNIST flag, or a NIfTI folder)")
    channels = cfg.data.channels
    if channels is not None and (
        not channels or len(set(channels)) != len(channels) or not all(map(str, channels))
    ):
        problems.append(
            f"data.channels={channels!r}: list each input channel's name once, in channel "
            "order (e.g. [t1n, t1c, t2w, t2f]), or leave it unset"
        )
    problems.extend(_split_problems(cfg.data))
    d = cfg.privacy.delta
    if d is not None and not (isinstance(d, float) and 0 < d < 1):
        problems.append(f"privacy.delta={d!r}: must be in (0, 1), e.g. 1e-5")
    if cfg.privacy.secure_rng is True and cfg.privacy.reproducible_noise is True:
        problems.append(
            "privacy.reproducible_noise=true contradicts privacy.secure_rng=true: replayable "
            "noise cannot come from the OS CSPRNG; turn one of them off"
        )
    ema = cfg.training.ema_decay
    if ema is not None and isinstance(ema, float) and not 0.0 < ema < 1.0:
        problems.append(
            f"training.ema_decay={ema!r}: must be between 0 and 1 exclusive (e.g. 0.99), or null"
        )
    if isinstance(cfg.pretrain.steps, int) and cfg.pretrain.steps < 0:
        problems.append(f"pretrain.steps={cfg.pretrain.steps}: must be >= 0 (0 = off)")
    if cfg.probes.kind == NoiseKind.SHAPES.value and cfg.data.task != TaskKind.SEGMENTATION:
        problems.append(
            "probes.kind='shapes': shape volumes come with label maps and apply to segmentation; "
            "use 'pink' for classification"
        )
    if cfg.data.augmentations_per_unit != 1 and cfg.data.task == "segmentation":
        problems.append(
            f"data.augmentations_per_unit={cfg.data.augmentations_per_unit}: applies to "
            "classification; segmentation draws data.patches_per_unit crops per unit instead"
        )
    if cfg.pretrain.steps and cfg.data.task != TaskKind.SEGMENTATION:
        problems.append(
            f"pretrain.steps={cfg.pretrain.steps}: data-free pretraining on synthetic shapes is "
            "available for segmentation; set pretrain.steps to 0 for classification"
        )
    problems.extend(_finetune_problems(cfg))
    problems.extend(_tracking_problems(cfg.tracking))
    if isinstance(cfg.training.warmup_steps, int) and cfg.training.warmup_steps < 0:
        problems.append(f"training.warmup_steps={cfg.training.warmup_steps}: must be >= 0")
    nm = cfg.privacy.noise_multiplier
    if nm is not None and isinstance(nm, float) and not nm > 0:
        problems.append(f"privacy.noise_multiplier={nm!r}: must be > 0 (or null to calibrate)")
    problems.extend(
        f"probes.{msg}"
        for msg in refresh_settings_problems(cfg.probes.refresh_every, cfg.probes.refresh_budget)
    )
    if cfg.method_enum.public_data and not cfg.probes.public_data:
        problems.append(
            "probes.public_data: required for method dp-kfc-public (path to a public .npz)"
        )
    if (
        cfg.training.optimizer == "adambc"
        and cfg.preconditioner.get("step") == "natural"
        and cfg.method_enum.preconditioned
    ):
        problems.append(
            "preconditioner.step='natural' with training.optimizer='adambc': "
            + NATURAL_STEP_REFUSED
        )
    if cfg.method_enum.scaled and cfg.privacy.clipping == Clipping.GHOST.value:
        problems.append(GHOST_REFUSED)
    if cfg.method_enum.scaled and cfg.training.optimizer == "adambc":
        problems.append(
            "training.optimizer='adambc' with method dp-stp: DP-AdamBC subtracts a constant noise "
            "variance, but dp-stp's noise is scaled by s per coordinate; use adam or sgd"
        )
    try:
        cfg.preconditioner_config()
    except (TypeError, ValueError) as err:
        names = [f.name for f in dataclasses.fields(PreconditionerConfig)]
        for key in cfg.preconditioner:
            if key not in names:
                problems.append(
                    f"preconditioner.{key}: unknown field{did_you_mean(key, names)}; "
                    f"allowed: {names}"
                )
        if isinstance(err, ValueError):
            problems.extend(str(err).splitlines()[1:] or [str(err)])


def _split_problems(d: Any) -> list[str]:
    """``data.split_file`` / ``data.split_fold`` problems the config alone shows."""
    problems: list[str] = []
    if isinstance(d.split_fold, int) and d.split_fold < 0:
        problems.append(
            f"data.split_fold={d.split_fold}: must be >= 0 (the 0-based fold of an nnU-Net "
            "splits_final.json)"
        )
    if d.split_file is not None and d.task != TaskKind.SEGMENTATION:
        problems.append(
            "data.split_file: applies to segmentation folders (a classification .npz holds its "
            "own train/val/test arrays); drop the field"
        )
    if d.split_file == "":
        problems.append("data.split_file: empty; give the JSON file's path or null")
    return problems


def _tracking_problems(t: Any) -> list[str]:
    """``tracking.*`` problems: where each stream goes, for the chosen backend."""
    problems: list[str] = []
    places = {"tracking.uri": t.uri, "tracking.custodian_uri": t.custodian_uri}
    if t.backend == TrackingBackend.NONE.value:
        problems.extend(
            f"{name}: only applies with tracking.backend tensorboard or mlflow; set the backend "
            "or drop the field"
            for name, value in places.items()
            if value is not None
        )
        return problems
    for name, value in places.items():
        if value == "":
            problems.append(f"{name}: empty; give a folder or URI, or null for the default")
        elif isinstance(value, str) and t.backend == TrackingBackend.MLFLOW.value:
            try:
                mlflow_location(value)
            except ValueError as err:
                problems.append(f"{name}={err}")
        elif isinstance(value, str) and "://" in value:
            problems.append(
                f"{name}={value!r}: TensorBoard writes event files to a folder; give a folder path"
            )
    if t.backend == TrackingBackend.TENSORBOARD.value and t.uri and t.uri == t.custodian_uri:
        problems.append(
            f"tracking.custodian_uri={t.custodian_uri!r}: the same folder as tracking.uri would "
            "mix the custodian stream into the shareable one; give each its own folder"
        )
    if not (isinstance(t.experiment, str) and t.experiment.strip()):
        problems.append("tracking.experiment: empty; name the MLflow experiment (e.g. dpkfc-med)")
    return problems


def _finetune_problems(cfg: Any) -> list[str]:
    """``model.pretrained*`` and ``training.finetune`` / ``lora_*`` problems."""
    problems = []
    m, t = cfg.model, cfg.training
    for name, patterns in (
        ("model.pretrained_skip", m.pretrained_skip),
        ("training.lora_targets", t.lora_targets or []),
    ):
        for pat in patterns:
            if not isinstance(pat, str):
                continue
            try:
                re.compile(pat)
            except re.error as err:
                problems.append(f"{name}: {pat!r} is not a regular expression ({err})")
    if m.pretrained_skip and not m.pretrained:
        problems.append(
            "model.pretrained_skip: only applies with model.pretrained (the weights to load)"
        )
    if m.pretrained and cfg.pretrain.steps:
        problems.append(
            f"pretrain.steps={cfg.pretrain.steps} with model.pretrained: data-free pretraining "
            "would overwrite the loaded weights; set pretrain.steps to 0 (or drop "
            "model.pretrained)"
        )
    elif cfg.pretrain.steps and t.finetune != "full":
        problems.append(
            f"training.finetune={t.finetune!r} with pretrain.steps={cfg.pretrain.steps}: the "
            "frozen parameters would not be pretrained either; use finetune: full with "
            "data-free pretraining"
        )
    k = t.head_first_epochs
    if isinstance(k, int) and not isinstance(k, bool) and k != 0:
        if k < 0:
            problems.append(f"training.head_first_epochs={k}: must be >= 0 (0: one stage)")
        elif not m.pretrained:
            problems.append(
                f"training.head_first_epochs={k}: a staged fine-tuning needs public weights "
                "(model.pretrained); set it to 0 when training from scratch"
            )
        elif t.finetune == "last_layers":
            problems.append(
                f"training.head_first_epochs={k} with training.finetune='last_layers': both "
                "stages would train the same modules; use finetune: full, norms_and_biases "
                "or lora for the second stage, or set head_first_epochs to 0"
            )
        elif k >= t.epochs and (t.recipe != "auto" or t.recipe_chosen):  # epochs known
            problems.append(
                f"training.head_first_epochs={k}: must be fewer than training.epochs="
                f"{t.epochs}, or the second stage never starts"
            )
    return problems


def value_problems(cfg: Any) -> list[str]:
    """Every value problem of a :class:`~.config.RunConfig` (choices, signs, cross-field rules).

    One line each. (``cfg`` is typed ``Any``: the config module imports this one.)
    """
    problems: list[str] = []
    _check_values(cfg, problems)
    return problems


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: a config's dotted paths."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        path = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and k not in ("kwargs", "preconditioner"):
            out.update(flatten(v, path))
        else:
            out[path] = v
    return out


def settings(cfg: Any) -> dict[str, Any]:
    """A run config's settings as a plain nested dict: its fields but the internal ones."""
    internal = {f.name for f in dataclasses.fields(cfg) if f.metadata.get("internal")}
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in internal}


def config_changes(before: Any, after: Any) -> list[tuple[str, Any, Any]]:
    """Fields whose values differ between two run configs, as ``(path, old, new)``."""
    a, b = flatten(settings(before)), flatten(settings(after))
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


class Attributed(NamedTuple):
    """A config's problems, each attributed to the YAML file or to one ``--set`` override.

    Attributes:
        problems: One line each, those of an overridden field as ``--set KEY=VALUE: ...``.
        source: Where they are, in words.
        set_by: Per problem, ``(KEY=VALUE, what is wrong)`` when an override is its culprit,
            else ``None``.
        file: The YAML file when any problem is in it, else ``None``.
    """

    problems: list[str]
    source: str
    set_by: list[tuple[str, str] | None]
    file: str | None


def attribute_overrides(problems: list[str], overrides: list[str], path: str) -> Attributed:
    """Problems of overridden fields attributed to their ``--set``, not to the YAML file."""
    keys = {item.split("=", 1)[0].strip(): item for item in overrides if "=" in item}
    named: list[str] = []
    set_by: list[tuple[str, str] | None] = []
    for problem in problems:
        item = keys.get(problem.split("=", 1)[0].split(":", 1)[0].strip())
        if item is None:
            named.append(problem)
            set_by.append(None)
        else:
            what = problem.split(": ", 1)[-1]
            named.append(f"--set {item}: {what}")
            set_by.append((item, what))
    if None in set_by:
        return Attributed(named, f"{path} and its --set overrides" if keys else path, set_by, path)
    return Attributed(named, "the --set overrides", set_by, None)
