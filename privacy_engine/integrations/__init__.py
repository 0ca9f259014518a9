"""Training frameworks driven with private training: each integration installs the private loader,
optimizer and accountant the framework would otherwise build itself (``hf_trainer``: Hugging Face
``Trainer``; ``lightning``: PyTorch Lightning's ``DPStrategy``; ``hf_losses``: per-example losses for
Hugging Face models called with ``labels=`` through a wrapper). Integrations import their framework only when used."""
