"""Capture: per-sample gradients from an ordinary forward and backward pass (the first layer of the
data path, before clipping).

=======================  ================================================================
file                     what it holds
=======================  ================================================================
``module.py``            ``GradSampleModule``: the wrapper (wrapping, forward, unwrapping)
``hooks.py``             forward/gradient hooks of layers with a grad sampler
``fallback_bridge.py``   modules without a sampler, through ``torch.func`` (``vmap``)
``patched_forward.py``   a module's replaced forward as a picklable object (``PatchedForward``)
``batch_size.py``        the batch size of a forward; outputs shared by every example; each
                         layer's batch dim (the layout its nearest module declares)
``root_parameters.py``   parameters the root owns itself (``logit_scale``): forward-mode tangents
``recompute.py``         activation checkpointing: its recomputation told apart from misuse
``step_binding.py``      the wrapper's side of the step contract (which batch, which pass)
``usage_check.py``       the first-backward check (``ParameterUsageError``)
``compiled_code.py``     its note when ``torch.compile`` reused code compiled for a plain model
``independence.py``      examples must not interact: buffers written, the first-step row check
``row_probe.py``         the row check's instruments: row fingerprints, hooks off, deterministic random ops
``loss_coupling.py``     losses that couple examples, seen while computed (first step)
``manual.py``            ``ManualGradSampleModule``: the loop sets ``grad_sample`` itself
``common.py``            what every wrapper shares (loss reductions, errors, key prefix, the
                         model's forward signature), and the interface ``training/`` uses
                         (``ContractedWrapper``)
``state.py``             the wrapper's state, one object per part, with who writes and reads it
=======================  ================================================================

Fast clipping (``privacy_engine.clipping.ghost``) builds on ``GradSampleModule``; nothing here imports it.
"""

from privacy_engine.capture.common import ParameterUsageError, per_sample_gradients
from privacy_engine.capture.manual import ManualGradSampleModule
from privacy_engine.capture.module import GradSampleModule

__all__ = [
    "GradSampleModule",
    "ManualGradSampleModule",
    "ParameterUsageError",
    "per_sample_gradients",
]
