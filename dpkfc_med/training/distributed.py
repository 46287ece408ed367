"""One private run over several processes: ``dpkfc-med train CONFIG --nproc N`` or ``torchrun``.

Every rank trains the same configuration on the whole training set; the engine
(:mod:`dpkfc_med.privacy.distributed`) shards the Poisson sampling, clips on each rank and adds
one noise draw per step on rank 0, so every rank holds the same released parameters. Each rank
loads its data and, before the first step, compares a digest of its unit ids in order with
every other rank's (:func:`~dpkfc_med.privacy.distributed.check_units_on_every_rank`): the
shards are by position, so ranks holding the units in different orders could draw one unit
twice in a step. Rank 0
writes the run directory (model, ledger, report); the other ranks work in a temporary
directory that is removed when they finish (on ``--resume`` it starts as a copy of rank 0's
run directory, so every rank resumes from the same checkpoint). The processes meet on
loopback (``--nproc``) or wherever ``torchrun`` points them; gloo on CPU, NCCL on GPU with one
GPU per rank.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import socket
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dpkfc_med.privacy.distributed import World, check_units_on_every_rank
from dpkfc_med.training.config import ConfigError, RunConfig

__all__ = [
    "backend_for",
    "free_port",
    "init_from_environment",
    "train_distributed",
    "train_on_this_rank",
]

TIMEOUT = datetime.timedelta(minutes=10)
"""How long a rank waits for the others at a collective before the run stops with an error."""


def backend_for(device: str) -> str:
    """``"nccl"`` for CUDA training, ``"gloo"`` otherwise."""
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def _use_device(cfg: RunConfig, rank: int) -> None:
    if backend_for(cfg.training.device) == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())


def init_from_environment(cfg: RunConfig) -> bool:
    """Join the process group ``torchrun`` describes (``WORLD_SIZE`` > 1); False if none."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return dist.is_initialized()
    _use_device(cfg, int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))))
    dist.init_process_group(backend_for(cfg.training.device), timeout=TIMEOUT)
    return True


def _rank_config(cfg: RunConfig, world: World, resume: bool) -> tuple[RunConfig, Path | None]:
    """Rank 0 keeps ``cfg``; the others get a temporary run directory (rank 0's on resume)."""
    if not world.is_main:
        tmp = Path(tempfile.mkdtemp(prefix=f"dpkfc_rank{world.rank}_"))
        own = tmp / cfg.run_dir().name
        if resume and cfg.run_dir().is_dir():
            shutil.copytree(cfg.run_dir(), own)
        rank_cfg = replace(
            cfg,
            output=replace(cfg.output, dir=str(own)),
            training=replace(cfg.training, progress=False),
            # rank 0 alone tracks the run (its streams would be written once per rank)
            tracking=replace(cfg.tracking, backend="none", uri=None, custodian_uri=None),
        )
        dist.barrier()  # rank 0 touches nothing before every copy is made
        return rank_cfg, tmp
    dist.barrier()
    return cfg, None


def train_on_this_rank(cfg: RunConfig, *, resume: bool = False, **kwargs: Any) -> Any:
    """:func:`~dpkfc_med.training.run.train` as one rank of an initialised process group.

    The rank's task (``kwargs["task"]``, else built from ``cfg`` and ``data_path``) is loaded
    here and its training units compared with every rank's before ``train`` starts.

    Raises:
        MechanismMismatchError: on every rank, when the ranks' training units differ in ids or
            order (both digests and the fix named).
    """
    from dpkfc_med.tasks.build import build_task
    from dpkfc_med.training.run import train

    world = World.current()
    own, tmp = _rank_config(cfg, world, resume)
    try:
        task = kwargs.pop("task", None)
        task = build_task(own, kwargs.get("data_path")) if task is None else task
        check_units_on_every_rank(task.train_set)
        return train(own, resume=resume, task=task, **kwargs)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def free_port() -> int:
    """A free TCP port on loopback (for the processes of one run to meet on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, nproc: int, port: int, cfg: RunConfig, resume: bool, out: str) -> None:
    if cfg.training.threads is None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    _use_device(cfg, rank)
    dist.init_process_group(
        backend_for(cfg.training.device),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=nproc,
        timeout=TIMEOUT,
    )
    try:
        result = train_on_this_rank(cfg, resume=resume)
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(result))
    except (ValueError, FileNotFoundError, KeyError) as err:
        # a user error (config, data, plan): every rank meets it; the parent reports rank 0's
        Path(out).with_name(f"error_rank{rank}.txt").write_text(str(err), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def train_distributed(cfg: RunConfig, nproc: int, *, resume: bool = False) -> Any:
    """Train ``cfg`` over ``nproc`` local processes (loopback) and return rank 0's result.

    Raises:
        ConfigError: ``nproc`` < 2, or more CUDA processes than GPUs.
        ValueError: the run refused its input (rank 0's message: config, data or plan).
        RuntimeError: a rank failed otherwise (its error is included).
    """
    if nproc < 2:
        raise ConfigError([f"--nproc {nproc}: use 2 or more processes (1 is plain training)"])
    if backend_for(cfg.training.device) == "nccl" and nproc > torch.cuda.device_count():
        raise ConfigError(
            [
                f"--nproc {nproc}: {torch.cuda.device_count()} GPU(s) visible; NCCL needs one "
                "GPU per process (lower --nproc or use --device cpu)"
            ]
        )
    with tempfile.TemporaryDirectory(prefix="dpkfc_nproc_") as d:
        out = Path(d) / "result.pkl"
        try:
            mp.start_processes(
                _rank_main,
                args=(nproc, free_port(), cfg, resume, str(out)),
                nprocs=nproc,
                start_method="spawn",
            )
        except mp.ProcessRaisedException as err:
            raise RuntimeError(f"a training process failed:\n{err}") from None
        except mp.ProcessExitedException as err:
            raise RuntimeError(f"a training process died: {err}") from None
        error = out.with_name("error_rank0.txt")
        if error.exists():
            raise ValueError(error.read_text(encoding="utf-8"))
        return pickle.loads(out.read_bytes())
