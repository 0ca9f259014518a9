"""Drawing the next step's noise in the background adds exactly the noise drawn in place."""

from __future__ import annotations

import copy

import pytest
import torch

from privacy_engine.noise import BandMFNoise, GaussianNoise
from privacy_engine.noise import prefetch as noise_prefetch

SHAPES = [(3, 5), (7,), (2, 2, 2)]


def step_noise(mechanism, scale=1.0, dtype=torch.float32, shapes=SHAPES):
    tensors = [torch.zeros(shape, dtype=dtype) for shape in shapes]
    mechanism.add_noise_(tensors, 1.0, scale)
    return torch.cat([t.reshape(-1) for t in tensors])


def run(mechanism, scales, **kwargs):
    return torch.stack([step_noise(mechanism, scale, **kwargs) for scale in scales])


MECHANISMS = {
    "gaussian": lambda prefetch, seed=3: GaussianNoise(seed=seed, prefetch=prefetch),
    "bandmf": lambda prefetch, seed=3: BandMFNoise([1.0, 0.6, -0.2], seed=seed, prefetch=prefetch),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", list(MECHANISMS))
def test_prefetched_noise_is_bit_for_bit_the_noise_drawn_in_place(kind, dtype):
    scales = [2.0] * 6
    expected = run(MECHANISMS[kind](False), scales, dtype=dtype)
    mechanism = MECHANISMS[kind](True)
    assert torch.equal(run(mechanism, scales, dtype=dtype), expected)
    assert mechanism._draws_ahead  # the next step's draw is under way


def test_a_draw_made_at_another_std_is_redrawn():
    scales = [1.0, 1.0, 3.0, 1.0, 0.5, 0.5]  # each change invalidates the draw made at the previous std
    assert torch.equal(
        run(GaussianNoise(seed=9, prefetch=True), scales), run(GaussianNoise(seed=9, prefetch=False), scales)
    )


def test_live_generators_move_only_when_a_step_uses_the_draw():
    mechanism = GaussianNoise(seed=1, prefetch=True)
    step_noise(mechanism)
    committed = [g.get_state() for g in mechanism._groups[0].generators]
    for ahead in mechanism._draws_ahead.values():
        ahead.wait()
    # The background draw used copies: the generators (and so state_dict) still show the committed step.
    assert all(torch.equal(g.get_state(), s) for g, s in zip(mechanism._groups[0].generators, committed))
    reference = GaussianNoise(seed=1, prefetch=False)
    step_noise(reference)
    assert all(torch.equal(a, b) for a, b in zip(mechanism.state_dict()["devices"][0]["generator_states"],
                                                 reference.state_dict()["devices"][0]["generator_states"]))  # fmt: skip
    assert torch.equal(step_noise(mechanism), step_noise(reference))


@pytest.mark.parametrize("kind", list(MECHANISMS))
def test_a_state_saved_with_a_draw_in_flight_resumes_exactly(kind):
    mechanism = MECHANISMS[kind](True)
    run(mechanism, [1.0] * 3)
    saved = copy.deepcopy(mechanism.state_dict())
    expected = run(mechanism, [1.0] * 3)
    for prefetch in (False, True):
        resumed = MECHANISMS[kind](prefetch, seed=99)
        resumed.load_state_dict(copy.deepcopy(saved))
        assert torch.equal(run(resumed, [1.0] * 3), expected)


def test_loading_an_earlier_state_drops_the_draw_made_for_the_current_one():
    mechanism = BandMFNoise([1.0, 0.5], seed=4, prefetch=True)
    run(mechanism, [1.0])
    early = copy.deepcopy(mechanism.state_dict())
    run(mechanism, [1.0] * 2)  # a draw for step 3 is under way
    mechanism.load_state_dict(early)
    reference = BandMFNoise([1.0, 0.5], seed=4, prefetch=False)
    run(reference, [1.0])
    assert torch.equal(run(mechanism, [1.0] * 2), run(reference, [1.0] * 2))


def test_a_bandmf_draw_formed_ahead_is_formed_again_when_the_history_changed():
    # Same generators, another history: the standard draw made ahead is right, its formed noise is not.
    mechanism = BandMFNoise([1.0, 0.7, 0.3], seed=5, prefetch=True)
    run(mechanism, [1.0] * 3)
    state = copy.deepcopy(mechanism.state_dict())
    state["devices"][0]["history"] = torch.full_like(state["devices"][0]["history"], 0.25)
    mechanism.load_state_dict(copy.deepcopy(state))
    assert mechanism._draws_ahead  # made before the load, from the same generator states
    reference = BandMFNoise([1.0, 0.7, 0.3], seed=5, prefetch=False)
    reference.load_state_dict(state)
    assert torch.equal(run(mechanism, [1.0] * 2), run(reference, [1.0] * 2))


@pytest.mark.parametrize("point", ["_form_noise", "_add_to_tensors"])
def test_a_failed_step_that_took_the_prefetched_draw_is_retried_with_the_same_noise(monkeypatch, point):
    mechanism = BandMFNoise([1.0, 0.5, 0.25], seed=2, prefetch=True)
    run(mechanism, [1.0] * 2)
    real = getattr(mechanism, point)

    def fails(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("injected")

    monkeypatch.setattr(mechanism, point, fails)
    with pytest.raises(RuntimeError, match="injected"):
        step_noise(mechanism)
    monkeypatch.undo()
    expected = run(BandMFNoise([1.0, 0.5, 0.25], seed=2, prefetch=False), [1.0] * 4)[2:]
    assert torch.equal(run(mechanism, [1.0] * 2), expected)


def test_a_copy_of_a_mechanism_with_a_draw_in_flight_continues_the_same_stream():
    mechanism = GaussianNoise(seed=6, prefetch=True)
    run(mechanism, [1.0] * 2)
    duplicate = copy.deepcopy(mechanism)
    assert not duplicate._draws_ahead
    assert torch.equal(run(duplicate, [1.0] * 2), run(mechanism, [1.0] * 2))


def test_a_new_layout_drops_the_draw_and_continues_the_seeded_stream():
    mechanism = GaussianNoise(seed=8, prefetch=True)
    reference = GaussianNoise(seed=8, prefetch=False)
    for noise in (mechanism, reference):
        run(noise, [1.0] * 2)
        noise.restart_layout()
    assert not mechanism._draws_ahead
    assert torch.equal(run(mechanism, [1.0] * 2, shapes=[(4,)]), run(reference, [1.0] * 2, shapes=[(4,)]))


def test_secure_mode_draws_ahead_from_copies_of_its_four_generators():
    entries = 200_000
    mechanism = GaussianNoise(secure_mode=True, prefetch=True)
    first = step_noise(mechanism, scale=2.0, shapes=[(entries,)])
    group = mechanism._groups[0]
    committed = [g.get_state() for g in group.generators]
    (ahead,) = mechanism._draws_ahead.values()
    assert ahead.wait() and len(ahead.shadows) == 4
    assert all(torch.equal(g.get_state(), s) for g, s in zip(group.generators, committed))
    drawn_to = [shadow.get_state() for shadow in ahead.shadows]
    second = step_noise(mechanism, scale=2.0, shapes=[(entries,)])
    # The generators moved on exactly as the background copies did; the draw has the mechanism's std.
    assert all(torch.equal(g.get_state(), s) for g, s in zip(group.generators, drawn_to))
    assert not torch.equal(first, second)
    assert second.std().item() == pytest.approx(2.0, rel=0.01)
    assert mechanism.state_dict()["devices"][0]["generator_states"] is None  # still no state saved


def test_automatic_prefetch_needs_a_spare_core_and_enough_entries(monkeypatch):
    large = [(noise_prefetch.MIN_PREFETCH_NUMEL,)]
    for spare, shapes, expected in ((False, large, False), (True, [(10,)], False), (True, large, True)):
        monkeypatch.setattr(noise_prefetch, "spare_core", lambda spare=spare: spare)
        mechanism = GaussianNoise(seed=0)
        step_noise(mechanism, shapes=shapes)
        assert bool(mechanism._draws_ahead) is expected, (spare, shapes)
    mechanism = GaussianNoise(seed=0, prefetch=False)
    step_noise(mechanism, shapes=large)
    assert not mechanism._draws_ahead


@pytest.mark.parametrize("prefetch", ["yes", 1, 0.5])
def test_prefetch_must_be_a_bool_or_none(prefetch):
    with pytest.raises(ValueError, match="prefetch must be True, False or None"):
        GaussianNoise(seed=0, prefetch=prefetch)
    with pytest.raises(ValueError, match="prefetch must be True, False or None"):
        BandMFNoise([1.0], seed=0, prefetch=prefetch)


def test_a_draw_is_taken_only_while_every_generator_is_in_its_start_state():
    # PendingDraw.matches compares CPU states as bytes: one draw from a generator (or a changed counter key) must
    # make it refuse, and a state equal in value (a fresh copy) must let it take the draw.
    import numpy as np

    from privacy_engine.noise import counter_stream

    generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    draw = noise_prefetch.PendingDraw(torch.empty(1), 1.0, [g.get_state() for g in generators], [], None)
    assert draw.matches(generators, 1.0)
    assert not draw.matches(generators, 2.0)
    torch.randn(1, generator=generators[1])
    assert not draw.matches(generators, 1.0)
    key = counter_stream.StreamKey(np.array([3, 4], dtype=np.uint64))
    keyed = noise_prefetch.PendingDraw(torch.empty(1), 1.0, [key.get_state()], [], None)
    assert keyed.matches([key], 1.0)
    changed = key.get_state()
    changed[0] ^= 1
    key.set_state(changed)
    assert not keyed.matches([key], 1.0)
