"""Private training over several processes (``torch.distributed``): one mechanism, one noise draw.

With a process group initialised (``torch.distributed.init_process_group``, gloo on CPU or
NCCL on GPU, e.g. under ``torchrun``), :meth:`~dpkfc_med.privacy.PrivacyEngine.make_private`
runs the same mechanism as one process, spread over the ranks:

* **Sampling.** Every rank is given the whole training set; unit ``i`` belongs to rank
  ``i mod world_size``, and each rank draws each of its units independently with the accounted
  rate ``q`` (:class:`ShardedPoissonSampler`). The union of the ranks' batches is therefore a
  Poisson sample of all ``N`` units at rate ``q``, exactly what the accountant assumes. Every
  rank yields every step, empty or not, so the ranks stay in step and an empty draw is still a
  noisy step (Opacus' own distributed sampler skips empty local batches).
* **Clipping** is per unit on each rank (a unit lives on one rank), in the preconditioned
  coordinates.
* **Noise.** Rank 0 adds the one ``N(0, sigma^2 C^2)`` draw to its clipped sum, the other
  ranks add nothing, and one all-reduce sums them (as Opacus' ``DistributedDPOptimizer``):
  every rank holds the same noisy sum, divided by the *global* expected batch ``q N``. In
  secure mode the draw comes from OS entropy on rank 0; without a seed the other ranks'
  generators are never used for noise.
* **Preconditioner.** Probes are data-free and the released parameters are the same on every
  rank, so every rank builds the same preconditioner; :func:`check_same_on_every_rank` checks
  its fingerprint after each refresh.
* **Ledger.** Only rank 0 keeps a ledger file; the accounting is that of one process with
  ``N`` units.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import Sampler

from dpkfc_med.privacy.rng import secure_uniform

__all__ = ["ShardedPoissonSampler", "World", "all_reduce_sum", "check_same_on_every_rank"]


@dataclass(frozen=True)
class World:
    """This process's place among the training processes.

    Attributes:
        rank: 0 for the process that draws the noise and writes the ledger.
        size: number of processes (1 without a process group).
        backend: the process group's backend (``"gloo"``, ``"nccl"``) or ``None``.
    """

    rank: int = 0
    size: int = 1
    backend: str | None = None

    @classmethod
    def current(cls) -> World:
        """The initialised default process group, or a single process."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))
        return cls()

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.size > 1


class ShardedPoissonSampler(Sampler[list[int]]):
    """Poisson sampling of all ``num_samples`` units, each unit drawn on the rank that owns it.

    Unit ``i`` is owned by rank ``i mod world_size``; each step, every unit of this rank's shard
    enters the batch independently with probability ``sample_rate``. ``steps`` batches per epoch
    (default ``int(1 / sample_rate)``, as in the single-process sampler), empty ones included.

    Args:
        num_samples: units in the whole training set (every rank passes the same).
        sample_rate: the accounted rate ``q``.
        world: this process's :class:`World`.
        generator: torch generator of the draws (ignored when ``secure``).
        secure: draw from the OS CSPRNG.
        steps: batches per epoch.
    """

    def __init__(
        self,
        *,
        num_samples: int,
        sample_rate: float,
        world: World,
        generator: torch.Generator | None = None,
        secure: bool = False,
        steps: int | None = None,
    ) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples={num_samples}: the training set is empty")
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.world = world
        self.generator = generator
        self.secure = secure
        self.steps = steps if steps is not None else int(1 / sample_rate)
        self.shard = torch.arange(world.rank, num_samples, world.size)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        n = len(self.shard)
        for _ in range(self.steps):
            u = secure_uniform(n) if self.secure else torch.rand(n, generator=self.generator)
            yield self.shard[u < self.sample_rate].tolist()


def all_reduce_sum(tensors: Sequence[Tensor]) -> None:
    """Sum ``tensors`` over all ranks in place, in one flat all-reduce."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def check_same_on_every_rank(value: float, what: str, *, rel: float = 1e-6) -> None:
    """Raise unless ``value`` agrees on every rank (to ``rel``), naming ``what`` differs.

    Raises:
        RuntimeError: The ranks disagree (e.g. their preconditioners were built from
            different parameters or probes).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    t = torch.tensor([value, -value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    high, low = float(t[0]), -float(t[1])
    if not math.isclose(high, low, rel_tol=rel, abs_tol=1e-12):
        raise RuntimeError(
            f"{what} differs between ranks ({low!r} .. {high!r}); every rank must build it "
            "from the same probes and released parameters (same config, seed and code)"
        )
