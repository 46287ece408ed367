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

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from dpkfc_med.data.units import reseed_for_unit
from dpkfc_med.training.config import ConfigError

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
REPLACED_HANDLERS = ("CheckpointSaver", "ValidationHandler", "LrScheduleHandler")


class BundleConfigError(ConfigError):
    """A bundle setting that would break the guarantee or cannot be used; names the id."""


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
        parser.read_meta(str(meta))
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


def _get(parser: Any, key: str, default: Any = None) -> Any:
    try:
        return parser.get_parsed_content(key, instantiate=True)
    except KeyError:
        return default


def _has(parser: Any, key: str) -> bool:
    try:
        parser[key]
    except (KeyError, IndexError, TypeError):
        return False
    return True


def guarantee_problems(parser: Any) -> list[str]:
    """The settings that would break the guarantee, each replaced by the private equivalent.

    One sentence per setting, naming its id; the report lists them.
    """
    replaced: list[str] = []
    if _has(parser, "train#trainer#amp") and parser["train#trainer#amp"] in (True, "true"):
        replaced.append(
            "train#trainer#amp: true: replaced by the private engine's precision "
            "(training.precision: float32, or bf16 on a GPU with --set training.precision=bf16, "
            "which keeps per-sample gradients, clipping and noise in float32; MONAI's autocast "
            "of a batch-mean loss would make each sample's gradient depend on the secret batch "
            "size)"
        )
    for key in ("train#dataloader#sampler", "train#dataloader#shuffle"):
        if _has(parser, key) and parser[key] not in (None, False, "false"):
            replaced.append(
                f"{key}: replaced by Poisson sampling of privacy units (the accountant's "
                "assumption)"
            )
    for section in ("train#handlers", "validate#handlers"):
        if not _has(parser, section):
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


class _UnitItems(Dataset):
    """One item per privacy unit: every sample the transform makes of the unit's data items.

    Args:
        units: Unit id -> the data-list items of that unit.
        transform: The bundle's ``train#preprocessing``.
        seed: The run seed (``None``: OS entropy); with the unit id and its draw count it keys
            the unit's random transforms.
    """

    def __init__(self, units: dict[str, list[Any]], transform: Any, seed: int | None) -> None:
        self.ids = sorted(units)
        self.units, self.transform, self.seed = units, transform, seed
        self.draws: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> list[dict[str, Any]]:
        uid = self.ids[index]
        draw = self.draws.get(uid, 0)
        self.draws[uid] = draw + 1
        reseed_for_unit(self.transform, self.seed, uid, draw)
        samples: list[dict[str, Any]] = []
        for item in self.units[uid]:
            out = self.transform(dict(item)) if self.transform is not None else dict(item)
            samples.extend(out if isinstance(out, list) else [out])
        return samples


def _plain(x: Any) -> Tensor:
    """A plain tensor (MONAI's ``MetaTensor`` meta data is not needed by the private step)."""
    return x.as_tensor() if hasattr(x, "as_tensor") else torch.as_tensor(x)


class _UnitCollate:
    """Concatenate the samples of the drawn units: ``{"image", "label", "unit"}``."""

    def __init__(self, channels: int, patch: Sequence[int], image_key: str, label_key: str):
        self.channels, self.patch = channels, tuple(patch)
        self.image_key, self.label_key = image_key, label_key

    def __call__(self, units: list[list[dict[str, Any]]]) -> dict[str, Tensor]:
        images, labels, ids = [], [], []
        for u, samples in enumerate(units):
            for s in samples:
                images.append(_plain(s[self.image_key]))
                labels.append(_plain(s[self.label_key]))
                ids.append(u)
        if not images:  # an empty Poisson batch still takes its noisy step
            return {
                "image": torch.zeros(0, self.channels, *self.patch),
                "label": torch.zeros(0, 1, *self.patch),
                "unit": torch.zeros(0, dtype=torch.int64),
            }
        return {
            "image": torch.stack(images).float(),
            "label": torch.stack(labels),
            "unit": torch.tensor(ids, dtype=torch.int64),
        }


def _network_format(parser: Any) -> dict[str, Any]:
    """Probe shape, channels and classes from the metadata's ``network_data_format``."""
    fmt: dict[str, Any] = {}
    try:
        fmt = parser.get("_meta_#network_data_format") or {}
    except (KeyError, AttributeError):
        fmt = {}
    image = (fmt.get("inputs") or {}).get("image") or {}
    pred = (fmt.get("outputs") or {}).get("pred") or {}
    shape = image.get("spatial_shape")
    out = {
        "spatial_shape": [int(s) for s in shape] if shape else None,
        "in_channels": image.get("num_channels"),
        "num_classes": pred.get("num_channels"),
    }
    missing = [k for k, v in out.items() if not v]
    if missing:
        raise BundleConfigError(
            [
                f"configs/metadata.json network_data_format: {', '.join(missing)} not given "
                "(inputs.image.spatial_shape / num_channels, outputs.pred.num_channels); the "
                "probes take them from the metadata, never from the data: add them there or "
                "pass --override _meta_#network_data_format#inputs#image#spatial_shape=[96,96,96]"
            ]
        )
    return out


def _per_sample(loss: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """The bundle's (batch-mean) loss applied to each sample alone: ``[N]``."""

    def per_sample(outputs: Tensor, targets: Tensor) -> Tensor:
        return torch.stack(
            [loss(outputs[i : i + 1], targets[i : i + 1]) for i in range(len(outputs))]
        )

    return per_sample


def _bundle_task(
    parser: Any, bundle: Path, unit_key: str | None, seed: int | None, fmt: dict[str, Any]
) -> Any:
    from dpkfc_med.training.tasks import Task

    data = _get(parser, "train#dataset#data")
    if not isinstance(data, list) or not data:
        raise BundleConfigError(
            ["train#dataset#data: the bundle's training data list is missing or empty; the "
             "private engine samples its items (set it, or --override dataset_dir=...)"]
        )  # fmt: skip
    units: dict[str, list[Any]] = {}
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise BundleConfigError(
                [f"train#dataset#data: item {i} is a {type(item).__name__}, not a dictionary "
                 "such as {'image': ..., 'label': ...}; the private engine reads the image and "
                 "label keys of each item"]
            )  # fmt: skip
        if unit_key is not None:
            if not isinstance(item, dict) or unit_key not in item:
                raise BundleConfigError(
                    [f"--unit-key {unit_key!r}: item {i} of train#dataset#data has no such "
                     "key; give every item the unit (patient) id, or drop --unit-key"]
                )  # fmt: skip
            uid = str(item[unit_key])
        else:
            uid = f"item{i:06d}"
        units.setdefault(uid, []).append(item)
    transform = _get(parser, "train#preprocessing")
    loss = _get(parser, "loss")
    if loss is None:
        raise BundleConfigError(["loss: the bundle defines no loss"])
    patch = fmt["spatial_shape"]
    channels, classes = int(fmt["in_channels"]), int(fmt["num_classes"])
    evaluator_cfg = _has(parser, "validate#evaluator")
    digest = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()

    class _Task(Task):
        def per_sample_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
            if self.kind == "segmentation" and targets.ndim == outputs.ndim - 1:
                targets = targets.unsqueeze(1)  # class-id maps of probes: MONAI's [N, 1, *S]
            return _per_sample(loss)(outputs, targets)

        def probe_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
            if self.kind == "classification":
                return F.cross_entropy(outputs, targets, reduction="none")
            return F.cross_entropy(outputs, targets, reduction="none").flatten(1).mean(1)

        def unpack(self, batch: Any) -> tuple[Tensor, Tensor, Tensor | None]:
            return batch["image"], batch["label"], batch["unit"]

        def evaluate(self, model: nn.Module, split: str, device: torch.device, batch_size: int,
                     *, full: bool = False) -> dict[str, Any]:  # fmt: skip
            if split != "val" or not evaluator_cfg:
                return {}
            return _run_evaluator(parser, model, device)

    kind = (
        "segmentation" if len(patch) > 0 and classes > 1 and _is_dense(parser) else "classification"
    )
    return _Task(
        kind=kind,
        spatial_dims=len(patch),
        in_channels=channels,
        num_classes=classes,
        spatial_shape=tuple(patch),
        label_names=None,
        train_set=_UnitItems(units, transform, seed),
        data_record={
            "path": str(bundle),
            "format": "MONAI bundle (train#dataset data list)",
            "sha256": {"train#dataset#data": digest},
            # units, not items: with --unit-key the item count (e.g. scans per patient) is
            # a private statistic the shareable report must not carry
            "splits": {
                "train": len(units),
                "val": len(_get(parser, "validate#dataset#data", []) or []),
            },
            "unit_key": unit_key,
        },
        selection_metric=_key_metric(parser),
        privacy_unit=f"item of train#dataset ({unit_key} group)"
        if unit_key
        else "item of train#dataset",
        max_samples_per_unit=1,
        max_samples_public=False,
        intensity="zscore",
        extra={"collate": _UnitCollate(channels, patch, "image", "label")},
    )


def _is_dense(parser: Any) -> bool:
    """Whether the network predicts per voxel (a segmentation bundle)."""
    try:
        fmt = parser.get("_meta_#network_data_format") or {}
    except (KeyError, AttributeError):
        return True
    pred = (fmt.get("outputs") or {}).get("pred") or {}
    return pred.get("type", "image") == "image"


def _key_metric(parser: Any) -> str:
    if _has(parser, "validate#key_metric"):
        km = parser["validate#key_metric"]
        if isinstance(km, dict) and km:
            return str(next(iter(km)))
    return "val_mean_dice"


def _run_evaluator(parser: Any, model: nn.Module, device: torch.device) -> dict[str, Any]:
    """Run the bundle's ``validate#evaluator`` on ``model`` (custodian-only statistics)."""
    parser["network"] = model  # validate#handlers were filtered by _user_handlers
    evaluator = parser.get_parsed_content("validate#evaluator", lazy=False)
    evaluator.network = model
    was = model.training
    try:
        evaluator.run()
    finally:
        model.train(was)
    return {k: float(v) for k, v in evaluator.state.metrics.items() if _is_number(v)}


def _is_number(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


@dataclass
class PreparedBundle:
    """A bundle ready for the private engine: the run config, task, network and handlers."""

    cfg: Any
    task: Any
    network: nn.Module
    fixes: list[dict[str, Any]]
    handlers: list[Any]
    replaced: list[str]


def prepare_bundle(
    bundle_dir: str | Path,
    *,
    epsilon: float,
    delta: float | None = None,
    method: str = "dp-kfc",
    unit_key: str | None = None,
    out: str | Path | None = None,
    overrides: Sequence[str] = (),
    settings: Sequence[str] = (),
) -> PreparedBundle:
    """Read, check and translate a bundle for the private engine.

    Args:
        bundle_dir: A bundle in the Model Zoo layout.
        epsilon: Target epsilon of the whole run.
        delta: Target delta (default: the project's rule from the number of units).
        method: ``dp-kfc``, ``dp-sgd`` or ``nonprivate``.
        unit_key: Data-list key whose items form one unit (a patient id); default one item.
        out: The run directory (default ``runs/<bundle name>``).
        overrides: ``ID=VALUE`` settings of the bundle config (MONAI ids, ``#`` separated).
        settings: ``--set``-style settings of the private run (``privacy.max_grad_norm=0.5``).
    """
    from monai.bundle import ConfigParser

    from dpkfc_med.models import make_private_compatible, validate_private_compatible
    from dpkfc_med.training.config import apply_overrides, config_from_dict

    bundle = Path(bundle_dir)
    parser = load_bundle(bundle, overrides)
    replaced = guarantee_problems(parser)
    fmt = _network_format(parser)
    network_def = parser.get_parsed_content("network_def", instantiate=False).get_config()
    epochs = int(_get(parser, "train#trainer#max_epochs", 1) or 1)
    batch = int(_get(parser, "train#dataloader#batch_size", 2) or 2)
    lr = float(parser["optimizer#lr"]) if _has(parser, "optimizer#lr") else 1e-3
    opt_target = str(parser["optimizer#_target_"]) if _has(parser, "optimizer#_target_") else ""
    optimizer = "adam" if opt_target.rsplit(".", 1)[-1].lower() == "adam" else "sgd"
    if opt_target and opt_target.rsplit(".", 1)[-1].lower() not in ("adam", "sgd"):
        replaced.append(
            f"optimizer ({opt_target}): replaced by SGD with its lr (the private engine trains "
            "with SGD, Adam or DP-AdamBC; choose with --set training.optimizer=adam)"
        )
    name = bundle.resolve().name
    raw: dict[str, Any] = {
        "name": name,
        "data": {"task": "segmentation", "path": str(bundle)},
        # the bundle's network_def (references resolved): export rebuilds it from this
        "model": {
            "name": f"{BUNDLE_MODEL_PREFIX}{name}#network_def",
            "norm": "group",
            "kwargs": {"network_def": _plain_config(network_def)},
        },
        "method": method,
        "privacy": {"target_epsilon": float(epsilon)},
        "training": {"epochs": epochs, "batch_size": batch, "lr": lr, "optimizer": optimizer,
                     "select_epoch": "last"},
        "pretrain": {"steps": 0},
        "output": {"dir": str(out) if out is not None else f"runs/{name}"},
    }  # fmt: skip
    if delta is not None:
        raw["privacy"]["delta"] = float(delta)
    raw = apply_overrides(raw, list(settings)) if settings else raw
    cfg = config_from_dict(raw, f"{bundle} (bundle train)")
    seed = None if cfg.privacy.secure_rng else cfg.training.seed
    task = _bundle_task(parser, bundle, unit_key, seed, fmt)
    # built from the resolved definition the export rebuilds, so both are one network
    network = ConfigParser({"net": raw["model"]["kwargs"]["network_def"]}).get_parsed_content("net")
    if not isinstance(network, nn.Module):
        raise BundleConfigError(["network_def: the bundle's network_def is not a torch module"])
    network, fixes = make_private_compatible(network, norm=cfg.model.norm)
    validate_private_compatible(network)
    handlers, logged = _user_handlers(parser, cfg.run_dir())
    task.data_record["bundle"] = {
        "name": parser.get("_meta_#name", name) if _has(parser, "_meta_") else name,
        "version": parser.get("_meta_#version") if _has(parser, "_meta_") else None,
        "replaced": replaced,
        "custodian_handlers": logged,
    }
    return PreparedBundle(cfg, task, network, [_fix_dict(f) for f in fixes], handlers, replaced)


def _user_handlers(parser: Any, run_dir: Path) -> tuple[list[Any], list[str]]:
    """The bundle's own handlers that stay (``StatsHandler``, TensorBoard, MLflow).

    The replaced ones (:data:`REPLACED_HANDLERS`) are dropped from ``train#handlers`` and
    ``validate#handlers``. What the others log is un-noised private statistics: their output
    folders move into the run's custodian folder, and the report lists them as not covered.

    Returns:
        The instantiated train handlers (to attach to the private trainer) and the names of
        every handler kept in either section.
    """
    from dpkfc_med.report.custodian import PRIVATE_DIR

    names: list[str] = []
    for section in ("train#handlers", "validate#handlers"):
        if not _has(parser, section):
            continue
        kept = []
        for h in parser[section] or []:
            target = str(h.get("_target_", "")) if isinstance(h, dict) else ""
            name = target.rsplit(".", 1)[-1]
            if not name or name in REPLACED_HANDLERS:
                continue
            h = dict(h)
            folder = run_dir / PRIVATE_DIR / f"{section.split('#')[0]}_{name}"
            if name.startswith("TensorBoard"):
                h["log_dir"] = str(folder)
            elif name.startswith("MLFlow"):
                h["tracking_uri"] = folder.resolve().as_uri()
            kept.append(h)
            names.append(name if section.startswith("train") else f"{name} (validation)")
        parser[section] = kept
    handlers = (
        list(_get(parser, "train#handlers", []) or []) if _has(parser, "train#handlers") else []
    )
    return handlers, names


def train_bundle(bundle_dir: str | Path, *, resume: bool = False, **options: Any) -> Any:
    """Train the bundle in ``bundle_dir`` privately; returns the run result.

    Args:
        bundle_dir: A bundle in the Model Zoo layout.
        resume: Continue the run in ``out`` within its budget.
        **options: ``epsilon`` (required) and the other arguments of :func:`prepare_bundle`.
    """
    from dpkfc_med.training.run import train

    b = prepare_bundle(bundle_dir, **options)
    return train(
        b.cfg,
        resume=resume,
        task=b.task,
        network=(b.network, b.fixes),
        handlers=b.handlers,
        decollate=True,  # the bundle's handlers read per-sample outputs, as in MONAI
    )


def _plain_config(value: Any) -> Any:
    """A resolved config as plain lists, dicts and scalars (YAML-safe)."""
    if isinstance(value, (list, tuple)):
        return [_plain_config(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain_config(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise BundleConfigError(
        [f"network_def: the value {value!r} is not a plain setting; give network_def as a "
         "_target_ with plain arguments so the released model can be rebuilt"]
    )  # fmt: skip


def _fix_dict(fix: Any) -> dict[str, Any]:
    import dataclasses

    if dataclasses.is_dataclass(fix) and not isinstance(fix, type):
        return dataclasses.asdict(fix)
    return dict(fix)
