"""A bundle's data, loss and evaluator as a private-engine task (:mod:`dpkfc_med.bundle.zoo`).

- **Units:** one unit is one item of ``train#dataset``'s data list, or all items sharing a unit
  key (a patient id). The samples a random transform makes of one item
  (``RandCropByPosNegLabeld(num_samples=k)``) are the unit's, summed before clipping; each
  unit's random transforms draw from a generator keyed by (seed, unit, draw), never by the
  sampling history.
- **Loss:** the bundle's (batch-mean) ``loss`` applied to each sample alone.
- **Probes:** shape, channels and classes from ``metadata.json``'s ``network_data_format``,
  never from the data.
- **Evaluation:** the bundle's ``validate#evaluator`` on ``validate#dataset#data`` (split
  ``val``) or on ``test#dataset#data`` (split ``test``, when the bundle has one); its figures
  are un-noised statistics of private data, for the custodian only.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from dpkfc_med.data.units import UnitDraws
from dpkfc_med.training.config import ConfigError
from dpkfc_med.utils import did_you_mean

__all__ = ["BundleConfigError", "bundle_task", "config_value", "has_id", "network_format"]

SPLIT_DATA = {"val": "validate#dataset#data", "test": "test#dataset#data"}
"""The data list each evaluation split reads; ``validate#evaluator`` runs on it."""


class BundleConfigError(ConfigError):
    """A bundle setting that would break the guarantee or cannot be used; names the id."""


def config_value(parser: Any, key: str, default: Any = None) -> Any:
    """The parsed (instantiated) content of ``key``, or ``default`` when the id is absent.

    Raises:
        BundleConfigError: The content cannot be built (a misspelled ``_target_``, a wrong
            argument); names the id, MONAI's reason and, for an unknown class, the closest
            MONAI or torch name.
    """
    try:
        return parser.get_parsed_content(key, instantiate=True)
    except KeyError:
        return default
    except BundleConfigError:
        raise
    except Exception as err:
        raise BundleConfigError([component_error(key, err)]) from err


def component_error(key: str, err: BaseException) -> str:
    """One line for a bundle component MONAI could not build: the id, the reason, the fix."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    match = re.search(r"Cannot locate class or function path: '([^']+)'", str(err))
    if match:
        name = match.group(1)
        return (
            f"{key}: _target_ {name!r} is not a class MONAI or torch can find"
            f"{_closest(name.rsplit('.', 1)[-1])}; give a MONAI name (UNet, DiceCELoss, "
            "LoadImaged, ...) or a full import path (package.module.Class)"
        )
    cause = err.__cause__ or err.__context__
    detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    return (
        f"{key}: MONAI could not build it ({type(err).__name__}: {text}){detail}; fix its "
        "arguments in the bundle's train config (python -m monai.bundle run shows the same)"
    )


def _closest(name: str) -> str:
    """`` (did you mean 'UNet'?)`` among MONAI's networks, losses, transforms and handlers."""
    import monai.handlers
    import monai.losses
    import monai.networks.nets
    import monai.transforms
    import torch.optim

    names: dict[str, str] = {}
    for module in (
        monai.networks.nets,
        monai.losses,
        monai.transforms,
        monai.handlers,
        torch.optim,
    ):
        for n in dir(module):
            if n[:1].isupper():  # an alias (Unet, LoadImageD) under its class's own name
                own = getattr(getattr(module, n), "__name__", n)
                names[n.lower()] = own if own.lower() == n.lower() else n
    hint = did_you_mean(name, names)
    close = re.search(r"'([^']+)'", hint)
    return f" (did you mean {names[close.group(1)]!r}?)" if close else ""


def has_id(parser: Any, key: str) -> bool:
    """Whether the bundle config defines ``key`` (a MONAI ``#`` id)."""
    try:
        parser[key]
    except (KeyError, IndexError, TypeError):
        return False
    return True


class _UnitItems(Dataset):
    """One item per privacy unit: every sample the transform makes of the unit's data items.

    Args:
        units: Unit id -> the data-list items of that unit.
        transform: The bundle's ``train#preprocessing``.
        seed: The run seed (``None``: OS entropy); with the unit id and its draw count it keys
            the unit's random transforms.
        cache: Keep each item after the transform's deterministic part (everything before its
            first random transform: loading, normalising, padding), as the bundle's
            ``CacheDataset`` does; only the random part runs on every draw. The samples are
            the same as without the cache: MONAI's ``Compose`` hands its random transforms
            their seeds in order, skipping the deterministic ones.
    """

    def __init__(
        self, units: dict[str, list[Any]], transform: Any, seed: int | None, cache: bool = False
    ) -> None:
        self.ids = sorted(units)
        self.units, self.transform, self.seed = units, transform, seed
        self.draws = UnitDraws(seed)
        self.prefix: Any = None
        self.random_part: Any = transform
        if cache:
            self.prefix, self.random_part = _split_deterministic(transform)
        self._cache: dict[tuple[str, int], Any] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def peek(self, index: int) -> list[dict[str, Any]]:
        """Item ``index`` drawn from the look stream, counting no draw (its structure only)."""
        with self.draws.looking():
            return self[index]

    def __getitem__(self, index: int) -> list[dict[str, Any]]:
        uid = self.ids[index]
        self.draws.reseed(self.random_part, uid)
        samples: list[dict[str, Any]] = []
        for j, item in enumerate(self.units[uid]):
            out = self._sample(uid, j, item)
            samples.extend(out if isinstance(out, list) else [out])
        return samples

    def _sample(self, uid: str, j: int, item: dict[str, Any]) -> Any:
        if self.prefix is None:
            return self.random_part(dict(item)) if self.random_part is not None else dict(item)
        if (uid, j) not in self._cache:
            self._cache[uid, j] = self.prefix(dict(item))
        data = copy.deepcopy(self._cache[uid, j])  # the random part must not change the cache
        return self.random_part(data) if self.random_part is not None else data


def _split_deterministic(transform: Any) -> tuple[Any, Any]:
    """``(deterministic prefix, the rest)`` of a MONAI ``Compose``; ``(None, t)`` if none."""
    from monai.transforms import Compose, Randomizable

    steps = list(getattr(transform, "transforms", None) or [])
    cut = next((i for i, t in enumerate(steps) if isinstance(t, Randomizable)), len(steps))
    if not isinstance(transform, Compose) or cut == 0:
        return None, transform
    options = {
        k: getattr(transform, k)
        for k in ("map_items", "unpack_items", "log_stats", "lazy", "overrides")
        if hasattr(transform, k)
    }
    rest = Compose(steps[cut:], **options) if cut < len(steps) else None
    return Compose(steps[:cut], **options), rest


def _caches(parser: Any) -> bool:
    """Whether the bundle's training dataset caches its deterministic transforms."""
    if not has_id(parser, "train#dataset#_target_"):
        return False
    name = str(parser["train#dataset#_target_"]).rsplit(".", 1)[-1]
    if name not in ("CacheDataset", "SmartCacheDataset", "PersistentDataset", "LMDBDataset"):
        return False
    rate = config_value(parser, "train#dataset#cache_rate", 1.0)
    try:
        return float(rate) > 0
    except (TypeError, ValueError):
        return True


def _plain(x: Any) -> Tensor:
    """A plain tensor (MONAI's ``MetaTensor`` meta data is not needed by the private step)."""
    return x.as_tensor() if hasattr(x, "as_tensor") else torch.as_tensor(x)


class _UnitCollate:
    """Concatenate the samples of the drawn units: ``{"image", "label", "unit"}``.

    Segmentation labels stay ``[N, 1, *S]`` maps; classification labels become class ids
    ``[N]``.
    """

    def __init__(
        self, channels: int, patch: Sequence[int], dense: bool, keys: tuple[str, str]
    ) -> None:
        self.channels, self.patch, self.dense = channels, tuple(patch), dense
        self.image_key, self.label_key = keys

    def __call__(self, units: list[list[dict[str, Any]]]) -> dict[str, Tensor]:
        images, labels, ids = [], [], []
        for u, samples in enumerate(units):
            for s in samples:
                images.append(_plain(s[self.image_key]))
                label = _plain(s[self.label_key])
                labels.append(label if self.dense else label.reshape(()).long())
                ids.append(u)
        if not images:  # an empty Poisson batch still takes its noisy step
            label_shape = (0, 1, *self.patch) if self.dense else (0,)
            return {
                "image": torch.zeros(0, self.channels, *self.patch),
                "label": torch.zeros(label_shape, dtype=torch.int64),
                "unit": torch.zeros(0, dtype=torch.int64),
            }
        return {
            "image": torch.stack(images).float(),
            "label": torch.stack(labels),
            "unit": torch.tensor(ids, dtype=torch.int64),
        }


def network_format(parser: Any) -> dict[str, Any]:
    """Probe shape, channels and classes from the metadata's ``network_data_format``."""
    fmt = _meta_format(parser)
    image = (fmt.get("inputs") or {}).get("image") or {}
    pred = (fmt.get("outputs") or {}).get("pred") or {}
    shape = image.get("spatial_shape")
    out: dict[str, Any] = {
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
    out["dense"] = pred.get("type", "image") == "image"
    out["modality"] = image.get("modality")
    channel_def = pred.get("channel_def") or {}
    names = [channel_def.get(str(i), channel_def.get(i)) for i in range(int(out["num_classes"]))]
    out["label_names"] = [str(n) for n in names] if all(names) else None
    return out


def _meta_format(parser: Any) -> dict[str, Any]:
    try:
        return parser.get("_meta_#network_data_format") or {}
    except (KeyError, AttributeError):
        return {}


def _per_sample(loss: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """The bundle's (batch-mean) loss applied to each sample alone: ``[N]``."""

    def per_sample(outputs: Tensor, targets: Tensor) -> Tensor:
        return torch.stack(
            [loss(outputs[i : i + 1], targets[i : i + 1]) for i in range(len(outputs))]
        )

    return per_sample


def data_digest(data: Any) -> str:
    """SHA-256 of a data list: paths and scalars by value, arrays by their bytes and shape."""
    h = hashlib.sha256()

    def feed(x: Any) -> None:
        if isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=str):
                h.update(str(k).encode() + b":")
                feed(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for v in x:
                feed(v)
            h.update(b"]")
        elif isinstance(x, (np.ndarray, Tensor)):
            a = np.ascontiguousarray(x.detach().cpu().numpy() if isinstance(x, Tensor) else x)
            h.update(f"array{a.dtype}{a.shape}".encode() + a.tobytes())
        else:
            h.update(repr(x).encode() + b",")

    feed(data)
    return h.hexdigest()


def item_id(item: Any) -> str:
    """A data-list item's unit id when no unit key is given: a digest of the item alone.

    The id is a function of the item's own entry (its file paths and values), never of its
    position in the list, so adding or removing another item leaves every other unit's id, and
    therefore its random crops (keyed by seed, unit id and draw), unchanged.
    """
    return f"item-{data_digest(item)[:16]}"


def _units(data: Any, unit_key: str | None) -> dict[str, list[Any]]:
    if not isinstance(data, list) or not data:
        raise BundleConfigError(
            ["train#dataset#data: the bundle's training data list is missing or empty; the "
             "private engine samples its items (set it, or --override dataset_dir=...)"]
        )  # fmt: skip
    units: dict[str, list[Any]] = {}
    seen: dict[str, list[int]] = {}
    problems: list[str] = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise BundleConfigError(
                [f"train#dataset#data: item {i} is a {type(item).__name__}, not a dictionary "
                 "such as {'image': ..., 'label': ...}; the private engine reads the image and "
                 "label keys of each item"]
            )  # fmt: skip
        if unit_key is not None and unit_key not in item:
            raise BundleConfigError(
                [f"--unit-key {unit_key!r}: item {i} of train#dataset#data has no such key; "
                 "give every item the unit (patient) id, or drop --unit-key"]
            )  # fmt: skip
        digest = data_digest(item)
        repeats = seen.setdefault(digest, [])
        repeats.append(i)
        if len(repeats) > 1 and names_files(item):
            problems.append(
                f"train#dataset#data: item {i} ({_item_name(item)}) repeats item {repeats[0]}; "
                "a file listed twice would make that patient count twice (2 C); remove the "
                "repeat"
            )
            continue
        if unit_key is not None:
            uid = str(item[unit_key])
        else:
            # Items of in-memory arrays may be equal records (a dataset's duplicate images):
            # the k-th equal one is its own unit. Equal items are interchangeable, so removing
            # one is the same neighbour whichever it is; no other unit's id moves.
            uid = item_id(item) + (f"-{len(repeats) - 1}" if len(repeats) > 1 else "")
        units.setdefault(uid, []).append(item)
    if problems:
        raise BundleConfigError(problems)
    return units


def unit_noun(unit_key: str | None) -> str:
    """The privacy unit in words: ``"image"`` (one data-list item), else the unit key's name.

    ``patient_id`` / ``PatientID`` / ``patient`` read "patient"; other keys read as themselves
    with underscores as spaces.
    """
    if not unit_key:
        return "image"
    stem = re.sub(r"[_\- ]?id$", "", unit_key, flags=re.IGNORECASE) or unit_key
    return stem.replace("_", " ").strip().lower() if stem.lower() != stem.upper() else stem


def unit_source(unit_key: str | None) -> str:
    """Where a bundle's unit comes from, in words (the report's neighbouring relation)."""
    if not unit_key:
        return "one item of train#dataset#data (one image with its label)"
    return f"all items of train#dataset#data sharing the data-list key {unit_key!r}"


def names_files(item: Any) -> bool:
    """Whether a data-list item names files (paths), rather than holding arrays itself."""
    if isinstance(item, dict):
        return any(names_files(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return any(names_files(v) for v in item)
    return isinstance(item, (str, Path))


def _item_name(item: dict[str, Any]) -> str:
    """A short name of a data-list item for messages: its image entry, else its keys."""
    image = item.get("image")
    if isinstance(image, (list, tuple)) and image:
        image = image[0]
    return Path(str(image)).name if isinstance(image, (str, Path)) else f"keys {sorted(item)}"


def bundle_task(
    parser: Any, bundle: Path, unit_key: str | None, seed: int | None, fmt: dict[str, Any]
) -> Any:
    """The private-engine :class:`~dpkfc_med.tasks.base.Task` of a bundle's components.

    Args:
        parser: The bundle's train config (``load_bundle``).
        bundle: The bundle folder (recorded as the data path, custodian only).
        unit_key: Data-list key of the unit id; ``None``: one item is one unit.
        seed: The run seed keying each unit's random transforms (``None``: OS entropy).
        fmt: :func:`network_format` of the metadata.
    """
    from dpkfc_med.tasks.base import Task

    data = config_value(parser, "train#dataset#data")
    units = _units(data, unit_key)
    transform = config_value(parser, "train#preprocessing")
    loss = config_value(parser, "loss")
    if loss is None:
        raise BundleConfigError(["loss: the bundle defines no loss"])
    patch = fmt["spatial_shape"]
    channels, classes, dense = int(fmt["in_channels"]), int(fmt["num_classes"]), fmt["dense"]
    has_evaluator = has_id(parser, "validate#evaluator")
    sizes = {
        split: len(config_value(parser, key, []) or [])
        for split, key in SPLIT_DATA.items()
        if has_id(parser, key)
    }

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
            if split not in sizes or not has_evaluator:
                return {}
            return {**run_evaluator(parser, model, split), "n": sizes[split]}

    return _Task(
        kind="segmentation" if dense and len(patch) > 0 and classes > 1 else "classification",
        spatial_dims=len(patch),
        in_channels=channels,
        num_classes=classes,
        spatial_shape=tuple(patch),
        label_names=fmt.get("label_names"),
        train_set=_UnitItems(units, transform, seed, cache=_caches(parser)),
        data_record={
            "path": str(bundle),
            "format": "MONAI bundle (train#dataset data list)",
            "sha256": {"train#dataset#data": data_digest(data)},
            # units, not items: with --unit-key the item count (e.g. scans per patient) is
            # a private statistic the shareable report must not carry
            "splits": {"train": len(units), **sizes},
            "unit_key": unit_key,
        },
        selection_metric=_key_metric(parser),
        privacy_unit=unit_noun(unit_key),
        max_samples_per_unit=1,
        max_samples_public=False,
        intensity="zscore",
        extra={
            "collate": _UnitCollate(channels, patch, dense, ("image", "label")),
            "splits": sizes,
        },
    )


def _key_metric(parser: Any) -> str:
    if has_id(parser, "validate#key_metric"):
        km = parser["validate#key_metric"]
        if isinstance(km, dict) and km:
            return str(next(iter(km)))
    return "val_mean_dice"


def run_evaluator(parser: Any, model: nn.Module, split: str = "val") -> dict[str, float]:
    """Run the bundle's ``validate#evaluator`` on ``model`` and ``split``'s data list.

    Custodian-only statistics: un-noised figures of private data.
    """
    parser["network"] = model  # validate#handlers were filtered by the bundle's preparation
    key = SPLIT_DATA["val"]
    original = parser[key]
    if split != "val":
        parser[key] = f"$@{SPLIT_DATA[split]}"
    try:
        evaluator = parser.get_parsed_content("validate#evaluator", lazy=False)
    finally:
        parser[key] = original
    evaluator.network = model
    was = model.training
    try:
        evaluator.run()
    finally:
        model.train(was)
    metrics = {k: float(v) for k, v in evaluator.state.metrics.items() if _is_number(v)}
    if split == "val":
        return metrics
    # the bundle names its metrics for validation (val_mean_dice): name them for the split
    return {f"{split}_{k.removeprefix('val_')}": v for k, v in metrics.items()}


def _is_number(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def item_image_digest(item: Any) -> str:
    """SHA-256 of a data-list item's image: of its file(s) by content, else of its array.

    A case copied or linked elsewhere has the digest of its source, so new cases are checked
    against a training list by content, not by path.
    """
    from dpkfc_med.data.paths import sha256_file

    image = item.get("image") if isinstance(item, dict) else item
    if names_files(image):
        files = image if isinstance(image, (list, tuple)) else [image]
        digests = [sha256_file(str(f)) for f in files]
        return (
            digests[0]
            if len(digests) == 1
            else hashlib.sha256(" ".join(digests).encode()).hexdigest()
        )
    return data_digest(image)
