"""The configuration reference (``docs/configuration.md``), generated from the typed config.

Every section, field, type and default comes from the dataclasses of
:mod:`dpkfc_med.training.config` and from
:class:`~dpkfc_med.curvature.preconditioner.PreconditionerConfig`; the descriptions are the
``Attributes:`` entries of their docstrings, and the allowed values come from the option enums
and the config's choice table. Regenerate the page after changing any of them::

    python -m dpkfc_med.training.config_reference > docs/configuration.md

``tests/test_docs.py`` fails while the committed page differs from :func:`render`.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import types
from enum import Enum
from typing import Any, Union, get_args, get_origin, get_type_hints

from dpkfc_med.curvature.preconditioner import PreconditionerConfig
from dpkfc_med.models import list_models
from dpkfc_med.probes import PRESETS
from dpkfc_med.training.config import (
    DataConfig,
    ModelConfig,
    OutputConfig,
    PretrainConfig,
    PrivacyConfig,
    ProbeConfig,
    RunConfig,
    SliceConfig,
    TrackingConfig,
    TrainingConfig,
)
from dpkfc_med.training.config_checks import CHOICES as _CHOICES

__all__ = ["SECTIONS", "field_rows", "render"]

SECTIONS: tuple[tuple[str, type], ...] = (
    ("", RunConfig),
    ("data", DataConfig),
    ("data.slices", SliceConfig),
    ("model", ModelConfig),
    ("privacy", PrivacyConfig),
    ("training", TrainingConfig),
    ("probes", ProbeConfig),
    ("pretrain", PretrainConfig),
    ("preconditioner", PreconditionerConfig),
    ("output", OutputConfig),
    ("tracking", TrackingConfig),
)
"""``(YAML section, dataclass)`` in the order of the page; ``""`` is the top level."""

_HEADER = """\
# Configuration reference

A run is one YAML file (the shipped ones are in `configs/`). Every field below has a default
except `data.path`. Unknown keys, wrong types and bad values are collected and reported
together, each naming the dotted field and the fix; `dpkfc-med train CONFIG --set a.b=value`
overrides a field (the value is parsed as YAML) and is validated the same way;
`--set data.slices=null` turns an optional section off.

This page is generated from the typed config (`dpkfc_med/training/config.py` and
`PreconditionerConfig` in `dpkfc_med/curvature/config.py`); regenerate it with
`python -m dpkfc_med.training.config_reference > docs/configuration.md`.
"""

# Fields whose dataclass docstring has no ``Attributes:`` entry. A docstring entry, where one
# exists, takes precedence, so each text belongs in its dataclass docstring eventually.
_FIELD_DOCS = {
    "name": "run name; defaults to the config file's stem and fills `{name}` in `output.dir`.",
    "method": "training method; `nonprivate` gives no privacy guarantee.",
    "preconditioner": "the preconditioner section below (a mapping of its fields).",
    "model.name": "registered network (`dpkfc_med.models.list_models()`).",
    "model.norm": "normalisation that replaces BatchNorm, which mixes samples.",
    "model.kwargs": "overrides of the MONAI constructor arguments of the registered network.",
    "training.epochs": "planned epochs; the planned steps are `epochs * ceil(N / batch_size)`.",
    "training.batch_size": (
        "batch size `B`: sets the Poisson sample rate `q = 1 / ceil(N / B)`; the expected "
        "batch (units per sampled batch) is `q N`."
    ),
    "training.lr": "learning rate of the base optimizer.",
    "training.momentum": "momentum of `sgd`.",
    "training.weight_decay": "weight decay of the base optimizer.",
    "training.seed": (
        "seed of the model initialisation, data subsets and case split (and of the noise "
        "only with `privacy.reproducible_noise`)."
    ),
    "training.eval_batch_size": "batch size of validation and test inference.",
    "training.device": "`auto` picks `cuda` when available.",
    "training.threads": "PyTorch CPU threads; `null` = PyTorch's default.",
    "training.progress": "show a progress bar.",
    "probes.preset": (
        "modality preset supplying the pink-noise exponent and intensity mapping "
        "(`dpkfc_med/probes/presets.py`)."
    ),
    "probes.kind": (
        "what the probe images are: `pink` (power-law noise) or `shapes` (segmentation: "
        "synthetic volumes of smooth shapes at random contrasts with pink texture, the "
        "volumes data-free pretraining trains on, with the label maps they were drawn from "
        "as targets unless `target: model`). White-noise probes are the method `dp-kfc-white`."
    ),
    "probes.alpha": (
        "power-spectrum exponent of the pink probes or of the shapes' texture (power "
        "proportional to f^(-alpha)); `null` = the preset's."
    ),
    "probes.num_probes": "probes per preconditioner refresh.",
    "probes.refresh_every": (
        "rebuild the preconditioner every this many steps (0 = only at step 0), or `auto`: "
        "every `20 * 2^k` steps, the shortest period whose estimated refresh share of "
        "training time stays within `refresh_budget`."
    ),
    "probes.refresh_budget": "share of training time the `auto` refresh period may spend.",
    "probes.target": (
        "probe targets: `uniform` (independent of inputs and model), `model` (sampled from "
        "the model's softmax on the probes) or `shapes` (segmentation: smooth foreground blobs)."
    ),
    "probes.seed": "seed of the probes; refresh k draws with `seed + k`.",
    "output.dir": "run directory; `{name}` is replaced by the run name.",
}

# Allowed values that live in registries rather than in the config's choice table.
_REGISTRY_CHOICES = {
    "model.name": list_models,
    "probes.preset": lambda: list(PRESETS),
}

_INTROS = {
    "": "Top-level fields; the sections below are nested mappings.",
    "preconditioner": (
        "Settings of the probe-only preconditioner (methods `dp-kfc`, `dp-kfc-white`, "
        "`dp-kfc-public`); see [method.md](method.md). `num_probes` defaults to "
        "`probes.num_probes`."
    ),
    "tracking": (
        "Experiment tracking with TensorBoard or MLflow (`pip install 'dpkfc-med[tracking]'`), "
        "e.g. `dpkfc-med train CONFIG --set tracking.backend=mlflow`. A run writes two "
        "streams. The **shareable** one (default `<run>/tracking/`: event files, or an MLflow "
        "SQLite store `mlflow.db`) holds only what the shareable privacy report holds: epsilon "
        "per noisy step, the recipe, the released model's SHA-256. The **custodian** one "
        "(default `<run>/private_not_for_release/tracking/`) holds the un-noised losses, "
        "validation scores and clipping diagnostics, which the guarantee does not cover: it "
        "leaves the custodian folder only if you set `custodian_uri` yourself, so a shared "
        "tracking server set as `uri` never receives un-noised statistics. View them with "
        "`tensorboard --logdir runs/NAME` or `mlflow ui --backend-store-uri "
        "sqlite:///runs/NAME/tracking/mlflow.db` (the UI needs the full `mlflow` package)."
    ),
}


def _attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` entries of a Google-style class docstring, one line each."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    match = re.search(r"^Attributes:\n((?:[ \t]+.*\n?|\n)*)", doc, flags=re.MULTILINE)
    if match is None:
        return {}
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in match.group(1).splitlines():
        head = re.match(r"^ {4}(\w+):\s*(.*)$", line)
        if head:
            current = entries.setdefault(head.group(1), [])
            current.append(head.group(2))
        elif current is not None and line.strip():
            current.append(line.strip())
    return {name: " ".join(parts).strip() for name, parts in entries.items()}


def _markdown(text: str, package: str = "") -> str:
    """Markdown for reST inline markup, safe inside a table cell.

    Args:
        text: docstring text.
        package: the package that relative references (``:mod:`.families```) are relative to.
    """

    def target(m: re.Match[str]) -> str:
        name = m.group(1)
        return f"`{package}{name}`" if name.startswith(".") and package else f"`{name}`"

    text = re.sub(r":\w+:`~?([^`]+)`", target, text)
    text = text.replace("``", "`")
    return text.replace("|", "\\|")


def _without_internal_refs(text: str) -> str:
    """Drop pointers to development notes that users do not have (``DESIGN.md 2b: ...``)."""
    return re.sub(r"DESIGN\.md[^:;)]*[:;]\s*", "", text)


def _enum_in(hint: Any) -> type[Enum] | None:
    """The option enum of an annotation such as ``Family | str``, if any."""
    candidates = [hint, *get_args(hint)]
    for c in candidates:
        if isinstance(c, type) and issubclass(c, Enum):
            return c
    return None


def _type_name(hint: Any) -> str:
    """A readable annotation: ``int | None``, ``list[float]``, ``str`` for enum options."""
    if _enum_in(hint) is not None:
        return "str"
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(hint))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in get_args(hint))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if hint is type(None):
        return "None"
    if hint is Any:
        return "Any"
    return getattr(hint, "__name__", str(hint))


def _yaml_value(value: Any) -> str:
    """A default as it would be written in YAML."""
    if isinstance(value, Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return value if value else '""'
    return repr(value)


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{_yaml_value(f.default)}`"
    if f.default_factory is not dataclasses.MISSING:
        made = f.default_factory()
        if dataclasses.is_dataclass(made):
            return "section"
        return f"`{_yaml_value(made)}`"
    return "required"


def field_rows(section: str, cls: type) -> list[dict[str, str]]:
    """One row per field of a config dataclass: name, type, default, allowed, description.

    Args:
        section: the YAML section (``""`` for the top level).
        cls: the dataclass.
    """
    hints = get_type_hints(cls)
    docs = _attribute_docs(cls)
    package = cls.__module__.rsplit(".", 1)[0]
    rows = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            continue  # a nested section, documented under its own heading
        if f.metadata.get("internal"):
            continue  # filled by the loader, not read from a file
        path = f"{section}.{f.name}" if section else f.name
        enum = _enum_in(hint)
        if enum is not None:
            allowed = [e.value for e in enum]
        elif path in _REGISTRY_CHOICES:
            allowed = list(_REGISTRY_CHOICES[path]())
        else:
            allowed = _CHOICES.get(path, [])
        doc = docs.get(f.name) or _FIELD_DOCS.get(path, "")
        rows.append(
            {
                "field": f.name,
                "type": _type_name(hint).replace("|", "\\|"),
                "default": "required" if path == "data.path" else _default(f),
                "allowed": ", ".join(f"`{a}`" for a in allowed),
                "description": _markdown(_without_internal_refs(doc), package),
            }
        )
    return rows


def _section_intro(section: str, cls: type) -> str:
    if section in _INTROS:
        return _INTROS[section]
    summary = inspect.cleandoc(cls.__doc__ or "").split("\n\n", 1)[0].replace("\n", " ")
    return _markdown(summary)


def render() -> str:
    """The whole reference page (Markdown)."""
    out = [_HEADER]
    for section, cls in SECTIONS:
        out.append(f"\n## {f'`{section}`' if section else 'Top level'}\n\n")
        out.append(_section_intro(section, cls) + "\n\n")
        out.append("| field | type | default | allowed | description |\n")
        out.append("|---|---|---|---|---|\n")
        for r in field_rows(section, cls):
            out.append(
                f"| `{r['field']}` | `{r['type']}` | {r['default']} | {r['allowed']} "
                f"| {r['description']} |\n"
            )
        if section == "training":
            out.append(_recipe_section())
    return "".join(out)


def _recipe_section() -> str:
    """``training.recipe: auto``: the rule, from :mod:`dpkfc_med.recipe.rule`'s docstring."""
    from dpkfc_med.recipe import RECIPE_FIELDS, rule

    body = inspect.cleandoc(rule.__doc__ or "").split("\n\n", 1)[1]
    fields = ", ".join(f"`{f}`" for f in RECIPE_FIELDS)
    return (
        "\n### `training.recipe: auto`\n\n"
        "The suggested start for a new workload, and the default of `dpkfc-med bundle train` "
        "(`--recipe bundle` keeps a bundle's own optimizer, lr, batch and epochs). Every "
        f"field of {fields} that the config does not set is chosen by this rule, from public "
        "facts only: the target epsilon, the number of training units, the task and its "
        "declared shapes, the network's parameter count and whether public weights are "
        "given (`dpkfc_med/recipe/rule.py`). Console and report list each field as set by "
        "you or chosen by the rule. Evidence: "
        "[recipe benchmark](../dpkfc_bench/results/recipe.md).\n\n" + body + "\n"
    )


def main() -> int:
    """Print the reference page to standard output."""
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
