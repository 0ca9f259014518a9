"""How per-example gradients are clipped: ``ClippingConfig`` (the bound(s) and the mode) and
``parameter_groups`` (the per-layer groups of ``clipping="per_layer"``).

Clipping modes. ``"flat"``: one L2 norm over all parameters together, bound ``C``. ``"per_layer"``:
the parameters are split into groups (layers, or single parameters) with one bound ``C_g`` each;
each group's slice of an example's gradient is clipped to ``C_g`` separately, so the whole clipped
gradient has norm at most ``sqrt(sum_g C_g^2)``, the *total bound*, which is what the noise must
be scaled to.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from privacy_engine.clipping.rule import validate_max_grad_norm

CLIPPING_MODES = ("flat", "per_layer")

MaxGradNorm = float | Sequence[float]

__all__ = ["CLIPPING_MODES", "ClippingConfig", "MaxGradNorm", "parameter_groups"]


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class ClippingConfig:
    """How per-example gradients are clipped.

    Keyword Args:
        max_grad_norm: ``"flat"``: one bound ``C >= 0`` (``inf`` disables clipping).
            ``"per_layer"``: one bound per parameter group, or a single number ``C`` that is split
            evenly as ``C / sqrt(G)`` over the ``G`` groups (so the total bound is ``C``).
        clipping: ``"flat"`` or ``"per_layer"``.
        nan_safe: non-finite entries (NaN, +-Inf) of a per-sample gradient count as 0 (True), or
            the whole example (its group, for per_layer) is dropped (False). Either way the bound
            holds; True keeps the example's finite part.
        rescale_to_unit_norm: divide the clipped gradients by the total bound so each has norm at
            most 1; the noise is then scaled to sensitivity 1 (``sensitivity``). Needs a finite
            total bound > 0.
    """

    max_grad_norm: MaxGradNorm
    clipping: str = "flat"
    nan_safe: bool = True
    rescale_to_unit_norm: bool = False

    def __post_init__(self) -> None:
        if self.clipping not in CLIPPING_MODES:
            raise ValueError(f"clipping must be one of {CLIPPING_MODES}; got {self.clipping!r}")
        if not isinstance(self.nan_safe, bool):
            raise TypeError(f"nan_safe must be a bool; got {self.nan_safe!r}")
        if not isinstance(self.rescale_to_unit_norm, bool):
            raise TypeError(f"rescale_to_unit_norm must be a bool; got {self.rescale_to_unit_norm!r}")
        if _is_real(self.max_grad_norm):
            object.__setattr__(self, "max_grad_norm", validate_max_grad_norm(self.max_grad_norm))
            return
        if self.clipping == "flat":
            raise TypeError(
                f"max_grad_norm must be a number for clipping='flat'; got {self.max_grad_norm!r}. "
                f"Use clipping='per_layer' for one bound per layer."
            )
        if isinstance(self.max_grad_norm, (str, bytes)) or not isinstance(self.max_grad_norm, Iterable):
            raise TypeError(f"max_grad_norm must be a number or a sequence of numbers; got {self.max_grad_norm!r}")
        bounds = tuple(self.max_grad_norm)
        if not bounds:
            raise ValueError("max_grad_norm is an empty sequence; give one bound per parameter group")
        for index, bound in enumerate(bounds):
            if not _is_real(bound):
                raise TypeError(f"max_grad_norm[{index}] must be a number; got {bound!r}")
        object.__setattr__(
            self,
            "max_grad_norm",
            tuple(validate_max_grad_norm(b, name=f"max_grad_norm[{i}]") for i, b in enumerate(bounds)),
        )

    def group_bounds(self, num_groups: int) -> tuple[float, ...]:
        """The bound of each of ``num_groups`` groups (raises if a sequence has another length)."""
        if isinstance(self.max_grad_norm, tuple):
            if len(self.max_grad_norm) != num_groups:
                raise ValueError(
                    f"max_grad_norm has {len(self.max_grad_norm)} bounds but there are {num_groups} "
                    f"parameter groups; give exactly one bound per group"
                )
            return self.max_grad_norm
        if self.clipping == "flat":
            return (self.max_grad_norm,)
        return (self.max_grad_norm / math.sqrt(num_groups),) * num_groups


def parameter_groups(
    module: nn.Module, params: Sequence[nn.Parameter], *, per: str = "layer"
) -> list[list[nn.Parameter]]:
    """Split ``params`` into per-layer clipping groups along ``module``'s structure.

    ``per="layer"``: one group per submodule that directly owns at least one of ``params`` (its
    own parameters, not its children's), in ``module.named_modules()`` order; a parameter shared
    by several modules (tied weights) belongs to the first. ``per="parameter"``: one group per
    parameter, in the order of ``params``. Parameters of ``params`` that ``module`` does not own
    raise ``ValueError``.
    """
    if per not in ("layer", "parameter"):
        raise ValueError(f"per must be 'layer' or 'parameter'; got {per!r}")
    wanted = {id(p) for p in params}
    owned = {id(p) for p in module.parameters()}
    missing = [i for i, p in enumerate(params) if id(p) not in owned]
    if missing:
        raise ValueError(f"params at positions {missing} are not parameters of the module")
    if per == "parameter":
        return [[p] for p in params]
    groups: list[list[nn.Parameter]] = []
    seen: set = set()
    for _, submodule in module.named_modules():
        group = []
        for param in submodule.parameters(recurse=False):
            if id(param) in wanted and id(param) not in seen:
                seen.add(id(param))
                group.append(param)
        if group:
            groups.append(group)
    return groups
