"""The Poisson loader the engine trains from, and the check of the loader it replaces.

Privacy guarantee:
    Every privacy unit is drawn independently with probability ``q = 1 / len(data_loader)``
    at every step (Opacus' sampler, the OS CSPRNG in secure mode, or each rank's own units
    over several processes), the sampling the accountant models; a loader whose own sampling
    the accountant cannot model is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from opacus.data_loader import DPDataLoader
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch.utils.data import DataLoader

from dpkfc_med.privacy.distributed import ShardedPoissonSampler, World
from dpkfc_med.privacy.rng import SecurePoissonSampler

__all__ = ["check_loader_sampling", "poisson_loader"]


def check_loader_sampling(data_loader: DataLoader) -> None:
    """Refuse a loader whose sampling the accountant cannot model.

    The engine replaces the loader's sampling by Poisson sampling of units at rate
    ``1 / len(data_loader)``. A loader built with its own ``sampler`` or ``batch_sampler``
    (``WeightedRandomSampler``, a class-balanced or custom sampler, a subset sampler) says the
    user wants other sampling: silently replacing it would train on data the user did not
    intend, keeping it would break the accountant (Opacus issue #813). Plain sequential or
    shuffled loaders are accepted.
    """
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

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
    first = dataset[0]
    # (x, y) tuples get Opacus' empty-batch collate; a MONAI unit (a list of sample dicts, e.g.
    # RandCropByPosNegLabeld's crops) has no tensor shape to copy, so its collate takes [] itself
    if isinstance(first, (tuple, list)) and not any(isinstance(x, (dict, list)) for x in first):
        dp = DPDataLoader.from_data_loader(data_loader, generator=generator)
        if not secure and not sharded:
            return dp
        collate = dp.collate_fn
    else:  # dict items (MONAI style): the caller's collate must handle an empty list
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
    )
    loader.sample_rate = sample_rate  # type: ignore[attr-defined]
    return loader
