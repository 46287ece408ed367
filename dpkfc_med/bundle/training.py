"""The ``training`` entry of the pipeline bundles: a run config trained by the engine itself.

A bundle's ``configs/train.yaml`` holds only the path of a run config (``configs/*.yaml``),
optional ``--set``-style overrides and an output directory; its ``training`` entry calls
:func:`train`, which takes exactly the code path of ``dpkfc-med train``
(:func:`~dpkfc_med.training.config.load_config` then :func:`~dpkfc_med.training.run.train`).
No setting of the run lives in the bundle.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpkfc_med.report.numbers import format_epsilon

__all__ = ["train"]


def train(
    config: str | Path,
    overrides: Sequence[str] | None = None,
    out: str | Path | None = None,
    resume: bool = False,
) -> Any:
    """Train privately from a run config, as ``dpkfc-med train CONFIG --set ... --out OUT``.

    Args:
        config: The YAML run config (see ``configs/``).
        overrides: ``KEY=VALUE`` overrides, e.g. ``["training.epochs=1"]`` (``--set``).
        out: The run directory (``--out``; default the config's ``output.dir``).
        resume: Continue the run in ``out`` within its budget (``--resume``).

    Returns:
        The :class:`~dpkfc_med.training.run.RunResult`; the run directory holds the model,
        the ledger and ``privacy_report.{json,md,html}``.

    Raises:
        ConfigError: A bad config or override (every problem named), or an existing run in
            ``out`` without ``resume``.

    Privacy guarantee:
        That of the run config's mechanism, accounted in the run's ledger; the bundle adds
        nothing and changes nothing.
    """
    from dpkfc_med.training.config import load_config
    from dpkfc_med.training.run import train as train_run

    items = [str(o) for o in (overrides or [])]
    if out is not None:
        items.append(f"output.dir={out}")
    result = train_run(load_config(config, items), resume=resume)
    eps = result.epsilon
    privacy = (
        "none (non-private training)" if eps is None else f"epsilon = {format_epsilon(eps)} (PRV)"
    )
    print(f"run: {result.run_dir} ({result.status}); privacy: {privacy}")
    print(f"report: {Path(result.run_dir) / 'privacy_report.md'}")
    return result
