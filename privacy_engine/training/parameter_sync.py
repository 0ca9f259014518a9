"""Which parameters a ``DPOptimizer`` clips and noises: the trainable ones now, read before every step.

A parameter unfrozen during training joins the clipper and the noise layout; one frozen gets no noise
and no update. The set may only change between a step and the next forward.

A trainable parameter of a wrapped model that the private optimizer does not hold (frozen when the
optimizer was built over the trainable ones only, unfrozen later, perhaps given an optimizer of its own)
would receive the raw, unclipped gradient of every private forward, and whatever steps it would release
that gradient without noise: refused at every forward and step, before anything is computed or released.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING

from torch import nn

from privacy_engine.clipping import PerSampleGradientClipper

if TYPE_CHECKING:
    from privacy_engine.noise import NoiseMechanism
    from privacy_engine.training.step_contract import StepContract

__all__ = ["ParameterSync", "has_foreign_trainable_parameter", "parameter_ids"]

#: Where ``ParameterSync._own_parameter_ids`` keeps its set (left out of a copied optimizer's state).
OWN_IDS_ATTRIBUTE = "_own_parameter_ids_cache"

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _modules_once(root: nn.Module) -> list[nn.Module]:
    """Every module of ``root``'s tree once (``root`` included), as ``root.modules()`` finds them.

    The checks before every forward and step walk the whole tree (it may change between steps: a layer
    replaced, a parameter assigned, even straight into ``_parameters`` / ``_modules``, which no hook sees), so the
    walk is done anew each time; this plain loop over ``_modules`` does what ``named_modules`` does without
    building the dotted names (about 4x faster on deep models).
    """
    seen = {id(root)}
    found = [root]
    for module in found:  # grows while it is read: a breadth-first walk
        children = module._modules
        if children:
            for child in children.values():
                if child is not None:
                    key = id(child)
                    if key not in seen:
                        seen.add(key)
                        found.append(child)
    return found


def parameter_ids(root: nn.Module) -> set[int]:
    """``{id(p) for p in root.parameters()}``, from the same walk as ``has_foreign_trainable_parameter``."""
    return {id(param) for module in _modules_once(root) for param in module._parameters.values() if param is not None}


def has_foreign_trainable_parameter(root: nn.Module, known_ids: set[int] | frozenset[int]) -> bool:
    """Whether a parameter of ``root``'s tree has ``requires_grad`` and an ``id`` outside ``known_ids``: the
    same answer as ``any(p.requires_grad and id(p) not in known_ids for p in root.parameters())``.

    Run twice per step (at the forward and at the step), so it is one walk that looks at each module's
    parameters as it reaches the module (plain loops, no generators). A parameter is tested by its ``id``
    first, which reads nothing of the tensor: only one outside ``known_ids`` (none, usually) has its
    ``requires_grad`` read. The walk keeps no set of the modules seen: a module reached twice (one registered
    under two parents, as seq2seq models share their embedding) is looked at twice, which changes no answer;
    only a cycle in ``_modules`` would never end, so past ``_WALK_LIMIT`` modules the walk is made again
    with one (``_modules_once``, exact whatever the graph)."""
    found = [root]
    append = found.append
    for module in found:  # grows while it is read: a breadth-first walk
        params = module._parameters
        if params:
            for param in params.values():
                if param is not None and id(param) not in known_ids and param.requires_grad:
                    return True
        children = module._modules
        if children:
            for child in children.values():
                if child is not None:
                    append(child)
            if len(found) > _WALK_LIMIT:
                return _has_foreign_in(_modules_once(root), known_ids)
    return False


#: Modules (counted with repeats) past which ``has_foreign_trainable_parameter`` walks again with a set of
#: the modules seen: far more than any real model holds, reached only through a cycle (or a pathological DAG).
_WALK_LIMIT = 1 << 16


def _has_foreign_in(modules: list[nn.Module], known_ids: set[int] | frozenset[int]) -> bool:
    for module in modules:
        params = module._parameters
        if params:
            for param in params.values():
                if param is not None and id(param) not in known_ids and param.requires_grad:
                    return True
    return False


class ParameterSync:
    """``DPOptimizer``'s ``sync_private_parameters`` (a mixin over its clipper, noise and contract)."""

    _all_params: list[nn.Parameter]
    _in_logical_step: bool
    clipper: PerSampleGradientClipper
    noise: NoiseMechanism
    contract: StepContract

    def sync_private_parameters(self) -> None:
        """Read which of the optimizer's parameters are trainable now, and clip and noise exactly those.

        A parameter unfrozen since the last step joins the clipper (flat clipping: under the same
        bound; per-layer with one total bound: as a group of its own, the bound split anew) and the
        noise layout restarts over the new set (BandMF: a fresh correlation, which keeps the
        guarantee); a parameter frozen since gets no noise and no update. Raises ``ValueError``
        naming the parameter, changing nothing, when the set changes in the middle of a step (after
        a backward pass) or when per-layer bounds were given one by one; ``RuntimeError`` naming it
        when a trainable parameter of a bound wrapped model is not one of this optimizer's (see the
        module docstring; ``check_no_foreign_trainable_parameters``).
        """
        self.check_no_foreign_trainable_parameters()
        active = list(filter(_REQUIRES_GRAD, self._all_params))
        current = self.clipper.params
        if len(active) == len(current) and all(map(operator.is_, active, current)):
            return
        changed = [p for p in active if all(p is not q for q in current)] or [
            p for p in current if all(p is not q for q in active)
        ]
        position = next(i for i, p in enumerate(self._all_params) if p is changed[0])
        what = f"optimizer parameter #{position} (shape {tuple(changed[0].shape)})"
        if (
            self.clipper.has_accumulated
            or self._in_logical_step
            or any(getattr(p, "grad_sample", None) is not None for p in current)
        ):
            raise ValueError(
                f"{what} was frozen or unfrozen in the middle of a step (after a backward pass): change "
                f"requires_grad between optimizer.step() and the next forward"
            )
        if not active:
            raise ValueError("every parameter of the optimizer is frozen: nothing to train privately")
        config = self.clipper.config
        if isinstance(config.max_grad_norm, tuple):
            raise ValueError(
                f"{what} changed requires_grad, but max_grad_norm gives one bound per group: the new set of "
                f"parameters has no bounds. Give one total bound (clipping='per_layer' splits it) or freeze "
                f"parameters before make_private."
            )
        clipper = self._clipper_over(active)
        for module in self.contract.modules:
            if hasattr(module, "attach_clipper"):
                module.attach_clipper(clipper, padding_mask_source=module.padding_mask_source)
        clipper.grad_scaler = self.clipper.grad_scaler
        self.noise.restart_layout()
        self.clipper = clipper

    def check_no_foreign_trainable_parameters(self) -> None:
        """Raise ``RuntimeError`` naming the first trainable parameter of a bound wrapped model that this
        optimizer does not hold; change nothing.

        Guarantee: while it passes, every parameter a private forward can give a gradient to is clipped
        and noised by this optimizer (the wrapper is bound only to an optimizer holding all of its
        trainable parameters, and this check keeps that true after ``requires_grad`` changes).

        ======================================  ============================================
        case                                    result
        ======================================  ============================================
        parameter frozen at make_private, in    not foreign: it joins the clipper when
        the optimizer                           unfrozen (``sync_private_parameters``)
        frozen, not in the optimizer            allowed while frozen (it gets no gradient)
        ... unfrozen (own optimizer or none)    RuntimeError at the next forward / step
        frozen again                            allowed again
        ======================================  ============================================
        """
        mine = self._own_parameter_ids()
        for module in self.contract.modules:
            wrapped = getattr(module, "wrapped_module", None)
            if wrapped is None or not has_foreign_trainable_parameter(wrapped, mine):
                continue
            # Found: walk again with names, only to name it in the message.
            for name, param in wrapped.named_parameters():
                if param.requires_grad and id(param) not in mine:
                    raise RuntimeError(
                        f"parameter {name!r} of the wrapped model is trainable but not held by the private "
                        f"optimizer (it was frozen, or left out, when the optimizer was made private, and "
                        f"unfrozen since): a private forward would give it the raw, unclipped gradient, and an "
                        f"optimizer stepping it would release that gradient without noise. Nothing was computed "
                        f"or released. Put every parameter that may be trained in the optimizer given to "
                        f"make_private (frozen ones too: they are clipped and noised from when they are "
                        f"unfrozen), or keep {name!r} frozen (requires_grad_(False))."
                    )

    def _own_parameter_ids(self) -> frozenset[int]:
        """``{id(p) for p in self._all_params}``, built once per ``_all_params`` list (the optimizer's parameters,
        fixed at construction: ``add_param_group`` is refused). Kept out of a copy's state
        (``DPOptimizer.__getstate__``): a copy holds other parameter objects, hence other ids."""
        cached = self.__dict__.get(OWN_IDS_ATTRIBUTE)
        params = self._all_params
        if cached is None or cached[0] is not params or cached[1] != len(params):
            cached = (params, len(params), frozenset(map(id, params)))
            self.__dict__[OWN_IDS_ATTRIBUTE] = cached
        return cached[2]

    def _clipper_over(self, active: list[nn.Parameter]) -> PerSampleGradientClipper:
        """A clipper configured as the current one, over ``active`` (per-layer: the current groups
        kept where their parameters still train, each new parameter a group of its own)."""
        config = self.clipper.config
        groups = None
        if config.clipping == "per_layer":
            kept = [[p for p in group if any(p is a for a in active)] for group in self.clipper.groups]
            grouped = {id(p) for group in kept for p in group}
            groups = [g for g in kept if g] + [[p] for p in active if id(p) not in grouped]
        clipper = PerSampleGradientClipper(active, config.max_grad_norm, clipping=config.clipping, groups=groups,
                                           nan_safe=config.nan_safe,
                                           rescale_to_unit_norm=config.rescale_to_unit_norm)  # fmt: skip
        scheduled = self.clipper._scheduled_bounds  # a clip-norm schedule's bound in force (training.schedules)
        if scheduled is not None:
            # The same total bound, split equally over the new groups as a single max_grad_norm is.
            total = math.sqrt(sum(b * b for b in scheduled))
            clipper.set_bounds([total / math.sqrt(clipper.num_groups)] * clipper.num_groups)
        return clipper
