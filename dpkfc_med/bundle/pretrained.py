"""Start a bundle's private fine-tuning from public weights: its own or a named checkpoint.

A Model Zoo bundle ships its weights in ``models/model.pt`` (a state dict, sometimes wrapped
as ``{"model": ...}`` or ``{"state_dict": ...}``). ``dpkfc-med bundle train BUNDLE
--pretrained`` starts from them, ``--pretrained PATH`` from another file or bundle folder, and
the bundle's own train config may say the same::

    "private_training": {"pretrained": true, "pretrained_source": "MONAI Model Zoo x 0.5.4"}

(``pretrained``: ``true`` for ``models/model.pt``, or a path relative to the bundle folder;
``private_training#model`` may hold exactly the ``model.pretrained*`` keys). Every form
becomes the run config's ``model.pretrained`` / ``model.pretrained_source``, so the weights get
the key and shape checks, ``model.pretrained_skip``, ``model.pretrained_class_map`` and
``training.finetune`` modes of a run config (:mod:`dpkfc_med.models.finetune`).

Privacy guarantee:
    The weights are an input of the mechanism: the run's (epsilon, delta) covers the private
    fine-tuning only, and the weights must not have been trained on the private data. The
    report names them by SHA-256 digest and by the stated source ("not stated" without
    ``--pretrained-source``); weights whose run record, or whose exported bundle's data tag,
    shows this data fingerprint are refused
    (:func:`~dpkfc_med.models.pretrained.same_data_problems`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpkfc_med.bundle.zoo_task import BundleConfigError, has_id

__all__ = ["OWN_WEIGHTS", "PRETRAINED_KEYS", "model_keys_allowed", "use_pretrained"]

OWN_WEIGHTS = Path("models") / "model.pt"
"""Where a Model Zoo bundle keeps its weights, relative to the bundle folder."""
PRETRAINED_KEYS = ("pretrained", "pretrained_source", "pretrained_skip", "pretrained_class_map")
"""The ``model`` fields a bundle's ``private_training`` may set (the rest come from it)."""
_TOP = ("pretrained", "pretrained_source")
"""The short form: ``private_training: {pretrained: ..., pretrained_source: ...}``."""

log = logging.getLogger("dpkfc_med")


def model_keys_allowed(parser: Any) -> bool:
    """Whether ``private_training#model`` holds only ``model.pretrained*`` keys."""
    section = parser["private_training#model"]
    return isinstance(section, dict) and bool(section) and set(section) <= set(PRETRAINED_KEYS)


def use_pretrained(
    raw: dict[str, Any],
    parser: Any,
    bundle: Path,
    *,
    pretrained: str | bool | None = None,
    source: str | None = None,
    settings: Sequence[str] = (),
) -> None:
    """Put the weights to start from in ``raw["model"]``; with them, pretraining is off.

    Precedence: the bundle's ``private_training`` (paths relative to the bundle), then
    ``--set model.pretrained*`` (already in ``raw``), then ``--pretrained`` /
    ``--pretrained-source`` (paths relative to the working folder).

    The rule between public weights and data-free pretraining: when ``model.pretrained`` is
    set, pretraining is off (it would overwrite the weights). A ``pretrain.steps`` the bundle
    states (its ``private_training``) becomes 0 here; ``training.recipe: auto`` chooses 0 from
    the same fact (:mod:`dpkfc_med.recipe.rule`, ``public_weights``); a ``--set
    pretrain.steps`` above 0 is the user's own, which the config checks refuse.

    Args:
        raw: The run config being built, after ``private_training`` and ``--set``; modified.
        parser: The bundle's train config (MONAI ``ConfigParser``).
        bundle: The bundle folder.
        pretrained: ``--pretrained``: ``True`` for the bundle's :data:`OWN_WEIGHTS`, else a
            weights file or bundle folder; ``None`` when not given.
        source: ``--pretrained-source``: where the weights come from, as it may be published.
        settings: The ``--set`` items (to tell what the user stated).

    Raises:
        BundleConfigError: The weights file does not exist (naming the path and the fix), or
            a source is stated without weights.
    """
    model = raw.setdefault("model", {})
    for key in _TOP:
        raw.pop(key, None)  # merged from private_training; placed in model below
    stated = {item.split("=", 1)[0].strip() for item in settings}
    for key, value in _from_config(parser).items():
        if f"model.{key}" not in stated:
            model[key] = _path(value, bundle, bundle) if key == "pretrained" else value
    if pretrained is not None:
        model["pretrained"] = _path(pretrained, bundle, Path.cwd())
    if source is not None:
        model["pretrained_source"] = source
    weights = model.get("pretrained")
    if model.get("pretrained_source") and not weights:
        raise BundleConfigError(
            ["--pretrained-source: states where pretrained weights come from, but none are "
             "loaded; add --pretrained (the bundle's models/model.pt) or --pretrained PATH"]
        )  # fmt: skip
    if not weights:
        return
    _check_exists(Path(weights), bundle)
    pre = raw.get("pretrain")
    if "pretrain.steps" not in stated and isinstance(pre, dict) and pre.get("steps"):
        log.info(
            "pretrain.steps=%s -> 0: the run starts from model.pretrained, which data-free "
            "pretraining would overwrite",
            pre["steps"],
        )
        pre["steps"] = 0


def _from_config(parser: Any) -> dict[str, Any]:
    """``pretrained`` / ``pretrained_source`` of ``private_training`` (or its ``model``)."""
    out: dict[str, Any] = {}
    for prefix in ("private_training#", "private_training#model#"):
        for key in _TOP:
            if has_id(parser, prefix + key):
                out[key] = parser.get_parsed_content(prefix + key)  # "$@bundle_root + ..."
    return out


def _path(value: Any, bundle: Path, relative_to: Path) -> str | None:
    """``True`` -> the bundle's own weights; a relative path -> under ``relative_to``."""
    if value is True:
        return str(bundle / OWN_WEIGHTS)
    if value in (None, False, ""):
        return None
    p = Path(str(value)).expanduser()
    return str(p if p.is_absolute() else relative_to / p)


def _check_exists(weights: Path, bundle: Path) -> None:
    if weights.exists():
        return
    if weights.resolve() == (bundle / OWN_WEIGHTS).resolve():
        raise BundleConfigError(
            [f"{weights}: no such file; --pretrained (or private_training: {{pretrained: true}}) "
             "starts from the bundle's own weights, which the Model Zoo layout keeps in "
             "models/model.pt: put them there (`python -m monai.bundle download --name NAME` "
             "fetches a Model Zoo bundle with its weights), or name the weights file with "
             "--pretrained PATH"]
        )  # fmt: skip
    raise BundleConfigError(
        [f"{weights}: no such file or folder (model.pretrained); give a .pt/.pth state dict, "
         "a run's model.pt or a MONAI bundle folder, or --pretrained alone for the bundle's "
         "own models/model.pt"]
    )  # fmt: skip
