"""PerSampleGradientClipper against a float64 per-example loop written out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from privacy_engine.capture import GradSampleModule
from privacy_engine.clipping import (
    ClippingConfig,
    PerSampleGradientClipper,
    parameter_groups,
)
from tests.conftest import per_example_reference

SHAPES = [(3, 4), (3,), (2, 3), (2,)]  # two "layers": (weight, bias) twice


def make_params(shapes=SHAPES, dtype=torch.float64):
    return [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]


def give_grad_samples(params, batch_size, *, seed=0, scales=None):
    """Random per-sample gradients; example i is scaled by scales[i] so norms straddle the bound."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for param in params:
        grads = torch.randn((batch_size, *param.shape), generator=generator, dtype=param.dtype)
        if scales is not None:
            grads = grads * torch.as_tensor(scales, dtype=param.dtype).view(-1, *([1] * param.dim()))
        param.grad_sample = grads.clone()
        samples.append(grads)
    return samples


def reference_clipped_sum(samples, groups, bounds, *, padding=None, rescale_by=1.0):
    """The definition: for each example, for each group, scale its slice to norm <= bound; sum."""
    batch_size = samples[0].shape[0]
    totals = [torch.zeros(s.shape[1:], dtype=torch.float64) for s in samples]
    for i in range(batch_size):
        if padding is not None and padding[i]:
            continue
        for group, bound in zip(groups, bounds):
            norm = math.sqrt(sum(float(samples[k][i].double().pow(2).sum()) for k in group))
            factor = 1.0 if norm <= bound else bound / norm
            for k in group:
                totals[k] += factor * samples[k][i].double() / rescale_by
    return totals


def grads_of(params):
    return [p.grad.detach().clone() for p in params]


def assert_all_close(actual, expected):
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.double(), e, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- the clipped sum
@settings(max_examples=15, deadline=None)
@given(batch_size=st.integers(1, 9), max_grad_norm=st.floats(0.05, 20.0), seed=st.integers(0, 2**16))
def test_flat_clipped_sum_equals_per_example_loop(batch_size, max_grad_norm, seed):
    params = make_params()
    scales = torch.logspace(-2, 1.5, batch_size).tolist()
    samples = give_grad_samples(params, batch_size, seed=seed, scales=scales)
    clipper = PerSampleGradientClipper(params, max_grad_norm)
    clipper.clip_and_accumulate()
    clipper.pre_step()
    expected = reference_clipped_sum(samples, [range(len(params))], [max_grad_norm])
    assert_all_close(grads_of(params), expected)


@settings(max_examples=15, deadline=None)
@given(batch_size=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_per_layer_clips_each_group_to_its_own_bound(batch_size, seed):
    params = make_params()
    scales = torch.logspace(-2, 1.5, batch_size).tolist()
    samples = give_grad_samples(params, batch_size, seed=seed, scales=scales)
    groups = [[params[0], params[1]], [params[2], params[3]]]
    clipper = PerSampleGradientClipper(params, [0.5, 2.0], clipping="per_layer", groups=groups)
    clipper.clip_and_accumulate()
    clipper.pre_step()
    expected = reference_clipped_sum(samples, [[0, 1], [2, 3]], [0.5, 2.0])
    assert_all_close(grads_of(params), expected)
    assert clipper.total_bound == pytest.approx(math.sqrt(0.5**2 + 2.0**2))
    assert clipper.sensitivity == clipper.total_bound


def test_per_layer_single_number_is_split_evenly_over_groups():
    params = make_params()
    clipper = PerSampleGradientClipper(params, 3.0, clipping="per_layer")  # one group per parameter
    assert clipper.bounds == pytest.approx((1.5,) * 4)
    assert clipper.total_bound == pytest.approx(3.0)


def test_grad_sample_module_end_to_end_matches_independent_reference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    inputs, targets = torch.randn(6, 5, dtype=torch.float64) * 3, torch.randint(0, 3, (6,))
    reference = per_example_reference(
        model, [inputs], lambda out, i: nn.functional.cross_entropy(out, targets[i : i + 1])
    )
    wrapped = GradSampleModule(model)
    nn.functional.cross_entropy(wrapped(inputs), targets).backward()
    params = list(model.parameters())
    clipper = PerSampleGradientClipper(params, 0.3)
    clipper.clip_and_accumulate()
    clipper.pre_step()
    names = [n for n, _ in model.named_parameters()]
    expected = reference_clipped_sum([reference[n] for n in names], [range(len(names))], [0.3])
    assert_all_close(grads_of(params), expected)


def test_micro_batches_accumulate_to_the_one_batch_sum():
    params = make_params()
    samples = give_grad_samples(params, 7, scales=torch.logspace(-1, 1, 7).tolist())
    clipper = PerSampleGradientClipper(params, 1.0)
    for start, end in ((0, 3), (3, 4), (4, 7)):
        for param, grads in zip(params, samples):
            param.grad_sample = grads[start:end].clone()
        clipper.clip_and_accumulate()
    stats = clipper.pre_step()
    assert_all_close(grads_of(params), reference_clipped_sum(samples, [range(4)], [1.0]))
    assert stats.num_examples == 7


def test_per_sample_gradients_are_freed_once_accumulated():
    params = make_params()
    give_grad_samples(params, 3)
    clipper = PerSampleGradientClipper(params, 1.0)
    clipper.clip_and_accumulate()
    assert all(p.grad_sample is None for p in params)
    assert clipper.has_accumulated


# ---------------------------------------------------------------------------- edge cases
def test_clip_norm_zero_gives_zero_sum():
    params = make_params()
    give_grad_samples(params, 4)
    clipper = PerSampleGradientClipper(params, 0.0)
    clipper.clip_and_accumulate()
    stats = clipper.pre_step()
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)
    assert stats.clipped_fraction == 1.0


def test_clip_norm_inf_gives_the_raw_sum():
    params = make_params()
    samples = give_grad_samples(params, 4, scales=[1e-3, 1.0, 1e3, 1e6])
    clipper = PerSampleGradientClipper(params, math.inf)
    clipper.clip_and_accumulate()
    stats = clipper.pre_step()
    assert_all_close(grads_of(params), [s.sum(0) for s in samples])
    assert stats.clipped_fraction == 0.0


def test_zero_gradient_example_contributes_zero_and_is_not_clipped():
    params = make_params()
    samples = give_grad_samples(params, 3, scales=[0.0, 0.0, 100.0])
    clipper = PerSampleGradientClipper(params, 1.0)
    clipper.clip_and_accumulate()
    stats = clipper.pre_step()
    assert_all_close(grads_of(params), reference_clipped_sum(samples, [range(4)], [1.0]))
    assert stats.clipped_fraction == pytest.approx(1 / 3)
    assert not any(torch.isnan(p.grad).any() for p in params)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_entries_count_as_zero_when_nan_safe(bad):
    params = make_params()
    samples = give_grad_samples(params, 4, scales=[5.0, 5.0, 0.1, 5.0])
    params[0].grad_sample[1, 0, 0] = bad
    params[3].grad_sample[2, 1] = bad
    cleaned = [s.clone() for s in samples]
    cleaned[0][1, 0, 0] = 0.0
    cleaned[3][2, 1] = 0.0
    clipper = PerSampleGradientClipper(params, 1.0)
    clipper.clip_and_accumulate()
    clipper.pre_step()
    assert_all_close(grads_of(params), reference_clipped_sum(cleaned, [range(4)], [1.0]))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_entries_drop_the_example_when_not_nan_safe(bad):
    params = make_params()
    samples = give_grad_samples(params, 4, scales=[5.0, 5.0, 0.1, 5.0])
    params[0].grad_sample[1, 0, 0] = bad
    clipper = PerSampleGradientClipper(params, 1.0, nan_safe=False)
    clipper.clip_and_accumulate()
    stats = clipper.pre_step()
    expected = reference_clipped_sum(samples, [range(4)], [1.0], padding=[False, True, False, False])
    assert_all_close(grads_of(params), expected)
    assert stats.clipped_fraction == 0.75  # two over the bound, one dropped, one (scale 0.1) under


def test_per_layer_not_nan_safe_drops_only_the_non_finite_group():
    params = make_params()
    samples = give_grad_samples(params, 2, scales=[5.0, 5.0])
    params[2].grad_sample[0, 0, 0] = math.nan
    groups = [[params[0], params[1]], [params[2], params[3]]]
    clipper = PerSampleGradientClipper(params, [1.0, 1.0], clipping="per_layer", groups=groups, nan_safe=False)
    clipper.clip_and_accumulate()
    clipper.pre_step()
    first = reference_clipped_sum(samples, [[0, 1]], [1.0])
    second = reference_clipped_sum(samples, [[2, 3]], [1.0], padding=[True, False])
    assert_all_close(grads_of(params), [first[0], first[1], second[2], second[3]])


def test_norm_overflow_drops_the_example():
    params = make_params(dtype=torch.float32)
    give_grad_samples(params, 2)
    params[0].grad_sample[0] = 3e38  # finite entries whose squares overflow float32
    clipper = PerSampleGradientClipper(params, 1.0)
    clipper.clip_and_accumulate()
    clipper.pre_step()
    total = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
    assert math.isfinite(total) and total <= 1.0 + 1e-6


def test_rescale_to_unit_norm_divides_by_the_bound():
    params = make_params()
    samples = give_grad_samples(params, 5, scales=torch.logspace(-1, 1, 5).tolist())
    clipper = PerSampleGradientClipper(params, 2.5, rescale_to_unit_norm=True)
    clipper.clip_and_accumulate()
    clipper.pre_step()
    assert clipper.sensitivity == 1.0
    assert_all_close(grads_of(params), reference_clipped_sum(samples, [range(4)], [2.5], rescale_by=2.5))


def test_per_layer_rescale_divides_by_the_total_bound():
    params = make_params()
    samples = give_grad_samples(params, 5, scales=torch.logspace(-1, 1, 5).tolist())
    groups = [[params[0], params[1]], [params[2], params[3]]]
    clipper = PerSampleGradientClipper(params, [3.0, 4.0], clipping="per_layer", groups=groups, rescale_to_unit_norm=True)
    clipper.clip_and_accumulate()
    clipper.pre_step()
    expected = reference_clipped_sum(samples, [[0, 1], [2, 3]], [3.0, 4.0], rescale_by=5.0)
    assert_all_close(grads_of(params), expected)


@pytest.mark.parametrize("max_grad_norm", [0.0, math.inf])
def test_rescale_needs_a_finite_positive_bound(max_grad_norm):
    with pytest.raises(ValueError, match="rescale_to_unit_norm"):
        PerSampleGradientClipper(make_params(), max_grad_norm, rescale_to_unit_norm=True)


def test_padding_examples_contribute_exactly_zero_and_are_not_counted():
    params = make_params()
    samples = give_grad_samples(params, 5, scales=[1.0, 100.0, 0.1, 100.0, 1.0])
    params[1].grad_sample[3] = math.nan  # padding may hold anything
    padding = torch.tensor([False, True, False, True, False])
    for nan_safe in (True, False):
        for param, grads in zip(params, samples):
            param.grad_sample = grads.clone()
        params[1].grad_sample[3] = math.nan
        clipper = PerSampleGradientClipper(params, 1.0, nan_safe=nan_safe)
        clipper.clip_and_accumulate(padding_mask=padding)
        stats = clipper.pre_step()
        assert_all_close(grads_of(params), reference_clipped_sum(samples, [range(4)], [1.0], padding=padding))
        assert stats.num_examples == 3


def test_per_user_clipping_sums_a_users_examples_before_clipping():
    params = make_params()
    samples = give_grad_samples(params, 6, scales=[0.3, 0.3, 0.3, 2.0, 0.1, 0.2])
    user_ids = torch.tensor([7, 7, 7, 2, 9, 2])
    padding = torch.tensor([False, False, False, False, False, True])
    clipper = PerSampleGradientClipper(params, 0.5)
    clipper.clip_and_accumulate(group_ids=user_ids, padding_mask=padding)
    stats = clipper.pre_step()
    # By hand: per user, the sum of its (non-padding) examples.
    users = {}
    for i, uid in enumerate(user_ids.tolist()):
        if not padding[i]:
            users.setdefault(uid, []).append(i)
    per_user = [torch.stack([sum(s[i] for i in members) for members in users.values()]) for s in samples]
    assert_all_close(grads_of(params), reference_clipped_sum(per_user, [range(4)], [0.5]))
    assert stats.num_examples == 3


def test_user_with_only_padding_examples_is_not_counted():
    params = make_params()
    give_grad_samples(params, 3)
    clipper = PerSampleGradientClipper(params, 0.5)
    clipper.clip_and_accumulate(group_ids=torch.tensor([1, 2, 2]), padding_mask=torch.tensor([True, False, False]))
    assert clipper.pre_step().num_examples == 1


def test_parameter_without_grad_sample_gets_a_zero_sum():
    params = make_params()
    samples = give_grad_samples(params, 3, scales=[3.0, 3.0, 3.0])
    params[2].grad_sample = None
    zeros = [s if k != 2 else torch.zeros_like(s) for k, s in enumerate(samples)]
    clipper = PerSampleGradientClipper(params, 1.0)
    clipper.clip_and_accumulate()
    clipper.pre_step()
    assert_all_close(grads_of(params), reference_clipped_sum(zeros, [range(4)], [1.0]))


def test_nothing_accumulated_writes_zero_gradients():
    params = make_params()
    clipper = PerSampleGradientClipper(params, 1.0)
    clipper.clip_and_accumulate()  # no grad_sample: an empty batch
    stats = clipper.pre_step()
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)
    assert (stats.num_examples, stats.mean_per_sample_norm, stats.clipped_fraction) == (0, 0.0, 0.0)


def test_mismatched_batch_sizes_raise_before_anything_changes():
    params = make_params()
    give_grad_samples(params, 3)
    params[1].grad_sample = torch.zeros(4, 3, dtype=torch.float64)
    clipper = PerSampleGradientClipper(params, 1.0)
    with pytest.raises(ValueError, match="grad_sample"):
        clipper.clip_and_accumulate()
    assert not clipper.has_accumulated and params[0].grad_sample is not None


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"padding_mask": torch.zeros(4, dtype=torch.bool)}, ValueError),
        ({"padding_mask": torch.zeros(3)}, TypeError),
        ({"group_ids": torch.zeros(3)}, TypeError),
    ],
)
def test_bad_masks_raise_before_anything_changes(kwargs, error):
    params = make_params()
    give_grad_samples(params, 3)
    clipper = PerSampleGradientClipper(params, 1.0)
    with pytest.raises(error):
        clipper.clip_and_accumulate(**kwargs)
    assert not clipper.has_accumulated and params[0].grad_sample is not None


# ---------------------------------------------------------------------------- statistics
def test_statistics_match_the_per_example_norms():
    params = make_params()
    samples = give_grad_samples(params, 6, scales=[0.1, 0.5, 1.0, 2.0, 4.0, 8.0])
    norms = [math.sqrt(sum(float(s[i].pow(2).sum()) for s in samples)) for i in range(6)]
    clipper = PerSampleGradientClipper(params, 1.5)
    clipper.clip_and_accumulate()
    stats = clipper.pre_step()
    assert stats.mean_per_sample_norm == pytest.approx(sum(norms) / 6)
    assert stats.max_per_sample_norm == pytest.approx(max(norms))
    assert stats.clipped_fraction == pytest.approx(sum(n > 1.5 for n in norms) / 6)


def test_statistics_are_those_of_the_norms_handed_over_even_if_the_caller_changes_them_later():
    params = make_params()
    clipper = PerSampleGradientClipper(params, 1.0)
    norms = torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64)
    clipper.accumulate_clipped_sums_({}, norms, padding_mask=torch.tensor([False, False, True]))
    clipper.accumulate_clipped_sums_({}, torch.tensor([4.0], dtype=torch.float64))
    norms.fill_(100.0)  # read lazily, the statistics must still be those of the calls
    saved = clipper.state_dict()["totals"]
    stats = clipper.pre_step()
    assert (stats.num_examples, stats.max_per_sample_norm, stats.clipped_fraction) == (3, 4.0, pytest.approx(2 / 3))
    assert stats.mean_per_sample_norm == pytest.approx((0.5 + 2.0 + 4.0) / 3)
    assert torch.equal(saved, stats.totals)


# ---------------------------------------------------------------------------- fast-clipping entry point
def test_accumulate_clipped_sums_matches_clip_and_accumulate():
    params = make_params()
    groups = [[params[0], params[1]], [params[2], params[3]]]
    samples = give_grad_samples(params, 5, scales=torch.logspace(-1, 1, 5).tolist())
    padding = torch.tensor([False, False, True, False, False])
    materialised = PerSampleGradientClipper(params, [1.0, 0.5], clipping="per_layer", groups=groups)
    materialised.clip_and_accumulate(padding_mask=padding)
    expected_stats = materialised.pre_step()
    expected = grads_of(params)

    # A path that only has per-sample squared norms and computes weighted sums itself.
    fast = PerSampleGradientClipper(params, [1.0, 0.5], clipping="per_layer", groups=groups)
    norms = fast.group_norms_from_squared({p: s.flatten(1).pow(2).sum(1) for p, s in zip(params, samples)})
    factors = fast.clip_factors_for_norms(norms, padding_mask=padding)
    sums = {p: torch.tensordot(factors[:, fast.group_index(p)], s, dims=1) for p, s in zip(params, samples)}
    fast.accumulate_clipped_sums_(sums, norms, padding_mask=padding)
    stats = fast.pre_step()
    assert_all_close(grads_of(params), expected)
    assert stats.as_dict() == pytest.approx(expected_stats.as_dict())


def test_accumulate_clipped_sums_rejects_wrong_shapes():
    params = make_params()
    clipper = PerSampleGradientClipper(params, 1.0)
    with pytest.raises(ValueError, match="clipped sum"):
        clipper.accumulate_clipped_sums_({params[0]: torch.zeros(4, 3)}, torch.ones(2))
    with pytest.raises(ValueError, match="per_sample_norms"):
        clipper.accumulate_clipped_sums_({}, torch.ones(2, 3))
    assert not clipper.has_accumulated


# ---------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": math.nan}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": [1.0, 2.0]}, TypeError, "per_layer"),
        ({"max_grad_norm": 1.0, "clipping": "adaptive"}, ValueError, "clipping"),
        ({"max_grad_norm": [1.0, -2.0], "clipping": "per_layer"}, ValueError, r"max_grad_norm\[1\]"),
        ({"max_grad_norm": [], "clipping": "per_layer"}, ValueError, "empty"),
        ({"max_grad_norm": 1.0, "nan_safe": 1}, TypeError, "nan_safe"),
    ],
)
def test_config_rejects_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        ClippingConfig(**kwargs)


def test_per_layer_bounds_must_match_the_groups():
    with pytest.raises(ValueError, match="one bound per group"):
        PerSampleGradientClipper(make_params(), [1.0, 1.0], clipping="per_layer")  # 4 groups


def test_groups_must_partition_the_parameters():
    params = make_params()
    with pytest.raises(ValueError, match="cover"):
        PerSampleGradientClipper(params, [1.0], clipping="per_layer", groups=[params[:2]])
    with pytest.raises(ValueError, match="repeats"):
        PerSampleGradientClipper(params, [1.0, 1.0], clipping="per_layer", groups=[params, params[:1]])


def test_parameter_groups_follow_the_modules():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)))
    params = list(model.parameters())
    layers = parameter_groups(model, params)
    assert [[id(p) for p in g] for g in layers] == [[id(p) for p in params[i : i + 2]] for i in (0, 2, 4)]
    assert len(parameter_groups(model, params, per="parameter")) == 6
    with pytest.raises(ValueError, match="not parameters of the module"):
        parameter_groups(model, [nn.Parameter(torch.zeros(1))])


def test_state_dict_round_trip_keeps_the_open_sum():
    params = make_params()
    give_grad_samples(params, 3, seed=1)
    clipper = PerSampleGradientClipper(params, 1.0)
    clipper.clip_and_accumulate()
    state = clipper.state_dict()
    clipper.pre_step()
    expected = grads_of(params)
    restored = PerSampleGradientClipper(params, 1.0)
    restored.load_state_dict(state)
    restored.pre_step()
    assert_all_close(grads_of(params), [e.double() for e in expected])
    with pytest.raises(ValueError, match="bounds"):
        PerSampleGradientClipper(params, 2.0).load_state_dict(state)
