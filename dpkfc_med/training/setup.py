"""What a run is built from: its device, seed, network, optimizer and data-free pretraining."""

from __future__ import annotations

import dataclasses
import logging
import random
import sys
from typing import Any

import numpy as np
import torch
from torch import nn

from dpkfc_med.engines.handlers.staged import HeadFirstHandler, head_parameters
from dpkfc_med.models import (
    build_model,
    check_input_size,
    make_private_compatible,
    validate_private_compatible,
)
from dpkfc_med.models.finetune import FinetuneRecord, apply_finetune, finetune_record
from dpkfc_med.models.pretrained import PretrainedWeightsError, load_pretrained, same_data_problems
from dpkfc_med.privacy.adambc import DPAdamBC
from dpkfc_med.recipe import public_facts, recipe_after_task, recipe_before_task
from dpkfc_med.recipe.apply import recipe_lines
from dpkfc_med.tasks.base import Task
from dpkfc_med.training.config import ConfigError, RunConfig
from dpkfc_med.training.config_checks import value_problems

log = logging.getLogger("dpkfc_med")

__all__ = [
    "build_run_model",
    "head_first_handler",
    "prepare_finetune",
    "make_optimizer",
    "recipe_before_task",
    "resolve_recipe",
    "settle_recipe",
    "unit_batch",
    "seed_everything",
    "task_record",
]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and PyTorch (initialisation, crops; never the privacy noise)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_run_model(
    cfg: RunConfig, task: Task, *, finetune: bool = True
) -> tuple[nn.Module, list[dict[str, Any]]]:
    """The run's network, made DP-compatible and checked against the task's input size.

    Args:
        cfg: The run config.
        task: The task (input channels, classes, spatial shape).
        finetune: Load ``model.pretrained`` and apply ``training.finetune`` (freezing, LoRA
            adapters); ``False`` builds the plain network of a released ``model.pt``.

    Returns:
        The model and its fixes as dictionaries (the report's ``model.fixes``).
    """
    model, _ = build_model(
        cfg.model.name,
        spatial_dims=task.spatial_dims,
        in_channels=task.in_channels,
        out_channels=task.num_classes,
        dp_fix=False,
        input_size=task.spatial_shape,
        **cfg.model.kwargs,
    )
    model, fixes = make_private_compatible(model, norm=cfg.model.norm)
    if finetune:  # model.pretrained and training.finetune, before any privacy wrapper
        record = getattr(task, "data_record", None) or {}
        prepare_finetune(model, cfg, record.get("sha256"))
    validate_private_compatible(model)
    check_input_size(model, (task.in_channels, *task.spatial_shape))
    return model, [dataclasses.asdict(f) for f in fixes]


def prepare_finetune(
    model: nn.Module, cfg: Any, data_sha256: dict[str, str] | None
) -> FinetuneRecord:
    """Load ``model.pretrained`` (if set) and apply ``training.finetune`` from a run config.

    Weights whose own run record shows they were trained on this private data (the same data
    fingerprint) are refused first.

    Args:
        model: The freshly built, DP-fixed network, modified in place.
        cfg: The run config (``model.pretrained``, ``pretrained_source``, ``pretrained_skip``,
            ``pretrained_class_map``; ``training.finetune``, ``finetune_last``, ``lora_*``).
        data_sha256: The private training data's fingerprint (the data record's ``sha256``,
            name -> SHA-256; ``None``: not known).

    Returns:
        The :class:`~dpkfc_med.models.finetune.FinetuneRecord` (also kept beside the model).

    Raises:
        PretrainedWeightsError: weights trained on this data, or weights that do not fit.
    """
    model_cfg, t = cfg.model, cfg.training
    problems = same_data_problems(model_cfg.pretrained, data_sha256)
    if problems:
        raise PretrainedWeightsError(problems)
    pretrained = None
    if model_cfg.pretrained:
        pretrained = load_pretrained(
            model,
            model_cfg.pretrained,
            skip=model_cfg.pretrained_skip or (),
            source=model_cfg.pretrained_source,
            class_map=getattr(model_cfg, "pretrained_class_map", None),
        )
        log.info(
            "model.pretrained: loaded %s (sha256 %s, source: %s)",
            pretrained["path"],
            pretrained["sha256"],
            pretrained["source"],
        )
        if not model_cfg.pretrained_source:
            log.warning(
                "model.pretrained: where the weights %s come from is not stated, and the "
                "shareable report will say so (source: not stated); state it with "
                "--pretrained-source TEXT (bundle train) or model.pretrained_source: the "
                "guarantee covers the private fine-tuning only, so the weights must not have "
                "been trained on this private data",
                pretrained["path"],
            )
    record = apply_finetune(
        model,
        t.finetune,
        last=t.finetune_last,
        lora_rank=t.lora_rank,
        lora_alpha=t.lora_alpha,
        lora_targets=t.lora_targets,
        keep_trainable=pretrained["reinitialised"] if pretrained else (),
    )
    record.pretrained = pretrained
    return record


def head_first_handler(model: nn.Module, cfg: RunConfig) -> HeadFirstHandler:
    """``training.head_first_epochs``: the stage handler, its stage kept in the finetune record."""
    t = cfg.training
    head = head_parameters(model, t.finetune_last)
    ids = {id(p) for p in head}
    record = finetune_record(model)
    if record is not None:  # the report's model section names the stage
        record.head_first = {
            "epochs": t.head_first_epochs,
            "modules": [
                n for n, m in model.named_modules()
                if any(id(p) in ids for p in m.parameters(recurse=False))
            ],
            "params": sum(p.numel() for p in head),
        }  # fmt: skip
    return HeadFirstHandler(model, head, t.head_first_epochs)


def make_optimizer(cfg: RunConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The configured optimizer (DP-AdamBC gets its noise variance from the privacy engine)."""
    t = cfg.training
    if t.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    if t.optimizer == "adambc":  # noise variance (and the default floor) set by the engine
        return DPAdamBC(
            model.parameters(), lr=t.lr, gamma=t.adambc_gamma, weight_decay=t.weight_decay
        )
    return torch.optim.SGD(
        model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay
    )


def task_record(task: Task) -> dict[str, Any]:
    """The task's public description kept in ``run.json`` (shapes, classes, unit, metric)."""
    return {
        "kind": task.kind,
        "spatial_dims": task.spatial_dims,
        "in_channels": task.in_channels,
        "num_classes": task.num_classes,
        "spatial_shape": list(task.spatial_shape),
        "label_names": task.label_names,
    }


def settle_recipe(
    cfg: RunConfig, task: Task, model: nn.Module, n_units: int
) -> tuple[RunConfig, int]:
    """The run's settings once the task and network exist: the recipe, and the batch at most N."""
    cfg = resolve_recipe(cfg, task, model, n_units)
    return cfg, unit_batch(cfg, n_units)


def resolve_recipe(cfg: RunConfig, task: Task, model: nn.Module, n_units: int) -> RunConfig:
    """``training.recipe: auto``: the rule's choices for every unset field, checked and shown."""
    if cfg.training.recipe != "auto":
        return cfg
    out = recipe_after_task(cfg, public_facts(cfg, task, model, n_units))
    problems = value_problems(out)
    if problems:  # the rule never chooses against a setting of yours; say which one clashes
        raise ConfigError([*problems, "(after training.recipe: auto filled the unset fields)"])
    if cfg.training.progress:
        print("recipe (training.recipe: auto):", *recipe_lines(out.recipe_rows), sep="\n",
              file=sys.stderr, flush=True)  # fmt: skip
    return out


def unit_batch(cfg: RunConfig, n_units: int) -> int:
    """``training.batch_size``, at most the training units (said on the console when cut)."""
    batch = min(cfg.training.batch_size, n_units)
    if batch < cfg.training.batch_size:
        print(
            f"training.batch_size={cfg.training.batch_size} is more than the {n_units} "
            "training units: every step draws each unit with probability 1 (q = 1, expected "
            f"batch {n_units}); lower training.batch_size for subsampling, which amplifies "
            "privacy",
            file=sys.stderr,
            flush=True,
        )
    return batch
