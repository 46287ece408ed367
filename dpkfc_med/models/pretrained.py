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
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dpkfc_med.data.paths import sha256_file

__all__ = [
    "PretrainedWeightsError",
    "compile_patterns",
    "load_pretrained",
    "read_pretrained",
    "same_data_problems",
]

RUN_RECORD = Path("private_not_for_release") / "custodian_report.json"
"""Where a run keeps its data fingerprint, relative to its folder (the run's ``model.pt``)."""

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


def same_data_problems(path: str | Path | None, fingerprints: dict[str, str] | None) -> list[str]:
    """Refusal lines when weights were trained on data with this run's fingerprint.

    A run's ``model.pt`` has its run record beside it (:data:`RUN_RECORD`, custodian-only);
    when that record's data fingerprint (``data.sha256``) shares a digest with this run's,
    the weights were trained on these private records: the guarantee would cover the
    fine-tuning while the start already holds the data, so the run is refused. Weights
    without a run record (a public release, an exported bundle) cannot be checked here; the
    user's statement of their source (``model.pretrained_source``) is what the report shows.

    Args:
        path: ``model.pretrained`` (a weights file or a bundle folder), or ``None``.
        fingerprints: This run's data fingerprint (name -> SHA-256).
    """
    import json

    if not path or not fingerprints:
        return []
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    record = folder / RUN_RECORD
    if not record.is_file():
        return []
    try:
        theirs = (json.loads(record.read_text(encoding="utf-8")).get("data") or {}).get("sha256")
    except (OSError, ValueError):
        return []
    shared = sorted(set((theirs or {}).values()) & set(fingerprints.values()))
    if not shared:
        return []
    return [
        f"{p}: these weights were trained on this run's private data (their run record "
        f"{record} has the same data fingerprint, SHA-256 {shared[0][:16]}...); starting from "
        "them, the guarantee would cover nothing of what the weights already hold about these "
        "records: start from weights trained on public data, or from no weights"
    ]
