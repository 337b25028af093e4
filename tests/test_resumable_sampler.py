"""The resumable sampler deals the rest of a resumed epoch: at the saving world size exactly as the
uninterrupted epoch, at another each sample not yet taken once (padded or cut as DistributedSampler
pads or cuts an epoch), never one already taken ([Note: global sample order] in data.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from fsdp_strategy.data import ResumableDistributedSampler


def _dealt(samples: int, world: int, epoch: int, skip: int, shuffle: bool, drop_last: bool) -> list[list[int]]:
    ranks = []
    for rank in range(world):
        sampler = ResumableDistributedSampler(range(samples), world, rank, shuffle=shuffle, seed=3, drop_last=drop_last)
        sampler.set_epoch(epoch)
        sampler.resume_from(epoch, skip)
        ranks.append(list(sampler))
        assert len(ranks[-1]) == sampler.rank_length()  # what a resumed loop counts its batches from
    return ranks


def _uninterrupted(samples: int, world: int, epoch: int, shuffle: bool, drop_last: bool) -> list[list[int]]:
    ranks = []
    for rank in range(world):
        sampler = DistributedSampler(range(samples), world, rank, shuffle=shuffle, seed=3, drop_last=drop_last)
        sampler.set_epoch(epoch)
        ranks.append(list(sampler))
    return ranks


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("samples", [10, 11, 12])
def test_a_resumed_epoch_deals_each_untaken_sample_once(samples, drop_last, shuffle):
    for world in (2, 3):
        whole = _uninterrupted(samples, world, 1, shuffle, drop_last)
        assert _dealt(samples, world, 1, 0, shuffle, drop_last) == whole  # no resume: DistributedSampler's epoch
        for batches in range(1, len(whole[0]) + 1):
            skip = batches * world  # one sample per rank and batch
            rest = _dealt(samples, world, 1, skip, shuffle, drop_last)
            assert rest == [order[batches:] for order in whole], (world, skip)  # the same world: exactly the rest
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(3 + 1)).tolist() if shuffle else None
    order = order or list(range(samples))
    for old, new in ((2, 3), (3, 2)):
        for skip in range(0, samples + 1, old):
            rest = _dealt(samples, new, 1, skip, shuffle, drop_last)
            assert len({len(mine) for mine in rest}) == 1  # every rank the same count
            untaken, dealt = order[skip:], [i for round_ in zip(*rest) for i in round_]
            if drop_last:
                assert dealt == untaken[: len(untaken) - len(untaken) % new], (old, new, skip)
            else:  # each untaken sample once, then the fewest repeats from the epoch's start to even the ranks
                assert dealt[: len(untaken)] == untaken and len(dealt) - len(untaken) < new, (old, new, skip)
                assert dealt[len(untaken) :] == order[: len(dealt) - len(untaken)], (old, new, skip)
