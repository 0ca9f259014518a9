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
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from privacy_engine.settings_checks import (
    CLIPPING_MODES,
    check_clipping,
    check_flag,
    check_max_grad_norms,
    check_rescale_to_unit_norm,
    total_bound,
)

MaxGradNorm = float | Sequence[float]

__all__ = ["CLIPPING_MODES", "ClippingConfig", "MaxGradNorm", "parameter_groups"]


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
        # Each setting's one check (privacy_engine.settings_checks), as make_private's options make it.
        check_clipping(self.clipping)
        check_flag("nan_safe", self.nan_safe)
        object.__setattr__(self, "max_grad_norm", check_max_grad_norms(self.max_grad_norm, clipping=self.clipping))
        check_rescale_to_unit_norm(self.rescale_to_unit_norm, total_bound(self.max_grad_norm))

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
