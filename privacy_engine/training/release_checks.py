"""The checks a ``DPOptimizer`` makes before it releases a step, and what the accountant records for it.

Every check raises before any noise is drawn or any step counted: data the private loader did not
draw (untagged and unrecognised, another loader's batch, a joined batch holding drawn rows), gradients
without per-sample contributions (eval mode, unwrapped model), a step with no new batch since the last
one, parameters another optimizer changed, several loader batches in one BandMF or truncated-sampling
step, and a batch released after a later BandMF noise row. For a mechanism that needs cyclic sampling
(``num_bands`` > 1 in its stated event: BandMF), a release also says how many noise rows it advances: one per
loader step since the last release, so each batch gets the row of its own step. What the accountant records is
the event the noise mechanism states (``NoiseMechanism.privacy_event``), at this release's sampling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from privacy_engine.training.step_contract import Release

if TYPE_CHECKING:
    from accountants.events import EventSpec
    from privacy_engine.clipping import PerSampleGradientClipper
    from privacy_engine.noise import NoiseMechanism
    from privacy_engine.training.step_contract import StepContract

__all__ = ["ReleaseChecks"]


class ReleaseChecks:
    """``DPOptimizer``'s checks before a release (a mixin over its contract, clipper and noise)."""

    _all_params: list[nn.Parameter]
    _grad_marks: dict[int, tuple[int, int]]
    accountant: Any | None
    clipper: PerSampleGradientClipper
    contract: StepContract
    noise: NoiseMechanism
    noise_multiplier: float
    num_bands: int
    privacy_event: EventSpec
    sample_rate: float | None
    source: str

    def _accounting_kwargs(self, release: Release, rows: int) -> dict[str, Any]:
        """What the accountant records for this release: the mechanism's stated event (its kind, bands
        and parameters, ``NoiseMechanism.privacy_event``) at this noise multiplier and sampling."""
        kwargs: dict[str, Any] = {
            "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
            **self.privacy_event.step_kwargs(),
        }  # fmt: skip
        if rows != 1:
            kwargs["num_steps"] = rows
        if self.source:
            kwargs["source"] = self.source
        if release.num_draws > 1:
            kwargs["batches_per_step"] = release.num_draws
        return kwargs

    def _check_release(self, release: Release, params: list[nn.Parameter]) -> tuple[int, int | None]:
        """Check what the step is about to release; return (noise rows to advance, loader step)."""
        contract = self.contract
        if release.refusals or (release.untracked and contract.has_loader):
            why = "; ".join(release.refusals) or (
                "a forward on tensors not yielded by the loader make_private returned"
            )
            raise RuntimeError(
                f"this step would release gradients of data that the private loader did not draw: {why}. The "
                f"accounting covers only the sampled batches; nothing was released or counted. (A training framework "
                f"that feeds its own batches needs its integration: a Hugging Face Trainer "
                f"privacy_engine.integrations.hf_trainer.DPTrainer, PyTorch Lightning "
                f"privacy_engine.integrations.lightning.DPStrategy.)"
            )
        if release.num_draws == 0 and not release.untracked and not self.clipper.has_accumulated:
            stray = [i for i, p in enumerate(self._all_params) if p.requires_grad and self._has_stray_gradient(p)]
            if stray:
                raise RuntimeError(
                    f"optimizer parameters {stray} have gradients from a backward pass that produced no per-sample "
                    f"gradients: the model was in eval() mode, not the wrapped model returned by make_private, or "
                    f"its hooks were removed. Nothing was released. Call model.train() on the wrapped model before "
                    f"the forward (or zero_grad() to drop these gradients)."
                )
            if not contract.has_new_batch:
                raise RuntimeError(
                    "optimizer.step() was called without a new batch since the last step (no training forward and "
                    "no backward pass ran in between): it would release noise alone and count it as one more sampled "
                    "step. Nothing was released or counted. Run the forward and backward of the next batch before "
                    "each step()."
                )
            forwarded = contract.forwarded_examples_without_backward()
            if forwarded:
                raise RuntimeError(
                    f"optimizer.step() was called after a training forward on a drawn batch of {forwarded} "
                    f"example(s) whose backward pass never ran: the step would release noise alone in place of that "
                    f"batch's clipped gradients and count it. Nothing was released or counted. Call loss.backward() "
                    f"before step(); to skip the batch, call zero_grad() and go on to the next batch without step()."
                )
        contract.check_parameters_unchanged(params, where="optimizer.step()")
        if release.num_draws > 1 and (self.num_bands > 1 or getattr(self.accountant, "max_batch_size", None)):
            raise RuntimeError(
                f"this step accumulated {release.num_draws} batches of the private loader: BandMF and truncated "
                f"sampling release one batch per step. Use VirtualSteps to split one batch "
                f"into micro-batches instead."
            )
        loader_step = release.loader_step
        if loader_step is None and release.num_draws == 0 and contract.has_loader:
            unused = contract.take_unused_draw()  # a batch the loop skipped backward for (empty)
            loader_step = None if unused is None else unused.loader_step
        return self._noise_rows(loader_step), loader_step

    def _noise_rows(self, loader_step: int | None) -> int:
        """How many noise rows releasing the batch of ``loader_step`` advances: 1, except with BandMF,
        where the rows of the loader steps never released since are drawn and discarded too."""
        if self.num_bands <= 1 or loader_step is None:
            return 1
        next_row = self.noise.step  # BandMF rows taken so far (restored with the noise state on resume)
        if loader_step < next_row:
            raise RuntimeError(
                f"the batch of loader step {loader_step} is released after noise row {next_row - 1} was used: "
                f"BandMF ties each batch to the noise row of its own step, which must increase. Use batches in the "
                f"order the loader yields them, each at most once."
            )
        return loader_step - next_row + 1

    def _has_stray_gradient(self, param: nn.Parameter) -> bool:
        grad = param.grad
        if grad is None:
            return False
        if self._grad_marks.get(id(param)) == (id(grad), grad._version):
            return False  # the private gradient this optimizer wrote (not zeroed since)
        return bool(grad.detach().abs().sum() > 0)
