"""Per-sample gradients for any module through ``torch.func``: the module's forward runs under
``vmap`` with one copy of its parameters per example.

Why a forward, not a backward re-computation: re-running the layer per example after the fact
cannot reproduce random operations inside it (the dropout of ``nn.MultiheadAttention``), so the
per-example gradients would not sum to the real gradient. Running the *real* forward through
``vmap(functional_call)`` with the parameters expanded along a new batch dimension makes autograd
deliver the gradient of that expanded view, which is exactly the stack of per-example gradients,
whatever the module does (dropout, parameters used twice, children called or not).

The expansion is a view (no copy of the weights); the batched matmuls it creates cost about what the
ordinary forward costs, provided every operation has a ``vmap`` batching rule. Two things keep it so:

- ``nn.MultiheadAttention`` (anywhere in the subtree) is called with ``need_weights=True`` while
  under ``vmap``: its ``need_weights=False`` path calls a fused attention kernel that has no batching
  rule, so ``vmap`` would fall back to calling it once per example (with a warning). The
  ``need_weights=True`` path computes the same function (bmm, softmax, dropout on the attention
  weights, bmm) in batched operations; the weights the caller did not ask for are dropped. Its dropout is still drawn in this,
  the real, forward. (One difference: an ``is_causal=True`` hint is then not used and the
  ``attn_mask`` it describes is applied instead, which is what the hint promises to be equivalent to.)
- arguments that are the same tensor stay the same tensor for each example, so identity checks in
  a forward (``query is key`` selects one fused input projection in attention) still hold.

Where the batch sits in each argument and output is read from the module when the claimed module is
an ``nn.MultiheadAttention`` (its own ``batch_first``; ``key_padding_mask`` and the returned weights are
batch-first; a 3-D ``attn_mask`` is ``(batch * heads, queries, keys)``); for any other module every
tensor argument whose ``batch_dim`` has the batch size is split and every output is stacked at
``batch_dim``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten, tree_unflatten

PerSampleGradCallback = Callable[[nn.Parameter, torch.Tensor], None]
_TENSOR = object()  # marks where a tensor output sits in the flattened output structure


# ---------------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class _ArgumentLayout:
    """The call's arguments as flat leaves, and for each leaf how it is split over the examples."""

    leaves: list[object]
    spec: object  # pytree spec of (args, kwargs)
    split_dims: list[int | None]  # dim vmap splits (None: shared by every example)
    keep_dims: list[int | None]  # dim where each example gets back a batch dim of size 1 (None: none)
    batch_size: int


def _unchanged(output):
    return output


@dataclass(frozen=True)
class _CallPlan:
    arguments: _ArgumentLayout
    output_dims: Callable[[int], int]  # output tensor leaf index -> its batch dim
    finish: Callable = _unchanged  # applied to each example's output before it is stacked


def _batch_size(args: tuple, kwargs: dict, batch_dim: int, module_path: str) -> int:
    leaves, _ = tree_flatten((args, kwargs))
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim:
            return leaf.shape[batch_dim]
    raise ValueError(
        f"module {module_path!r}: the torch.func fallback needs a tensor input with a batch dimension "
        f"(dim {batch_dim}); got no such tensor among its arguments"
    )


def _generic_plan(args: tuple, kwargs: dict, batch_dim: int, module_path: str) -> _CallPlan:
    """Tensors whose ``batch_dim`` has the batch size are split per example; others are shared."""
    batch_size = _batch_size(args, kwargs, batch_dim, module_path)
    leaves, spec = tree_flatten((args, kwargs))
    dims = [
        batch_dim
        if isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim and leaf.shape[batch_dim] == batch_size
        else None
        for leaf in leaves
    ]
    return _CallPlan(_ArgumentLayout(leaves, spec, dims, list(dims), batch_size), lambda index: batch_dim)


_ATTENTION_PARAMETERS = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)


def _attention_plan(module: nn.MultiheadAttention, args: tuple, kwargs: dict, module_path: str) -> _CallPlan:
    """Batch positions of ``nn.MultiheadAttention.forward``'s arguments and outputs."""
    if len(args) > len(_ATTENTION_PARAMETERS):
        raise TypeError(f"module {module_path!r}: MultiheadAttention.forward got {len(args)} positional arguments")
    named = dict(zip(_ATTENTION_PARAMETERS, args))
    for name, value in kwargs.items():
        if name in named or name not in _ATTENTION_PARAMETERS:
            raise TypeError(f"module {module_path!r}: unexpected or repeated MultiheadAttention argument {name!r}")
        named[name] = value
    query = named.get("query")
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(
            f"module {module_path!r} (MultiheadAttention): per-sample gradients need a batched query "
            f"(3 dims); got {shape}. Add the batch dimension."
        )
    sequence_dim = 0 if module.batch_first else 1
    batch_size = query.shape[sequence_dim]
    split: dict[str, int | None] = {"query": sequence_dim, "key": sequence_dim, "value": sequence_dim}
    keep: dict[str, int | None] = dict(split)
    mask = named.get("key_padding_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # (batch, keys) whatever batch_first says
        split["key_padding_mask"] = keep["key_padding_mask"] = 0
    mask = named.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 3:
        # (batch * heads, queries, keys): each example gets its (heads, queries, keys) block, which is
        # what the module expects for a batch of one.
        if mask.shape[0] != batch_size * module.num_heads:
            raise ValueError(
                f"module {module_path!r}: a 3-D attn_mask must have batch * num_heads = "
                f"{batch_size * module.num_heads} rows; got {mask.shape[0]}"
            )
        named["attn_mask"] = mask.reshape(batch_size, module.num_heads, *mask.shape[1:])
        split["attn_mask"], keep["attn_mask"] = 0, None
    # The batched path (see the module docstring); weights nobody asked for are dropped again.
    weights_asked = bool(named.get("need_weights", True))
    named["need_weights"] = True
    if not weights_asked:
        named["average_attn_weights"] = True  # the smallest weights to compute and drop
    names = list(named)
    leaves = [named[name] for name in names]
    _, spec = tree_flatten(((), {name: 0 for name in names}))
    split_dims = [split.get(name) if isinstance(named[name], torch.Tensor) else None for name in names]
    keep_dims = [keep.get(name) if isinstance(named[name], torch.Tensor) else None for name in names]
    # Output 0 (attention output) is laid out like the query; output 1 (weights) is batch-first.
    return _CallPlan(
        _ArgumentLayout(leaves, spec, split_dims, keep_dims, batch_size),
        lambda index: sequence_dim if index == 0 else 0,
        _unchanged if weights_asked else _drop_attention_weights,
    )


def _drop_attention_weights(output):
    return output[0], None


def _call_plan(module: nn.Module, args: tuple, kwargs: dict, batch_dim: int, module_path: str) -> _CallPlan:
    if type(module) is nn.MultiheadAttention:
        return _attention_plan(module, args, kwargs, module_path)
    return _generic_plan(args, kwargs, batch_dim, module_path)


# ---------------------------------------------------------------------------------- attention
def _attention_argument(args: tuple, kwargs: dict, name: str, default):
    position = _ATTENTION_PARAMETERS.index(name)
    return args[position] if len(args) > position else kwargs.get(name, default)


def _with_attention_argument(args: tuple, kwargs: dict, name: str, value) -> tuple[tuple, dict]:
    position = _ATTENTION_PARAMETERS.index(name)
    if len(args) > position:
        return args[:position] + (value,) + args[position + 1 :], kwargs
    return args, {**kwargs, name: value}


@contextlib.contextmanager
def _attention_through_batched_ops(module: nn.Module) -> Iterator[None]:
    """While active, every ``nn.MultiheadAttention`` strictly inside ``module``'s subtree computes its
    weights explicitly (``need_weights=True``) and drops them again if the caller did not ask for
    them. (``module`` itself is not called through its hooks: ``_attention_plan`` handles it.)"""
    attentions = [m for m in module.modules() if type(m) is nn.MultiheadAttention and m is not module]
    if not attentions:
        yield
        return
    asked: list[bool] = []  # a stack: attention modules may be called inside one another

    def force_weights(layer, args, kwargs):
        asked.append(bool(_attention_argument(args, kwargs, "need_weights", True)))
        args, kwargs = _with_attention_argument(args, kwargs, "need_weights", True)
        if not asked[-1]:  # head-averaged weights: the smallest to compute and drop
            args, kwargs = _with_attention_argument(args, kwargs, "average_attn_weights", True)
        return args, kwargs

    def drop_weights(layer, args, kwargs, output):
        return output if asked.pop() else _drop_attention_weights(output)

    handles = []
    try:
        for attention in attentions:
            # Ours run last before forward and first after it: the user's hooks see the call and
            # the result as the caller made and expects them.
            handles.append(attention.register_forward_pre_hook(force_weights, with_kwargs=True))
            handles.append(attention.register_forward_hook(drop_weights, with_kwargs=True, prepend=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _math_attention_on_cpu(params) -> contextlib.AbstractContextManager:
    """``F.scaled_dot_product_attention`` on its math kernel when the parameters are on the CPU: the CPU's
    fused kernel has no ``vmap`` batching rule (vmap would call it once per example) and no gradient for a
    mask that needs one (Swin adds its learned relative position bias through the mask). The math kernel
    computes the same function in batched operations. On other devices the fused kernels have batching rules
    and are left to torch's choice."""
    if any(p.device.type != "cpu" for p in params):
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)


# ---------------------------------------------------------------------------------- own forwards
@dataclass(frozen=True)
class PerSampleForward:
    """A layer type's own replacement for the ``vmap`` path (recurrent layers: their fused kernels have
    no batching rule). ``forward`` has ``per_sample_forward``'s signature and contract;
    ``output_batch_size(module, output)`` is the number of examples in the layer's output (None: unknown)."""

    forward: Callable
    output_batch_size: Callable[[nn.Module, object], int | None]
    # ``(module, *args, **kwargs) -> output``: the layer's forward in operations that have batching rules,
    # run instead of its forward when the layer sits inside another module's ``vmap`` (None: not needed).
    vmap_forward: Callable | None = None


_PER_SAMPLE_FORWARDS: dict[type[nn.Module], PerSampleForward] = {}


def register_per_sample_forward(
    *layer_types: type[nn.Module],
    output_batch_size: Callable[[nn.Module, object], int | None],
    vmap_forward: Callable | None = None,
) -> Callable[[Callable], Callable]:
    """Route the fallback of layers of these types (and of their subclasses that keep the class's
    ``forward``) through ``function`` instead of ``vmap``.

    Used only while the layer runs its class's own ``forward`` (an instance or subclass whose ``forward``
    was replaced goes through ``vmap``)."""

    def decorate(function: Callable) -> Callable:
        for layer_type in layer_types:
            _PER_SAMPLE_FORWARDS[layer_type] = PerSampleForward(function, output_batch_size, vmap_forward)
        return function

    return decorate


def per_sample_forward_for(module: nn.Module) -> PerSampleForward | None:
    """The registered replacement of the ``vmap`` path for ``module``'s type (or the registered class it
    derives from without changing ``forward``), or None."""
    for layer_type in type(module).__mro__:
        own = _PER_SAMPLE_FORWARDS.get(layer_type)
        if own is not None:
            return own if type(module).forward is layer_type.forward else None
    return None


@contextlib.contextmanager
def _own_forwards_under_vmap(module: nn.Module, module_path: str) -> Iterator[None]:
    """While active, every layer strictly inside ``module``'s subtree that registered a ``vmap_forward``
    (and whose forward is its class's) runs that instead of its forward (fused kernels without batching
    rules: recurrent layers). An error raised meanwhile gets a note saying why such layers ran under
    ``vmap`` and how to avoid it."""
    replaced, custom = [], []
    try:
        for inner in module.modules():
            if not any(base in _PER_SAMPLE_FORWARDS for base in type(inner).__mro__):
                continue
            own = per_sample_forward_for(inner)
            if inner is module:  # its forward is the one being run (``module.forward`` is the wrapper's patch)
                if own is None:
                    custom.append(inner)
            elif own is None or "forward" in inner.__dict__:
                custom.append(inner)  # a subclass or instance with its own forward: nothing to swap in
            elif own.vmap_forward is not None:
                inner.forward = partial(own.vmap_forward, inner)
                replaced.append(inner)
        yield
    except Exception as error:
        if (replaced or custom) and hasattr(error, "add_note"):
            label = f"module {module_path!r}" if module_path else "the top-level module"
            if custom:
                kinds = sorted({type(inner).__name__ for inner in custom})
                error.add_note(
                    f"{label} runs under the torch.func fallback (vmap, one example per call) and contains "
                    f"{'/'.join(kinds)} with a forward of its own (a subclass of a torch recurrent layer, or a "
                    f"replaced forward), which cannot be swapped for a vmap-safe one; torch's fused recurrent "
                    f"kernels have no batching rule. Call a plain torch layer (nn.LSTM, nn.GRU, nn.RNN, or a "
                    f"cell) as a child module instead of overriding its forward."
                )
            if replaced:
                kinds = sorted({type(inner).__name__ for inner in replaced})
                error.add_note(
                    f"{label} owns parameters itself, so it runs under the torch.func fallback (vmap, one example "
                    f"per call) together with the {'/'.join(kinds)} inside it; there a PackedSequence cannot be "
                    f"built or split per example. Move the own parameters of {label} into a child module: the "
                    f"recurrent layer then gets its exact per-sample gradients on its own, for any input."
                )
        raise
    finally:
        for inner in replaced:
            del inner.forward


# ---------------------------------------------------------------------------------- main entry
class _ForwardOnly(nn.Module):
    """Runs ``forward`` (the module's own forward) with ``module``'s parameters swapped by
    ``functional_call``, without going through ``module.__call__``: the module's hooks already ran
    for the real call and must not run a second time on the per-example tensors."""

    def __init__(self, module: nn.Module, forward: Callable) -> None:
        super().__init__()
        self.module = module
        self.call_forward = forward

    def forward(self, *args, **kwargs):
        return self.call_forward(*args, **kwargs)


def _expanded_parameters(
    params: dict[str, nn.Parameter], batch_size: int, on_per_sample_grad: PerSampleGradCallback
) -> dict[str, torch.Tensor]:
    """One expanded view (no copy) of each parameter per example, named for ``_ForwardOnly``; the gradient
    autograd delivers to a view is the stack of per-example gradients, handed to ``on_per_sample_grad``."""
    expanded: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        copies = param.unsqueeze(0).expand(batch_size, *param.shape)
        copies.register_hook(lambda grads, param=param: on_per_sample_grad(param, grads))
        expanded["module." + name] = copies
    return expanded


def _distinct_inputs(layout: _ArgumentLayout) -> tuple[list[object], list[int | None], list[int | None], list[int]]:
    """One ``vmap`` input per distinct (tensor, split dim, keep dim): ``(inputs, their split dims, their keep
    dims, the input of each leaf)``. A tensor passed twice stays one tensor for each example, so identity
    checks in a forward (``query is key``) still hold."""
    inputs: list[object] = []
    split_dims: list[int | None] = []
    keep_dims: list[int | None] = []
    input_of_leaf: list[int] = []
    seen: dict[tuple[int, int | None, int | None], int] = {}
    for leaf, split_dim, keep_dim in zip(layout.leaves, layout.split_dims, layout.keep_dims):
        key = (id(leaf), split_dim, keep_dim)
        if isinstance(leaf, torch.Tensor) and key in seen:
            input_of_leaf.append(seen[key])
            continue
        seen[key] = len(inputs)
        input_of_leaf.append(len(inputs))
        inputs.append(leaf)
        split_dims.append(split_dim)
        keep_dims.append(keep_dim)
    return inputs, split_dims, keep_dims, input_of_leaf


def per_sample_forward(
    module: nn.Module,
    original_forward: Callable,
    args: tuple,
    kwargs: dict,
    *,
    params: dict[str, nn.Parameter],
    batch_dim: int,
    module_path: str,
    on_per_sample_grad: PerSampleGradCallback,
):
    """Run ``module``'s forward on a batch so that backward also yields per-example gradients.

    ``params`` maps names (relative to ``module``) to the trainable parameters to differentiate.
    For each of them, ``on_per_sample_grad(param, grads)`` is called during backward with
    ``grads`` of shape ``(batch, *param.shape)``: the gradient of the loss with respect to each
    example's copy of the parameter (no loss-reduction scaling applied). ``param.grad`` still
    receives the ordinary gradient (the sum over examples).

    Guarantee: the output equals the module's own forward on the batch (up to float rounding,
    with random operations drawn independently per example), and ``grads[i]`` is the exact
    gradient of the loss with respect to example ``i``'s parameters, so ``grads.sum(0)`` is the
    ordinary gradient.

    ==========================================  ==============================================
    case                                        behaviour
    ==========================================  ==============================================
    argument without the batch size at its dim  shared by every example (not split)
    same tensor passed twice                    the same tensor for each example (``is`` holds)
    MultiheadAttention (root or inside)         run on its batched ``need_weights=True`` path
    MultiheadAttention, batch_first=False       batch read from the module: dim 1 of q/k/v and
                                                of the output, dim 0 of key_padding_mask and
                                                of the weights
    MultiheadAttention, 3-D attn_mask           split as (batch, heads, queries, keys)
    MultiheadAttention, unbatched query         ValueError
    no tensor with a batch dimension            ValueError
    an output without the example at its dim    ValueError naming the module (one example's
    (``batch_dim``, or the attention's)         output has no axis of size 1 there)
    type with a registered own forward          that forward (``register_per_sample_forward``)
    ==========================================  ==============================================
    """
    own = per_sample_forward_for(module)
    if own is not None and getattr(original_forward, "__func__", None) is type(module).forward:
        return own.forward(module, original_forward, args, kwargs, params=params, batch_dim=batch_dim,
                           module_path=module_path, on_per_sample_grad=on_per_sample_grad)
    plan = _call_plan(module, args, kwargs, batch_dim, module_path)
    layout = plan.arguments
    batch_size = layout.batch_size
    expanded = _expanded_parameters(params, batch_size, on_per_sample_grad)
    caller = _ForwardOnly(module, original_forward)
    inputs, input_split_dims, input_keep_dims, input_of_leaf = _distinct_inputs(layout)

    output_spec: list = []

    def one_example(example_params, example_inputs):
        # Each example is given back a batch dimension of size 1 where the module expects one.
        restored = [
            value.unsqueeze(keep_dim) if keep_dim is not None else value
            for value, keep_dim in zip(example_inputs, input_keep_dims)
        ]
        example_args, example_kwargs = tree_unflatten([restored[i] for i in input_of_leaf], layout.spec)
        output = plan.finish(functional_call(caller, example_params, example_args, example_kwargs))
        leaves, spec = tree_flatten(output)
        output_spec[:] = [spec, [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]]
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        output_dims[:] = [plan.output_dims(index) for index in range(len(tensors))]
        for index, (tensor, dim) in enumerate(zip(tensors, output_dims)):
            if tensor.dim() > dim and tensor.shape[dim] != 1:
                raise ValueError(_output_without_example_axis(module, module_path, index, tuple(tensor.shape), dim))
        return tuple(tensor.squeeze(dim) for tensor, dim in zip(tensors, output_dims))

    output_dims: list[int] = []
    batched = vmap(one_example, in_dims=(0, input_split_dims), out_dims=0, randomness="different")
    with (
        _attention_through_batched_ops(module),
        _own_forwards_under_vmap(module, module_path),
        _math_attention_on_cpu(params.values()),
    ):
        stacked = batched(expanded, inputs)
    tensor_outputs = iter(tensor.movedim(0, dim) if dim else tensor for tensor, dim in zip(stacked, output_dims))
    spec, leaves = output_spec
    return tree_unflatten([next(tensor_outputs) if leaf is _TENSOR else leaf for leaf in leaves], spec)


def _output_without_example_axis(module: nn.Module, module_path: str, index: int, shape: tuple, dim: int) -> str:
    label = f"{module_path!r} ({type(module).__name__})" if module_path else f"the model ({type(module).__name__})"
    return (
        f"{label} has its per-sample gradients computed through torch.func: its forward ran on each example "
        f"alone, with the example at dim {dim} of its inputs, and its output tensor {index} came back with "
        f"shape {shape} for one example, which has no axis of size 1 at dim {dim}: the output holds the examples "
        f"at another dim (a batch-first head after a sequence-first encoder, or the reverse), and stacking it at "
        f"dim {dim} would scramble them. Give the layers inside it a grad sampler each (so that each layer's own "
        f"layout is read), declare the layout of the sub-modules that differ (a boolean batch_first attribute), or "
        f"return the output with the examples at dim {dim}."
    )


__all__ = [
    "PerSampleForward",
    "PerSampleGradCallback",
    "per_sample_forward",
    "per_sample_forward_for",
    "register_per_sample_forward",
]
