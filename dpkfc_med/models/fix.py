"""Make a network trainable with Opacus DP-SGD, and explain what stops one from being.

Two kinds of layers get in the way of per-sample gradients:

* layers that **mix samples**: BatchNorm normalises each sample with statistics of the whole
  batch, and running-statistics buffers (BatchNorm, InstanceNorm with
  ``track_running_stats=True``) are averaged over the batch and released without noise.
  Either breaks the per-sample sensitivity bound DP-SGD relies on;
* operations that **overwrite a hooked output in place** (``ReLU(inplace=True)``,
  ``out += residual``): Opacus wraps each trainable layer's output in a backward hook, and
  autograd refuses in-place changes to it.

:func:`make_private_compatible` replaces or reconfigures those layers and returns one
:class:`Fix` per change, so that a pipeline can list them in its privacy report;
:func:`validate_private_compatible` reports, all at once, whatever is still wrong.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum

import torch
from opacus.grad_sample import GradSampleModule
from opacus.layers.dp_rnn import DPRNNBase
from opacus.utils.module_utils import trainable_modules
from opacus.validators import ModuleValidator
from opacus.validators.errors import (
    IllegalModuleConfigurationError,
    ShouldReplaceModuleError,
    UnsupportedModuleError,
)
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules.lazy import LazyModuleMixin

from dpkfc_med.models._attention import hoist_token_parameters
from dpkfc_med.models._choices import unknown_option
from dpkfc_med.models._residual import out_of_place_class

__all__ = [
    "Fix",
    "ModelCompatibilityError",
    "NormChoice",
    "check_input_size",
    "make_private_compatible",
    "validate_private_compatible",
]

_FIX_CALL = "call dpkfc_med.models.make_private_compatible(model)"
# GroupNorm paper (Wu & He, 2018): 32 groups is the default that works across widths.
_MAX_GROUPS = 32
_INSTANCE_NORMS: dict[int, type[_InstanceNorm]] = {
    1: nn.InstanceNorm1d,
    2: nn.InstanceNorm2d,
    3: nn.InstanceNorm3d,
}
_BATCH_NORM_DIMS: tuple[tuple[type[_BatchNorm], int], ...] = (
    (nn.BatchNorm1d, 1),
    (nn.BatchNorm2d, 2),
    (nn.BatchNorm3d, 3),
)


class NormChoice(str, Enum):
    """What :func:`make_private_compatible` puts in place of a BatchNorm layer."""

    GROUP = "group"
    INSTANCE = "instance"

    @classmethod
    def parse(cls, value: NormChoice | str) -> NormChoice:
        """Accept an enum member or a plain (case-insensitive) string.

        Raises:
            ValueError: If ``value`` names no member; the message suggests the closest one.
        """
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise unknown_option("norm", value, [m.value for m in cls]) from None


@dataclass(frozen=True)
class Fix:
    """One change made by :func:`make_private_compatible`.

    Attributes:
        path: Dotted module path as in ``model.named_modules()`` (``""`` for the root).
        before: The module before the change, e.g. ``"BatchNorm3d(64, eps=1e-05, ...)"``.
        after: The module after the change, e.g. ``"GroupNorm(32, 64, eps=1e-05, ...)"``.
        reason: Why the change was needed, in one sentence.
    """

    path: str
    before: str
    after: str
    reason: str

    def __str__(self) -> str:
        return f"{_shown(self.path)}: {self.before} -> {self.after} ({self.reason})"


class ModelCompatibilityError(ValueError):
    """A model has layers that break per-sample privacy or Opacus' per-sample gradients.

    The message has one line per problem, ``"<dotted path>: <what is wrong>; <the fix>"``.

    Attributes:
        problems: The same lines, one per problem.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(self.problems))


def make_private_compatible(
    model: nn.Module,
    *,
    norm: NormChoice | str = NormChoice.GROUP,
    num_groups: int | None = None,
) -> tuple[nn.Module, list[Fix]]:
    """Replace or reconfigure, in place, every layer that stops DP-SGD training with Opacus.

    In order:

    1. each BatchNorm (1d/2d/3d, SyncBatchNorm) becomes a ``GroupNorm`` (``norm="group"``,
       ``num_groups`` groups or the largest divisor of the channel count that is at most 32,
       affine kept) or an ``InstanceNorm{1,2,3}d(affine=True, track_running_stats=False)``
       matching its spatial dims (``norm="instance"``; a SyncBatchNorm, whose dims are
       unknown, becomes the equivalent ``GroupNorm(C, C)``). Affine weights are copied;
    2. each InstanceNorm that tracks running statistics is rebuilt without them;
    3. each module with ``inplace=True`` (ReLU, LeakyReLU, ELU, Dropout, MONAI activations,
       ...) gets ``inplace=False``;
    4. each MONAI residual block that adds its skip connection in place (ResNet, SegResNet,
       DynUNet blocks) gets an equivalent forward that adds it out of place;
    5. MONAI transformer parts whose parameters Opacus' hooks cannot reach (the ViT class
       token, the patch embedding's position embedding, Swin's relative position bias table
       and its windows-folded batch) get leaf modules and equivalent forwards
       (:mod:`dpkfc_med.models._attention`);
    6. whatever ``opacus.validators.ModuleValidator.validate`` still reports and Opacus can
       fix (``nn.LSTM``, ``nn.GRU``, ``nn.MultiheadAttention``) is swapped for Opacus'
       drop-in replacement.

    New modules take the device and dtype of the ones they replace. Nothing is changed if
    an argument error is found. Follow with :func:`validate_private_compatible` to learn
    about anything that could not be fixed (e.g. the model being in eval mode).

    Args:
        model: The network; modified in place.
        norm: ``"group"`` or ``"instance"``: what replaces BatchNorm.
        num_groups: Groups for every GroupNorm replacement; must divide each channel count.
            Only with ``norm="group"``; ``None`` picks the largest divisor at most 32.

    Returns:
        The model (a new object only if the root module itself had to be replaced) and the
        changes made, in the order of the steps above and in module order within a step.

    Raises:
        ValueError: For an unknown ``norm``, ``num_groups`` given with ``norm="instance"``,
            or a ``num_groups`` that does not divide a layer's channels (all such layers
            are listed in one message).

    Note:
        ``BatchNorm1d`` over ``[B, C]`` features has no spatial axis to normalise over, so
        ``norm="instance"`` is degenerate there; ``norm="group"`` is the safe choice.
    """
    choice = NormChoice.parse(norm)
    if num_groups is not None and choice is not NormChoice.GROUP:
        raise ValueError(
            f"num_groups={num_groups} only applies to norm='group', not norm={choice.value!r}; "
            "drop num_groups or choose norm='group'"
        )
    if num_groups is not None and num_groups < 1:
        raise ValueError(f"num_groups must be a positive integer, got {num_groups}")

    replacements, fixes = _plan_norm_replacements(model, choice, num_groups)
    for path, new in replacements.items():
        model = _set_submodule(model, path, new)

    for path, module in model.named_modules(remove_duplicate=False):
        if getattr(module, "inplace", None) is True:
            before = _describe(module)
            module.inplace = False
            fixes.append(
                Fix(
                    path,
                    before,
                    _describe(module),
                    "in-place ops break Opacus' backward hooks on the layer before",
                )
            )
        new_cls = out_of_place_class(module)
        if new_cls is not None:
            name = type(module).__name__
            module.__class__ = new_cls
            fixes.append(
                Fix(
                    path,
                    f"{name} (out += residual)",
                    f"{new_cls.__name__} (out = out + residual)",
                    "an in-place residual add breaks Opacus' backward hooks",
                )
            )

    fixes.extend(Fix(*fix) for fix in hoist_token_parameters(model))
    model, opacus_fixes = _apply_opacus_fixers(model)
    fixes.extend(opacus_fixes)
    return model, fixes


def validate_private_compatible(model: nn.Module) -> None:
    """Check that ``model`` can be trained with DP-SGD through Opacus; report every problem.

    Checks for layers that mix samples (BatchNorm of any kind), running-statistics buffers
    (InstanceNorm with ``track_running_stats=True``), trainable layers with buffers Opacus
    refuses, in-place activations and in-place residual adds (they break Opacus' backward
    hooks), and whatever ``opacus.validators.ModuleValidator`` reports, with its messages
    translated to name the layer.

    Args:
        model: The network to check; not modified.

    Raises:
        ModelCompatibilityError: Once, listing one ``"<path>: <problem>; <fix>"`` line per
            problem, e.g. ``encoder.down.2.norm: BatchNorm3d mixes samples and breaks
            per-sample privacy; call dpkfc_med.models.make_private_compatible(model) or
            choose norm="instance"``.
    """
    problems = _own_problems(model) + _opacus_problems(model)
    if problems:
        raise ModelCompatibilityError(problems)


# --- fixing ------------------------------------------------------------------------------


def _plan_norm_replacements(
    model: nn.Module, choice: NormChoice, num_groups: int | None
) -> tuple[dict[str, nn.Module], list[Fix]]:
    """Build every norm replacement before touching the model, so errors leave it intact."""
    replacements: dict[str, nn.Module] = {}
    fixes: list[Fix] = []
    errors: list[str] = []
    # A module shared by several parents appears under each path; all get the same new one.
    built: dict[int, nn.Module] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, _BatchNorm):
            reason = "BatchNorm mixes samples and breaks per-sample privacy"
        elif isinstance(module, _InstanceNorm) and module.track_running_stats:
            reason = "running statistics are batch averages released without noise"
        else:
            continue
        lazy = isinstance(module, LazyModuleMixin)
        if lazy and module.has_uninitialized_params():  # type: ignore[misc]
            errors.append(
                f"{_shown(path)}: {type(module).__name__} is not initialised yet; "
                "run one forward pass before making the model private"
            )
            continue
        if id(module) not in built:
            try:
                built[id(module)] = _replacement_norm(module, choice, num_groups)
            except ValueError as err:
                errors.append(f"{_shown(path)}: {err}")
                continue
        new = built[id(module)]
        replacements[path] = new
        fixes.append(Fix(path, _describe(module), _describe(new), reason))
    if errors:
        raise ValueError("\n".join(errors))
    return replacements, fixes


def _replacement_norm(
    module: _BatchNorm | _InstanceNorm, choice: NormChoice, num_groups: int | None
) -> nn.Module:
    """Return the privacy-safe norm layer that takes the place of ``module``."""
    channels = module.num_features
    new: nn.Module
    if isinstance(module, _InstanceNorm):
        new = type(module)(
            channels,
            eps=module.eps,  # momentum only drives the running stats that are dropped
            affine=module.affine,
            track_running_stats=False,
        )
    elif choice is NormChoice.INSTANCE:
        dims = next((d for cls, d in _BATCH_NORM_DIMS if isinstance(module, cls)), None)
        if dims is None:
            # SyncBatchNorm accepts any dims; one group per channel is instance norm for all.
            new = nn.GroupNorm(channels, channels, eps=module.eps, affine=True)
        else:
            new = _INSTANCE_NORMS[dims](
                channels, eps=module.eps, affine=True, track_running_stats=False
            )
    else:
        groups = _default_groups(channels) if num_groups is None else num_groups
        if channels % groups:
            divisors = [g for g in range(1, min(channels, _MAX_GROUPS) + 1) if channels % g == 0]
            raise ValueError(
                f"num_groups={groups} does not divide the {channels} channels of "
                f"{type(module).__name__}; choose one of {divisors} or leave num_groups=None"
            )
        new = nn.GroupNorm(groups, channels, eps=module.eps, affine=module.affine)
    _copy_affine(module, new)
    return _like(new, module)


def _default_groups(channels: int) -> int:
    """Largest divisor of ``channels`` that is at most 32."""
    return max(g for g in range(1, min(channels, _MAX_GROUPS) + 1) if channels % g == 0)


def _copy_affine(old: nn.Module, new: nn.Module) -> None:
    """Carry per-channel scale and shift over (both layers have one pair per channel)."""
    old_w, new_w = getattr(old, "weight", None), getattr(new, "weight", None)
    if not isinstance(old_w, nn.Parameter) or not isinstance(new_w, nn.Parameter):
        return
    with torch.no_grad():
        for name in ("weight", "bias"):
            src, dst = getattr(old, name), getattr(new, name)
            dst.copy_(src)
            # A frozen norm stays frozen: freezing decides what DP noise is added to.
            dst.requires_grad_(src.requires_grad)


def _like(new: nn.Module, old: nn.Module) -> nn.Module:
    """Move ``new`` to the device and floating dtype of ``old``."""
    tensors = [*old.parameters(recurse=False), *old.buffers(recurse=False)]
    floating = [t for t in tensors if t.is_floating_point()]
    if floating:
        new.to(device=floating[0].device, dtype=floating[0].dtype)
    elif tensors:
        new.to(device=tensors[0].device)
    return new


def _set_submodule(model: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``path``; returns the (possibly new) root."""
    if path == "":
        return new
    parent_path, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent_path), leaf, new)
    return model


def _apply_opacus_fixers(model: nn.Module) -> tuple[nn.Module, list[Fix]]:
    """Use Opacus' own fixers for what its validator still reports after our fixes."""
    fixes: list[Fix] = []
    if not ModuleValidator.validate(model, strict=False):
        return model, fixes
    for path, module in list(trainable_modules(model)):
        validator = ModuleValidator.VALIDATORS.get(type(module))
        fixer = ModuleValidator.FIXERS.get(type(module))
        if validator is None or fixer is None:
            continue
        errors = validator(module)
        if not errors:
            continue
        new = _like(fixer(module), module)
        model = _set_submodule(model, path, new)
        fixes.append(Fix(path, _describe(module), _describe(new), _first_sentence(errors[0])))
    return model, fixes


# --- validating --------------------------------------------------------------------------


def _own_problems(model: nn.Module) -> list[str]:
    """Problems Opacus' validator misses or reports without saying where."""
    problems: list[str] = []
    for path, module in model.named_modules():
        name, where = type(module).__name__, _shown(path)
        if isinstance(module, _BatchNorm):
            # Checked even without trainable affine (Opacus skips those): the forward
            # pass still mixes samples.
            problems.append(
                f"{where}: {name} mixes samples and breaks per-sample privacy; "
                f'{_FIX_CALL} or choose norm="instance"'
            )
        elif isinstance(module, _InstanceNorm) and module.track_running_stats:
            problems.append(
                f"{where}: {name} tracks running statistics, batch averages that are "
                f"released without noise; {_FIX_CALL} or pass track_running_stats=False"
            )
        if getattr(module, "inplace", None) is True:
            problems.append(
                f"{where}: {name}(inplace=True) overwrites the output of the layer before it, "
                "which breaks Opacus' backward hooks (autograd forbids in-place changes to a "
                f"hooked output); {_FIX_CALL} or pass inplace=False"
            )
        if out_of_place_class(module) is not None:
            problems.append(
                f"{where}: {name} adds its skip connection in place (out += residual), which "
                f"breaks Opacus' backward hooks on the layer before; {_FIX_CALL}"
            )
    for path, module in trainable_modules(model):
        own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        nested = [
            n
            for n, child in module.named_children()
            if any(p.requires_grad for p in child.parameters())
        ]
        if own and nested and not _opacus_handles(module):
            problems.append(
                f"{_shown(path)}: {type(module).__name__} uses its own parameters "
                f"({', '.join(own)}) next to trainable layers ({', '.join(nested[:3])}), so "
                "Opacus would recompute the whole module per sample and cannot hook its layers; "
                "move the parameters into a leaf module (as dpkfc_med.models does for MONAI's "
                "ViT, UNETR and SwinUNETR) or freeze them"
            )
        if isinstance(module, (_BatchNorm, _InstanceNorm)):
            continue  # reported above, with a better fix
        buffers = [n for n, _ in module.named_buffers()]
        if buffers:
            # Same rule as opacus.GradSampleModule.validate, which refuses such layers.
            problems.append(
                f"{_shown(path)}: {type(module).__name__} is trainable and holds buffers "
                f"({', '.join(buffers)}) that Opacus cannot make private; freeze its "
                "parameters or replace the module"
            )
    return problems


def _opacus_handles(module: nn.Module) -> bool:
    """Whether Opacus has its own per-sample rule for this module (a sampler, or its RNNs)."""
    return type(module) in GradSampleModule.GRAD_SAMPLERS or isinstance(module, DPRNNBase)


def _opacus_problems(model: nn.Module) -> list[str]:
    """Translate ``ModuleValidator.validate`` into located, actionable lines."""
    problems: list[str] = []
    located: Counter[str] = Counter()
    for path, module in trainable_modules(model):
        validator = ModuleValidator.VALIDATORS.get(type(module))
        if validator is None:
            continue
        for error in validator(module):
            located[str(error)] += 1
            if isinstance(module, (_BatchNorm, _InstanceNorm)):
                continue  # already in _own_problems
            problems.append(_translate(_shown(path), module, error))

    if not model.training:
        problems.append(
            f"{_shown('')}: {type(model).__name__} is in eval mode, and Opacus computes "
            "per-sample gradients only in training mode; call model.train() first"
        )
    # Anything else Opacus reports (future checks) is kept, verbatim, rather than dropped.
    reported = Counter(str(e) for e in ModuleValidator.validate(model, strict=False))
    reported.pop("Model needs to be in training mode", None)
    for message, count in (reported - located).items():
        problems.extend(
            [f"{_shown('')}: Opacus reports: {_first_sentence(message)}; see its validator"] * count
        )
    return problems


def _translate(where: str, module: nn.Module, error: UnsupportedModuleError) -> str:
    """Say which layer Opacus rejects, why in one sentence, and what to do."""
    name, why = type(module).__name__, _first_sentence(error)
    fixable = type(module) in ModuleValidator.FIXERS
    if isinstance(error, ShouldReplaceModuleError) and fixable:
        return (
            f"{where}: {name} is not supported by Opacus' per-sample gradient hooks; "
            f"{_FIX_CALL} to swap in Opacus' drop-in replacement"
        )
    if isinstance(error, IllegalModuleConfigurationError) and fixable:
        return f"{where}: {name} is configured in a way Opacus rejects ({why}); {_FIX_CALL}"
    return f"{where}: {name} is rejected by Opacus ({why}); replace it or freeze its parameters"


# --- helpers -----------------------------------------------------------------------------


def _shown(path: str) -> str:
    """The root module has the empty path; show it as ``<root>`` in messages."""
    return path or "<root>"


def _describe(module: nn.Module) -> str:
    """One-line description, e.g. ``"ReLU(inplace=True)"``."""
    return f"{type(module).__name__}({module.extra_repr()})"


def _first_sentence(message: object) -> str:
    """Opacus messages are paragraphs; the first sentence says what is wrong."""
    text = str(message).strip()
    cut = text.find(". ")
    return (text if cut < 0 else text[:cut]).rstrip(".")


def check_input_size(model: nn.Module, input_shape: tuple[int, ...]) -> None:
    """Check that ``model`` gives input-dependent outputs for inputs of ``input_shape``.

    A network that downsamples more than the input allows either fails deep inside its
    forward pass or, worse, silently trains a constant: a GroupNorm / InstanceNorm that
    normalises a single value per group outputs its bias whatever the image (DenseNet121 on
    28x28 images reaches 1x1 before its last block). Both are reported here, naming the layer.

    Args:
        model: the network (any train/eval state; restored afterwards).
        input_shape: one sample's ``(C, *spatial)``.

    Raises:
        ModelCompatibilityError: one line per problem, with the fix.
    """
    size = "x".join(map(str, input_shape[1:]))
    fix = (
        "use a larger input (data.resize for MedMNIST files, data.patch_size for volumes) or "
        "a network with fewer downsampling stages"
    )
    problems: list[str] = []
    names = {m: n for n, m in model.named_modules()}

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
        x = inputs[0]
        groups = module.num_groups if isinstance(module, nn.GroupNorm) else x.shape[1]
        per_group = (x.shape[1] // groups) * x[0, 0].numel()
        if per_group == 1:
            problems.append(
                f"{names.get(module, type(module).__name__)}: {type(module).__name__} normalises "
                f"a single value per group at input {size} (feature map "
                f"{'x'.join(map(str, x.shape[2:])) or '1'}), so its output ignores the image; "
                + fix
            )

    norms = [m for m in model.modules() if isinstance(m, (nn.GroupNorm, _InstanceNorm))]
    handles = [m.register_forward_hook(hook) for m in norms]
    was_training = model.training
    try:
        ref = next(model.parameters(), None)
        # A private generator: the check must not move the training RNG.
        x = torch.randn(2, *input_shape, generator=torch.Generator().manual_seed(0))
        if ref is not None:
            x = x.to(device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            model.eval()
            model(x)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0]
        raise ModelCompatibilityError(
            [f"{type(model).__name__} fails on inputs of size {size}: {first}; {fix}"]
        ) from None
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    if problems:
        raise ModelCompatibilityError(
            problems[:5] + ([] if len(problems) <= 5 else [f"... and {len(problems) - 5} more"])
        )
