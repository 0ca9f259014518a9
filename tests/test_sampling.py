"""Samplers and DPDataLoader: inclusion statistics, group structure, truncation, empty batches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from privacy_engine.training.data_loader import DPDataLoader
from privacy_engine.training.sampling import CyclicPoissonBatchSampler, PoissonBatchSampler


class IndexDataset(Dataset):
    """Example i is (i, a (2, 3) float tensor filled with i): batches show which indices were drawn."""

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return torch.tensor(index), torch.full((2, 3), float(index))


class NestedDataset(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return {"image": torch.ones(3, 5), "meta": (torch.tensor([index, index]), f"name{index}"), "label": index}


def generator(seed):
    return torch.Generator().manual_seed(seed)


def indicator(batches, num_samples):
    """(steps, num_samples) 0/1 matrix of inclusions."""
    matrix = np.zeros((len(batches), num_samples))
    for step, batch in enumerate(batches):
        matrix[step, batch] = 1
    return matrix


def test_poisson_includes_each_example_independently_with_probability_q():
    num_samples, q, steps = 50, 0.2, 3000
    batches = list(PoissonBatchSampler(num_samples, q, steps=steps, generator=generator(0)))
    inclusions = indicator(batches, num_samples)
    assert all(len(set(batch)) == len(batch) for batch in batches)
    # Per-example counts are Binomial(steps, q): within 5 standard deviations.
    sd = math.sqrt(steps * q * (1 - q))
    assert np.all(np.abs(inclusions.sum(axis=0) - steps * q) < 5 * sd)
    # Batch sizes are Binomial(N, q): mean Nq, variance Nq(1-q).
    sizes = inclusions.sum(axis=1)
    assert sizes.mean() == pytest.approx(num_samples * q, abs=5 * math.sqrt(num_samples * q * (1 - q) / steps))
    assert sizes.var() == pytest.approx(num_samples * q * (1 - q), rel=5 * math.sqrt(2 / steps))
    # Pairs are included together with probability q^2 (independence across examples).
    together = (inclusions.T @ inclusions)[np.triu_indices(num_samples, 1)] / steps
    assert together.mean() == pytest.approx(q**2, abs=5 * math.sqrt(q**2 / (steps * together.size)) + 1e-3)


def test_poisson_default_steps_and_full_rate():
    assert len(PoissonBatchSampler(100, 0.03)) == 33
    assert list(PoissonBatchSampler(4, 1.0, steps=2)) == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_poisson_is_reproducible_with_a_seeded_generator():
    a = list(PoissonBatchSampler(30, 0.3, steps=5, generator=generator(3)))
    b = list(PoissonBatchSampler(30, 0.3, steps=5, generator=generator(3)))
    c = list(PoissonBatchSampler(30, 0.3, steps=5, generator=generator(4)))
    assert a == b
    assert a != c


@pytest.mark.parametrize("public_size", [True, False])
def test_every_example_is_in_exactly_one_group(public_size):
    sampler = CyclicPoissonBatchSampler(103, 4, 0.5, public_size=public_size, generator=generator(1))
    members = torch.cat(sampler.groups).tolist()
    assert sorted(members) == list(range(103))
    if public_size:
        sizes = [g.numel() for g in sampler.groups]
        assert max(sizes) - min(sizes) <= 1


def test_private_size_groups_are_independent_uniform_assignments():
    num_samples, num_groups = 3000, 3
    sampler = CyclicPoissonBatchSampler(num_samples, num_groups, 0.5, public_size=False, generator=generator(2))
    sizes = np.array([g.numel() for g in sampler.groups])
    sd = math.sqrt(num_samples * (1 / num_groups) * (1 - 1 / num_groups))
    assert np.all(np.abs(sizes - num_samples / num_groups) < 5 * sd)


def test_cyclic_step_t_draws_only_from_group_t_mod_b_across_epochs():
    sampler = CyclicPoissonBatchSampler(40, 3, 0.6, steps=7, generator=generator(5))
    groups = [set(g.tolist()) for g in sampler.groups]
    step = 0
    for _ in range(3):  # 7 steps per epoch is not a multiple of 3: the cycle must carry over
        for batch in sampler:
            assert set(batch) <= groups[step % 3]
            step += 1
    assert step == 21


def test_cyclic_participations_are_at_least_b_steps_apart():
    num_groups = 4
    sampler = CyclicPoissonBatchSampler(20, num_groups, 1.0, steps=6, generator=generator(6))
    last_seen = {}
    for step, batch in enumerate(batch for _ in range(4) for batch in sampler):
        for index in batch:
            if index in last_seen:
                assert step - last_seen[index] >= num_groups
            last_seen[index] = step
    assert len(last_seen) == 20


def test_cyclic_inclusion_probability_within_group():
    num_samples, num_groups, p, rounds = 30, 3, 0.25, 2000
    sampler = CyclicPoissonBatchSampler(num_samples, num_groups, p, steps=num_groups * rounds, generator=generator(7))
    counts = indicator(list(sampler), num_samples).sum(axis=0)
    sd = math.sqrt(rounds * p * (1 - p))
    assert np.all(np.abs(counts - rounds * p) < 5 * sd)


def test_truncated_batches_have_fixed_size_and_a_correct_padding_mask():
    max_batch_size = 3
    sampler = CyclicPoissonBatchSampler(24, 2, 0.4, steps=400, max_batch_size=max_batch_size, generator=generator(8))
    groups = [g.tolist() for g in sampler.groups]
    truncated = padded = 0
    for step in range(400):
        indices, mask = sampler._draw(step)
        group = groups[step % 2]
        assert len(indices) == max_batch_size and mask.shape == (max_batch_size,) and mask.dtype == torch.bool
        real = [i for i, pad in zip(indices, mask.tolist()) if not pad]
        padding = [i for i, pad in zip(indices, mask.tolist()) if pad]
        assert set(real) <= set(group) and len(set(real)) == len(real)
        assert padding == [group[0]] * (max_batch_size - len(real))
        assert not mask[: len(real)].any() and mask[len(real) :].all()
        truncated += len(real) == max_batch_size
        padded += len(padding) > 0
    assert truncated > 0 and padded > 0  # both regimes were exercised


def test_truncation_keeps_a_uniform_subset():
    # Group of 6, all drawn (p = 1), keep 2: each member kept with probability 1/3.
    sampler = CyclicPoissonBatchSampler(6, 1, 1.0, steps=3000, max_batch_size=2, generator=generator(9))
    counts = indicator(list(sampler), 6).sum(axis=0)
    sd = math.sqrt(3000 * (1 / 3) * (2 / 3))
    assert np.all(np.abs(counts - 1000) < 5 * sd)


@pytest.mark.parametrize("kwargs", [{"sample_rate": 0.0}, {"sample_rate": 1.5}, {"sample_rate": float("nan")}])
def test_sample_rate_outside_unit_interval_raises(kwargs):
    with pytest.raises(ValueError, match="sample_rate"):
        PoissonBatchSampler(10, **kwargs)
    with pytest.raises(ValueError, match="sample_rate"):
        CyclicPoissonBatchSampler(10, 2, **kwargs)


def test_sampler_argument_errors():
    with pytest.raises(ValueError, match="num_groups"):
        CyclicPoissonBatchSampler(5, 6, 0.5)
    with pytest.raises(ValueError, match="max_batch_size"):
        CyclicPoissonBatchSampler(5, 1, 0.5, max_batch_size=0)
    with pytest.raises(ValueError, match="steps"):
        PoissonBatchSampler(5, 0.5, steps=0)
    with pytest.raises(ValueError, match="num_samples"):
        PoissonBatchSampler(0, 0.5)


def test_empty_poisson_batch_yields_zero_length_tensors_of_the_right_trailing_shape():
    loader = DataLoader(IndexDataset(5), batch_size=1)
    # q = 0.2 over 5 examples: ~1/3 of the 60 batches are empty.
    dp_loader = DPDataLoader.from_data_loader(loader, generator=generator(10), steps=60)
    sizes = []
    for index, data in dp_loader:
        assert data.shape[1:] == (2, 3) and data.dtype == torch.float32 and index.dtype == torch.int64
        assert index.shape == (data.shape[0],)
        assert torch.equal(data, index.float()[:, None, None].expand(-1, 2, 3))
        sizes.append(len(index))
    assert 0 in sizes and max(sizes) > 0


def test_empty_batch_of_nested_structures():
    loader = DataLoader(NestedDataset(), batch_size=1)
    dp_loader = DPDataLoader.from_data_loader(loader, generator=generator(0), steps=1)
    empty = dp_loader.collate_fn([])
    assert empty["image"].shape == (0, 3, 5)
    assert empty["meta"][0].shape == (0, 2)
    assert list(empty["meta"][1]) == []
    assert empty["label"].shape == (0,)
    full = dp_loader.collate_fn([NestedDataset()[1], NestedDataset()[2]])
    assert full["image"].shape == (2, 3, 5) and list(full["meta"][1]) == ["name1", "name2"]


def test_dp_loader_keeps_the_loader_settings_and_exposes_sampling_attributes():
    def collate(batch):
        return torch.stack([b[1] for b in batch])

    def init(worker_id):
        return None

    loader = DataLoader(IndexDataset(40), batch_size=8, collate_fn=collate, worker_init_fn=init, pin_memory=False, shuffle=True)
    dp_loader = DPDataLoader.from_data_loader(loader, generator=generator(0))
    assert dp_loader.dataset is loader.dataset
    assert dp_loader.collate_fn.collate_fn is collate and dp_loader.worker_init_fn is init
    assert dp_loader.sample_rate == pytest.approx(0.2)
    assert dp_loader.expected_batch_size == pytest.approx(8)
    assert dp_loader.num_groups == 1 and dp_loader.max_batch_size is None
    assert len(dp_loader) == 5
    assert all(batch.shape[1:] == (2, 3) for batch in dp_loader)
    assert dp_loader.padding_mask is None

    cyclic = DPDataLoader.cyclic(loader, 4, max_batch_size=12, generator=generator(0))
    assert cyclic.sample_rate == pytest.approx(8 * 4 / 40)
    assert cyclic.expected_batch_size == pytest.approx(8)
    assert cyclic.num_groups == 4 and cyclic.max_batch_size == 12
    assert len(cyclic) == 4


def test_padding_masks_stay_in_step_with_batches_with_worker_processes():
    loader = DataLoader(IndexDataset(30), batch_size=4, num_workers=2)
    dp_loader = DPDataLoader.cyclic(loader, 3, max_batch_size=5, generator=generator(11), steps=9)
    twin = CyclicPoissonBatchSampler(30, 3, 0.4, steps=9, max_batch_size=5, generator=generator(11))
    expected = [twin._draw(step) for step in range(9)]
    seen = 0
    for (index, _), (indices, mask) in zip(dp_loader, expected):
        assert index.tolist() == indices
        assert torch.equal(dp_loader.padding_mask, mask)
        seen += 1
    assert seen == 9
    assert any(mask.any() for _, mask in expected)


def test_cycle_resumes_after_the_last_yielded_batch_when_an_epoch_is_cut_short():
    loader = DataLoader(IndexDataset(30), batch_size=2, num_workers=2)
    dp_loader = DPDataLoader.cyclic(loader, 3, generator=generator(12), steps=12)
    groups = [set(g.tolist()) for g in dp_loader.batch_sampler.groups]
    for consumed, _ in enumerate(dp_loader, start=1):
        if consumed == 2:
            break  # workers have prefetched beyond step 2 by now
    steps_seen = 2
    for index, _ in dp_loader:
        assert set(index.tolist()) <= groups[steps_seen % 3]
        steps_seen += 1
    assert steps_seen == 14
    assert dp_loader.state_dict()["next_step"] == 14


def test_iterable_dataset_is_rejected_naming_the_dataset():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(TypeError, match=r"loader\.dataset \(Stream\).*sized"):
        DPDataLoader.from_data_loader(DataLoader(Stream(), batch_size=2))


def test_loader_errors():
    dataset = TensorDataset(torch.zeros(10, 2))
    with pytest.raises(ValueError, match="batch_size"):
        DPDataLoader.from_data_loader(DataLoader(dataset, batch_size=None))
    with pytest.raises(ValueError, match="batch_size"):
        DPDataLoader.from_data_loader(DataLoader(dataset, batch_size=11))
    with pytest.raises(ValueError, match="num_groups"):
        DPDataLoader.cyclic(DataLoader(dataset, batch_size=1), 11)
    with pytest.raises(ValueError, match="num_groups"):
        DPDataLoader.cyclic(DataLoader(dataset, batch_size=4), 3)
