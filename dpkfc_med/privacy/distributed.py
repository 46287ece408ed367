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
* **One mechanism.** Before the first step, :func:`check_mechanism_on_every_rank` compares
  every rank's mechanism (method, ``C``, ``sigma``, ``q``, ``N``, delta, accountant, clipping,
  precision, the unit, a digest of the network and its initial parameters, the planned steps)
  and stops the run on every rank if any field differs: the accountant's figures hold only if
  every rank clips to the ``C`` and samples at the ``q`` rank 0 writes in the ledger (a rank
  clipping to ``10 C`` would let one unit move the noisy sum by far more than ``C``).
* **The same units in the same order.** Ownership is by position, so the shards partition the
  units only if every rank holds them in the same order: with the same ``N`` in another order a
  unit can sit at an even position on one rank and an odd one on the other, be drawn by both
  and move the noisy sum by ``2 C``. :func:`check_units_on_every_rank` compares a digest of
  every rank's unit ids, in order (:func:`unit_ids_digest`), before the first step.
* **Preconditioner.** Probes are data-free and the released parameters are the same on every
  rank, so every rank builds the same preconditioner; :func:`check_same_on_every_rank` checks
  its fingerprint after each refresh.
* **Ledger.** Only rank 0 keeps a ledger file; the accounting is that of one process with
  ``N`` units.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import Sampler, Subset

from dpkfc_med.privacy.rng import secure_uniform

__all__ = [
    "MechanismMismatchError",
    "ShardedPoissonSampler",
    "World",
    "all_reduce_sum",
    "check_mechanism_on_every_rank",
    "check_same_on_every_rank",
    "check_units_on_every_rank",
    "mechanism_differences",
    "module_digests",
    "unit_ids",
    "unit_ids_digest",
]


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


class MechanismMismatchError(ValueError):
    """The ranks of one run would run different private mechanisms (a user error: configs)."""


def _plain(value: object) -> object:
    """``value`` as plain, comparable data (enums by value, tuples as lists)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


_MISSING = object()


def _same(a: object, b: object) -> bool:
    if a is _MISSING or b is _MISSING:
        return a is b
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def mechanism_differences(per_rank: Sequence[Mapping[str, object]]) -> list[str]:
    """Every field on which a rank's mechanism differs from rank 0's, one line per value.

    Args:
        per_rank: each rank's fields, in rank order (as :func:`check_mechanism_on_every_rank`
            gathers them).

    Returns:
        Lines like ``"rank 1 has max_grad_norm=10.0 where rank 0 has 1.0"`` (ranks that agree
        with each other are named together), empty when every rank agrees.
    """
    if not per_rank:
        return []
    first = per_rank[0]
    keys = list(first) + [k for m in per_rank[1:] for k in m if k not in first]
    keys = list(dict.fromkeys(keys))
    lines = []
    for key in keys:
        ref = first.get(key, _MISSING)
        groups: list[tuple[object, list[int]]] = []  # differing value -> its ranks
        for rank, fields in enumerate(per_rank[1:], start=1):
            value = fields.get(key, _MISSING)
            if _same(value, ref):
                continue
            for seen, ranks in groups:
                if _same(seen, value):
                    ranks.append(rank)
                    break
            else:
                groups.append((value, [rank]))
        for value, ranks in groups:
            who = (
                f"rank {ranks[0]} has"
                if len(ranks) == 1
                else ("ranks " + ", ".join(map(str, ranks)) + " have")
            )
            has = "no " + key if value is _MISSING else f"{key}={value!r}"
            want = "none" if ref is _MISSING else repr(ref)
            lines.append(f"{who} {has} where rank 0 has {want}")
    return lines


def check_mechanism_on_every_rank(fields: Mapping[str, object]) -> None:
    """Stop the run on every rank unless every rank runs the mechanism described by ``fields``.

    Every rank calls this once, before the first step, with the same field names (method,
    ``max_grad_norm``, ``noise_multiplier``, ``sample_rate``, units, delta, accountant,
    clipping, precision, the unit, :func:`module_digests`, planned steps...). The fields are
    gathered on every rank (``all_gather_object``), so every rank reaches the same verdict and
    all of them raise together: none is left waiting at a later collective. A single process
    returns at once.

    Privacy guarantee:
        Rank 0's ledger accounts for one mechanism; this check makes that mechanism the one
        every rank runs. A rank with a larger ``C`` (or a higher ``q``, or less noise on
        rank 0) would let one unit move the released sum by more than the accounted ``C``.

    Raises:
        MechanismMismatchError: naming every differing field, its values and its ranks, e.g.
            ``rank 1 has max_grad_norm=10.0 where rank 0 has 1.0``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = {str(k): _plain(v) for k, v in fields.items()}
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    lines = mechanism_differences(per_rank)
    if lines:
        raise MechanismMismatchError(
            "the processes of this run would not run the same private mechanism (rank 0's "
            "ledger accounts for rank 0's):\n  "
            + "\n  ".join(lines)
            + "\nevery process must run the same config (same file, overrides, seed, data and "
            "code); no step was taken"
        )


def module_digests(module: nn.Module) -> dict[str, str]:
    """SHA-256 digests of ``module``'s architecture and of its parameters and buffers.

    Returns:
        ``{"architecture": ..., "initial_parameters": ...}`` (hex, first 16 characters): the
        architecture from the module tree (``repr``) and every tensor's name, dtype and shape;
        the parameters from their bytes as well.
    """
    arch = hashlib.sha256(repr(module).encode())
    params = hashlib.sha256()
    for name, t in module.state_dict().items():
        head = f"{name}:{t.dtype}:{list(t.shape)};".encode()
        arch.update(head)
        params.update(head)
        data = t.detach().to("cpu").contiguous().reshape(-1)
        params.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return {"architecture": arch.hexdigest()[:16], "initial_parameters": params.hexdigest()[:16]}


def _record_case_ids(dataset: Any) -> object:
    records = getattr(dataset, "records", None)
    if not isinstance(records, Sequence):
        return None
    ok = all(isinstance(r, Mapping) and "case_id" in r for r in records)
    return [r["case_id"] for r in records] if ok else None


_ID_SOURCES: tuple[tuple[str, Callable[[Any], object]], ...] = (
    ("ids", lambda d: getattr(d, "ids", None)),  # a MONAI bundle's units (bundle/zoo_task.py)
    ("names", lambda d: getattr(d, "names", None)),  # UnitImageDataset (data/units.py)
    ("case_ids", lambda d: getattr(d, "case_ids", None)),  # a dataset that lists its cases
    ("records[i]['case_id']", _record_case_ids),  # VolumeDataset (data/volumes.py)
)
"""Where a training set lists its unit ids in item order, tried in this order."""


def _listed(value: object, n: int) -> list[str] | None:
    """``value`` as ``n`` ids, or ``None`` if it is not a list of one id per item."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        return None
    ids = [str(v) for v in value]
    return ids if len(ids) == n else None


def unit_ids(dataset: Any) -> tuple[list[str], str] | None:
    """The unit id of every item of ``dataset``, in item order, and where they were read.

    A :class:`~torch.utils.data.Subset` maps its ``indices`` through its dataset's ids;
    otherwise the first source of :data:`_ID_SOURCES` that lists exactly ``len(dataset)`` ids
    counts: ``ids``, ``names``, ``case_ids``, or the ``case_id`` of every entry of
    ``records``.

    Returns:
        ``(ids, source)`` (e.g. ``(["p01", "p02"], "names")``), or ``None`` for a dataset that
        names no ids (its items are the units, e.g. MedMNIST images).
    """
    if isinstance(dataset, Subset):
        inner = unit_ids(dataset.dataset)
        if inner is None:
            return None
        return [inner[0][int(i)] for i in dataset.indices], f"{inner[1]} through Subset.indices"
    n = len(dataset)
    for source, read in _ID_SOURCES:
        ids = _listed(read(dataset), n)
        if ids is not None:
            return ids, source
    return None


def _tensor_bytes(h: Any, name: str, t: Tensor) -> None:
    h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
    data = t.detach().to("cpu").contiguous().reshape(-1)
    h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")


def unit_ids_digest(dataset: Any) -> tuple[str, str]:
    """A digest of ``dataset``'s units in item order, and what it was computed from.

    Returns:
        ``(digest, source)``: the first 16 hex characters of a SHA-256 of the number of items
        and every unit id in order (:func:`unit_ids`), and the ids' source in words. A dataset
        that names no ids falls back to what is known of it: the number of items, its type and
        the bytes of its in-memory tensors in item order (``images`` and ``labels`` of a
        MedMNIST split, ``tensors`` of a ``TensorDataset``, also through a ``Subset``). That
        catches another order of in-memory images; a dataset with neither ids nor tensors is
        compared by its length and type only, which cannot see another order.

    Privacy:
        The ids are private (patient ids); the digest only travels between the ranks of one
        run and into an error message on the custodian's console, never into the ledger or a
        report.
    """
    h = hashlib.sha256()
    n = len(dataset)
    found = unit_ids(dataset)
    if found is not None:
        ids, source = found
        h.update(json.dumps({"n": n, "ids": ids}).encode())
        return h.hexdigest()[:16], f"{n} unit ids from {source}"
    # No ids: the items themselves are the units (e.g. MedMNIST images). Digest what is known
    # without reading items (which may load files or run random transforms): the length, the
    # type and the in-memory tensors, in item order.
    h.update(f"n={n};".encode())
    base, indices = dataset, None
    if isinstance(dataset, Subset):
        base, indices = dataset.dataset, torch.as_tensor(list(dataset.indices), dtype=torch.long)
    h.update(type(base).__name__.encode())
    known = [(a, getattr(base, a, None)) for a in ("images", "labels")]
    known += [(f"tensors[{i}]", t) for i, t in enumerate(getattr(base, "tensors", ()))]
    tensors = [(a, t) for a, t in known if isinstance(t, Tensor) and len(t) == len(base)]
    for name, t in tensors:
        _tensor_bytes(h, name, t if indices is None else t[indices])
    what = " and ".join(a for a, _ in tensors) or "nothing else (no ids, no tensors)"
    return h.hexdigest()[:16], f"no unit ids: {n} items, {type(base).__name__}, {what}"


def check_units_on_every_rank(dataset: Any) -> None:
    """Stop the run on every rank unless every rank holds the same units in the same order.

    Every rank calls this once, before the first step, with its training set. The digests
    (:func:`unit_ids_digest`) are gathered on every rank, so all of them reach the same verdict
    and raise together. A single process returns at once.

    Privacy guarantee:
        Unit ``i`` belongs to rank ``i mod world_size`` *in each rank's own order*; only with
        one order do the shards partition the units, so that each unit is drawn at most once
        per step (by one rank) and moves the noisy sum by at most ``C``.

    Raises:
        MechanismMismatchError: naming every rank whose digest differs from rank 0's, both
            digests, what each was computed from, and the fix.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = unit_ids_digest(dataset)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    ref, ref_source = per_rank[0]
    lines = [
        f"rank {rank}'s training units have digest {digest} ({source}) where rank 0's have "
        f"{ref} ({ref_source})"
        for rank, (digest, source) in enumerate(per_rank)
        if digest != ref
    ]
    if lines:
        raise MechanismMismatchError(
            "the processes of this run do not hold the same training units in the same order, "
            "so a unit could be drawn by two ranks in one step (2 C, beyond what rank 0's "
            "ledger accounts for):\n  "
            + "\n  ".join(lines)
            + "\nevery process must read the same data in the same order: the same data.path "
            "contents and data.unit_ids file on every machine (compare them with sha256sum), "
            "the same config, overrides and training.seed; no step was taken"
        )
