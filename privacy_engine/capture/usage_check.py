"""The first-backward check: at the first training backward, every trainable parameter's gradient must
equal the sum of its per-sample gradients (``ParameterUsageError`` otherwise: the parameter is used
outside the forward of the module that owns it, and that use has no per-sample gradient).

``UsageCheck`` is a mixin of ``GradSampleModule``; its state (``_check_*``) is initialised by
``_reset_usage_check_state``. ``GhostClippingModule`` turns it off (``.grad`` is never written there;
a hook per parameter refuses any gradient instead).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from grad_samplers import layer_sampler_for, norm_sampler_for
from privacy_engine.capture.common import ParameterUsageError
from privacy_engine.models.validation import submodule_label

__all__ = ["UsageCheck", "at_least_float32"]


class UsageCheck:
    """Mixin: verify, once, that each parameter's gradient is explained by its per-sample gradients."""

    def _reset_usage_check_state(self) -> None:
        self._check_state = "pending"  # -> "armed" at the first forward, "done" after the first backward
        self._check_sums: dict[nn.Parameter, torch.Tensor] = {}
        self._check_magnitudes: dict[nn.Parameter, float] = {}  # sum_i ||g_i||: the scale of rounding errors
        self._check_term_scales: dict[nn.Parameter, float] = {}  # ||sum |terms| ||: see _record_term_scales
        self._check_dtypes: dict[nn.Parameter, torch.dtype] = {}  # least precise dtype of the computation
        self._check_autocast_dtype: torch.dtype | None = None
        self._check_handles: list[torch.utils.hooks.RemovableHandle] = []

    def _arm_usage_check(self) -> None:
        """Hook every trainable parameter so the first backward can verify sum_i grad_sample[i] == grad."""
        for handle in self._check_handles:
            handle.remove()
        trainable = [p for p in self._owner_paths if p.requires_grad]
        self._check_sums, self._check_magnitudes = {}, {}
        self._check_term_scales, self._check_dtypes = {}, {}
        # Ops under autocast ran in its dtype (bf16/fp16): the check's tolerance must follow it.
        self._check_autocast_dtype = _autocast_dtype()
        # A hook on the leaf sees exactly the gradient this backward delivers. Diffing .grad against a
        # snapshot taken at forward time would break when gradients are zeroed between forward and
        # backward (optimizer.zero_grad() just before loss.backward()), and would copy every gradient.
        self._check_handles = [param.register_hook(partial(self._verify_parameter, param)) for param in trainable]
        self._check_state = "armed"

    def _record_for_usage_check(self, param: nn.Parameter, grads: torch.Tensor, batch_size: int) -> None:
        if not self._check_sums:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_usage_check)
        grads = grads.detach()
        self._note_check_dtype(param, grads.dtype)
        # Summed in float32 at least: a half-precision sum would add its own rounding to the comparison.
        total = grads.sum(0, dtype=at_least_float32(grads.dtype))
        if self.loss_reduction == "mean":
            total = total / batch_size
        previous = self._check_sums.get(param)
        self._check_sums[param] = total if previous is None else previous + total
        # reshape, not flatten(1): a 0-dim parameter's per-sample gradients are 1-D.
        per_example = grads.reshape(grads.shape[0], param.numel())
        magnitude = float(torch.linalg.vector_norm(per_example, dim=1, dtype=at_least_float32(grads.dtype)).sum())
        if self.loss_reduction == "mean":
            magnitude /= max(batch_size, 1)
        self._check_magnitudes[param] = self._check_magnitudes.get(param, 0.0) + magnitude

    def _note_check_dtype(self, param: nn.Parameter, dtype: torch.dtype) -> None:
        """Keep the least precise floating dtype a parameter's per-sample computation went through."""
        if not dtype.is_floating_point:
            return
        previous = self._check_dtypes.get(param)
        if previous is None or torch.finfo(dtype).eps > torch.finfo(previous).eps:
            self._check_dtypes[param] = dtype

    def _record_term_scales(self, layer: nn.Module, activations: tuple, backprops: torch.Tensor) -> None:
        """For the first-backward check: the size of the terms each per-sample gradient sums.

        A per-sample gradient sums products of output gradients and inputs over positions; when they
        cancel (a conv bias followed by InstanceNorm: the normalisation removes every per-channel
        shift, so the exact gradient is 0), the computed sum is pure rounding, of the order of
        ``eps * sum |terms|``, however small the sum itself. The same sampler evaluated on ``|inputs|``
        and ``|output gradient|`` gives ``sum |terms|`` (exactly for linear maps, convolutions and
        embeddings), through its norm sampler; a layer that transforms its input before the product (a
        normalisation) gives its own ``LayerSampler.term_scale``. Layers with neither, e.g. plugins' with only
        a grad sampler, get no term scale: their sampler is not run twice.
        """
        backprops, activations = self._batch_first(backprops, activations)
        if backprops.shape[0] == 0:
            return
        floating = [a for a in activations if isinstance(a, torch.Tensor) and a.is_floating_point()]
        trainable = [p for p in layer.parameters(recurse=False) if p.requires_grad]
        for param in trainable:
            for tensor in (backprops, *floating):
                self._note_check_dtype(param, tensor.dtype)
        sampler = layer_sampler_for(layer)
        term_scale = None if sampler is None else sampler.term_scale
        norm_sampler = norm_sampler_for(layer)
        if term_scale is None and norm_sampler is None:
            return  # only the cheap norm form is used (a layer without one keeps the strict check)
        with torch.no_grad():
            try:
                if term_scale is not None:  # the layer's own (it transforms its input before the product)
                    scales = {p: norms.to(at_least_float32(norms.dtype)) for p, norms in term_scale(layer, activations, backprops).items()}
                else:
                    absolute = tuple(a.abs() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in activations)
                    scales = {
                        p: squared.to(at_least_float32(squared.dtype)).clamp(min=0).sqrt()
                        for p, squared in norm_sampler(layer, absolute, backprops.abs()).items()
                    }
            except Exception:  # noqa: BLE001  (a sampler that rejects these values: no term scale, the check stays strict)
                return
        for param, per_example in scales.items():
            self._check_term_scales[param] = self._check_term_scales.get(param, 0.0) + float(per_example.sum())

    def _verify_parameter(self, param: nn.Parameter, received: torch.Tensor) -> None:
        if self._check_state != "armed":
            return
        name = self._param_names.get(param, "?")
        owner = submodule_label(self._module, self._owner_paths.get(param))
        received = received.detach()
        explained = self._check_sums.get(param)
        if explained is None:
            self._check_state = "done"
            raise ParameterUsageError(
                f"parameter {name!r} received a gradient but its owner {owner} produced no per-sample "
                f"gradient: it is used outside the forward of the module that owns it. Call the owning "
                f"module instead of reading its parameter directly (or move the computation into a "
                f"module that owns the parameter)."
            )
        # The least precise dtype the gradient went through: the parameter's, its per-sample
        # computation's, or autocast's (bf16/fp16 autocast computes in half precision what a float32
        # parameter receives).
        dtypes = [received.dtype, self._check_dtypes.get(param, received.dtype)]
        if self._check_autocast_dtype is not None:
            dtypes.append(self._check_autocast_dtype)
        eps = max(torch.finfo(d).eps if d.is_floating_point else 0.0 for d in dtypes)
        # Relative to the per-sample magnitudes, not only to the result: when examples' gradients
        # cancel, the rounding of their sum is far larger than the (near-zero) sum itself. 1e-3 is far
        # above float32 rounding and far below what a second use of a parameter adds; half precision
        # rounds each product to 2^-8 (bf16), so its bound grows with eps.
        tolerance = max(1e-3, 4 * eps)
        # Plus the rounding of sums that cancel within an example (see _record_term_scales): at most a
        # few units of rounding (log2 of the number of terms, for float32 blocked sums) of sum |terms|.
        term_tolerance = max(32 * torch.finfo(torch.float32).eps, 2 * eps)
        scale = max(float(received.norm()), float(explained.norm()), self._check_magnitudes.get(param, 0.0))
        term_scale = self._check_term_scales.get(param, 0.0)  # from the unscaled output gradients: as received
        difference = float(torch.linalg.vector_norm(received - explained.to(received.dtype), dtype=at_least_float32(received.dtype)))
        if difference > tolerance * scale + term_tolerance * term_scale + 1e-12:
            self._check_state = "done"
            raise ParameterUsageError(
                f"parameter {name!r}: its gradient is not the sum of its per-sample gradients computed in "
                f"{owner}: it is also used outside the forward of that module. Route every use through "
                f"the owning module."
            )

    def _finish_usage_check(self) -> None:
        for handle in self._check_handles:
            handle.remove()
        self._check_handles = []
        self._check_sums, self._check_magnitudes = {}, {}
        self._check_term_scales, self._check_dtypes = {}, {}
        if self._check_state == "armed":
            self._check_state = "done"


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32


def _autocast_dtype() -> torch.dtype | None:
    """The dtype autocast computes in right now (the least precise of the enabled devices), or None."""
    found = None
    for device_type in ("cpu", "cuda", "xpu", "mps"):
        try:
            enabled = torch.is_autocast_enabled(device_type)
        except (TypeError, RuntimeError):  # older torch: no per-device query, or an unknown device type
            continue
        if enabled:
            dtype = torch.get_autocast_dtype(device_type)
            if found is None or torch.finfo(dtype).eps > torch.finfo(found).eps:
                found = dtype
    return found
