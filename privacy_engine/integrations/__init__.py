"""Training frameworks driven with private training: each integration installs the private loader,
optimizer and accountant the framework would otherwise build itself (``hf_trainer``: Hugging Face
``Trainer``). Integrations import their framework only when used."""
