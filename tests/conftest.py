"""Shared fixtures: tiny 2D/3D nets, a deterministic probe source, thread limits, and every
test's own process state (seeds, locale, threads, logging, environment, paths)."""

from __future__ import annotations

import contextlib
import locale
import logging
import os
import random
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

# Bundle exports keep their data tag under a custodian key (models/pretrained.py): the tests'
# key lives in a temporary folder, never in the user's ~/.config.
os.environ.setdefault(
    "DPKFC_MED_CUSTODIAN_KEY", os.path.join(tempfile.mkdtemp(prefix="dpkfc_key_"), "custodian.key")
)

# pytest-xdist runs two workers (pyproject addopts): one thread each, so they share the two
# cores instead of oversubscribing them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))

SHARED_DATA = os.environ.get(
    "DPKFC_MED_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
)


def _package_loggers() -> list[logging.Logger]:
    """``dpkfc_med`` and its children (a run points them at its ``train.log``)."""
    names = [n for n in logging.Logger.manager.loggerDict if n.split(".")[0] == "dpkfc_med"]
    return [logging.getLogger("dpkfc_med"), *map(logging.getLogger, names)]


_FRESH_LOGGER: dict[str, Any] = {
    "handlers": [],
    "filters": [],
    "level": logging.NOTSET,
    "propagate": True,
    "disabled": False,
}
"""How the package leaves its loggers (it adds no handler: a run adds its train.log's)."""


def _restore_logger(logger: logging.Logger, state: dict[str, Any]) -> None:
    for handler in list(logger.handlers):
        if handler not in state["handlers"]:
            logger.removeHandler(handler)
            if isinstance(handler, logging.FileHandler):  # a run's train.log, in a tmp folder
                handler.close()
    for handler in state["handlers"]:
        if handler not in logger.handlers:
            logger.addHandler(handler)
    logger.filters[:] = state["filters"]
    logger.setLevel(state["level"])
    logger.propagate, logger.disabled = state["propagate"], state["disabled"]


def _restore_root_logger(level: int, handlers: list[logging.Handler]) -> None:
    """The root's level; handlers a test added, except pytest's own (its capture per phase)."""
    root = logging.getLogger()
    root.setLevel(level)
    for handler in list(root.handlers):
        if handler not in handlers and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)
            if isinstance(handler, logging.FileHandler):
                handler.close()


def _restore_environ(saved: dict[str, str]) -> None:
    for key in set(saved) | set(os.environ):
        if key == "PYTEST_CURRENT_TEST":  # pytest's own, per test phase
            continue
        if key not in saved:
            del os.environ[key]
        elif os.environ.get(key) != saved[key]:
            os.environ[key] = saved[key]


# The state of a fresh process (after the thread limit above): each test ends there again,
# also after a module- or session-scoped fixture that changed it before the test began.
_FRESH_LOCALE = locale.setlocale(locale.LC_ALL)
_FRESH_THREADS = torch.get_num_threads()
_FRESH_DTYPE = torch.get_default_dtype()


@contextlib.contextmanager
def restored_process_state() -> Iterator[None]:
    """Seed every generator, and leave the process as a fresh one (or as found) on exit.

    Locale, threads, default dtype and the package's loggers return to a fresh process's;
    working directory, ``sys.path``, environment, grad mode and the root logger to what they
    were on entry.
    """
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    cwd, path, environ = os.getcwd(), list(sys.path), dict(os.environ)
    grad, disable = torch.is_grad_enabled(), logging.root.manager.disable
    root_level, root_handlers = logging.getLogger().level, list(logging.getLogger().handlers)
    try:
        yield
    finally:
        if locale.setlocale(locale.LC_ALL) != _FRESH_LOCALE:
            locale.setlocale(locale.LC_ALL, _FRESH_LOCALE)
        if os.getcwd() != cwd:
            os.chdir(cwd)
        if sys.path != path:
            sys.path[:] = path
        _restore_environ(environ)
        if torch.get_num_threads() != _FRESH_THREADS:
            torch.set_num_threads(_FRESH_THREADS)
        torch.set_default_dtype(_FRESH_DTYPE)
        torch.set_grad_enabled(grad)
        logging.disable(disable)
        _restore_root_logger(root_level, root_handlers)
        for logger in _package_loggers():
            _restore_logger(logger, _FRESH_LOGGER)


@pytest.fixture(autouse=True)
def _own_process_state() -> Iterator[None]:
    """Every test starts from the same seeds and leaves the process as it found it.

    Run in one process, a test would otherwise see what earlier ones left: a training run
    leaves the ``dpkfc_med`` log writing to its ``train.log`` with ``propagate=False`` (an
    open file in its tmp folder, which every later test's log lines go to) and may set
    ``training.threads``; SimpleITK's DICOM
    writer (GDCM) sets the C locale, under which text read without an explicit encoding is
    ASCII; ``monai.bundle run`` puts a bundle folder on ``sys.path``.
    """
    with restored_process_state():
        yield


class GaussianProbes:
    """Minimal probe source for engine tests (real probe generators are tested separately)."""

    def __init__(self, shape: tuple[int, ...], num_classes: int = 2) -> None:
        self.shape, self.num_classes = shape, num_classes

    def sample(self, num, *, seed, model=None, device=None, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(num, *self.shape, generator=g).to(device=device, dtype=dtype)
        y = torch.randint(0, self.num_classes, (num,), generator=g).to(device)
        return x, y

    def describe(self):
        return {"kind": "gaussian-test"}


def per_sample_ce(outputs, targets):
    return F.cross_entropy(outputs, targets, reduction="none")


def tiny_cnn_2d(num_classes: int = 3) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Conv2d(4, 6, 3, padding=1, bias=False),
        nn.GroupNorm(2, 6),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, num_classes),
    )


def tiny_cnn_3d(num_classes: int = 2) -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(1, 3, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Conv3d(3, 4, 2, stride=2, bias=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 1 * 2 * 2, num_classes),
    )


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def summed_clipped(popt, backward, units=None) -> torch.Tensor:
    """Sum of transformed, per-unit clipped gradients before noise (the DP sensitivity target).

    ``backward()`` runs the forward/backward pass of one batch; ``units`` are its unit ids.
    """
    popt.zero_grad()
    backward()
    popt.set_unit_ids(units)
    for p in popt.params:
        p.summed_grad = None
    popt.clip_and_accumulate()
    out = torch.cat([p.summed_grad.flatten() for p in popt.params])
    popt.zero_grad()
    return out
