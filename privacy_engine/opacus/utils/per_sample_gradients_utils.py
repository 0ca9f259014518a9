"""``opacus.utils.per_sample_gradients_utils``: the engine's per-sample gradients of a module checked
against a per-example loop (``check_per_sample_gradients_are_correct``), and the pieces Opacus's own
tests use to compare the two (``compute_microbatch_grad_sample``, the loop; ``compute_opacus_grad_sample``,
the wrapper of a ``grad_sample_mode``; ``compute_grad_samples_microbatch_and_opacus``, both)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from privacy_engine.capture import GradSampleModule, ParameterUsageError
from privacy_engine.opacus.grad_sample.utils import wrap_model
from privacy_engine.opacus.utils.module_utils import clone_module, trainable_parameters
from privacy_engine.opacus.utils.packed_sequences import compute_seq_lengths

__all__ = [
    "ModelWithLoss",
    "check_per_sample_gradients_are_correct",
    "clone_module",
    "compute_grad_samples_microbatch_and_opacus",
    "compute_microbatch_grad_sample",
    "compute_opacus_grad_sample",
    "get_grad_sample_modes",
    "is_batch_empty",
    "unpack_packedsequences",
]

_REDUCTIONS = ("mean", "sum")


def is_batch_empty(batch: torch.Tensor | Sequence[torch.Tensor]) -> bool:
    """Whether a batch (a tensor, or a sequence whose first item is one) has no element."""
    first = batch if isinstance(batch, torch.Tensor) else batch[0]
    return first.numel() == 0


def get_grad_sample_modes(use_ew: bool = False) -> list[str]:
    """The ``grad_sample_mode`` values that compute per-sample gradients: ``"hooks"``, ``"functorch"``
    (and ``"ew"``, the same exact gradients here, with ``use_ew``)."""
    return ["hooks", "functorch", "ew"] if use_ew else ["hooks", "functorch"]


def unpack_packedsequences(packed: PackedSequence) -> list[torch.Tensor]:
    """The sequences of ``packed``, each ``(length, features)``, in the order they were packed in."""
    padded = pad_packed_sequence(packed, batch_first=True)[0]  # (batch, time, features), sorted order undone
    lengths = compute_seq_lengths(packed.batch_sizes)  # longest first, i.e. in sorted order
    if packed.unsorted_indices is not None:
        lengths = [lengths[int(position)] for position in packed.unsorted_indices]
    return [padded[index, :length] for index, length in enumerate(lengths)]


class ModelWithLoss(nn.Module):
    """``module`` followed by an L1 loss against zeros (``reduction`` ``"mean"`` or ``"sum"``), so any
    module gives a scalar loss. A ``PackedSequence`` output with ``"mean"`` is averaged per sequence,
    then over the sequences (each example weighs the same whatever its length)."""

    supported_reductions = _REDUCTIONS

    def __init__(self, module: nn.Module, loss_reduction: str = "mean") -> None:
        super().__init__()
        if loss_reduction not in _REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {list(_REDUCTIONS)}; got {loss_reduction!r}")
        self.wrapped_module = module
        self.criterion = nn.L1Loss(reduction=loss_reduction)

    def forward(self, x: object) -> torch.Tensor:
        """The loss of ``module(x)`` (``module(*x)`` when ``x`` is exactly a tuple)."""
        # exactly a tuple: a PackedSequence is a tuple subclass and is one argument
        output = self.wrapped_module(*x) if type(x) is tuple else self.wrapped_module(x)
        if isinstance(output, PackedSequence):
            if self.criterion.reduction == "sum":
                return self.criterion(output.data, torch.zeros_like(output.data))
            sequences = unpack_packedsequences(output)
            return sum(self.criterion(seq, torch.zeros_like(seq)) for seq in sequences) / len(sequences)
        return self.criterion(output, torch.zeros_like(output))


def _deterministic(function: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    # The same seed for the loop and the wrapper: a module with dropout draws the same masks in both.
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        return function()
    finally:
        torch.use_deterministic_algorithms(previous)


def compute_microbatch_grad_sample(
    x: torch.Tensor | list[torch.Tensor],
    module: nn.Module,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    chunk_method: Callable = iter,
) -> dict[str, torch.Tensor]:
    """Per-sample gradients by the definition: each example of ``x`` (as split by ``chunk_method``)
    run alone through a copy of ``module`` followed by ``ModelWithLoss``'s loss; returns
    ``{parameter name: (batch, *shape)}`` (always batch first). ``module`` is not changed."""

    def loop() -> dict[str, torch.Tensor]:
        model = ModelWithLoss(clone_module(module), loss_reduction)
        examples = x if isinstance(x, list) or batch_first else x.transpose(0, 1)
        rows: dict[str, list[torch.Tensor]] = {name: [] for name, _ in trainable_parameters(model.wrapped_module)}
        for example in chunk_method(examples):
            model.zero_grad(set_to_none=True)
            if type(example) is not tuple:  # a tuple is one example's several arguments (EmbeddingBag)
                example = example.unsqueeze(0 if batch_first else 1)
            model(example).backward()
            for name, param in trainable_parameters(model.wrapped_module):
                rows[name].append(torch.zeros_like(param) if param.grad is None else param.grad.detach().clone())
        return {name: torch.stack(grads) for name, grads in rows.items()}

    return _deterministic(loop)


def compute_opacus_grad_sample(
    x: torch.Tensor | PackedSequence,
    module: nn.Module,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    grad_sample_mode: str = "hooks",
) -> dict[str, torch.Tensor]:
    """Per-sample gradients of a copy of ``module`` wrapped for ``grad_sample_mode`` (``wrap_model``),
    after one backward of ``ModelWithLoss``'s loss on the whole batch ``x``: ``{parameter name:
    p.grad_sample}``. ``module`` is not changed."""

    def wrapped() -> dict[str, torch.Tensor]:
        wrapper = wrap_model(clone_module(module), grad_sample_mode, batch_first=batch_first,
                             loss_reduction=loss_reduction)  # fmt: skip
        model = ModelWithLoss(wrapper, loss_reduction)
        model.zero_grad()
        model(x).backward()
        return {name: param.grad_sample for name, param in trainable_parameters(wrapper._module)}

    return _deterministic(wrapped)


def compute_grad_samples_microbatch_and_opacus(
    x: torch.Tensor | PackedSequence,
    module: nn.Module,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    grad_sample_mode: str = "hooks",
    chunk_method: Callable = iter,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(compute_microbatch_grad_sample(...), compute_opacus_grad_sample(...))`` for the same batch:
    the definition and the engine side by side. An empty batch raises ``RuntimeError``; parameter
    names that differ between the two raise ``ValueError``."""
    if isinstance(x, PackedSequence):
        examples: torch.Tensor | list[torch.Tensor] = unpack_packedsequences(x)
    elif is_batch_empty(x):
        raise RuntimeError("x is empty: per-sample gradients of an empty batch cannot be compared")
    else:
        examples = x
    reference = compute_microbatch_grad_sample(examples, module, batch_first=batch_first,
                                               loss_reduction=loss_reduction, chunk_method=chunk_method)  # fmt: skip
    engine = compute_opacus_grad_sample(x, module, batch_first=batch_first, loss_reduction=loss_reduction,
                                        grad_sample_mode=grad_sample_mode)  # fmt: skip
    if reference.keys() != engine.keys():
        raise ValueError(f"parameter names differ: only in the loop {sorted(reference.keys() - engine.keys())}, "
                         f"only in the wrapper {sorted(engine.keys() - reference.keys())}")  # fmt: skip
    return reference, engine


def _per_example_gradients(module: nn.Module, x: torch.Tensor, batch_dim: int) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(module)
    trainable = [(name, p) for name, p in reference.named_parameters() if p.requires_grad]
    rows: dict[str, list[torch.Tensor]] = {name: [] for name, _ in trainable}
    for index in range(x.shape[batch_dim]):
        reference.zero_grad(set_to_none=True)
        reference(x.narrow(batch_dim, index, 1)).sum().backward()
        for name, param in trainable:
            rows[name].append(torch.zeros_like(param) if param.grad is None else param.grad.detach().clone())
    return {name: torch.stack(grads) for name, grads in rows.items()}


def check_per_sample_gradients_are_correct(
    x: torch.Tensor,
    module: nn.Module,
    *,
    batch_first: bool = True,
    atol: float = 10e-6,
    rtol: float = 10e-5,
    grad_sample_mode: str = "hooks",
) -> bool:
    """Whether ``GradSampleModule`` gives, for every example of ``x`` and every trainable parameter of
    ``module``, the gradient of that example's own loss (the sum of its outputs), computed by running
    each example alone through a copy of ``module``; for ``loss_reduction`` ``"sum"`` and ``"mean"``
    (``torch.allclose`` with ``atol``, ``rtol``). ``module`` itself is not changed (copies are used).
    Per-sample gradients that do not even sum to the gradient (the wrapper's first-backward check
    raises ``ParameterUsageError``) also give False.

    ``grad_sample_mode``: ``"hooks"``, ``"functorch"`` or ``"ew"`` (the same exact gradients here);
    anything else raises ``ValueError``. ``x`` must be a tensor (batch on dim 0, or dim 1 if not
    ``batch_first``).
    """
    if grad_sample_mode not in ("hooks", "functorch", "ew"):
        raise ValueError(f"grad_sample_mode must be 'hooks', 'functorch' or 'ew'; got {grad_sample_mode!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor (the input batch); got {type(x).__name__}")
    batch_dim = 0 if batch_first else 1
    expected = _per_example_gradients(module, x, batch_dim)
    for reduction in ("sum", "mean"):
        model = copy.deepcopy(module)
        wrapped = GradSampleModule(model, batch_first=batch_first, loss_reduction=reduction)
        output = wrapped(x)
        loss = output.sum() if reduction == "sum" else output.sum() / x.shape[batch_dim]
        try:
            loss.backward()
        except ParameterUsageError:
            return False  # the engine's own check found per-sample gradients that do not sum to the gradient
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            grad_sample = getattr(param, "grad_sample", None)
            if grad_sample is None or not torch.allclose(grad_sample, expected[name], atol=atol, rtol=rtol):
                return False
        wrapped.to_standard_module()
    return True
