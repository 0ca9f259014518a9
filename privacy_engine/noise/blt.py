"""Buffered-linear-Toeplitz noise (``BLTNoise``): correlated noise with ``d`` buffers per parameter.

A BLT strategy (Dvijotham, McMahan et al. 2024, arXiv:2404.16706; McMahan et al. 2024, arXiv:2408.08868)
is a lower-triangular Toeplitz matrix ``C`` whose first column is ``t_0 = 1`` and, for ``k >= 1``,

    t_k = sum_i output_scale[i] * buf_decay[i] ** (k - 1),

(a rational generating function with ``d = len(buf_decay)`` poles). The mechanism releases
``G + C^{-1} Z`` like BandMF, but ``C^{-1} z`` is streamed with ``d`` buffers instead of ``b - 1`` past rows:
solving ``C x = z`` row by row,

    x_t = z_t - sum_i output_scale[i] * buf_i,    then    buf_i <- buf_decay[i] * buf_i + x_t,

so the noise memory is ``d`` vectors of the parameters' size however many steps the correlation spans.

Optimisation (``optimize_blt``). The loss is the one of JAX Privacy's ``buffered_toeplitz.LossFn.build_min_sep``
with ``error="mean"``: the mean over the ``n`` steps of the expected squared error of the noisy prefix sums
(``(1/n) sum_i ||row_i(A C^{-1})||^2``, ``A`` the prefix-sum matrix) times the sensitivity squared of ``C``
for min-separation participation (``minsep_sensitivity_squared``). It is parameterised by the pair of
buffer decays of ``C`` and of ``C^{-1}`` (the output scales of both follow in closed form, Lemma 5.2 of
arXiv:2404.16706) and carries the same small barrier terms that keep the strategy in the well-behaved class
of arXiv:2504.21413 (decays in (0, 1), positive output scales of ``C``, negative ones of ``C^{-1}``,
``sum(output_scale) < 1`` and ``sum(output_scale / buf_decay) < 1``). The gradients come from torch's
autograd in float64 and the minimiser is scipy's L-BFGS-B; ``tests/blt_jax_reference.json`` holds JAX
Privacy's optima on the same cases for comparison.

Sensitivity. For a Toeplitz ``C`` with non-negative, non-increasing coefficients, the worst case over
participation patterns with at most ``k`` participations at least ``min_sep`` steps apart is ``k``
participations exactly ``min_sep`` apart starting at step 0, all with the same clipped gradient
(arXiv:2405.13763, Theorem 2); ``BLTStrategy`` refuses parameters that do not give such coefficients.

Accounting (event kind ``"blt"``, ``blt_event``): the Gaussian mechanism on ``C G`` with that sensitivity,
**without amplification by sampling** (no amplification result applies to a non-banded ``C``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import dp_accounting
import numpy as np
import torch

from accountants.events import EventSpec, Sampling, register_event_kind
from privacy_engine.noise.layout import _DeviceGroup
from privacy_engine.noise.mechanism import NoiseMechanism

__all__ = [
    "BLTNoise",
    "BLTStrategy",
    "blt_event",
    "blt_expected_error",
    "blt_loss",
    "minsep_sensitivity_squared",
    "optimize_blt",
]

#: Largest number of steps the strategy functions accept (they hold ``n x num_buffers`` float64 powers).
MAX_BLT_STEPS = 10**7
#: Most buffers ``optimize_blt`` accepts: beyond ~10 the optimisation is numerically ill-conditioned (JAX
#: Privacy refuses more than 15 for the same reason) and 3-6 are usually best.
MAX_NUM_BUFFERS = 12
# The barrier terms' weight and the gap kept between buffer decays, as in JAX Privacy's LossFn defaults.
_PENALTY_STRENGTH = 1e-8
_MIN_DECAY_GAP = 1e-12


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _steps(name: str, value: Any) -> int:
    value = _positive_int(name, value)
    if value > MAX_BLT_STEPS:
        raise ValueError(f"{name}={value} exceeds MAX_BLT_STEPS={MAX_BLT_STEPS} (the strategy's coefficients over "
                         f"{name} steps are held in memory)")  # fmt: skip
    return value


@dataclass(frozen=True, kw_only=True)
class BLTStrategy:
    """The parameters of a BLT strategy ``C`` (see the module docstring): ``buf_decay`` (theta) and
    ``output_scale`` (omega), one per buffer, kept as tuples of floats with the decays in decreasing order.

    Guarantee: ``C``'s Toeplitz coefficients are non-negative and non-increasing for every ``n``
    (``0 <= buf_decay < 1``, ``output_scale >= 0``, ``sum(output_scale) <= 1``), the condition under which
    ``minsep_sensitivity_squared`` is the sensitivity.

    ==========================================  =======================================
    case                                        result
    ==========================================  =======================================
    lengths differ, empty, not 1-D, not finite  ValueError naming the field
    a buf_decay outside [0, 1)                  ValueError naming buf_decay
    an output_scale < 0 or sum > 1              ValueError naming output_scale
    ==========================================  =======================================
    """

    buf_decay: tuple[float, ...]
    output_scale: tuple[float, ...]

    def __post_init__(self) -> None:
        arrays = {}
        for name in ("buf_decay", "output_scale"):
            try:
                array = np.asarray(getattr(self, name), dtype=np.float64)
            except (TypeError, ValueError) as error:
                raise ValueError(f"{name} must be a 1-D sequence of numbers: {error}") from error
            if array.ndim != 1 or array.size == 0 or not np.all(np.isfinite(array)):
                raise ValueError(f"{name} must be a non-empty 1-D sequence of finite numbers, got {array.tolist()}")
            arrays[name] = array
        decay, scale = arrays["buf_decay"], arrays["output_scale"]
        if decay.size != scale.size:
            raise ValueError(
                f"buf_decay has {decay.size} entries and output_scale {scale.size}: one of each per buffer"
            )
        if np.any(decay < 0) or np.any(decay >= 1):
            raise ValueError(f"buf_decay must be in [0, 1) (a decaying buffer), got {decay.tolist()}")
        if np.any(scale < 0) or scale.sum() > 1 + 1e-12:
            raise ValueError(
                f"output_scale must be >= 0 with sum <= 1 (so that C's coefficients are non-negative and "
                f"non-increasing, which the sensitivity assumes), got {scale.tolist()} (sum {scale.sum():.6g})"
            )
        order = np.argsort(-decay, kind="stable")
        object.__setattr__(self, "buf_decay", tuple(float(x) for x in decay[order]))
        object.__setattr__(self, "output_scale", tuple(float(x) for x in scale[order]))

    @property
    def num_buffers(self) -> int:
        """``d``: the buffers per parameter the noise is streamed with."""
        return len(self.buf_decay)

    def toeplitz_coefficients(self, n: int) -> np.ndarray:
        """``C``'s first column ``(t_0, ..., t_{n-1})`` in float64."""
        return _toeplitz_coefficients(np.asarray(self.buf_decay), np.asarray(self.output_scale), _steps("n", n))

    def inverse_toeplitz_coefficients(self, n: int) -> np.ndarray:
        """``C^{-1}``'s first column (the impulse response of the streaming recursion), in float64."""
        n = _steps("n", n)
        impulse = np.zeros(n)
        impulse[0] = 1.0
        return stream_inverse(self, impulse[:, None])[:, 0]

    def materialize(self, n: int) -> np.ndarray:
        """The dense ``n x n`` matrix ``C`` (for tests and small ``n``)."""
        column = self.toeplitz_coefficients(n)
        index = np.arange(n)
        lags = index[:, None] - index[None, :]
        return np.where(lags >= 0, column[np.clip(lags, 0, None)], 0.0)


def _toeplitz_coefficients(decay: np.ndarray, scale: np.ndarray, n: int) -> np.ndarray:
    powers = np.arange(max(n - 1, 0), dtype=np.float64)
    with np.errstate(under="ignore"):
        tail = (decay[None, :] ** powers[:, None]) @ scale
    return np.concatenate([[1.0], tail])[:n]


def stream_inverse(strategy: BLTStrategy, rows: np.ndarray) -> np.ndarray:
    """``C^{-1} rows`` computed row by row with ``d`` buffers, the recursion ``BLTNoise`` runs (float64).

    ``rows`` has shape ``(n, m)``; the result has the same shape. A reference for tests and small inputs.
    """
    rows = np.asarray(rows, dtype=np.float64)
    decay, scale = np.asarray(strategy.buf_decay), np.asarray(strategy.output_scale)
    buffers = np.zeros((decay.size, rows.shape[1]))
    out = np.empty_like(rows)
    for t in range(rows.shape[0]):
        out[t] = rows[t] - scale @ buffers
        buffers = decay[:, None] * buffers + out[t]
    return out


def minsep_sensitivity_squared(
    coefficients: Sequence[float] | np.ndarray, min_sep: int, max_participations: int | None = None
) -> float:
    """Sensitivity squared of the lower-triangular Toeplitz ``C`` with first column ``coefficients`` (its size
    is ``n``) when each example takes part at most ``max_participations`` times (None: ``ceil(n / min_sep)``),
    at least ``min_sep`` steps apart, each time with a gradient of L2 norm at most 1.

    Guarantee: for non-negative, non-increasing coefficients this is exactly ``max ||sum_j C[:, p_j] g_j||^2``
    over those patterns (arXiv:2405.13763, Theorem 2: the worst pattern is ``0, min_sep, 2 min_sep, ...`` with
    equal gradients), computed in O(n). Other coefficients: ValueError (the formula would not be an upper
    bound).

    ======================================  ============================
    case                                    result
    ======================================  ============================
    max_participations = 1                  ``||coefficients||^2``
    min_sep >= n                            one participation
    negative or increasing coefficients     ValueError naming them
    min_sep, max_participations < 1         ValueError naming them
    ======================================  ============================
    """
    coefficients = np.asarray(coefficients, dtype=np.float64)
    if coefficients.ndim != 1 or coefficients.size == 0:
        raise ValueError(f"coefficients must be a non-empty 1-D sequence, got shape {coefficients.shape}")
    if np.any(coefficients < 0) or np.any(np.diff(coefficients) > 1e-15 * coefficients[0]):
        raise ValueError("coefficients must be non-negative and non-increasing for the min-separation sensitivity")
    min_sep = _positive_int("min_sep", min_sep)
    n = coefficients.size
    k = -(-n // min_sep)
    if max_participations is not None:
        k = min(k, _positive_int("max_participations", max_participations))
    return float(_minsep_squared(torch.as_tensor(coefficients), min_sep, k))


def _minsep_squared(coefficients: torch.Tensor, min_sep: int, participations: int) -> torch.Tensor:
    # Row i of C x for x the indicator of 0, b, 2b, ...: sum of c[i - j b] over the first k participations,
    # i.e. a cumulative sum along each residue class mod b, minus what lies k participations back.
    n = coefficients.shape[0]
    padding = (-n) % min_sep
    padded = torch.nn.functional.pad(coefficients, (0, padding))
    summed = padded.reshape(-1, min_sep).cumsum(dim=0).reshape(-1)
    cut = min_sep * participations
    if cut < summed.shape[0]:
        summed = torch.cat([summed[:cut], summed[cut:] - summed[:-cut]])
    summed = summed[:n]
    return summed @ summed


def blt_loss(strategy: BLTStrategy, n: int, *, min_sep: int = 1, max_participations: int | None = None) -> float:
    """Mean expected squared error of the noisy prefix sums over ``n`` steps per unit noise multiplier:
    ``minsep_sensitivity_squared(C) * (1/n) sum_i ||row_i(A C^{-1})||^2`` (JAX Privacy's
    ``LossFn.build_min_sep(error="mean")`` loss; BandMF's ``strategy_loss`` is the same quantity for a banded
    ``C`` with one participation per ``b`` steps).

    Guarantee: equals the dense float64 computation on the ``n x n`` matrices up to rounding. Edge cases as
    ``minsep_sensitivity_squared``; ``n < 1`` or above ``MAX_BLT_STEPS``: ValueError naming ``n``.
    """
    n = _steps("n", n)
    sensitivity_squared = minsep_sensitivity_squared(strategy.toeplitz_coefficients(n), min_sep, max_participations)
    return sensitivity_squared * _mean_error(strategy.inverse_toeplitz_coefficients(n))


def _mean_error(inverse_coefficients: np.ndarray) -> float:
    step_response = np.cumsum(inverse_coefficients)  # first column of A C^{-1}, a Toeplitz matrix
    n = step_response.size
    return float(np.cumsum(step_response**2).sum() / n)


def blt_expected_error(strategy: BLTStrategy, n: int, noise_multiplier: float, *, min_sep: int = 1) -> float:
    """``blt_loss * noise_multiplier**2``: the mean expected squared error per coordinate of the noisy prefix
    sums over ``n`` steps in units of ``max_grad_norm**2``, when ``BLTNoise`` scales its noise by the
    sensitivity for ``min_sep`` (comparable with ``strategy.expected_error`` of BandMF and DP-SGD).
    ``noise_multiplier = 0``: 0.0; negative or NaN: ValueError naming it."""
    if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
    if noise_multiplier == 0:
        return 0.0
    return blt_loss(strategy, n, min_sep=min_sep) * float(noise_multiplier) ** 2


# ---------------------------------------------------------------------------------------------- optimisation
def _scales_from_decays(decay: torch.Tensor, other_decay: torch.Tensor) -> torch.Tensor:
    """Output scales of the BLT with poles ``decay`` whose inverse has poles ``other_decay`` (the generating
    function ``prod(1 - other x) / prod(1 - decay x)``, partial fractions)."""
    numerators = torch.prod(decay[:, None] - other_decay[None, :], dim=1)
    differences = decay[:, None] - decay[None, :]
    differences = differences + torch.eye(decay.shape[0], dtype=decay.dtype)
    return numerators / torch.prod(differences, dim=1)


def _inverse_decays(decay: np.ndarray, scale: np.ndarray) -> np.ndarray:
    # The poles of 1 / C(x): eigenvalues of diag(decay) - scale 1^T (the state matrix of the recursion
    # x_t = z_t - scale . buf, buf <- decay * buf + x_t).
    return np.sort(np.linalg.eigvals(np.diag(decay) - np.outer(scale, np.ones_like(scale))).real)[::-1].copy()


def _rational_start(num_buffers: int) -> tuple[np.ndarray, np.ndarray]:
    """A starting point: a rational approximation of ``sqrt(1 - x)`` (the optimal Toeplitz ``C^{-1}`` for
    one participation) with ``num_buffers`` poles (arXiv:2404.16706, Proposition 4.5), moved inside the
    feasible set. Returns the decays of ``C`` and of ``C^{-1}``."""
    half = (num_buffers + 1) // 2
    step = 1.6 * math.pi / math.sqrt(2 * (half + 1))
    ks = np.arange(-half + 1, num_buffers - half + 1) - 1
    inverse_decay = 1.0 / (1.0 + np.exp(2 * step * ks))
    inverse_scale = -(inverse_decay**2) * np.exp(3 * step * ks)
    inverse_scale /= np.sum(np.exp(step * ks) * inverse_decay)
    decay = _inverse_decays(inverse_decay, inverse_scale)
    scale = _scales_from_decays(torch.as_tensor(decay), torch.as_tensor(inverse_decay)).numpy()
    decay = decay * min(1.0, (1 - 1e-6) / decay.max())
    scale = scale * min(1.0, (1 - 1e-6) / float(np.sum(scale / decay)))
    return decay, _inverse_decays(decay, scale)


def _min_gap(values: torch.Tensor) -> torch.Tensor:
    if values.shape[0] < 2:
        return torch.tensor(math.inf, dtype=values.dtype)
    differences = (values[:, None] - values[None, :]).abs() + torch.diag(torch.full_like(values, math.inf))
    return differences.min()


def _objective(decay: torch.Tensor, inverse_decay: torch.Tensor, n: int, min_sep: int, participations: int,
               normaliser: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(penalised normalised loss, unpenalised loss) of the pair of decays, differentiable."""
    scale = _scales_from_decays(decay, inverse_decay)
    inverse_scale = _scales_from_decays(inverse_decay, decay)
    powers = torch.arange(n - 1, dtype=decay.dtype)
    one = torch.ones(1, dtype=decay.dtype)
    coefficients = torch.cat([one, (decay[None, :] ** powers[:, None]) @ scale])
    inverse_coefficients = torch.cat([one, (inverse_decay[None, :] ** powers[:, None]) @ inverse_scale])
    step_response = inverse_coefficients.cumsum(0)
    mean_error = (step_response**2).cumsum(0).mean()
    loss = mean_error * _minsep_squared(coefficients, min_sep, participations)
    barriers = [
        -torch.log(decay).sum(), -torch.log(1 - decay).sum(), -torch.log(scale).sum(),
        -torch.log(inverse_decay).sum(), -torch.log(1 - inverse_decay).sum(), -torch.log(-inverse_scale).sum(),
        -torch.log(1 - scale.sum()), -torch.log(1 - (scale / decay).sum()),
    ]  # fmt: skip
    if decay.shape[0] > 1:
        barriers.append(
            -torch.log(_min_gap(decay) - _MIN_DECAY_GAP) - torch.log(_min_gap(inverse_decay) - _MIN_DECAY_GAP)
        )
    return loss / normaliser + _PENALTY_STRENGTH * sum(barriers), loss


def _lbfgs(objective: Callable[[np.ndarray], tuple[float, np.ndarray | None]], start: np.ndarray, *,
           max_iterations: int, memory: int = 15) -> np.ndarray:  # fmt: skip
    """Minimise ``objective`` (value and gradient; ``inf`` outside its domain) by L-BFGS with a backtracking
    (Armijo) line search. The barriers make the loss infinite just outside the feasible set, where a
    Wolfe line search (scipy's) gives up; halving the step until the value is finite and decreases does not.
    The first step is at most 1e-3 per coordinate."""
    x = start
    value, gradient = objective(x)
    steps: list[np.ndarray] = []
    changes: list[np.ndarray] = []
    history = [value]
    for _ in range(max_iterations):
        direction = -_two_loop(gradient, steps, changes)
        if gradient @ direction >= 0:  # not a descent direction: restart from the scaled gradient
            steps, changes = [], []
            direction = -_two_loop(gradient, steps, changes)
        length, accepted = 1.0, False
        for _ in range(80):
            candidate = x + length * direction
            candidate_value, candidate_gradient = objective(candidate)
            if math.isfinite(candidate_value) and candidate_value <= value + 1e-4 * length * (gradient @ direction):
                accepted = True
                break
            length *= 0.5
        if not accepted:
            break
        step, change = candidate - x, candidate_gradient - gradient
        if step @ change > 0:
            steps, changes = (steps + [step])[-memory:], (changes + [change])[-memory:]
        x, value, gradient = candidate, candidate_value, candidate_gradient
        history.append(value)
        # Converged: less than 1e-10 (relative) gained over the last 10 iterations.
        if len(history) > 10 and history[-11] - value <= 1e-10 * abs(value):
            break
    return x


def _two_loop(gradient: np.ndarray, steps: list[np.ndarray], changes: list[np.ndarray]) -> np.ndarray:
    """The L-BFGS approximation of (inverse Hessian) @ gradient."""
    q = gradient.copy()
    alphas = []
    for step, change in zip(reversed(steps), reversed(changes)):
        alpha = (step @ q) / (change @ step)
        alphas.append(alpha)
        q -= alpha * change
    if steps:
        q *= (steps[-1] @ changes[-1]) / (changes[-1] @ changes[-1])
    else:
        q *= min(1.0, 1e-3 / (np.abs(gradient).max() + 1e-300))
    for (step, change), alpha in zip(zip(steps, changes), reversed(alphas)):
        q += step * (alpha - (change @ q) / (change @ step))
    return q


def optimize_blt(
    n: int,
    num_buffers: int,
    *,
    min_sep: int = 1,
    max_participations: int | None = None,
    max_iterations: int = 1000,
) -> BLTStrategy:
    """The BLT strategy with ``num_buffers`` buffers minimising ``blt_loss`` for ``n`` steps and min-separation
    participation (``min_sep``; at most ``max_participations``, None: ``ceil(n / min_sep)``).

    L-BFGS on the decays of ``C`` and ``C^{-1}`` with exact float64 gradients (torch autograd) and the
    barrier terms of the module docstring, started from the rational approximation of the optimal
    one-participation strategy (as JAX Privacy's ``buffered_toeplitz.optimize_loss``). The loss has several
    local optima (buffers that end up unused or with equal decays), so the search is run twice, on the decays
    themselves and on their logits (which resolves decays close to 1), and the lower loss is kept.

    Guarantee: the result is a valid ``BLTStrategy`` (so ``minsep_sensitivity_squared`` is its sensitivity)
    with finite loss, no larger than the starting point's. It is a local optimum found numerically: on the
    cases of ``tests/blt_jax_reference.json`` its loss is at most 1e-4 (relative) above JAX Privacy's (and
    sometimes below: another local optimum).

    ==============================  =============================================
    case                            result
    ==============================  =============================================
    num_buffers > MAX_NUM_BUFFERS   ValueError naming num_buffers
    n, num_buffers, min_sep < 1     ValueError naming the argument
    n > MAX_BLT_STEPS               ValueError naming n
    ==============================  =============================================
    """
    n = _steps("n", n)
    num_buffers = _positive_int("num_buffers", num_buffers)
    if num_buffers > MAX_NUM_BUFFERS:
        raise ValueError(f"num_buffers={num_buffers} exceeds MAX_NUM_BUFFERS={MAX_NUM_BUFFERS}: the optimisation is "
                         "ill-conditioned with that many poles, and 3 to 6 buffers are usually best")  # fmt: skip
    min_sep = _positive_int("min_sep", min_sep)
    participations = -(-n // min_sep)
    if max_participations is not None:
        participations = min(participations, _positive_int("max_participations", max_participations))
    max_iterations = _positive_int("max_iterations", max_iterations)
    # The loss grows like k + (1 + ln n / pi)^2; dividing by it keeps the barriers' relative weight the same
    # across n and k (JAX Privacy normalises the same way).
    normaliser = participations + (1 + math.log(n) / math.pi) ** 2

    def searched(to_decays: Callable[[torch.Tensor], torch.Tensor], start: np.ndarray) -> BLTStrategy | None:
        def objective(x: np.ndarray) -> tuple[float, np.ndarray | None]:
            point = torch.tensor(x, dtype=torch.float64, requires_grad=True)
            with torch.enable_grad():
                decays = to_decays(point)
                value, _ = _objective(decays[:num_buffers], decays[num_buffers:], n, min_sep, participations,
                                      normaliser)  # fmt: skip
                if not torch.isfinite(value):
                    return math.inf, None
                value.backward()
            gradient = point.grad.numpy()
            return (float(value.detach()), gradient) if np.all(np.isfinite(gradient)) else (math.inf, None)

        decays = to_decays(torch.as_tensor(_lbfgs(objective, start, max_iterations=max_iterations)))
        scale = _scales_from_decays(decays[:num_buffers], decays[num_buffers:])
        try:
            return BLTStrategy(buf_decay=tuple(decays[:num_buffers].tolist()), output_scale=tuple(scale.tolist()))
        except ValueError:  # cannot happen from a finite barrier value; kept as a guard
            return None

    decay, inverse_decay = _rational_start(num_buffers)
    start = np.concatenate([decay, inverse_decay])
    candidates = [
        searched(lambda x: x, start),
        searched(torch.sigmoid, np.log(start) - np.log1p(-start)),
    ]
    start_scale = _scales_from_decays(torch.as_tensor(decay), torch.as_tensor(inverse_decay))
    candidates.append(BLTStrategy(buf_decay=tuple(decay.tolist()), output_scale=tuple(start_scale.tolist())))
    return min((c for c in candidates if c is not None),
               key=lambda c: blt_loss(c, n, min_sep=min_sep, max_participations=max_participations))  # fmt: skip


# ---------------------------------------------------------------------------------------------- the event
@functools.lru_cache(maxsize=256)
def _sensitivity(buf_decay: tuple[float, ...], output_scale: tuple[float, ...], steps: int, min_sep: int) -> float:
    strategy = BLTStrategy(buf_decay=buf_decay, output_scale=output_scale)
    return math.sqrt(minsep_sensitivity_squared(strategy.toeplitz_coefficients(steps), min_sep))


@register_event_kind("blt")
def blt_event(
    *,
    noise_multiplier: float,
    sampling: Sampling,
    steps: int,
    num_bands: int,
    buf_decay: Sequence[float],
    output_scale: Sequence[float],
    noise_sensitivity: float,
) -> dp_accounting.DpEvent:
    """The event of ``steps`` steps of ``BLTNoise`` whose fresh draws have std ``noise_multiplier *
    max_grad_norm * noise_sensitivity``, with every example taking part in at most one of any ``num_bands``
    consecutive steps (cyclic sampling over ``num_bands`` groups; 1: any step).

    Guarantee: the first ``steps`` released rows are post-processing of ``C G + Z`` restricted to those rows,
    a Gaussian mechanism whose L2 sensitivity is ``S = sqrt(minsep_sensitivity_squared(C over steps,
    num_bands))`` times the clip norm; the event is ``GaussianDpEvent(noise_multiplier * noise_sensitivity /
    S)``, **not amplified** by the sampling (valid whatever batches are drawn, as long as the participation
    pattern holds). ``S`` grows with ``steps``, so a run longer than planned is accounted correctly (its
    epsilon grows faster). The event covers the steps *from the start of the strategy*, so a run's BLT steps
    must be one ledger entry: ``BLTNoise`` refuses a change of ``noise_multiplier * max_grad_norm`` (its steps
    merge into one entry), and the kind is marked ``whole_run`` so that an accountant refuses to record a
    second entry of it for the same source (``accountants.events.entries_compose``).

    ==============================  =========================================
    case                            result
    ==============================  =========================================
    steps = 0 or sample_rate = 0    NoOpDpEvent (nothing data-dependent)
    noise_multiplier = 0            GaussianDpEvent(0): epsilon inf
    batches_per_step > 1            ValueError (one batch per step only)
    invalid strategy parameters     ValueError naming them (``BLTStrategy``)
    noise_sensitivity <= 0          ValueError naming it
    ==============================  =========================================
    """
    if sampling.batches_per_step > 1:
        raise ValueError("BLT noise is accounted for one batch per step; batches_per_step > 1 is refused")
    if not (isinstance(noise_sensitivity, (int, float)) and math.isfinite(noise_sensitivity) and noise_sensitivity > 0):
        raise ValueError(f"noise_sensitivity must be a positive finite number, got {noise_sensitivity!r}")
    if steps == 0 or sampling.sample_rate == 0.0:
        return dp_accounting.NoOpDpEvent()
    sensitivity = _sensitivity(tuple(buf_decay), tuple(output_scale), int(steps), int(num_bands))
    return dp_accounting.GaussianDpEvent(noise_multiplier * noise_sensitivity / sensitivity)


# One run from its start (see the guarantee): an accountant refuses a second entry of this kind for one source.
blt_event.whole_run = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------- the mechanism
@dataclass(eq=False)
class _BLTBuffers:
    """BLT's per-device constants (``_DeviceGroup.mechanism_buffers``); the buffers are ``group.history``."""

    decay: torch.Tensor  # (d, 1)
    scale: torch.Tensor  # (d,)


class BLTNoise(NoiseMechanism):
    """Buffered-linear-Toeplitz noise: step ``t`` adds row ``t`` of ``C^{-1} Z``, streamed with ``d`` buffers.

    ``C`` is the BLT strategy ``strategy`` (a ``BLTStrategy``, e.g. from ``optimize_blt``); ``Z`` has iid
    ``N(0, s^2)`` entries with ``s = noise_multiplier * max_grad_norm * sensitivity`` and ``sensitivity =
    sqrt(minsep_sensitivity_squared(C over total_steps, min_sep))``.

    Guarantee: the released gradients equal ``C^{-1} (C G + Z)`` (post-processing of the Gaussian mechanism
    on ``C G``). When every example takes part in steps at least ``min_sep`` apart (cyclic Poisson sampling
    over ``min_sep`` groups guarantees it; ``min_sep = 1``: any sampling), one example changes ``C G`` over
    the first ``total_steps`` rows by at most ``max_grad_norm * sensitivity`` in L2, so the run is as private
    as **one un-amplified** Gaussian mechanism with noise multiplier ``noise_multiplier``
    (``privacy_event``: kind ``"blt"``, ``blt_event``; the sampling's amplification is not used, because no
    amplification analysis covers a non-banded ``C``). More steps than ``total_steps`` are allowed and
    accounted at their larger sensitivity. Memory: ``d`` float vectors per device of the parameters' size
    (``group.history``, saved in ``state_dict``), besides the draw itself.

    ``noise_multiplier * max_grad_norm`` must be the same at every step (one scale of ``Z``).

    ===================================  ============================================
    case                                 result
    ===================================  ============================================
    noise_multiplier = 0 at every step   no noise, step advances
    noise scale changes between steps    ValueError, nothing changed
    min_sep, total_steps < 1             ValueError naming them
    strategy not a BLTStrategy           TypeError
    secure_mode with a seed              ValueError
    ===================================  ============================================
    """

    def __init__(
        self,
        strategy: BLTStrategy,
        *,
        min_sep: int,
        total_steps: int,
        seed: int | None = None,
        secure_mode: bool = False,
        prefetch: bool | None = None,
        noise_stream: str = "mt19937",
    ) -> None:
        if not isinstance(strategy, BLTStrategy):
            raise TypeError(f"strategy must be a BLTStrategy (e.g. optimize_blt(...)), got {type(strategy).__name__}")
        min_sep = _positive_int("min_sep", min_sep)
        total_steps = _steps("total_steps", total_steps)
        super().__init__(seed=seed, secure_mode=secure_mode, prefetch=prefetch, noise_stream=noise_stream)
        self.strategy = strategy
        self.min_sep = min_sep
        self.total_steps = total_steps
        self.sensitivity = _sensitivity(strategy.buf_decay, strategy.output_scale, total_steps, min_sep)
        self._fixed_scale: float | None = None
        self._this_step_scale = 0.0
        self._drawing = False

    @property
    def num_buffers(self) -> int:
        """``d``, the buffers per parameter."""
        return self.strategy.num_buffers

    def noise_std(self, noise_multiplier: float, max_grad_norm: float) -> float:
        """``s = noise_multiplier * max_grad_norm * sensitivity``, the std of the fresh draws ``z_t``."""
        return self._validated_noise_scale(noise_multiplier, max_grad_norm) * self.sensitivity

    def privacy_event(self) -> EventSpec:
        """Kind ``"blt"`` (``blt_event``): the un-amplified Gaussian mechanism on ``C G`` at the min-separation
        sensitivity, with cyclic sampling over ``min_sep`` groups (``num_bands``)."""
        return EventSpec(
            kind="blt", num_bands=self.min_sep,
            parameters={"buf_decay": self.strategy.buf_decay, "output_scale": self.strategy.output_scale,
                        "noise_sensitivity": self.sensitivity},
        )  # fmt: skip

    def _before_step(self, noise_scale: float) -> None:
        fixed = self._fixed_scale
        if fixed is not None and not math.isclose(noise_scale, fixed, rel_tol=1e-9):
            raise ValueError(
                "BLTNoise needs the same noise_multiplier * max_grad_norm at every step (first step: "
                f"{fixed}, now: {noise_scale}): the guarantee covers rows of Z with one scale"
            )
        self._this_step_scale = noise_scale

    def _draw_std(self, std: float) -> float:
        self._drawing = std > 0.0
        return std

    def _history_rows(self) -> int:
        return self.num_buffers

    def _buffers(self, group: _DeviceGroup) -> _BLTBuffers:
        if group.mechanism_buffers is None:
            group.mechanism_buffers = _BLTBuffers(
                decay=torch.tensor(self.strategy.buf_decay, dtype=group.dtype, device=group.device).unsqueeze(1),
                scale=torch.tensor(self.strategy.output_scale, dtype=group.dtype, device=group.device),
            )
        return group.mechanism_buffers

    def _form_noise(self, group: _DeviceGroup) -> float:
        # x_t = z_t - sum_i omega_i buf_i: reads the buffers, changes nothing (they are folded once recorded).
        group.noise.addmv_(group.history.t(), self._buffers(group).scale, alpha=-1.0)
        return 1.0

    def _advance(self) -> Callable[[], None]:
        # The buffers change only here, after the step is recorded (``_commit`` calls this function once
        # ``on_commit`` returned): an update in place of all d rows could not be undone bit for bit, so it is
        # not made before the accountant has recorded the step. In-place arithmetic on existing tensors.
        fixed_scale = self._this_step_scale if self._fixed_scale is None else self._fixed_scale
        groups = list(self._groups) if self._drawing else []

        def advance() -> None:
            self._fixed_scale = fixed_scale
            for group in groups:
                # buf_i <- decay_i * buf_i + x_t, one pass over the d buffers (in place: out is the input).
                torch.addcmul(group.noise, group.history, self._buffers(group).decay, out=group.history)

        return advance

    def restart_layout(self) -> None:
        """As ``NoiseMechanism.restart_layout``; the correlation restarts (buffers at zero). The strategy
        becomes block-diagonal with non-negative blocks, whose min-separation sensitivity is at most the
        Toeplitz one, so the same accounting holds."""
        super().restart_layout()

    def _extra_state(self) -> dict[str, Any]:
        return {
            "buf_decay": list(self.strategy.buf_decay),
            "output_scale": list(self.strategy.output_scale),
            "min_sep": self.min_sep,
            "total_steps": self.total_steps,
            "noise_scale": self._fixed_scale,
        }

    def _check_extra_state(self, state: dict[str, Any]) -> None:
        saved = (tuple(state["buf_decay"]), tuple(state["output_scale"]), state["min_sep"], state["total_steps"])
        mine = (self.strategy.buf_decay, self.strategy.output_scale, self.min_sep, self.total_steps)
        if saved != mine:
            raise ValueError(
                "state was saved by a BLTNoise with another strategy, min_sep or total_steps; build BLTNoise with "
                "those of the saved run"
            )

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._fixed_scale = state["noise_scale"]

    def __repr__(self) -> str:
        return (
            f"BLTNoise(num_buffers={self.num_buffers}, min_sep={self.min_sep}, total_steps={self.total_steps}, "
            f"secure_mode={self.secure_mode}, step={self.step})"
        )
