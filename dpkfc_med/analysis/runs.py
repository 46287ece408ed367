"""Released models of finished runs, public proxies, and committed benchmark results.

:func:`released_model` rebuilds the model a run released (``model.pt``) so its curvature can be
compared with the probes' after private training. :func:`public_proxy` is the probe source of
the ``dp-kfc-public`` method (images of a public archive), checked against the private training
split. :func:`benchmark_accuracy` reads the accuracy benchmark's JSON
(``dpkfc_bench/results/accuracy_*.json``) into rows of test metrics per method and epsilon.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn

__all__ = ["benchmark_accuracy", "public_proxy", "released_model"]


def released_model(run_dir: str | Path) -> nn.Module:
    """The model a finished run released, in eval mode (the run's own architecture and fixes).

    Args:
        run_dir: A finished run directory (``config.yaml`` and ``model.pt``).

    Returns:
        The network with the released parameters (the ones ``model.pt`` holds).

    Raises:
        FileNotFoundError: The directory lacks ``config.yaml`` or ``model.pt``.
    """
    from dpkfc_med.tasks.build import build_task
    from dpkfc_med.training.config import config_from_dict
    from dpkfc_med.training.setup import build_run_model

    run = Path(run_dir)
    missing = [n for n in ("config.yaml", "model.pt") if not (run / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"released_model: {run} lacks {', '.join(missing)}; pass a finished run directory "
            "(dpkfc-med train CONFIG writes it)"
        )
    cfg = config_from_dict(
        yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8")), str(run)
    )
    saved = torch.load(run / "model.pt", map_location="cpu", weights_only=False)
    model, _ = build_run_model(cfg, build_task(cfg, public_probes=False))
    model.load_state_dict(saved["model"])
    return model.eval()


def public_proxy(
    path: str | Path,
    *,
    spatial_shape: Sequence[int],
    num_classes: int,
    channels: int = 1,
    private: str | Path | None = None,
) -> Any:
    """Probes from a public MedMNIST-format archive, as the ``dp-kfc-public`` method draws them.

    Args:
        path: The public ``.npz`` (path or MedMNIST flag). A 3D archive serves a 2D task
            through the central slice of each volume along each axis.
        spatial_shape: The private task's image size (the proxy is resized to it).
        num_classes: The private task's classes (probe targets are uniform random classes).
        channels: The private task's channels.
        private: The private archive; its training split is compared with the proxy by
            content and MedMNIST flag, and an overlapping proxy is refused. ``None``: not
            checked (``describe()`` says so).

    Returns:
        A :class:`~dpkfc_med.tasks.classification.public_probes.PublicProbeSource` (a probe
        source for :func:`~dpkfc_med.analysis.probe_factors`).
    """
    from dpkfc_med.data import load_medmnist, resolve_data_path
    from dpkfc_med.tasks.classification.public_probes import PublicProbeSource

    priv = (
        None
        if private is None
        else load_medmnist(resolve_data_path(str(private)), infer_classes=True)
    )
    return PublicProbeSource(
        str(path),
        spatial_shape=tuple(int(s) for s in spatial_shape),
        channels=channels,
        num_classes=num_classes,
        task="classification",
        private=priv,
    )


def benchmark_accuracy(
    path: str | Path, methods: Sequence[str], *, metric: str = "auroc"
) -> list[dict[str, Any]]:
    """Test ``metric`` (mean and std over evaluation seeds) per method and epsilon.

    Each row uses the learning rate whose tuning run (seed 0) scored best on validation among
    the learning rates that have evaluation runs, as the benchmark chooses it.

    Args:
        path: An accuracy benchmark JSON (``dpkfc_bench/results/accuracy_*.json``).
        methods: Method names of the benchmark, e.g. ``("dp-kfc-dense", "dp-kfc-white")``.
        metric: A test metric of the runs (``"auroc"``, ``"accuracy"``,
            ``"balanced_accuracy"``).

    Returns:
        Rows ``{method, epsilon, lr, mean, std, seeds}``, in the order of ``methods``; a
        method without evaluation runs is left out.
    """
    runs = json.loads(Path(path).read_text(encoding="utf-8"))["runs"]
    rows = []
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        for eps in sorted({r["eps"] for r in mine}, key=lambda e: -1.0 if e is None else e):
            evals = [r for r in mine if r["phase"] == "eval" and r["eps"] == eps]
            tune = {
                r["lr"]: r["val"][metric]
                for r in mine
                if r["phase"] == "tune" and r["eps"] == eps and r["lr"] in {e["lr"] for e in evals}
            }
            if not tune:
                continue
            lr = max(tune, key=tune.__getitem__)
            values = [r["test"][metric] for r in evals if r["lr"] == lr]
            mean = float(np.mean(values))
            std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
            rows.append(
                {
                    "method": method,
                    "epsilon": eps,
                    "lr": lr,
                    "mean": mean,
                    "std": std,
                    "seeds": len(values),
                }
            )
    return rows
