"""The global-batch sampler: the same items per global batch on any world size, resumable, DataLoader-ready."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from batchfit import ConfigError
from batchfit.train.sampler import GlobalBatchSampler


def _global_batches(n: int, g: int, world: int, seed: int = 3) -> list[list[int]]:
    samplers = [GlobalBatchSampler(n, g, rank=r, world_size=world, seed=seed) for r in range(world)]
    per_rank = [list(s) for s in samplers]
    return [sum((per_rank[r][t] for r in range(world)), []) for t in range(len(per_rank[0]))]


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_global_batches_do_not_depend_on_the_world_size(world: int) -> None:
    assert _global_batches(103, 31, world) == _global_batches(103, 31, 1)


def test_every_item_at_most_once_per_epoch_and_shares_differ_by_one() -> None:
    batches = _global_batches(100, 30, 4)
    items = [i for b in batches for i in b]
    assert len(items) == len(set(items)) == 90  # 3 global batches; the last 10 items are dropped
    shares = [len(b) for b in (list(GlobalBatchSampler(100, 30, rank=r, world_size=4, seed=3))[0] for r in range(4))]
    assert shares == [8, 8, 7, 7]


def test_epochs_reshuffle_and_resume_continues_exactly() -> None:
    s = GlobalBatchSampler(40, 8, rank=0, world_size=1, seed=1)
    epoch0 = list(s)
    epoch1 = list(s)
    assert epoch0 != epoch1 and sorted(sum(epoch0, [])) == sorted(sum(epoch1, []))
    s = GlobalBatchSampler(40, 8, rank=0, world_size=1, seed=1)
    it = iter(s)
    seen = [next(it), next(it)]
    state = s.state_dict()
    resumed = GlobalBatchSampler(40, 8, rank=1, world_size=2, seed=1)
    resumed.load_state_dict(state)
    other = GlobalBatchSampler(40, 8, rank=0, world_size=2, seed=1)
    other.load_state_dict(state)
    rest = [a + b for a, b in zip(list(other), list(resumed))]
    assert seen + rest == epoch0


def test_a_state_from_other_data_is_refused() -> None:
    state = GlobalBatchSampler(40, 8, rank=0, world_size=1).state_dict()
    with pytest.raises(ConfigError, match="global_batch_size"):
        GlobalBatchSampler(40, 10, rank=0, world_size=1).load_state_dict(state)


class _Squares(Dataset):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i])


def test_works_as_a_dataloader_batch_sampler_with_workers() -> None:
    sampler = GlobalBatchSampler(20, 6, rank=1, world_size=2, seed=0)
    expected = [b for b in GlobalBatchSampler(20, 6, rank=1, world_size=2, seed=0)]
    loader = DataLoader(_Squares(), batch_sampler=sampler, num_workers=2, pin_memory=False)
    got = [batch[:, 0].tolist() for batch in loader]
    assert got == expected


@pytest.mark.parametrize(
    ("args", "fragment"),
    [((10, 0), "global batch"), ((10, 4, 0, 5), "ranks"), ((3, 4, 0, 1), "dataset")],
)
def test_bad_input(args, fragment: str) -> None:
    n, g, *rest = args
    kw = {"rank": rest[0], "world_size": rest[1]} if rest else {"rank": 0, "world_size": 1}
    with pytest.raises(ConfigError, match=fragment):
        GlobalBatchSampler(n, g, **kw)
