"""The state of a capturing wrapper, declared per concern: what each part of ``GradSampleModule`` keeps
between calls, which part writes it and which reads it. Fast clipping's own state is declared next to
its backward pass (``privacy_engine.clipping.ghost.uses.GhostPasses``, ``ClipperLink``).

===================  ================  ================================  ================================
state                on the wrapper    written by                        read by
===================  ================  ================================  ================================
``CaptureTables``    ``_tables``       module.py (``__init__``,          usage_check (owners, names),
                                       ``_attach``, ``_detach``);        hooks (names in errors),
                                       fallback_bridge and ghost's       independence (hooked paths)
                                       ``_attach`` (patched modules);
                                       ghost's ``__init__`` (hooks)
``ForwardFlags``     ``_flags``        module.py (``forward``,           batch_size, step_binding
                                       ``to_standard_module``,           (``in_forward``, ``released``);
                                       ``_forward_replay``);             the fallback's, the gate's and
                                       fallback_bridge                   attention's forwards
                                       (``inside_fallback``)             (``inside_fallback``)
``UsageCheckState``  ``_usage``        usage_check; module.py            hooks (``phase``: record while
                                       (``forward``: arm, re-arm)        armed); module.py (``_detach``)
``BatchSizeState``   ``_batch_sizes``  batch_size; module.py             fallback_bridge (error message);
                                       (``forward`` resets it,           step_binding and independence
                                       ``_forward_replay`` restores it)  (``_forward_batch_size()``)
===================  ================  ================================  ================================

Not here: the step binding (``_consumer``, ``_generation``, ``_generation_tickets``, ``_forward_ticket``,
``_grad_sample_ticket``, ``_backward_running``, ``_awaiting_backward``), declared by
``capture.step_binding.StepContractBinding``; the independence guard's state, declared by
``capture.independence.IndependenceGuard`` (``_independence``). ``training/`` uses none of these: it calls
the wrapper's public step-contract methods (``GradSampleModule.forget_forward_batch`` and the others listed
in ``capture.common.ContractedWrapper``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["BatchSizeState", "CaptureTables", "ForwardFlags", "UsageCheckState"]


@dataclass(eq=False)
class CaptureTables:
    """What wrapping set up, and what unwrapping undoes.

    ``param_names``: each parameter's first name in the model (error messages). ``owner_paths``: the path
    of the module whose per-sample gradients explain each parameter (filled by ``_attach``).
    ``batchnorms``: BatchNorm modules, refused in training mode at every forward. ``handles``: hooks to
    remove at unwrapping. ``patched``: modules whose ``forward`` was replaced on the instance;
    ``instance_forwards``: the instance forwards they had before (put back at unwrapping).
    ``root_parameters``: the root's own parameters when they take the forward-mode path
    (``capture.root_parameters``). ``unowned``: frozen parameters no module owns (refused if unfrozen).
    ``layer_batch_dims``: for each instrumented module's path, the dim of its input and output that holds
    the examples (``capture.batch_size.declared_batch_dims``: the layout its nearest module declares).
    """

    param_names: dict[nn.Parameter, str]
    batchnorms: list[tuple[str, nn.Module]]
    owner_paths: dict[nn.Parameter, str] = field(default_factory=dict)
    handles: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)
    patched: list[nn.Module] = field(default_factory=list)
    instance_forwards: dict[nn.Module, object] = field(default_factory=dict)
    root_parameters: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    unowned: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    layer_batch_dims: dict[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class ForwardFlags:
    """Where the wrapper is: ``in_forward`` (inside its own forward: a hooked layer's training forward
    anywhere else is the model called directly), ``inside_fallback`` (inside a ``torch.func`` fallback
    forward: the modules it calls run their plain forward), ``released`` (unwrapped by
    ``to_standard_module``: calling it raises)."""

    in_forward: bool = False
    inside_fallback: bool = False
    released: bool = False


@dataclass(eq=False)
class UsageCheckState:
    """The first-backward check (``capture.usage_check``).

    ``phase``: ``"pending"`` (armed by the next training forward), ``"armed"`` (the next backward is
    verified), ``"done"`` (verified, or failed once), or ``"off"`` (the wrapper class does not check:
    ``GradSampleModule.checks_parameter_usage``). The other fields live while armed: per parameter, the
    sum of its per-sample gradients, the sum of their norms (the scale of rounding), the size of the terms
    they sum (``UsageCheck._record_term_scales``), the least precise dtype of the computation; autocast's
    dtype at the forward; the hooks on the parameters; ``end_queued``: ``_finish_usage_check`` is queued on
    the running backward (by the first record, or earlier by a reentrant checkpoint's recomputation).
    """

    phase: str = "pending"
    sums: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)
    magnitudes: dict[nn.Parameter, float] = field(default_factory=dict)
    term_scales: dict[nn.Parameter, float] = field(default_factory=dict)
    dtypes: dict[nn.Parameter, torch.dtype] = field(default_factory=dict)
    autocast_dtype: torch.dtype | None = None
    handles: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)
    end_queued: bool = False

    def clear_records(self) -> None:
        """Drop what the last armed backward recorded (the hooks are the caller's to remove)."""
        self.sums, self.magnitudes = {}, {}
        self.term_scales, self.dtypes = {}, {}
        self.end_queued = False


@dataclass(eq=False)
class BatchSizeState:
    """The batch size of the running forward (``capture.batch_size``).

    ``forward_batch``: (first layer, batch size) that fixed it, reset by ``forward``. Reset per forward by
    the pre-hook on the wrapped module: ``input_batch`` (the size most tensor inputs have, if unambiguous),
    ``forward_single`` (the first layer left at batch 1 while no batch was known), ``forward_broadcast``
    ((layer, size): the first layer expanded to the batch), ``forward_without_grad`` (the batch size of
    instrumented layers that ran without gradients, e.g. in a reentrant checkpoint's first forward: used
    only when no layer ran with gradients).
    """

    forward_batch: tuple[str, int] | None = None
    input_batch: int | None = None
    forward_single: str | None = None
    forward_broadcast: tuple[str, int] | None = None
    forward_without_grad: int | None = None
