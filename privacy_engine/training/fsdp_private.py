"""The private optimizer ``make_private`` returns for a model sharded with FSDP2 (``fully_shard``), so
that the user's loop is the ordinary one::

    model, optimizer, loader = engine.make_private(module=fsdp_model, optimizer=opt, data_loader=loader,
                                                   grad_sample_mode="ghost", noise_multiplier=..., max_grad_norm=...)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)   # any loss that is a mean (or sum) of per-example terms
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

How the ordinary loop gets per-example clipping (the two passes of ``training.fsdp.FSDPGhostClipping``
need per-example losses, which a scalar loss no longer has):

- ``OutputCapture`` (a forward hook on the root module) hands the loss *detached copies* of the model's
  floating-point outputs (leaves that require grad) and keeps the real outputs with their graph.
  ``loss.backward()`` therefore runs only from the loss to the outputs: it fills the leaves' ``.grad``
  with ``G = dL/d(output)`` and does not enter the model (FSDP runs no collective).
- Row ``i`` of ``G`` is the gradient of example ``i``'s own loss divided by the local batch size
  (``loss_reduction="mean"``) or itself (``"sum"``), as long as the loss is a mean or sum of
  per-example terms and the model does not mix examples (the same assumption as every ghost mode).
  ``optimizer.step()`` forms the per-example surrogate ``s_i = sum over outputs of <out_i, b G_i>``
  (``b`` the local batch size for "mean", 1 for "sum"; ``G`` detached), whose gradient with respect
  to the model is exactly example ``i``'s own gradient, and hands ``s`` to
  ``FSDPGhostClipping.backward``: norms from the first pass, the clipped sum reduce-scattered by
  FSDP in the second.
- Then ``FSDPPrivateStep``: each rank noises its own shard from its own stream (``ShardNoise`` for
  DP-SGD; ``ShardMechanismNoise`` for BandMF/BLT, the mechanism's history kept for the shard only),
  divides by the *global* expected batch size, steps the wrapped optimizer; then the step is recorded
  in the engine's ledger (rate ``q``, ``sigma`` and the noise's own event: the single-process event).

The engine builds it (``privacy_engine.engine.sharded``); see ``FSDPPrivateOptimizer`` for the guarantee
and the loop's rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from privacy_engine.training.fsdp import FSDPGhostClipping, FSDPPrivateStep, ShardNoise
from privacy_engine.training.fsdp_noise import ShardMechanismNoise

__all__ = ["FSDPPrivateOptimizer", "OutputCapture"]


def _map_tensors(value: Any, function: Any) -> Any:
    """``value`` with ``function`` applied to each tensor in it (tensors, tuples, lists, named tuples and
    mappings such as transformers' ``ModelOutput``); anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map_tensors(item, function) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(item, function) for item in value)
    if isinstance(value, Mapping):
        return type(value)(**{key: _map_tensors(item, function) for key, item in value.items()})
    return value


def _padded_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """For an empty batch (every tensor argument with zero rows): the same arguments with one all-zero row
    each; None otherwise."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() >= 1]
    if not tensors or any(t.shape[0] != 0 for t in tensors):
        return None

    def pad(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return torch.zeros((1, *value.shape[1:]), dtype=value.dtype, device=value.device)
        return value

    return tuple(pad(a) for a in args), {key: pad(value) for key, value in kwargs.items()}


class OutputCapture:
    """Forward hooks on the root module: each training forward's floating-point outputs are handed on as
    detached leaves (``requires_grad=True``), the real outputs kept (with their graph) until
    ``take()``. Eval mode or ``no_grad``: the outputs pass unchanged.

    An empty local batch (a normal Poisson event) still has to run FSDP's collectives, but many models
    cannot run on zero rows (reshapes with ``-1``): the model runs on one all-zero row instead, the loss
    is handed zero-row outputs (so it sees the empty batch it was given), and the step weights that row
    by zero (``per_example_surrogate``): it adds nothing to the clipped sum."""

    def __init__(self, model: nn.Module) -> None:
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._padded = False
        #: Whether the last training forward ran on a padding row for an empty batch.
        self.last_padded = False
        # Before FSDP's own pre-forward (which all-gathers): a refused forward leaves FSDP untouched, and a
        # padded batch is what FSDP sees.
        self._handles = [model.register_forward_pre_hook(self._before, prepend=True, with_kwargs=True),
                         model.register_forward_hook(self._after)]  # fmt: skip

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        if self._pending is not None and any(leaf.grad is not None for _, leaf in self._pending):
            # The first forward's gradient would be dropped (FSDP's passes run for one forward only).
            raise RuntimeError(
                "a second training forward before optimizer.step(): under FSDP each step takes exactly one forward "
                "and one loss.backward(); for larger batches raise the loader's batch_size"
            )
        padded = _padded_inputs(args, kwargs)
        self._padded = padded is not None
        return padded

    def _after(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            return None
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        padded = self._padded

        def detached(tensor: torch.Tensor) -> torch.Tensor:
            if not (tensor.requires_grad and tensor.is_floating_point() and tensor.dim() >= 1):
                return tensor[:0] if padded and tensor.dim() >= 1 else tensor
            leaf = (tensor.detach()[:0] if padded else tensor.detach()).requires_grad_(True)
            pairs.append((tensor, leaf))
            return leaf

        handed_on = _map_tensors(output, detached)
        if not pairs:
            raise TypeError(
                f"the model returned {type(output).__name__} with no floating-point tensor that requires grad: under "
                "FSDP the loss must be computed from the model's outputs (batch dimension first)"
            )
        self._pending = pairs
        self.last_padded = padded
        return handed_on

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The last training forward's (output, leaf) pairs, forgotten here (a padded forward's outputs hold
        one row, their leaves none); RuntimeError if there is none."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("optimizer.step() with no training forward since the last step (model in eval mode "
                               "or under no_grad?)")  # fmt: skip
        return pending

    def clear(self) -> None:
        """Forget the last forward (its graph is freed)."""
        self._pending = None

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending = None


def per_example_surrogate(pending: list[tuple[torch.Tensor, torch.Tensor]], *, loss_reduction: str) -> torch.Tensor:
    """``s_i = sum_k <out_k[i], b G_k[i]>`` over the outputs the loss reached (``G_k`` = their leaves'
    ``.grad``, detached; ``b`` the local batch size for ``loss_reduction="mean"``, 1 for "sum"): the
    gradient of ``s_i`` with respect to the model is example ``i``'s own gradient.

    ==========================================  ==============================================
    case                                        result
    ==========================================  ==============================================
    outputs with different first dimensions     ValueError (one row per example, batch first)
    no output reached by the loss, rows > 0     RuntimeError: call loss.backward() first
    an empty batch (zero rows, or padded)       zeros with the forward's graph (it still takes
                                                part in FSDP's collectives)
    ==========================================  ==============================================
    """
    rows = {int(leaf.shape[0]) for _, leaf in pending}
    if len(rows) != 1:
        raise ValueError(f"the model's outputs have first dimensions {sorted(rows)}: every output must hold one row "
                         "per example (batch dimension first)")  # fmt: skip
    batch = rows.pop()
    reached = [(output, leaf.grad) for output, leaf in pending if leaf.grad is not None]
    if batch == 0:
        # An empty batch, run on zero rows or on one padding row: weighted by zero, it adds nothing.
        output = pending[0][0]
        reached = [(output, torch.zeros_like(output))]
    elif not reached:
        raise RuntimeError("optimizer.step() before loss.backward(): no gradient reached the model's outputs")
    scale = batch if loss_reduction == "mean" else 1
    surrogate = None
    for output, grad in reached:
        # At least float32 (bfloat16 outputs under FSDP mixed precision): the scale by b is not rounded to 16 bits.
        dtype = torch.promote_types(output.dtype, torch.float32)
        product = output.to(dtype) * (grad.detach().to(dtype) * scale)
        if product.dim() > 1:
            product = product.sum(dim=tuple(range(1, product.dim())))
        surrogate = product if surrogate is None else surrogate + product
    return surrogate


class FSDPPrivateOptimizer:
    """What ``make_private`` returns as the optimizer for a ``fully_shard`` model (ghost clipping).

    Guarantee: when every rank runs, per step, one training forward of the model on its batch from the
    private loader, ``loss.backward()`` of a loss that is the mean (``loss_reduction="mean"``) or sum
    (``"sum"``) of per-example terms of the model's outputs, and ``step()``, each step releases
    ``(sum_i clip_C(g_i) + N(0, (sigma C)^2 I)) / (q N)`` over the union of the ranks' batches (one
    Poisson sample of the dataset at rate ``q``), each example's gradient ``g_i`` clipped once by the rank
    holding it, the full parameter vector noised exactly once (each rank its own shard, from its own
    stream), and records that one step in the engine's ledger as ``privacy_event``: epsilon is the
    single-process epsilon. With BandMF/BLT (``noise`` a ``ShardMechanismNoise``) the Gaussian term is
    replaced by row ``t`` of the mechanism's correlated noise over the full vector and the batches are the
    loader's cyclic groups (step ``t`` samples group ``t mod b`` only), as in one process. A budget
    (``max_epsilon``) is checked before anything is computed.

    ==========================================  ==============================================
    case                                        result
    ==========================================  ==============================================
    step() with no forward since the last one   RuntimeError, nothing released
    step() before loss.backward() (rows > 0)    RuntimeError, nothing released
    a second training forward before step()     RuntimeError at that forward
    step(closure)                               TypeError (no closures)
    an empty local batch                        takes part (adds zero to the sum)
    the step would pass max_epsilon             ``PrivacyBudgetExceeded``, nothing released
    a rank that stops calling step()            the others raise at FSDP's next collective
                                                (the process group's timeout)
    ==========================================  ==============================================

    The wrapped optimizer is ``original_optimizer`` (its state dict is sharded: save it with
    ``torch.distributed.checkpoint``, as ``engine.checkpoint.sharded`` does).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, model: nn.Module, noise: ShardNoise | ShardMechanismNoise,
                 data_loader: Any, accountant: Any, budget: Any, loss_reduction: str, source: str = "",
                 privacy_event: Any) -> None:  # fmt: skip
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum'; got {loss_reduction!r}")
        self.original_optimizer = optimizer
        self.noise = noise
        self.accountant = accountant
        self.budget = budget
        self.loss_reduction = loss_reduction
        self.source = source
        #: The event each step is recorded as (the noise mechanism's ``EventSpec``; DP-SGD's).
        self.privacy_event = privacy_event
        # Collective: the ranks compare sigma, C, seeds, rate, shapes (raises on every rank if they differ).
        self._release = FSDPPrivateStep(optimizer, noise, data_loader)
        self.sample_rate = self._release.sample_rate
        self.expected_batch_size = self._release.expected_batch_size
        self.clipping = FSDPGhostClipping(model, max_grad_norm=noise.max_grad_norm)
        self.capture = OutputCapture(model)
        #: Private steps released by this optimizer.
        self.steps = 0

    @property
    def noise_multiplier(self) -> float:
        """sigma: the noise's standard deviation per coordinate over ``max_grad_norm``."""
        return self.noise.noise_multiplier

    @property
    def max_grad_norm(self) -> float:
        """C: the bound on each example's gradient norm."""
        return self.noise.max_grad_norm

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's parameter groups (learning-rate schedulers act on them)."""
        return self.original_optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (its entries are sharded like the parameters)."""
        return self.original_optimizer.state

    @property
    def defaults(self) -> dict:
        """The wrapped optimizer's defaults."""
        return self.original_optimizer.defaults

    @property
    def last_per_sample_norms(self) -> torch.Tensor | None:
        """This rank's per-example gradient norms of the last step (diagnostics computed from the data: not
        private)."""
        return self.clipping.last_per_sample_norms

    def step_kwargs(self) -> dict[str, Any]:
        """What one step records in the ledger."""
        kwargs = {"noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
                  **self.privacy_event.step_kwargs()}  # fmt: skip
        if self.source:
            kwargs["source"] = self.source
        return kwargs

    def step(self, closure: Any = None) -> None:
        """One private release (every rank, once per global step); see the class docstring."""
        if closure is not None:
            raise TypeError("step() takes no closure under FSDP: run the forward and loss.backward() before it")
        pending = self.capture.take()
        if self.budget is not None:
            self.budget.check_release(self.accountant, **self.step_kwargs())
        surrogate = per_example_surrogate(pending, loss_reduction=self.loss_reduction)
        self.clipping.backward(surrogate)
        del pending, surrogate  # the forward's graph is freed before the update
        self._release.step()
        if self.accountant is not None:
            self.accountant.step(**self.step_kwargs())
        self.steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the wrapped optimizer's gradients and forget a forward not yet stepped."""
        self.capture.clear()
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """This rank's private state (plain data): released steps and the noise stream. The wrapped
        optimizer's sharded state goes through ``torch.distributed.checkpoint`` (``engine.checkpoint.sharded``)."""
        return {"steps": self.steps, "noise": self.noise.state_dict(), "sample_rate": self.sample_rate,
                "noise_multiplier": self.noise_multiplier, "max_grad_norm": self.max_grad_norm}  # fmt: skip

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """ValueError naming the first mismatch unless ``load_state_dict(state)`` restores it; changes nothing."""
        for key in ("sample_rate", "noise_multiplier", "max_grad_norm"):
            if float(state[key]) != float(getattr(self, key)):
                raise ValueError(f"the checkpoint was taken with {key}={state[key]}; this optimizer has "
                                 f"{getattr(self, key)}: resume with the same settings")  # fmt: skip
        if bool(state["noise"].get("secure_mode")) != self.noise.secure_mode:
            raise ValueError("the checkpoint's secure_mode differs from this engine's")
        if not self.noise.secure_mode and int(state["noise"]["rank"]) != self.noise.rank:
            raise ValueError(f"the checkpoint's noise state is rank {state['noise']['rank']}'s; this is rank "
                             f"{self.noise.rank}")  # fmt: skip
        if isinstance(self.noise, ShardMechanismNoise):
            # BandMF/BLT: the mechanism, its strategy and this shard's history must fit (checked, not loaded).
            self.noise.check_state_dict(state["noise"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (checked first: on a mismatch nothing changes)."""
        self.check_state_dict(state)
        self.noise.load_state_dict(state["noise"])
        self.steps = int(state["steps"])
        self.capture.clear()

    def remove_hooks(self) -> None:
        """Remove the hooks on the model (it is left as it was sharded)."""
        self.capture.remove()
        self.clipping.remove()
