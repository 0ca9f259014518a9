"""Which Hugging Face model families run, and are exact, in hooks and ghost mode: a table for the README.

Each family is built from a tiny config (no download), in float64, dropout off, and called as its
documentation calls it with ``labels=`` (HF computes the loss). The reference is the per-example loop: each
example alone through a copy of the model, its gradient from the loss HF computes on that batch of one.

- hooks: ``GradSampleModule``; error = max over parameters of ``||grad_sample - reference||`` divided by the
  norm of the whole per-example reference (so parameters whose exact gradient is 0, like a key bias before a
  softmax, do not blow up a relative error made of rounding);
- ghost: ``GhostClippingModule`` with the clipping bound at the median per-example norm; error = the larger of
  the per-example norms' relative error and the clipped sum's (relative to the clipped sum's norm).

"exact" means error <= 1e-6 (float64 rounding is ~1e-15). A family that raises prints the error's first words.
DeBERTa's errors (~4e-8) are the model's own: its logits for an example alone differ from those in a batch by
that much (float32 position buckets and scale), while the engine matches the batched model to ~1e-16.

    python benchmarks/hf_model_families.py [--only bert,t5] [--batch 4]

Prints a markdown table; takes one to a few minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from privacy_engine import GhostClippingModule, GradSampleModule, PerSampleGradientClipper, fix_module

VOCAB, SEQ, LABELS = 64, 8, 3
EXACT = 1e-6


def families(transformers):
    """name -> (builder, kind): kind is "classification", "causal_lm", "seq2seq" or "image"."""
    t = transformers
    small = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32}
    no_dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    decoder = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 1, "max_position_embeddings": 32, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}  # fmt: skip
    return {
        "BERT": (lambda: t.BertForSequenceClassification(t.BertConfig(vocab_size=VOCAB, num_labels=LABELS, max_position_embeddings=32, **small, **no_dropout)), "classification"),
        "RoBERTa": (lambda: t.RobertaForSequenceClassification(t.RobertaConfig(vocab_size=VOCAB, num_labels=LABELS, max_position_embeddings=40, pad_token_id=1, **small, **no_dropout)), "classification"),
        "DistilBERT": (lambda: t.DistilBertForSequenceClassification(t.DistilBertConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, hidden_dim=32, num_labels=LABELS, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, max_position_embeddings=32)), "classification"),
        "ALBERT": (lambda: t.AlbertForSequenceClassification(t.AlbertConfig(vocab_size=VOCAB, embedding_size=8, num_labels=LABELS, max_position_embeddings=32, classifier_dropout_prob=0.0, **small, **no_dropout)), "classification"),
        "ELECTRA": (lambda: t.ElectraForSequenceClassification(t.ElectraConfig(vocab_size=VOCAB, embedding_size=8, num_labels=LABELS, max_position_embeddings=32, **small, **no_dropout)), "classification"),
        "GPT-2": (lambda: t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)), "causal_lm"),
        "OPT": (lambda: t.OPTForCausalLM(t.OPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0)), "causal_lm"),
        "Llama": (lambda: t.LlamaForCausalLM(t.LlamaConfig(**decoder)), "causal_lm"),
        "Mistral": (lambda: t.MistralForCausalLM(t.MistralConfig(**decoder)), "causal_lm"),
        "Qwen2": (lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**decoder)), "causal_lm"),
        "GPT-NeoX": (lambda: t.GPTNeoXForCausalLM(t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)), "causal_lm"),
        "Bloom": (lambda: t.BloomForCausalLM(t.BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=2, n_head=2, hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)), "causal_lm"),
        "Falcon": (lambda: t.FalconForCausalLM(t.FalconConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)), "causal_lm"),
        "Phi": (lambda: t.PhiForCausalLM(t.PhiConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=32, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)), "causal_lm"),
        "Gemma": (lambda: t.GemmaForCausalLM(t.GemmaConfig(head_dim=8, **decoder)), "causal_lm"),
        "DeBERTa-v2": (lambda: t.DebertaV2ForSequenceClassification(t.DebertaV2Config(vocab_size=VOCAB, num_labels=LABELS, max_position_embeddings=32, relative_attention=True, position_buckets=8, max_relative_positions=16, pos_att_type=["p2c", "c2p"], pooler_dropout=0.0, **small, **no_dropout)), "classification"),
        "T5": (lambda: t.T5ForConditionalGeneration(t.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)), "seq2seq"),
        "MT5": (lambda: t.MT5ForConditionalGeneration(t.MT5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)), "seq2seq"),
        "UMT5": (lambda: t.UMT5ForConditionalGeneration(t.UMT5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)), "seq2seq"),
        "BART": (lambda: t.BartForConditionalGeneration(t.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)), "seq2seq"),
        "ViT": (lambda: t.ViTForImageClassification(t.ViTConfig(image_size=16, patch_size=4, num_channels=3, num_labels=LABELS, **small, **no_dropout)), "image"),
        "DeiT": (lambda: t.DeiTForImageClassification(t.DeiTConfig(image_size=16, patch_size=4, num_channels=3, num_labels=LABELS, **small, **no_dropout)), "image"),
        "Swin": (lambda: t.SwinForImageClassification(t.SwinConfig(image_size=16, patch_size=2, num_channels=3, embed_dim=8, depths=[2, 1], num_heads=[1, 2], window_size=2, num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)), "image"),
        "Swinv2": (lambda: t.Swinv2ForImageClassification(t.Swinv2Config(image_size=16, patch_size=2, num_channels=3, embed_dim=8, depths=[2, 1], num_heads=[1, 2], window_size=2, num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)), "image"),
        "DeBERTa": (lambda: t.DebertaForSequenceClassification(t.DebertaConfig(vocab_size=VOCAB, num_labels=LABELS, max_position_embeddings=32, relative_attention=True, max_relative_positions=16, pos_att_type=["p2c", "c2p"], pooler_dropout=0.0, **small, **no_dropout)), "classification"),
        "BEiT": (lambda: t.BeitForImageClassification(t.BeitConfig(image_size=16, patch_size=4, num_channels=3, num_labels=LABELS, use_relative_position_bias=True, use_mean_pooling=True, drop_path_rate=0.0, **small, **no_dropout)), "image"),
        "ResNet (BatchNorm)": (lambda: t.ResNetForImageClassification(t.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=LABELS)), "image"),
        "ResNet (after fix_module)": (lambda: fix_module(t.ResNetForImageClassification(t.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=LABELS)))[0], "image"),
        "ConvNeXt": (lambda: t.ConvNextForImageClassification(t.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=LABELS, image_size=16, drop_path_rate=0.0)), "image"),
        "CLIP (vision)": (lambda: t.CLIPVisionModelWithProjection(t.CLIPVisionConfig(image_size=16, patch_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, projection_dim=8)), "image_embedding"),
    }  # fmt: skip


def make_batch(kind: str, batch: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    if kind in ("image", "image_embedding"):
        inputs = {"pixel_values": torch.randn(batch, 3, 16, 16, dtype=torch.float64, generator=generator)}
        if kind == "image":
            inputs["labels"] = torch.arange(batch) % LABELS
        return inputs
    ids = torch.randint(3, VOCAB, (batch, SEQ), generator=generator)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    mask[-1, SEQ - 2 :] = 0  # one padded example
    if kind == "classification":
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(batch) % LABELS}
    if kind == "causal_lm":
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(3, VOCAB, (batch, SEQ - 3), generator=generator)}


def loss_of(output) -> torch.Tensor:
    if getattr(output, "loss", None) is not None:
        return output.loss
    return output.image_embeds.square().sum(-1).mean()  # an embedding model: a per-example loss of our own


def reference_gradients(model, inputs) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(model)
    batch = next(iter(inputs.values())).shape[0]
    trainable = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    stacks = {n: [] for n, _ in trainable}
    for index in range(batch):
        reference.zero_grad(set_to_none=True)
        loss_of(reference(**{k: v[index : index + 1] for k, v in inputs.items()})).backward()
        for name, param in trainable:
            stacks[name].append(torch.zeros_like(param) if param.grad is None else param.grad.detach().clone())
    return {name: torch.stack(grads) for name, grads in stacks.items()}


def hooks_error(model, inputs, reference) -> float:
    model = copy.deepcopy(model)
    wrapped = GradSampleModule(model)
    loss_of(wrapped(**inputs)).backward()
    total = torch.cat([g.flatten(1) for g in reference.values()], dim=1).norm()
    worst = 0.0
    for name, param in model.named_parameters():
        if name in reference:
            worst = max(worst, float((param.grad_sample - reference[name]).norm() / total))
    return worst


def ghost_error(model, inputs, reference) -> float:
    model = copy.deepcopy(model)
    norms = torch.cat([g.flatten(1) for g in reference.values()], dim=1).norm(dim=1)
    bound = float(norms.median())
    clipper = PerSampleGradientClipper([p for p in model.parameters() if p.requires_grad], max_grad_norm=bound)
    wrapped = GhostClippingModule(model, clipper=clipper)
    loss_of(wrapped(**inputs)).backward()
    norm_error = float(((wrapped.last_per_sample_norms.flatten() - norms).abs() / norms).max())
    clipper.pre_step()
    factors = (bound / norms).clamp(max=1.0)
    expected = {n: torch.einsum("b,b...->...", factors, g) for n, g in reference.items()}
    scale = torch.cat([e.flatten() for e in expected.values()]).norm()
    sum_error = max(float((p.grad - expected[n]).norm() / scale) for n, p in model.named_parameters() if n in expected)
    return max(norm_error, sum_error)


def attempt(function, *args) -> tuple[str, float | None]:
    try:
        error = function(*args)
    except Exception as problem:  # noqa: BLE001  (the table reports it)
        words = " ".join(str(problem).split())
        return f"{type(problem).__name__}: {words[:90]}", None
    return ("exact" if error <= EXACT else "NOT EXACT"), error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated family names (default: all)")
    parser.add_argument("--batch", type=int, default=4)
    options = parser.parse_args()
    import transformers  # optional: only this script needs it

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    chosen = {name.strip().lower() for name in options.only.split(",") if name.strip()}
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, batch {options.batch}, float64\n")
    print("| family | hooks | ghost | max error (hooks / ghost) | seconds |")
    print("|---|---|---|---|---|")
    for name, (build, kind) in families(transformers).items():
        if chosen and name.lower() not in chosen:
            continue
        started = time.perf_counter()
        torch.manual_seed(0)
        try:
            model = build().double().train()
            inputs = make_batch(kind, options.batch, torch.Generator().manual_seed(1))
            reference = reference_gradients(model, inputs)
        except Exception as problem:  # noqa: BLE001
            print(f"| {name} | (could not build: {type(problem).__name__}: {str(problem)[:60]}) | | | |")
            continue
        hooks, hooks_value = attempt(hooks_error, model, inputs, reference)
        ghost, ghost_value = attempt(ghost_error, model, inputs, reference)
        values = " / ".join("-" if v is None else f"{v:.1e}" for v in (hooks_value, ghost_value))
        print(f"| {name} | {hooks} | {ghost} | {values} | {time.perf_counter() - started:.1f} |", flush=True)


if __name__ == "__main__":
    main()
