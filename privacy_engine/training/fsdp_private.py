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

Logical batches larger than memory (gradient accumulation) use ``VirtualSteps`` as in one process::

    with VirtualSteps(data_loader=loader, max_physical_batch_size=16, optimizer=optimizer) as batches:
        for x, y in batches:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

Each micro-batch's ``step()`` (after ``signal_skip_step(True)``) runs both clipping passes for that
micro-batch only: its clipped sum is added to FSDP's sharded ``.grad`` (``zero_grad()`` keeps it while the
logical step is open); the step closing the logical batch adds the noise once, divides by the global expected
batch size, steps and records one step. Every micro-batch runs FSDP's collectives, so the ranks first agree on
the number of micro-batches (the largest local count); a rank with fewer runs empty ones (zero-weighted).

Stalls: at each training forward (before FSDP's all-gathers) and at each ``step()`` (before the clipping
passes) the ranks meet at a barrier bounded by the job's timeout (the process group's, set by
``init_process_group(timeout=...)``): a rank that stalls in the user's loop, raises or dies makes the others
raise ``DistributedStepError`` naming the point, instead of failing later inside FSDP with the backend's message.

The engine builds it (``privacy_engine.engine.sharded``); see ``FSDPPrivateOptimizer`` for the guarantee
and the loop's rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from privacy_engine.training.distributed_job import DistributedJob
from privacy_engine.training.fsdp import FSDPGhostClipping, FSDPPrivateStep, ShardNoise, _local
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

    def __init__(self, model: nn.Module, *, before_forward: Callable[[], None] | None = None) -> None:
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # Called at each training forward before FSDP's pre-forward (the optimizer's agreement point).
        self._before_forward = before_forward
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
                "and one loss.backward(); to cut a logical batch into micro-batches use VirtualSteps(data_loader=..., "
                "max_physical_batch_size=..., optimizer=optimizer) and call optimizer.step() after each micro-batch"
            )
        if self._before_forward is not None:
            self._before_forward()
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
    step() after ``signal_skip_step()``         the micro-batch is clipped and added to the
    (``VirtualSteps``)                          sharded ``.grad``: no noise, no record
    ``zero_grad()`` inside a logical step       keeps the accumulated clipped sum
    loop left between micro-batches             ``discard_logical_step()``: the partial sum is
                                                dropped, nothing released or recorded
    ranks with different micro-batch counts     ``VirtualSteps`` runs the largest on each rank
                                                (empty ones add nothing)
    a rank that stalls, raises or dies          the others raise ``DistributedStepError`` at
                                                the barrier before the next forward or
                                                clipping pass, within the job's timeout
    ==========================================  ==============================================

    Virtual steps: with ``VirtualSteps`` the guarantee holds per *logical* batch: the union of the
    micro-batches of all ranks is one Poisson sample at rate ``q``, each example clipped once (in the
    micro-batch holding it), one noise draw and one recorded step per logical batch.

    The wrapped optimizer is ``original_optimizer`` (its state dict is sharded: save it with
    ``torch.distributed.checkpoint``, as ``engine.checkpoint.sharded`` does).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, model: nn.Module, noise: ShardNoise | ShardMechanismNoise,
                 data_loader: Any, accountant: Any, budget: Any, loss_reduction: str, source: str = "",
                 privacy_event: Any, job: DistributedJob | None = None) -> None:  # fmt: skip
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
        #: The job whose timeout bounds the agreement points (None: no agreement, e.g. one rank).
        self.job = job if job is not None and job.world_size > 1 else None
        self.capture = OutputCapture(model, before_forward=self._agree_before_forward)
        #: Private steps released by this optimizer.
        self.steps = 0
        # Virtual steps (``VirtualSteps``): the next step() only clips and accumulates into FSDP's sharded .grad.
        self._skip_next_step = False
        self._in_logical_step = False
        #: Micro-batches clipped into the open logical step (0 when none is open).
        self.accumulated_micro_batches = 0
        #: Read by ``VirtualSteps`` (which installs its own while it runs); padding masks are not used here.
        self.padding_mask_source: Any = None

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

    def _agree(self, what: str) -> None:
        """Every rank reaches this point within the job's timeout, else ``DistributedStepError`` naming the
        point: a stalled rank fails the others here, before FSDP's own collectives (which would fail with the
        backend's bare message). A plain barrier, not gloo's monitored one: that one waits the whole timeout for
        a rank that has died, where the barrier fails as soon as the connection drops."""
        if self.job is not None:
            self.job.wait(dist.barrier(group=self.job.process_group, async_op=True), what)

    def _agree_before_forward(self) -> None:
        self._agree(f"the training forward of private step {self.steps} (before FSDP's all-gathers)")

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Make the next ``step()`` only clip and accumulate (a micro-batch that does not close its logical
        batch, as ``VirtualSteps`` asks): its clipped sum is added to FSDP's sharded ``.grad``; nothing is noised,
        released or recorded until the step that closes the logical batch."""
        self._skip_next_step = bool(do_skip)

    def agreed_micro_batch_count(self, local_count: int) -> int:
        """The number of micro-batches every rank cuts this logical batch into: the largest ``local_count``
        over the ranks (collective, bounded by the job's timeout). Each micro-batch runs FSDP's collectives, so
        the ranks must run as many; a rank with fewer examples runs empty micro-batches (padding rows weighted
        by zero). The count reveals only the largest local batch size to the other ranks."""
        if self.job is None:
            return int(local_count)
        # On the parameters' device: the backend's (a CUDA tensor for NCCL, a CPU one for gloo).
        device = _local(self._release.params[0]).device if self._release.params else torch.device("cpu")
        count = torch.tensor([int(local_count)], dtype=torch.int64, device=device)
        work = dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.job.process_group, async_op=True)
        self.job.wait(work, f"agreeing on the micro-batches of private step {self.steps}")
        return int(count.item())

    def step(self, closure: Any = None) -> None:
        """One private release (every rank, once per global step), or after ``signal_skip_step()`` one
        micro-batch clipped and accumulated; see the class docstring."""
        if closure is not None:
            raise TypeError("step() takes no closure under FSDP: run the forward and loss.backward() before it")
        pending = self.capture.take()
        if self.budget is not None:
            self.budget.check_release(self.accountant, **self.step_kwargs())
        surrogate = per_example_surrogate(pending, loss_reduction=self.loss_reduction)
        self._agree(f"private step {self.steps} (before the clipping passes)")
        # Adds this (micro-)batch's clipped sum to what the sharded .grad holds (the open logical step's).
        self.clipping.backward(surrogate)
        del pending, surrogate  # the forward's graph is freed before the update
        if self._skip_next_step:
            self._skip_next_step = False
            self._in_logical_step = True
            self.accumulated_micro_batches += 1
            return
        self._in_logical_step = False
        self.accumulated_micro_batches = 0
        self._release.step()
        if self.accountant is not None:
            self.accountant.step(**self.step_kwargs())
        self.steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the wrapped optimizer's gradients and forget a forward not yet stepped; inside an open logical
        step (the last ``step()`` was skipped) the accumulated clipped sum in ``.grad`` is kept."""
        self.capture.clear()
        if not self._in_logical_step:
            self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def discard_logical_step(self) -> None:
        """Drop a partly accumulated logical step (its clipped sum in ``.grad``; nothing was released or
        recorded) and any pending skip: ``VirtualSteps`` calls it when the loop stops between micro-batches."""
        self.capture.clear()
        self.original_optimizer.zero_grad(set_to_none=True)
        self._skip_next_step = False
        self._in_logical_step = False
        self.accumulated_micro_batches = 0

    def state_dict(self) -> dict[str, Any]:
        """This rank's private state (plain data): released steps and the noise stream. The wrapped
        optimizer's sharded state goes through ``torch.distributed.checkpoint`` (``engine.checkpoint.sharded``).
        RuntimeError inside an open logical step (its partial clipped sum in ``.grad`` is not saved)."""
        if self._in_logical_step or self._skip_next_step:
            raise RuntimeError("state_dict() between micro-batches of one logical batch: its partial clipped sum would "
                               "be lost; save after the step that closes the logical batch")  # fmt: skip
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
        self._skip_next_step = self._in_logical_step = False
        self.accumulated_micro_batches = 0

    def remove_hooks(self) -> None:
        """Remove the hooks on the model (it is left as it was sharded)."""
        self.capture.remove()
        self.clipping.remove()
