"""Per-layer samplers of exact per-sample gradients (and, where a layer allows, of their norms and
weighted sums): one ``LayerSampler`` per layer family, registered for its layer types (``registry``).

Importing this package registers the built-in samplers. Any module that owns parameters and has no
sampler here goes through the ``torch.func`` fallback (``grad_samplers.functorch_fallback``).
"""

from grad_samplers import (
    conv,  # noqa: F401  (registers nn.Conv1d/2d/3d)
    conv_transpose,  # noqa: F401  (registers nn.ConvTranspose1d/2d/3d)
    embedding,  # noqa: F401  (registers nn.Embedding, nn.EmbeddingBag)
    hf_conv1d,  # registers transformers' Conv1D lazily (register_optional_samplers)
    linear,  # noqa: F401  (registers nn.Linear)
    normalization,  # noqa: F401  (registers LayerNorm, GroupNorm, InstanceNorm*, RMSNorm)
    rnn,  # noqa: F401  (registers own forwards for nn.LSTM, nn.GRU, nn.RNN)
)
from grad_samplers.registry import (
    ENTRY_POINT_GROUP,
    LayerSampler,
    grad_sampler_for,
    layer_sampler_for,
    load_plugins,
    norm_sampler_for,
    register_grad_sampler,
    register_layer_sampler,
    register_norm_sampler,
    register_weighted_sum_sampler,
    registered_grad_samplers,
    registered_layer_samplers,
    weighted_sum_sampler_for,
)
from grad_samplers.units import is_per_sample_unit, register_per_sample_unit, registered_per_sample_units


def register_optional_samplers() -> None:
    """Register the samplers for layers of optional libraries that are imported by now (never imports
    them): ``transformers.pytorch_utils.Conv1D``. Called when a model is wrapped."""
    hf_conv1d.register_if_imported()


__all__ = [
    "ENTRY_POINT_GROUP",
    "LayerSampler",
    "grad_sampler_for",
    "is_per_sample_unit",
    "layer_sampler_for",
    "load_plugins",
    "norm_sampler_for",
    "register_grad_sampler",
    "register_layer_sampler",
    "register_norm_sampler",
    "register_optional_samplers",
    "register_per_sample_unit",
    "register_weighted_sum_sampler",
    "registered_grad_samplers",
    "registered_layer_samplers",
    "registered_per_sample_units",
    "weighted_sum_sampler_for",
]
