"""The wrappers' side of the step contract (``privacy_engine.training.step_contract``): which batch each training
forward ran on, whether a backward still belongs to the live forward, and handing the completed passes
to the bound ``DPOptimizer``.

A wrapper is bound to one optimizer by ``privacy_engine.connect_private`` only (``make_private`` calls it);
nothing binds by itself. Every parameter of a wrapped model carries the wrapper's class name
(``mark_wrapped_parameters``, removed on unwrapping), so that a ``DPOptimizer`` tells per-sample
gradients a wrapper made from ones a loop set by hand, and refuses those of a wrapper it was never
connected to (``wrapper_holding``).

``StepContractBinding`` is a mixin of the capturing wrappers; it keeps ``_consumer``, ``_generation``,
``_generation_tickets``, ``_forward_ticket``, ``_grad_sample_ticket``, ``_backward_running`` and
``_awaiting_backward`` (initialised by the wrapper).
"""

from __future__ import annotations

import torch
from torch import nn

from privacy_engine.batches.tickets import BatchTicket
from privacy_engine.capture.recompute import checkpoint_recompute
from privacy_engine.models.validation import submodule_label

__all__ = [
    "StepContractBinding", "mark_wrapped_parameters", "set_binding_fields", "unmark_wrapped_parameters",
    "wrapper_holding",
]

#: The attribute set on every parameter of a wrapped model: the wrapper's class name (a string, so a
#: model saved with ``torch.save`` stays loadable).
WRAPPED_PARAMETER_ATTRIBUTE = "_privacy_engine_wrapper"


def mark_wrapped_parameters(module: nn.Module, wrapper_name: str) -> None:
    """Mark every parameter of ``module`` (frozen ones too: they may be unfrozen) as held by a wrapper."""
    for param in module.parameters():
        setattr(param, WRAPPED_PARAMETER_ATTRIBUTE, wrapper_name)


def unmark_wrapped_parameters(module: nn.Module) -> None:
    """Remove the mark of ``mark_wrapped_parameters`` (the wrapper let the model go)."""
    for param in module.parameters():
        if hasattr(param, WRAPPED_PARAMETER_ATTRIBUTE):
            delattr(param, WRAPPED_PARAMETER_ATTRIBUTE)


def wrapper_holding(param: nn.Parameter) -> str | None:
    """The class name of the wrapper holding ``param``'s model, or None if no wrapper holds it."""
    return getattr(param, WRAPPED_PARAMETER_ATTRIBUTE, None)


def set_binding_fields(wrapper: nn.Module, **fields: object) -> None:
    """Set fields of the step binding (``_generation``, ``_forward_ticket``, ...) on ``wrapper`` straight in its
    ``__dict__``, where ``nn.Module.__setattr__`` would put them too: their values (ints, bools, dicts, tickets,
    None) are never parameters, buffers or modules, and that method's checks for those cost ~2 us per field (its
    ``isinstance(value, Parameter)`` runs a Python metaclass check), about ten times per training step."""
    wrapper.__dict__.update(fields)


class StepContractBinding:
    """Mixin: ties forwards and backward passes to the batches the private loader drew."""

    def bind(self, consumer) -> None:
        """Send each backward pass's per-sample gradients to ``consumer`` (a ``DPOptimizer``): a pass is
        clipped on its own unless the previous pass ran on the same batch (then they are summed per
        example first). The wrapper's half of ``privacy_engine.connect_private``, which checks the pair and
        connects both halves: call that. ``ValueError`` if already bound to another optimizer."""
        if self._consumer is not None and self._consumer is not consumer:
            raise ValueError(
                "this wrapper is already connected to another DPOptimizer (privacy_engine.connect_private)"
            )
        self._consumer = consumer

    def __getstate__(self) -> dict:
        """Pickle (``torch.save(model)``) the wrapper without its binding: the bound ``DPOptimizer`` holds
        the loader, its step contract and closures that cannot be pickled, and a saved model must not
        carry the open step of a training run. A loaded wrapper is unbound (a per-sample gradient tool)
        until ``privacy_engine.connect_private`` connects it to a ``DPOptimizer`` again."""
        state = self.__dict__.copy()
        state.update(_consumer=None, _generation_tickets={}, _forward_ticket=None, _grad_sample_ticket=None,
                     _backward_running=False, _awaiting_backward=False)  # fmt: skip
        return state

    def _before_bound_forward(self) -> None:
        if self._backward_running:
            # The last backward raised part-way: its per-sample gradients are incomplete.
            self._discard_grad_samples()
        self._consumer.sync_private_parameters()
        # (Straight into __dict__, as set_binding_fields does: this runs at every training forward.)
        self.__dict__["_generation"] = self._generation + 1

    def _after_bound_forward(self, args, kwargs) -> None:
        batch_size = self._forward_batch_size()
        if batch_size is None:
            return  # nothing trainable ran (every layer frozen): no per-sample gradients to tie
        consumer = self._consumer
        contract = consumer.contract
        fields = self.__dict__  # the binding's fields are set there, as set_binding_fields does (every forward)
        previous = self._forward_ticket
        ticket = contract.resolve(args, kwargs, batch_size, batch_dim=self._batch_dim,
                                  join_pending=self._awaiting_backward)  # fmt: skip
        fields["_awaiting_backward"] = ticket.tracked
        self._check_second_pass(ticket)
        if previous is None or not ticket.same_rows(previous):
            if previous is not None and self._grad_sample_ticket is None and not contract.already_contributed(previous):
                contract.abandon(previous)  # its backward never ran; a later forward may use the batch
            # Only the forwards of the live batch can still be backpropagated (``_check_live``): drop the
            # others' tickets, or the map would keep one ticket (and its padding mask) per step forever.
            # ``previous is None`` after a step released the batch: every earlier forward is dead too.
            fields["_generation_tickets"] = {}
        if self._grad_sample_ticket is not None and not ticket.same_rows(self._grad_sample_ticket):
            self.flush_grad_samples()
        self._generation_tickets[self._generation] = ticket
        fields["_forward_ticket"] = ticket
        contract.check_parameters_unchanged(consumer.params, where="a forward")

    def _check_second_pass(self, ticket) -> None:
        """Hooks mode sums a second backward pass over the same examples into the first (see ``_accumulate``)."""

    def _check_live(self, generation: int) -> None:
        """Raise if a backward reaches the forward of a batch that a later forward replaced."""
        if self._consumer is None:
            return
        ticket = self._generation_tickets.get(generation)
        live = self._forward_ticket
        # (Once per layer in backward: the usual live forward's own ticket object is taken without same_rows.)
        if ticket is None or (ticket is not live and not ticket.same_rows(live)):
            raise RuntimeError(
                "a backward pass reached the forward of an earlier batch after the model ran on another batch: "
                "the per-sample gradients of two batches would be mixed. Run backward for each forward before "
                "the next batch's forward (or use VirtualSteps for gradient accumulation)."
            )

    def flush_grad_samples(self) -> None:
        """Hand the completed backward passes' per-sample gradients to the bound optimizer's clipper."""
        ticket = self._grad_sample_ticket
        set_binding_fields(self, _grad_sample_ticket=None)
        if ticket is not None and self._consumer is not None and not self._backward_running:
            self._consumer.accumulate_pass(ticket)

    def _discard_grad_samples(self) -> None:
        self.clear_grad_sample()
        self._grad_sample_ticket = None
        self._backward_running = False

    def _backward_finished_by_clipping(self) -> None:
        """Fast clipping consumed this forward's backward pass (``clipping.ghost.backward``)."""
        set_binding_fields(self, _awaiting_backward=False)

    def _backward_done(self) -> None:
        self._backward_running = False
        self._awaiting_backward = False
        if self._consumer is not None:
            # No wrapper forward since the last step (the inner module was called directly): an untracked
            # batch, which the optimizer refuses to release when it has a private loader.
            self._grad_sample_ticket = self._forward_ticket or BatchTicket(loader_step=None, size=0)

    def _recompute_kind(self) -> str | None:
        """The kind of activation-checkpointing recomputation running now (``capture.recompute``), or None:
        inside this wrapper's own forward there is none to look for."""
        if self._flags.in_forward:
            return None
        return checkpoint_recompute()

    def _check_called_through_wrapper(self, path: str) -> str | None:
        """A training forward of a hooked layer must come through this wrapper's forward, or be
        ``torch.utils.checkpoint``'s recomputation of one during backward; return None for the former and the
        recomputation's kind (``capture.recompute.REENTRANT`` / ``NON_REENTRANT``) for the latter.

        Anything else raises ``RuntimeError``: the model called directly (a training framework holding the
        unwrapped model, e.g. a plain HF Trainer), whose batch is not the one the private loader drew and
        accounted for; or a forward run during a backward pass that is not a checkpoint's recomputation (a
        hook calling the model). The recomputation is recognised by torch's own markers (the reentrant
        checkpoint's backward node, the non-reentrant checkpoint's recomputation saved-tensor hooks), never
        by the absence of the wrapper's forward alone; see ``capture.recompute``."""
        if self._flags.in_forward or self._flags.released:
            return None
        recompute = checkpoint_recompute()
        if recompute is not None:
            return recompute
        if torch._C._current_autograd_node() is not None:
            raise RuntimeError(
                f"{submodule_label(self._module, path)} ran a training forward during a backward pass, and not as "
                f"torch.utils.checkpoint's recomputation: its batch was never drawn by the private loader. Run "
                f"forwards outside backward (activation checkpointing through torch.utils.checkpoint, "
                f"checkpoint_sequential or Hugging Face's gradient_checkpointing_enable() is supported)."
            )
        raise RuntimeError(
            f"{submodule_label(self._module, path)} ran a training forward (training mode, gradients on) "
            f"without going through its {type(self).__name__}: the wrapped model was called directly. Call the "
            f"wrapper make_private returned ({_framework_hint(self._module)}), or call model.eval() / "
            f"torch.no_grad() for forwards that are not training steps."
        )


def _framework_hint(module: nn.Module) -> str:
    """What to use instead when a training framework calls the wrapped model itself."""
    # Lightning calls training_step on the LightningModule, never the wrapper (Opacus's own Lightning example
    # calls make_private inside configure_optimizers): name the integration that routes the step through it.
    if any(cls.__module__.split(".")[0] in ("lightning", "pytorch_lightning") for cls in type(module).__mro__):
        return (
            "with PyTorch Lightning, leave the LightningModule as it is, without make_private, and train with "
            "Trainer(strategy=privacy_engine.integrations.lightning.DPStrategy(...)), which runs each training step "
            "through the wrapper and draws the batches the accountant records"
        )
    return (
        "with Hugging Face Trainer, use privacy_engine.integrations.hf_trainer.DPTrainer, which also draws the "
        "batches the accountant records"
    )
