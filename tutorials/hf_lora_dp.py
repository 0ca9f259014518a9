"""LoRA fine-tuning of a small Hugging Face BERT under differential privacy, on text Python itself ships.

    python tutorials/hf_lora_dp.py                 # epsilon = 8, delta = 1e-5
    python tutorials/hf_lora_dp.py --epsilon 3

The task: is a line of the Python standard library a docstring line, a comment, or code? The lines are
read from the installed standard library (``inspect.getsource`` / ``inspect.getdoc``): nothing is downloaded.
The modules are split in two halves:

1. public half: stands in for the public data a pretrained model was trained on. A small BERT built from
   its config (2 layers, hidden size 64, no pretrained weights) is trained on it without privacy, for the
   coarser task "prose (docstring or comment) or code?".
2. private half: the data to protect. The pretrained BERT gets LoRA adapters (rank 8, on the attention's
   query/value and the dense layers) and a new 3-way classifier head; only those are trained, with DP-SGD
   (Poisson sampling, per-example clipping, Gaussian noise calibrated to the target epsilon over the
   whole run, PLD accounting). The model is called as Hugging Face documents,
   ``model(input_ids=..., attention_mask=..., labels=...)``.

It prints epsilon as training goes and the private test accuracy before and after. Words are hashed into
a fixed vocabulary (``zlib.crc32``), so no tokenizer file is needed either. About 15 s on 2 CPU cores (12-15 s measured, load about 1).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import random
import re
import time
import zlib

import torch
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import PrivacyEngine

try:
    import peft
    import transformers
except ImportError as error:  # pragma: no cover - a message instead of a traceback
    raise SystemExit(f"this tutorial needs transformers and peft ({error}); pip install -r requirements-test.txt") from error

PUBLIC_MODULES = (
    "argparse", "asyncio.base_events", "collections", "csv", "datetime", "decimal", "email.message",
    "fractions", "functools", "http.client", "inspect", "json.decoder", "logging", "pathlib", "pickle",
    "shutil", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading",
)  # fmt: skip
PRIVATE_MODULES = (
    "typing", "unittest.case", "urllib.parse", "zipfile", "calendar", "configparser", "difflib", "ftplib",
    "tokenize", "ast", "dataclasses", "enum", "heapq", "imaplib", "mailbox", "optparse", "pdb", "pprint",
    "smtplib", "socket", "traceback", "uuid",
)  # fmt: skip
CLASSES = ("docstring", "comment", "code")
VOCAB, SEQ_LEN = 2048, 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilon", type=float, default=8.0, help="target epsilon of the private fine-tuning")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=4, help="epochs of private fine-tuning")
    parser.add_argument("--batch-size", type=int, default=256, help="expected (Poisson) batch size")
    parser.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate of the private fine-tuning")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-example clipping bound")
    parser.add_argument("--per-class", type=int, default=1200, help="lines per class and half (at most)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


# ---------------------------------------------------------------------------------- data
def standard_library_lines(module_names) -> dict[str, set[str]]:
    """Docstring lines, comment texts ('#' removed) and code lines of these standard-library modules."""
    lines: dict[str, set[str]] = {name: set() for name in CLASSES}
    for module_name in module_names:
        module = importlib.import_module(module_name)
        documented = [module] + [
            member for _, member in inspect.getmembers(module)
            if (inspect.isfunction(member) or inspect.isclass(member)) and member.__module__ == module.__name__
        ]  # fmt: skip
        docstring_lines = set()
        for member in documented:
            for line in (inspect.getdoc(member) or "").splitlines():
                text = line.strip()
                docstring_lines.add(text)
                if len(text.split()) >= 5 and not text.startswith((">>>", "...")):
                    lines["docstring"].add(text)
        for line in inspect.getsource(module).splitlines():
            text = line.strip()
            if text.startswith("#"):
                comment = text.lstrip("#").strip()
                if len(comment.split()) >= 5:
                    lines["comment"].add(comment)
            elif (
                len(text.split()) >= 3
                and text not in docstring_lines
                and not text.startswith(('"', "'"))
                and re.search(r"[=():\[\]]", text)
            ):
                lines["code"].add(text)
    return lines


def encode(text: str) -> tuple[list[int], list[int]]:
    """Lower-cased words and punctuation, hashed into VOCAB ids (0 = padding, 1 = start)."""
    tokens = re.findall(r"\w+|[^\w\s]", text.lower())[: SEQ_LEN - 1]
    ids = [1] + [2 + zlib.crc32(token.encode()) % (VOCAB - 2) for token in tokens]
    padding = SEQ_LEN - len(ids)
    return ids + [0] * padding, [1] * len(ids) + [0] * padding


def dataset(module_names, per_class: int, rng: random.Random, labels_of=lambda c: c) -> TensorDataset:
    lines = standard_library_lines(module_names)
    examples = [
        (text, labels_of(label))
        for label, name in enumerate(CLASSES)
        for text in rng.sample(sorted(lines[name]), min(per_class, len(lines[name])))
    ]
    rng.shuffle(examples)
    encoded = [encode(text) for text, _ in examples]
    return TensorDataset(
        torch.tensor([ids for ids, _ in encoded]),
        torch.tensor([mask for _, mask in encoded]),
        torch.tensor([label for _, label in examples]),
    )


def split(data: TensorDataset, test_fraction: float = 0.2) -> tuple[TensorDataset, TensorDataset]:
    count = int(len(data) * test_fraction)
    return TensorDataset(*(t[count:] for t in data.tensors)), TensorDataset(*(t[:count] for t in data.tensors))


@torch.no_grad()
def accuracy(model, data: TensorDataset) -> float:
    model.eval()
    ids, mask, labels = data.tensors
    predictions = model(input_ids=ids, attention_mask=mask).logits.argmax(dim=-1)
    model.train()
    return float((predictions == labels).float().mean())


# ---------------------------------------------------------------------------------- the two stages
def pretrain_on_public_data(public: TensorDataset, seed: int):
    """Stage 1 (no privacy: public data). Stands in for downloading a pretrained model."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=SEQ_LEN, num_labels=2, pad_token_id=0,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = DataLoader(public, batch_size=128, shuffle=True)
    for _ in range(2):
        for ids, mask, labels in loader:
            optimizer.zero_grad()
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            optimizer.step()
    return model


def private_lora_fine_tuning(pretrained, private_train: TensorDataset, private_test: TensorDataset, args):
    """Stage 2: LoRA adapters and a new 3-way head, trained with DP-SGD on the private data."""
    # A new head for the 3 classes (the pretrained one had 2); peft trains it with the adapters.
    pretrained.classifier = torch.nn.Linear(pretrained.config.hidden_size, len(CLASSES))
    pretrained.config.num_labels = pretrained.num_labels = len(CLASSES)
    lora = peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["query", "value", "dense"], modules_to_save=["classifier"],
    )  # fmt: skip
    model = peft.get_peft_model(pretrained, lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    print(
        f"private fine-tuning: {sum(p.numel() for p in trainable):,} trainable parameters (LoRA + head) "
        f"of {sum(p.numel() for p in model.parameters()):,}"
    )
    print(f"private test accuracy before fine-tuning (new head): {accuracy(model, private_test):.1%}")

    engine = PrivacyEngine(accountant="pld")
    optimizer = torch.optim.Adam(trainable, lr=args.lr)
    private_model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=DataLoader(private_train, batch_size=args.batch_size),
        target_epsilon=args.epsilon, target_delta=args.delta, epochs=args.epochs, max_grad_norm=args.max_grad_norm,
    )  # fmt: skip
    print(f"noise multiplier {optimizer.noise_multiplier:.3f} for epsilon {args.epsilon} over {args.epochs} epochs")
    for epoch in range(args.epochs):
        for ids, mask, labels in loader:
            optimizer.zero_grad()
            if len(ids):  # an empty Poisson batch still takes its (noise-only) step
                private_model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            optimizer.step()
        epsilon = engine.get_epsilon(args.delta)
        print(f"epoch {epoch + 1}: private test accuracy {accuracy(model, private_test):.1%}, epsilon {epsilon:.2f}")
    return model, engine


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    start = time.time()
    rng = random.Random(args.seed)
    prose_or_code = {0: 0, 1: 0, 2: 1}  # docstring and comment are both prose in the public task
    public = dataset(PUBLIC_MODULES, args.per_class, rng, labels_of=prose_or_code.__getitem__)
    private_train, private_test = split(dataset(PRIVATE_MODULES, args.per_class, rng))
    print(f"public lines: {len(public)}; private lines: {len(private_train)} train, {len(private_test)} test")

    pretrained = pretrain_on_public_data(public, args.seed)
    print(f"pretrained on the public half ({time.time() - start:.0f} s so far)")
    _, engine = private_lora_fine_tuning(pretrained, private_train, private_test, args)
    print(f"final: epsilon {engine.get_epsilon(args.delta):.2f} at delta {args.delta} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
