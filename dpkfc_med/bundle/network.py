"""The network of a run as a MONAI bundle ``network_def``, checked against the engine's own build.

The engine builds a network from the registry and then makes it private-compatible
(:func:`dpkfc_med.training.setup.build_run_model`: BatchNorm -> GroupNorm, in-place ops off). A
bundle has to rebuild exactly that architecture from its config. :func:`network_definition`
records the MONAI constructor call the registry makes (``_target_: monai.networks.nets.X`` with
the run's keyword arguments), expresses the norm replacements as MONAI's ``norm`` argument,
and then checks by brute force that the MONAI-only definition is the same network: it must load
the engine model's state dict with ``strict=True`` and give the same outputs on a random input.
In-place flags and out-of-place residual adds change nothing at inference, so they need no
translation. When the check fails (or the network is not a MONAI one, e.g. ``small_cnn``), the
definition falls back to :func:`build_network`, a ``dpkfc_med`` target that runs the engine's
own build; the bundle then needs ``dpkfc-med`` installed, which its metadata and docs say.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch import nn

__all__ = [
    "BUNDLE_FALLBACK_TARGET",
    "FALLBACK_TARGET",
    "NetworkDefinition",
    "build_bundle_network",
    "build_network",
    "network_definition",
]

FALLBACK_TARGET = "dpkfc_med.bundle.build_network"
"""``_target_`` of a network that plain MONAI cannot rebuild (needs ``dpkfc-med``)."""
BUNDLE_FALLBACK_TARGET = "dpkfc_med.bundle.network.build_bundle_network"
"""``_target_`` of a training bundle's network that plain MONAI cannot rebuild."""

_GROUP_RE = re.compile(r"^GroupNorm\((\d+), (\d+),")
_INSTANCE_RE = re.compile(r"^InstanceNorm[123]d\(.*affine=True")


@dataclass(frozen=True)
class NetworkDefinition:
    """A bundle ``network_def`` and how it was obtained.

    Attributes:
        config: The ``network_def`` mapping (``_target_`` plus keyword arguments).
        monai_only: Whether MONAI alone builds it (no ``dpkfc_med`` import).
        note: One sentence for the bundle docs: what the definition is and why.
    """

    config: dict[str, Any]
    monai_only: bool
    note: str


def build_network(
    name: str,
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    spatial_shape: list[int],
    norm: str = "group",
    kwargs: dict[str, Any] | None = None,
) -> nn.Module:
    """Build a registry network exactly as a training run does (fixes included).

    This is the bundle ``network_def`` target for networks that plain MONAI cannot rebuild; it
    calls the engine's own model builder, so the architecture is the trained one.

    Args:
        name: Registry name (``model.name`` of the run config).
        spatial_dims: 2 or 3.
        in_channels: Input channels ``C``.
        out_channels: Classes ``K``.
        spatial_shape: Network input size (checked as in training).
        norm: What replaced BatchNorm (``model.norm``).
        kwargs: Constructor overrides (``model.kwargs``).

    Returns:
        The network in training mode with freshly initialised weights.
    """
    from dpkfc_med.training.config import ModelConfig, RunConfig
    from dpkfc_med.training.setup import build_run_model

    cfg = RunConfig(model=ModelConfig(name=name, norm=norm, kwargs=dict(kwargs or {})))
    task = SimpleNamespace(
        spatial_dims=spatial_dims,
        in_channels=in_channels,
        num_classes=out_channels,
        spatial_shape=tuple(spatial_shape),
    )
    model, _ = build_run_model(cfg, cast(Any, task))
    return model


def build_bundle_network(network_def: dict[str, Any] | nn.Module, norm: str = "group") -> nn.Module:
    """Build a training bundle's ``network_def`` with the fixes the private engine applied.

    The ``network_def`` target of a ``dpkfc-med bundle train`` run whose BatchNorm replacements
    MONAI's ``norm`` argument cannot express (different group counts per layer).
    """
    from monai.bundle import ConfigParser

    from dpkfc_med.models import make_private_compatible

    if isinstance(network_def, nn.Module):  # MONAI's parser built the inner _target_ already
        raw = network_def
    else:
        raw = ConfigParser({"net": copy.deepcopy(network_def)}).get_parsed_content("net")
    model, _ = make_private_compatible(raw, norm=norm)
    return model


def _plain(value: Any) -> Any:
    """Tuples -> lists, recursively (YAML/JSON-friendly constructor arguments)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


@contextmanager
def _recording_monai_calls() -> Iterator[list[tuple[str, tuple[Any, ...], dict[str, Any]]]]:
    """Record calls to the public constructors of ``monai.networks.nets`` (outermost first)."""
    from monai.networks import nets

    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    saved: dict[str, Any] = {}

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def recorder(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, args, dict(kwargs)))
            return real(*args, **kwargs)

        return recorder

    for name in dir(nets):
        obj = getattr(nets, name)
        is_net = isinstance(obj, type) and issubclass(obj, nn.Module)
        if name.startswith("_") or not (is_net or inspect.isfunction(obj)):
            continue
        saved[name] = obj
        setattr(nets, name, wrap(name, obj))
    try:
        yield calls
    finally:
        for name, obj in saved.items():
            setattr(nets, name, obj)


def _norm_argument(fixes: list[Any]) -> tuple[Any, str | None]:
    """MONAI ``norm`` argument equal to the BatchNorm replacements, or why there is none."""
    afters = [f.after for f in fixes if "BatchNorm" in f.before]
    if not afters:
        return None, None
    groups = {m.group(1) for a in afters if (m := _GROUP_RE.match(a))}
    if len(groups) == 1 and all(_GROUP_RE.match(a) for a in afters):
        return ["group", {"num_groups": int(groups.pop())}], None
    if all(_INSTANCE_RE.match(a) for a in afters):
        return ["instance", {"affine": True}], None
    return None, "the BatchNorm replacements use different group counts"


def _accepts(target: Callable[..., Any], arg: str) -> bool:
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False
    return arg in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _same_network(
    definition: dict[str, Any], reference: nn.Module, shape: tuple[int, ...]
) -> str | None:
    """``None`` if the definition builds ``reference``'s network; else what differs."""
    from monai.bundle import ConfigParser

    target = definition["_target_"]
    try:
        net = ConfigParser({"net": copy.deepcopy(definition)}).get_parsed_content("net")
    except Exception as err:  # any failure to build means "not the same network"
        return f"{target} cannot be built from the recorded arguments ({type(err).__name__})"
    mine, theirs = set(net.state_dict()), set(reference.state_dict())
    if mine != theirs:
        extra, lost = sorted(mine - theirs)[:3], sorted(theirs - mine)[:3]
        return (
            f"{target} has other weights than the trained network (its own: {extra}; "
            f"missing: {lost})"
        )
    try:
        net.load_state_dict(reference.state_dict(), strict=True)
    except RuntimeError:
        return f"{target} has weights of other shapes than the trained network"
    net.eval()
    was = reference.training
    reference.eval()
    x = torch.rand((1, *shape), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            ok = torch.allclose(net(x), reference(x), rtol=1e-4, atol=1e-5)
    finally:
        reference.train(was)
    return None if ok else "outputs differ from the engine's network on a random input"


def network_definition(
    model: dict[str, Any], task: dict[str, Any], state_dict: dict[str, Any] | None = None
) -> NetworkDefinition:
    """The bundle ``network_def`` of a run's network.

    Args:
        model: The run config's ``model`` section (``name``, ``norm``, ``kwargs``).
        task: The run's task record (``spatial_dims``, ``in_channels``, ``num_classes``,
            ``spatial_shape``), as stored in ``model.pt``.
        state_dict: The trained weights to check the MONAI definition with (default: the
            fresh initialisation of the engine's build).

    Returns:
        A MONAI-only definition when it provably rebuilds the engine's network, else the
        :data:`FALLBACK_TARGET` definition; ``note`` says which and why.
    """
    from dpkfc_med.models import build_model, make_private_compatible

    if "network_def" in (model.get("kwargs") or {}):
        return _bundle_network(model, task, state_dict)
    args = {
        "name": model["name"],
        "spatial_dims": int(task["spatial_dims"]),
        "in_channels": int(task["in_channels"]),
        "out_channels": int(task["num_classes"]),
        "spatial_shape": [int(s) for s in task["spatial_shape"]],
        "norm": model.get("norm", "group"),
        "kwargs": _plain(model.get("kwargs") or {}),
    }
    fallback = {"_target_": FALLBACK_TARGET, **args}
    reference = build_network(**args)
    if state_dict is not None:
        reference.load_state_dict(state_dict, strict=True)
    with _recording_monai_calls() as calls:
        raw, _ = build_model(
            args["name"],
            spatial_dims=args["spatial_dims"],
            in_channels=args["in_channels"],
            out_channels=args["out_channels"],
            dp_fix=False,
            **args["kwargs"],
        )
    _, fixes = make_private_compatible(raw, norm=args["norm"])
    why: str | None = None
    if not calls:
        why = f"{args['name']!r} is not a monai.networks.nets network"
    elif calls[0][1]:
        why = f"the registry calls monai.networks.nets.{calls[0][0]} with positional arguments"
    if why is None:
        name, _, kwargs = calls[0]
        definition: dict[str, Any] = {"_target_": f"monai.networks.nets.{name}", **_plain(kwargs)}
        norm, why = _norm_argument(fixes)
        if norm is not None:
            from monai.networks import nets

            if _accepts(getattr(nets, name), "norm"):
                definition["norm"] = norm
            else:
                why = f"monai.networks.nets.{name} takes no norm argument for the BatchNorm fix"
        if why is None:
            shape = (args["in_channels"], *args["spatial_shape"])
            why = _same_network(definition, reference, shape)
        if why is None:
            replaced = " (BatchNorm replaced through its norm argument)" if norm else ""
            return NetworkDefinition(
                definition,
                True,
                f"plain MONAI network monai.networks.nets.{name}{replaced}; checked to load the "
                "trained weights strictly and to reproduce the engine's outputs",
            )
    return NetworkDefinition(
        fallback,
        False,
        f"built by {FALLBACK_TARGET} (needs `pip install dpkfc-med`): {why}, so plain MONAI "
        "cannot rebuild the trained (private-compatible) architecture",
    )


def _bundle_network(
    model: dict[str, Any], task: dict[str, Any], state_dict: dict[str, Any] | None
) -> NetworkDefinition:
    """The ``network_def`` of a run trained from a MONAI bundle (``dpkfc-med bundle train``).

    The bundle's own definition with the BatchNorm fix expressed as MONAI's ``norm`` argument,
    checked like a registry network; there is no fallback builder for a bundle's network.
    """
    from monai.bundle import ConfigParser

    from dpkfc_med.models import make_private_compatible

    definition = copy.deepcopy(model["kwargs"]["network_def"])
    raw = ConfigParser({"net": copy.deepcopy(definition)}).get_parsed_content("net")
    reference, fixes = make_private_compatible(raw, norm=model.get("norm", "group"))
    if state_dict is not None:
        reference.load_state_dict(state_dict, strict=True)
    norm, why = _norm_argument(fixes)
    if norm is not None and why is None:
        definition["norm"] = norm
    if why is None:
        shape = (int(task["in_channels"]), *(int(s) for s in task["spatial_shape"]))
        why = _same_network(definition, reference, shape)
    if why is not None:
        return NetworkDefinition(
            {
                "_target_": BUNDLE_FALLBACK_TARGET,
                "network_def": model["kwargs"]["network_def"],
                "norm": model.get("norm", "group"),
            },
            False,
            f"built by {BUNDLE_FALLBACK_TARGET} (needs `pip install dpkfc-med`): the training "
            f"bundle's network_def with the engine's private-compatibility fixes ({why})",
        )
    return NetworkDefinition(
        definition,
        True,
        f"the training bundle's network_def ({definition['_target_']})"
        + (" with BatchNorm replaced through its norm argument" if norm else "")
        + "; checked to load the trained weights strictly and to reproduce the engine's outputs",
    )
