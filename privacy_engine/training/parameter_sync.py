"""Which parameters a ``DPOptimizer`` clips and noises: the trainable ones now, read before every step.

A parameter unfrozen during training joins the clipper and the noise layout; one frozen gets no noise
and no update. The set may only change between a step and the next forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from privacy_engine.clipping import PerSampleGradientClipper

if TYPE_CHECKING:
    from privacy_engine.noise import NoiseMechanism
    from privacy_engine.training.step_contract import StepContract

__all__ = ["ParameterSync"]


class ParameterSync:
    """``DPOptimizer``'s ``sync_private_parameters`` (a mixin over its clipper, noise and contract)."""

    _all_params: list[nn.Parameter]
    _in_logical_step: bool
    clipper: PerSampleGradientClipper
    noise: NoiseMechanism
    contract: StepContract

    def sync_private_parameters(self) -> None:
        """Read which of the optimizer's parameters are trainable now, and clip and noise exactly those.

        A parameter unfrozen since the last step joins the clipper (flat clipping: under the same
        bound; per-layer with one total bound: as a group of its own, the bound split anew) and the
        noise layout restarts over the new set (BandMF: a fresh correlation, which keeps the
        guarantee); a parameter frozen since gets no noise and no update. Raises ``ValueError``
        naming the parameter, changing nothing, when the set changes in the middle of a step (after
        a backward pass) or when per-layer bounds were given one by one.
        """
        active = [p for p in self._all_params if p.requires_grad]
        current = self.clipper.params
        if len(active) == len(current) and all(a is b for a, b in zip(active, current)):
            return
        changed = [p for p in active if all(p is not q for q in current)] or [
            p for p in current if all(p is not q for q in active)
        ]
        position = next(i for i, p in enumerate(self._all_params) if p is changed[0])
        what = f"optimizer parameter #{position} (shape {tuple(changed[0].shape)})"
        if (
            self.clipper.has_accumulated
            or self._in_logical_step
            or any(getattr(p, "grad_sample", None) is not None for p in current)
        ):
            raise ValueError(
                f"{what} was frozen or unfrozen in the middle of a step (after a backward pass): change "
                f"requires_grad between optimizer.step() and the next forward"
            )
        if not active:
            raise ValueError("every parameter of the optimizer is frozen: nothing to train privately")
        config = self.clipper.config
        if isinstance(config.max_grad_norm, tuple):
            raise ValueError(
                f"{what} changed requires_grad, but max_grad_norm gives one bound per group: the new set of "
                f"parameters has no bounds. Give one total bound (clipping='per_layer' splits it) or freeze "
                f"parameters before make_private."
            )
        clipper = self._clipper_over(active)
        for module in self.contract.modules:
            if hasattr(module, "attach_clipper"):
                module.attach_clipper(clipper, padding_mask_source=module._padding_mask_source)
        clipper.grad_scaler = self.clipper.grad_scaler
        self.noise.restart_layout()
        self.clipper = clipper

    def _clipper_over(self, active: list[nn.Parameter]) -> PerSampleGradientClipper:
        """A clipper configured as the current one, over ``active`` (per-layer: the current groups
        kept where their parameters still train, each new parameter a group of its own)."""
        config = self.clipper.config
        groups = None
        if config.clipping == "per_layer":
            kept = [[p for p in group if any(p is a for a in active)] for group in self.clipper.groups]
            grouped = {id(p) for group in kept for p in group}
            groups = [g for g in kept if g] + [[p] for p in active if id(p) not in grouped]
        return PerSampleGradientClipper(active, config.max_grad_norm, clipping=config.clipping, groups=groups,
                                        nan_safe=config.nan_safe,
                                        rescale_to_unit_norm=config.rescale_to_unit_norm)  # fmt: skip
