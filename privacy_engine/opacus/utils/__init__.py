"""``opacus.utils``: the loader, sampler and per-sample-gradient helpers Opacus scripts import."""
