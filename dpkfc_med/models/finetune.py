"""Start from public or own pretrained weights and choose which parameters train privately.

Two steps, both before the privacy engine wraps the network:

1. :func:`~dpkfc_med.models.pretrained.load_pretrained` copies external weights into a freshly
   built network (a state dict, a finished run's ``model.pt`` or a MONAI bundle folder), after
   checking that every key and shape matches; keys matching ``skip`` patterns keep their fresh
   initialisation (a public 2-class model fine-tuned on a 3-class private task re-initialises
   its output layer).
2. :func:`apply_finetune` sets ``requires_grad`` for a fine-tuning mode (:class:`FinetuneMode`):
   every parameter, the last ``N`` parametrised modules, normalisation affines and biases, or
   LoRA adapters (Hu et al. 2022, "LoRA: Low-Rank Adaptation of Large Language Models",
   through the ``peft`` library). Frozen parameters are invisible to Opacus: they get no
   per-sample gradient, no clipping share, no noise, no curvature block, and never change.

A LoRA layer computes ``y = W x + s B A x`` with ``A`` ``[r, d_in]`` (a convolution with the
layer's kernel), ``B`` ``[d_out, r]`` (a 1x1 convolution) and ``s = alpha / r``; ``A`` and
``B`` are ordinary ``nn.Linear`` / ``nn.ConvNd`` modules, so per-sample gradients and the
DP-KFC curvature adapters treat them like any layer. :func:`released_state_dict` merges them,
``W' = W + s B A``, so the released model is a plain network of the original architecture.

Privacy guarantee:
    The weights loaded here are an input of the mechanism, not an output: the run's
    (epsilon, delta) covers the private fine-tuning only. They must not have been trained on
    the private records (public data, or data outside the private training set); the report
    names them by SHA-256 digest and the user's own statement of their source.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import Tensor, nn

from dpkfc_med.models.pretrained import (
    PretrainedWeightsError,
    compile_patterns,
    load_pretrained,
    read_pretrained,
)
from dpkfc_med.utils import check_choice

__all__ = [
    "FinetuneMode",
    "FinetuneRecord",
    "PretrainedWeightsError",
    "apply_finetune",
    "finetune_record",
    "finetune_report",
    "load_pretrained",
    "lora_supported_types",
    "output_layer_name",
    "parametrised_modules",
    "read_pretrained",
    "released_state_dict",
]

log = logging.getLogger("dpkfc_med")

# what apply_finetune did to each network, held beside it rather than as an attribute on it
# (weak keys: a record goes with its network)
_RECORDS: weakref.WeakKeyDictionary[nn.Module, FinetuneRecord] = weakref.WeakKeyDictionary()
_NORMS: tuple[type[nn.Module], ...] = tuple(
    t
    for t in (
        nn.modules.batchnorm._NormBase,
        nn.GroupNorm,
        nn.LayerNorm,
        getattr(nn, "RMSNorm", None),
    )
    if t is not None
)
LORA_INSTALL = (
    "training.finetune: lora needs the peft library (LoRA layers); install it with "
    "`pip install 'dpkfc-med[finetune]'` (or `pip install 'peft>=0.13'`), or choose "
    "training.finetune: last_layers / norms_and_biases"
)


class FinetuneMode(str, Enum):
    """Which parameters train privately (``training.finetune``)."""

    FULL = "full"
    LAST_LAYERS = "last_layers"
    FIRST_AND_LAST_LAYERS = "first_and_last_layers"
    NORMS_AND_BIASES = "norms_and_biases"
    LORA = "lora"


@dataclass
class FinetuneRecord:
    """What was loaded and which parameters train (the report's ``model`` fields).

    Attributes:
        finetune: The :class:`FinetuneMode` value.
        trainable_params: Elements of the parameters that train privately.
        frozen_params: Elements of the frozen parameters.
        trainable_modules: Dotted names of the modules with a trainable parameter.
        lora: Rank, alpha, scaling and target layers in ``lora`` mode, else ``None``.
        pretrained: The loaded weights: ``sha256`` of the file, ``source`` as the user states
            it, ``format``, ``reinitialised`` keys, ``dropped_keys`` and ``path`` (the path
            is custodian-only in the report).
        head_first: A staged fine-tuning (``training.head_first_epochs``): its ``epochs``, the
            ``modules`` that learn alone in them and their ``params``; ``None``: one stage.
    """

    finetune: str = FinetuneMode.FULL.value
    trainable_params: int = 0
    frozen_params: int = 0
    trainable_modules: list[str] = field(default_factory=list)
    lora: dict[str, Any] | None = None
    pretrained: dict[str, Any] | None = None
    head_first: dict[str, Any] | None = None


def parametrised_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules with parameters of their own, in registration order (``named_modules``)."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if next(m.parameters(recurse=False), None) is not None
    ]


def output_layer_name(model: nn.Module) -> str:
    """The output layer: the last parametrised module in registration order."""
    mods = parametrised_modules(model)
    if not mods:
        raise ValueError("the network has no parameters to fine-tune")
    return mods[-1][0]


def lora_supported_types() -> tuple[type[nn.Module], ...]:
    """Layer types the installed ``peft`` wraps with LoRA (Linear, Conv1d/2d/3d as it has them).

    Raises:
        ImportError: ``peft`` is not installed (:data:`LORA_INSTALL`).
    """
    try:
        from peft.tuners.lora import layer
    except ImportError:
        raise ImportError(LORA_INSTALL) from None
    names = {"Linear": nn.Linear, "Conv1d": nn.Conv1d, "Conv2d": nn.Conv2d, "Conv3d": nn.Conv3d}
    return tuple(t for n, t in names.items() if hasattr(layer, n))


def _lora_targets(model: nn.Module, targets: Sequence[str] | None, output: str) -> list[str]:
    """Dotted names of the layers that get LoRA adapters (see :func:`apply_finetune`)."""
    supported = lora_supported_types()
    kinds = ", ".join(t.__name__ for t in supported)
    layers = [(n, m) for n, m in parametrised_modules(model) if isinstance(m, supported)]
    if targets is None:
        chosen = [n for n, _ in layers if n != output]
        if not chosen:
            raise ValueError(
                f"training.finetune=lora: the network has no {kinds} layer besides the output "
                f"layer {output!r}; set training.lora_targets or choose another mode"
            )
        return chosen
    problems: list[str] = []
    picked: set[str] = set()
    by_type = {t.__name__: t for t in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)}
    for entry in targets:
        if entry in by_type:
            if by_type[entry] not in supported:
                problems.append(
                    f"training.lora_targets: {entry}: the installed peft has no LoRA layer for "
                    f"{entry} (it supports {kinds}); upgrade peft or target other layers"
                )
                continue
            hits = [n for n, m in layers if type(m) is by_type[entry] and n != output]
        else:
            pat = compile_patterns([entry], "training.lora_targets")[0]
            hits = [n for n, _ in layers if pat.search(n)]
            if not hits:
                other = [
                    f"{n} ({type(m).__name__})"
                    for n, m in parametrised_modules(model)
                    if pat.search(n)
                ]
                why = (
                    f"it matches only {other[:3]}, which LoRA cannot wrap"
                    if other
                    else "it matches no layer name"
                )
                problems.append(
                    f"training.lora_targets: {entry!r}: {why}; targets are regexes of module "
                    f"names or the types {kinds} (3D convolutions need a peft with Conv3d "
                    "LoRA)"
                )
        picked.update(hits)
    if problems:
        raise ValueError("\n".join(problems))
    return [n for n, _ in layers if n in picked]


def _inject_lora(model: nn.Module, names: list[str], rank: int, alpha: float) -> None:
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ImportError(LORA_INSTALL) from None
    pattern = "^(?:" + "|".join(re.escape(n) for n in names) + ")$"
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # typed int by peft; a float scales alike
        lora_dropout=0.0,
        bias="none",
        target_modules=pattern,
    )
    inject_adapter_in_model(config, model)


def _lora_layers(model: nn.Module) -> dict[str, Any]:
    """Dotted name -> peft LoRA layer (empty without peft or without adapters)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def apply_finetune(
    model: nn.Module,
    mode: str | FinetuneMode = FinetuneMode.FULL,
    *,
    last: int = 1,
    lora_rank: int = 8,
    lora_alpha: float = 16.0,
    lora_targets: Sequence[str] | None = None,
    keep_trainable: Sequence[str] = (),
) -> FinetuneRecord:
    """Freeze every parameter the mode does not train (``requires_grad=False``), in place.

    Modes:

    * ``full``: every parameter trains.
    * ``last_layers``: the parameters of the last ``last`` parametrised modules (modules with
      parameters of their own, in registration order; norm layers count) train.
    * ``first_and_last_layers``: the first ``last`` and the last ``last`` parametrised modules
      train (the input end adapts to a new intensity profile, the output end to new classes).
    * ``norms_and_biases``: normalisation affines, every ``bias`` and the output layer train.
    * ``lora``: LoRA adapters (rank ``r = lora_rank``, scaling ``lora_alpha / r``, ``B = 0`` at
      the start, so the network starts as loaded) are added to ``lora_targets`` -- regexes
      searched in module names, or the type names ``Linear``, ``Conv1d``, ``Conv2d``,
      ``Conv3d`` (default: every such layer except the output layer) -- and train with the
      output layer (in full, unless it is itself a target); the rest is frozen. Transposed
      convolutions and norms cannot take LoRA adapters.

    Parameters the network's builder or the DP fixer had already frozen stay frozen. Call it
    before the privacy engine wraps the model.

    Args:
        model: The network (pretrained weights already loaded), modified in place.
        mode: A :class:`FinetuneMode` or its value.
        last: Modules trained by ``last_layers``.
        lora_rank: LoRA rank ``r``.
        lora_alpha: LoRA ``alpha``.
        lora_targets: See ``lora`` above.
        keep_trainable: State-dict keys that train whatever the mode (the re-initialised
            keys of :func:`load_pretrained`: a fresh layer left frozen would stay random).

    Returns:
        The :class:`FinetuneRecord`; also kept on the model (:func:`finetune_record`).

    Raises:
        ValueError: an unknown mode, or LoRA targets that match no supported layer.
        ImportError: ``lora`` without ``peft``.
    """
    mode = check_choice("training.finetune", mode, FinetuneMode)
    # what the builder or the DP fixer froze (e.g. unused attention norms) stays frozen
    before = {id(p): p.requires_grad for p in model.parameters()}
    mods = parametrised_modules(model)
    output = output_layer_name(model)
    params = dict(model.named_parameters())
    forced = [params[k] for k in keep_trainable if k in params]
    train: list[nn.Parameter] = []
    lora_info: dict[str, Any] | None = None
    if mode is FinetuneMode.FULL:
        train = list(params.values())
    elif mode in (FinetuneMode.LAST_LAYERS, FinetuneMode.FIRST_AND_LAST_LAYERS):
        if last < 1:
            raise ValueError(f"training.finetune_last={last}: must be at least 1")
        first = mods[:last] if mode is FinetuneMode.FIRST_AND_LAST_LAYERS else []
        ends = {id(m): m for _, m in [*first, *mods[-last:]]}  # overlapping ends: once
        train = [p for m in ends.values() for p in m.parameters(recurse=False)]
    elif mode is FinetuneMode.NORMS_AND_BIASES:
        for name, m in mods:
            for p_name, p in m.named_parameters(recurse=False):
                if isinstance(m, _NORMS) or p_name == "bias" or name == output:
                    train.append(p)
    else:
        names = _lora_targets(model, lora_targets, output)
        _inject_lora(model, names, lora_rank, lora_alpha)
        layers = _lora_layers(model)
        train = [p for n, p in model.named_parameters() if ".lora_" in f".{n}"]
        if output not in names:
            train += list(dict(mods)[output].parameters(recurse=False))
        lora_info = {
            "rank": lora_rank,
            "alpha": lora_alpha,
            "scaling": lora_alpha / lora_rank,
            "targets": names,
            "adapters": len(layers),
            "released": "merged into the base weights (W + scaling * B A)",
        }
    keep = {id(p) for p in [*train, *forced]}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep and before.get(id(p), True))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    if trainable == 0:
        raise ValueError(f"training.finetune={mode.value}: no parameter is left to train")
    record = FinetuneRecord(
        finetune=mode.value,
        trainable_params=trainable,
        frozen_params=frozen,
        trainable_modules=[
            n
            for n, m in model.named_modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))
        ],
        lora=lora_info,
    )
    _RECORDS[model] = record
    if mode is not FinetuneMode.FULL:
        log.info(
            "training.finetune=%s: %d parameters train, %d frozen (modules: %s)",
            mode.value,
            trainable,
            frozen,
            record.trainable_modules,
        )
    return record


def finetune_record(model: nn.Module) -> FinetuneRecord | None:
    """The record :func:`apply_finetune` kept on ``model`` (``None`` if it never ran)."""
    return _RECORDS.get(model)


def finetune_report(model: nn.Module) -> dict[str, Any]:
    """Fields for the report's ``model`` section (merged into it).

    ``finetune``, ``trainable_params``, ``frozen_params``, ``trainable_modules``, ``lora`` and
    ``pretrained`` (``None`` when no external weights were loaded; its ``path`` is moved to
    the custodian report). A model never passed through :func:`apply_finetune` trains in full.
    """
    record = finetune_record(model)
    if record is None:
        n = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        record = FinetuneRecord(trainable_params=n, frozen_params=frozen)
    return asdict(record)


def released_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` as a plain network of the original architecture.

    LoRA layers are merged, ``W' = W + s B A`` (``peft``'s ``get_delta_weight``), and lose
    their adapter keys; any other network's state dict is returned as it is.

    Shape:
        Each merged weight has its base layer's shape (``[d_out, d_in]``, ``[C_out, C_in, *k]``).
    """
    state = model.state_dict()
    layers = _lora_layers(model)
    if not layers:
        return state
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        prefix = next((n for n in layers if key.startswith(f"{n}.")), None)
        if prefix is None:
            out[key] = value
            continue
        rest = key[len(prefix) + 1 :]
        if not rest.startswith("base_layer."):
            continue  # lora_A / lora_B: merged below
        name = f"{prefix}.{rest[len('base_layer.') :]}"
        layer = layers[prefix]
        if rest == "base_layer.weight" and not getattr(layer, "merged", False):
            with torch.no_grad():
                delta = sum(
                    (layer.get_delta_weight(a) for a in layer.active_adapters),
                    torch.zeros_like(value),
                )
                value = (value + delta.to(value.dtype)).detach()
        out[name] = value
    return out
