"""Randomness for ``secure_mode``: full-entropy choices and full-entropy noise generators.

What was wrong with seeding torch generators from the OS. ``torch.Generator.manual_seed`` takes a
64-bit integer, but the CPU generator (a Mersenne Twister, MT19937) is initialised from its low 32
bits only: seeds ``s`` and ``s + 2**32`` give the same stream (``initial_seed()`` still reports
all 64 bits, which hides it). Anyone who sees outputs of such a generator recovers it by trying
2**32 seeds, so 8 bytes of OS entropy passed through ``manual_seed`` buy 32 bits of security.
CUDA's generator (Philox) keeps the full 64-bit seed.

What this module does instead:

* Every random *choice* of the samplers in secure mode (Poisson inclusion, group assignment,
  truncation subsets) is drawn directly from the operating system's cryptographic generator
  (``os.urandom``): ``secure_uniform``, ``secure_randint``, ``secure_permutation``. There is no
  generator state to recover, save or leak.
* Noise still comes from torch generators (drawing tens of millions of Gaussians per step from the
  OS would cost too much), but ``full_entropy_generator`` sets a CPU generator's whole
  19937-bit Mersenne Twister state from the OS instead of going through ``manual_seed``, and
  seeds other devices' generators (Philox) with 64 OS bits each.

``SecureGenerator`` marks secure sampling: a ``torch.Generator`` (so that code written for
generators accepts it) whose own state is full-entropy, and which the samplers replace by the
functions above. Its state is never written to a checkpoint.

What remains (see also ``NoiseMechanism``): MT19937 and Philox are statistically strong, not
cryptographically secure generators; full-entropy seeds rule out seed search, not an attack on a
generator's structure from many exact outputs (the noise is only ever seen added to gradients, and
secure mode sums four independent generators). Gaussian sampling in floating point has known
attacks (the set of floats a sampler can output is sparse and uneven; Mironov 2012 for Laplace,
Holohan & Braghin 2021 and Jin et al. 2022 for Gaussian samplers); summing four draws blurs that
pattern but is a mitigation, not a proof.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

__all__ = [
    "SecureGenerator",
    "full_entropy_generator",
    "is_secure_generator",
    "secure_permutation",
    "secure_randint",
    "secure_uniform",
]

# Layout of the CPU generator's state tensor (torch's CPUGeneratorImplState): uint64 initial seed,
# int32 `left`, int32 `seeded`, uint64 `next`, then the 624 Mersenne Twister words, each stored in
# a uint64. Checked at run time against a known seed before it is relied on (_check_cpu_layout).
_MT_WORDS = 624
_MT_WORDS_OFFSET = 24
_MT_INIT_MULTIPLIER = 1812433253  # MT19937's initialisation: w[i] = m * (w[i-1] ^ (w[i-1] >> 30)) + i


def _count(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def _os_words(count: int) -> np.ndarray:
    """``count`` uniformly random uint64 values from the OS's cryptographic generator."""
    return np.frombuffer(os.urandom(8 * count), dtype=np.uint64)


def secure_uniform(n: int) -> torch.Tensor:
    """``n`` independent uniforms on ``[0, 1)`` from the OS's cryptographic generator.

    Guarantee: each value is ``k / 2**53`` with ``k`` uniform on ``{0, ..., 2**53 - 1}`` (the top
    53 bits of 8 OS bytes), so ``P(u < q)`` is exactly ``q`` rounded down to a multiple of
    ``2**-53``; values are independent of each other and of every other call. float64, CPU.

    ========  ===========================
    case      result
    ========  ===========================
    n = 0     empty float64 tensor
    n < 0     ValueError naming n
    ========  ===========================
    """
    n = _count(n, "n")
    top_bits = _os_words(n) >> np.uint64(11)
    return torch.from_numpy(top_bits.astype(np.float64) * 2.0**-53)


def secure_randint(high: int, n: int) -> torch.Tensor:
    """``n`` independent integers uniform on ``{0, ..., high - 1}`` from the OS.

    Guarantee: exactly uniform (rejection sampling: 64-bit words at or above the largest multiple
    of ``high`` are redrawn, so the modulo has no bias); int64, CPU.

    ==================  =============================
    case                result
    ==================  =============================
    high = 1            all zeros
    n = 0               empty int64 tensor
    high < 1 or > 2**63  ValueError naming high
    n < 0               ValueError naming n
    ==================  =============================
    """
    if isinstance(high, bool) or not isinstance(high, (int, np.integer)) or not 1 <= high <= 2**63:
        raise ValueError(f"high must be an int in [1, 2**63], got {high!r}")
    n = _count(n, "n")
    high = int(high)
    accept_below = (2**64 // high) * high  # 2**64 when high is a power of two: nothing rejected
    out = np.empty(n, dtype=np.uint64)
    filled = 0
    while filled < n:
        words = _os_words(n - filled)
        if accept_below < 2**64:
            words = words[words < np.uint64(accept_below)]
        out[filled : filled + words.size] = words % np.uint64(high)
        filled += words.size
    return torch.from_numpy(out.astype(np.int64))


def secure_permutation(n: int) -> torch.Tensor:
    """A uniformly random permutation of ``range(n)`` from the OS (int64, CPU).

    Guarantee: every one of the ``n!`` orders is equally likely. The permutation sorts ``n``
    independent 64-bit OS words; if two words are equal (probability below ``n**2 / 2**65``) all
    are redrawn, so ties never favour an order.

    ========  ===========================
    case      result
    ========  ===========================
    n = 0     empty int64 tensor
    n = 1     tensor([0])
    n < 0     ValueError naming n
    ========  ===========================
    """
    n = _count(n, "n")
    while True:
        keys = _os_words(n)
        order = np.argsort(keys, kind="stable")
        ordered = keys[order]
        if n < 2 or bool(np.all(ordered[1:] != ordered[:-1])):
            return torch.from_numpy(order.astype(np.int64))


@functools.lru_cache(maxsize=1)
def _check_cpu_layout() -> int:
    """The CPU generator state's size, after checking the Mersenne Twister words sit where
    ``_set_full_entropy_cpu_state`` writes them (a known seed must give MT19937's first words)."""
    seed = 0x9E3779B9
    state = torch.Generator().manual_seed(seed).get_state().numpy()
    end = _MT_WORDS_OFFSET + 8 * _MT_WORDS
    if state.size < end:
        raise RuntimeError(_LAYOUT_ERROR)
    words = state[_MT_WORDS_OFFSET:end].view(np.uint64)
    second = (_MT_INIT_MULTIPLIER * (seed ^ (seed >> 30)) + 1) % 2**32
    if int(words[0]) != seed or int(words[1]) != second or int(words.max()) >= 2**32:
        raise RuntimeError(_LAYOUT_ERROR)
    return int(state.size)


_LAYOUT_ERROR = (
    "this version of torch lays out the CPU generator's state differently than privacy_engine "
    "expects, so secure_mode cannot set the Mersenne Twister state from OS entropy (and will not "
    "fall back to torch's 32-bit seeding); please report it with your torch version"
)


def _set_full_entropy_cpu_state(generator: torch.Generator) -> None:
    _check_cpu_layout()
    state = generator.get_state().numpy().copy()
    end = _MT_WORDS_OFFSET + 8 * _MT_WORDS
    words = (_os_words(_MT_WORDS) & np.uint64(0xFFFFFFFF)).copy()
    state[_MT_WORDS_OFFSET:end] = words.view(np.uint8)
    # `left = 1, next = 0`: the next draw regenerates all 624 words from these (MT19937's twist),
    # exactly as after manual_seed; the initial-seed field is filled with noise too so that
    # initial_seed() does not suggest a seed that reproduces the stream.
    state[0:8] = _os_words(1).view(np.uint8)
    state[8:12] = np.array([1], dtype=np.int32).view(np.uint8)
    state[12:16] = np.array([1], dtype=np.int32).view(np.uint8)
    state[16:24] = np.zeros(1, dtype=np.uint64).view(np.uint8)
    generator.set_state(torch.from_numpy(state))
    written = generator.get_state().numpy()[_MT_WORDS_OFFSET:end].view(np.uint64)
    if not np.array_equal(written, words):
        raise RuntimeError(_LAYOUT_ERROR)


def full_entropy_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A new ``torch.Generator`` on ``device`` whose state comes from the OS's cryptographic
    generator, not from a searchable seed.

    Guarantee (entropy of the state, i.e. the work of a seed search):

    ==============  ====================================================================
    device          state
    ==============  ====================================================================
    cpu             all 624 Mersenne Twister words from the OS: 19937 bits (MT19937's
                    whole state space); ``manual_seed`` would give 32
    cuda / other    ``manual_seed`` with 64 OS bits (Philox keeps all 64)
    unknown torch   RuntimeError (never a silent fall back to 32-bit seeding)
    CPU layout
    ==============  ====================================================================
    """
    device = torch.device(device)
    generator = torch.Generator(device=device)
    if device.type == "cpu":
        _set_full_entropy_cpu_state(generator)
    else:
        generator.manual_seed(int(_os_words(1)[0]))
    return generator


class SecureGenerator(torch.Generator):
    """The sampling "generator" of a secure-mode run: samplers given one draw every choice from
    the OS (``secure_uniform``, ``secure_randint``, ``secure_permutation``) instead of from it.

    It is a CPU ``torch.Generator`` so that code accepting a generator accepts it; should some
    code draw from it as a torch generator anyway, its Mersenne Twister state is full-entropy
    (``full_entropy_generator``). Checkpoints never store its state.
    """

    def __init__(self) -> None:
        # torch.Generator is built in __new__ (a CPU generator by default); only its state is set here.
        _set_full_entropy_cpu_state(self)

    def __repr__(self) -> str:
        return "SecureGenerator()"


def is_secure_generator(generator: object) -> bool:
    """True for a ``SecureGenerator`` (the samplers' test for secure mode)."""
    return isinstance(generator, SecureGenerator)
