"""Parameters owned directly by the wrapped model's root (issue 21, item 3): CLIP's ``logit_scale``.

They get per-sample gradients of their own (forward-mode tangents at the output, ``capture.root_parameters``)
instead of sending the whole model to the ``torch.func`` fallback; frozen parameters are owned by no
fallback. References: a float64 per-example loop (``conftest.per_example_reference``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ATOL, RTOL, assert_matches_reference, per_example_reference
from torch import nn

from privacy_engine import GhostClippingModule, GradSampleModule, PerSampleGradientClipper

BATCH = 6


class ScaledClassifier(nn.Module):
    """Two linear layers, then a learned temperature (0-dim) and a class bias owned by the root itself."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)
        self.logit_scale = nn.Parameter(torch.tensor(0.7))
        self.class_bias = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logit_scale.exp() * self.head(torch.tanh(self.hidden(x))) + self.class_bias


def make_model() -> ScaledClassifier:
    torch.manual_seed(0)
    return ScaledClassifier().double()


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 4, generator=generator, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=generator)


def loss_of(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, y)


def assert_ghost_matches(model: nn.Module, loss, reference: dict[str, torch.Tensor]) -> None:
    """Fast clipping's per-example norms and clipped sums against the per-example loop's (bound: the median
    norm, so some examples are clipped and some not)."""
    flat = torch.cat([g.reshape(g.shape[0], -1) for g in reference.values()], dim=1)
    norms = flat.norm(dim=1)
    bound = float(norms.median())
    clipper = PerSampleGradientClipper([p for p in model.parameters() if p.requires_grad], max_grad_norm=bound)
    wrapped = GhostClippingModule(model, clipper=clipper)
    loss(wrapped).backward()
    clipper.pre_step()
    torch.testing.assert_close(wrapped.last_per_sample_norms.flatten(), norms, rtol=RTOL, atol=ATOL)
    factors = (bound / norms).clamp(max=1.0)
    for name, param in model.named_parameters():
        expected = torch.einsum("b,b...->...", factors, reference[name])
        torch.testing.assert_close(param.grad, expected, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def test_root_parameters_get_their_own_exact_per_sample_gradients() -> None:
    x, y = make_batch()
    model = make_model()
    reference = per_example_reference(model, [x], lambda out, i: loss_of(out, y[i : i + 1]))
    wrapped = GradSampleModule(model)
    assert wrapped._tables.patched == []  # the layers keep their samplers: no whole-model fallback
    assert [name for name, _ in wrapped._tables.root_parameters] == ["logit_scale", "class_bias"]
    loss_of(wrapped(x), y).backward()  # the first backward also checks sum_i grad_sample[i] == grad
    assert model.logit_scale.grad_sample.shape == (BATCH,)
    assert_matches_reference(model, reference)


def test_root_parameters_in_ghost_mode_exact() -> None:
    x, y = make_batch()
    model = make_model()
    reference = per_example_reference(model, [x], lambda out, i: loss_of(out, y[i : i + 1]))
    assert_ghost_matches(model, lambda wrapped: loss_of(wrapped(x), y), reference)


def test_a_root_parameter_frozen_at_wrapping_and_unfrozen_later_is_exact() -> None:
    x, y = make_batch()
    model = make_model()
    reference = per_example_reference(model, [x], lambda out, i: loss_of(out, y[i : i + 1]))
    model.logit_scale.requires_grad_(False)
    wrapped = GradSampleModule(model)
    loss_of(wrapped(x), y).backward()
    assert getattr(model.logit_scale, "grad_sample", None) is None
    wrapped.zero_grad()
    model.logit_scale.requires_grad_(True)
    loss_of(wrapped(x), y).backward()
    torch.testing.assert_close(model.logit_scale.grad_sample, reference["logit_scale"], rtol=RTOL, atol=ATOL)


class FrozenContainer(nn.Module):
    """A submodule owning only a frozen parameter, with a trainable child."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x + self.offset)


def test_frozen_parameters_make_no_fallback_owner() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(FrozenContainer(), nn.Tanh(), nn.Linear(3, 3)).double()
    x, y = make_batch()
    reference = per_example_reference(model, [x], lambda out, i: loss_of(out, y[i : i + 1]))
    wrapped = GradSampleModule(model)
    assert wrapped._tables.patched == []  # the container's Linear keeps its sampler
    loss_of(wrapped(x), y).backward()
    assert_matches_reference(model, reference)
    model[0].offset.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"'0.offset' was frozen when the model was wrapped"):
        wrapped(x)


def test_an_output_depending_on_a_root_parameter_without_the_batch_is_refused() -> None:
    class WithPenalty(ScaledClassifier):
        def forward(self, x):
            return super().forward(x), self.logit_scale.square()  # no example axis

    torch.manual_seed(0)
    wrapped = GradSampleModule(WithPenalty().double())
    x, _ = make_batch()
    with pytest.raises(ValueError, match=r"root parameter\(s\) \['logit_scale'\].*small module"):
        wrapped(x)


# ------------------------------------------------------------------------------- Hugging Face CLIP
def _clip():
    transformers = pytest.importorskip("transformers")
    text = {"vocab_size": 50, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "max_position_embeddings": 8, "projection_dim": 8}  # fmt: skip
    vision = {"image_size": 8, "patch_size": 4, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "projection_dim": 8, "num_channels": 3}  # fmt: skip
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)
    torch.manual_seed(0)
    model = transformers.CLIPModel(config).double().train()
    generator = torch.Generator().manual_seed(1)
    batch = {
        "input_ids": torch.randint(1, 50, (4, 8), generator=generator),
        "pixel_values": torch.randn(4, 3, 8, 8, generator=generator, dtype=torch.float64),
    }
    return model, batch


def _matched_pair_loss(output) -> torch.Tensor:
    """Each example's own image-text similarity (the diagonal): a per-example loss, unlike CLIP's contrastive
    loss (a batch x batch coupling the engine refuses)."""
    return -output.logits_per_image.diagonal()


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_hf_clip_logit_scale_exact_without_a_whole_model_fallback(mode: str) -> None:
    model, batch = _clip()
    reference = per_example_reference(model, [batch["input_ids"]], lambda out, i: _matched_pair_loss(out).sum(),
                                      kwargs={"pixel_values": batch["pixel_values"]})  # fmt: skip
    assert "logit_scale" in reference
    if mode == "ghost":
        assert_ghost_matches(copy.deepcopy(model), lambda wrapped: _matched_pair_loss(wrapped(**batch)).mean(), reference)
        return
    wrapped = GradSampleModule(model)
    assert [name for name, _ in wrapped._tables.root_parameters] == ["logit_scale"]
    assert model not in wrapped._tables.patched
    _matched_pair_loss(wrapped(**batch)).mean().backward()
    assert_matches_reference(model, reference)
