"""Do the ranks hold the same dataset, in the same order? A digest every rank compares at ``make_private``.

Distributed sampling (``distributed_sampling``) gives example ``i`` to one rank's shard and samples each
shard at the global rate ``q``: the union of the ranks' batches is one Poisson sample only if index ``i``
is the same example on every rank. Ranks that hold the same examples in different orders (each shuffled
its copy, or read files in a different order) pass a size check and break the guarantee silently: an
example at index 3 on rank 0 and index 7 on rank 1 is in both shards (inclusion up to 2q) while another is
in none. So the cross-rank settings check (``distributed.plan_settings``) includes ``dataset_digest``.

What the digest covers. The length, and the contents of a fixed sample of indices (the same on every rank:
the first and last, evenly spaced ones and a seeded random set, ``DIGEST_EXAMPLES`` in all; every index
when the dataset is no larger), hashed from the tensors' bytes. A dataset reordered (each rank shuffled
its copy) moves nearly every example, so a sampled index differs; two datasets that differ only at
indices outside the sample (one pair of examples swapped in a large dataset) are not told apart.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["DIGEST_EXAMPLES", "dataset_digest", "dataset_settings", "digest_indices"]

#: How many examples of the dataset every rank reads and hashes at make_private (all of them if fewer).
DIGEST_EXAMPLES = 256
# Seeds of the fixed sample of indices and of the randomness a dataset's own transforms draw while hashed.
_INDEX_SEED = 18_011
_TRANSFORM_SEED = 18_012


def dataset_settings(dataset: Any) -> dict[str, str]:
    """What the ranks compare about their dataset (``DistributedJob.agree``): its digest, under a name
    that says what must agree. Index ``i`` must be the same example on every rank (shards are by index)."""
    return {
        "dataset (digest of its examples at fixed indices: every rank must hold the same examples in the same "
        "order)": dataset_digest(dataset),
    }


def digest_indices(num_examples: int, count: int = DIGEST_EXAMPLES) -> list[int]:
    """The indices hashed: all of them when ``num_examples <= count``; else the first and the last,
    ``count // 2`` evenly spaced ones and seeded random ones, sorted (the same on every rank)."""
    if num_examples <= count:
        return list(range(num_examples))
    spaced = torch.linspace(0, num_examples - 1, steps=count // 2, dtype=torch.float64).round().long()
    generator = torch.Generator().manual_seed(_INDEX_SEED)
    drawn = torch.randint(0, num_examples, (count - count // 2,), generator=generator)
    return sorted({0, num_examples - 1, *spaced.tolist(), *drawn.tolist()})


def dataset_digest(dataset: Any, count: int = DIGEST_EXAMPLES) -> str:
    """SHA-256 (hex) of ``len(dataset)`` and the examples at ``digest_indices``, each with its index.

    Guarantee: two datasets with different lengths, or with different contents at any hashed index
    (tensor bytes, dtype and shape; numbers; strings; arrays; nested tuples, lists and dicts of
    them), have different digests; the same dataset has the same digest on every rank and run. The
    global random generators (torch, numpy, random) are left as they were, and the example reads run
    with them fixed, so random transforms read the same on every rank.

    ==========================================  ==============================================
    case                                        result
    ==========================================  ==============================================
    same examples, another order                different digest (a sampled index differs)
    a random transform in ``__getitem__``       same digest on every rank (seeded reads);
                                                the ranks' generators untouched
    an object of another type in an example     its type name only (its contents are not
                                                compared); PIL images: their bytes
    examples differing outside the sample       not detected (see the module docstring)
    ``dataset[i]`` raises                       the error propagates (make_private fails on
                                                that rank; the others time out)
    ==========================================  ==============================================
    """
    num_examples = len(dataset)
    hasher = hashlib.sha256(f"len={num_examples}".encode())
    with _fixed_randomness():
        for index in digest_indices(num_examples, count):
            hasher.update(f"|{index}:".encode())
            _hash_value(hasher, dataset[index])
    return hasher.hexdigest()


@contextlib.contextmanager
def _fixed_randomness() -> Iterator[None]:
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_TRANSFORM_SEED)
            random.seed(_TRANSFORM_SEED)
            np.random.seed(_TRANSFORM_SEED)
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _hash_value(hasher: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        hasher.update(f"tensor{tuple(tensor.shape)}{tensor.dtype}".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        hasher.update(f"array{array.shape}{array.dtype}".encode())
        hasher.update(array.tobytes() if array.dtype != object else repr(array.tolist()).encode())
    elif value is None or isinstance(value, (bool, int, float, complex, str, bytes, np.generic)):
        hasher.update(f"{type(value).__name__}={value!r}".encode())
    elif isinstance(value, Mapping):
        hasher.update(f"map{len(value)}".encode())
        for key in sorted(value, key=repr):
            _hash_value(hasher, key)
            _hash_value(hasher, value[key])
    elif isinstance(value, (list, tuple)):
        hasher.update(f"seq{len(value)}".encode())
        for item in value:
            _hash_value(hasher, item)
    elif callable(getattr(value, "tobytes", None)):  # PIL images and other buffers
        hasher.update(f"{type(value).__qualname__}{getattr(value, 'size', '')}{getattr(value, 'mode', '')}".encode())
        hasher.update(value.tobytes())
    else:
        # No portable byte form (its repr may hold a memory address): compared by type only.
        hasher.update(type(value).__qualname__.encode())
