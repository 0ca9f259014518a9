"""Activation checkpointing: telling ``torch.utils.checkpoint``'s recomputation of a forward, during
backward, apart from a misuse (a wrapped model's layer called outside the wrapper's forward).

A hooked layer (or gated layer, or fallback module) whose training forward runs while the wrapper's own
forward is not running is one of three things, told apart by the markers torch itself sets, never by a
guess:

=========================  ===============================================  ===============================
what runs the layer        how it is recognised                             what the wrapper does
=========================  ===============================================  ===============================
a reentrant checkpoint's   the autograd node being executed                 captures, as in a forward: the
recomputation              (``torch._C._current_autograd_node()``) is the   first forward ran under
(``use_reentrant=True``)   backward node of                                 ``no_grad`` and captured
                           ``torch.utils.checkpoint.CheckpointFunction``    nothing; the nested backward
                                                                            gives the per-sample gradients
a non-reentrant            a backward is running and the innermost          replays: the same output
checkpoint's               saved-tensor hooks are ``_recomputation_hook``   (expansion, copy) as in the
recomputation (also        of ``torch.utils.checkpoint`` (the first         first forward, nothing
``checkpoint_sequential``  forward, inside the wrapper's forward, runs      captured: backward runs through
and HF's gradient          under its ``_checkpoint_hook``)                  the first forward's graph and
checkpointing by default)                                                   hooks (the recomputed graph
                                                                            only refills saved tensors)
anything else: a forward   neither marker (a backward running), or no       ``RuntimeError``: misuse
during backward, the       backward and the wrapper's forward not running   (see ``StepContractBinding``)
inner model called
directly
=========================  ===============================================  ===============================

Why the non-reentrant kind keeps the first forward's activations: the output-gradient hooks that fire are
those of the first forward's outputs (the recomputed outputs never receive a gradient), and the
recomputation stops early, as soon as the tensors autograd saved are rebuilt (``set_checkpoint_early_stop``),
so the last layers of a region may never run again. The first forward's values are the recomputation's
bit for bit (checkpointing restores the RNG state), so the per-sample results equal the run without
checkpointing; the cost is that the hooked layers' inputs (which per-sample gradients need in any case)
are held through the region instead of being recomputed.

The reentrant kind runs a nested backward inside the outer one; callbacks queued on the autograd engine
from inside it would run at its end, not at the end of the whole backward. So the wrapper queues its
end-of-backward callbacks (``_prepare_recompute_pass``) during the recomputed forward, which still runs in
the outer backward.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointFunction

__all__ = ["NON_REENTRANT", "REENTRANT", "checkpoint_recompute"]

REENTRANT = "reentrant"
NON_REENTRANT = "non_reentrant"

_CHECKPOINT_MODULE = "torch.utils.checkpoint"


def checkpoint_recompute() -> str | None:
    """``REENTRANT`` or ``NON_REENTRANT`` when called from inside ``torch.utils.checkpoint``'s
    recomputation of a forward during backward; None otherwise (no backward running, or a backward that
    is not recomputing a checkpointed forward)."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    if getattr(node, "_forward_cls", None) is CheckpointFunction:
        return REENTRANT
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None:
        pack = hooks[0]
        qualname = getattr(pack, "__qualname__", "")
        if getattr(pack, "__module__", None) == _CHECKPOINT_MODULE and qualname.startswith("_recomputation_hook."):
            return NON_REENTRANT
    return None
