"""Modules whose per-sample gradients are taken as one unit by the ``torch.func`` fallback, even though
every layer inside has a sampler.

A layer's sampler reads the examples from one dim of the layer's input and output. Some layers inside a
module have no such dim: T5's relative position bias is an ``nn.Embedding`` looked up with
``(q_len, k_len)`` buckets, its output ``(q_len, k_len, heads)`` shared by every example and added to each
example's attention scores; Swin's layers fold the windows of every image into the batch dim
(``(batch * windows, window_size ** 2, channels)``). Neither says which rows belong to which example, and
reading it from a size would be a guess (OPT's decoder layers fold the batch with the sequence the same
way, ``(batch * seq_len, hidden)``). The module that holds them (``T5Attention``, ``SwinLayer``,
``OPTDecoderLayer``, DeBERTa's encoder) has
the examples at its input's batch dim: run as one unit, its forward is run on each example alone under
``vmap`` (``grad_samplers.functorch_fallback``), so whatever it broadcasts or folds inside belongs to that
example, and its per-sample gradients are exact.

Registered here: by class (``register_per_sample_unit``), or, for optional libraries that are never
imported here, by the class's module and qualified name (the Hugging Face classes below), with an
optional test on the instance (only T5 attention layers that own the relative bias need it).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["is_per_sample_unit", "register_per_sample_unit", "registered_per_sample_units"]

UnitTest = Callable[[nn.Module], bool]

_BY_CLASS: dict[type, UnitTest | None] = {}


def _owns_relative_bias(module: nn.Module) -> bool:
    return bool(getattr(module, "has_relative_attention_bias", False))


def _uses_relative_attention(module: nn.Module) -> bool:
    return bool(getattr(module, "relative_attention", False))


# (module of the class, qualified name) -> test on the instance (None: every instance). Checked by name so
# that transformers is never imported here; tests/test_batch_dim.py runs each of these models.
_BY_NAME: dict[tuple[str, str], UnitTest | None] = {
    ("transformers.models.t5.modeling_t5", "T5Attention"): _owns_relative_bias,
    ("transformers.models.mt5.modeling_mt5", "MT5Attention"): _owns_relative_bias,
    ("transformers.models.umt5.modeling_umt5", "UMT5Attention"): None,  # a relative bias in every layer
    ("transformers.models.swin.modeling_swin", "SwinLayer"): None,
    ("transformers.models.swinv2.modeling_swinv2", "Swinv2Layer"): None,
    # OPT runs each decoder layer's feed-forward on (batch * seq_len, hidden): the batch folded with time.
    ("transformers.models.opt.modeling_opt", "OPTDecoderLayer"): None,
    # DeBERTa's relative position embeddings (the encoder's rel_embeddings, read as a weight and normalised)
    # are one (2 * buckets, hidden) tensor shared by every example, projected by each layer's attention.
    ("transformers.models.deberta_v2.modeling_deberta_v2", "DebertaV2Encoder"): _uses_relative_attention,
    ("transformers.models.deberta.modeling_deberta", "DebertaEncoder"): _uses_relative_attention,
}


def register_per_sample_unit(module_type: type, when: UnitTest | None = None) -> None:
    """Have every module of ``module_type`` (for which ``when(module)`` is true, if given) take its
    per-sample gradients as one unit through the ``torch.func`` fallback: its forward runs on each example
    alone (under ``vmap``), and its whole subtree is differentiated there, grad samplers of the layers
    inside it unused.

    Use it for a module whose layers do not hold the examples at one dim of their input and output (a
    tensor shared by every example without a batch dim, a batch folded with another axis); the engine's
    error names such a layer. The module itself must have the examples at the wrapper's batch dim (or the
    dim its ``batch_first`` attribute declares) in its inputs and outputs, and its forward must run under
    ``vmap`` (no data-dependent Python control flow). Takes effect for models wrapped afterwards.

    Raises ``TypeError`` if ``module_type`` is not a subclass of ``nn.Module`` or ``when`` is not callable.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_per_sample_unit takes an nn.Module subclass; got {module_type!r}")
    if when is not None and not callable(when):
        raise TypeError(f"when must be a callable taking the module and returning a bool; got {when!r}")
    _BY_CLASS[module_type] = when


def registered_per_sample_units() -> list[str]:
    """The registered unit classes, as ``module.QualifiedName`` strings (those registered by class first)."""
    by_class = [f"{t.__module__}.{t.__qualname__}" for t in _BY_CLASS]
    return by_class + [f"{module}.{name}" for module, name in _BY_NAME]


def is_per_sample_unit(module: nn.Module) -> bool:
    """Whether ``module`` takes its per-sample gradients as one unit (see ``register_per_sample_unit``)."""
    for klass in type(module).__mro__:
        if klass in _BY_CLASS:
            when = _BY_CLASS[klass]
            return when is None or bool(when(module))
        key = (klass.__module__, klass.__qualname__)
        if key in _BY_NAME:
            when = _BY_NAME[key]
            return when is None or bool(when(module))
    return False
