"""Opacus's public API on this engine: an Opacus script migrates by renaming its imports,

    sed -i -E '/^\\s*(from|import)\\s/ s/\\bopacus\\b/privacy_engine.opacus/' train.py

The module paths are Opacus's (``privacy_engine.opacus.layers``, ``.validators``, ``.optimizers``,
``.accountants``, ``.data_loader``, ``.distributed``, ``.grad_sample``, ``.utils.batch_memory_manager``,
...); every name is built on this engine's own classes. Where behaviour differs from Opacus (the
sample rate, the accountants, state-dict keys), README.md's migration table says how.
"""

from privacy_engine.opacus import utils
from privacy_engine.opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
from privacy_engine.opacus.privacy_engine import PrivacyEngine

#: The Opacus release whose public API this namespace mirrors.
__version__ = "1.6.0"

__all__ = ["GradSampleModule", "GradSampleModuleFastGradientClipping", "PrivacyEngine", "__version__", "utils"]
