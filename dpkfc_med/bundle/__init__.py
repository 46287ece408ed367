"""MONAI bundles: train through the engine from a bundle, export a finished run as a bundle.

* :func:`train` -- the ``training`` entry of ``pipelines/*/configs/train.yaml``
  (the code path of ``dpkfc-med train``);
* :func:`export_bundle` -- ``dpkfc-med bundle export RUN_DIR OUT_DIR``;
* :func:`build_network` -- the ``network_def`` target of networks plain MONAI cannot rebuild;
* :mod:`.metadata`, :mod:`.inference` -- the generated ``metadata.json`` / ``inference.yaml``.

See ``docs/bundles.md``.
"""

from dpkfc_med.bundle.network import build_network
from dpkfc_med.bundle.training import train


def __getattr__(name: str):  # export pulls in torch/yaml/report code: import it on first use
    if name in ("BundleExportError", "export_bundle"):
        from dpkfc_med.bundle import export

        return getattr(export, name)
    raise AttributeError(f"module 'dpkfc_med.bundle' has no attribute {name!r}")


__all__ = ["BundleExportError", "build_network", "export_bundle", "train"]
