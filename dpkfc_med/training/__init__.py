"""Training and evaluation loops, metrics and checkpoints.

``train`` and ``load_config`` (the command line's pipeline, ``train(load_config(path))``) are
importable from here; they load on first use, so importing a submodule stays cheap.
"""

from typing import Any

__all__ = ["load_config", "train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from dpkfc_med.training.run import train

        return train
    if name == "load_config":
        from dpkfc_med.training.config import load_config

        return load_config
    raise AttributeError(f"module 'dpkfc_med.training' has no attribute {name!r}")
