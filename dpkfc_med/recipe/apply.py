"""Apply ``training.recipe: auto`` to a run config: the rule fills what the user left unset.

Two passes, because the data fields shape the task before it is built:
:func:`recipe_before_task` (crops or slices per unit, from the config alone) and
:func:`recipe_after_task` (everything else, once the number of training units and the
network's parameter count are known). Each pass records one row per field, "set by you" or
"chosen by the rule" with the rule's reason; the report and the console show them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from torch import nn

from dpkfc_med.recipe.facts import PublicFacts, network_facts
from dpkfc_med.recipe.rule import RECIPE_FIELDS, RECIPES, Choice, choose

# RunConfig (dpkfc_med.training.config) is typed Any here: the recipe sits below training
RunConfig = Any

__all__ = [
    "RECIPES",
    "SET_BY_YOU",
    "BY_RULE",
    "public_facts",
    "recipe_after_task",
    "recipe_before_task",
    "recipe_lines",
]

log = logging.getLogger(__name__)

SET_BY_YOU, BY_RULE = "set by you", "chosen by the rule"
_DATA_FIELDS = ("data.patches_per_unit", "data.slices.per_unit")


def _is_set(field: str, set_by_user: frozenset[str]) -> bool:
    parts = field.split(".")
    # a field counts as set when it or a section above it was written
    return any(".".join(parts[: i + 1]) in set_by_user for i in range(len(parts)))


def _get(cfg: Any, field: str) -> Any:
    node = cfg
    for part in field.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def _set(cfg: Any, field: str, value: Any) -> None:
    *parents, last = field.split(".")
    node = cfg
    for part in parents:
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    if isinstance(node, dict):
        node[last] = value
    else:
        setattr(node, last, value)


def _apply(cfg: RunConfig, choices: list[Choice], fields: tuple[str, ...]) -> list[dict[str, Any]]:
    given = frozenset(cfg.set_by_user)
    chosen = set(cfg.training.recipe_chosen)  # a resumed run: its stored config holds them
    rows = []
    for c in choices:
        if c.field not in fields:
            continue
        if c.field in chosen:
            rows.append({"field": c.field, "value": _get(cfg, c.field), "origin": BY_RULE,
                         "why": c.why})  # fmt: skip
            continue
        if _is_set(c.field, given):
            rows.append({"field": c.field, "value": _get(cfg, c.field), "origin": SET_BY_YOU})
            continue
        _set(cfg, c.field, c.value)
        rows.append({"field": c.field, "value": c.value, "origin": BY_RULE, "why": c.why})
    return rows


def public_facts(cfg: RunConfig, task: Any, model: nn.Module, n_units: int) -> PublicFacts:
    """The :class:`PublicFacts` of a run: its config, the task's declared shapes, the network."""
    voxels = 1
    for s in task.spatial_shape:
        voxels *= int(s)
    return PublicFacts(
        epsilon=float(cfg.privacy.target_epsilon),
        n_units=int(n_units),
        kind=str(task.kind),
        spatial_dims=int(task.spatial_dims),
        from_volumes=cfg.data.slices.axis is not None,
        patch_voxels=voxels,
        in_channels=int(task.in_channels),
        num_classes=int(task.num_classes),
        n_params=network_facts(model),
        public_weights=cfg.model.pretrained is not None,
        bundle=cfg.model.name.startswith("bundle:"),
    )


def recipe_before_task(cfg: RunConfig) -> RunConfig:
    """Crops or slices per unit for ``recipe: auto``, from the config alone (a copy)."""
    if cfg.training.recipe != "auto":
        return cfg
    d = cfg.data
    dims = d.spatial_dims or (len(d.patch_size) if d.patch_size else None)
    facts = PublicFacts(
        epsilon=cfg.privacy.target_epsilon, n_units=1, kind=d.task,
        spatial_dims=2 if d.slices.axis is not None else (dims or 0),
        from_volumes=d.slices.axis is not None,
        patch_voxels=math.prod(d.patch_size) if d.patch_size else 1, in_channels=1, num_classes=2,
        n_params=1, public_weights=cfg.model.pretrained is not None,
        bundle=cfg.model.name.startswith("bundle:"),
    )  # fmt: skip
    out = dataclasses.replace(cfg)
    out.data = dataclasses.replace(cfg.data, slices=dataclasses.replace(cfg.data.slices))
    out.recipe_rows = _apply(out, choose(facts), _DATA_FIELDS)
    return out


def recipe_after_task(cfg: RunConfig, facts: PublicFacts) -> RunConfig:
    """Every other unset recipe field for ``recipe: auto`` (a copy of ``cfg``), logged."""
    if cfg.training.recipe != "auto":
        return cfg
    out = dataclasses.replace(
        cfg,
        privacy=dataclasses.replace(cfg.privacy),
        training=dataclasses.replace(cfg.training),
        probes=dataclasses.replace(cfg.probes),
        pretrain=dataclasses.replace(cfg.pretrain),
        preconditioner=dict(cfg.preconditioner),
    )
    other = tuple(f for f in RECIPE_FIELDS if f not in _DATA_FIELDS)
    out.recipe_rows = [*cfg.recipe_rows, *_apply(out, choose(facts), other)]
    order = {f: i for i, f in enumerate(RECIPE_FIELDS)}
    out.recipe_rows.sort(key=lambda r: order[r["field"]])
    out.training.recipe_chosen = [r["field"] for r in out.recipe_rows if r["origin"] == BY_RULE]
    for row in out.recipe_rows:
        note = f" ({row['why']})" if row.get("why") else ""
        log.info("recipe: %s = %s, %s%s", row["field"], row["value"], row["origin"], note)
    return out


def recipe_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The recipe as the console shows it: one line per field with its origin."""
    width = max((len(r["field"]) for r in rows), default=0)
    lines = []
    for r in rows:
        why = f": {r['why']}" if r.get("why") else ""
        lines.append(f"  {r['field']:<{width}}  {r['value']!s:<8}  {r['origin']}{why}")
    return lines
