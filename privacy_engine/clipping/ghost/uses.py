"""What fast clipping keeps: each gated (or fallback) call of a layer (``Use``), what a backward pass has
gathered until its end (``BackwardPass``), the wrapper's state between calls (``GhostPasses``, ``ClipperLink``),
and the small tensor helpers the gate, the attention decomposition and the end of the pass share.

====================  ==============  ====================================  ===============================
state                 on the wrapper  written by                            read by
====================  ==============  ====================================  ===============================
``GhostPasses``       ``_passes``     gate.py, attention.py and module.py   backward.py (``_current_pass``,
                                      (``pending``: each gated / fallback   ``_finish_pass``)
                                      call); backward.py (``current``);
                                      ``set_padding_mask``, ``forward``
``ClipperLink``       ``_clipping``   ``attach_clipper`` (replaced whole)   backward.py, ``clipper``,
                                                                            ``padding_mask_source``
====================  ==============  ====================================  ===============================

The base wrapper's state (``capture.state``) is used as by ``GradSampleModule``: ``_tables`` (owners,
patched modules, hooks), ``_flags.inside_fallback``, the batch-size bookkeeping and the step binding.
"""

from __future__ import annotations

import itertools
import math
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from privacy_engine.clipping.per_user import UserRows
from privacy_engine.models.validation import module_label

__all__ = [
    "BackwardPass",
    "ClipperLink",
    "GhostPasses",
    "Rows",
    "Use",
    "add_rows",
    "check_sampler_result",
    "in_float32",
    "row_numel",
    "row_shape",
    "shared_parameters",
    "tensor_bytes",
    "zero_rows",
]

Rows = slice | None


@dataclass(eq=False)
class Use:
    """One gated call (or one fallback call) of one forward: what its backward needs.

    ``parts``: the trainable parameters the call reads, each with the rows it reads (None: all).
    ``norms`` / ``sums`` / ``grads``: ``(activations, G) -> {param: squared norms (B,)}``,
    ``(activations, G, weights) -> {param: weighted sum}``, ``(activations, G) -> {param: (B, ...)}``;
    ``norms``/``sums`` None when only materialising is possible. A fallback call has no functions:
    its per-example gradients arrive through hooks. ``batch_dim``: where the examples sit in ``activations``
    and in the output gradient (the layer's own layout; 0 for attention's projections, which run batch first).
    ``stacks_users``: ``norms`` gives a user's squared norm from its rows stacked as one example
    (``clipping.per_user.stacks_users``; user-level passes only).
    """

    path: str
    layer: nn.Module
    parts: tuple[tuple[nn.Parameter, Rows], ...]
    activations: tuple | None = None
    norms: Callable | None = None
    sums: Callable | None = None
    grads: Callable | None = None
    consumed: bool = False
    grad_shape: torch.Size | None = None
    generation: int = 0  # the training forward this call belongs to (see StepContractBinding._check_live)
    batch_dim: int = 0
    stacks_users: bool = False
    rank_one_linear: bool = False  # an nn.Linear with the built-in samplers: see batched.rank_one_linear
    # An earlier backward pass through this call's forward was clipped without reaching it: a backward reaching it
    # now would clip that forward's examples a second time (see BackwardPasses._refuse_second_pass).
    forward_clipped: bool = False


def shared_parameters(uses: Sequence[Use]) -> set:
    """Parameters whose uses overlap (a whole-parameter use twice, or overlapping row blocks): their
    per-example norm needs cross terms, so they are materialised."""
    # Keyed by id, not by the parameter: a tensor's __hash__ is a Python call, and this runs over every call of
    # the pass (the uses hold their parameters, so no id is reused while it runs). No parameter read twice (the
    # usual case): nothing can overlap, so none is shared (one comprehension instead of the per-part loop below).
    ids = [id(param) for use in uses for param, _ in use.parts]
    if len(set(ids)) == len(ids):
        return set()
    # Entry: [param, rows, rows, ...].
    spans: dict[int, list] = {}
    for use in uses:
        for param, rows in use.parts:
            entry = spans.get(id(param))
            if entry is None:
                spans[id(param)] = [param, rows]
            else:
                entry.append(rows)
    shared = set()
    for entry in spans.values():
        if len(entry) < 3:
            continue
        param, rows_list = entry[0], entry[1:]
        if any(rows is None for rows in rows_list):
            shared.add(param)
            continue
        ordered = sorted((rows.start, rows.stop) for rows in rows_list)
        if any(later[0] < earlier[1] for earlier, later in itertools.pairwise(ordered)):
            shared.add(param)
    return shared


# A sum of two uses' per-example gradients larger than this gets a fresh tensor each pass instead of a buffer kept
# from the last one (``GhostPasses.buffers``): what is kept between steps stays bounded.
REUSED_BUFFER_BYTES = 64 * 2**20


class BackwardPass:
    """What one backward pass has gathered, until its end-of-backward callback.

    ``buffers``: the wrapper's buffers kept between passes (``GhostPasses.buffers``), which the sum of a shared
    parameter's per-example gradients is written into when one of the right shape and dtype is there."""

    def __init__(self, shared: set, buffers: dict | None = None) -> None:
        self.shared = shared
        self.buffers: dict[nn.Parameter, torch.Tensor] = {} if buffers is None else buffers
        self.batch: tuple[Use, int] | None = None  # the first layer the pass reached, and its batch size
        self.squared_norms: dict[nn.Parameter, torch.Tensor] = {}  # unscaled, summed over disjoint rows
        self.deferred: list[tuple[Use, Callable, tuple, torch.Tensor]] = []  # (use, sums, activations, G)
        self.materialised: dict[nn.Parameter, torch.Tensor] = {}  # (B, *param.shape), unscaled
        # The parameters whose ``materialised`` total is a buffer this pass created (not a sampler's result, which
        # may alias an autograd buffer): row blocks are added into those in place, without a copy first.
        self.owned_materialised: set[nn.Parameter] = set()
        self.reached: list[Use] = []  # the calls whose backward ran in this pass (sharing with recomputed calls)
        # A user-level pass (clipping.per_user.UserRows): norms, factors and materialised gradients are per user.
        self.users: UserRows | None = None
        # Weights tied between an embedding and linear maps (``tied.TiedUses``): their uses run as unshared ones,
        # the cross terms between them are added to the norms at the end. None: no such weight in this pass.
        self.tied = None
        # The pass's rank-one linear calls (``batched.RankOneLinearLayers``), done together at its end; None: none yet.
        self.rank_one_linear = None

    def note_batch(self, use: Use, batch_size: int) -> None:
        """Record the batch size of a layer the pass reached; ``ValueError`` if it differs from the first
        layer's (every layer of one pass must see the same examples, or the norms would mix them)."""
        if self.batch is None:
            self.batch = (use, batch_size)
        elif self.batch[1] != batch_size:
            first = self.batch[0]
            raise ValueError(
                f"ghost clipping: one backward pass reached {module_label(use.path, use.layer)} with {batch_size} "
                f"examples but {module_label(first.path, first.layer)} with {self.batch[1]}; every layer must see "
                f"the same batch"
            )

    def add_squared(self, param: nn.Parameter, squared: torch.Tensor) -> None:
        """Add ``squared`` (per-example squared norms ``(B,)``, unscaled) to ``param``'s, for uses of disjoint
        rows of it (a shared parameter's uses are materialised instead: cross terms)."""
        previous = self.squared_norms.get(param)
        self.squared_norms[param] = squared if previous is None else previous + squared

    def add_materialised(self, param: nn.Parameter, rows: Rows, grads: torch.Tensor) -> None:
        """Add per-example gradients ``grads`` of ``param``'s ``rows`` (None: all of it) to ``param``'s
        ``(B, *param.shape)`` total. Never written into ``grads`` (it may alias an autograd buffer): the total is
        ``grads`` itself for the first use, then a tensor this pass created, or the wrapper's buffer kept from an
        earlier pass (``buffers``), holding exactly what a fresh ``previous + grads`` would."""
        previous = self.materialised.get(param)
        if rows is None:
            # Never into `grads` or a sampler's result: it may alias an autograd buffer (a Linear's bias gradient
            # is G itself). Into a buffer of this wrapper's otherwise: the same sum, without the page faults of a
            # freshly allocated (B, *param.shape) tensor (~1 ms per 2 MiB on CPU).
            if previous is None:
                self.materialised[param] = grads
                return
            # What `previous + grads` would give: the same shape, dtype and (contiguous) layout, so that the norms
            # and sums read from it reduce in the same order.
            same_layout = (
                previous.shape == grads.shape
                and torch.result_type(previous, grads) == previous.dtype
                and previous.is_contiguous()
                and grads.is_contiguous()
            )
            if param in self.owned_materialised and same_layout:
                previous.add_(grads)
                return
            buffer = self.buffers.get(param)
            if (
                same_layout
                and buffer is not None
                and buffer.shape == previous.shape
                and buffer.dtype == previous.dtype
                and buffer.device == previous.device
            ):
                torch.add(previous, grads, out=buffer)
            else:
                buffer = previous + grads
                if same_layout and tensor_bytes(buffer) <= REUSED_BUFFER_BYTES:
                    self.buffers[param] = buffer
            self.materialised[param] = buffer
            self.owned_materialised.add(param)
            return
        if previous is None:
            previous = grads.new_zeros((grads.shape[0], *param.shape))
        elif param not in self.owned_materialised:
            previous = previous.clone()
        previous[:, rows] += grads
        self.materialised[param] = previous
        self.owned_materialised.add(param)


@dataclass(eq=False)
class GhostPasses:
    """The backward passes of fast clipping, between calls.

    ``pending``: the calls (``Use``) of live forwards whose backward has not reached them (weak: a forward
    whose graph is dropped drops them). ``current``: the pass in progress, from its first output gradient to
    its end-of-backward callback (None between passes; cleared by a forward after a pass that raised).
    ``padding_mask``: set by ``set_padding_mask`` for the next pass only. ``recomputed``: a reentrant
    checkpoint recomputed gated calls since the pass last looked for shared parameters (``_pass_for_backward``).
    ``buffers``: for each parameter shared by uses of the last pass, the tensor its per-example gradients were
    summed into (``BackwardPass.add_materialised``), reused by the next pass when its shape and dtype fit (each
    replaces an allocation of the same size: peak memory unchanged; kept up to ``REUSED_BUFFER_BYTES`` each,
    dropped when a pass starts in which the parameter is not shared). Nothing reads them after their pass, and
    ``drop_pass`` zeroes them when it ends (or is abandoned).
    """

    pending: weakref.WeakSet[Use] = field(default_factory=weakref.WeakSet)
    current: BackwardPass | None = None
    padding_mask: torch.Tensor | None = None
    recomputed: bool = False
    buffers: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)

    def unconsumed(self) -> list[Use]:
        """The pending calls whose backward has not run (``not use.consumed``), in the order ``list(pending)`` gives.

        Read twice per backward pass (its start and its end). ``WeakSet``'s own iteration runs a generator under an
        iteration guard (~10 us for three calls); here its set of weak references is copied in one C call, which
        runs no Python code (no weakref callback can change the set meanwhile), and each reference is called: the
        same members. Should the set change size anyway, the copy raises and the ``WeakSet``'s iteration is used."""
        try:
            refs = list(self.pending.data)
        except (AttributeError, RuntimeError):  # pragma: no cover (WeakSet internals moved, or a concurrent change)
            return [use for use in list(self.pending) if not use.consumed]
        return [use for use in map(_call, refs) if use is not None and not use.consumed]

    def drop_pass(self) -> None:
        """End the current pass (finished or abandoned) and zero the kept buffers: per-example gradients never
        outlive their pass, even in memory kept for the next one."""
        self.current = None
        if self.buffers:  # (no grad-mode context object per pass when nothing is kept: the usual case)
            with torch.no_grad():
                for buffer in self.buffers.values():
                    buffer.zero_()


# ``ref()`` for each weak reference; operator.call (Python 3.11+) runs it without a Python frame per reference.
_call = getattr(operator, "call", None) or (lambda ref: ref())


@dataclass(frozen=True, eq=False)
class ClipperLink:
    """Where the clipped sums go: set whole by ``GhostClippingModule.attach_clipper``.

    ``param_ids``: ``id`` of each of the clipper's parameters (a trained parameter outside it is refused).
    ``takes_ownership``: its ``accumulate_clipped_sums_`` may keep the sums without copying them.
    ``padding_mask_source``: called at the end of a pass for its padding mask, when the pass's batch carries
    none (``VirtualSteps`` redirects it to the micro-batch's slice).
    """

    clipper: object
    param_ids: frozenset[int]
    takes_ownership: bool
    padding_mask_source: Callable[[], torch.Tensor | None] | None = None
    #: The end of pass's group plans checked against this clipper (``BackwardPasses._group_plan``): they live and
    #: go with the link (a wrapper pickles without it), so no table outside the wrapper keeps its parameters alive.
    group_plans: dict = field(default_factory=dict, repr=False)


def check_sampler_result(kind: str, use: Use, result: dict, expected: Callable[[nn.Parameter, Rows], tuple]) -> None:
    """Check that a sampler returned, for every part of ``use``, a tensor of shape ``expected(param, rows)``;
    ``RuntimeError`` naming the layer otherwise (before anything is clipped)."""
    for param, rows in use.parts:
        value = result.get(param)
        if value is None:
            raise RuntimeError(
                f"{kind} sampler for {module_label(use.path, use.layer)} returned nothing for a "
                f"trainable parameter of shape {tuple(param.shape)}"
            )
        if value.shape != expected(param, rows):  # torch.Size compares as the tuple it is
            raise RuntimeError(
                f"{kind} sampler for {module_label(use.path, use.layer)} returned shape "
                f"{tuple(value.shape)} for a parameter of shape {tuple(param.shape)}; expected {expected(param, rows)}"
            )


def row_shape(param: nn.Parameter, rows: Rows) -> tuple:
    """The shape of ``param[rows]`` (``param``'s own shape for None)."""
    return tuple(param.shape) if rows is None else tuple(param[rows].shape)


def row_numel(param: nn.Parameter, rows: Rows) -> int:
    """The number of elements of ``param[rows]`` (of ``param`` for None)."""
    return param.numel() if rows is None else math.prod(row_shape(param, rows))


def zero_rows(value, keep: torch.Tensor):
    """``value`` with the rows of dropped examples set to 0 (floating tensors with a batch axis only)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0 and value.shape[0] == keep.shape[0]:
        mask = (keep if keep.device == value.device else keep.to(value.device)).view(-1, *([1] * (value.dim() - 1)))
        return torch.where(mask, value, 0.0)  # a Python 0: no zero tensor made (a kernel launch on a GPU)
    return value


def in_float32(function: Callable) -> Callable:
    """``function(activations, grads, *rest)`` with half-precision floating tensors promoted to float32.

    Under autocast (or for a model held in bf16/fp16) a layer's inputs and output gradient are half
    precision. A per-example norm computed in bf16 is off by up to 2^-8 relative, so an example's
    clipped contribution could exceed the clipping bound by that much; a clipped sum rounded to bf16
    moves by an ulp of the whole batch's sum. Promoting the operands (kept in half precision until
    this call, so memory does not grow) keeps norms and sums as exact as float32 makes them.
    """

    def promoted(activations, grads, *rest):
        # (Loops, not ``any`` over a generator: once per sampler call of every layer.)
        half = _is_half(grads)
        if not half:
            for value in activations:
                if _is_half(value):
                    half = True
                    break
        if half:
            activations = tuple(a.float() if _is_half(a) else a for a in activations)
            grads = grads.float() if _is_half(grads) else grads
        return function(activations, grads, *rest)

    return promoted


# Floating dtypes narrower than float32 (float16, bfloat16, the float8 kinds): one set lookup per operand,
# which is what ``in_float32`` runs for every sampler call of every layer.
_HALF_DTYPES = frozenset(
    dtype for dtype in vars(torch).values() if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize < 4
)


def _is_half(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in _HALF_DTYPES


def tensor_bytes(value) -> int:
    """Bytes of ``value``'s elements if it is a tensor, else 0."""
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0



def add_rows(sums: dict[nn.Parameter, torch.Tensor], param: nn.Parameter, rows: Rows, value: torch.Tensor) -> None:
    """Add ``value`` into ``sums[param]``: the whole of it (``rows`` None, out of place) or its ``rows``
    (in place, into a zero tensor of ``param``'s shape when ``param`` has no sum yet)."""
    if rows is None:
        previous = sums.get(param)
        sums[param] = value if previous is None else previous + value
        return
    total = sums.get(param)
    if total is None:
        total = value.new_zeros(param.shape)
        sums[param] = total
    total[rows] += value
