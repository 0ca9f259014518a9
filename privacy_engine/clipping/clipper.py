"""Per-example gradient clipping: turn per-sample gradients into one bounded-sensitivity sum.

The clipper owns the sum of clipped per-example gradients (the *accumulator*) between backward
passes and the optimizer step. Two producers fill it:

- ``clip_and_accumulate()`` reads ``param.grad_sample`` (materialised per-sample gradients, from
  ``GradSampleModule``), clips and sums them, and frees them;
- ``accumulate_clipped_sums_()`` takes per-sample norms and already clipped per-parameter sums from
  a path that never materialises per-sample gradients (fast / ghost clipping,
  ``privacy_engine.clipping.ghost``). That path gets its factors from ``clip_factors_for_norms()`` so
  both paths apply the same rule (``privacy_engine.clipping.rule.clip_factors``).

``pre_step()`` writes the accumulated sum into each parameter's ``.grad`` and returns statistics.
Neither the noise nor the division by the batch size happens here (see ``DPOptimizer``). The clipping
modes and their bounds: ``privacy_engine.clipping.config``.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from privacy_engine.clipping.adaptive import AdaptiveClipping
from privacy_engine.clipping.config import ClippingConfig, MaxGradNorm
from privacy_engine.clipping.per_sample_ops import (
    all_finite,
    expand_rows,
    finite_entries,
    norm_dtype,
    squared_norms,
    sum_dtype,
    sum_per_user,
)
from privacy_engine.clipping.rule import clip_factors
from privacy_engine.clipping.stats import ClippingStats, combined_totals

# torch.promote_types goes through the dispatcher (a few microseconds); the fast-clipping pass asks once per
# parameter per pass for the same few dtypes, so the answers are kept.
_promote_types = functools.cache(torch.promote_types)
_norm_dtype = functools.cache(norm_dtype)
_sum_dtype = functools.cache(sum_dtype)
# Dtypes whose clipped sums are kept in the dtype itself (``sum_dtype`` of each is itself; checked at import).
_WIDE_DTYPES = frozenset(dtype for dtype in (torch.float32, torch.float64) if sum_dtype(dtype) == dtype)

__all__ = ["PerSampleGradientClipper"]


class PerSampleGradientClipper:
    """Clips per-example gradients and keeps their sum until ``pre_step()``.

    Guarantee: whatever the per-sample gradients are (any norm, NaN, +-Inf), each example's
    (each user's, with ``group_ids``) contribution to the sum written by ``pre_step`` has L2 norm
    at most ``total_bound`` (at most 1 with ``rescale_to_unit_norm``), its per-layer slices at most
    their group bounds, and padding examples contribute exactly zero. Each call's contribution is
    computed from the per-sample gradients of that call only, so calling ``clip_and_accumulate``
    once per micro-batch gives the same sum as one call on the concatenated batch.

    ======================================  =================================================
    case                                    result
    ======================================  =================================================
    max_grad_norm = 0                       every contribution is zero
    max_grad_norm = inf                     no clipping (sum of raw gradients); no DP noise
                                            can be scaled to it (the optimizer refuses)
    per-sample gradient of norm 0           contributes zero, counted, not clipped
    NaN / +-Inf entries, nan_safe=True      those entries count as 0, the rest is clipped
    NaN / +-Inf entries, nan_safe=False     the example (its group, per_layer) is dropped
    finite entries, norm overflows to inf   the example is dropped (factor 0)
    rescale_to_unit_norm                    clipped gradients divided by the total bound
    padding_mask[i] True                    example i contributes exactly zero, not counted
    group_ids given                         examples with equal id summed, then clipped
    param without grad_sample               treated as a zero per-sample gradient
    grad_sample batch sizes differ          ValueError, nothing changed
    no grad_sample at all                   nothing accumulated (an empty batch)
    ======================================  =================================================

    Args:
        params: the parameters to clip, in a fixed order (the order of the noise layout).
        max_grad_norm: see ``ClippingConfig``.
        clipping: ``"flat"`` or ``"per_layer"``.
        groups: for ``per_layer``, a partition of ``params`` into groups (e.g. from
            ``parameter_groups``); default one group per parameter. Ignored for ``flat``.
        nan_safe, rescale_to_unit_norm: see ``ClippingConfig``.
        adaptive: an ``AdaptiveClipping`` (one clip norm per group) whose ``clip_norms`` are the
            bounds in force (read at every clipping call; ``max_grad_norm`` is then only the bounds the
            configuration and checkpoints are checked against) and which counts, at every call, the
            examples left unclipped. ``None``: fixed bounds.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        max_grad_norm: MaxGradNorm,
        *,
        clipping: str = "flat",
        groups: Sequence[Sequence[nn.Parameter]] | None = None,
        nan_safe: bool = True,
        rescale_to_unit_norm: bool = False,
        adaptive: AdaptiveClipping | None = None,
    ) -> None:
        self.config = ClippingConfig(
            max_grad_norm=max_grad_norm,
            clipping=clipping,
            nan_safe=nan_safe,
            rescale_to_unit_norm=rescale_to_unit_norm,
        )
        self.params: list[nn.Parameter] = list(params)
        if not self.params:
            raise ValueError("params is empty: the clipper needs at least one trainable parameter")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("params lists a parameter twice; give each parameter once")
        if clipping == "flat":
            groups = [self.params]
        elif groups is None:
            groups = [[p] for p in self.params]
        self.groups: list[list[nn.Parameter]] = [list(g) for g in groups]
        self._check_partition()
        self._index_of: dict[int, int] = {id(p): i for i, p in enumerate(self.params)}
        self._group_of: dict[int, int] = {id(p): g for g, group in enumerate(self.groups) for p in group}
        self._configured_bounds: tuple[float, ...] = self.config.group_bounds(len(self.groups))
        self._configured_total_bound: float = math.sqrt(sum(b * b for b in self._configured_bounds))
        #: Bounds set by a clip-norm schedule (``set_bounds``), in force instead of the configured ones; None: none.
        self._scheduled_bounds: tuple[float, ...] | None = None
        #: Adaptive clipping (``privacy_engine.clipping.adaptive``): the owner of the bounds in force; None: fixed.
        self.adaptive: AdaptiveClipping | None = adaptive
        # rescale_to_unit_norm with adaptive clipping divides by the total bound in force at each call (public: set
        # from earlier released counts), so the release's scale no longer follows the clip norm.
        if adaptive is not None and adaptive.num_groups != len(self.groups):
            raise ValueError(f"adaptive has {adaptive.num_groups} clip norms; the clipper has {len(self.groups)} groups")
        self._accumulated: dict[int, torch.Tensor] = {}  # param index -> clipped sum
        self._totals: torch.Tensor | None = None  # see ClippingStats.totals (restored from a state_dict)
        # (norms, padding mask) of each call since the last pre_step: the statistics are computed from them
        # when read (ClippingStats), not at every call.
        self._stat_batches: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        #: A ``torch.amp.GradScaler`` whose loss scale the per-sample gradients carry (``loss_scale``);
        #: set by ``DPOptimizer.attach_grad_scaler``.
        self.grad_scaler: Any = None

    def _check_partition(self) -> None:
        position = {id(p): i for i, p in enumerate(self.params)}
        seen: set = set()
        for g, group in enumerate(self.groups):
            if not group:
                raise ValueError(f"groups[{g}] is empty; every group needs at least one parameter")
            for param in group:
                if id(param) not in position:
                    raise ValueError(f"groups[{g}] holds a parameter that is not in params")
                if id(param) in seen:
                    raise ValueError(f"groups[{g}] repeats a parameter already in an earlier group")
                seen.add(id(param))
        if len(seen) != len(self.params):
            raise ValueError("groups do not cover every parameter in params; each must be in exactly one group")

    # ------------------------------------------------------------------ properties
    @property
    def bounds(self) -> tuple[float, ...]:
        """The bound in force for each group: ``max_grad_norm``'s, or adaptive clipping's current clip norms."""
        if self.adaptive is not None:
            return self.adaptive.clip_norms
        return self._configured_bounds if self._scheduled_bounds is None else self._scheduled_bounds

    def set_bounds(self, bounds: Sequence[float]) -> None:
        """Clip at ``bounds`` (one per group, each >= 0) from the next clipping call on: a clip-norm schedule
        (``training.schedules``). Guarantee: every example clipped after the call has group norms at most these
        bounds. ``ValueError`` (nothing changed) with adaptive clipping (it owns the bounds), a clipped sum
        waiting (clipped at the old bounds), or a wrong count / negative / NaN bound."""
        bounds = tuple(float(b) for b in bounds)
        if len(bounds) != len(self.groups) or any(not b >= 0.0 for b in bounds):
            raise ValueError(f"bounds must be {len(self.groups)} numbers >= 0 (one per group); got {list(bounds)}")
        if self.adaptive is not None:
            raise ValueError("set_bounds with adaptive clipping: the clip norms in force are adaptive clipping's")
        if self.has_accumulated and bounds != self.bounds:
            raise ValueError("set_bounds while a clipped sum waits for the release (clipped at the old bounds)")
        self._scheduled_bounds = None if bounds == self._configured_bounds else bounds

    @property
    def total_bound(self) -> float:
        """``sqrt(sum_g bound_g^2)``: the L2 bound of one example's whole clipped gradient, now."""
        if self.adaptive is None and self._scheduled_bounds is None:
            return self._configured_total_bound
        return math.sqrt(sum(b * b for b in self.bounds))

    @property
    def sensitivity(self) -> float:
        """L2 norm bound of one example's contribution: the scale the noise must be drawn at."""
        return 1.0 if self.config.rescale_to_unit_norm else self.total_bound

    @property
    def num_groups(self) -> int:
        """The number of clipping groups (columns of the per-example norms and factors; 1 for flat clipping)."""
        return len(self.groups)

    def group_index(self, param: nn.Parameter) -> int:
        """Which clipping group ``param`` belongs to (column of the norms and factors)."""
        try:
            return self._group_of[id(param)]
        except KeyError:
            raise ValueError("param is not one of the clipper's parameters") from None

    @property
    def has_accumulated(self) -> bool:
        """Whether anything was accumulated since the last ``pre_step`` / ``reset``."""
        return self._totals is not None or bool(self._stat_batches)

    # ------------------------------------------------------------------ loss scaling
    def loss_scale(self) -> float:
        """The factor the per-sample gradients handed to this clipper carry: the current scale of the
        attached ``torch.amp.GradScaler`` (``grad_scaler``), 1 without one or when it is disabled.

        Guarantee: both clipping paths divide the per-example norms by it before the clip factors are
        formed and the clipped sums by it before they are accumulated, so what is clipped at
        ``max_grad_norm`` is the true (unscaled) gradient of each example. The scale is read when a pass
        is clipped, which is before ``scaler.update()`` can change it (update runs after the step).
        """
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return 1.0
        return float(scaler.get_scale())

    # ------------------------------------------------------------------ the shared rule
    def group_norms_from_squared(
        self, per_param_squared_norms: Mapping[nn.Parameter, torch.Tensor]
    ) -> torch.Tensor:
        """Per-example norms of each group, shape ``(batch, num_groups)``, from per-parameter
        squared norms of shape ``(batch,)``. Parameters left out count as zero gradients."""
        batch_size, device, dtype = None, None, torch.float32
        for param, squared in per_param_squared_norms.items():
            dtype = _promote_types(dtype, _norm_dtype(squared.dtype))
            self.group_index(param)
            if squared.dim() != 1 or (batch_size is not None and squared.shape[0] != batch_size):
                raise ValueError(
                    f"per-parameter squared norms must all have shape (batch,); got {tuple(squared.shape)}"
                    + ("" if batch_size is None else f" after ({batch_size},)")
                )
            if batch_size is None:
                batch_size, device = squared.shape[0], squared.device
        if batch_size is None:
            raise ValueError("per_param_squared_norms is empty")
        if len(per_param_squared_norms) == 1 and len(self.groups) == 1:
            # One group (flat clipping) summed first by the caller: the column itself, no stack. ``to`` only where
            # it changes something (the device is the entry's own here); sqrt gives a fresh tensor either way.
            (squared,) = per_param_squared_norms.values()
            if squared.requires_grad:
                squared = squared.detach()
            if squared.dtype != dtype:
                squared = squared.to(dtype=dtype)
            return squared.sqrt().unsqueeze(1)
        if len(per_param_squared_norms) == self.num_groups == len(
            {self._group_of[id(param)] for param in per_param_squared_norms}
        ):
            # One entry per group (fast clipping sums each group's squares first): no sums to form.
            columns = sorted(per_param_squared_norms.items(), key=lambda item: self._group_of[id(item[0])])
            stacked = torch.stack([squared.detach().to(device=device, dtype=dtype) for _, squared in columns], dim=1)
            return stacked.sqrt()
        squared_sums = torch.zeros(batch_size, self.num_groups, device=device, dtype=dtype)
        for param, squared in per_param_squared_norms.items():
            column = self._group_of[id(param)]
            squared_sums[:, column] += squared.detach().to(device=device, dtype=dtype)
        return squared_sums.sqrt()

    def clip_factors_for_norms(
        self, per_sample_norms: torch.Tensor, *, padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Factors, shape ``(batch, num_groups)``, such that ``factor[i, g] * (example i's slice of
        group g)`` has norm at most the group's bound (divided by the total bound when rescaling).

        ``per_sample_norms``: the unclipped group norms, shape ``(batch, num_groups)`` (or
        ``(batch,)`` for flat clipping). Each column goes through ``clip_factors``, the rule shared
        by every clipping path; see its table for the edge cases.
        """
        norms = self._as_group_norms(per_sample_norms)
        rescale = self.config.rescale_to_unit_norm
        if self.config.clipping == "flat":
            if padding_mask is None:
                # The rule is elementwise: the (batch, 1) column's factors are the same floats as those of its
                # (batch,) view, without the select and unsqueeze around it (two ops per clipping call).
                return clip_factors(norms, self.bounds[0], rescale_to_unit_norm=rescale)
            return clip_factors(
                norms.select(1, 0), self.bounds[0], rescale_to_unit_norm=rescale, padding_mask=padding_mask
            ).unsqueeze(1)
        columns = [
            clip_factors(norms.select(1, g), bound, padding_mask=padding_mask) for g, bound in enumerate(self.bounds)
        ]
        factors = torch.stack(columns, dim=1)
        # Rescale by the total bound (not each group's own), so the whole gradient has norm <= 1.
        return factors / self.total_bound if rescale else factors

    def _as_group_norms(self, per_sample_norms: torch.Tensor) -> torch.Tensor:
        # Detached only where it changes something: the callers read the norms, never write them.
        norms = per_sample_norms.detach() if per_sample_norms.requires_grad else per_sample_norms
        if norms.dim() == 1 and self.num_groups == 1:
            norms = norms[:, None]
        if norms.dim() != 2 or norms.shape[1] != self.num_groups:
            raise ValueError(
                f"per_sample_norms has shape {tuple(per_sample_norms.shape)}; expected "
                f"(batch, {self.num_groups}) (one column per clipping group)"
            )
        return norms

    # ------------------------------------------------------------------ producers
    def clip_and_accumulate(
        self,
        *,
        padding_mask: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> None:
        """Clip the per-sample gradients in ``param.grad_sample``, add their sum to the
        accumulator and free them (``param.grad_sample = None``).

        ``padding_mask``: bool ``(batch,)``, True for padding examples (contribute exactly zero).
        ``group_ids``: integer ``(batch,)``; examples with the same id (one user's examples) are
        summed before clipping, so the bound holds per user. Ids need not be contiguous. Each call
        groups its own batch only: a user whose examples are split over two calls is clipped twice.

        Guarantee and edge cases: see the class docstring. Everything is checked before any state
        changes.
        """
        present = [(i, p, p.grad_sample) for i, p in enumerate(self.params) if getattr(p, "grad_sample", None) is not None]
        if not present:
            if group_ids is not None:
                # Fast clipping never materialises per-sample gradients; returning quietly here would
                # skip the per-user grouping the caller asked for.
                raise ValueError(
                    "group_ids (per-user clipping) needs materialised per-sample gradients, and none are "
                    "present: per-user clipping is not supported with grad_sample_mode='ghost'."
                )
            return
        batch_size = present[0][2].shape[0]
        for _, param, grads in present:
            if grads.dim() == 0 or grads.shape[0] != batch_size or tuple(grads.shape[1:]) != tuple(param.shape):
                raise ValueError(
                    f"grad_sample of shape {tuple(grads.shape)} for a parameter of shape {tuple(param.shape)}; "
                    f"expected ({batch_size}, *param.shape) like the first parameter's. Run one forward/backward "
                    f"per clip_and_accumulate() call."
                )
        device = present[0][2].device
        padding_mask = self._checked_per_example("padding_mask", padding_mask, batch_size, device)
        if padding_mask is not None and padding_mask.dtype != torch.bool:
            raise TypeError(f"padding_mask must be a bool tensor; got dtype {padding_mask.dtype}")
        group_ids = self._checked_per_example("group_ids", group_ids, batch_size, device)
        if group_ids is not None and (group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool):
            raise TypeError(f"group_ids must be an integer tensor; got dtype {group_ids.dtype}")

        with torch.no_grad():
            grads_by_index = {index: grads.detach() for index, _, grads in present}
            if group_ids is not None:
                if self.config.nan_safe:  # entries must be zeroed before examples are summed
                    grads_by_index = {i: finite_entries(g) for i, g in grads_by_index.items()}
                grads_by_index, padding_mask = sum_per_user(grads_by_index, group_ids, padding_mask)
            squared = squared_norms(self.params, grads_by_index)
            # A finite norm means every entry is finite, so the copy that zeroes non-finite entries is
            # only needed when some norm is not: one pass over the per-sample gradients saved in the
            # common case, at the price of one host sync.
            if self.config.nan_safe and group_ids is None and not all_finite(squared.values()):
                grads_by_index = {i: finite_entries(g) for i, g in grads_by_index.items()}
                squared = squared_norms(self.params, grads_by_index)
            norms = self.group_norms_from_squared(squared)
            loss_scale = self.loss_scale()
            if loss_scale != 1.0:
                norms = norms / loss_scale  # the norms of the unscaled gradients
            factors = self.clip_factors_for_norms(norms, padding_mask=padding_mask)
            weights = factors if loss_scale == 1.0 else factors / loss_scale
            clipped_sums = {}
            for index, grads in grads_by_index.items():
                column = weights[:, self._group_of[id(self.params[index])]].to(device=grads.device)
                if not self.config.nan_safe:
                    # factor 0 times a NaN/Inf entry is NaN: drop those rows outright. (nan_safe
                    # already zeroed every non-finite entry, and 0 * finite = 0.)
                    grads = torch.where(expand_rows(column > 0, grads), grads, torch.zeros((), dtype=grads.dtype, device=grads.device))
                # Summed in float32 at least: a bf16/fp16 sum would round to an ulp of the whole batch's sum.
                accumulation = norm_dtype(grads.dtype)
                clipped_sums[self.params[index]] = torch.tensordot(column.to(accumulation), grads.to(accumulation), dims=1)
            self._accumulate(clipped_sums, norms, padding_mask, owned=True)
        for param in self.params:
            if getattr(param, "grad_sample", None) is not None:
                param.grad_sample = None

    def accumulate_clipped_sums_(
        self,
        clipped_sums: Mapping[nn.Parameter, torch.Tensor],
        per_sample_norms: torch.Tensor,
        *,
        padding_mask: torch.Tensor | None = None,
        take_ownership: bool = False,
    ) -> None:
        """Add clipped per-parameter sums computed elsewhere (fast clipping) and record statistics,
        exactly as ``clip_and_accumulate`` does for materialised per-sample gradients.

        Contract (what keeps the guarantee): ``clipped_sums[p] = sum_i factor[i, g(p)] * g_i(p)``
        with ``factor = clip_factors_for_norms(per_sample_norms, padding_mask=padding_mask)`` and
        ``g(p) = group_index(p)``, over per-sample gradients whose non-finite entries were handled
        per ``nan_safe`` before the norms were taken. ``per_sample_norms``: unclipped group norms,
        ``(batch, num_groups)`` (``(batch,)`` for flat). Parameters left out contribute zero.
        ``take_ownership=True``: the caller hands over fresh tensors it will not touch again, so the
        first sum is kept as the accumulator instead of being copied.

        ==============================  ===========================================
        case                            result
        ==============================  ===========================================
        a key not in the clipper        ValueError, nothing changed
        a sum of the wrong shape        ValueError, nothing changed
        norms of the wrong shape        ValueError, nothing changed
        empty ``clipped_sums``          only the statistics are updated
        ==============================  ===========================================
        """
        norms = self._as_group_norms(per_sample_norms)
        padding_mask = self._checked_per_example("padding_mask", padding_mask, norms.shape[0], norms.device)
        index_of = self._index_of
        checked = []  # (index, param, sum): every key and shape checked before anything is added
        for param, total in clipped_sums.items():
            index = index_of.get(id(param))
            if index is None:
                self.group_index(param)  # raises
            if total.shape != param.shape:
                raise ValueError(
                    f"clipped sum of shape {tuple(total.shape)} for a parameter of shape {tuple(param.shape)}"
                )
            checked.append((index, param, total))
        self._accumulate_checked(checked, owned=take_ownership)
        self._record_stats(norms, padding_mask)

    # ------------------------------------------------------------------ consumer
    def pre_step(self) -> ClippingStats:
        """Write the accumulated clipped sum into each parameter's ``.grad`` (zeros for a
        parameter nothing was accumulated for, e.g. after an empty batch), reset the accumulator
        and return the statistics of what was accumulated since the last ``pre_step``.

        The ``.grad`` tensors are fresh (not aliasing any user tensor): the optimizer adds noise
        to them in place.
        """
        params = self.params
        # One C-level pass per column where one serves (a step of many small parameters paid ~1 us per parameter
        # for each Python iteration here).
        sums = list(map(self._accumulated.get, range(len(params))))
        if type(None) in map(type, sums):  # (``None in sums`` would compare tensors' values)
            sums = [
                torch.zeros_like(param, dtype=sum_dtype(param.dtype)) if total is None else total
                for param, total in zip(params, sums)
            ]
        dtype_of = operator.attrgetter("dtype")
        if list(map(dtype_of, sums)) == list(map(dtype_of, params)):
            for param, total in zip(params, sums):
                param.grad = total
        else:
            for param, total in zip(params, sums):
                # A half-precision parameter's sum stays in float32 until the noise is added (rounding the
                # clipped sum to bf16 first could push one example's contribution past the bound): the
                # optimizer casts the noised sum into .grad (``released_sums``).
                param.grad = total if total.dtype == param.dtype else None
        #: The sums just written (in float32 at least), in ``params`` order: what the noise is added to.
        self.released_sums = sums
        totals, batches, bounds = self._totals, self._stat_batches, self.bounds
        self.reset()
        if totals is None and not batches:
            return ClippingStats(torch.zeros(4, dtype=torch.float64))
        return ClippingStats(lambda: combined_totals(totals, batches, bounds))

    def reset(self) -> None:
        """Drop the accumulated sum and statistics (per-sample gradients are left alone)."""
        self._accumulated = {}
        self._totals = None
        self._stat_batches = []
        if self.adaptive is not None:
            self.adaptive.discard_count()

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, object]:
        """The accumulated sums (clipped, un-noised gradients: keep them as secret as the data)
        and statistics, so a run saved between micro-batches of one logical step resumes exactly."""
        state = {
            "accumulated": {index: total.detach().clone() for index, total in self._accumulated.items()},
            "totals": combined_totals(self._totals, self._stat_batches, self.bounds) if self.has_accumulated else None,
            "bounds": list(self._configured_bounds),
            "clipping": self.config.clipping,
        }
        if self.adaptive is not None:
            state["adaptive"] = self.adaptive.state_dict()  # the bounds in force and the open count
        if self._scheduled_bounds is not None:
            state["bounds_in_force"] = list(self._scheduled_bounds)  # set by a clip-norm schedule
        return state

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore ``state_dict()``; raises (changing nothing) if it was saved by a clipper with
        other bounds, another mode or other parameter shapes."""
        if state.get("clipping") != self.config.clipping or tuple(state.get("bounds", ())) != self._configured_bounds:
            raise ValueError(
                f"clipper state was saved with clipping={state.get('clipping')!r}, bounds={state.get('bounds')}; "
                f"this clipper has clipping={self.config.clipping!r}, bounds={list(self._configured_bounds)}"
            )
        if ("adaptive" in state) != (self.adaptive is not None):
            raise ValueError("clipper state was saved with adaptive clipping on" if "adaptive" in state
                             else "clipper state was saved without adaptive clipping; this clipper has it")  # fmt: skip
        if self.adaptive is not None:
            self.adaptive.check_state_dict(state["adaptive"])
        in_force = state.get("bounds_in_force")
        if in_force is not None:
            if (not isinstance(in_force, (list, tuple)) or len(in_force) != len(self.groups)
                    or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and b >= 0.0 for b in in_force)):  # fmt: skip
                raise ValueError(f"clipper state's bounds_in_force must be {len(self.groups)} numbers >= 0")
            if self.adaptive is not None:
                raise ValueError("clipper state has scheduled bounds and adaptive clipping (it was altered)")
        accumulated = dict(state["accumulated"])
        for index, total in accumulated.items():
            if not (0 <= int(index) < len(self.params)) or tuple(total.shape) != tuple(self.params[int(index)].shape):
                raise ValueError(f"saved accumulator {index} does not match the clipper's parameters")
        self._accumulated = {
            int(i): t.to(device=self.params[int(i)].device, dtype=sum_dtype(self.params[int(i)].dtype)).clone()
            for i, t in accumulated.items()
        }
        totals = state["totals"]
        self._totals = None if totals is None else totals.clone()
        self._stat_batches = []
        if self.adaptive is not None:
            self.adaptive.load_state_dict(state["adaptive"])
        self._scheduled_bounds = None if in_force is None else tuple(float(b) for b in in_force)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _checked_per_example(
        name: str, values: torch.Tensor | None, batch_size: int, device: torch.device
    ) -> torch.Tensor | None:
        if values is None:
            return None
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{name} must be a tensor of shape ({batch_size},); got {type(values).__name__}")
        if tuple(values.shape) != (batch_size,):
            raise ValueError(f"{name} has shape {tuple(values.shape)}; expected ({batch_size},), one entry per example")
        return values.to(device)

    def _accumulate(
        self,
        clipped_sums: Mapping[nn.Parameter, torch.Tensor],
        norms: torch.Tensor,
        padding_mask: torch.Tensor | None,
        *,
        owned: bool = False,
    ) -> None:
        """``owned``: the sums are fresh tensors nobody else holds, so the first one is kept as is."""
        index_of = self._index_of
        self._accumulate_checked([(index_of[id(param)], param, total) for param, total in clipped_sums.items()], owned=owned)
        self._record_stats(norms, padding_mask)

    def _accumulate_checked(self, sums: Sequence[tuple[int, nn.Parameter, torch.Tensor]], *, owned: bool) -> None:
        """Add each ``(index in params, param, clipped sum)`` (checked by the caller) to the accumulator."""
        accumulated = self._accumulated
        for index, param, total in sums:
            # detach / to only where they change something (the same tensor values either way): this runs
            # once per parameter per pass, so the common case (a float32/float64 sum of a parameter of that
            # dtype, both on the CPU) is recognised from attributes alone.
            if total.requires_grad or total._base is not None:
                total = total.detach()  # kept as the accumulator (``owned``): never a view, never in a graph
            dtype = param.dtype
            if not (total.dtype is dtype and dtype in _WIDE_DTYPES and total.is_cpu and param.is_cpu):
                dtype = _sum_dtype(dtype)
                if total.dtype != dtype or total.device != param.device:
                    total = total.to(dtype=dtype, device=param.device)
            previous = accumulated.get(index)
            if previous is None:
                accumulated[index] = total if owned else total.clone()
            else:
                previous.add_(total)

    def _record_stats(self, norms: torch.Tensor, padding_mask: torch.Tensor | None) -> None:
        if self.adaptive is not None:
            # Counted against the bounds these norms were just clipped with (fixed within a logical step).
            self.adaptive.count_unclipped_(norms, padding_mask)
        # Copies (a few numbers per example): the caller's tensors may change before the totals are read.
        # (clone alone where it gives the same tensor as detach().clone(): norms outside any graph.)
        kept = (norms.detach() if norms.requires_grad else norms).clone()
        self._stat_batches.append((kept, None if padding_mask is None else padding_mask.clone()))
