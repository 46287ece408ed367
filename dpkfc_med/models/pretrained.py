"""External weights for the run's network: read, checked key by key, copied in.

:func:`load_pretrained` copies a state dict, a finished run's ``model.pt`` or a MONAI bundle's
``models/model.pt`` into a freshly built network after checking that every key and shape
matches; keys matching ``skip`` patterns keep their fresh initialisation (a public 2-class
model fine-tuned on a 3-class private task re-initialises its output layer). Files are read
with ``torch.load(weights_only=True)``: an external pickle cannot run code.

Privacy guarantee:
    The weights are an input of the mechanism, not an output: a run's (epsilon, delta) covers
    its private fine-tuning only, and the weights must not come from the private records. The
    report names them by SHA-256 digest and the user's statement of their source. Weights
    whose own run record (the custodian report beside a run's ``model.pt``) shows they were
    trained on data with this run's fingerprint are refused (:func:`same_data_problems`).

    An exported bundle carries no run record: the data fingerprint is custodian-only (released,
    it would let someone holding every record but one test candidates for the last). It
    carries :func:`training_data_tag` instead, the fingerprint under a secret key of the
    exporting custodian (HMAC-SHA256, Bellare et al. 1996), which only that custodian can
    compare with a new run's data.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dpkfc_med.data.paths import sha256_file

__all__ = [
    "PretrainedWeightsError",
    "compile_patterns",
    "custodian_key",
    "load_pretrained",
    "read_pretrained",
    "same_data_problems",
    "training_data_tag",
]

RUN_RECORD = Path("private_not_for_release") / "custodian_report.json"
"""Where a run keeps its data fingerprint, relative to its folder (the run's ``model.pt``)."""
KEY_ENV = "DPKFC_MED_CUSTODIAN_KEY"
"""Environment variable naming the custodian's key file (default :data:`DEFAULT_KEY`)."""
DEFAULT_KEY = Path("~/.config/dpkfc-med/custodian.key")
TAG_FIELD = "training_data_tag"
"""Key of the tag in an exported bundle's ``differential_privacy`` metadata block."""

log = logging.getLogger("dpkfc_med")

_BN_STATS = ("running_mean", "running_var", "num_batches_tracked")


class PretrainedWeightsError(ValueError):
    """External weights that cannot be loaded into the run's network.

    Attributes:
        problems: One line per problem, naming the key, what differs and the fix.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("model.pretrained:\n  " + "\n  ".join(self.problems))


def compile_patterns(patterns: Iterable[str], field_name: str) -> list[re.Pattern[str]]:
    """Regular expressions of a config list, every bad one named in one ``ValueError``."""
    out, problems = [], []
    for pat in patterns:
        try:
            out.append(re.compile(pat))
        except re.error as err:
            problems.append(f"{field_name}: {pat!r} is not a regular expression ({err})")
    if problems:
        raise ValueError("\n".join(problems))
    return out


def read_pretrained(path: str | Path) -> tuple[dict[str, Tensor], str, Path]:
    """The state dict held by a weights file or MONAI bundle folder.

    Args:
        path: A ``.pt``/``.pth`` file holding a state dict, ``{"model": state_dict}`` (a
            finished run's ``model.pt``) or ``{"state_dict": state_dict}``; or a MONAI bundle
            folder (its ``models/model.pt``).

    Returns:
        ``(state_dict, format, file)``: ``format`` is ``"state dict"``, ``"run model.pt"``
        or ``"MONAI bundle"``; ``file`` is the file read (its digest goes in the report).

    Raises:
        PretrainedWeightsError: no such file, not a tensor-only checkpoint, or no state dict.
    """
    p = Path(path)
    fmt = "state dict"
    if p.is_dir():
        file = p / "models" / "model.pt"
        if not file.is_file():
            raise PretrainedWeightsError(
                [
                    f"{p}: a folder but not a MONAI bundle with models/model.pt; give a "
                    ".pt/.pth state dict, a run's model.pt or a bundle folder"
                ]
            )
        p, fmt = file, "MONAI bundle"
    elif not p.is_file():
        raise PretrainedWeightsError(
            [
                f"{p}: no such file or folder; give a .pt/.pth state dict, a run's model.pt or a "
                "MONAI bundle folder"
            ]
        )
    try:  # tensors and plain containers only: an external pickle must not run code
        from dpkfc_med.tasks.kinds import TaskKind

        # a run's model.pt records its task kind as this str enum: allowed, nothing else
        with torch.serialization.safe_globals([TaskKind]):
            obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for foreign or unsafe pickles
        raise PretrainedWeightsError(
            [
                f"{p}: cannot be read as a tensor-only checkpoint ({type(err).__name__}); "
                "re-save it as a plain state dict: torch.save(model.state_dict(), path)"
            ]
        ) from None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj, fmt = obj["model"], ("run model.pt" if fmt == "state dict" else fmt)
    elif isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, Tensor) for v in obj.values()):
        raise PretrainedWeightsError(
            [
                f"{p}: holds no state dict (a mapping of parameter names to tensors, or one "
                "under the key 'model' or 'state_dict')"
            ]
        )
    state = {str(k): v for k, v in obj.items()}
    for prefix in ("module.", "_module."):  # DataParallel / Opacus GradSampleModule wrappers
        if all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return state, fmt, p


def load_pretrained(
    model: nn.Module,
    path: str | Path,
    *,
    skip: Sequence[str] = (),
    source: str | None = None,
    class_map: Sequence[int] | None = None,
) -> dict[str, Any]:
    r"""Copy external weights into ``model`` after checking every key and shape.

    Keys of ``model.state_dict()`` that match a ``skip`` pattern (``re.search`` in the dotted
    key, e.g. ``"^classifier\.3\."``) keep their fresh initialisation, and the file's keys
    matching one are ignored. Batch-norm statistics (``running_mean`` ...) of a layer that the
    DP fixer replaced by a norm without statistics are dropped.

    Args:
        model: The freshly built (and DP-fixed) network, modified in place.
        path: See :func:`read_pretrained`.
        skip: Regular expressions of keys to leave at their initialisation.
        source: Where the weights come from, as the user states it (reported as given).
        class_map: For each output class of ``model``, the class of the file's network it
            starts from (e.g. ``[0, 1, 1]``: a 3-class head from a 2-class one whose class 1
            covered both). Every tensor whose shape differs from the file's in one axis only,
            where the network has ``len(class_map)`` entries, takes the file's entries
            ``class_map`` along that axis (the output layer's weight and bias).

    Returns:
        The provenance record: ``sha256``, ``source``, ``format``, ``reinitialised``,
        ``dropped_keys``, ``path``.

    Raises:
        PretrainedWeightsError: missing / unexpected keys or shape mismatches, each naming the
            first keys and the fix; all problems at once.
    """
    state, fmt, file = read_pretrained(path)
    patterns = compile_patterns(skip, "model.pretrained_skip")
    mine = model.state_dict()

    def skipped(key: str) -> bool:
        return any(p.search(key) for p in patterns)

    modules = dict(model.named_modules())
    dropped = sorted(
        k
        for k in state
        if k not in mine
        and k.rsplit(".", 1)[-1] in _BN_STATS
        and not isinstance(modules.get(k.rsplit(".", 1)[0]), nn.modules.batchnorm._NormBase)
        and k.rsplit(".", 1)[0] in modules
    )
    missing = [k for k in mine if k not in state and not skipped(k)]
    unexpected = [k for k in state if k not in mine and not skipped(k) and k not in dropped]
    problems: list[str] = []
    mapped = _map_classes(state, mine, class_map, skipped, problems) if class_map else {}
    state = {**state, **mapped}
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(mine[k].shape)}"
        for k in mine
        if k in state and not skipped(k) and state[k].shape != mine[k].shape
    ]
    fix = (
        "check model.name / model.kwargs against the network the weights were trained with, "
        "or leave keys at their fresh initialisation with model.pretrained_skip: [regex, ...]"
    )
    if shapes:
        problems.append(
            f"{len(shapes)} shape mismatch(es) (file vs network), first: {'; '.join(shapes[:3])}"
            f"; {_shape_fix(model, [s.split(' ', 1)[0] for s in shapes])}"
        )
    if missing:
        problems.append(
            f"{len(missing)} key(s) of the network missing from the file, first: "
            f"{missing[:3]}; {fix}"
        )
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected key(s) in the file, first: {unexpected[:3]}; {fix}"
        )
    if problems:
        raise PretrainedWeightsError([f"{file}: {p}" for p in problems])
    reinit = [k for k in mine if skipped(k)]
    with torch.no_grad():
        for k, v in mine.items():
            if k in state and not skipped(k):
                v.copy_(state[k].to(dtype=v.dtype, device=v.device))
    if reinit:
        log.info(
            "model.pretrained: %d key(s) keep their fresh initialisation: %s", len(reinit), reinit
        )
    return {
        "sha256": sha256_file(file),
        "source": source if source else "not stated",
        "format": fmt,
        "tensors_loaded": len(mine) - len(reinit),
        "reinitialised": reinit,
        "class_mapped": sorted(mapped),
        "class_map": list(class_map) if class_map else None,
        "dropped_keys": dropped,
        "path": str(file),
    }


def _shape_fix(model: nn.Module, keys: list[str]) -> str:
    """The fix for mismatched shapes: a class-count change only touches the output layer."""
    params = [name for name, _ in model.named_parameters()]
    out = params[-1].rsplit(".", 1)[0] if params else ""
    if out and all(k.rsplit(".", 1)[0] == out for k in keys):
        return (
            "a different class count re-initialises the output layer with "
            f"model.pretrained_skip: ['^{re.escape(out)}\\.'] (or maps its classes with "
            "model.pretrained_class_map)"
        )
    return (
        "the layers' widths differ from the file's: give model.name / model.kwargs (e.g. "
        "channels, features) of the network the weights were trained with"
    )


def _map_classes(
    state: dict[str, Tensor],
    mine: dict[str, Tensor],
    class_map: Sequence[int],
    skipped: Any,
    problems: list[str],
) -> dict[str, Tensor]:
    """The file's output-layer tensors with their class axis taken at ``class_map``."""
    out: dict[str, Tensor] = {}
    for k, want in mine.items():
        have = state.get(k)
        if have is None or skipped(k) or have.shape == want.shape or have.dim() != want.dim():
            continue
        axes = [d for d in range(want.dim()) if have.shape[d] != want.shape[d]]
        if len(axes) != 1 or want.shape[axes[0]] != len(class_map):
            continue  # not a class axis: reported as a shape mismatch
        axis = axes[0]
        bad = [c for c in class_map if not 0 <= int(c) < have.shape[axis]]
        if bad:
            problems.append(
                f"model.pretrained_class_map: {k} has {have.shape[axis]} classes in the file, "
                f"so {bad} are not classes of it; give indices in [0, {have.shape[axis]})"
            )
            continue
        index = torch.as_tensor([int(c) for c in class_map], device=have.device)
        out[k] = have.index_select(axis, index)
    if not out and not problems:
        problems.append(
            f"model.pretrained_class_map {list(class_map)}: no tensor of the file differs from "
            f"the network's in a class axis of {len(class_map)} entries; drop it, or give one "
            "entry per output class of the network"
        )
    return out


def custodian_key(*, create: bool = False) -> bytes | None:
    """This custodian's secret key for data tags (32 random bytes, hex, in a 0600 file).

    The file is :data:`KEY_ENV` or :data:`DEFAULT_KEY`; it never leaves the custodian's machine.

    Args:
        create: Write a new key when there is none (export does; checks only read).

    Returns:
        The key, or ``None`` when there is none (or it cannot be read or written).
    """
    path = Path(os.environ.get(KEY_ENV) or DEFAULT_KEY).expanduser()
    try:
        if path.is_file():
            return bytes.fromhex(path.read_text(encoding="utf-8").strip())
        if not create:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        try:  # O_EXCL: of two processes creating it at once, both end up with the first key
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(secrets.token_hex(32) + "\n")
        except FileExistsError:
            pass
        return bytes.fromhex(path.read_text(encoding="utf-8").strip())
    except (OSError, ValueError) as err:
        log.warning("custodian key %s: %s; exported bundles carry no data tag", path, err)
        return None


def _key_id(key: bytes) -> str:
    return hashlib.sha256(b"dpkfc-med custodian key id\0" + key).hexdigest()[:16]


def _tags(key: bytes, salt: str, fingerprints: Iterable[str]) -> list[str]:
    return sorted(
        hmac.new(key, f"{salt}\0{fp}".encode(), hashlib.sha256).hexdigest() for fp in fingerprints
    )


def training_data_tag(run_dir: str | Path) -> dict[str, Any] | None:
    """The data tag an exported bundle carries: the run's data fingerprint under this key.

    ``tags`` are HMAC-SHA256 of each ``data.sha256`` value of the run record, keyed by
    :func:`custodian_key` and salted per export (two bundles of one data set do not match);
    without the key they say nothing about the data.

    Args:
        run_dir: The run whose record (:data:`RUN_RECORD`) holds the data fingerprint.

    Returns:
        ``scheme``, ``key_id``, ``salt`` and ``tags``; ``None`` without a record or a key.
    """
    fingerprints = _record_fingerprints(Path(run_dir) / RUN_RECORD)
    key = custodian_key(create=True) if fingerprints else None
    if not fingerprints or key is None:
        return None
    salt = secrets.token_hex(16)
    return {
        "scheme": "HMAC-SHA256 of each training-data fingerprint under the exporting "
        "custodian's secret key (dpkfc-med); lets that custodian refuse fine-tuning these "
        "weights on the same data, says nothing about the data to anyone else",
        "key_id": _key_id(key),
        "salt": salt,
        "tags": _tags(key, salt, fingerprints.values()),
    }


def _record_fingerprints(record: Path) -> dict[str, str]:
    """``data.sha256`` of a run record (empty when there is none or it cannot be read)."""
    if not record.is_file():
        return {}
    try:
        data = json.loads(record.read_text(encoding="utf-8")).get("data") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return {str(k): str(v) for k, v in (data.get("sha256") or {}).items()}


def _bundle_metadata(p: Path) -> Path | None:
    """``configs/metadata.json`` of the bundle holding weights ``p`` (its folder or file)."""
    root = p if p.is_dir() else (p.parent.parent if p.parent.name == "models" else None)
    meta = root / "configs" / "metadata.json" if root is not None else None
    return meta if meta is not None and meta.is_file() else None


def same_data_problems(path: str | Path | None, fingerprints: dict[str, str] | None) -> list[str]:
    """Refusal lines when weights were trained on data with this run's fingerprint.

    Two records show where weights come from:

    - a run's ``model.pt`` has its run record beside it (:data:`RUN_RECORD`, custodian-only);
      its data fingerprint (``data.sha256``) sharing a digest with this run's means the
      weights were trained on these private records;
    - a bundle exported by ``dpkfc-med bundle export`` (the weights file in its
      ``models/``, or its folder) carries :func:`training_data_tag` in its metadata; when it
      was exported under this custodian's key, a tag equal to one of this run's fingerprint
      under the same key and salt means the same.

    Either way the guarantee would cover the fine-tuning while the start already holds the
    data, so the run is refused. Weights with neither record (a public release, a bundle
    exported elsewhere) cannot be checked; the user's statement of their source
    (``model.pretrained_source``) is what the report shows.

    Args:
        path: ``model.pretrained`` (a weights file or a bundle folder), or ``None``.
        fingerprints: This run's data fingerprint (name -> SHA-256).
    """
    if not path or not fingerprints:
        return []
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    record = folder / RUN_RECORD
    shared = sorted(set(_record_fingerprints(record).values()) & set(fingerprints.values()))
    where = f"their run record {record} has the same data fingerprint"
    meta = _bundle_metadata(p) if not shared else None
    if meta is not None:
        shared = _tagged(meta, fingerprints)
        where = f"their bundle metadata {meta} carries the tag of this run's data fingerprint"
    if not shared:
        return []
    return [
        f"{p}: these weights were trained on this run's private data ({where}, SHA-256 "
        f"{shared[0][:16]}...); starting from them, the guarantee would cover nothing of what "
        "the weights already hold about these records: start from weights trained on public "
        "data, or from no weights"
    ]


def _tagged(meta: Path, fingerprints: dict[str, str]) -> list[str]:
    """This run's fingerprints whose tag an exported bundle's metadata carries."""
    try:
        dp = json.loads(meta.read_text(encoding="utf-8")).get("differential_privacy") or {}
        tag = dp.get(TAG_FIELD) or {}
        key_id, salt, tags = tag.get("key_id"), str(tag.get("salt")), set(tag.get("tags") or [])
    except (OSError, ValueError, AttributeError):
        return []
    if not tags:
        return []
    key = custodian_key()
    if key is None or _key_id(key) != key_id:
        log.info(
            "model.pretrained: %s was exported by another custodian (key %s); whether its "
            "weights were trained on this data cannot be checked here",
            meta,
            key_id,
        )
        return []
    return sorted(fp for fp in set(fingerprints.values()) if _tags(key, salt, [fp])[0] in tags)
