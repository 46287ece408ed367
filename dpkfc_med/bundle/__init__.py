"""MONAI bundles: train a bundle privately, export a finished run as a bundle.

* :func:`train_bundle` -- ``dpkfc-med bundle train BUNDLE_DIR``: a bundle in the MONAI Model
  Zoo layout (``pipelines/*`` or the user's own) trained through the private engine;
* :func:`export_bundle` -- ``dpkfc-med bundle export RUN_DIR OUT_DIR``;
* :func:`build_network` -- the ``network_def`` target of networks plain MONAI cannot rebuild;
* :mod:`.datalists` -- the train / val / test data lists of a folder or ``.npz`` for a
  bundle config (the split of a run config of the same data);
* :mod:`.metadata`, :mod:`.inference` -- the generated ``metadata.json`` / ``inference.yaml``.

See ``docs/bundles.md``.
"""

from typing import Any

from dpkfc_med.bundle.network import build_network


def __getattr__(name: str) -> Any:  # export and training pull in torch/MONAI: import on use
    if name in ("BundleExportError", "export_bundle"):
        from dpkfc_med.bundle import export

        return getattr(export, name)
    if name == "train_bundle":
        from dpkfc_med.bundle import zoo

        return zoo.train_bundle
    if name == "datalists":  # `from dpkfc_med.bundle import datalists` in a bundle's imports
        import importlib

        return importlib.import_module("dpkfc_med.bundle.datalists")
    raise AttributeError(f"module 'dpkfc_med.bundle' has no attribute {name!r}")


__all__ = ["BundleExportError", "build_network", "export_bundle", "train_bundle"]
