"""Per-sample gradients for any module through ``torch.func``: the module's forward runs under
``vmap`` with one copy of its parameters per example.

Why a forward, not a backward re-computation: re-running the layer per example after the fact
cannot reproduce random operations inside it (the dropout of ``nn.MultiheadAttention``), so the
per-example gradients would not sum to the real gradient. Running the *real* forward through
``vmap(functional_call)`` with the parameters expanded along a new batch dimension makes autograd
deliver the gradient of that expanded view, which is exactly the stack of per-example gradients,
whatever the module does (dropout, parameters used twice, children called or not).

The expansion is a view (no copy of the weights); the batched matmuls it creates cost about what the
ordinary forward costs.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

PerSampleGradCallback = Callable[[nn.Parameter, torch.Tensor], None]
_TENSOR = object()  # marks where a tensor output sits in the flattened output structure


def _batch_size(args: Tuple, kwargs: Dict, batch_dim: int, module_path: str) -> int:
    leaves, _ = tree_flatten((args, kwargs))
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim:
            return leaf.shape[batch_dim]
    raise ValueError(
        f"module {module_path!r}: the torch.func fallback needs a tensor input with a batch dimension "
        f"(dim {batch_dim}); got no such tensor among its arguments"
    )


def _in_dims(tree, batch_dim: int, batch_size: int):
    """Tensors whose batch dimension has the batch size are split per example; others are shared."""
    leaves, spec = tree_flatten(tree)
    dims = [
        batch_dim if isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim and leaf.shape[batch_dim] == batch_size else None
        for leaf in leaves
    ]
    return tree_unflatten(dims, spec)


def per_sample_forward(
    module: nn.Module,
    original_forward: Callable,
    args: Tuple,
    kwargs: Dict,
    *,
    params: Dict[str, nn.Parameter],
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

    Assumes every tensor output carries the batch at ``batch_dim``.
    """
    batch_size = _batch_size(args, kwargs, batch_dim, module_path)
    expanded: Dict[str, torch.Tensor] = {}
    for name, param in params.items():
        copies = param.unsqueeze(0).expand(batch_size, *param.shape)
        copies.register_hook(lambda grads, param=param: on_per_sample_grad(param, grads))
        expanded[name] = copies

    output_spec: List = []

    def one_example(example_params, example_args, example_kwargs):
        # Each example is given back a batch dimension of size 1: many modules require one.
        example_args, example_kwargs = _unsqueeze_batched((example_args, example_kwargs), in_dims, batch_dim)
        output = functional_call(module, example_params, example_args, example_kwargs)
        leaves, spec = tree_flatten(output)
        output_spec[:] = [spec, [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]]
        return tuple(leaf.squeeze(batch_dim) for leaf in leaves if isinstance(leaf, torch.Tensor))

    in_dims = (_in_dims(args, batch_dim, batch_size), _in_dims(kwargs, batch_dim, batch_size))
    batched = vmap(
        one_example,
        in_dims=(0, in_dims[0], in_dims[1]),
        out_dims=batch_dim,
        randomness="different",
    )
    tensor_outputs = iter(batched(expanded, args, kwargs))
    spec, leaves = output_spec
    return tree_unflatten([next(tensor_outputs) if leaf is _TENSOR else leaf for leaf in leaves], spec)


def _unsqueeze_batched(tree, in_dims, batch_dim: int):
    leaves, spec = tree_flatten(tree)
    dims, _ = tree_flatten(in_dims)
    return tree_unflatten(
        [leaf.unsqueeze(batch_dim) if dim is not None else leaf for leaf, dim in zip(leaves, dims)], spec
    )
