"""Refusals name the real reason and the way out (issue 21, item 9)."""

from __future__ import annotations

import pytest
from torch import nn

from privacy_engine import GradSampleModule, fix_module
from privacy_engine.models.validation import UnsupportedModuleError


def test_batchnorm_refusal_names_fix_module_which_does_the_replacement() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    with pytest.raises(UnsupportedModuleError, match=r"privacy_engine\.fix_module\(model\)") as refused:
        GradSampleModule(model)
    assert "GroupNorm" in str(refused.value)
    fixed, _ = fix_module(model)  # ... and it does what the message says
    GradSampleModule(fixed)


def test_embedding_max_norm_refusal_says_the_weights_are_rewritten_without_noise() -> None:
    with pytest.raises(UnsupportedModuleError, match=r"(?s)max_norm=1\.0.*in place.*private examples.*no noise") as refused:
        GradSampleModule(nn.Sequential(nn.Embedding(10, 4, max_norm=1.0)))
    assert "max_norm=None" in str(refused.value)
