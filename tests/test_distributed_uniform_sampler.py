"""``DistributedUniformWithReplacementSampler`` (Opacus's distributed Poisson sampler, its keyword
arguments): each rank's batches, their sizes, determinism, and the semantics of Opacus 1.x's class.

The ranks are simulated in one process: rank and world size are read from ``torch.distributed``,
which is patched for each rank (the samplers draw without any collective)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

# Imported by its Opacus path, which stays whichever module of the engine defines the class.
from privacy_engine.opacus.utils.uniform_sampler import DistributedUniformWithReplacementSampler


def _sampler(monkeypatch, rank: int, world_size: int, **kwargs) -> DistributedUniformWithReplacementSampler:
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    return DistributedUniformWithReplacementSampler(**kwargs)


def _ranks(monkeypatch, world_size: int, **kwargs) -> list[DistributedUniformWithReplacementSampler]:
    return [_sampler(monkeypatch, rank, world_size, **kwargs) for rank in range(world_size)]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_without_a_process_group_it_asks_for_one():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedUniformWithReplacementSampler(total_size=10, sample_rate=0.5)


@pytest.mark.parametrize(("total_size", "world_size"), [(10, 1), (10, 3), (7, 4), (3, 5), (64, 8)])
def test_shards_partition_the_examples_in_opacus_balanced_sizes(monkeypatch, total_size, world_size):
    samplers = _ranks(monkeypatch, world_size, total_size=total_size, sample_rate=0.5, generator=_generator(0))
    shards = [sampler.shard.tolist() for sampler in samplers]
    assert sorted(index for shard in shards for index in shard) == list(range(total_size))  # every example on exactly one rank
    # Opacus: total_size // world_size each, the first total_size % world_size ranks one more.
    expected_sizes = [total_size // world_size + (rank < total_size % world_size) for rank in range(world_size)]
    assert [len(shard) for shard in shards] == expected_sizes


def test_each_batch_is_drawn_from_the_ranks_shard_and_no_example_is_on_two_ranks_at_once(monkeypatch):
    samplers = _ranks(monkeypatch, 3, total_size=50, sample_rate=0.3, steps=40, generator=_generator(1))
    for batches in zip(*samplers):
        for sampler, batch in zip(samplers, batches):
            assert set(batch) <= set(sampler.shard.tolist())
            assert len(set(batch)) == len(batch)  # sampling without replacement within a step
        union = [index for batch in batches for index in batch]
        assert len(union) == len(set(union))


def test_the_union_over_ranks_includes_each_example_at_the_global_rate(monkeypatch):
    q, steps, total_size = 0.2, 3000, 12
    samplers = _ranks(monkeypatch, 4, total_size=total_size, sample_rate=q, steps=steps, generator=_generator(2))
    inclusion = torch.zeros(steps, total_size)
    for sampler in samplers:
        for step, batch in enumerate(sampler):
            inclusion[step, batch] += 1
    assert inclusion.max().item() == 1
    # Each frequency: sd sqrt(q(1-q)/3000) = 0.0073; the mean local batch is q * shard size.
    assert (inclusion.mean(0) - q).abs().max().item() < 5 * 0.0074
    for sampler in samplers:
        assert sampler.expected_batch_size == pytest.approx(q * total_size)  # the global one, as the noise needs


def test_empty_local_batches_are_yielded_so_every_rank_takes_every_step(monkeypatch):
    # Opacus skips an empty local batch, so ranks could disagree on the number of steps under DDP;
    # here every rank yields every step, an empty one included.
    (sampler,) = _ranks(monkeypatch, 1, total_size=3, sample_rate=0.05, steps=200, generator=_generator(3))
    batches = list(sampler)
    assert len(batches) == len(sampler) == 200
    assert any(len(batch) == 0 for batch in batches)


def test_the_same_generator_state_gives_the_same_batches_and_the_generator_is_left_alone(monkeypatch):
    generator = _generator(4)
    state = generator.get_state()
    first = [list(_sampler(monkeypatch, rank, 2, total_size=30, sample_rate=0.3, generator=generator))
             for rank in range(2)]  # fmt: skip
    assert torch.equal(generator.get_state(), state)  # the seed is read from the state, not drawn
    again = [list(_sampler(monkeypatch, rank, 2, total_size=30, sample_rate=0.3, generator=_generator(4)))
             for rank in range(2)]  # fmt: skip
    other = [list(_sampler(monkeypatch, rank, 2, total_size=30, sample_rate=0.3, generator=_generator(5)))
             for rank in range(2)]  # fmt: skip
    assert first == again
    assert first != other
    assert first[0] != first[1]  # the ranks' streams differ even with one shared seed


def test_iterating_twice_continues_the_stream_instead_of_repeating_it(monkeypatch):
    sampler = _sampler(monkeypatch, 0, 2, total_size=40, sample_rate=0.4, steps=5, generator=_generator(6))
    assert list(sampler) != list(sampler)


@pytest.mark.parametrize("shuffle", [True, False])
def test_shuffle_arguments_are_accepted_and_change_nothing(monkeypatch, shuffle):
    plain = [list(sampler) for sampler in _ranks(monkeypatch, 2, total_size=20, sample_rate=0.5, generator=_generator(7))]
    shuffled = _ranks(monkeypatch, 2, total_size=20, sample_rate=0.5, shuffle=shuffle, shuffle_seed=3,
                      generator=_generator(7))  # fmt: skip
    assert [list(sampler) for sampler in shuffled] == plain


@pytest.mark.parametrize("steps", [1, 7])
def test_steps_sets_the_number_of_batches(monkeypatch, steps):
    sampler = _sampler(monkeypatch, 1, 2, total_size=20, sample_rate=0.3, steps=steps, generator=_generator(8))
    assert len(sampler) == steps == len(list(sampler))


@pytest.mark.parametrize("sample_rate", [0.5, 0.3, 0.1, 0.01])
def test_default_number_of_batches_is_opacus_int_of_one_over_q_where_round_agrees(monkeypatch, sample_rate):
    sampler = _sampler(monkeypatch, 0, 2, total_size=20, sample_rate=sample_rate, generator=_generator(9))
    assert len(sampler) == int(1 / sample_rate)
    assert 1 / len(sampler) >= sample_rate


@pytest.mark.parametrize("sample_rate", [0.35, 0.15])
def test_default_number_of_batches_is_opacus_int_of_one_over_q(monkeypatch, sample_rate):
    sampler = _sampler(monkeypatch, 0, 2, total_size=20, sample_rate=sample_rate, generator=_generator(9))
    assert len(sampler) == math.floor(1 / sample_rate)
