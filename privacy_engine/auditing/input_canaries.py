"""Input canaries for one-run auditing: canary examples appended to the dataset the private loader samples.

Each of ``num_canaries`` canaries is an example (input, label) that does not depend on the training data:
by default an input drawn from ``N(0, 1)`` with the shape and dtype of the dataset's first input and a label
uniform over ``num_classes``, each from ``numpy.random.default_rng([seed, stream, j])``; or
``canary_fn(j)``, the user's. Each canary is included with probability 1/2 (an independent fair coin; the
OS's in ``secure_mode``), and the included ones are appended to the dataset (``CanaryDataset``): the private
loader then samples them exactly as it samples the real examples (Poisson, cyclic Poisson for BandMF), they
are clipped, noised and accounted as examples. After training, canary ``j``'s score is ``-loss`` of the
trained model on it (``score_fn(model, example)`` when given): higher for the canaries the model has seen.
The scores are computed from the trained model and the (public, seeded) canaries only, without knowing
which were included: what one-run auditing needs (``CanaryScoreAuditor.epsilon_one_run``).

Including canaries changes the dataset: it holds ``n + k`` examples (``k`` the number included, about
``num_canaries / 2``), so the sample rate is ``batch_size / (n + k)`` and the steps of an epoch
``round((n + k) / batch_size)``; the accountant records that rate, the one the loader runs. (Strictly, the
rate then depends on ``k``: including canary ``j`` or not also moves every other example's rate by a factor
``1 +- 1 / (n + k)``, which the one-run null hypothesis, add or remove one example at a fixed rate, does not
cover; a divergence of order ``q / (n + k)`` a step, far below what the noise hides.) The private loader
``make_private`` returns holds the canaries: a second run built from it (without an audit, or with another)
trains on them as examples.

They add nothing to the clipped sums: as the optimizer's ``canaries`` component (``add_to_clipped_sums`` does
nothing) they only carry their state (seed, inclusion, releases counted) in the optimizer's DP state, so a
checkpoint holds it. The dataset is fixed when ``make_private`` builds the loader, so a resumed run must be
built with the same canaries (``AuditConfig(seed=...)`` of the saved run): ``check_state_dict`` refuses any
other (and, in secure mode, every resume: the inclusion came from the OS and cannot be drawn again).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from privacy_engine.auditing.auditor import CanaryScoreAuditor
from privacy_engine.noise.secure_random import secure_uniform
from privacy_engine.training.canary_slot import CanarySlot

__all__ = ["CanaryDataset", "InputCanaries"]

_STATE_KEYS = ("kind", "num_canaries", "seed", "included", "steps_scored")
_INCLUSION_STREAM = 0x696E636C  # entropy word of the inclusion coins' stream ("incl")
_EXAMPLE_STREAM = 0x6578616D  # entropy word of the canary examples' stream ("exam")


class InputCanaries:
    """``num_canaries`` canary examples drawn from ``seed``, each included with probability 1/2.

    Guarantee: each canary's inclusion is an independent fair coin (``included``); canary ``j``'s example
    depends on ``seed`` and ``j`` only (``canary_fn(j)`` when given), never on the training data; its score
    depends on the trained model and the example only, never on ``included``.

    ==================================  ================================================
    case                                result
    ==================================  ================================================
    num_canaries < 1                    ValueError naming num_canaries
    neither canary_fn nor num_classes   ValueError naming num_classes
    num_classes < 2                     ValueError naming num_classes
    example_like not (input, label)     ValueError naming canary_fn (give one)
    example_like's input not floating   ValueError naming canary_fn (give one)
    no step released                    the scores of the untrained model (the audit
                                        finds nothing)
    ==================================  ================================================
    """

    def __init__(
        self, num_canaries: int, seed: int | None, *, example_like: Any = None, num_classes: int | None = None,
        canary_fn: Callable[[int], Any] | None = None,
        score_fn: Callable[[nn.Module, Any], float] | None = None, secure_mode: bool = False,
    ) -> None:  # fmt: skip
        if num_canaries < 1:
            raise ValueError(f"num_canaries must be >= 1, got {num_canaries}")
        self.num_canaries, self.secure_mode = int(num_canaries), bool(secure_mode)
        self.canary_fn, self.score_fn = canary_fn, score_fn
        if canary_fn is None:
            if num_classes is None or num_classes < 2:
                raise ValueError(f"num_classes must be an int >= 2 without canary_fn, got {num_classes!r}")
            self._input_shape, self._input_dtype = _input_like(example_like)
        self.num_classes = None if num_classes is None else int(num_classes)
        #: The examples' seed (public: the canaries are needed to score).
        self.seed = int.from_bytes(os.urandom(8), "little") >> 1 if seed is None else int(seed)
        if self.secure_mode:
            included = secure_uniform(self.num_canaries) < 0.5
        else:
            included = torch.from_numpy(
                np.random.default_rng([self.seed, _INCLUSION_STREAM]).random(num_canaries) < 0.5
            )
        #: Which canaries are in the dataset (a fair coin each); secret until the audit.
        self.included = included.to(torch.bool)
        #: -loss of the trained model on each canary (float64); set by ``compute_scores``.
        self.scores = torch.zeros(self.num_canaries, dtype=torch.float64)
        #: Releases so far (the report's steps).
        self.steps_scored = 0
        self._examples: dict[int, Any] = {}

    @property
    def included_indices(self) -> list[int]:
        """The included canaries' indices, in order (the order they are appended to the dataset)."""
        return [int(j) for j in torch.nonzero(self.included).reshape(-1)]

    def example(self, index: int) -> Any:
        """Canary ``index``'s example: ``canary_fn(index)``, else ``(input, label)`` drawn from ``[seed, index]``
        (cached: the same object every call)."""
        if not 0 <= index < self.num_canaries:
            raise IndexError(f"canary index {index} out of range [0, {self.num_canaries})")
        if index not in self._examples:
            if self.canary_fn is not None:
                self._examples[index] = self.canary_fn(index)
            else:
                rng = np.random.default_rng([self.seed, _EXAMPLE_STREAM, index])
                values = rng.standard_normal(self._input_shape)
                features = torch.from_numpy(np.asarray(values)).to(self._input_dtype)
                self._examples[index] = (features, torch.tensor(int(rng.integers(self.num_classes))))
        return self._examples[index]

    # ------------------------------------------------------------------ the optimizer's component
    def add_to_clipped_sums(self, clipped_sums: Sequence[torch.Tensor], slot: CanarySlot) -> None:
        """``training.canary_slot.ClippedSumCanaries``: adds nothing (input canaries are examples of the loader's
        dataset, clipped and noised as the others are)."""

    def count_release(self, optimizer: Any) -> None:
        """A ``DPOptimizer`` step hook: count one release (the report's ``steps``)."""
        self.steps_scored += 1

    # ------------------------------------------------------------------ scores
    @torch.no_grad()
    def compute_scores(self, model: nn.Module) -> torch.Tensor:
        """Score every canary on ``model`` (in eval mode, restored after): ``score_fn(model, example)``, else
        ``-cross_entropy(model(input[None]), label[None])`` (a classifier's logits). Sets and returns ``scores``."""
        training = model.training
        model.eval()
        try:
            scores = [float(self._score(model, self.example(j))) for j in range(self.num_canaries)]
        finally:
            model.train(training)
        self.scores = torch.tensor(scores, dtype=torch.float64)
        return self.scores

    def _score(self, model: nn.Module, example: Any) -> float:
        if self.score_fn is not None:
            return self.score_fn(model, example)
        features, label = example
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        logits = model(torch.as_tensor(features).unsqueeze(0).to(device))
        target = torch.as_tensor(label).reshape(1).to(device)
        return -float(nn.functional.cross_entropy(logits.float(), target))

    def auditor(self) -> CanaryScoreAuditor:
        """A ``CanaryScoreAuditor`` over the last computed scores of the included and excluded canaries;
        ValueError if either set is empty (use more canaries)."""
        scores, included = self.scores.numpy(), self.included.numpy()
        return CanaryScoreAuditor(scores[included], scores[~included])

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain data (``torch.load(weights_only=True)``): the seed, inclusion and releases counted. As secret
        as the run (it says which canaries were included)."""
        return {"kind": "input", "num_canaries": self.num_canaries, "seed": self.seed,
                "included": self.included.clone(), "steps_scored": self.steps_scored}  # fmt: skip

    def check_state_dict(self, state: Any) -> None:
        """``ValueError`` naming the first mismatch unless ``load_state_dict(state)`` restores it; changes nothing.
        The saved canaries must be this run's (same seed and inclusion): the dataset the loader samples was
        built with them and cannot change under it."""
        if not isinstance(state, dict) or not set(_STATE_KEYS) <= set(state):
            raise ValueError(f"the canaries' state lacks some of {list(_STATE_KEYS)} (it was altered)")
        for key, here in (("kind", "input"), ("num_canaries", self.num_canaries)):
            if state[key] != here:
                raise ValueError(
                    f"the canaries' state has {key}={state[key]!r}, this audit {here!r}: use the saved audit="
                )
        included, steps = state["included"], state["steps_scored"]
        if (
            not isinstance(included, torch.Tensor)
            or included.dtype != torch.bool
            or included.numel() != self.num_canaries
        ):
            raise ValueError(f"the canaries' state's included is not a bool tensor of {self.num_canaries} entries")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"the canaries' state has steps_scored={steps!r}; expected an int >= 0")
        if self.secure_mode:
            raise ValueError(
                "input canaries in secure mode cannot be resumed: their inclusion came from the OS and the dataset "
                "this run samples holds other canaries; start a new audited run"
            )
        if state["seed"] != self.seed or not torch.equal(included.cpu(), self.included):
            raise ValueError(
                f"the checkpoint's input canaries were drawn from seed={state['seed']!r} ({int(included.sum())} "
                f"included), this run's from seed={self.seed} ({int(self.included.sum())} included): the loader's "
                f"dataset holds the canaries drawn when make_private built it; pass "
                f"audit=AuditConfig(seed={state['seed']!r}, ...) to the resumed make_private"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (checked first): the releases counted continue."""
        self.check_state_dict(state)
        self.steps_scored = int(state["steps_scored"])


class CanaryDataset(Dataset):
    """``dataset`` followed by the included canaries of ``canaries`` (in index order): ``len(dataset) + k``
    examples, ``k = canaries.included.sum()``.

    Guarantee: index ``i < len(dataset)`` is ``dataset[i]``; index ``len(dataset) + r`` is the ``r``-th
    included canary's example; no excluded canary is ever returned."""

    def __init__(self, dataset: Dataset, canaries: InputCanaries) -> None:
        self.dataset, self.canaries = dataset, canaries
        self.num_real = len(dataset)  # type: ignore[arg-type]
        self._canary_indices = canaries.included_indices

    def __len__(self) -> int:
        return self.num_real + len(self._canary_indices)

    def __getitem__(self, index: int) -> Any:
        index = int(index)
        if index < 0:
            index += len(self)
        if index < self.num_real:
            return self.dataset[index]
        return self.canaries.example(self._canary_indices[index - self.num_real])


def _input_like(example: Any) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of an ``(input, label)`` example's input; ValueError naming canary_fn otherwise."""
    if not isinstance(example, (tuple, list)) or len(example) != 2:
        raise ValueError(
            "input canaries without canary_fn need the dataset's examples to be (input, label) pairs; got "
            f"{type(example).__name__}: pass AuditConfig(canary_fn=...)"
        )
    features = torch.as_tensor(example[0])
    if not features.is_floating_point():
        raise ValueError(
            f"input canaries without canary_fn draw Gaussian inputs, but the dataset's inputs are {features.dtype}: "
            "pass AuditConfig(canary_fn=...)"
        )
    return tuple(features.shape), features.dtype
