"""``connect_private``: the one place a wrapper, a private optimizer and a private loader are tied together.

``make_private`` calls it on what it built (``engine.build.wrap_model``); a hand-built pipeline calls it
once, after building its three pieces. Nothing connects by itself: building a wrapper or a
``DPOptimizer`` binds nothing, and a ``DPOptimizer`` that finds per-sample gradients of a wrapper it was
never connected to refuses the step (``DPOptimizer._check_connected``).
"""

from __future__ import annotations

from typing import Any

from privacy_engine.capture import GradSampleModule
from privacy_engine.capture.manual import ManualGradSampleModule
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.training.data_loader import DPDataLoader
from privacy_engine.training.optimizer import DPOptimizer

__all__ = ["connect_private", "connection_refusal"]

_HOW = "Build a new wrapper and DPOptimizer for another pairing (make_private builds and connects its own)"


def connect_private(
    module: GradSampleModule | ManualGradSampleModule,
    optimizer: DPOptimizer,
    data_loader: DPDataLoader | None = None,
) -> None:
    """Connect one wrapper, one ``DPOptimizer`` and optionally one private loader, for good: the
    wrapper's training forwards are tied to the batches they ran on and each backward pass is handed to
    ``optimizer`` (clipped on its own, see ``privacy_engine.training.step_contract``), and ``optimizer``
    releases only ``data_loader``'s draws. ``make_private`` does this for what it returns.

    Guarantee: either the three are connected, or an exception naming the argument at fault is raised
    and nothing changed. Once connected, no other wrapper, optimizer or loader can attach to them.

    ==================================================  ==============================================
    case                                                result
    ==================================================  ==============================================
    ``module`` not a GradSampleModule,                  ``TypeError`` naming module
    GhostClippingModule or ManualGradSampleModule
    ``optimizer`` not a DPOptimizer                     ``TypeError`` naming optimizer
    ``data_loader`` not a DPDataLoader (nor None)       ``TypeError`` naming data_loader
    ``module`` already connected (to any optimizer)     ``ValueError`` naming module
    ``optimizer`` already connected to a wrapper        ``ValueError`` naming optimizer
    a trainable parameter of ``module`` is not one of   ``ValueError`` naming module and the parameters
    ``optimizer``'s (or the module has none)
    fast clipping: the wrapper's clipper is another     ``ValueError`` naming module
    than ``optimizer.clipper``
    fast clipping, no clipper attached yet              ``optimizer.clipper`` is attached (padding
                                                        masks from ``optimizer.current_padding_mask``)
    ``optimizer`` already draws from another loader     ``ValueError`` naming data_loader
    ``data_loader`` None                                no loader attached: the optimizer adopts the
                                                        private loader of the first drawn batch it
                                                        trains on; data no private loader drew is
                                                        released unchecked (its accounting is yours)
    ==================================================  ==============================================
    """
    refusal = connection_refusal(module, optimizer, data_loader)
    if refusal is not None:
        error, message = refusal
        raise error(message)
    if isinstance(module, GhostClippingModule) and module.clipper is None:
        # The optimizer's current_padding_mask follows the loader's mask (and VirtualSteps' slices of it),
        # so padding examples contribute zero in fast clipping as well.
        module.attach_clipper(optimizer.clipper, padding_mask_source=optimizer.current_padding_mask)
    optimizer.contract.attach_module(module)
    module.bind(optimizer)
    if data_loader is not None:
        optimizer.attach_loader(data_loader)


def connection_refusal(module: Any, optimizer: Any, data_loader: Any = None) -> tuple[type[Exception], str] | None:
    """Why ``connect_private(module, optimizer, data_loader)`` would refuse, as ``(exception class,
    message)``; None if it would connect them. Changes nothing."""
    if not isinstance(module, (GradSampleModule, ManualGradSampleModule)):
        return TypeError, (
            f"connect_private: module must be the wrapper of the model (GradSampleModule, GhostClippingModule or "
            f"ManualGradSampleModule); got {type(module).__name__}. Wrap the model first."
        )
    if not isinstance(optimizer, DPOptimizer):
        return TypeError, (
            f"connect_private: optimizer must be a DPOptimizer; got {type(optimizer).__name__}. Wrap it first: "
            f"DPOptimizer(optimizer, noise_multiplier=..., max_grad_norm=..., expected_batch_size=...)."
        )
    if data_loader is not None and not isinstance(data_loader, DPDataLoader):
        return TypeError, (
            f"connect_private: data_loader must be a DPDataLoader (whose batches carry the tickets the step "
            f"contract checks) or None; got {type(data_loader).__name__}. Use DPDataLoader.from_data_loader(loader)."
        )
    if module.bound_optimizer is not None:
        whom = "this optimizer" if module.bound_optimizer is optimizer else "another DPOptimizer"
        return (
            ValueError,
            f"connect_private: module is already connected to {whom}; a wrapper is connected once. {_HOW}.",
        )
    if optimizer.contract.modules:
        return ValueError, (
            f"connect_private: optimizer is already connected to a {type(optimizer.contract.modules[0]).__name__}; "
            f"one optimizer releases the per-sample gradients of one wrapper. {_HOW}."
        )
    problem = _parameter_problem(module, optimizer)
    if problem:
        return ValueError, f"connect_private: {problem}"
    if (
        data_loader is not None
        and optimizer.contract.has_loader
        and optimizer.contract.origin is not data_loader.tickets.origin
    ):
        return ValueError, (
            f"connect_private: data_loader is not the loader optimizer already draws from ({optimizer.contract.origin.name}); "
            f"one optimizer releases the draws of one private loader."
        )
    return None


def _parameter_problem(module: Any, optimizer: DPOptimizer) -> str:
    """Why ``module``'s trainable parameters are not ``optimizer``'s to release ("" if they are)."""
    if isinstance(module, GhostClippingModule) and module.clipper is not None:
        if module.clipper is optimizer.clipper:
            return ""
        return (
            "module (fast clipping) adds its clipped sums to another clipper than optimizer.clipper: those sums would "
            "never be released. Build it without clipper= (connect_private attaches optimizer.clipper), or with "
            "clipper=optimizer.clipper."
        )
    # Fast clipping without a clipper: optimizer.clipper will be attached, so it must hold every trainable one.
    if isinstance(module, GhostClippingModule):
        mine = {id(p) for p in optimizer.clipper.params}
    else:
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    theirs = [(name, p) for name, p in module.wrapped_module.named_parameters() if p.requires_grad]
    if not theirs:
        return "module has no trainable parameter: nothing of it could be released."
    missing = [name for name, p in theirs if id(p) not in mine]
    if missing:
        return (
            f"module's trainable parameters {missing} are not optimizer's: their per-sample gradients would be clipped "
            f"and noised by no one. Build the DPOptimizer over every trainable parameter of the wrapped model (or freeze "
            f"those with requires_grad_(False))."
        )
    return ""
