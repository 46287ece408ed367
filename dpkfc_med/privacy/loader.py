"""The Poisson loader the engine trains from, and the check of the loader it replaces.

Privacy guarantee:
    Every privacy unit is drawn independently with probability ``q = 1 / len(data_loader)``
    at every step (Opacus' sampler, the OS CSPRNG in secure mode, or each rank's own units
    over several processes), the sampling the accountant models; a loader whose own sampling
    the accountant cannot model is refused. The loader's look at an item's structure (for the
    collate of an empty batch) uses the dataset's ``peek`` where it has one, so it never uses up
    a unit's draw of its random transforms (:func:`first_item`).
"""

from __future__ import annotations

from typing import Any

import torch
from opacus.data_loader import dtype_safe, shape_safe, wrap_collate_with_empty
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from dpkfc_med.privacy.distributed import ShardedPoissonSampler, World
from dpkfc_med.privacy.rng import SecurePoissonSampler

__all__ = ["check_loader_sampling", "first_item", "poisson_loader"]


def first_item(dataset: Any) -> Any:
    """Item 0 of ``dataset``, as a look at its structure that uses up no unit's draw.

    A dataset whose units draw their random transforms from per-unit streams counted per draw
    (:class:`~dpkfc_med.data.units.UnitDraws`) defines ``peek(index)``: the item drawn from a
    stream no training draw uses, counting nothing. Calling ``dataset[0]`` there would advance
    the draw count of the unit that sorts first, so its crops would depend on whether another
    unit sorts before it. Other datasets are indexed as usual.
    """
    peek = getattr(dataset, "peek", None)
    return peek(0) if callable(peek) else dataset[0]


def check_loader_sampling(data_loader: DataLoader) -> None:
    """Refuse a loader whose sampling the accountant cannot model.

    The engine replaces the loader's sampling by Poisson sampling of units at rate
    ``1 / len(data_loader)``. A loader built with its own ``sampler`` or ``batch_sampler``
    (``WeightedRandomSampler``, a class-balanced or custom sampler, a subset sampler) says the
    user wants other sampling: silently replacing it would train on data the user did not
    intend, keeping it would break the accountant (Opacus issue #813). Plain sequential or
    shuffled loaders are accepted.
    """
    sampler = getattr(data_loader, "sampler", None)
    batch_sampler = getattr(data_loader, "batch_sampler", None)
    plain_sampler = type(sampler) in (SequentialSampler, RandomSampler)
    if isinstance(sampler, RandomSampler) and (
        sampler.replacement or sampler._num_samples is not None
    ):
        plain_sampler = False
    plain_batches = batch_sampler is None or type(batch_sampler) is BatchSampler
    if plain_sampler and plain_batches:
        return
    culprit = sampler if not plain_sampler else batch_sampler
    raise ValueError(
        f"data_loader uses {type(culprit).__name__}: private training samples every unit "
        "independently with probability q (Poisson sampling), the only sampling the "
        "accountant models; a weighted, class-balanced, subset or custom sampler would make the "
        "reported epsilon wrong. Pass a plain DataLoader(dataset, batch_size=B) (B = expected "
        "batch size); to rebalance classes, weight the loss instead of the sampler"
    )


def poisson_loader(
    data_loader: DataLoader,
    *,
    generator: torch.Generator | None,
    secure: bool,
    world: World | None = None,
) -> DataLoader:
    """Poisson-sampled loader with the expected batch size of ``data_loader``.

    Over several processes (``world``) each rank draws the units it owns
    (:class:`~dpkfc_med.privacy.distributed.ShardedPoissonSampler`) at the same rate.
    """
    check_loader_sampling(data_loader)
    dataset = data_loader.dataset
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        raise ValueError("the training split is empty; private training needs at least one unit")
    sample_rate = 1 / len(data_loader)
    sharded = world is not None and world.distributed
    first = first_item(dataset)
    if isinstance(first, (tuple, list)) and not any(isinstance(x, (dict, list)) for x in first):
        # (x, y) tuples: Opacus' empty-batch collate, its shapes from the look above (Opacus'
        # own DPDataLoader would index dataset[0] itself, twice)
        collate = wrap_collate_with_empty(
            collate_fn=data_loader.collate_fn or default_collate,
            sample_empty_shapes=[(0, *shape_safe(x)) for x in first],
            dtypes=[dtype_safe(x) for x in first],
        )
    else:  # a MONAI unit (a list of sample dicts, e.g. RandCropByPosNegLabeld's crops) or a
        # dict item has no tensor shape to copy: the caller's collate must take [] itself
        collate = data_loader.collate_fn
    sampler: Any
    if sharded:
        assert world is not None
        sampler = ShardedPoissonSampler(
            num_samples=n, sample_rate=sample_rate, world=world, generator=generator, secure=secure
        )
    elif secure:
        sampler = SecurePoissonSampler(num_samples=n, sample_rate=sample_rate)
    else:
        sampler = UniformWithReplacementSampler(
            num_samples=n, sample_rate=sample_rate, generator=generator
        )
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=data_loader.num_workers,
        pin_memory=data_loader.pin_memory,
        generator=generator,  # the workers' base seed, as Opacus' DPDataLoader passes it
    )
    loader.sample_rate = sample_rate  # type: ignore[attr-defined]
    return loader
