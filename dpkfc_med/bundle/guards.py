"""What a bundle may not do to the guarantee, checked before any budget is spent.

- **Handlers** (:func:`user_handlers`): the MONAI handlers a bundle keeps write only into the
  run's custodian folder; any other handler is refused by id.
- **Data-dependent inputs** (:func:`data_dependent_inputs`): a value the engine uses (the
  transform chain, network, loss, optimizer, handlers) that is computed from the private data
  lists outside one unit's own transform chain (a dataset mean, a fitted transform) makes
  every unit's input depend on every other unit; it is refused by id unless the user accepts
  it as not covered (``--allow-data-dependent ID``).
- **Evaluation lists** (:func:`evaluation_overlap`): validation or test items that are training
  items are refused.
- **Labels and classes** (:func:`label_problems`): every training label value and the
  network's output channels are checked against the declared classes.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dpkfc_med.bundle.zoo_task import (
    SPLIT_DATA,
    BundleConfigError,
    config_value,
    data_digest,
    has_id,
    names_files,
)

__all__ = [
    "HANDLER_OUTPUTS",
    "REPLACED_HANDLERS",
    "check_data_dependence",
    "data_dependent_inputs",
    "evaluation_overlap",
    "label_problems",
    "output_problems",
    "user_handlers",
]

REPLACED_HANDLERS = ("CheckpointSaver", "ValidationHandler", "LrScheduleHandler")
"""Handlers replaced by the private engine's own (named in the report, never run)."""

HANDLER_OUTPUTS: dict[str, tuple[str, ...]] = {
    "StatsHandler": (),  # the console (Python logging), the custodian's
    "TensorBoardStatsHandler": ("log_dir",),
    "TensorBoardImageHandler": ("log_dir",),
    "MLFlowHandler": ("tracking_uri", "artifact_location"),
    "MetricsSaver": ("save_dir",),
    "ClassificationSaver": ("output_dir",),
    "ProbMapProducer": ("output_dir",),
    "MetricLogger": (),
    "DecollateBatch": (),
    "PostProcessing": (),
    "GarbageCollector": (),
}
"""The MONAI handlers a bundle may keep, with the arguments naming where each writes.

Those arguments are set to a folder of the run's custodian folder (``private_not_for_release/``)
whatever the bundle gave, so every file a kept handler writes (un-noised losses, per-case
metrics with image paths, predictions) stays with the data custodian."""
HANDLER_WRITERS = (
    "summary_writer",
    "epoch_event_writer",
    "iteration_event_writer",
    "epoch_print_logger",
    "iteration_print_logger",
    "epoch_logger",
    "iteration_logger",
    "dataset_logger",
    "saver",
)
"""Arguments through which a kept handler would write with a writer of the bundle's own (a
``SummaryWriter``, a logging callable, a saver object), wherever that writes: refused."""
REFUSED_HANDLERS = {
    "EarlyStopHandler": "it stops training on an un-noised validation score of private data; "
    "set training.epochs instead",
    "ParamSchedulerHandler": "it changes the optimizer's settings outside the privacy plan; use "
    "training.lr_schedule",
    "CheckpointLoader": "it would load weights the report does not record; start from "
    "pretrained weights with --set model.pretrained=PATH (and model.pretrained_source=...), "
    "which checks them key by key and names them in the report",
}


def user_handlers(parser: Any, run_dir: Path) -> tuple[list[Any], list[str]]:
    """The bundle's own handlers that stay, each writing only into the custodian folder.

    The replaced ones (:data:`REPLACED_HANDLERS`) are dropped from ``train#handlers`` and
    ``validate#handlers``. The kept ones (:data:`HANDLER_OUTPUTS`) log un-noised private
    statistics: every argument naming where they write is set to a folder of the run's
    custodian folder, and the report lists them as not covered. Any other handler (a user's
    own class, ``ClearMLStatsHandler``, one given as an expression) could write anywhere, and
    is refused with its id and the fix, as is a kept handler given a writer of its own
    (:data:`HANDLER_WRITERS`).

    Returns:
        The instantiated train handlers (to attach to the private trainer) and the names of
        every handler kept in either section.

    Raises:
        BundleConfigError: Every refused handler, by id.
    """
    from dpkfc_med.report.custodian import PRIVATE_DIR

    names: list[str] = []
    problems: list[str] = []
    kept_by_section: dict[str, list[Any]] = {}
    for section in ("train#handlers", "validate#handlers"):
        if not has_id(parser, section):
            continue
        kept = []
        listed = parser[section]
        if not isinstance(listed, list):
            problems.append(
                f"{section}: given as {listed!r}, not a list of components; list the handlers "
                "([{'_target_': 'StatsHandler', ...}, ...], or [] for none) so that where each "
                "writes can be checked"
            )
            continue
        for i, h in enumerate(listed):
            target = str(h.get("_target_", "")) if isinstance(h, dict) else ""
            name = target.rsplit(".", 1)[-1]
            if name in REPLACED_HANDLERS:
                continue
            where = f"{section}#{i} ({target or repr(h)})"
            if name in REFUSED_HANDLERS:
                problems.append(f"{where}: refused: {REFUSED_HANDLERS[name]}")
                continue
            if name not in HANDLER_OUTPUTS:
                problems.append(
                    f"{where}: a handler the private engine does not know could write un-noised "
                    "per-sample statistics of the private data (losses, predictions, the secret "
                    "batch size) anywhere; remove it from the bundle (e.g. --override "
                    f"{section}=[...] without it) or use one of {', '.join(HANDLER_OUTPUTS)}, "
                    f"whose output folders are moved into {PRIVATE_DIR}/"
                )
                continue
            writers = [k for k in HANDLER_WRITERS if h.get(k) not in (None, False)]
            if writers:
                problems.append(
                    f"{where}: {', '.join(writers)} would write through the bundle's own writer, "
                    f"wherever it writes; remove {' / '.join(writers)} and let the handler make "
                    f"its own (its folder is moved into {PRIVATE_DIR}/)"
                )
                continue
            h = dict(h)
            folder = (
                run_dir / PRIVATE_DIR / "bundle_handlers" / f"{section.split('#')[0]}_{i}_{name}"
            )
            for arg in HANDLER_OUTPUTS[name]:
                if name == "MLFlowHandler":
                    h[arg] = (
                        (folder / ("mlruns" if arg == "tracking_uri" else "artifacts"))
                        .resolve()
                        .as_uri()
                    )
                else:
                    h[arg] = str(folder)
            kept.append(h)
            names.append(name if section.startswith("train") else f"{name} (validation)")
        kept_by_section[section] = kept
    if problems:
        raise BundleConfigError(problems)
    for section, kept in kept_by_section.items():
        parser[section] = kept
    handlers = list(config_value(parser, "train#handlers", []) or [])
    return handlers, names


ENGINE_ROOTS = (
    "train#preprocessing",
    "network_def",
    "loss",
    "optimizer",
    "train#handlers",
    "private_training",
)
"""The bundle ids the private engine instantiates for training."""
DATA_LISTS = ("train#dataset#data", *SPLIT_DATA.values())


def _nodes(config: Any, prefix: str = "") -> dict[str, Any]:
    """Every node of a raw bundle config by its id (``a#b#0``), the root excluded."""
    out: dict[str, Any] = {}
    items = (
        config.items() if isinstance(config, dict)
        else enumerate(config) if isinstance(config, list) else ()
    )  # fmt: skip
    for key, value in items:
        node = f"{prefix}#{key}" if prefix else str(key)
        out[node] = value
        out.update(_nodes(value, node))
    return out


def _refs(value: Any) -> set[str]:
    """The ids a raw string value refers to (``@id`` in a reference or ``$`` expression)."""
    from monai.bundle.reference_resolver import ReferenceResolver

    if not isinstance(value, str) or not value.startswith(("$", "@")):
        return set()
    return {
        r.replace(ReferenceResolver.sep, "#") for r in ReferenceResolver.match_refs_pattern(value)
    }


def _within(node: str, ids: Iterable[str]) -> str | None:
    """The id of ``ids`` that ``node`` is, lies within or contains, if any."""
    for d in ids:
        if node == d or node.startswith(d + "#") or d.startswith(node + "#"):
            return d
    return None


def data_dependent_inputs(parser: Any) -> list[str]:
    """The values the engine uses that are computed from the private data lists.

    The private data are the data lists (``train#dataset#data``, the validation and test
    lists) and every expression they are built from (``@images``, a glob of the data folder);
    plain settings they read (``dataset_dir``, ``num_train``) are public configuration. A
    training input (:data:`ENGINE_ROOTS`, followed through every ``@`` reference) that refers
    to any of them reads the data outside one unit's own transform chain: a dataset-wide mean,
    a transform fitted on the data, statistics of a ``CacheDataset``. Adding or removing one
    unit would then change every other unit's input.

    Returns:
        One line per such value: the id where the reference is, and the chain to the data.
    """
    nodes = _nodes(parser.get(""))
    lists = [d for d in DATA_LISTS if d in nodes]
    data = set(lists)
    work = list(lists)
    while work:  # the expressions the lists are built from are the data too
        current = work.pop()
        for node, value in nodes.items():
            if node != current and not node.startswith(current + "#"):
                continue
            for ref in _refs(value):
                raw = nodes.get(ref)
                expression = isinstance(raw, (list, dict)) or (
                    isinstance(raw, str) and raw.startswith(("$", "@"))
                )
                if expression and ref not in data:
                    data.add(ref)
                    work.append(ref)
    replaced = [
        node
        for node, value in nodes.items()
        if isinstance(value, dict)
        and str(value.get("_target_", "")).rsplit(".", 1)[-1] in REPLACED_HANDLERS
    ]  # the engine never builds these (its own validation, checkpoints, lr schedule)
    found: list[str] = []
    for root in ENGINE_ROOTS:
        for node, value in nodes.items():
            if node != root and not node.startswith(root + "#"):
                continue
            if _within(node, replaced) is not None:
                continue
            chain = _chain_to_data(node, value, nodes, data)
            if chain:
                found.append(f"{node}: " + " -> ".join(f"@{c}" for c in chain))
    return found


def _chain_to_data(
    node: str, value: Any, nodes: dict[str, Any], data: set[str]
) -> list[str] | None:
    """The reference chain from ``node``'s own value to a data id, if there is one."""
    seen: set[str] = set()
    stack = [(ref, [ref]) for ref in sorted(_refs(value))]
    while stack:
        ref, chain = stack.pop()
        hit = _within(ref, data)
        if hit is not None:
            return chain if hit == ref else [*chain, hit]
        if ref in seen:
            continue
        seen.add(ref)
        for sub, sub_value in nodes.items():
            if sub == ref or sub.startswith(ref + "#"):
                stack.extend((r, [*chain, r]) for r in sorted(_refs(sub_value)))
    return None


def check_data_dependence(parser: Any, allowed: Iterable[str] = ()) -> list[str]:
    """Refuse data-dependent inputs (:func:`data_dependent_inputs`) unless ``allowed`` names them.

    Returns:
        The accepted ones (each line as found), for the report's not-covered list.

    Raises:
        BundleConfigError: One line per refused value, with the fix.
    """
    allowed = set(allowed)
    found = data_dependent_inputs(parser)
    accepted = [f for f in found if f.split(":", 1)[0] in allowed]
    refused = [f for f in found if f not in accepted]
    unknown = sorted(a for a in allowed if not any(f.split(":", 1)[0] == a for f in found))
    problems = [
        f"{line}: computed from the private data outside one unit's own transform chain, so "
        "adding or removing one unit changes every other unit's input and the guarantee does "
        "not hold; compute it per image inside the transform chain (e.g. NormalizeIntensityd "
        "without subtrahend/divisor normalises each image by its own statistics) or give a "
        "public constant; to train anyway with this value listed as not covered, pass "
        f"--allow-data-dependent {line.split(':', 1)[0]}"
        for line in refused
    ]
    problems += [
        f"--allow-data-dependent {a}: no value of the engine's inputs with this id reads the "
        "data lists; remove the option" for a in unknown
    ]  # fmt: skip
    if problems:
        raise BundleConfigError(problems)
    return accepted


def _image_key(item: dict[str, Any]) -> str:
    """A digest of an item's image entry (its file paths), else of the whole item."""
    return data_digest(item["image"]) if "image" in item else data_digest(item)


def evaluation_overlap(parser: Any, train: list[Any]) -> None:
    """Refuse validation or test items whose image files are a training item's.

    Raises:
        BundleConfigError: Per evaluation list that shares items, with a count and examples.
    """
    # items of in-memory arrays that are equal may be distinct records (published datasets
    # hold duplicate images across splits); only items naming the same files are one record
    train_images = {_image_key(i) for i in train if isinstance(i, dict) and names_files(i)}
    problems = []
    for split, key in SPLIT_DATA.items():
        if not has_id(parser, key):
            continue
        items = config_value(parser, key, []) or []
        shared = [i for i in items if isinstance(i, dict) and _image_key(i) in train_images]
        if shared:
            names = ", ".join(Path(str(i.get("image", "?"))).name for i in shared[:3])
            problems.append(
                f"{key}: {len(shared)} of its {len(items)} items are training items of "
                f"train#dataset#data ({names}{', ...' if len(shared) > 3 else ''}); its "
                f"{split} figures would score the model on data it trained on: give the {split} "
                "list cases that are not in the training list"
            )
    if problems:
        raise BundleConfigError(problems)


def _deterministic_prefix(transform: Any) -> Any:
    """The part of a MONAI ``Compose`` before its first random transform (``None``: none)."""
    from monai.transforms import Compose, Randomizable

    steps = list(getattr(transform, "transforms", []) or [])
    cut = next((i for i, t in enumerate(steps) if isinstance(t, Randomizable)), len(steps))
    return Compose(steps[:cut]) if cut else None


def _label_array(value: Any) -> Any:
    import numpy as np

    if isinstance(value, (str, Path)) or (
        isinstance(value, (list, tuple)) and value and isinstance(value[0], (str, Path))
    ):
        from monai.transforms import LoadImage

        value = LoadImage(image_only=True)(value)
    if hasattr(value, "as_tensor"):
        value = value.as_tensor()
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def label_problems(
    parser: Any, items: list[Any], classes: int, dense: bool, *, show: int = 10
) -> list[str]:
    """Training labels that are not class ids ``0..classes-1``, by item (none: ``[]``).

    Each item goes through the deterministic part of ``train#preprocessing`` (loading and
    label remapping, before the first random transform), so the label checked is the one the
    loss sees, whole. A one-channel label map (or a class id) must hold integers in
    ``[0, classes)``; a label of several channels (one-hot, multi-label) must have ``classes``
    of them. The custodian reads this before training; nothing of it is released.
    """
    import numpy as np

    prefix = _deterministic_prefix(config_value(parser, "train#preprocessing"))
    where = "outputs.pred.num_channels of configs/metadata.json's network_data_format"
    problems: list[str] = []
    for i, item in enumerate(items):
        name = f"train#dataset#data item {i} ({_name(item)})"
        try:
            out = prefix(dict(item)) if prefix is not None else dict(item)
            out = out[0] if isinstance(out, list) else out
            label = _label_array(out["label"])
        except KeyError:
            problems.append(f"{name}: no 'label' after train#preprocessing; give each item one")
            continue
        except Exception as err:  # a file MONAI cannot read: named, with MONAI's reason
            problems.append(
                f"{name}: could not be read through train#preprocessing ({type(err).__name__}: "
                f"{err}); fix the file or the data list"
            )
            continue
        channels = label.shape[0] if dense and label.ndim > 1 else 1
        if channels > 1:
            if channels != classes:
                problems.append(
                    f"{name}: its label has {channels} channels but {where} declares {classes} "
                    "classes; make them agree"
                )
            continue
        values = np.unique(label)
        bad = [v for v in values.tolist() if v != int(v) or not 0 <= v < classes]
        if bad:
            problems.append(
                f"{name}: label value(s) {', '.join(f'{v:g}' for v in bad[:5])} outside the "
                f"{classes} classes 0..{classes - 1} declared by {where}; relabel the case or "
                "declare more classes"
            )
    if len(problems) > show:
        problems = [*problems[:show], f"... and {len(problems) - show} more items"]
    return problems


def output_problems(network: Any, channels: int, shape: list[int], classes: int) -> list[str]:
    """The network's output channels against the declared classes, on a zero input."""
    import torch

    was = network.training
    try:
        network.eval()
        with torch.no_grad():
            out = network(torch.zeros(1, channels, *shape))
    except Exception as err:
        return [
            f"network_def: a zero input of shape {[1, channels, *shape]} (num_channels and "
            f"spatial_shape of network_data_format's inputs.image) fails ({type(err).__name__}: "
            f"{err}); make the network and the metadata agree"
        ]
    finally:
        network.train(was)
    out = out[0] if isinstance(out, (list, tuple)) else out
    if out.ndim < 2 or out.shape[1] != classes:
        got = out.shape[1] if out.ndim >= 2 else "no channel axis"
        return [
            f"network_def: the network gives {got} output channels but configs/metadata.json "
            f"declares {classes} classes (network_data_format outputs.pred.num_channels); set "
            "the network's out_channels (or num_classes) to the class count, or fix the metadata"
        ]
    return []


def _name(item: Any) -> str:
    if not isinstance(item, dict):
        return type(item).__name__
    image = item.get("image")
    if isinstance(image, (list, tuple)) and image:
        image = image[0]
    return Path(str(image)).name if isinstance(image, (str, Path)) else f"keys {sorted(item)}"
