"""Data-free pretraining: non-private steps on synthetic shape volumes before private training.

The synthetic task is "segment smooth blobs of distinct intensity": each volume is a label map
of random smooth foreground blobs (:func:`~dpkfc_med.probes.sources.shape_label_maps`) and an
image in which class ``c`` sits ``c`` random contrast steps from the background, plus power-law
texture, standardised like the private volumes' preprocessing. It is generated on the fly from
a seed and the config (patch size, voxel spacing, class count, the modality preset's exponent)
only, so pretraining reads no private data, costs no privacy, and the run's guarantee is
unchanged; the report records it as provenance of the initial weights.

Pretrained weights can be kept in a cache folder (``pretrain.cache_dir``) keyed by a hash of
everything that determines them (the initial weights and the network's structure, the
pretraining settings, the synthetic data's shape, spacing, classes and exponent, the loss, the
device type, the torch and package versions and the source of the generating code). A later
run with the same key (another method, epsilon or learning rate on the same seed) loads them
instead of pretraining again; the weights are bitwise those it would have computed. The cache
holds no private data.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

import dpkfc_med
from dpkfc_med.probes import noise, sources
from dpkfc_med.probes.sources import shape_volumes
from dpkfc_med.tasks.base import Task
from dpkfc_med.utils import atomic_write_bytes

if TYPE_CHECKING:
    from dpkfc_med.training.config import RunConfig

__all__ = [
    "PRETRAIN_CACHE",
    "PretrainSpec",
    "pretrain",
    "pretrain_cache_key",
    "pretrain_synthetic",
    "synthetic_shapes",
]

log = logging.getLogger(__name__)


def synthetic_shapes(
    spatial_shape: Sequence[int],
    *,
    num: int,
    num_classes: int,
    spacing: Sequence[float],
    alpha: float,
    generator: torch.Generator,
    foreground: tuple[float, float] = (0.03, 0.25),
    channels: int = 1,
) -> tuple[Tensor, Tensor]:
    """``num`` synthetic image/label pairs for segmentation pretraining.

    The volumes of :func:`~dpkfc_med.probes.sources.shape_volumes` in float32: one label map,
    each of the ``channels`` image channels with its own contrast and texture (a multi-modal
    scan's channels show the same anatomy differently).

    Returns:
        ``(images [num, C, *S] float32, labels [num, *S] int64)``; every volume holds every
        foreground class only by chance, background always.
    """
    images, labels = shape_volumes(
        spatial_shape,
        num=num,
        channels=channels,
        num_classes=num_classes,
        spacing=spacing,
        alpha=alpha,
        generator=generator,
        foreground=foreground,
    )
    return images.float(), labels


@dataclass(frozen=True)
class PretrainSpec:
    """What data-free pretraining runs (all from the config).

    Attributes:
        steps: optimizer steps (0 = no pretraining).
        batch_size: synthetic volumes per step.
        lr: Adam learning rate.
        seed: seed of the synthetic data (step ``t`` draws with ``seed + t``).
    """

    steps: int
    batch_size: int
    lr: float
    seed: int

    def describe(
        self, spatial_shape: Sequence[int], alpha: float, seconds: float
    ) -> dict[str, Any]:
        """Provenance record for the privacy report."""
        return {
            "data": "synthetic shape volumes generated from the config (no private or public "
            "data; no privacy cost)",
            "steps": self.steps,
            "batch_size": self.batch_size,
            "optimizer": "adam",
            "lr": self.lr,
            "seed": self.seed,
            "spatial_shape": list(spatial_shape),
            "texture_alpha": alpha,
            "seconds": round(seconds, 1),
        }


def pretrain_cache_key(
    model: nn.Module,
    spec: PretrainSpec,
    *,
    loss_id: str,
    spatial_shape: Sequence[int],
    num_classes: int,
    spacing: Sequence[float],
    alpha: float,
    device: torch.device,
) -> str:
    """Hex SHA-256 of everything that determines the weights :func:`pretrain_synthetic` returns.

    Args:
        model: the network before pretraining (its structure and every state tensor count).
        spec: the pretraining settings.
        loss_id: a name that identifies the training loss's code and settings.
        spatial_shape: synthetic volume shape ``(D, H, W)``.
        num_classes: ``K`` including the background.
        spacing: voxel spacing per axis (mm).
        alpha: texture exponent.
        device: where pretraining runs (CPU and GPU kernels round differently).
    """
    h = hashlib.sha256()
    meta = {
        "format": 1,
        "spec": asdict(spec),
        "loss": loss_id,
        "spatial_shape": [int(s) for s in spatial_shape],
        "num_classes": int(num_classes),
        "spacing": [float(s) for s in spacing],
        "alpha": float(alpha),
        "device": torch.device(device).type,
        "torch": torch.__version__,
        "dpkfc_med": dpkfc_med.__version__,
        # the code that draws the volumes and trains: an edited checkout gets new keys
        "code": _code_digest(),
        "model": repr(model),
    }
    h.update(json.dumps(meta, sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _code_digest() -> str:
    """SHA-256 of the source of the modules that determine the pretrained weights."""
    import inspect
    import sys

    h = hashlib.sha256()
    for module in (sys.modules[__name__], sources, noise):
        try:
            h.update(inspect.getsource(module).encode())
        except (OSError, TypeError):  # installed without sources: the version names the code
            h.update(module.__name__.encode())
    return h.hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (POSIX), so parallel runs pretrain a key once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no advisory locks: parallel runs may both pretrain (still correct)
        yield
        return
    with open(path, "a", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def pretrain_synthetic(
    model: nn.Module,
    spec: PretrainSpec,
    *,
    loss: Callable[[Tensor, Tensor], Tensor],
    spatial_shape: Sequence[int],
    num_classes: int,
    spacing: Sequence[float],
    alpha: float,
    device: torch.device,
    cache_dir: str | Path | None = None,
    loss_id: str | None = None,
    channels: int = 1,
    progress: bool = False,
) -> dict[str, Any]:
    """Train ``model`` in place on :func:`synthetic_shapes` batches; returns the provenance.

    Deterministic for a given ``spec`` and initial model (the data come from seeded CPU
    generators). The model is left in training mode.

    Args:
        model: the network, trained in place.
        spec: the pretraining settings.
        loss: batch-mean training loss ``loss(logits [N, K, *S], labels [N, *S])``.
        spatial_shape: synthetic volume shape.
        num_classes: ``K`` including the background.
        spacing: voxel spacing per axis (mm).
        alpha: texture exponent (the modality preset's).
        device: device of the model.
        cache_dir: folder of cached pretrained weights (None: no cache). A hit loads the
            weights of :func:`pretrain_cache_key` instead of training; a miss trains and
            stores them.
        loss_id: identifies ``loss`` in the cache key (required with ``cache_dir``).
        channels: image channels of the synthetic volumes: the network's input channels
            (the cache key already holds them through the network's structure).
        progress: show a progress bar over the steps (console).
    """

    def draw(step: int) -> tuple[Tensor, Tensor]:
        return synthetic_shapes(
            spatial_shape,
            channels=channels,
            num=spec.batch_size,
            num_classes=num_classes,
            spacing=spacing,
            alpha=alpha,
            generator=torch.Generator().manual_seed(spec.seed + step),
        )

    if cache_dir is None:
        return _pretrain(model, spec, loss, draw, spatial_shape, alpha, device, progress)
    if not loss_id:
        raise ValueError("pretrain_synthetic: cache_dir needs a loss_id naming the loss")
    key = pretrain_cache_key(
        model,
        spec,
        loss_id=loss_id,
        spatial_shape=spatial_shape,
        num_classes=num_classes,
        spacing=spacing,
        alpha=alpha,
        device=device,
    )
    folder = Path(cache_dir)
    path = folder / f"{key}.pt"
    with _locked(folder / f"{key}.lock"):
        if path.is_file():
            saved = torch.load(path, map_location="cpu", weights_only=True)
            model.load_state_dict(saved["state_dict"])
            model.train()
            log.info("data-free pretraining: weights loaded from the cache (%s)", path)
            return {**saved["record"], "cache": {"key": key, "reused": True}}
        record = _pretrain(model, spec, loss, draw, spatial_shape, alpha, device, progress)
        buf = io.BytesIO()
        state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
        torch.save({"state_dict": state, "record": record}, buf)
        atomic_write_bytes(path, buf.getvalue())
    return {**record, "cache": {"key": key, "reused": False}}


def _pretrain(
    model: nn.Module,
    spec: PretrainSpec,
    loss: Callable[[Tensor, Tensor], Tensor],
    draw: Callable[[int], tuple[Tensor, Tensor]],
    spatial_shape: Sequence[int],
    alpha: float,
    device: torch.device,
    progress: bool = False,
) -> dict[str, Any]:
    """The pretraining steps themselves; ``draw(t)`` is step ``t``'s synthetic batch."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
    model.train()
    last = float("nan")
    bar = tqdm(
        total=spec.steps,
        desc="data-free pretraining (synthetic shapes, no data)",
        unit="step",
        leave=False,
        disable=not progress,
    )
    for step in range(spec.steps):
        x, y = draw(step)
        opt.zero_grad(set_to_none=True)
        out = loss(model(x.to(device)), y.to(device))
        out.backward()
        opt.step()
        last = float(out.detach())
        bar.update()
        bar.set_postfix(loss=f"{last:.3f}", refresh=False)
    bar.close()
    seconds = time.perf_counter() - t0
    log.info(
        "data-free pretraining: %d steps on synthetic shapes, last loss %.3f, %.1f s",
        spec.steps,
        last,
        seconds,
    )
    record = spec.describe(spatial_shape, alpha, seconds)
    record["final_loss"] = last
    return record


PRETRAIN_CACHE = ".pretrain_cache"  # pretrain.cache_dir: auto, beside the run directory


def pretrain(cfg: RunConfig, task: Task, model: nn.Module, device: torch.device) -> dict[str, Any]:
    """Data-free pretraining on synthetic shapes (config only; see :mod:`.pretrain`)."""
    from dpkfc_med.probes.presets import get_preset

    p = cfg.pretrain
    alpha = (
        cfg.probes.alpha if cfg.probes.alpha is not None else get_preset(cfg.probes.preset).alpha
    )
    return pretrain_synthetic(
        model,
        PretrainSpec(steps=p.steps, batch_size=p.batch_size, lr=p.lr, seed=p.seed),
        loss=task.loss,
        spatial_shape=task.spatial_shape,
        num_classes=task.num_classes,
        spacing=task.spacing or (1.0,) * len(task.spatial_shape),
        alpha=alpha,
        device=device,
        cache_dir=(cfg.run_dir().parent / PRETRAIN_CACHE if p.cache_dir == "auto" else p.cache_dir),
        loss_id=f"{type(task).__module__}.{type(task).__qualname__}.loss",
        channels=task.in_channels,
        progress=cfg.training.progress,
    )
