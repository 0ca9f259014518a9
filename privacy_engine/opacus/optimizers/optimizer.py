"""``opacus.optimizers.optimizer``: ``DPOptimizer`` with Opacus's constructor and extension points.

Opacus's optimizer is extended by subclassing: a subclass overrides ``add_noise()`` to read each
parameter's clipped sum ``p.summed_grad`` and write ``p.grad``, using ``_check_processed_flag`` /
``_mark_as_processed`` to catch a sum used twice. Here clipping and noise run in the engine's
``DPOptimizer.pre_step``; a subclass's ``add_noise`` is called at the moment the engine would add its
noise, with ``p.summed_grad`` holding the clipped sum, and what it writes to ``p.grad`` is the
released gradient (divided by the expected batch size afterwards, as Opacus does in ``scale_grad``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.optim import Optimizer

from accountants.events import EventSpec
from privacy_engine.noise import GaussianNoise, NoiseMechanism
from privacy_engine.opacus._binding import optimizer_built
from privacy_engine.opacus.grad_sample import RELEASED_FLAG, _OpacusStateDict
from privacy_engine.settings_checks import check_unseeded_in_secure_mode
from privacy_engine.training.optimizer import DPOptimizer as _DPOptimizer

__all__ = ["DPOptimizer", "DPPerLayerOptimizer", "_check_processed_flag", "_generate_noise", "_mark_as_processed"]

_PROCESSED = "_processed"


def _mark_as_processed(obj: torch.Tensor | list[torch.Tensor]) -> None:
    """Mark a tensor (or each of a list) as used by an optimizer step: a second use raises in
    ``_check_processed_flag`` until ``zero_grad()`` drops it."""
    for tensor in [obj] if isinstance(obj, torch.Tensor) else list(obj):
        setattr(tensor, _PROCESSED, True)


def _check_processed_flag(obj: torch.Tensor | list[torch.Tensor]) -> None:
    """Raise ``ValueError`` if the tensor (or any of a list) was already used by a step
    (``_mark_as_processed``): a clipped sum released twice would be released without fresh noise."""
    for tensor in [obj] if isinstance(obj, torch.Tensor) else list(obj):
        if hasattr(tensor, _PROCESSED):
            raise ValueError(
                "this gradient was already used by an optimizer step: call optimizer.zero_grad() after every "
                "step, so that no clipped sum is released twice"
            )


def _generate_noise(std: float, reference: torch.Tensor, generator: torch.Generator | None = None,
                    secure_mode: bool = False) -> torch.Tensor:  # fmt: skip
    """Opacus's private helper, for scripts that import it: Gaussian noise of standard deviation ``std``
    with ``reference``'s shape, dtype and device, drawn from ``generator`` (torch's global generator when
    None); zeros when ``std`` is 0, ``ValueError`` when it is negative. With ``secure_mode`` the draw is
    the mean of four draws scaled by 2 (the same distribution; Opacus's defence against floating-point
    attacks). The engine's own noise step does not use it (``privacy_engine.noise``)."""
    if std < 0:
        raise ValueError(f"std must be >= 0; got {std!r}")
    zeros = torch.zeros(reference.shape, device=reference.device, dtype=reference.dtype)
    if std == 0:
        return zeros
    if not secure_mode:
        return torch.normal(mean=0.0, std=float(std), size=reference.shape, device=reference.device,
                            generator=generator).to(reference.dtype)  # fmt: skip
    total = zeros
    for _ in range(4):
        total = total + torch.normal(mean=0.0, std=float(std), size=reference.shape, device=reference.device,
                                     generator=generator).to(reference.dtype)  # fmt: skip
    return total / 2


def _check_generator(generator: torch.Generator | None) -> None:
    # Opacus draws its noise from this generator; ours is seeded by one draw from it at the first step.
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None; got {type(generator).__name__}")


class _SubclassNoise(NoiseMechanism):
    """The noise of a ``DPOptimizer`` subclass that overrides ``add_noise()`` (Opacus's extension
    point): at the engine's noise step, each parameter's clipped sum is handed over as
    ``p.summed_grad`` and the subclass's ``add_noise()`` writes ``p.grad``, which becomes the released
    gradient (copied into the tensor the engine then scales)."""

    num_bands = 1

    def __init__(self, *, secure_mode: bool) -> None:
        super().__init__(secure_mode=secure_mode)
        self.optimizer: DPOptimizer | None = None

    def noise_std(self, noise_multiplier: float, max_grad_norm: float) -> float:
        return noise_multiplier * max_grad_norm  # the Gaussian std the accountant assumes

    def privacy_event(self) -> EventSpec:
        return EventSpec()  # accounted as the Gaussian mechanism, as Opacus does (see DPOptimizer)

    def add_noise_(self, tensors, noise_multiplier: float, max_grad_norm: float, *, on_commit=None) -> None:
        # The engine's contract (NoiseMechanism.add_noise_): the noise is in place before on_commit()
        # records the release, and the step counts only if on_commit returns.
        optimizer = self.optimizer
        tensors = list(tensors)
        params = optimizer.params
        for param, clipped_sum in zip(params, tensors):
            param.summed_grad = clipped_sum.detach().clone()
        optimizer.add_noise()
        for param, released in zip(params, tensors):
            if param.grad is not released:
                released.copy_(param.grad)
                param.grad = released
        if on_commit is not None:
            on_commit()
        self._step += 1


class DPOptimizer(_DPOptimizer):
    """The engine's ``DPOptimizer`` (see ``privacy_engine.training.optimizer``) with Opacus's constructor
    (``generator=`` seeds the noise; Opacus's other keywords go to the engine's), Opacus's
    extension points (an ``add_noise()`` override, ``attach_step_hook``) and attributes
    (``accumulated_iterations``, ``grad_samples``, ``p.summed_grad`` inside ``add_noise``).

    Guarantee: as the engine's ``DPOptimizer`` when ``add_noise`` is not overridden. With an
    override, the released gradient is whatever the override writes: the accountant still records
    the Gaussian mechanism of ``noise_multiplier`` (as Opacus does), so the reported epsilon holds
    only if the override adds at least that noise (a warning says so at construction).
    ``max_grad_norm`` may be left out when a ready ``clipper=`` is given (``make_private`` does).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        noise_multiplier: float,
        max_grad_norm: float | None = None,
        expected_batch_size: float | None,
        loss_reduction: str = "mean",
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
        **kwargs: Any,
    ) -> None:
        custom_noise = type(self).add_noise is not DPOptimizer.add_noise
        check_unseeded_in_secure_mode("generator", generator, secure_mode=secure_mode)
        _check_generator(generator)
        if custom_noise:
            warnings.warn(
                f"{type(self).__name__} overrides add_noise(): the accountant records the Gaussian mechanism with "
                f"noise_multiplier={noise_multiplier}; the reported epsilon holds only if your noise is at least that "
                f"private",
                stacklevel=2,
            )
            kwargs["noise"] = _SubclassNoise(secure_mode=secure_mode)
        elif "noise" not in kwargs:
            kwargs["noise"] = GaussianNoise(seed=None, secure_mode=secure_mode)
            if generator is not None:
                kwargs["noise"].seed_lazily_from(generator)
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            secure_mode=secure_mode,
            **kwargs,
        )
        if custom_noise:
            self.noise.optimizer = self
            self._gaussian = GaussianNoise(seed=None, secure_mode=secure_mode)
            if generator is not None and not secure_mode:
                self._gaussian.seed_lazily_from(generator)
        # Opacus scripts never connect their pieces: the namespace connects a hand-built pair (opacus._binding).
        optimizer_built(self)

    # ------------------------------------------------------------------ Opacus's extension points
    def add_noise(self) -> None:
        """Opacus's noise step: ``p.grad = p.summed_grad + N(0, (noise_multiplier * max_grad_norm)^2)``
        for every parameter, each sum used once. The engine calls it only for subclasses that
        override it (and a subclass may call this one); otherwise its own noise step runs."""
        params = self.params
        for param in params:
            _check_processed_flag(param.summed_grad)
        noised = [param.summed_grad.clone() for param in params]
        gaussian = self.__dict__.get("_gaussian", self.noise)
        gaussian.add_noise_(noised, self.noise_multiplier, self.clipper.sensitivity)
        for param, grad in zip(params, noised):
            param.grad = grad.view_as(param)
            _mark_as_processed(param.summed_grad)

    def step(self, closure: Any = None) -> Any:
        """The engine's ``step`` (see ``privacy_engine.training.optimizer.DPOptimizer``); afterwards each
        parameter's ``p.grad_sample`` is still readable, as in Opacus, until ``zero_grad()`` or the
        next training forward.

        Guarantee: nothing more is released than by the engine's ``step``. The per-sample gradients
        kept are those the user could already read between ``backward()`` and ``step()``; they are
        never used again: the next ``step()`` drops them before it clips anything (a second
        ``step()`` without a new backward then finds nothing new and the step contract refuses it),
        and the next training forward of this namespace's wrappers drops them before its backward
        could add to them. They are kept only when every wrapper connected to this optimizer is one of this
        namespace's (an engine wrapper would add the next batch's rows to them: there they are
        cleared at ``step()`` as before).
        """
        # What an earlier step left for reading was released already: it must never be clipped again.
        for param in self.params:
            if getattr(getattr(param, "grad_sample", None), RELEASED_FLAG, False):
                param.grad_sample = None
        modules = list(self.contract.modules)
        keep = bool(modules) and all(isinstance(module, _OpacusStateDict) for module in modules)
        kept = {param: param.grad_sample for param in self.params if getattr(param, "grad_sample", None) is not None}
        # The step hooks run inside super().step(), after the release: they read accumulated_iterations as the
        # release recorded it, not as the passes waiting before it.
        self._stepping = True
        self._passes_before_step = self._waiting_passes()
        try:
            result = super().step(closure)
        finally:
            self._stepping = False
            self._clipped_passes = []
            self._fast_clipping_passes = 0
        if keep:
            for param, grad_sample in kept.items():
                if getattr(param, "grad_sample", None) is None:
                    setattr(grad_sample, RELEASED_FLAG, True)
                    param.grad_sample = grad_sample
        return result

    def _accounting_kwargs(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # What the engine records for the step being released, kept for accumulated_iterations (step hooks
        # run after the release, when the step's contributions are already consumed).
        recorded = super()._accounting_kwargs(*args, **kwargs)
        self._last_recorded = recorded  # the engine completes it for fixed-size batches (their summed rate)
        # Loader batches in this release, for Opacus's accountant hook: the draws the engine records, or the
        # backward passes over distinct batches if more (k fixed-size batches are recorded as one draw at k
        # times the rate, which a hook given the loader's rate would under-count as one batch).
        self._released_batches = max(int(recorded.get("batches_per_step", 1)), self.__dict__.get("_passes_before_step", 1))
        return recorded

    def accumulate_pass(self, ticket: Any) -> None:
        """The engine's ``accumulate_pass`` (one completed backward pass clipped into the open step); the
        pass's per-sample gradients are kept for reading (``grad_samples``, ``accumulated_iterations``, as
        Opacus keeps its list of them) until the next ``step()`` or ``zero_grad()``. They were clipped
        once here and are never handed to the clipper again."""
        waiting = [getattr(param, "grad_sample", None) for param in self.params]
        super().accumulate_pass(ticket)
        if any(grads is not None for grads in waiting) and all(getattr(p, "grad_sample", None) is None for p in self.params):
            self.__dict__.setdefault("_clipped_passes", []).append(waiting)

    def _note_fast_clipping_pass(self) -> None:
        """A connected fast-clipping wrapper of this namespace clipped one backward pass into the open step (called
        at the pass's end, once the clipper holds it; a second pass over the same rows is refused by the wrapper)."""
        self._fast_clipping_passes = self.__dict__.get("_fast_clipping_passes", 0) + 1

    def _waiting_passes(self) -> int:
        """Backward passes (over distinct batches) accumulated into the open step so far: those already
        clipped (hooks mode: their per-sample gradients kept; fast clipping: clipped in the pass itself), and the
        last one while its per-sample gradients wait in ``grad_sample``."""
        unflushed = any(module.has_unflushed_passes for module in self.contract.modules)
        clipped = len(self.__dict__.get("_clipped_passes", ())) + self.__dict__.get("_fast_clipping_passes", 0)
        return clipped + int(unflushed)

    @property
    def accumulated_iterations(self) -> int:
        """Opacus's count of accumulated loader batches. Between backward passes and ``step()``: the
        backward passes over distinct batches accumulated into the open step (Opacus's ``len(p.grad_sample)``;
        several passes over one batch count once, their per-sample gradients being summed; a fast-clipping
        wrapper's passes count too, one per clipped backward: Opacus's ``DPOptimizerFastGradientClipping``
        answers 1 whatever was accumulated, which its accountant hook then records as one batch). Otherwise,
        and inside ``step()`` (read by Opacus's accountant hook), the loader batches of the last release: the draws the engine recorded
        (``batches_per_step``), or its backward passes over distinct batches if more (``poisson_sampling=False``:
        k fixed-size batches, which the engine records as one draw at k times the rate, and so does the hook,
        see ``_released_disjoint_batches``); 1 for a plain step."""
        if not self.__dict__.get("_stepping", False):
            waiting = self._waiting_passes()
            if waiting:
                return waiting
        return int(self.__dict__.get("_released_batches", 1))

    def _released_disjoint_batches(self) -> bool:
        """Whether the last release held several fixed-size batches of the loader (``poisson_sampling=False``),
        which the engine records as one draw at their summed rate, not as independent Poisson draws (read by
        Opacus's accountant hook, ``privacy_engine.opacus.accountants``)."""
        recorded = self.__dict__.get("_last_recorded", {})
        return self.__dict__.get("_released_batches", 1) > 1 and "batches_per_step" not in recorded

    @property
    def grad_samples(self) -> list[torch.Tensor | None]:
        """Each parameter's per-sample gradients of the open step, the passes concatenated along the batch
        dimension in order (Opacus's flat ``grad_samples``; ``p.grad_sample`` itself holds the last pass);
        None where there are none."""
        passes = self.__dict__.get("_clipped_passes", [])
        flat = []
        for index, param in enumerate(self.params):
            parts = [waiting[index] for waiting in passes if waiting[index] is not None]
            if getattr(param, "grad_sample", None) is not None:
                parts.append(param.grad_sample)
            flat.append(None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
        return flat

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine's ``zero_grad``; each parameter's ``summed_grad`` (Opacus's) and the per-sample gradients
        kept for ``grad_samples`` are dropped too."""
        self._clipped_passes = []
        self._fast_clipping_passes = 0
        super().zero_grad(set_to_none=set_to_none)
        for param in self.params:
            if getattr(param, "summed_grad", None) is not None:
                param.summed_grad = None


class DPPerLayerOptimizer(DPOptimizer):
    """Opacus's per-layer clipping optimizer: ``DPOptimizer`` with ``clipping="per_layer"`` (one
    bound per parameter, or one number split over the layers, as the engine's clipper does)."""

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float, max_grad_norm, **kwargs: Any) -> None:
        kwargs.setdefault("clipping", "per_layer")
        super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, **kwargs)
