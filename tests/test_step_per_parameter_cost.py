"""The step's per-parameter passes done as C-level maps / one foreach call (issue 25): same results, same refusals.

- ``noise.mechanism._divide_`` (a 0-dim float64 divisor on the CPU) gives the bits of ``torch._foreach_div_`` by the
  Python number, special values included;
- ``_add_to_tensors``'s one-dtype path adds and divides exactly as the per-dtype path;
- ``DPOptimizer._has_grad_samples`` answers as the per-parameter loop, and the clipper still casts a half-precision
  parameter's noised sum into ``.grad`` (the fast branch only where every dtype matches).
"""

from __future__ import annotations

import torch
from torch import nn

from privacy_engine.clipping import PerSampleGradientClipper
from privacy_engine.noise import GaussianNoise
from privacy_engine.noise.mechanism import NoiseMechanism, _divide_
from privacy_engine.training.optimizer import DPOptimizer

SPECIAL = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, 3e38, -2.5e-39, 1.0]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32 if tensor.dtype == torch.float32 else torch.int64)


def test_divide_gives_the_bits_of_the_python_number_division():
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        tensors = [
            torch.randn(n, generator=generator, dtype=torch.float64).mul(100).to(dtype) for n in (1, 3, 17, 4099)
        ]
        tensors.append(torch.tensor(SPECIAL, dtype=dtype))
        for divisor in (8.0, 256.0, 3.0, 7.3, 1000.1, 1e-3, 1.0 / 3.0, 12345.678):
            ours, reference = [t.clone() for t in tensors], [t.clone() for t in tensors]
            _divide_(ours, divisor)
            torch._foreach_div_(reference, divisor)
            for a, b in zip(ours, reference):
                assert torch.equal(_bits(a), _bits(b)), (dtype, divisor)
    mixed = [torch.ones(3, dtype=torch.float32) * 7, torch.ones(2, dtype=torch.float64) * 7]
    reference = [t.clone() for t in mixed]
    _divide_(mixed, 3.0)
    torch._foreach_div_(reference, 3.0)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(mixed, reference))


def test_one_dtype_add_matches_the_per_dtype_path():
    shapes = [(4, 4), (4,), (3, 2), (5,)]
    for scale, divide_by in ((1.0, None), (1.0, 8.0), (0.75, 7.3)):
        mechanism = GaussianNoise(seed=3)
        tensors = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
        mechanism.add_noise_([t.clone() for t in tensors], 1.0, 1.0)  # lays the noise out (group, views)
        (group,) = mechanism._groups
        ours = [t.clone() for t in tensors]
        NoiseMechanism._add_to_tensors(group, ours, scale, divide_by)
        expected = []
        for tensor, noise in zip(tensors, group.noise_views):
            out = tensor.clone()
            out.add_(noise) if scale == 1.0 else out.add_(noise, alpha=scale)  # the ops of the old path
            if divide_by is not None:
                out.div_(divide_by)
            expected.append(out)
        for a, b in zip(ours, expected):
            assert torch.equal(_bits(a), _bits(b))


def test_has_grad_samples_and_the_cast_of_a_half_parameter():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    model[1].half()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = DPOptimizer(sgd, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=2)
    params = optimizer.clipper.params
    assert not optimizer._has_grad_samples()
    params[3].grad_sample = torch.zeros(2, *params[3].shape, dtype=params[3].dtype)
    assert optimizer._has_grad_samples()
    optimizer.zero_grad()
    assert not optimizer._has_grad_samples() and getattr(params[3], "grad_sample", None) is None
    # Nothing accumulated: zeros in each sum's dtype, a float32 sum for the half parameters, cast into .grad.
    clipper: PerSampleGradientClipper = optimizer.clipper
    clipper.pre_step()
    assert [t.dtype for t in clipper.released_sums] == [torch.float32] * 4
    assert params[0].grad is clipper.released_sums[0] and params[2].grad is None


def test_the_add_in_the_noise_vector_gives_the_bits_of_the_per_tensor_ops():
    from privacy_engine.noise import BandMFNoise

    shapes = [(4, 4), (4,), (3, 2), (5,), (1,)]
    sums = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    sums[1][0], sums[1][1], sums[3][0] = float("nan"), float("inf"), -0.0
    for divide_by in (8.0, 7.3):
        released = []
        for use_vector in (True, False):
            mechanism = GaussianNoise(seed=5)
            if not use_vector:
                mechanism._adds_in_noise_vector = lambda group, targets: False
            tensors = [t.clone() for t in sums]
            mechanism.add_noise_(tensors, 1.0, 2.0, divide_by=divide_by)
            if use_vector:
                (group,) = mechanism._groups
                assert mechanism._adds_in_noise_vector(group, tensors)
            released.append(tensors)
        for a, b in zip(*released):
            assert torch.equal(_bits(a), _bits(b))
    # A mechanism that keeps its noise (BandMF's history) never adds in the noise vector.
    bandmf = BandMFNoise((1.0, 0.5), seed=1)
    bandmf.add_noise_([t.clone() for t in sums], 1.0, 1.0, divide_by=8.0)
    assert not bandmf._adds_in_noise_vector(bandmf._groups[0], [t.clone() for t in sums])
