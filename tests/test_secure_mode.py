"""secure_mode: every sampling choice from the OS, noise generators with full-entropy state, nothing
saved that reproduces future noise; non-secure runs stay seedable."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import PrivacyEngine
from privacy_engine.engine import checkpoint
from privacy_engine.noise import BandMFNoise, GaussianNoise, secure_random
from privacy_engine.noise.secure_random import (
    SecureGenerator,
    full_entropy_generator,
    secure_permutation,
    secure_randint,
    secure_uniform,
)
from privacy_engine.training import sampling
from privacy_engine.training.sampling import CyclicPoissonBatchSampler, PoissonBatchSampler

MT_INIT = 1812433253
CPU_STATE_BYTES = torch.Generator().get_state().numel()


def mt_words(generator: torch.Generator) -> np.ndarray:
    """The 624 Mersenne Twister words of a CPU generator's state (after the 24-byte preamble)."""
    return generator.get_state().numpy()[24 : 24 + 8 * 624].view(np.uint64)


def follows_mt_seeding(words: np.ndarray) -> bool:
    """True if the words are MT19937's initialisation from a 32-bit seed (what manual_seed produces)."""
    w = [int(x) for x in words[:3]]
    return all(w[i] == (MT_INIT * (w[i - 1] ^ (w[i - 1] >> 30)) + i) % 2**32 for i in (1, 2))


class FakeOS:
    """Replays given bytes as os.urandom's output, recording the requests."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)
        self.requests: list[int] = []

    def __call__(self, count: int) -> bytes:
        self.requests.append(count)
        chunk = self.chunks.pop(0)
        assert len(chunk) == count
        return chunk


def words_bytes(*values: int) -> bytes:
    return np.array(values, dtype=np.uint64).tobytes()


# ---------------------------------------------------------------------------------------------- the problem
def test_torch_manual_seed_keeps_only_the_low_32_bits_on_cpu():
    # Why secure mode cannot seed through manual_seed: seeds 2**32 apart give the same stream.
    seed = int.from_bytes(b"\x8f\x11\x02\x9a\x77\x01\xc3\x5e", "little")
    a = torch.rand(8, generator=torch.Generator().manual_seed(seed))
    b = torch.rand(8, generator=torch.Generator().manual_seed(seed % 2**32))
    assert torch.equal(a, b)
    assert follows_mt_seeding(mt_words(torch.Generator().manual_seed(seed)))


# ---------------------------------------------------------------------------------------------- OS draws
def test_secure_uniform_takes_the_top_53_bits_of_each_os_word(monkeypatch):
    fake = FakeOS(words_bytes(0, 2**64 - 1, 2**11, 2**63))
    monkeypatch.setattr(secure_random.os, "urandom", fake)
    values = secure_uniform(4)
    assert values.dtype == torch.float64
    assert values.tolist() == [0.0, 1.0 - 2.0**-53, 2.0**-53, 0.5]
    assert fake.requests == [32]


def test_secure_uniform_is_uniform_on_the_unit_interval():
    values = secure_uniform(200_000).numpy()
    assert values.min() >= 0.0 and values.max() < 1.0
    # mean 1/2 with standard error sqrt(1/12 / n); the fraction below 0.3 is binomial.
    assert abs(values.mean() - 0.5) < 5 * math.sqrt(1 / 12 / values.size)
    assert abs((values < 0.3).mean() - 0.3) < 5 * math.sqrt(0.3 * 0.7 / values.size)
    assert secure_uniform(0).numel() == 0
    with pytest.raises(ValueError, match="n must be"):
        secure_uniform(-1)


def test_secure_randint_rejects_words_that_would_bias_the_modulo(monkeypatch):
    # high = 3: 2**64 = 1 (mod 3), so the single word 2**64 - 1 must be redrawn.
    fake = FakeOS(words_bytes(2**64 - 1, 7), words_bytes(5))
    monkeypatch.setattr(secure_random.os, "urandom", fake)
    assert secure_randint(3, 2).tolist() == [7 % 3, 5 % 3]
    assert fake.requests == [16, 8]


def test_secure_randint_is_uniform_and_in_range():
    values = secure_randint(5, 100_000).numpy()
    assert values.min() == 0 and values.max() == 4
    counts = np.bincount(values, minlength=5)
    expected = values.size / 5
    assert np.all(np.abs(counts - expected) < 5 * math.sqrt(expected * 0.8))
    assert secure_randint(1, 4).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="high"):
        secure_randint(0, 3)


def test_secure_permutation_redraws_when_keys_tie(monkeypatch):
    fake = FakeOS(words_bytes(4, 9, 4), words_bytes(30, 10, 20))
    monkeypatch.setattr(secure_random.os, "urandom", fake)
    assert secure_permutation(3).tolist() == [1, 2, 0]  # the order of the second, tie-free draw
    assert len(fake.requests) == 2


def test_secure_permutation_is_a_uniform_permutation():
    assert sorted(secure_permutation(50).tolist()) == list(range(50))
    counts = np.zeros((3, 3))
    for _ in range(3000):
        counts[np.arange(3), secure_permutation(3).numpy()] += 1
    assert np.all(np.abs(counts - 1000) < 5 * math.sqrt(1000 * 2 / 3))


# ---------------------------------------------------------------------------------------------- generators
def test_a_full_entropy_generator_takes_its_whole_state_from_the_os(monkeypatch):
    words = np.arange(1, 625, dtype=np.uint64) * np.uint64(2654435761) % np.uint64(2**32)
    fake = FakeOS(words.tobytes(), words_bytes(123))
    monkeypatch.setattr(secure_random.os, "urandom", fake)
    generator = full_entropy_generator("cpu")
    monkeypatch.undo()
    assert np.array_equal(mt_words(generator), words)
    # Its stream is the one of a Mersenne Twister started from exactly those words.
    reference = torch.Generator()
    state = reference.get_state().numpy().copy()
    state[24 : 24 + 8 * 624] = words.view(np.uint8)
    reference.set_state(torch.from_numpy(state))
    assert torch.equal(torch.rand(1000, generator=generator), torch.rand(1000, generator=reference))


def test_full_entropy_generators_are_not_seed_derived_and_differ():
    first, second = full_entropy_generator(), full_entropy_generator()
    assert not follows_mt_seeding(mt_words(first))
    assert not torch.equal(torch.rand(16, generator=first), torch.rand(16, generator=second))


def test_secure_noise_uses_four_full_entropy_generators_per_device():
    noise = BandMFNoise([1.0, 0.5], secure_mode=True)
    noise.add_noise_([torch.zeros(10)], 1.0, 1.0)
    generators = noise._groups[0].generators
    assert len(generators) == 4
    assert not any(follows_mt_seeding(mt_words(g)) for g in generators)
    words = [mt_words(g) for g in generators]
    assert all(not np.array_equal(words[i], words[j]) for i in range(4) for j in range(i + 1, 4))


def test_secure_noise_has_the_right_std_and_is_not_reproducible():
    entries = 100_000
    a, b = torch.zeros(entries), torch.zeros(entries)
    GaussianNoise(secure_mode=True).add_noise_([a], 1.0, 2.0)
    GaussianNoise(secure_mode=True).add_noise_([b], 1.0, 2.0)
    assert a.std().item() == pytest.approx(2.0, rel=5 / math.sqrt(2 * entries))
    assert not torch.equal(a, b)


def test_non_secure_noise_stays_seedable():
    a, b = torch.zeros(50), torch.zeros(50)
    BandMFNoise([1.0, 0.5], seed=4).add_noise_([a], 1.0, 1.0)
    BandMFNoise([1.0, 0.5], seed=4).add_noise_([b], 1.0, 1.0)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- sampling
class Recorder:
    def __init__(self, function):
        self.function, self.calls = function, 0

    def __call__(self, *args):
        self.calls += 1
        return self.function(*args)


@pytest.fixture
def os_draws(monkeypatch):
    recorders = {name: Recorder(getattr(sampling, name)) for name in ("secure_uniform", "secure_randint",
                                                                        "secure_permutation")}  # fmt: skip
    for name, recorder in recorders.items():
        monkeypatch.setattr(sampling, name, recorder)
    return recorders


def test_secure_poisson_sampling_draws_from_the_os_not_from_the_generator(os_draws):
    generator = SecureGenerator()
    sampler = PoissonBatchSampler(1000, 0.1, steps=3, generator=generator)
    state = generator.get_state()
    batches = list(sampler)
    assert os_draws["secure_uniform"].calls == 3
    assert torch.equal(generator.get_state(), state)  # the torch generator was never drawn from
    sizes = [len(b) for b in batches]
    assert all(abs(size - 100) < 5 * math.sqrt(90) for size in sizes)


@pytest.mark.parametrize("public_size, draw", [(True, "secure_permutation"), (False, "secure_randint")])
def test_secure_group_assignment_and_truncation_draw_from_the_os(os_draws, public_size, draw):
    generator = SecureGenerator()
    state = generator.get_state()
    sampler = CyclicPoissonBatchSampler(200, 4, 0.5, steps=4, public_size=public_size, generator=generator,
                                        max_batch_size=5)  # fmt: skip
    assert os_draws[draw].calls == 1
    assert sorted(torch.cat(sampler.groups).tolist()) == list(range(200))
    batches = list(sampler)
    assert os_draws["secure_uniform"].calls == 4
    assert os_draws["secure_permutation"].calls >= 4  # truncation of ~25 drawn members to 5, each step
    assert all(len(b) == 5 for b in batches)
    assert torch.equal(generator.get_state(), state)


def make_secure_run(mechanism="bandmf"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
    dataset = TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
    engine = PrivacyEngine(accountant="rdp", secure_mode=True)
    kwargs = {"noise_mechanism": "bandmf", "num_bands": 2, "total_steps": 8} if mechanism == "bandmf" else {}
    model, optimizer, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                   data_loader=DataLoader(dataset, batch_size=5), noise_multiplier=1.0,
                                                   max_grad_norm=1.0, **kwargs)  # fmt: skip
    for step, (inputs, targets) in enumerate(loader):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        if step == 2:
            break
    return engine, model, optimizer, loader


@pytest.mark.parametrize("mechanism", ["gaussian", "bandmf"])
def test_the_engine_samples_from_the_os_in_secure_mode(os_draws, mechanism):
    _, _, _, loader = make_secure_run(mechanism)
    assert isinstance(loader.batch_sampler.generator, SecureGenerator)
    assert os_draws["secure_uniform"].calls == 3
    if mechanism == "bandmf":
        assert os_draws["secure_randint"].calls + os_draws["secure_permutation"].calls == 1  # the groups


# ---------------------------------------------------------------------------------------------- checkpoints
def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def test_a_secure_checkpoint_holds_no_seed_and_no_generator_state(tmp_path):
    engine, model, optimizer, loader = make_secure_run()
    path = tmp_path / "secure.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer, data_loader=loader)
    payload = checkpoint.read_checkpoint(path)
    noise = payload[checkpoint.OPTIMIZER_KEY]["privacy_engine.dp_state"]["noise"]
    assert noise["seed"] is None
    assert all(device["generator_states"] is None for device in noise["devices"])
    assert payload[checkpoint.LOADER_KEY]["generator"] == "secure"
    assert payload[checkpoint.LOADER_KEY]["generator_state"] is None
    # No tensor in the file could be a generator state (uint8, the size of one).
    assert not any(t.dtype == torch.uint8 and t.numel() == CPU_STATE_BYTES for t in _tensors(payload))
    # What it does hold: BandMF's history (past noise), needed to continue the correlated noise.
    assert noise["devices"][0]["history"] is not None


def test_a_resumed_secure_run_keeps_the_history_and_draws_fresh_noise(tmp_path):
    engine, model, optimizer, loader = make_secure_run()
    path = tmp_path / "secure.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer, data_loader=loader)
    resumed = []
    for _ in range(2):
        other_engine, other_model, other_optimizer, other_loader = make_secure_run()
        other_engine.load_checkpoint(path=path, module=other_model, optimizer=other_optimizer, data_loader=other_loader)
        noise = other_optimizer.noise
        assert noise.step == optimizer.noise.step
        assert torch.equal(noise._groups[0].history, optimizer.noise._groups[0].history)
        tensors = [torch.zeros_like(p) for p in other_model.parameters()]
        noise.add_noise_(tensors, 1.0, 1.0)
        resumed.append(torch.cat([t.flatten() for t in tensors]))
    assert not torch.equal(resumed[0], resumed[1])  # the file does not determine the next noise


def test_a_secure_checkpoint_loads_only_into_a_secure_engine(tmp_path):
    engine, model, optimizer, loader = make_secure_run("gaussian")
    path = tmp_path / "secure.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer, data_loader=loader)
    plain = PrivacyEngine(accountant="rdp")
    torch.manual_seed(0)
    plain_model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
    with pytest.raises(checkpoint.CheckpointError, match="secure_mode=True"):
        plain.load_checkpoint(path=path, module=plain_model)


def test_a_secure_noise_state_round_trips_through_weights_only_loading():
    noise = BandMFNoise([1.0, 0.5, 0.2], secure_mode=True)
    noise.add_noise_([torch.zeros(7)], 1.0, 1.0)
    buffer = io.BytesIO()
    torch.save(noise.state_dict(), buffer)
    buffer.seek(0)
    restored = BandMFNoise([1.0, 0.5, 0.2], secure_mode=True)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.step == 1
    with pytest.raises(ValueError, match="secure_mode"):
        BandMFNoise([1.0, 0.5, 0.2], seed=1).load_state_dict(noise.state_dict())
