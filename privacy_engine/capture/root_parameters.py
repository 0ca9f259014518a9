"""Parameters owned directly by the wrapped model's root (CLIP's ``logit_scale``, a learned temperature):
their per-sample gradients by forward-mode differentiation, without sending the whole model to the
``torch.func`` fallback.

A root parameter is read in the root's own forward body, so no layer hook sees its use. Its per-sample
gradient is exact all the same, by the chain rule at the model's output: with ``L = sum_i l_i(out_i)`` (the
examples independent, which the engine checks), ``dl_i/dp = <G_i, d out_i / dp>``, where ``G`` is the
output's gradient (it arrives in backward) and ``d out / dp`` is the output's tangent along ``p``, one
forward-mode pass (``torch.autograd.forward_ad``) per element of ``p``. The tangent passes rerun the real
forward (no ``vmap``: data-dependent control flow is fine), under ``no_grad``, with the random state of the
real forward (dropout draws the same masks), with every capture and forward hook off except the per-example
loss hooks of Hugging Face models (``_forward_replay``, ``row_probe.without_forward_hooks``), and with
``scaled_dot_product_attention`` on its math kernel (the fused ones have no forward-mode derivative).

==========================================  ==========================================================
case                                        behaviour
==========================================  ==========================================================
root parameter, at most                     forward-mode per-sample gradient: one extra no-grad forward
``ROOT_PARAMETER_ELEMENTS`` trainable       per element, exact (checked at the first backward in hooks
elements at the root, children with         mode like every parameter); the children are hooked as usual
parameters
more root elements than that                the whole model through the ``torch.func`` fallback (as
                                            before); wrap them in a small module to avoid it
the root owns every parameter (no child     the ``torch.func`` fallback on the root (unchanged)
with parameters)
frozen root parameter                       not owned: nothing computed; unfrozen later: ``RuntimeError``
                                            at the next training forward (wrap the model again)
an output that depends on the parameter     ``ValueError`` at the forward, naming the parameter
without the batch at ``batch_dim``
an op without forward-mode support          ``UnsupportedModuleError`` naming the parameter and the way
                                            out (a small module owning it)
==========================================  ==========================================================

``RootParameters`` is a mixin of ``GradSampleModule``. It reads ``_tables.root_parameters`` (set at
wrapping), ``_batch_dim``, ``_module``, ``_generation`` and the batch size of the forward; it runs the
tangent passes inside ``_forward_replay`` and hands the per-sample gradients to ``_root_parameter_sink``
(hooks mode: ``_fallback_backward_of``; fast clipping: a materialised use of the pass).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from privacy_engine.capture.row_probe import without_forward_hooks
from privacy_engine.models.validation import UnsupportedModuleError

__all__ = ["ROOT_PARAMETER_ELEMENTS", "RootParameters"]

#: The most trainable elements the root may own directly for the forward-mode path (each costs one extra
#: no-grad forward per step); beyond it the whole model goes through the ``torch.func`` fallback.
ROOT_PARAMETER_ELEMENTS = 8


class RootParameters:
    """Mixin: per-sample gradients of the root's own parameters, by forward-mode tangents at the output."""

    @contextlib.contextmanager
    def _root_parameter_forward(self):
        """Around the real training forward: keep the random state it starts from (the tangent passes replay
        it), and let the subclass swap the root parameters (``_root_parameters_in_forward``)."""
        trainable = [(name, p) for name, p in self._tables.root_parameters if p.requires_grad]
        if not trainable:
            yield None
            return
        devices = sorted({p.device.index for _, p in self._tables.root_parameters if p.is_cuda})
        state = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices], devices)
        with self._root_parameters_in_forward(trainable):
            yield (trainable, state)

    @contextlib.contextmanager
    def _root_parameters_in_forward(self, trainable: list[tuple[str, nn.Parameter]]):
        """How the real forward reads the root parameters: as they are (their ``.grad`` is the ordinary one,
        checked at the first backward against the per-sample gradients)."""
        yield

    def _root_parameter_sink(self, params: list[nn.Parameter]) -> Callable[[nn.Parameter, torch.Tensor], None]:
        """Where the per-sample gradients ``(param, grads (B, *param.shape), loss reduction not undone)`` go."""
        return partial(self._fallback_backward_of, self._generation)

    def _attach_root_parameter_grads(self, prepared, args: tuple, kwargs: dict, output):
        """After the real forward (``prepared`` from ``_root_parameter_forward``): run one tangent pass per
        trainable root element; return the output with each tensor that depends on a root parameter replaced
        by a hooked copy, so that backward turns its gradient into per-sample gradients of the root
        parameters (the output unchanged when no root parameter is trainable)."""
        if prepared is None:
            return output
        trainable, (cpu_state, cuda_states, devices) = prepared
        leaves = [leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor)]
        batch_size = self._forward_batch_size()
        dim = self._batch_dim
        # tangents[param][leaf index] = (numel, *leaf.shape): d leaf / d param[e] for each element e
        tangents: dict[nn.Parameter, dict[int, torch.Tensor]] = {}
        own = self._module._parameters
        # Forward hooks off (the user's see only training forwards), except the per-example loss hooks of
        # Hugging Face models (integrations.hf_losses): the pass must return what the real forward returned.
        keep = frozenset(handle.id for handle in self._hf_losses.handles) if self._hf_losses is not None else frozenset()
        with (
            self._forward_replay(),
            without_forward_hooks(self._independence.modules, keep),
            torch.no_grad(),
            torch.random.fork_rng(devices=devices),
            forward_ad.dual_level(),
            # The fused attention kernels have no forward-mode derivative; the math one has (same tangent up to
            # rounding; the pass's own output is not used).
            sdpa_kernel(SDPBackend.MATH),
        ):
            for name, param in trainable:
                per_leaf: dict[int, list[torch.Tensor]] = {}
                for element in range(param.numel()):
                    torch.set_rng_state(cpu_state)
                    for device, cuda_state in zip(devices, cuda_states):
                        torch.cuda.set_rng_state(cuda_state, device)
                    direction = torch.zeros_like(param).reshape(-1)
                    direction[element] = 1
                    own[name] = forward_ad.make_dual(param.detach(), direction.view_as(param))
                    try:
                        dual_output = self._module(*args, **kwargs)
                    except RuntimeError as error:
                        raise UnsupportedModuleError(_no_forward_mode(name, error)) from error
                    finally:
                        own[name] = param
                    dual_leaves = [leaf for leaf in tree_leaves(dual_output) if isinstance(leaf, torch.Tensor)]
                    for index, leaf in enumerate(dual_leaves):
                        tangent = forward_ad.unpack_dual(leaf).tangent
                        if tangent is not None:
                            per_leaf.setdefault(index, []).append(tangent)
                tangents[param] = {index: torch.stack(values) for index, values in per_leaf.items()}
        sink = self._root_parameter_sink([param for _, param in trainable])
        names = {param: name for name, param in trainable}
        flat, spec = tree_flatten(output)
        tensor_positions = [position for position, value in enumerate(flat) if isinstance(value, torch.Tensor)]
        for index, leaf in enumerate(leaves):
            parts = {param: per_leaf[index] for param, per_leaf in tangents.items() if index in per_leaf}
            parts = {param: tangent for param, tangent in parts.items() if bool(tangent.ne(0).any())}
            if not parts or not leaf.requires_grad:
                continue
            if batch_size is None or leaf.dim() <= dim or leaf.shape[dim] != batch_size:
                raise ValueError(
                    f"root parameter(s) {sorted(names[p] for p in parts)}: an output of shape {tuple(leaf.shape)} depends "
                    f"on it without the {batch_size} examples at dim {dim}, so its gradient cannot be split per example. "
                    f"Use the parameter inside a small module of its own (it then gets its own per-sample gradients), "
                    f"or freeze it."
                )
            # Handed back as a copy, and the copy hooked: its gradient is what the caller's loss sends to this
            # output alone. A hook on the output itself would also receive what flows into it from other
            # outputs computed from it inside the model (HF's loss from the logits), counted twice then.
            returned = leaf.clone()
            returned.register_hook(partial(_per_sample_from_tangents, parts, dim, sink))
            flat[tensor_positions[index]] = returned
        return tree_unflatten(flat, spec)


def _per_sample_from_tangents(parts: dict[nn.Parameter, torch.Tensor], dim: int, sink, grad: torch.Tensor) -> None:
    """``grads[i] = <G_i, d out_i / d param>`` for each root parameter, handed to ``sink``."""
    grad_first = grad.movedim(dim, 0)
    batch_size = grad_first.shape[0]
    for param, tangent in parts.items():
        tangent_first = tangent.movedim(dim + 1, 1).reshape(tangent.shape[0], batch_size, -1)
        # In float32 at least: under autocast the output gradient may be half precision.
        dtype = torch.promote_types(torch.promote_types(grad.dtype, tangent.dtype), torch.float32)
        per_example = torch.einsum("ebk,bk->be", tangent_first.to(dtype), grad_first.reshape(batch_size, -1).to(dtype))
        sink(param, per_example.reshape(batch_size, *param.shape).to(param.dtype))


def _no_forward_mode(name: str, error: RuntimeError) -> str:
    return (
        f"root parameter {name!r} is read in the model's own forward, so its per-sample gradients come from "
        f"forward-mode differentiation of the model, and an operation of the forward has none ({error}). Move the "
        f"parameter into a small module that owns it and applies it (e.g. class Scale(nn.Module) holding it, "
        f"called in the forward): the module gets per-sample gradients of its own; or freeze the parameter."
    )
