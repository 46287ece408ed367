"""What the ``dpkfc-med`` console shows of third-party libraries: only what a user can act on.

MONAI's DICOM reader announces, each time a ``LoadImage`` is built, that its GPU decoder plugin
(nvImageCodec) is not available; on a machine without CUDA nothing can be done about it, so the
command line drops those two messages there (on a GPU machine they stay: installing
nvImageCodec speeds DICOM decoding up). Opacus configures the root logger when it is imported
(``logging.basicConfig`` in ``opacus.utils.module_utils``), so every library's log line that
also has a handler of its own (MONAI's ``StatsHandler``) printed twice; the command line takes
that handler off again (warnings of loggers without a handler still print, through Python's
last-resort handler). Nothing else is filtered.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_third_party"]

NVIMGCODEC_LOG = "nvImageCodec is not available"
NVIMGCODEC_WARNING = "NvImgCodecPydicomReader: nvImageCodec decoder plugin did not register"


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_third_party() -> None:
    """Drop third-party console messages a user cannot act on (see the module docstring)."""
    import opacus.utils.module_utils  # noqa: F401  (its basicConfig runs now, not mid-run)
    import torch

    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler:  # basicConfig's, not a user's file handler
            root.removeHandler(handler)
    if torch.cuda.is_available():
        return
    logger = logging.getLogger("monai.data.nvimgcodec_pydicom_plugin")
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage(NVIMGCODEC_LOG))
    warnings.filterwarnings("ignore", message=NVIMGCODEC_WARNING, category=UserWarning)
