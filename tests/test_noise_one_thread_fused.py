"""At one torch thread the Gaussian step draws its noise chunk by chunk into a small buffer and adds (and divides)
each chunk into the gradients while it is in cache (``NoiseMechanism._draw_and_add_on_this_thread``): the same bits
and the same generator state as one whole draw, one add and one division, for every way the chunks can fall."""

from __future__ import annotations

import math

import pytest
import torch
from test_noise_stream import noised_and_divided

from privacy_engine.noise import GaussianNoise
from privacy_engine.noise import counter_stream as cs
from privacy_engine.noise import mechanism as mechanism_module
from privacy_engine.noise.layout import _derived_seed

CHUNK = 64  # ONE_THREAD_CHUNK_NUMEL for these tests (a multiple of 16), so that a few hundred entries make many chunks
STD = 1.3 * 0.7

SERIAL_LAYOUTS = {
    "under 16": [(5,)],
    "exactly a chunk": [(CHUNK,)],
    "a chunk and 7 (the tail joins it)": [(CHUNK + 7,)],
    "two chunks and a tail of 16": [(2 * CHUNK + 16,)],
    "several chunks": [(5 * CHUNK + 33,)],
    "mixed tensors": [(3, 7), (CHUNK + 9,), (0,), (5,), (2, 3, 11), (CHUNK,), (1,), (2 * CHUNK + 7,)],
}


@pytest.fixture
def one_thread(monkeypatch):
    monkeypatch.setattr(mechanism_module, "ONE_THREAD_CHUNK_NUMEL", CHUNK)
    monkeypatch.setattr(mechanism_module, "ONE_THREAD_MIN_NUMEL", 0)  # (1 << 24 by default)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _gradients(shapes, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=dtype) for shape in shapes]


def _spy_on_the_fused_path(mechanism):
    calls = []
    fused = mechanism._draw_and_add_on_this_thread
    mechanism._draw_and_add_on_this_thread = lambda *args: calls.append(1) or fused(*args)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", list(SERIAL_LAYOUTS))
def test_the_serial_stream_adds_the_bits_of_one_draw_one_add_and_one_division(one_thread, layout, dtype):
    shapes = SERIAL_LAYOUTS[layout]
    numel = sum(math.prod(shape) for shape in shapes)
    reference = torch.Generator().manual_seed(_derived_seed(6, 0, 0))  # the serial stream, written out
    mechanism = GaussianNoise(seed=6, prefetch=False)
    calls = _spy_on_the_fused_path(mechanism)
    for step, divide_by in enumerate([None, 37.0, 256.0, 0.5]):  # 256 and 0.5: multiplied by the exact reciprocal
        gradients = _gradients(shapes, dtype, step)
        noise = torch.empty(numel, dtype=dtype).normal_(0.0, STD, generator=reference)
        expected = noised_and_divided(gradients, noise, divide_by)
        mechanism.add_noise_(gradients, 1.3, 0.7, divide_by=divide_by)
        assert all(torch.equal(a, b) for a, b in zip(gradients, expected)), (step, divide_by)
        assert torch.equal(mechanism._groups[0].generators[0].get_state(), reference.get_state()), step
    assert len(calls) == (4 if numel > CHUNK else 0)  # one chunk (or less): one draw, one add


def test_the_serial_stream_never_writes_the_noise_vector_past_its_first_chunk(one_thread):
    mechanism = GaussianNoise(seed=2, prefetch=False)
    gradients = _gradients([(5 * CHUNK + 33,)], torch.float32, 0)
    mechanism.add_noise_(gradients, 1.0, 1.0)
    noise = mechanism._groups[0].noise
    noise.fill_(math.nan)
    mechanism.add_noise_(gradients, 1.0, 1.0, divide_by=3.0)
    assert not noise[:CHUNK].isnan().any() and noise[CHUNK:].isnan().all()  # its pages are never faulted in
    assert not any(g.isnan().any() for g in gradients)


@pytest.mark.parametrize("divide_by", [None, 3.0, 64.0])
def test_the_counter_stream_adds_the_bits_of_one_draw_one_add_and_one_division(one_thread, divide_by):
    shapes = [(cs.CHUNK_NUMEL + 5,), (0,), (3, 7), (cs.CHUNK_NUMEL - 17,)]  # 2 chunks and 9 entries
    fused, whole = (GaussianNoise(seed=4, prefetch=False, noise_stream=cs.STREAM_COUNTER) for _ in range(2))
    whole._draws_into_tensors = lambda group, targets: False  # the old order: draw everything, add, divide
    calls = _spy_on_the_fused_path(fused)
    for step in range(2):
        gradients = _gradients(shapes, torch.float32, step)
        expected = [g.clone() for g in gradients]
        fused.add_noise_(gradients, 1.3, 0.7, divide_by=divide_by)
        whole.add_noise_(expected, 1.3, 0.7, divide_by=divide_by)
        assert all(torch.equal(a, b) for a, b in zip(gradients, expected)), step
    assert len(calls) == 2 and fused.step == whole.step == 2


def test_only_a_power_of_two_is_divided_by_as_a_multiplication_and_it_rounds_as_the_division():
    reciprocal = mechanism_module._exact_reciprocal
    assert [reciprocal(d) for d in (1.0, 256.0, 0.25, 2.0**60)] == [1.0, 1 / 256, 4.0, 2.0**-60]
    assert all(reciprocal(d) is None for d in (255.0, 300.0, 256.00001, 2.0**61, 2.0**-61, 3.0))
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-40, 1e-38, 3.4e38, 1.0, -2.5]
    try:
        for flush in (False, True):
            torch.set_flush_denormal(flush)
            for dtype, bits in ((torch.float32, torch.int32), (torch.float64, torch.int64)):
                values = torch.cat([torch.tensor(special, dtype=dtype), torch.randn(300, dtype=dtype) * 1e-37])
                values = torch.cat([values, torch.randn(300, dtype=dtype) * 1e30])
                for divisor in (1.0, 0.5, 256.0, 2.0**-60, 2.0**60):
                    divided = values.clone().div_(divisor)
                    multiplied = values.clone().mul_(reciprocal(divisor))
                    assert torch.equal(divided.view(bits), multiplied.view(bits)), (dtype, flush, divisor)
    finally:
        torch.set_flush_denormal(False)  # torch's default (it has no getter to restore from)


@pytest.mark.parametrize("stream", [cs.STREAM_MT, cs.STREAM_COUNTER])
def test_at_one_thread_only_a_noise_vector_past_the_cache_is_drawn_chunk_by_chunk(stream):
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for numel, chunked in ((mechanism_module.ONE_THREAD_MIN_NUMEL - 16, False),
                               (mechanism_module.ONE_THREAD_MIN_NUMEL, True)):  # fmt: skip
            targets = [torch.empty(numel - 21), torch.empty(3, 7)]  # never written: no page is faulted in
            mechanism = GaussianNoise(seed=1, prefetch=False, noise_stream=stream)
            mechanism.add_noise_(targets, 0.0, 1.0)  # lays the noise out without drawing
            assert mechanism._draws_into_tensors(mechanism._groups[0], targets) == chunked, numel
            assert not mechanism._draws_into_tensors(mechanism._groups[0], [targets[0], targets[1].t()])
    finally:
        torch.set_num_threads(saved)
