"""The first-backward check: at the first training backward, every trainable parameter's gradient must
equal the sum of its per-sample gradients (``ParameterUsageError`` otherwise: the parameter is used
outside the forward of the module that owns it, and that use has no per-sample gradient).

``UsageCheck`` is a mixin of ``GradSampleModule``. It reads and writes ``_usage``
(``capture.state.UsageCheckState``), and reads ``_tables.owner_paths`` / ``_tables.param_names``,
``_module`` and ``loss_reduction``. ``hooks.py`` feeds it (``_record_for_usage_check``,
``_record_term_scales``) while ``_usage.phase == "armed"``; ``GradSampleModule.forward`` arms it.
``GhostClippingModule`` turns it off through ``GradSampleModule.checks_parameter_usage`` (``.grad`` is
never written there; a hook per parameter refuses any gradient instead).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from grad_samplers import layer_sampler_for, norm_sampler_for
from privacy_engine.capture.common import ParameterUsageError
from privacy_engine.capture.compiled_code import stale_compilation_note
from privacy_engine.models.validation import submodule_label

__all__ = ["UsageCheck", "at_least_float32"]


class UsageCheck:
    """Mixin: verify, once, that each parameter's gradient is explained by its per-sample gradients."""

    def _arm_usage_check(self) -> None:
        """Hook every trainable parameter so the first backward can verify sum_i grad_sample[i] == grad."""
        usage = self._usage
        for handle in usage.handles:
            handle.remove()
        trainable = [p for p in self._tables.owner_paths if p.requires_grad]
        usage.clear_records()
        # Ops under autocast ran in its dtype (bf16/fp16): the check's tolerance must follow it.
        usage.autocast_dtype = _autocast_dtype()
        # A hook on the leaf sees exactly the gradient this backward delivers. Diffing .grad against a
        # snapshot taken at forward time would break when gradients are zeroed between forward and
        # backward (optimizer.zero_grad() just before loss.backward()), and would copy every gradient.
        usage.handles = [param.register_hook(partial(self._verify_parameter, param)) for param in trainable]
        usage.phase = "armed"

    def _record_for_usage_check(self, param: nn.Parameter, grads: torch.Tensor, batch_size: int) -> None:
        usage = self._usage
        self._queue_usage_check_end()
        grads = grads.detach()
        self._note_check_dtype(param, grads.dtype)
        # Summed in float32 at least: a half-precision sum would add its own rounding to the comparison.
        total = grads.sum(0, dtype=at_least_float32(grads.dtype))
        if self.loss_reduction == "mean":
            total = total / batch_size
        previous = usage.sums.get(param)
        usage.sums[param] = total if previous is None else previous + total
        # reshape, not flatten(1): a 0-dim parameter's per-sample gradients are 1-D.
        per_example = grads.reshape(grads.shape[0], param.numel())
        magnitude = float(torch.linalg.vector_norm(per_example, dim=1, dtype=at_least_float32(grads.dtype)).sum())
        if self.loss_reduction == "mean":
            magnitude /= max(batch_size, 1)
        usage.magnitudes[param] = usage.magnitudes.get(param, 0.0) + magnitude

    def _queue_usage_check_end(self) -> None:
        """Queue ``_finish_usage_check`` at the end of the running backward, once per armed check."""
        if not self._usage.end_queued:
            self._usage.end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_usage_check)

    def _note_check_dtype(self, param: nn.Parameter, dtype: torch.dtype) -> None:
        """Keep the least precise floating dtype a parameter's per-sample computation went through."""
        if not dtype.is_floating_point:
            return
        previous = self._usage.dtypes.get(param)
        if previous is None or torch.finfo(dtype).eps > torch.finfo(previous).eps:
            self._usage.dtypes[param] = dtype

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
        # activations and backprops batch-first (``_batch_first``, called by the hook)
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
            self._usage.term_scales[param] = self._usage.term_scales.get(param, 0.0) + float(per_example.sum())

    def _verify_parameter(self, param: nn.Parameter, received: torch.Tensor) -> None:
        usage = self._usage
        if usage.phase != "armed":
            return
        name = self._tables.param_names.get(param, "?")
        owner = submodule_label(self._module, self._tables.owner_paths.get(param))
        received = received.detach()
        explained = usage.sums.get(param)
        if explained is None:
            usage.phase = "done"
            raise ParameterUsageError(
                f"parameter {name!r} received a gradient but its owner {owner} produced no per-sample "
                f"gradient: it is used outside the forward of the module that owns it. Call the owning "
                f"module instead of reading its parameter directly (or move the computation into a "
                f"module that owns the parameter)."
                + stale_compilation_note(self._module, self._tables.owner_paths.get(param))
            )
        # The least precise dtype the gradient went through: the parameter's, its per-sample
        # computation's, or autocast's (bf16/fp16 autocast computes in half precision what a float32
        # parameter receives).
        dtypes = [received.dtype, usage.dtypes.get(param, received.dtype)]
        if usage.autocast_dtype is not None:
            dtypes.append(usage.autocast_dtype)
        eps = max(torch.finfo(d).eps if d.is_floating_point else 0.0 for d in dtypes)
        # Relative to the per-sample magnitudes, not only to the result: when examples' gradients
        # cancel, the rounding of their sum is far larger than the (near-zero) sum itself. 1e-3 is far
        # above float32 rounding and far below what a second use of a parameter adds; half precision
        # rounds each product to 2^-8 (bf16), so its bound grows with eps.
        tolerance = max(1e-3, 4 * eps)
        # Plus the rounding of sums that cancel within an example (see _record_term_scales): at most a
        # few units of rounding (log2 of the number of terms, for float32 blocked sums) of sum |terms|.
        term_tolerance = max(32 * torch.finfo(torch.float32).eps, 2 * eps)
        scale = max(float(received.norm()), float(explained.norm()), usage.magnitudes.get(param, 0.0))
        term_scale = usage.term_scales.get(param, 0.0)  # from the unscaled output gradients: as received
        difference = float(torch.linalg.vector_norm(received - explained.to(received.dtype), dtype=at_least_float32(received.dtype)))
        if difference > tolerance * scale + term_tolerance * term_scale + 1e-12:
            usage.phase = "done"
            raise ParameterUsageError(
                f"parameter {name!r}: its gradient is not the sum of its per-sample gradients computed in "
                f"{owner}: it is also used outside the forward of that module. Route every use through "
                f"the owning module."
                + stale_compilation_note(self._module, self._tables.owner_paths.get(param))
            )

    def _finish_usage_check(self) -> None:
        usage = self._usage
        for handle in usage.handles:
            handle.remove()
        usage.handles = []
        usage.clear_records()
        if usage.phase == "armed":
            usage.phase = "done"


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """The dtype to accumulate ``dtype`` values in: ``dtype`` promoted to at least float32 (float64 stays;
    float16/bfloat16 become float32); float32 for a non-floating dtype."""
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
