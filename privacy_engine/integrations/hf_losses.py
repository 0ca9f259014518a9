"""Per-example losses for Hugging Face models called with ``labels=`` through a private wrapper.

A Hugging Face model called as documented, ``model(input_ids, labels=labels).loss``, returns the mean over
every labelled token of the batch (or, given ``num_items_in_batch``, the sum divided by a batch-wide token
count). Each example's gradient then depends on the other examples' lengths: adding one long example rescales
every other example's contribution, and the per-example clipping bound no longer bounds its influence
(measured on GPT-2: 6.2 times the clipping bound). ``install_per_example_losses`` makes the loss the wrapper
sees per-example by construction:

- every ``transformers.PreTrainedModel`` inside the wrapped module gets, as its ``loss_function`` (the
  property transformers 5.x models call), a per-example version of its own loss function: example ``i``'s
  loss is what the original computes on a batch holding example ``i`` alone (``num_items_in_batch``
  ignored), then the mean (``loss_reduction="mean"``) or sum (``"sum"``) over the batch's examples. The token
  cross-entropy family (``ForCausalLMLoss``, ``ForMaskedLMLoss``, ``ForTokenClassification``) is computed
  vectorised (``privacy_engine.losses.per_example_token_cross_entropy``); any other loss function is called
  once per example on that example's rows.
- models that compute their loss inline (``CrossEntropyLoss()`` in T5, BART, BERT's masked-LM, token- and
  sequence-classification heads, ...) never call ``loss_function``. A forward hook on each
  ``PreTrainedModel`` notices that a loss was returned without it and recomputes it per example from the
  output's ``logits`` and the ``labels`` argument, with the one head formula that reproduces the model's own
  batch loss: token cross-entropy (labels aligned with the logits: masked LM, token classification,
  seq2seq decoders), token cross-entropy shifted by one (causal LM), cross-entropy of one label per example
  (sequence classification), mean squared error (regression) or binary cross-entropy (multi-label). If none
  or several formulas match, or the loss came from other label arguments (``start_positions``,
  ``next_sentence_label``, ...), it raises before anything is released.
- a model whose returned loss is not the per-example loss it computed (an auxiliary term added to it, such
  as a mixture-of-experts router loss computed over the whole batch) raises as well.

Only forwards through the wrapper are affected: the model called directly (evaluation through the
unwrapped model, ``generate``) keeps its own loss. ``remove()`` (called by ``to_standard_module()``) puts
every model's ``loss_function`` back and removes the hooks.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from privacy_engine.losses import per_example_token_cross_entropy

__all__ = ["PerExampleLosses", "install_per_example_losses", "per_example_loss_function"]

_MISSING = object()
_HOW_TO = (
    "Call the model without labels= and compute a per-example loss from its outputs, e.g. "
    "privacy_engine.losses.per_example_token_cross_entropy(outputs.logits, labels, shift=<causal LM>)."
)


def _loss_utils():
    from transformers.loss import loss_utils

    return loss_utils


def _reduce(per_example: torch.Tensor, reduction: str) -> torch.Tensor:
    return per_example.sum() if reduction == "sum" or per_example.numel() == 0 else per_example.mean()


def per_example_loss_function(original: Callable, reduction: str) -> Callable:
    """A loss function with ``original``'s signature whose result is per-example.

    Guarantee: the returned function gives ``reduce_i l_i`` (``reduce`` = mean or sum over examples) with
    ``l_i`` the value ``original`` computes on example ``i``'s rows alone, ``num_items_in_batch`` ignored; so
    ``l_i`` depends on example ``i`` only.

    ================================  ====================================================
    case                              behaviour
    ================================  ====================================================
    token cross-entropy family        vectorised (``per_example_token_cross_entropy``)
    (causal LM, masked LM, token      equal to the batch-of-one values; an example with no
    classification)                   labelled token gives 0 (batch of one: NaN)
    any other loss function           called once per example on its rows (tensors whose
                                      first dimension is the batch size), results stacked
    ``num_items_in_batch`` given      ignored (it is a batch-wide count)
    ``original`` returns a non-       ``TypeError`` naming the function
    scalar or a non-tensor
    ================================  ====================================================
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum'; got {reduction!r}")
    signature = inspect.signature(original)
    vectorised = _vectorised_form(original)

    def per_example_loss(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        if "num_items_in_batch" in bound.arguments:
            bound.arguments["num_items_in_batch"] = None  # a batch-wide count: never per-example
        extra = bound.arguments.get(_var_keyword_name(signature) or "", None)
        if isinstance(extra, dict):
            extra.pop("num_items_in_batch", None)
        if vectorised is not None:
            named = {key: value for key, value in bound.arguments.items() if value is not extra}
            return _reduce(vectorised({**named, **(extra if isinstance(extra, dict) else {})}), reduction)
        return _reduce(_one_example_at_a_time(original, bound), reduction)

    per_example_loss.__wrapped__ = original
    per_example_loss.__name__ = f"per_example_{getattr(original, '__name__', 'loss')}"
    return per_example_loss


def _var_keyword_name(signature: inspect.Signature) -> str | None:
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            return parameter.name
    return None


def _vectorised_form(original: Callable) -> Callable[[dict], torch.Tensor] | None:
    """The vectorised per-example version of a token cross-entropy loss of transformers, or None."""
    loss_utils = _loss_utils()

    # transformers' token losses upcast the logits with .float() (float64 included, down to float32): the
    # same cast here keeps each example's loss what the original computes on a batch of one.
    def causal(arguments: dict) -> torch.Tensor:
        ignore_index = arguments.get("ignore_index", -100)
        logits = arguments["logits"].float()
        shift_labels = arguments.get("shift_labels")
        if shift_labels is not None:  # already aligned with the logits
            return per_example_token_cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="none")
        return per_example_token_cross_entropy(
            logits, arguments["labels"], ignore_index=ignore_index, shift=True, reduction="none"
        )

    def aligned(arguments: dict) -> torch.Tensor:
        return per_example_token_cross_entropy(
            arguments["logits"].float(),
            arguments["labels"],
            ignore_index=arguments.get("ignore_index", -100),
            reduction="none",
        )

    forms = {
        getattr(loss_utils, "ForCausalLMLoss", None): causal,
        getattr(loss_utils, "ForMaskedLMLoss", None): aligned,
        getattr(loss_utils, "ForTokenClassification", None): aligned,
    }
    forms.pop(None, None)
    return forms.get(original)


def _one_example_at_a_time(original: Callable, bound: inspect.BoundArguments) -> torch.Tensor:
    name = getattr(original, "__name__", repr(original))
    args, kwargs = bound.args, bound.kwargs
    batch = _batch_size(kwargs.get("labels", None), [*args, *kwargs.values()], name)
    losses = []
    for index in range(batch):

        def rows(value, index=index):
            return value[index : index + 1] if _is_batched(value, batch) else value

        loss = original(*(rows(a) for a in args), **{key: rows(value) for key, value in kwargs.items()})
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"per-example losses: the loss function {name} returned {type(loss).__name__} "
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}, not one scalar; it cannot be made "
                f"per-example automatically. {_HOW_TO}"
            )
        losses.append(loss.reshape(()))
    if not losses:
        raise ValueError(f"per-example losses: the loss function {name} was called on an empty batch")
    return torch.stack(losses)


def _is_batched(value, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch


def _batch_size(labels, values: list, name: str) -> int:
    """The labels' batch size, else that of the first tensor argument with a batch dimension."""
    for value in (labels, *values):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ValueError(f"per-example losses: the loss function {name} got no batched tensor argument")


# ---------------------------------------------------------------------------------------------- inline losses
@dataclass(frozen=True, kw_only=True)
class _HeadFormula:
    """One way a head reduces its logits and labels: the batch loss an inline implementation computes,
    and the per-example terms that replace it."""

    name: str
    batch_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    per_example: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _token_mean(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> torch.Tensor:
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def _formulas(logits: torch.Tensor, labels: torch.Tensor) -> list[_HeadFormula]:
    """The head formulas that apply to these shapes and dtypes."""
    formulas = []
    if not labels.is_floating_point() and logits.dim() == labels.dim() + 1 and logits.shape[:-1] == labels.shape:
        if labels.dim() == 1:
            formulas.append(_HeadFormula(
                name="cross-entropy of one label per example",
                batch_loss=lambda x, y: F.cross_entropy(x, y, ignore_index=-100),
                per_example=lambda x, y: per_example_token_cross_entropy(x[:, None], y[:, None], reduction="none"),
            ))  # fmt: skip
        else:
            formulas.append(_HeadFormula(
                name="token cross-entropy (labels aligned with the logits)",
                batch_loss=lambda x, y: _token_mean(x, y, shift=False),
                per_example=lambda x, y: per_example_token_cross_entropy(x, y, reduction="none"),
            ))  # fmt: skip
            if labels.dim() == 2 and labels.shape[1] > 1:
                formulas.append(_HeadFormula(
                    name="token cross-entropy shifted by one (causal LM)",
                    batch_loss=lambda x, y: _token_mean(x, y, shift=True),
                    per_example=lambda x, y: per_example_token_cross_entropy(x, y, shift=True, reduction="none"),
                ))  # fmt: skip
    if labels.is_floating_point() and logits.numel() == labels.numel() and labels.numel() > 0:

        def rows(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.reshape(x.shape[0], -1), y.reshape(x.shape[0], -1).to(x.dtype)

        formulas.append(_HeadFormula(
            name="mean squared error (regression)",
            batch_loss=lambda x, y: F.mse_loss(*rows(x, y)),
            per_example=lambda x, y: F.mse_loss(*rows(x, y), reduction="none").mean(dim=1),
        ))  # fmt: skip
        formulas.append(_HeadFormula(
            name="binary cross-entropy (multi-label)",
            batch_loss=lambda x, y: F.binary_cross_entropy_with_logits(*rows(x, y)),
            per_example=lambda x, y: F.binary_cross_entropy_with_logits(*rows(x, y), reduction="none").mean(dim=1),
        ))  # fmt: skip
    return formulas


def _matches(candidate: torch.Tensor, reported: torch.Tensor, dtype: torch.dtype) -> bool:
    # The model's own loss and the candidate can differ by rounding only: HF upcasts some losses to float32,
    # inline losses stay in the logits' dtype.
    tolerance = max(1e-5, 16 * torch.finfo(dtype).eps if dtype.is_floating_point else 0.0)
    candidate, reported = candidate.detach().double(), reported.detach().double()
    return bool(torch.isfinite(candidate)) and bool(
        (candidate - reported).abs() <= tolerance * max(1.0, float(reported.abs()))
    )


def _recompute_inline_loss(model_label: str, logits, labels, reported: torch.Tensor, reduction: str) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError(
            f"per-example losses: {model_label} computed its loss inline (not through loss_function) and its "
            f"output has no logits tensor or its labels are not a tensor, so the loss cannot be recomputed per "
            f"example. {_HOW_TO}"
        )
    with torch.no_grad():
        matching = [
            f for f in _formulas(logits, labels) if _matches(f.batch_loss(logits, labels), reported, logits.dtype)
        ]
    if len(matching) != 1:
        found = (
            "no head formula" if not matching else "several head formulas (" + ", ".join(f.name for f in matching) + ")"
        )
        raise RuntimeError(
            f"per-example losses: {model_label} computed its loss inline (not through loss_function), and "
            f"{found} reproduce it from logits {tuple(logits.shape)} and labels {tuple(labels.shape)}: the loss "
            f"it returned may couple examples. {_HOW_TO}"
        )
    return _reduce(matching[0].per_example(logits, labels), reduction)


# ---------------------------------------------------------------------------------------------- installation
@dataclass
class PerExampleLosses:
    """What ``install_per_example_losses`` changed, to undo it with ``remove()``."""

    reduction: str
    is_active: Callable[[], bool]
    saved_loss_functions: dict[nn.Module, object] = field(default_factory=dict)
    handles: list = field(default_factory=list)
    calls: int = 0  # per-example loss functions evaluated through the wrapper so far
    last_loss: torch.Tensor | None = None
    starts: list[int] = field(default_factory=list)

    def remove(self) -> None:
        """Put every model's own ``loss_function`` back and remove the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for model, saved in self.saved_loss_functions.items():
            model.__dict__.pop("_loss_function", None)
            if saved is not _MISSING:
                model.__dict__["_loss_function"] = saved
        self.saved_loss_functions = {}

    # -------------------------------------------------------------- the installed pieces
    def _loss_function_for(self, model: nn.Module, saved) -> Callable:
        per_example = {}

        def loss_function(*args, **kwargs):
            original = saved if saved is not _MISSING else _own_loss_function(model)
            if not self.is_active():
                return original(*args, **kwargs)
            if original not in per_example:
                per_example[original] = per_example_loss_function(original, self.reduction)
            loss = per_example[original](*args, **kwargs)
            self.calls += 1
            self.last_loss = loss
            return loss

        return loss_function

    def _before_forward(self, module, args, kwargs) -> None:
        self.starts.append(self.calls)

    def _after_forward(self, path: str, module, args, kwargs, output):
        start = self.starts.pop() if self.starts else self.calls
        if not self.is_active():
            return None
        label = f"{type(module).__name__} (at {path or 'the wrapped module'})"
        if isinstance(output, (tuple, list)):
            if any(name in kwargs for name in _LABEL_ARGUMENTS):
                raise RuntimeError(
                    f"per-example losses: {label} returned a tuple (return_dict=False) for a call with labels; "
                    f"call it with return_dict=True so its loss can be checked to be per-example"
                )
            return None
        reported = getattr(output, "loss", None)
        if not isinstance(reported, torch.Tensor):
            return None
        if self.calls > start:
            last = self.last_loss
            if reported is last or (last is not None and reported.shape == last.shape and torch.equal(reported, last)):
                return None
            raise RuntimeError(
                f"per-example losses: {label} returned a loss other than the per-example loss it computed (an "
                f"auxiliary term, e.g. a router load-balancing loss over the whole batch, couples examples). "
                f"Turn the auxiliary loss off or {_HOW_TO[0].lower() + _HOW_TO[1:]}"
            )
        labels = kwargs.get("labels")
        if labels is None:
            given = [name for name in kwargs if name in _LABEL_ARGUMENTS] or ["label arguments"]
            raise RuntimeError(
                f"per-example losses: {label} computed a loss from {', '.join(given)} inline (not through "
                f"loss_function); it is not known to be per-example. {_HOW_TO}"
            )
        loss = _recompute_inline_loss(label, getattr(output, "logits", None), labels, reported, self.reduction)
        # Counted as a per-example loss: a model that hands this output on (an outer PreTrainedModel) passes.
        self.calls += 1
        self.last_loss = loss
        output.loss = loss
        return output


_LABEL_ARGUMENTS = (
    "labels", "start_positions", "end_positions", "next_sentence_label", "mc_labels", "sentence_order_label",
    "label", "label_ids",
)  # fmt: skip


def _own_loss_function(model: nn.Module) -> Callable:
    """The loss function the model would use without ours (its class's choice by ``loss_type``)."""
    ours = model.__dict__.pop("_loss_function")
    try:
        return model.loss_function
    finally:
        model.__dict__["_loss_function"] = ours


def install_per_example_losses(
    module: nn.Module, *, loss_reduction: str, is_active: Callable[[], bool]
) -> PerExampleLosses | None:
    """Make every Hugging Face model inside ``module`` return per-example losses while ``is_active()``.

    Guarantee: while ``is_active()`` is true (the wrapper's forward), a loss returned by any
    ``transformers.PreTrainedModel`` inside ``module`` is ``reduce_i l_i`` with ``l_i`` example ``i``'s loss
    on a batch of one (``reduce``: mean for ``loss_reduction="mean"``, sum for ``"sum"``), or the forward
    raises ``RuntimeError`` before the loss is handed back. See the module docstring for how.

    ========================================  ===========================================================
    case                                      behaviour
    ========================================  ===========================================================
    no transformers imported / no HF model    nothing installed, returns None
    model calls ``self.loss_function``        per-example version of that function (its own or the one
                                              set on the model before wrapping)
    inline loss, one head formula matches     recomputed per example from ``logits`` and ``labels``
    inline loss, no / several matches         ``RuntimeError`` (call without labels, use
                                              ``per_example_token_cross_entropy``)
    loss from ``start_positions`` etc.        per-example if through ``loss_function``; inline:
                                              ``RuntimeError``
    per-example loss plus an extra term       ``RuntimeError``
    ``return_dict=False`` with labels         ``RuntimeError`` (the loss cannot be found in a tuple)
    ``num_items_in_batch`` passed             ignored (batch-wide count)
    example with no labelled token            contributes 0 (token losses)
    called directly, not through wrapper      the model's own loss, unchanged
    ``loss_function`` set after wrapping      replaces ours (not per-example); set it before wrapping
    ========================================  ===========================================================
    """
    if "transformers" not in sys.modules:
        return None  # no Hugging Face model can be inside: the module's classes would have imported it
    from transformers import PreTrainedModel

    models = [(path, m) for path, m in module.named_modules() if isinstance(m, PreTrainedModel)]
    if not models:
        return None
    installed = PerExampleLosses(reduction=loss_reduction, is_active=is_active)
    for path, model in models:
        saved = model.__dict__.get("_loss_function", _MISSING)
        installed.saved_loss_functions[model] = saved
        model.__dict__["_loss_function"] = installed._loss_function_for(model, saved)
        installed.handles.append(model.register_forward_pre_hook(installed._before_forward, with_kwargs=True))
        installed.handles.append(model.register_forward_hook(
            lambda m, a, k, o, path=path: installed._after_forward(path, m, a, k, o), with_kwargs=True
        ))  # fmt: skip
    return installed
