"""Losses that couple the examples of a batch, seen while they are computed.

The engine never sees the user's loss (``loss = criterion(model(x), y); loss.backward()``). At the first
training step (and after the model's train/eval structure changes) the wrapper enters a
``LossCouplingMonitor`` (a ``TorchFunctionMode``) when its forward returns; the mode follows every tensor
computed from the model's outputs until ``backward`` (or ``torch.autograd.grad``) is called, and refuses:

- ``F.cross_entropy`` / ``F.nll_loss`` (and ``nn.CrossEntropyLoss`` / ``nn.NLLLoss``, which call them) with
  ``reduction="mean"`` and a class ``weight``: the mean divides by the batch's total weight
  ``sum_i w[y_i]``, which depends on every example;
- the same with targets hit by ``ignore_index`` unevenly across examples: the mean divides by the batch's
  count of kept targets (token cross-entropy over padded sequences);
- a loss divided by a quantity summed over the batch (``(loss * mask).sum() / mask.sum()``);
- a batch x batch tensor computed from the outputs (in-batch contrastive losses, InfoNCE
  ``a @ b.T``, ``torch.cdist(a, b)``, pairwise similarities by broadcasting).

The same cross-entropy rules run inside the independence check's forward (a model computing its loss in
its forward, e.g. with ``labels=``); see ``capture.independence``.

Only when the wrapper is bound to a private optimizer (something will be released). The mode stack:
the monitor is inserted at the bottom (above ``torch.device`` contexts), so a user's mode entered before
the forward and exited after it pops itself, not ours; it is taken off by identity (``remove_function_mode``)
at the optimizer's step, the wrapper's next forward or ``to_standard_module``. A mode cannot leave the
stack from inside its own handler (torch pushes it back when the handler returns), so after ``backward``
or a refusal it passes through until then; finished monitors of other wrappers are removed whenever a new
one is inserted.
"""

from __future__ import annotations

import inspect
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from privacy_engine.models.validation import InteractingExamplesError

__all__ = ["LossCouplingMonitor", "insert_function_mode", "remove_function_mode"]

_BACKWARD = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
_NORMALISING = {F.cross_entropy: inspect.signature(F.cross_entropy), F.nll_loss: inspect.signature(F.nll_loss)}
_DIVISIONS = (torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.true_divide)
_CONTRACTIONS = (
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm,
    torch.einsum, torch.cdist, torch.tensordot, torch.inner, torch.Tensor.inner, torch.outer, torch.Tensor.outer,
    F.linear, F.bilinear,
)
_REDUCTIONS = (torch.sum, torch.Tensor.sum, torch.count_nonzero, torch.Tensor.count_nonzero, torch.mean, torch.Tensor.mean)

PER_EXAMPLE_ADVICE = (
    "Compute one loss per example and reduce over examples with mean or sum (the wrapper's loss_reduction), "
    "e.g. F.cross_entropy(..., reduction='none') weighted per example then .mean(), or for token losses "
    "privacy_engine.losses.per_example_token_cross_entropy(logits, labels) (each example averaged over its own "
    "tokens)."
)


class LossCouplingMonitor(TorchFunctionMode):
    """Refuse, while a loss is computed, the operations that make one example's gradient depend on others.

    Guarantee: between entering and the first ``backward``/``autograd.grad``, any of the operations in the
    table whose result requires grad raises ``InteractingExamplesError`` (``strict=True``) before it
    returns, i.e. before any gradient exists; with ``strict=False`` it warns once and stays silent after.
    ``tracked=None`` (the forward's own loss): every tensor counts as the model's; otherwise only tensors
    computed from ``tracked`` (the wrapper's outputs) do.

    ====================================================  =========================================
    operation on the model's outputs (grad required)      result
    ====================================================  =========================================
    cross_entropy / nll_loss, mean, weight not constant   refused (divides by the batch's weight)
    same, ignore_index hit by uneven counts per example   refused (divides by the batch's count)
    same, targets of one example only (numel not k x B)   accepted (that example's own mean)
    same, mean, no weight, equal counts per example       accepted (denominator B x count)
    reduction 'sum' / 'none'                              accepted
    x / s, s a sum over the batch dim of a batch tensor   refused (normalised by the batch)
    result with two dims of size B from inputs with one   refused (examples compared in-batch)
    B = 1                                                 batch x batch rule off
    under no_grad / detached (metrics)                    accepted (no gradient)
    after backward / autograd.grad                        inactive (passes through)
    ====================================================  =========================================
    """

    def __init__(self, *, batch_size: int | None, batch_dim: int, strict: bool, tracked=None, owner=None) -> None:
        super().__init__()
        self.owner = None if owner is None else weakref.ref(owner)  # the wrapper's guard, which removes it
        self.batch_size = batch_size
        self.batch_dim = batch_dim
        self.strict = strict
        self.active = True
        self._all = tracked is None
        self._derived: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._aggregates: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for leaf in tree_leaves(tracked) if tracked is not None else ():
            if isinstance(leaf, torch.Tensor):
                self._derived[leaf] = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        if func in _BACKWARD:
            self.finish()  # the loss is complete: what follows is not the loss any more
            return func(*args, **kwargs)
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        derived = [t for t in tensors if self._all or t in self._derived]
        if func in _NORMALISING and derived and (self._all or torch.is_grad_enabled()):  # (the check's forward: no_grad)
            self._refuse(_normalising_problem(func, args, kwargs, self.batch_size, self.batch_dim))
        result = func(*args, **kwargs)
        if not derived:
            if func in _REDUCTIONS:
                self._note_aggregate(tensors, args, kwargs, result)
            return result
        if self._all:
            return result  # inside a forward: only the cross-entropy rules (the rest is the row check's)
        outputs = [leaf for leaf in tree_leaves(result) if isinstance(leaf, torch.Tensor)]
        for leaf in outputs:
            self._derived[leaf] = True
        self._refuse(self._pairwise_problem(func, derived, outputs))
        if func in _DIVISIONS and len(args) >= 2:
            self._refuse(self._division_problem(args[0], args[1], outputs))
        if func in _REDUCTIONS:
            self._note_aggregate(tensors, args, kwargs, result)
        return result

    def finish(self) -> None:
        """Stop checking. The mode cannot leave the stack from inside its own handler (torch puts it back when
        the handler returns): its owner takes it off at the next optimizer step, forward or unwrapping."""
        self.active = False

    def _refuse(self, problem: str | None) -> None:
        if problem is None:
            return
        self.finish()
        if self.strict:
            raise InteractingExamplesError(problem)
        warnings.warn(f"strict=False: {problem}", stacklevel=3)

    def _pairwise_problem(self, func, derived: list[torch.Tensor], outputs: list[torch.Tensor]) -> str | None:
        size = self.batch_size
        if size is None or size < 2 or not any(out.requires_grad for out in outputs):
            return None
        if any(_count(t.shape, size) >= 2 for t in derived):
            return None  # the inputs were batch x batch already (or B equals a feature size)
        if func in _CONTRACTIONS:
            pairs = any(_count(out.shape, size) >= 2 for out in outputs)
        else:
            pairs = _broadcasts_pairs(derived, size)
        if not pairs:
            return None
        name = getattr(func, "__name__", str(func))
        return (
            f"the loss compares the examples of the batch with each other: {name} paired the {size} examples of the "
            f"model's outputs into a batch x batch tensor, as an in-batch contrastive loss (InfoNCE logits "
            f"a @ b.T, CLIP's loss, cdist, pairwise similarities) does. Each example's gradient then depends on "
            f"the other examples, and per-example clipping no longer bounds one example's influence. Use a loss "
            f"computed from each example alone (e.g. negatives drawn from public data, or pairs stored inside one "
            f"example)."
        )

    def _note_aggregate(self, tensors: list[torch.Tensor], args, kwargs, result) -> None:
        """Remember a reduction over the batch dim of a batch tensor (a count or total of the batch)."""
        size = self.batch_size
        if size is None or not isinstance(result, torch.Tensor) or not tensors:
            return
        source = tensors[0]
        if source.dim() <= self.batch_dim or source.shape[self.batch_dim] != size or size < 2:
            return
        dims = kwargs.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], torch.dtype) else None)
        if dims is None or dims == () or dims == []:
            self._aggregates[result] = True
            return
        dims = [dims] if isinstance(dims, int) else list(dims)
        if any(d % source.dim() == self.batch_dim for d in dims):
            self._aggregates[result] = True

    def _division_problem(self, numerator, denominator, outputs) -> str | None:
        if not isinstance(denominator, torch.Tensor) or denominator not in self._aggregates:
            return None
        if not any(out.requires_grad for out in outputs):
            return None
        return (
            f"the loss is divided by a quantity summed over the batch (a tensor of shape "
            f"{tuple(denominator.shape)} reduced over the batch dim, e.g. mask.sum() of the batch's tokens): "
            f"each example's weight then depends on the other examples. " + PER_EXAMPLE_ADVICE
        )


def _count(shape, size: int) -> int:
    return sum(d == size for d in shape)


def _broadcasts_pairs(tensors: list[torch.Tensor], size: int) -> bool:
    """Whether broadcasting pairs examples: one input has the batch at dim i and 1 at dim j, another the
    batch at j and 1 at i (``a[:, None] - b[None]``, ``cosine_similarity(a[:, None], b[None], dim=-1)``)."""
    if len(tensors) < 2:
        return False
    rank = max(t.dim() for t in tensors)
    shapes = [(1,) * (rank - t.dim()) + tuple(t.shape) for t in tensors]
    for i in range(rank):
        for j in range(rank):
            if i != j and any(s[i] == size and s[j] == 1 for s in shapes) and any(s[j] == size and s[i] == 1 for s in shapes):
                return True
    return False


def _normalising_problem(func, args, kwargs, batch_size: int | None, batch_dim: int) -> str | None:
    """Why this cross_entropy/nll_loss call's mean couples examples, or None."""
    try:
        bound = _NORMALISING[func].bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    arguments = bound.arguments
    if arguments.get("reduction") != "mean" or arguments.get("size_average") is False or arguments.get("reduce") is False:
        return None
    name = f"F.{func.__name__}"
    weight = arguments.get("weight")
    target = arguments.get("target")
    if isinstance(weight, torch.Tensor) and weight.numel() > 1 and not bool((weight == weight.flatten()[0]).all()):
        return (
            f"{name}(weight=..., reduction='mean') (nn.{'CrossEntropyLoss' if func is F.cross_entropy else 'NLLLoss'}"
            f"(weight=...)) divides by the batch's total weight sum_i weight[y_i], so each example's gradient "
            f"depends on the other examples' labels. Use reduction='none', multiply each example's loss by "
            f"weight[y_i] and take .mean() (the per-example weighting, divided by the batch size). "
            + PER_EXAMPLE_ADVICE
        )
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        return None  # class probabilities: no ignore_index
    kept = target != arguments.get("ignore_index", -100)
    if bool(kept.all()):
        return None
    per_example = _per_example_counts(kept, batch_size, batch_dim)
    if per_example is None:
        return None  # the targets do not span the batch (one example's own tokens, averaged over themselves)
    if bool((per_example == per_example[0]).all()):
        return None  # every example keeps as many targets: the denominator is B x that count
    return (
        f"{name}(ignore_index={arguments.get('ignore_index', -100)}, reduction='mean') divides by the number of "
        f"targets kept in the whole batch, and the examples keep different numbers: each example's weight "
        f"depends on the others' lengths (token cross-entropy over padded sequences). " + PER_EXAMPLE_ADVICE
    )


def _per_example_counts(kept: torch.Tensor, batch_size: int | None, batch_dim: int) -> torch.Tensor | None:
    """Kept targets per example, or None when the target's layout does not show the examples."""
    if batch_size is None or batch_size < 2 or kept.numel() % batch_size:
        return None
    if kept.dim() > batch_dim and kept.shape[batch_dim] == batch_size:
        return kept.movedim(batch_dim, 0).reshape(batch_size, -1).sum(1)
    if kept.dim() == 1:  # flattened (B * T,) in the model's layout
        rows = kept.reshape(batch_size, -1) if batch_dim == 0 else kept.reshape(-1, batch_size).T
        return rows.sum(1)
    return None


_INSERTED: weakref.WeakSet = weakref.WeakSet()  # monitors put on the stack, until their owner takes them off


def insert_function_mode(mode: TorchFunctionMode) -> None:
    """Put ``mode`` at the bottom of the torch-function mode stack (above any ``torch.device`` context, which
    must stay at the bottom): a user's mode entered before and exited after it then pops itself, not ours."""
    # Left by a wrapper not called again since (finished), or by one that no longer exists.
    for finished in [m for m in _INSERTED if not m.active or (m.owner is not None and m.owner() is None)]:
        remove_function_mode(finished)
        _INSERTED.discard(finished)
    _INSERTED.add(mode)
    above = []
    while torch._C._len_torch_function_stack() and not isinstance(torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1), DeviceContext):
        above.append(torch._C._pop_torch_function_stack())
    # (only modes above the device contexts were popped; the device contexts stay below)
    torch._C._push_on_torch_function_stack(mode)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


def remove_function_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off the torch-function mode stack wherever it is, leaving every other mode in order."""
    depth = torch._C._len_torch_function_stack()
    if not any(torch._C._get_function_stack_at(i) is mode for i in range(depth)):
        return
    above = []
    while True:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)
