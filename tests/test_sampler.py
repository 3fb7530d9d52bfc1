"""data.sampler.EpochSampler: a reproducible order per epoch, resumable at any index, refusing a checkpoint whose
order was for other data, and striding the epoch's order over processes."""

from __future__ import annotations

import math

import pytest

from data.sampler import EpochSampler
from runtime.errors import UserError


def test_each_epoch_is_a_permutation_drawn_from_seed_plus_epoch():
    s = EpochSampler(range(50), seed=3)
    first = list(s)
    assert sorted(first) == list(range(50))
    s.set_epoch(1)
    second = list(s)
    assert sorted(second) == list(range(50)) and second != first
    assert list(EpochSampler(range(50), seed=3)) == first  # same seed and epoch: same order
    other = EpochSampler(range(50), seed=2)
    other.set_epoch(1)
    assert list(other) == EpochSampler(range(50), seed=3).order(0)  # the order follows seed + epoch only


def test_resumes_at_the_index_it_stopped_at_then_starts_the_next_epoch_whole():
    s = EpochSampler(range(40), seed=1)
    s.set_epoch(2)
    it = iter(s)
    seen = [next(it) for _ in range(13)]
    state = s.state_dict()
    assert state == {"epoch": 2, "yielded": 13, "seed": 1, "num_samples": 40}
    resumed = EpochSampler(range(40), seed=1)
    resumed.load_state_dict(state)
    assert seen + list(resumed) == s.order(2)
    resumed.set_epoch(3)
    assert list(resumed) == s.order(3)  # the restored position applies to its own epoch only


@pytest.mark.parametrize("change", ["rows", "seed"])
def test_refuses_a_checkpoint_whose_order_was_for_other_data(change):
    s = EpochSampler(range(40), seed=1)
    state = s.state_dict()
    other = EpochSampler(range(41), seed=1) if change == "rows" else EpochSampler(range(40), seed=2)
    with pytest.raises(UserError, match=r"training order was for 40 rows per process and seed 1.*ckpt_path=null"):
        other.load_state_dict(state)


def test_length_grouped_batches_pad_less_than_random_ones():
    lengths = [(i * 37) % 101 + 1 for i in range(400)]
    grouped = EpochSampler(range(400), seed=0, lengths=lengths, batch_size=8)
    shuffled = EpochSampler(range(400), seed=0)

    def padding(order):
        batches = [order[i : i + 8] for i in range(0, len(order), 8)]
        return sum(max(lengths[j] for j in b) * len(b) - sum(lengths[j] for j in b) for b in batches)

    assert sorted(grouped.order(0)) == list(range(400))
    assert padding(grouped.order(0)) < padding(shuffled.order(0)) / 3


def test_processes_stride_one_epoch_order_and_cover_every_row():
    orders = []
    for rank in range(3):
        s = EpochSampler(range(10), seed=4)
        s.num_replicas, s.rank = 3, rank  # as DistributedSampler sets them from the process group
        s.num_samples = math.ceil(10 / 3)
        s.total_size = s.num_samples * 3
        orders.append(s.order(0))
    assert all(len(o) == 4 for o in orders)
    assert set(sum(orders, [])) == set(range(10))  # two rows repeat, as DistributedSampler pads
    whole = EpochSampler(range(10), seed=4).order(0)
    assert [orders[r][i] for i in range(3) for r in range(3)] == whole[:9]
