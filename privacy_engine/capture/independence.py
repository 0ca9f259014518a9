"""The independence check: DP-SGD's bound assumes example ``i``'s gradient depends on example ``i`` alone.
Clipping that gradient then bounds what ``i`` adds to the step. A forward that mixes the examples of a
batch (batch statistics, a layer run time-major inside a batch-first model) or a loss that couples them
(``capture.loss_coupling``) breaks the assumption silently: the released step moves by several times the
clipping bound when one example is removed.

``IndependenceGuard`` (one per wrapper, its state declared here) runs, on each training forward of the
wrapper (training mode, gradients on):

- every forward, O(#modules) Python: (1) the modules' train/eval structure; when it changed since the last
  training forward, the wrap-time checks (``models.validation.find_problems``) run again and the checks
  below are re-armed; (2) the ``_version`` of every buffer before and after the forward: a buffer written
  in place during a training forward (running statistics, by any module) is refused, naming it;
- at the first training forward of a structure (on batches of 2 or more examples), before the output is
  handed back: the *row check*. The forward runs twice more under ``no_grad``, deterministically (random
  ops replaced, see ``DeterministicRandom``; RNG state and buffers restored afterwards), on the full batch
  and on a sub-batch of its first examples. Every module's inputs and outputs are compared row by row (a
  fingerprint per row): the first module whose output rows for the sub-batch differ from the same rows
  for the full batch (while its inputs agreed) mixes examples; a module whose input does not carry the
  examples at the batch dim (a layer run ``(T, B, F)`` inside a batch-first model) is named as such. The
  cross-entropy rules of ``loss_coupling`` run in the full forward too (a loss computed inside it), and a
  buffer the forward changed by value (in place or reassigned) is refused;
- after that forward, until ``backward``: ``loss_coupling.LossCouplingMonitor`` on the outputs.

What it uses of the wrapper (``after_training_forward``'s ``wrapper``): ``_forward_batch_size()``, the hooked
module paths (``_tables.owner_paths``) and their batch dims (``_tables.layer_batch_dims``), whether Hugging Face loss hooks are installed (``_hf_losses``), the
bound optimizer (``bound_optimizer``), and ``_forward_replay()`` around the check's extra forwards (which puts
back the wrapper's batch-size state and flags); it writes nothing on the wrapper.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils._pytree import tree_leaves, tree_map

from privacy_engine.capture.loss_coupling import LossCouplingMonitor, insert_function_mode, remove_function_mode
from privacy_engine.capture.row_probe import DeterministicRandom, RowMismatch, RowProbe, without_forward_hooks
from privacy_engine.models.validation import (
    InteractingExamplesError,
    UnsupportedModuleError,
    find_problems,
    module_label,
)

__all__ = ["DeterministicRandom", "IndependenceGuard"]

SUB_BATCH_ROWS = 2  # rows of the sub-batch (fewer when the batch is smaller): its activations are recorded


class IndependenceGuard:
    """Refuses forwards and losses in which the examples of a batch interact (see the module docstring).

    Guarantee: a training forward of the wrapper raises ``InteractingExamplesError`` (``strict=False``: warns)
    before returning its output, so before any backward, clipping, noise or accounting, when

    ==================================================  ================================================
    case                                                result
    ==================================================  ================================================
    a buffer written in place during the forward        refused at every training forward, naming
    (running stats, ``num_batches_tracked``, counters)  ``module.buffer`` (restored at the first step)
    a module whose output rows depend on other rows     refused at the first training forward of each
    (``F.batch_norm(training=True)``,                   train/eval structure, naming the innermost such
    ``x - x.mean(0)``, LayerNorm over the batch dim,    module (on batches of >= 2 examples)
    a batch-size MoE)
    a layer's input without the examples at batch_dim   refused (first step), naming the layer
    buffer changed by value (reassigned) in a forward   refused (first step)
    cross_entropy/nll_loss coupling inside the forward  refused (first step; see ``loss_coupling``)
    the user's loss couples examples                    refused while it is computed (first step)
    the model turned train -> eval -> train, or a       wrap-time checks re-run (InstanceNorm
    submodule's mode changed                            ``track_running_stats`` in training), re-checked
    sub-batch forward fails, or a mismatch with         warning: independence cannot be verified (the
    arguments the check cannot split per example        slicing, not the model, may cause the mismatch)
    wrapper not bound to a private optimizer            nothing checked (nothing is released)
    batch of 1 example / nothing trainable ran          row check deferred to the next forward
    dropout and other random ops                        replaced by deterministic ones for the check
    eval mode / ``no_grad``                             nothing checked (no gradient, no buffer rule)
    ==================================================  ================================================

    Not covered: coupling that shows only on other batches than the checked one (data-dependent control
    flow, targets that hit ``ignore_index`` only later), a coupled loss computed from tensors the monitor
    cannot see as the outputs' (copied out with ``.tolist()``), and buffers reassigned (not written in
    place) after the first step.
    """

    def __init__(self, module: nn.Module, *, batch_dim: int, strict: bool) -> None:
        self.module = module
        self.batch_dim = batch_dim
        self.strict = strict
        self.modules = list(module.named_modules())
        self.buffer_slots = [(path, m, name) for path, m in self.modules for name in m._buffers]
        # The structure the wrap-time checks saw (they ran just before): re-checked when it changes.
        self.structure: tuple[bool, ...] = tuple(m.training for _, m in self.modules)
        self.verified = False  # the row check passed for the current structure
        self.monitor: LossCouplingMonitor | None = None
        self._monitor_handles: list = []
        self._versions: list[tuple[torch.Tensor | None, int]] = []
        self._snapshot: list[torch.Tensor | None] | None = None  # buffer copies while a check is pending

    # ------------------------------------------------------------------ every forward
    def _module_objects(self) -> list[nn.Module]:
        """The modules of ``self.modules`` without their paths, listed once: the structure read at every training
        forward walks this flat list, not the ``(path, module)`` pairs (one object fewer to load per module)."""
        cached = self.__dict__.get("_flat_modules")  # (pairs list, its length, the modules)
        pairs = self.modules
        if cached is None or cached[0] is not pairs or cached[1] != len(pairs):
            cached = self._flat_modules = (pairs, len(pairs), [m for _, m in pairs])
        return cached[2]

    def end_loss_monitor(self) -> None:
        """Called at the start of every forward of the wrapper: the previous step's loss is over."""
        if self.monitor is not None:
            self.monitor.active = False
            remove_function_mode(self.monitor)
            self.monitor = None
        while self._monitor_handles:
            self._monitor_handles.pop().remove()

    def before_training_forward(self) -> None:
        """Called before a bound training forward runs the model: if the modules' train/eval structure
        changed since the last one, re-run the wrap-time checks (``UnsupportedModuleError`` for a problem;
        ``strict=False``: a warning) and re-arm the row check; snapshot the buffers while the row check is
        pending, and note every buffer's ``_version`` for ``after_training_forward``."""
        structure = tuple([m.training for m in self._module_objects()])  # (at every training forward)
        if structure != self.structure:
            self.structure, self.verified = structure, False
            problems = find_problems(self.module)
            if problems:
                self._report("cannot compute per-sample gradients:\n- " + "\n- ".join(problems), UnsupportedModuleError)
        if not self.buffer_slots:
            return  # a model without buffers (the usual MLP / decoder): nothing to snapshot or watch
        if not self.verified:
            self._snapshot = [_copy(self._buffer(slot)) for slot in self.buffer_slots]
        self._versions = [(b, b._version if b is not None else 0) for b in map(self._buffer, self.buffer_slots)]

    def after_training_forward(self, wrapper, args, kwargs, output) -> None:
        """Called after a bound training forward, before its output is returned (so before any backward,
        clipping, noise or accounting): refuse a buffer written in place during the forward (restored while
        the row check is pending, then ``InteractingExamplesError``; ``strict=False``: a warning); at the
        first training forward of a structure with 2 or more examples, run the row check and, when a private
        optimizer is bound, start the loss-coupling monitor on ``output``. A batch of 1 example, or a forward
        in which nothing trainable ran, defers the row check to a later forward. See the class table."""
        if self.verified and not self.buffer_slots:
            return  # (the usual forward: no buffer to watch, the row check done; nothing was noted to reset)
        try:
            for slot, (before, version) in zip(self.buffer_slots, self._versions):
                after = self._buffer(slot)
                if after is not None and after is before and after._version != version:
                    self._restore_buffers()
                    self._report(_buffer_written(slot, restored=self._snapshot is not None))
            if self.verified:
                return
            batch_size = wrapper._forward_batch_size()
            if batch_size is None or batch_size < 2:
                return  # nothing to compare rows with: checked at a later forward
            problem, unverifiable = self._row_check(wrapper, args, kwargs, batch_size)
            if unverifiable is not None:
                warnings.warn(unverifiable, stacklevel=4)
            elif problem is not None:
                self._restore_buffers()
                self._report(problem)
            self.verified = True
            optimizer = wrapper.bound_optimizer
            if optimizer is not None:  # a private optimizer will release this step: watch its loss
                self._start_loss_monitor(optimizer, batch_size, output)
        finally:
            self._snapshot = None
            self._versions = []

    def _start_loss_monitor(self, optimizer, batch_size: int, output) -> None:
        """Watch the loss computed from ``output`` until backward (``loss_coupling``). The mode is taken off
        the stack at the optimizer's step, the next forward or ``to_standard_module``, whichever comes first."""
        monitor = LossCouplingMonitor(batch_size=batch_size, batch_dim=self.batch_dim, strict=self.strict, tracked=output, owner=self)
        insert_function_mode(monitor)
        self.monitor = monitor
        if hasattr(optimizer, "register_step_pre_hook"):
            # Removes the mode, not itself (the optimizer is iterating its hooks): end_loss_monitor does.
            self._monitor_handles.append(optimizer.register_step_pre_hook(lambda *_: remove_function_mode(monitor)))

    # ------------------------------------------------------------------ the first-step row check
    def _row_check(self, wrapper, args, kwargs, batch_size: int) -> tuple[str | None, str | None]:
        """``(problem, unverifiable)``: the coupling found (None: none), or why the check could not decide.

        The check can only slice what it knows to be per-example: tensors with ``batch_size`` entries at the
        batch dim. A forward that also takes tensors of another leading size (a flat index list with offsets,
        a ``(B * heads, T, S)`` mask) or that fails on the sub-batch cannot be judged: a mismatch there may
        come from the slicing, not from the model, so it is reported as unverifiable (a warning), not as
        coupling."""
        unsliced: list[tuple[int, ...]] = []
        rows = torch.arange(min(SUB_BATCH_ROWS, batch_size - 1))
        device = next((t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
        if device is not None:
            rows = rows.to(device)
        dim = self.batch_dim

        def take_rows(leaf):
            if isinstance(leaf, PackedSequence):  # a batch of sequences: unpack, take the rows, pack again
                padded, lengths = pad_packed_sequence(leaf)
                return pack_padded_sequence(padded.index_select(1, rows), lengths.index_select(0, rows.cpu()), enforce_sorted=False)
            if isinstance(leaf, torch.Tensor) and leaf.dim() > dim and leaf.shape[dim] == batch_size:
                return leaf.index_select(dim, rows)
            if isinstance(leaf, torch.Tensor) and dim != 0 and leaf.dim() > 1 and leaf.shape[0] == batch_size:
                return leaf.index_select(0, rows)  # batch-first arguments of a time-major model (padding masks)
            if isinstance(leaf, torch.Tensor) and leaf.dim() > dim:
                unsliced.append(tuple(leaf.shape))
            return leaf

        sub_args, sub_kwargs = tree_map(take_rows, (args, kwargs), is_leaf=lambda v: isinstance(v, PackedSequence))
        probe = RowProbe(self.modules, dim, batch_size, rows, hooked=set(wrapper._tables.owner_paths.values()),
                         layer_dims=wrapper._tables.layer_batch_dims)  # fmt: skip
        devices = sorted({b.device.index for b in self.module.buffers() if b.is_cuda} | {p.device.index for p in self.module.parameters() if p.is_cuda})
        try:
            with (
                wrapper._forward_replay(),
                torch.no_grad(),
                torch.random.fork_rng(devices=devices),
                DeterministicRandom(),
                without_forward_hooks(self.modules),
                warnings.catch_warnings(),
            ):
                # A reentrant activation checkpoint warns that no input requires grad: true under no_grad, and
                # not the user's concern here (their own forwards run with gradients).
                warnings.filterwarnings("ignore", message="None of the inputs have requires_grad=True")
                try:
                    with probe.recording():
                        self.module(*sub_args, **sub_kwargs)
                except InteractingExamplesError:
                    raise
                except Exception as error:  # noqa: BLE001  (reported as "cannot verify", with the cause)
                    return None, _cannot_verify(len(rows), batch_size, dim, error)
                changed = self._changed_buffers()
                if changed:
                    return changed, None
                # A loss computed inside the forward: the cross-entropy rules, unless the wrapper's Hugging Face
                # loss hooks (integrations.hf_losses, not run here) replace it by a per-example loss.
                rules = LossCouplingMonitor(batch_size=batch_size, batch_dim=dim, strict=True)
                if getattr(wrapper, "_hf_losses", None) is not None:
                    rules = contextlib.nullcontext()
                try:
                    with probe.comparing(), rules:
                        self.module(*args, **kwargs)
                except RowMismatch:
                    pass
                except InteractingExamplesError as error:
                    return str(error), None
                except Exception as error:  # noqa: BLE001
                    return None, _cannot_verify(batch_size, batch_size, dim, error)
                changed = self._changed_buffers()
                if changed:
                    return changed, None
                if probe.problem is not None and unsliced:
                    return None, _unsliced_arguments(batch_size, dim, unsliced, probe.problem)
                return probe.problem, None
        finally:
            self._restore_buffers()

    # ------------------------------------------------------------------ buffers
    @staticmethod
    def _buffer(slot) -> torch.Tensor | None:
        _, module, name = slot
        return module._buffers.get(name)

    def _changed_buffers(self) -> str | None:
        """A buffer whose value or identity changed since the snapshot (and restore it)."""
        if self._snapshot is None:
            return None
        for slot, copy in zip(self.buffer_slots, self._snapshot):
            current = self._buffer(slot)
            if (current is None) != (copy is None):
                return _buffer_written(slot, restored=True)
            if current is not None and not _same_buffer(current, copy):
                return _buffer_written(slot, restored=True)
        return None

    def _restore_buffers(self) -> None:
        if self._snapshot is None:
            return
        with torch.no_grad():
            for (path, module, name), copy in zip(self.buffer_slots, self._snapshot):
                current = module._buffers.get(name)
                if copy is None or current is None or current.shape != copy.shape:
                    module._buffers[name] = copy
                elif not _same_buffer(current, copy):
                    current.copy_(copy)

    def _report(self, problem: str, error=InteractingExamplesError) -> None:
        if self.strict:
            raise error(problem)
        warnings.warn(f"strict=False: {problem}", stacklevel=4)


def _cannot_verify(rows: int, batch_size: int, dim: int, error: Exception) -> str:
    return (
        f"could not verify that the examples of a batch are independent: the model's forward on {rows} of the "
        f"{batch_size} examples (the tensors with {batch_size} entries at dim {dim} sliced, others passed unchanged) "
        f"failed with {type(error).__name__}: {error}. The privacy guarantee assumes each example's output depends "
        f"on that example alone; pass per-example tensors with the examples at dim {dim} so the engine can check it."
    )


def _unsliced_arguments(batch_size: int, dim: int, shapes: list[tuple[int, ...]], problem: str) -> str:
    return (
        f"could not verify that the examples of a batch are independent: the forward takes tensors without "
        f"{batch_size} entries at dim {dim} (shapes {shapes[:3]}), which the check cannot split per example, and "
        f"the sub-batch forward then differed ({problem.split(':')[0]}). The privacy guarantee assumes each "
        f"example's output depends on that example alone; pass per-example tensors with the examples at dim "
        f"{dim} so the engine can check it."
    )


def _buffer_written(slot, *, restored: bool) -> str:
    path, module, name = slot
    where = f"{path}.{name}" if path else name
    after = (
        "It was restored." if restored else
        "It now holds values computed from this batch: do not release this model; reload a checkpoint."
    )
    return (
        f"buffer {where!r} of {module_label(path, module)} was written during a training forward: "
        f"a buffer computed from the batch (running statistics) leaves with the model without noise. Construct the "
        f"module without running statistics (track_running_stats=False), keep it in eval mode, or update the "
        f"buffer outside the training forward if it does not depend on the examples. {after}"
    )


def _same_buffer(current: torch.Tensor, copy: torch.Tensor) -> bool:
    if current.shape != copy.shape or current.dtype != copy.dtype:
        return False
    if current.is_floating_point() or current.is_complex():
        return bool(torch.isclose(current, copy, rtol=0, atol=0, equal_nan=True).all())
    return torch.equal(current, copy)


def _copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().clone()
