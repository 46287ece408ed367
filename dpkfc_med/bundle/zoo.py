"""Train a MONAI bundle in the Model Zoo layout privately, with the bundle's own components.

A bundle's ``configs/train.json`` (or ``.yaml``) names its network (``network_def``), loss
(``loss``), optimizer (``optimizer``: its class and ``lr``), preprocessing and dataset
(``train#preprocessing``, ``train#dataset``: its ``data`` list), trainer (``train#trainer``:
``max_epochs``, ``amp``) and validation (``validate#evaluator``). :func:`train_bundle` trains
those components through the project's one private engine
(:func:`dpkfc_med.training.run.train`):

- the network is made DP-compatible by the model fixer (BatchNorm -> GroupNorm, in-place ops
  off; every fix in the report);
- the loss is applied to each sample alone (per-sample losses for per-sample gradients);
- the data loader is replaced by Poisson sampling of privacy units: one unit is one item of
  ``train#dataset``'s data list, or all items sharing ``unit_key`` (e.g. a patient id); the
  samples a random transform makes of one item (``RandCropByPosNegLabeld(num_samples=k)``) are
  the unit's, summed before clipping; each unit's random transforms draw from a generator keyed
  by (seed, unit, draw), never by the sampling history;
- probes take their shape, channels and classes from ``metadata.json``'s
  ``network_data_format`` (or overrides), never from the data;
- ``validate#evaluator`` runs as custodian-only evaluation (its key metric selects nothing
  unless ``training.select_epoch: best_val``); its ``CheckpointSaver`` keyed on a metric is
  replaced by the run's budget-safe checkpoint.

What would break the guarantee (a sampler or shuffle of its own, MONAI's ``amp``, a checkpoint
kept for its validation metric) is replaced by the private equivalent and named by its id in the
report; what cannot be used (no data list, no loss, probe shapes missing from the metadata) is
refused with the id and the fix (:class:`BundleConfigError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from dpkfc_med.bundle.guards import (
    REPLACED_HANDLERS,
    check_data_dependence,
    evaluation_overlap,
    label_problems,
    output_problems,
    user_handlers,
)
from dpkfc_med.bundle.own_recipe import bundle_recipe, bundle_training
from dpkfc_med.bundle.pretrained import model_keys_allowed, use_pretrained
from dpkfc_med.bundle.zoo_task import (
    BundleConfigError,
    bundle_task,
    component_error,
    config_value,
    has_id,
    network_format,
    unit_source,
)

__all__ = [
    "BundleConfigError",
    "PreparedBundle",
    "guarantee_problems",
    "load_bundle",
    "prepare_bundle",
    "train_bundle",
]

TRAIN_FILES = ("configs/train.json", "configs/train.yaml", "configs/train.yml")
METADATA = "configs/metadata.json"
BUNDLE_MODEL_PREFIX = "bundle:"
"""``model.name`` of a bundle run: ``bundle:<bundle folder>#network_def``."""
BUNDLE_OPTIONS = "bundle_options.json"
"""How a bundle run was prepared, in its custodian folder (for ``dpkfc-med evaluate``)."""


def _train_file(bundle: Path) -> Path:
    for rel in TRAIN_FILES:
        if (bundle / rel).is_file():
            return bundle / rel
    raise BundleConfigError(
        [f"{bundle}: no {' / '.join(TRAIN_FILES)}; give the folder of a bundle in the MONAI "
         "Model Zoo layout"]
    )  # fmt: skip


def _literal(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def load_bundle(bundle_dir: str | Path, overrides: Sequence[str] = ()) -> Any:
    """The bundle's train config as a MONAI ``ConfigParser``, with ``ID=VALUE`` overrides.

    ``bundle_root`` is set to the bundle folder unless an override sets it.
    """
    from monai.bundle import ConfigParser

    bundle = Path(bundle_dir)
    parser = ConfigParser()
    parser.read_config(str(_train_file(bundle)))
    meta = bundle / METADATA
    if meta.is_file():
        import json

        try:
            content = json.loads(meta.read_text(encoding="utf-8"))
        except ValueError as err:
            raise BundleConfigError(
                [f"{meta}: not valid JSON ({err}); fix the file (MONAI's metadata.json)"]
            ) from None
        # MONAI's schema requires this key, while its parser calls it deprecated and writes it
        # over required_packages_version; nothing here reads it
        content.pop("optional_packages_version", None)
        parser.read_meta(content)
    parser["bundle_root"] = str(bundle)
    problems = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            problems.append(
                f"--override {item!r}: expected ID=VALUE, e.g. train#trainer#max_epochs=2"
            )
            continue
        parser[key] = _literal(value)
    if problems:
        raise BundleConfigError(problems)
    return parser


def guarantee_problems(parser: Any) -> list[str]:
    """The settings that would break the guarantee, each replaced by the private equivalent.

    One sentence per setting, naming its id; the report lists them.
    """
    replaced: list[str] = []
    if has_id(parser, "train#trainer#amp") and parser["train#trainer#amp"] in (True, "true"):
        replaced.append(
            "train#trainer#amp: true: replaced by the private engine's precision "
            "(training.precision: float32, or bf16 on a GPU with --set training.precision=bf16, "
            "which keeps per-sample gradients, clipping and noise in float32; MONAI's autocast "
            "of a batch-mean loss would make each sample's gradient depend on the secret batch "
            "size)"
        )
    for key in ("train#dataloader#sampler", "train#dataloader#shuffle"):
        if has_id(parser, key) and parser[key] not in (None, False, "false"):
            replaced.append(
                f"{key}: replaced by Poisson sampling of privacy units (the accountant's "
                "assumption)"
            )
    for section in ("train#handlers", "validate#handlers"):
        if not has_id(parser, section):
            continue
        for i, h in enumerate(parser[section] or []):
            target = str(h.get("_target_", "")) if isinstance(h, dict) else ""
            name = target.rsplit(".", 1)[-1]
            if name in REPLACED_HANDLERS:
                replaced.append(
                    f"{section}#{i} ({name}): replaced by the private engine's "
                    + {
                        "CheckpointSaver": "budget-safe checkpoint (a checkpoint kept for its "
                        "validation metric would select on private data)",
                        "ValidationHandler": "validation after epochs (training.eval_every)",
                        "LrScheduleHandler": "learning-rate schedule (training.lr_schedule)",
                    }[name]
                )
    return replaced


@dataclass
class PreparedBundle:
    """A bundle ready for the private engine: the run config, task, network and handlers."""

    cfg: Any
    task: Any
    network: nn.Module
    fixes: list[dict[str, Any]]
    handlers: list[Any]
    replaced: list[str]
    options: dict[str, Any]
    """The arguments it was prepared with (custodian-only: paths), to rebuild it."""
    parser: Any
    """The bundle's train config (MONAI ``ConfigParser``), overrides applied."""


def prepare_bundle(
    bundle_dir: str | Path,
    *,
    epsilon: float | None = None,
    delta: float | None = None,
    method: str | None = None,
    unit_key: str | None = None,
    recipe: str | None = None,
    out: str | Path | None = None,
    overrides: Sequence[str] = (),
    settings: Sequence[str] = (),
    allow_data_dependent: Sequence[str] = (),
    pretrained: str | bool | None = None,
    pretrained_source: str | None = None,
) -> PreparedBundle:
    """Read, check and translate a bundle for the private engine.

    Args:
        bundle_dir: A bundle in the Model Zoo layout.
        epsilon: Target epsilon of the whole run (default: the bundle's
            ``private_training#privacy#target_epsilon``; one of the two is required).
        delta: Target delta (default: the bundle's, else the project's rule from the number
            of units).
        method: ``dp-kfc``, ``dp-sgd`` or ``nonprivate`` (default: the bundle's
            ``private_training#method``, else ``dp-kfc``).
        unit_key: Data-list key whose items form one unit (a patient id); default one item.
        recipe: ``auto``: unset training settings chosen by the rule of ``training.recipe:
            auto``; ``bundle``: the bundle's own (:mod:`dpkfc_med.bundle.own_recipe`);
            default: the bundle's ``private_training#training#recipe``, else ``auto``.
        out: The run directory (default ``runs/<bundle name>``).
        overrides: ``ID=VALUE`` settings of the bundle config (MONAI ids, ``#`` separated).
        settings: ``--set``-style settings of the private run (``privacy.max_grad_norm=0.5``).
        allow_data_dependent: Ids of training inputs computed from the private data lists
            (:func:`~dpkfc_med.bundle.guards.data_dependent_inputs`) to train with anyway,
            each listed in the report as not covered; any other such input is refused.
        pretrained: Start from these weights: ``True`` for the bundle's ``models/model.pt``,
            else a weights file or bundle folder (:mod:`dpkfc_med.bundle.pretrained`).
        pretrained_source: Where the weights come from, as the report may show it.

    The bundle's ``private_training`` section (run-config fields: ``method``, ``privacy``,
    ``training``, ``pretrain``, ``probes``, ``preconditioner``, ``data`` statements such as
    ``modality``) is applied over what its components give; ``epsilon``, ``delta``, ``method``
    and ``settings`` are applied over it.
    """
    from monai.bundle import ConfigParser

    from dpkfc_med.models import make_private_compatible, validate_private_compatible
    from dpkfc_med.probes.presets import preset_for_modality
    from dpkfc_med.training.config import apply_overrides, config_from_dict
    from dpkfc_med.training.setup import prepare_finetune

    bundle = Path(bundle_dir)
    parser = load_bundle(bundle, overrides)
    replaced = guarantee_problems(parser)
    fmt = network_format(parser)
    network_def = parser.get_parsed_content("network_def", instantiate=False).get_config()
    recipe = bundle_recipe(parser, recipe)
    name = bundle.resolve().name
    raw: dict[str, Any] = {
        "name": name,
        "data": {"task": "segmentation" if fmt["dense"] else "classification", "path": str(bundle)},
        # the bundle's network_def (references resolved): export rebuilds it from this
        "model": {
            "name": f"{BUNDLE_MODEL_PREFIX}{name}#network_def",
            "norm": "group",
            "kwargs": {"network_def": _plain_config(network_def)},
        },
        "privacy": {},
        # --recipe auto: the rule chooses; bundle: the bundle's own optimizer, lr, batch, epochs
        **bundle_training(parser, recipe, replaced),
    }
    # the probes' texture from the metadata's declared modality (a public statement), unless
    # private_training or --set chooses the preset
    preset = preset_for_modality(fmt.get("modality"))
    if preset is not None:
        raw["probes"] = {"preset": preset}
    _merge(raw, _private_training(parser))
    raw["training"]["recipe"] = "auto" if recipe == "auto" else "manual"
    raw["output"] = {"dir": str(out) if out is not None else f"runs/{name}"}
    for key, value in (("target_epsilon", epsilon), ("delta", delta)):
        if value is not None:
            raw["privacy"][key] = float(value)
    if method is not None:
        raw["method"] = method
    if "target_epsilon" not in raw["privacy"]:
        raise BundleConfigError(
            ["no target epsilon: pass --epsilon E, or set private_training#privacy#"
             "target_epsilon in the bundle's train config"]
        )  # fmt: skip
    raw = apply_overrides(raw, list(settings)) if settings else raw
    use_pretrained(raw, parser, bundle, pretrained=pretrained, source=pretrained_source,
                   settings=settings)  # fmt: skip
    cfg = config_from_dict(raw, f"{bundle} (bundle train)")
    seed = None if cfg.privacy.secure_rng else cfg.training.seed
    task = bundle_task(parser, bundle, unit_key, seed, fmt)
    # built from the resolved definition the export rebuilds, so both are one network
    try:
        network = ConfigParser({"net": raw["model"]["kwargs"]["network_def"]}).get_parsed_content(
            "net"
        )
    except Exception as err:
        raise BundleConfigError([component_error("network_def", err)]) from err
    if not isinstance(network, nn.Module):
        raise BundleConfigError(["network_def: the bundle's network_def is not a torch module"])
    problems = output_problems(
        network, task.in_channels, list(task.spatial_shape), task.num_classes
    )
    if problems:
        raise BundleConfigError(problems)
    network, fixes = make_private_compatible(network, norm=cfg.model.norm)
    # model.pretrained and training.finetune (--set), as for a run config's network
    prepare_finetune(network, cfg, task.data_record.get("sha256"))
    validate_private_compatible(network)
    handlers, logged = user_handlers(parser, cfg.run_dir())
    accepted = check_data_dependence(parser, allow_data_dependent)
    evaluation_overlap(parser, train_items(task))
    task.data_record["bundle"] = {
        "name": parser.get("_meta_#name", name) if has_id(parser, "_meta_") else name,
        "version": parser.get("_meta_#version") if has_id(parser, "_meta_") else None,
        "replaced": replaced,
        "custodian_handlers": logged,
        "unit_source": unit_source(unit_key),
        "modality": fmt.get("modality"),
        "probe_preset": cfg.probes.preset,
        "data_dependent_inputs": accepted,
    }
    options = {
        "bundle_dir": str(bundle.resolve()),
        "epsilon": epsilon,
        "delta": delta,
        "method": method,
        "unit_key": unit_key,
        "recipe": recipe,
        "overrides": list(overrides),
        "settings": list(settings),
        "allow_data_dependent": list(allow_data_dependent),
        "pretrained": cfg.model.pretrained,
        "pretrained_source": cfg.model.pretrained_source,
    }
    return PreparedBundle(
        cfg, task, network, [_fix_dict(f) for f in fixes], handlers, replaced, options, parser
    )


def train_items(task: Any) -> list[Any]:
    """The training data-list items of a prepared bundle task, unit by unit."""
    return [item for uid in task.train_set.ids for item in task.train_set.units[uid]]


_FROM_COMPONENTS = ("name", "model", "output", "data#path", "data#task")


def _private_training(parser: Any) -> dict[str, Any]:
    """The bundle's ``private_training`` section: run-config fields over its components."""
    if not has_id(parser, "private_training"):
        return {}
    section = parser["private_training"]
    if not isinstance(section, dict):
        raise BundleConfigError(
            ["private_training: expected a mapping of run-config fields (privacy, training, "
             "probes, ...), as in a dpkfc-med YAML config"]
        )  # fmt: skip
    taken = [
        f"private_training#{key}"
        for key in _FROM_COMPONENTS
        if has_id(parser, f"private_training#{key}")
        and not (key == "model" and model_keys_allowed(parser))  # model.pretrained* only
    ]
    if taken:
        raise BundleConfigError(
            [f"{key}: comes from the bundle's own components (network_def, the data list, "
             "--out), not from private_training; remove it" for key in taken]
        )  # fmt: skip
    return _plain_config(section, "private_training")


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    """Merge ``extra`` into ``base`` (nested mappings key by key, anything else replaced)."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def train_bundle(bundle_dir: str | Path, *, resume: bool = False, **options: Any) -> Any:
    """Train the bundle in ``bundle_dir`` privately; returns the run result.

    Args:
        bundle_dir: A bundle in the Model Zoo layout.
        resume: Continue the run in ``out`` within its budget.
        **options: The arguments of :func:`prepare_bundle`.
    """
    from dpkfc_med.report.custodian import PRIVATE_DIR
    from dpkfc_med.training.run import train
    from dpkfc_med.utils import write_json

    b = prepare_bundle(bundle_dir, **options)
    # before any budget is spent: a label the loss cannot take would crash a later step
    items = config_value(b.parser, "train#dataset#data", [])
    problems = label_problems(b.parser, items, b.task.num_classes, b.task.kind == "segmentation")
    if problems:
        raise BundleConfigError(problems)
    result = train(
        b.cfg,
        resume=resume,
        task=b.task,
        network=(b.network, b.fixes),
        handlers=b.handlers,
        decollate=True,  # the bundle's handlers read per-sample outputs, as in MONAI
    )
    # how to rebuild the bundle's data and evaluator (`dpkfc-med evaluate`); paths: custodian
    write_json(Path(result.run_dir) / PRIVATE_DIR / BUNDLE_OPTIONS, b.options)
    return result


def evaluate_bundle_run(
    run_dir: str | Path,
    *,
    split: str = "test",
    device: str = "cpu",
    data: str | Path | None = None,
    save_predictions: bool = False,
) -> dict[str, Any]:
    """The bundle's ``validate#evaluator`` on a finished bundle run's released model.

    Args:
        run_dir: A finished ``dpkfc-med bundle train`` run.
        split: ``val`` (``validate#dataset#data``) or ``test`` (``test#dataset#data``);
            unused with ``data``.
        device: Where the run's model is evaluated (the evaluator keeps the bundle's
            ``device``).
        data: A segmentation folder of new cases (any layout ``dpkfc-med`` reads, DICOM series
            included): all its cases, as items ``{"image", "label", "case_id"}`` (as
            :func:`~dpkfc_med.bundle.datalists.segmentation_datalists` builds them), replace
            the evaluator's data list; the split is then ``all``.
        save_predictions: Also save each item's label map (the argmax of the evaluator's
            ``pred``, taken back to the input's grid through its dataset's transform).

    Returns:
        The metrics (named by the bundle's key metric, ``test_`` for the test split, ``all_``
        for ``data``), ``n``, ``overlap_with_training`` (evaluated items whose image content
        is a ``train#dataset#data`` item's), ``not_dp``, the privacy note and ``per_case``
        (the per-case files, relative to the run directory); written to the run's custodian
        folder (``evaluations/bundle_<split>.json``, or ``<folder>_all.json`` for ``data``,
        beside a folder of the same name with MONAI ``MetricsSaver``'s files: ``metrics.csv``
        and ``<metric>_raw.csv`` for each metric that keeps per-item details, and
        ``predictions/``).

    Raises:
        ConfigError: Not a finished bundle run, a split the bundle has no data list for, or
            a ``data`` folder that cannot be read.
    """
    import json
    import shutil

    import torch

    from dpkfc_med.bundle.zoo_task import SPLIT_DATA, item_image_digest
    from dpkfc_med.report.custodian import EVALUATION_NOTE, EVALUATIONS_DIR, PRIVATE_DIR
    from dpkfc_med.tasks.segmentation.metrics import write_metric_reports
    from dpkfc_med.training.predictions import CaseCollector
    from dpkfc_med.utils import write_json

    run = Path(run_dir)
    stored = run / PRIVATE_DIR / BUNDLE_OPTIONS
    missing = [str(p) for p in (stored, run / "model.pt") if not p.is_file()]
    if missing:
        raise BundleConfigError(
            [f"{p}: missing; a `dpkfc-med bundle train` run writes it when it finishes "
             "(resume an unfinished run with --resume)" for p in missing]
        )  # fmt: skip
    options = json.loads(stored.read_text(encoding="utf-8"))
    b = prepare_bundle(options.pop("bundle_dir"), **{**options, "out": run})
    cases = None
    if data is not None:
        from dpkfc_med.data import load_segmentation_folder, resolve_data_path

        root = resolve_data_path(str(data), kind="dir")
        cases = load_segmentation_folder(root, cache_dir=run / PRIVATE_DIR / "dicom_cache")
        items = cases.data_dicts()
        split, source, stem = "all", {"path": str(root), "cases": len(items)}, f"{root.name}_all"
    elif split not in b.task.extra["splits"]:
        raise BundleConfigError(
            [f"--split {split}: the bundle has no {SPLIT_DATA.get(split, split)}; it evaluates "
             f"{sorted(b.task.extra['splits'])} (data lists {', '.join(SPLIT_DATA.values())}), "
             "or pass --data FOLDER of new cases"]
        )  # fmt: skip
    else:
        items = config_value(b.parser, SPLIT_DATA[split], []) or []
        source, stem = {"bundle": b.options["bundle_dir"], "list": SPLIT_DATA[split]}, None
    stem = stem or f"bundle_{split}"
    if not has_id(b.parser, "validate#evaluator"):
        raise BundleConfigError(
            ["validate#evaluator: the bundle defines no evaluator; add one (a MONAI "
             "SupervisedEvaluator with a key metric) to evaluate its runs"]
        )  # fmt: skip
    saved = torch.load(run / "model.pt", map_location="cpu", weights_only=False)
    b.network.load_state_dict(saved["model"])
    model = b.network.to(torch.device(device)).eval()
    train_images = {item_image_digest(i) for i in config_value(b.parser, "train#dataset#data")}
    shared = sum(item_image_digest(i) in train_images for i in items)
    # the evaluator reads validate#dataset#data; point it at the evaluated list
    key = SPLIT_DATA["val"]
    original = b.parser[key]
    b.parser["network"] = model
    b.parser[key] = items if data is not None else f"$@{SPLIT_DATA[split]}"
    try:
        evaluator = b.parser.get_parsed_content("validate#evaluator", lazy=False)
    finally:
        b.parser[key] = original
    evaluator.network = model
    out_dir = run / EVALUATIONS_DIR / stem
    if out_dir.exists():
        shutil.rmtree(out_dir)  # a previous evaluation's items must not mix with these
    names = b.task.label_names or [f"class{i}" for i in range(b.task.num_classes)]
    collector = CaseCollector(
        out_dir / "predictions" if save_predictions else None,
        getattr(getattr(evaluator.data_loader, "dataset", None), "transform", None),
        cases,
        names[1:],
    )
    collector.attach(evaluator)
    with torch.no_grad():
        evaluator.run()

    def renamed(name: str) -> str:
        # the bundle names its metrics for validation (val_mean_dice): name them for the split
        return name if split == "val" else f"{split}_{name.removeprefix('val_')}"

    metrics = {
        renamed(k): float(v)
        for k, v in evaluator.state.metrics.items()
        if isinstance(v, (int, float)) or getattr(v, "numel", lambda: 0)() == 1
    }
    written = write_metric_reports(out_dir, collector.filenames, metrics, {}, None)
    for k, v in (getattr(evaluator.state, "metric_details", None) or {}).items():
        width = v.shape[-1] if getattr(v, "ndim", 0) > 1 else 1
        # the columns are named by the classes where they are the (foreground) classes
        cls = {len(names) - 1: names[1:], len(names): names}.get(width)
        written += write_metric_reports(out_dir, collector.filenames, {}, {renamed(k): v}, cls)
    out = {
        "run": str(run),
        "data": source,
        "split": split,
        "not_dp": bool(shared),
        **(
            {"warning": f"{shared} of the {len(items)} evaluated items are in the run's "
                        "training data list: these figures are not differentially private"}
            if shared
            else {}
        ),
        "overlap_with_training": {
            "checked": True, "unit": "items", "evaluated": len(items), "shared": shared,
            "method": "SHA-256 of each item's image file(s) (or array) against "
                      "train#dataset#data",
        },
        "privacy_note": EVALUATION_NOTE,
        **metrics,
        "n": len(items),
        "per_case": {
            "files": [str(p.relative_to(run)) for p in written],
            "predictions": str((out_dir / "predictions").relative_to(run))
            if save_predictions else None,
            **({"dicom_seg_not_written": collector.problems} if collector.problems else {}),
        },
    }  # fmt: skip
    write_json(run / EVALUATIONS_DIR / f"{stem}.json", out)
    return out


def _plain_config(value: Any, where: str = "network_def") -> Any:
    """A resolved config as plain lists, dicts and scalars (YAML-safe)."""
    if isinstance(value, (list, tuple)):
        return [_plain_config(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain_config(v, where) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise BundleConfigError(
        [f"{where}: the value {value!r} is not a plain setting; give {where} with plain "
         "arguments (numbers, strings, lists), so the run can be rebuilt from its record"]
    )  # fmt: skip


def _fix_dict(fix: Any) -> dict[str, Any]:
    import dataclasses

    if dataclasses.is_dataclass(fix) and not isinstance(fix, type):
        return dataclasses.asdict(fix)
    return dict(fix)
