"""``opacus.grad_sample.functorch.make_functional``: a module as a function of its parameters, for
loops that compute per-sample gradients themselves with ``torch.func`` (``grad_sample_mode="no_op"``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from privacy_engine.capture import GradSampleModule
from privacy_engine.capture.manual import ManualGradSampleModule

__all__ = ["make_functional"]


def make_functional(mod: nn.Module, disable_autograd_tracking: bool = False) -> tuple[Callable, tuple]:
    """``(fmodel, params)`` with ``fmodel(params, *args, **kwargs)`` computing ``mod(*args, **kwargs)``
    with ``params`` in place of ``mod``'s parameters (in ``mod.parameters()`` order), and ``params``
    ``mod``'s own parameters (detached if ``disable_autograd_tracking``).

    ``fmodel`` runs a parameterless copy of the model (on the ``meta`` device, as Opacus does), with
    the live model's buffers, so calling it never changes ``mod``. For the wrapper of
    ``grad_sample_mode="no_op"`` the wrapped model is used (the wrapper's forward is the model's).

    ==========================================  ===================================================
    case                                        result
    ==========================================  ===================================================
    plain module or no_op wrapper               as above
    a hooking wrapper (GradSampleModule, ghost)  TypeError: its hooks would run under vmap; pass the
                                                 model, or use grad_sample_mode="no_op"
    ==========================================  ===================================================
    """
    if isinstance(mod, GradSampleModule):
        raise TypeError(
            f"make_functional got a {type(mod).__name__}, whose hooks would run inside torch.func transforms: "
            f"pass the unwrapped model, or make the model private with grad_sample_mode='no_op'"
        )
    live = mod.wrapped_module if isinstance(mod, ManualGradSampleModule) else mod
    names = [name for name, _ in live.named_parameters()]
    params = tuple(param for _, param in live.named_parameters())
    stateless = copy.deepcopy(live).to("meta")

    def fmodel(new_params, *args, **kwargs):
        if len(new_params) != len(names):
            raise ValueError(f"fmodel expects {len(names)} parameter tensors (mod.parameters() order); got {len(new_params)}")
        tensors = dict(live.named_buffers())
        tensors.update(zip(names, new_params))
        return torch.func.functional_call(stateless, tensors, args, kwargs)

    if disable_autograd_tracking:
        params = tuple(param.detach() for param in params)
    return fmodel, params
