"""The counter-keyed noise stream ("counter-v1", privacy_engine.noise.counter_stream): its numbers, its
statistics, its independence of the thread count, and how it is versioned against the serial stream.

Statistical checks use bounds with a stated false-alarm rate per check (each is a fixed-seed draw, so a
check that passes once passes always; the rates say how unlikely a correct stream is to fail a new seed).
"""

from __future__ import annotations

import contextlib
import copy
import math
import pickle
import time

import numpy as np
import pytest
import torch
from scipy import stats

from privacy_engine.noise import BandMFNoise, GaussianNoise
from privacy_engine.noise import counter_stream as cs
from privacy_engine.noise.secure_random import _MT_WORDS, _MT_WORDS_OFFSET

COUNTER = cs.STREAM_COUNTER
SHAPES = [(3, 5), (7,), (2, 2, 2)]
# 5 standard errors: a two-sided false alarm of 5.7e-7 per check for a correct Gaussian stream.
Z = 5.0


def _steps(mechanism, count, shapes=SHAPES, **kwargs):
    out = []
    for _ in range(count):
        tensors = [torch.zeros(shape) for shape in shapes]
        mechanism.add_noise_(tensors, 1.0, 1.0, **kwargs)
        out.append(torch.cat([t.reshape(-1) for t in tensors]))
    return out


class _Threads(contextlib.ContextDecorator):
    """torch.set_num_threads inside a test (a ``with`` block or the whole test as a decorator), restored after."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __enter__(self):
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.count)

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)


def _reference_chunk(key: cs.StreamKey, step: int, chunk: int, numel: int, std: float) -> torch.Tensor:
    """The specification, written out independently: chunk c of step t is torch's normal_ from an MT19937 state
    whose 624 words are Philox4x64-10's outputs under the key at counter blocks 78c+1 .. 78c+78 of (., t, 0, 0),
    each 64-bit output giving its low then its high 32 bits."""
    philox = np.random.Philox(key=key.key, counter=np.array([78 * chunk, step, 0, 0], dtype=np.uint64))
    words64 = philox.random_raw(312)
    words32 = np.stack([words64 & np.uint64(0xFFFFFFFF), words64 >> np.uint64(32)], axis=1).reshape(-1)
    state = torch.Generator().get_state().numpy().copy()
    state[_MT_WORDS_OFFSET : _MT_WORDS_OFFSET + 8 * _MT_WORDS] = words32.astype(np.uint64).view(np.uint8)
    state[8:12] = np.array([1], dtype=np.int32).view(np.uint8)  # left = 1: twist before the first output
    state[16:24] = 0
    generator = torch.Generator()
    generator.set_state(torch.from_numpy(state))
    return torch.empty(numel).normal_(0.0, std, generator=generator)



def noised_and_divided(gradients: list, noise: torch.Tensor, divide_by: float | None) -> list:
    """What ``add_noise_(gradients, ..., divide_by=...)`` must leave: each gradient plus its slice of the flat
    ``noise`` (in order), divided by ``divide_by`` when given, in the order of ops the mechanism documents."""
    expected, offset = [], 0
    for gradient in gradients:
        added = gradient + noise[offset : offset + gradient.numel()].view(gradient.shape)
        expected.append(added if divide_by is None else added / divide_by)
        offset += gradient.numel()
    return expected

def test_each_chunk_is_the_specified_philox_keyed_draw():
    key = cs.stream_key(11, 0)
    numel = 2 * cs.CHUNK_NUMEL + 1000
    out = torch.empty(numel)
    cs.draw_counter_noise(out, None, [key], 7, 1.5)
    for chunk, (start, end) in enumerate(cs.chunk_bounds(numel)):
        assert torch.equal(out[start:end], _reference_chunk(key, 7, chunk, end - start, 1.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_numbers_at_one_and_two_threads(dtype):
    key = cs.stream_key(5, 0)
    numel = 5 * cs.CHUNK_NUMEL + 17
    with _Threads(1):
        one = torch.empty(numel, dtype=dtype)
        cs.draw_counter_noise(one, None, [key], 3, 2.0)
        mechanism_one = _steps(GaussianNoise(seed=4, noise_stream=COUNTER, prefetch=False), 2, shapes=[(numel,)])
    with _Threads(2):
        two = torch.empty(numel, dtype=dtype)
        cs.draw_counter_noise(two, None, [key], 3, 2.0)
        mechanism_two = _steps(GaussianNoise(seed=4, noise_stream=COUNTER, prefetch=False), 2, shapes=[(numel,)])
    assert torch.equal(one, two)
    assert all(torch.equal(a, b) for a, b in zip(mechanism_one, mechanism_two))
    three = torch.empty(numel, dtype=dtype)
    cs.draw_counter_noise(three, None, [key], 3, 2.0, threads=3)  # any pool size, any finishing order
    assert torch.equal(one, three)


def test_mean_std_and_normality():
    std = 2.5
    out = torch.empty(2 * cs.CHUNK_NUMEL, dtype=torch.float64)
    cs.draw_counter_noise(out, None, [cs.stream_key(2024, 0)], 0, std)
    n = out.numel()
    assert abs(out.mean().item()) < Z * std / math.sqrt(n)
    # The sample variance's standard error is sigma^2 * sqrt(2 / (n - 1)).
    assert abs(out.var().item() / std**2 - 1.0) < Z * math.sqrt(2.0 / (n - 1))
    # Kolmogorov-Smirnov against N(0, std^2): false alarm 1e-6.
    assert stats.kstest(out.numpy() / std, "norm").pvalue > 1e-6


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a @ b) / (a.norm() * b.norm()))


def test_independent_across_chunks_steps_seeds_and_neighbours():
    # For independent samples of m pairs, the correlation is ~N(0, 1/m): |r| < 5 / sqrt(m) fails with
    # probability 5.7e-7 per pair (7 pairs here: 4e-6 in all).
    numel = 2 * cs.CHUNK_NUMEL
    m = cs.CHUNK_NUMEL
    draws = {}
    for seed in (1, 2):
        for step in (0, 1, 2**40):
            out = torch.empty(numel)
            cs.draw_counter_noise(out, None, [cs.stream_key(seed, 0)], step, 1.0)
            draws[seed, step] = out
    first, second = slice(0, m), slice(m, 2 * m)
    pairs = [
        (draws[1, 0][first], draws[1, 0][second]),  # two chunks of one step
        (draws[1, 0][first], draws[1, 1][first]),  # one chunk, consecutive steps
        (draws[1, 1][second], draws[1, 2**40][second]),  # far-apart steps
        (draws[1, 0][first], draws[2, 0][first]),  # two seeds
        (draws[1, 0][:-1], draws[1, 0][1:]),  # neighbouring entries (lag 1)
        (draws[1, 0][: m - 16], draws[1, 0][16:m]),  # entries 16 apart (the sampler transforms 16 at a time)
    ]
    key_a, key_b = cs.stream_key(1, 0), cs.stream_key(1, 1)
    other_device = torch.empty(m)
    cs.draw_counter_noise(other_device, None, [key_b], 0, 1.0)
    pairs.append((draws[1, 0][first], other_device))  # two devices of one run
    assert key_a != key_b
    for a, b in pairs:
        assert abs(_corr(a, b)) < Z / math.sqrt(a.numel())
    assert len({draws[key][0].item() for key in draws}) == len(draws)


def test_resume_mid_run_is_bit_identical_and_records_the_stream():
    reference = _steps(GaussianNoise(seed=9, noise_stream=COUNTER), 5)
    mechanism = GaussianNoise(seed=9, noise_stream=COUNTER)
    _steps(mechanism, 2)
    state = copy.deepcopy(mechanism.state_dict())
    assert state["noise_stream"] == COUNTER
    resumed = GaussianNoise(seed=123, noise_stream=COUNTER)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(_steps(resumed, 3), reference[2:]))


def test_an_old_stream_checkpoint_resumes_on_the_old_stream():
    serial = _steps(GaussianNoise(seed=9), 4)
    mechanism = GaussianNoise(seed=9)
    _steps(mechanism, 2)
    old_state = copy.deepcopy(mechanism.state_dict())
    del old_state["noise_stream"]  # as written before the counter stream existed
    resumed = GaussianNoise(seed=9, noise_stream=COUNTER)  # a new run's default would not matter
    resumed.load_state_dict(old_state)
    assert resumed.noise_stream == cs.STREAM_MT
    assert all(torch.equal(a, b) for a, b in zip(_steps(resumed, 2), serial[2:]))
    # and the other way: a counter-stream state loaded into a mechanism built (and stepped) on the serial stream
    counter = _steps(GaussianNoise(seed=9, noise_stream=COUNTER), 3)
    source = GaussianNoise(seed=9, noise_stream=COUNTER)
    _steps(source, 2)
    target = GaussianNoise(seed=9)
    _steps(target, 1)
    target.load_state_dict(copy.deepcopy(source.state_dict()))
    assert torch.equal(_steps(target, 1)[0], counter[2])


def test_the_streams_differ_and_a_layout_restart_gets_a_new_key():
    counter = GaussianNoise(seed=9, noise_stream=COUNTER)
    first = _steps(counter, 1)[0]
    assert not torch.equal(first, _steps(GaussianNoise(seed=9), 1)[0])
    counter.restart_layout()
    again = GaussianNoise(seed=9, noise_stream=COUNTER)
    _steps(again, 1)
    assert not torch.equal(_steps(counter, 1)[0], _steps(again, 1)[0])


def test_a_failed_step_redraws_the_same_noise():
    reference = _steps(GaussianNoise(seed=3, noise_stream=COUNTER), 3)
    mechanism = GaussianNoise(seed=3, noise_stream=COUNTER)
    _steps(mechanism, 2)

    def fails():
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError):
        mechanism.add_noise_([torch.zeros(s) for s in SHAPES], 1.0, 1.0, on_commit=fails)
    assert mechanism.step == 2
    assert torch.equal(_steps(mechanism, 1)[0], reference[2])


@pytest.mark.parametrize("kind", ["gaussian", "bandmf"])
def test_prefetch_is_bit_identical(kind):
    def make(prefetch):
        if kind == "gaussian":
            return GaussianNoise(seed=8, prefetch=prefetch, noise_stream=COUNTER)
        return BandMFNoise([1.0, 0.5, -0.25], seed=8, prefetch=prefetch, noise_stream=COUNTER)

    scales = [1.0, 1.0, 2.0, 2.0, 2.0] if kind == "gaussian" else [1.5] * 5  # BandMF keeps one scale

    def run(mechanism):
        rows = []
        for scale in scales:
            tensors = [torch.zeros(shape) for shape in SHAPES]
            mechanism.add_noise_(tensors, 1.0, scale)
            rows.append(torch.cat([t.reshape(-1) for t in tensors]))
        return rows

    expected = run(make(False))
    prefetched = make(True)
    assert all(torch.equal(a, b) for a, b in zip(run(prefetched), expected))
    assert prefetched._draws_ahead


def test_bandmf_with_one_band_adds_the_gaussian_noise():
    gaussian = _steps(GaussianNoise(seed=21, noise_stream=COUNTER), 3)
    bandmf = _steps(BandMFNoise([1.0], seed=21, noise_stream=COUNTER), 3)
    assert all(torch.equal(a, b) for a, b in zip(gaussian, bandmf))


def test_secure_mode_keys_come_from_the_os_and_are_never_saved():
    first = GaussianNoise(secure_mode=True, noise_stream=COUNTER)
    second = GaussianNoise(secure_mode=True, noise_stream=COUNTER)
    shapes = [(cs.CHUNK_NUMEL + 5,)]
    a, b = _steps(first, 1, shapes)[0], _steps(second, 1, shapes)[0]
    assert not torch.equal(a, b)
    assert len(first._groups[0].generators) == 4  # four OS keys summed, as the serial stream sums four generators
    state = first.state_dict()
    assert state["seed"] is None and all(d["generator_states"] is None for d in state["devices"])
    n = a.numel()
    assert abs(a.var().item() - 1.0) < Z * math.sqrt(2.0 / (n - 1))  # the sum has the requested std


@pytest.mark.parametrize("stream", [cs.STREAM_MT, COUNTER])
def test_divide_by_gives_the_bits_of_adding_then_dividing(stream):
    shapes = [(cs.CHUNK_NUMEL + 3,), (5, 7)]
    fused = _steps(GaussianNoise(seed=2, noise_stream=stream), 2, shapes, divide_by=48.0)
    plain = [noise / 48.0 for noise in _steps(GaussianNoise(seed=2, noise_stream=stream), 2, shapes)]
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    zero = GaussianNoise(seed=2, noise_stream=stream)
    tensors = [torch.full((3,), 6.0)]
    zero.add_noise_(tensors, 0.0, 1.0, divide_by=3.0)  # no noise: still divided
    assert torch.equal(tensors[0], torch.full((3,), 2.0))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), True, "2"])
def test_a_bad_divisor_raises_before_anything_changes(bad):
    mechanism = GaussianNoise(seed=1, noise_stream=COUNTER)
    tensors = [torch.ones(4)]
    with pytest.raises(ValueError, match="divide_by"):
        mechanism.add_noise_(tensors, 1.0, 1.0, divide_by=bad)
    assert mechanism.step == 0 and torch.equal(tensors[0], torch.ones(4))


def test_bad_stream_names_are_refused():
    with pytest.raises(ValueError, match="noise_stream"):
        GaussianNoise(seed=1, noise_stream="philox")
    mechanism = GaussianNoise(seed=1)
    _steps(mechanism, 1)
    state = copy.deepcopy(mechanism.state_dict())
    state["noise_stream"] = "counter-v9"
    with pytest.raises(ValueError, match="noise_stream"):
        GaussianNoise(seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="step"):
        cs.draw_counter_noise(torch.empty(3), None, [cs.stream_key(1, 0)], -1, 1.0)


def test_copies_and_pickles_continue_the_stream():
    import pickle

    mechanism = GaussianNoise(seed=3, noise_stream=COUNTER, prefetch=True)
    shapes = [(cs.CHUNK_NUMEL + 9,)]
    _steps(mechanism, 2, shapes)
    copies = [copy.deepcopy(mechanism), pickle.loads(pickle.dumps(mechanism))]
    expected = _steps(mechanism, 1, shapes)[0]
    assert all(torch.equal(_steps(other, 1, shapes)[0], expected) for other in copies)


def test_the_one_chunk_form_for_other_devices_is_keyed_by_key_and_step():
    # The form used on non-CPU devices (one generator per step, seeded with 64 Philox bits), run here on CPU
    # tensors: there is no accelerator in the test environment.
    key, other = cs.stream_key(4, 0), cs.stream_key(5, 0)

    def draw(keys, step):
        out, scratch = torch.empty(1000), torch.empty(1000)
        cs._draw_device(out, scratch, keys, step, 1.0)
        return out

    assert torch.equal(draw([key], 3), draw([key], 3))
    assert not torch.equal(draw([key], 3), draw([key], 4))
    assert not torch.equal(draw([key], 3), draw([other], 3))
    assert torch.equal(draw([key, other], 3), draw([key], 3) + draw([other], 3))


@pytest.mark.parametrize("stream", [cs.STREAM_MT, COUNTER])
def test_a_pickled_mechanism_adds_fresh_noise_not_the_last_steps(stream):
    # pickle copies each view of the noise vector as a tensor of its own: a copy that added through those views
    # added the previous step's noise a second time. Its next steps must be the original's, and differ from it.
    mechanism = GaussianNoise(seed=5, noise_stream=stream, prefetch=False)
    shapes = [(cs.CHUNK_NUMEL + 3,), (4, 5)]
    last = _steps(mechanism, 2, shapes)[-1]
    copied = pickle.loads(pickle.dumps(mechanism))
    expected = _steps(mechanism, 2, shapes)
    got = _steps(copied, 2, shapes)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not torch.equal(got[0], last)


# ---------------------------------------------------------------------------------------------- through make_private
# A model whose loss does not depend on its parameters: every clipped sum is exactly 0, so with
# loss_reduction="sum" the released gradient is exactly the step's noise, replayed by a mechanism built alone.
_IN, _OUT = 300, 500  # 150,500 parameters: 2 chunks of the counter stream
SIGMA, BOUND = 1.3, 0.7


def _private_run(noise_stream=None, *, seed=11, ddp=False, **settings):
    from torch.utils.data import DataLoader, TensorDataset

    from privacy_engine import PrivacyEngine

    torch.manual_seed(0)
    model = torch.nn.Linear(_IN, _OUT)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    loader = DataLoader(TensorDataset(torch.randn(32, _IN)), batch_size=8)
    if noise_stream is not None:
        settings["noise_stream"] = noise_stream
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=loader,
        noise_multiplier=SIGMA, max_grad_norm=BOUND, noise_seed=seed, loss_reduction="sum", grad_sample_mode="hooks",
        **settings,
    )  # fmt: skip
    return engine, model, optimizer, loader


def _released_steps(run, count):
    _, model, optimizer, loader = run
    out = []
    batches = iter(loader)
    for _ in range(count):
        (inputs,) = next(batches)
        optimizer.zero_grad()
        (model(inputs) * 0.0).sum().backward()
        optimizer.step()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return out


def _replayed_steps(stream, count, seed=11):
    mechanism = GaussianNoise(seed=seed, noise_stream=stream, prefetch=False)
    out = []
    for _ in range(count):
        tensors = [torch.zeros(_OUT, _IN), torch.zeros(_OUT)]
        mechanism.add_noise_(tensors, SIGMA, BOUND)
        out.append(torch.cat([t.reshape(-1) for t in tensors]))
    return out


def test_make_private_releases_the_counter_streams_noise():
    released = _released_steps(_private_run(COUNTER), 2)
    assert all(torch.equal(a, b) for a, b in zip(released, _replayed_steps(COUNTER, 2)))
    default = _released_steps(_private_run(), 1)[0]  # the default stays the serial stream
    assert torch.equal(default, _replayed_steps(cs.STREAM_MT, 1)[0]) and not torch.equal(default, released[0])


def test_make_private_on_the_counter_stream_releases_the_same_numbers_at_1_and_2_threads():
    with _Threads(1):
        one = _released_steps(_private_run(COUNTER), 2)
    with _Threads(2):
        two = _released_steps(_private_run(COUNTER), 2)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert torch.equal(one[0], _replayed_steps(COUNTER, 1)[0])


# BLT's strategy (~3 s) and the automatic choice (~8 s) are optimised at make_private: slow.
@pytest.mark.parametrize("mechanism", ["bandmf", pytest.param("blt", marks=pytest.mark.slow),
                                       pytest.param("auto", marks=pytest.mark.slow)])  # fmt: skip
def test_every_mechanism_the_engine_builds_takes_the_stream(mechanism):
    from torch.utils.data import DataLoader, TensorDataset

    from privacy_engine import PrivacyEngine

    model = torch.nn.Linear(4, 2)
    loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, common = PrivacyEngine(), {"max_grad_norm": 1.0, "noise_mechanism": mechanism, "noise_stream": COUNTER}
    if mechanism == "auto":
        _, optimizer, _ = engine.make_private_with_epsilon(module=model, optimizer=optimizer, data_loader=loader,
                                                           target_epsilon=4.0, target_delta=1e-5, epochs=2, **common)
    else:
        _, optimizer, _ = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                              noise_multiplier=1.0, num_bands=2, total_steps=8, **common)  # fmt: skip
    assert optimizer.noise.noise_stream == COUNTER


@pytest.mark.parametrize("bad", ["philox", "counter-v2", None, 1])
def test_make_private_refuses_an_unknown_noise_stream_naming_it(bad):
    with pytest.raises(ValueError, match="noise_stream"):
        _private_run(bad if bad is not None else "MT19937")


def test_noise_stream_with_a_ready_mechanism_is_refused():
    with pytest.raises(ValueError, match="noise_stream"):
        _private_run(COUNTER, seed=None, noise_mechanism=GaussianNoise(seed=3))


def test_a_checkpoint_resumes_on_its_own_stream_whatever_the_new_setting(tmp_path, caplog):
    saved_run = _private_run(COUNTER)
    _released_steps(saved_run, 2)
    engine, model, optimizer, loader = saved_run
    engine.save_checkpoint(path=tmp_path / "run.pt", module=model, optimizer=optimizer, data_loader=loader)
    resumed = _private_run(seed=99)  # the default stream, another seed: neither is the saved run's
    with caplog.at_level("WARNING", logger="privacy_engine.noise.state"):
        resumed[0].load_checkpoint(path=tmp_path / "run.pt", module=resumed[1], optimizer=resumed[2],
                                   data_loader=resumed[3])  # fmt: skip
    assert resumed[2].noise.noise_stream == COUNTER
    assert "continues on its own noise stream 'counter-v1'" in caplog.text
    released = _released_steps(resumed, 1)[0]
    assert torch.equal(released, _replayed_steps(COUNTER, 3)[2])


def test_a_one_rank_ddp_job_draws_the_counter_stream_on_rank_0(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        run = _private_run(COUNTER, ddp=True)
        assert type(run[2].noise).__name__ == "RankZeroNoise" and run[2].noise.inner.noise_stream == COUNTER
        released = _released_steps(run, 2)
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(a, b) for a, b in zip(released, _replayed_steps(COUNTER, 2)))


def test_a_sharded_run_refuses_the_counter_stream_saying_why():
    from privacy_engine.engine.options import PrivacyOptions
    from privacy_engine.engine.sharded import fsdp_options

    options = PrivacyOptions(noise_multiplier=1.0, max_grad_norm=1.0, noise_stream=COUNTER)
    with pytest.raises(NotImplementedError, match="noise_stream='counter-v1'.*serial stream"):
        fsdp_options(options, torch.nn.Linear(2, 2))


# ---------------------------------------------------------------- the draw added chunk by chunk (issue 25)
# Sizes that put tensor boundaries inside chunks, a tensor spanning several chunks, one shorter than a piece, and an
# empty one.
CHUNKED_SHAPES = [
    (cs.CHUNK_NUMEL + 5,),
    (0,),
    (3, 7),
    (2 * cs.CHUNK_NUMEL + cs.GRAIN_NUMEL + 11,),
    (cs.CHUNK_NUMEL - 1,),
]


def _chunked_reference(seed: int, step: int, gradients: list[torch.Tensor], std: float, divide_by: float | None):
    """What a counter-stream step must release, built without the chunked path: the whole flat noise vector from
    ``draw_counter_noise``, added to each gradient in one add, then divided in one division."""
    numel = sum(g.numel() for g in gradients)
    noise = torch.empty(numel, dtype=gradients[0].dtype)
    cs.draw_counter_noise(noise, None, [cs.stream_key(seed, 0)], step, std)
    return noised_and_divided(gradients, noise, divide_by)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_chunked_add_releases_the_bits_of_one_draw_one_add_and_one_division(threads, dtype):
    generator = torch.Generator().manual_seed(threads)
    mechanism = GaussianNoise(seed=6, noise_stream=COUNTER, prefetch=False)
    with _Threads(threads):
        for step, divide_by in enumerate([None, 37.0, 3.0]):
            gradients = [torch.randn(shape, generator=generator, dtype=dtype) for shape in CHUNKED_SHAPES]
            expected = _chunked_reference(6, step, gradients, 1.3 * 0.7, divide_by)
            group_targets = [g.clone() for g in gradients]
            if step:
                assert mechanism._draws_into_tensors(mechanism._groups[0], group_targets) == (threads > 1)
            mechanism.add_noise_(group_targets, 1.3, 0.7, divide_by=divide_by)
            assert all(torch.equal(a, b) for a, b in zip(group_targets, expected)), (step, divide_by)
    assert (mechanism._groups[0].add_plan is not None) == (threads > 1)  # the chunked path ran (one thread: not)


@_Threads(2)
def test_the_chunked_add_is_kept_out_where_the_noise_vector_is_needed_or_the_ops_would_differ():
    n = cs.CHUNK_NUMEL
    with _Threads(1):  # one thread: one draw, one add
        one = GaussianNoise(seed=1, noise_stream=COUNTER, prefetch=False)
        one.add_noise_([torch.zeros(n), torch.zeros(4, 3)], 1.0, 1.0)
        assert not one._draws_into_tensors(one._groups[0], [torch.zeros(n), torch.zeros(4, 3)])
    gaussian = GaussianNoise(seed=1, noise_stream=COUNTER, prefetch=False)
    gaussian.add_noise_([torch.zeros(n), torch.zeros(4, 3)], 1.0, 1.0)
    group = gaussian._groups[0]
    assert gaussian._draws_into_tensors(group, [torch.zeros(n), torch.zeros(4, 3)])
    assert not gaussian._draws_into_tensors(group, [torch.zeros(n), torch.zeros(3, 4).t()])  # not contiguous
    assert not gaussian._draws_into_tensors(group, [torch.zeros(n), torch.zeros(4, 3, dtype=torch.float64)])
    small = GaussianNoise(seed=1, noise_stream=COUNTER, prefetch=False)
    small.add_noise_([torch.zeros(n)], 1.0, 1.0)
    assert not small._draws_into_tensors(small._groups[0], [torch.zeros(n)])  # one chunk
    from privacy_engine.noise.mechanism import SERIAL_CHUNK_NUMEL

    big = [torch.zeros(SERIAL_CHUNK_NUMEL + 1)]
    serial = GaussianNoise(seed=1, prefetch=False)
    serial.add_noise_(big, 1.0, 1.0)
    with _Threads(1):  # the serial stream's draw and add share one thread: one draw, one add
        assert not serial._draws_into_tensors(serial._groups[0], big)
    with _Threads(2):  # one thread draws, another adds
        assert serial._draws_into_tensors(serial._groups[0], big)
        small = GaussianNoise(seed=1, prefetch=False)
        small.add_noise_([torch.zeros(SERIAL_CHUNK_NUMEL)], 1.0, 1.0)
        assert not small._draws_into_tensors(small._groups[0], [torch.zeros(SERIAL_CHUNK_NUMEL)])  # one chunk
        secure = GaussianNoise(secure_mode=True, prefetch=False)
        secure.add_noise_(big, 1.0, 1.0)
        assert not secure._draws_into_tensors(secure._groups[0], big)  # four generators summed
    bandmf = BandMFNoise([1.0, 0.5], seed=1, noise_stream=COUNTER, prefetch=False)
    bandmf.add_noise_([torch.zeros(10)], 1.0, 1.0)
    assert not bandmf._draws_into_tensors(bandmf._groups[0], [torch.zeros(10)])  # forms and keeps its noise


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_serial_stream_drawn_by_one_thread_and_added_by_another_releases_the_same_bits(threads, dtype):
    from privacy_engine.noise.layout import _derived_seed
    from privacy_engine.noise.mechanism import SERIAL_CHUNK_NUMEL

    # Tensor boundaries inside chunks, and a last chunk of 9 entries (joined to the one before: torch draws fewer
    # than 16 values another way).
    shapes = [(SERIAL_CHUNK_NUMEL + 5,), (0,), (3, 7), (SERIAL_CHUNK_NUMEL - 17,)]  # 2 chunks and 9 entries
    reference = torch.Generator().manual_seed(_derived_seed(6, 0, 0))  # the serial stream, written out
    generator = torch.Generator().manual_seed(threads)
    mechanism = GaussianNoise(seed=6, prefetch=False)
    with _Threads(threads):
        for step, divide_by in enumerate([None, 37.0, 3.0]):
            gradients = [torch.randn(shape, generator=generator, dtype=dtype) for shape in shapes]
            noise = torch.empty(sum(g.numel() for g in gradients), dtype=dtype)
            noise.normal_(0.0, 1.3 * 0.7, generator=reference)
            expected = noised_and_divided(gradients, noise, divide_by)
            mechanism.add_noise_(gradients, 1.3, 0.7, divide_by=divide_by)
            assert all(torch.equal(a, b) for a, b in zip(gradients, expected)), (step, divide_by)
        assert torch.equal(mechanism._groups[0].generators[0].get_state(), reference.get_state())
        assert (mechanism._groups[0].add_plan is not None) == (threads > 1)


def test_a_mixed_dtype_step_on_the_counter_stream_adds_the_drawn_noise():
    # Not chunked (a float32 tensor in a float64 group gets the noise converted): the one draw, added as before.
    mechanism = GaussianNoise(seed=9, noise_stream=COUNTER, prefetch=False)
    tensors = [torch.zeros(cs.CHUNK_NUMEL + 9, dtype=torch.float64), torch.zeros(6)]
    mechanism.add_noise_(tensors, 1.0, 1.0, divide_by=4.0)
    noise = torch.empty(cs.CHUNK_NUMEL + 15, dtype=torch.float64)
    cs.draw_counter_noise(noise, None, [cs.stream_key(9, 0)], 0, 1.0)
    assert torch.equal(tensors[0], noise[: cs.CHUNK_NUMEL + 9] / 4.0)
    assert torch.equal(tensors[1], noise[cs.CHUNK_NUMEL + 9 :].float() / 4.0)


@pytest.mark.parametrize("keys", [1, 4])
def test_draw_counter_chunks_hands_over_the_chunks_draw_counter_noise_draws(keys):
    stream_keys = [cs.stream_key(30 + number, 0) for number in range(keys)]
    numel = 3 * cs.CHUNK_NUMEL + 100
    whole, scratch = torch.empty(numel), torch.empty(numel)
    cs.draw_counter_noise(whole, scratch, stream_keys, 5, 2.0)
    for threads in (1, 2):
        seen = {}

        def consume(index, chunk, seen=seen):
            seen[index] = chunk.clone()  # the buffer is drawn over again after consume returns

        cs.draw_counter_chunks(numel, torch.float32, stream_keys, 5, 2.0, consume, threads=threads)
        assert sorted(seen) == list(range(4))
        for index, (start, end) in enumerate(cs.chunk_bounds(numel)):
            assert torch.equal(seen[index], whole[start:end])
    calls = []
    cs.draw_counter_chunks(0, torch.float32, stream_keys, 5, 2.0, lambda *args: calls.append(args))
    assert not calls
    with pytest.raises(ValueError, match="step"):
        cs.draw_counter_chunks(10, torch.float32, stream_keys, -1, 2.0, lambda *args: None)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_consumer_that_raises_stops_the_draw_and_its_error_is_raised(threads):
    consumed = []

    def consume(index, chunk):
        consumed.append(index)
        if len(consumed) == 2:
            raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        cs.draw_counter_chunks(40 * cs.CHUNK_NUMEL, torch.float32, [cs.stream_key(1, 0)], 0, 1.0, consume,
                               threads=threads)  # fmt: skip
    assert len(consumed) < 40  # no chunk started after the failure (at most one per other thread was under way)


@_Threads(2)
def test_a_failed_chunked_step_leaves_the_mechanism_as_it_was():
    reference = GaussianNoise(seed=12, noise_stream=COUNTER, prefetch=False)
    mechanism = GaussianNoise(seed=12, noise_stream=COUNTER, prefetch=False)
    shapes = [(2 * cs.CHUNK_NUMEL,), (7,)]
    _steps(reference, 1, shapes)
    _steps(mechanism, 1, shapes)
    original = cs.draw_counter_chunks

    def failing(numel, dtype, keys, step, std, consume, **kwargs):
        def consume_then_fail(index, chunk):
            consume(index, chunk)
            raise RuntimeError("injected")

        original(numel, dtype, keys, step, std, consume_then_fail, **kwargs)

    cs.draw_counter_chunks = failing
    try:
        with pytest.raises(RuntimeError, match="injected"):
            mechanism.add_noise_([torch.zeros(s) for s in shapes], 1.0, 1.0)
    finally:
        cs.draw_counter_chunks = original
    assert mechanism.step == 1
    assert all(torch.equal(a, b) for a, b in zip(_steps(mechanism, 2, shapes), _steps(reference, 2, shapes)))


def test_the_add_plan_cuts_no_piece_across_a_tensor_or_a_chunk_and_none_above_the_grain():
    from privacy_engine.noise.layout import _add_plan

    rng = np.random.default_rng(0)
    for _ in range(20):
        numels = [int(n) for n in rng.integers(0, 3 * cs.CHUNK_NUMEL, size=rng.integers(1, 6))]
        if sum(numels) == 0:
            continue
        bounds = cs.chunk_bounds(sum(numels))
        plan = _add_plan(numels, bounds, cs.GRAIN_NUMEL)
        starts, offset = [], 0  # each piece's flat start, in layout order
        for numel, sizes in zip(numels, plan.tensor_piece_sizes):
            assert sum(sizes) == numel and all(0 < size <= cs.GRAIN_NUMEL for size in sizes)
            for size in sizes:
                starts.append((offset, size))
                offset += size
        for (start, end), (first, last), sizes in zip(bounds, plan.chunk_pieces, plan.chunk_piece_sizes):
            assert sum(sizes) == end - start
            assert [size for _, size in starts[first:last]] == list(sizes)
            assert starts[first][0] == start
        assert plan.chunk_pieces[-1][1] == len(starts)


def test_a_failed_add_on_the_serial_streams_add_thread_leaves_the_mechanism_as_it_was(monkeypatch):
    shapes = [(600_000,), (7,)]  # three chunks of the serial stream's draw
    reference = GaussianNoise(seed=12, prefetch=False)
    mechanism = GaussianNoise(seed=12, prefetch=False)
    with _Threads(2):
        _steps(reference, 1, shapes)
        _steps(mechanism, 1, shapes)
        real, calls, finished = torch._foreach_div_, [], []

        def fails_on_the_second_chunk(tensors, divisor):
            calls.append(len(tensors))
            if len(calls) == 2:
                raise RuntimeError("injected")
            if len(calls) == 3:
                time.sleep(0.2)  # the last add is still running when the second one fails
            real(tensors, divisor)
            finished.append(len(calls))

        monkeypatch.setattr(torch, "_foreach_div_", fails_on_the_second_chunk)
        with pytest.raises(RuntimeError, match="injected"):
            mechanism.add_noise_([torch.zeros(s) for s in shapes], 1.0, 1.0, divide_by=2.0)
        assert finished == [1, 3]  # raised only once no add touched the tensors any more
        monkeypatch.undo()
        assert len(calls) == 3 and mechanism.step == 1 and mechanism._groups[0].add_plan is not None
        expected = _steps(reference, 2, shapes, divide_by=2.0)
        assert all(torch.equal(a, b) for a, b in zip(_steps(mechanism, 2, shapes, divide_by=2.0), expected))


@_Threads(2)
def test_a_replaced_step_of_the_mechanism_is_run_not_skipped_by_the_chunked_path():
    shapes = [(cs.CHUNK_NUMEL,), (5, 7)]
    mechanism = GaussianNoise(seed=3, noise_stream=COUNTER, prefetch=False)
    _steps(mechanism, 1, shapes)
    group = mechanism._groups[0]
    assert mechanism._draws_into_tensors(group, [torch.zeros(s) for s in shapes])
    seen = []
    real = mechanism._form_noise
    mechanism._form_noise = lambda group: seen.append(group) or real(group)
    assert not mechanism._draws_into_tensors(group, [torch.zeros(s) for s in shapes])
    _steps(mechanism, 1, shapes)
    assert seen == [group]
