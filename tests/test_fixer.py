"""fix_module and the Opacus-compatible ModuleValidator: what is replaced, what is carried over, what is
reported, and that fixing twice changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_matches_reference, per_example_reference
from torch import nn

from privacy_engine import GradSampleModule, ModuleValidator, fix_module
from privacy_engine.models.fixer import (
    IllegalModuleConfigurationError,
    ShouldReplaceModuleError,
    UnsupportableModuleError,
    UnsupportedModuleError,
    default_group_count,
    register_module_fixer,
    register_module_validator,
)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5), nn.BatchNorm1d(5), nn.Linear(5, 3),
    )  # fmt: skip
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model


@pytest.fixture
def restore_validator_tables():
    saved = dict(ModuleValidator.VALIDATORS), dict(ModuleValidator.FIXERS)
    yield
    ModuleValidator.VALIDATORS.clear()
    ModuleValidator.VALIDATORS.update(saved[0])
    ModuleValidator.FIXERS.clear()
    ModuleValidator.FIXERS.update(saved[1])


def test_batchnorm_becomes_groupnorm_with_affine_carried_over() -> None:
    model = _cnn()
    model[4].weight.requires_grad_(False)
    fixed, report = fix_module(model)
    for index, groups in ((1, 32), (4, 8), (9, 1)):
        old, new = model[index], fixed[index]
        assert type(new) is nn.GroupNorm and new.num_groups == groups and new.num_channels == old.num_features
        assert torch.equal(new.weight, old.weight) and torch.equal(new.bias, old.bias)
        assert new.weight.requires_grad == old.weight.requires_grad
        assert new.eps == old.eps
    assert len(report.changes) == 3 and all("GroupNorm" in change for change in report.changes)
    assert report.ok and report.problems == ()
    x = torch.randn(4, 3, 6, 6)
    hidden = fixed[0](x)
    expected = nn.functional.group_norm(hidden, 32, model[1].weight, model[1].bias, model[1].eps)
    torch.testing.assert_close(fixed[1](hidden), expected)


@pytest.mark.parametrize("channels,groups", [(1, 1), (3, 1), (16, 8), (32, 16), (64, 32), (96, 32), (100, 25)])
def test_batchnorm1d_group_count_keeps_two_channels_per_group(channels: int, groups: int) -> None:
    assert default_group_count(nn.BatchNorm1d(channels)) == groups


@pytest.mark.parametrize("channels,groups", [(3, 1), (16, 16), (64, 32), (96, 32), (100, 4)])
def test_batchnorm2d_group_count_is_gcd_with_32(channels: int, groups: int) -> None:
    assert default_group_count(nn.BatchNorm2d(channels)) == groups


def test_fix_is_idempotent_and_leaves_the_original_alone() -> None:
    model = _cnn()
    original = copy.deepcopy(model.state_dict())
    fixed, _ = fix_module(model)
    assert all(torch.equal(original[k], v) for k, v in model.state_dict().items())
    assert isinstance(model[1], nn.BatchNorm2d)
    again, report = fix_module(fixed)
    assert report.changes == () and report.ok
    assert [type(m) for m in again.modules()] == [type(m) for m in fixed.modules()]
    assert all(torch.equal(fixed.state_dict()[k], v) for k, v in again.state_dict().items())
    assert "0 change(s)" in str(report)


def test_inplace_fix_changes_the_model_itself() -> None:
    model = _cnn()
    fixed, _ = fix_module(model, inplace=True)
    assert fixed is model and isinstance(model[1], nn.GroupNorm)


def test_num_groups_option_and_a_bad_value_changes_nothing() -> None:
    model = _cnn()
    fixed, _ = fix_module(nn.Sequential(nn.BatchNorm2d(8)), num_groups=4)
    assert fixed[0].num_groups == 4
    with pytest.raises(ValueError, match=r"num_groups=4 does not divide the 5 channels of '9' \(BatchNorm1d\)"):
        fix_module(model, num_groups=4, inplace=True)
    assert isinstance(model[1], nn.BatchNorm2d)  # raised before anything changed
    with pytest.raises(ValueError, match="exclude each other"):
        fix_module(model, num_groups=1, replace_bn_with_in=True)


def test_replace_with_instance_norm() -> None:
    fixed, _ = fix_module(nn.Sequential(nn.BatchNorm2d(4)), replace_bn_with_in=True)
    assert type(fixed[0]) is nn.InstanceNorm2d and fixed[0].affine and not fixed[0].track_running_stats
    with pytest.raises(UnsupportableModuleError, match="SyncBatchNorm"):
        fix_module(nn.Sequential(nn.SyncBatchNorm(4)), replace_bn_with_in=True)


def test_shared_batchnorm_gets_one_replacement_at_every_path() -> None:
    shared = nn.BatchNorm1d(4)
    model = nn.Sequential(nn.Linear(4, 4), shared, nn.Linear(4, 4), shared)
    fixed, report = fix_module(model)
    assert fixed[1] is fixed[3] and isinstance(fixed[1], nn.GroupNorm)
    assert len(report.changes) == 1


def test_model_that_is_a_batchnorm() -> None:
    fixed, report = fix_module(nn.BatchNorm2d(6))
    assert isinstance(fixed, nn.GroupNorm) and len(report.changes) == 1


def test_configuration_fixes_and_remaining_problems_are_reported() -> None:
    model = nn.Sequential(
        nn.Embedding(10, 4, sparse=True, scale_grad_by_freq=True),
        nn.InstanceNorm1d(4, affine=True, track_running_stats=True),
        nn.Embedding(10, 4, max_norm=1.0),
        nn.EmbeddingBag(10, 4, mode="max"),
    )
    weight = model[0].weight
    fixed, report = fix_module(model, inplace=True)
    assert fixed[0].weight is weight and not fixed[0].sparse and not fixed[0].scale_grad_by_freq
    assert not fixed[1].track_running_stats and fixed[1].running_mean is None
    assert len(report.changes) == 2
    assert not report.ok and len(report.problems) == 2
    assert "'2' is Embedding(max_norm=1.0)" in report.problems[0]
    assert "'3' is EmbeddingBag(mode='max')" in report.problems[1]
    assert "problems left:" in str(report) and "'3'" in str(report)


def test_fixed_model_gives_exact_per_sample_gradients() -> None:
    fixed, _ = fix_module(_cnn().double())
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 0])
    reference = per_example_reference(fixed, [x], lambda out, i: nn.functional.cross_entropy(out, labels[i : i + 1]))
    wrapped = GradSampleModule(fixed)
    nn.functional.cross_entropy(wrapped(x), labels).backward()
    assert_matches_reference(fixed, reference)


def test_wrapped_model_is_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    wrapped = GradSampleModule(model)
    with pytest.raises(ValueError, match="fix the original model before wrapping"):
        fix_module(wrapped)
    with pytest.raises(ValueError, match="fix the original model before wrapping"):
        fix_module(model)


# ---------------------------------------------------------------------------------- ModuleValidator
def test_validate_lists_typed_errors_with_paths() -> None:
    model = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Embedding(3, 2, max_norm=1.0))
    errors = ModuleValidator.validate(model)
    assert [type(e) for e in errors] == [ShouldReplaceModuleError, UnsupportableModuleError]
    assert str(errors[0]).startswith("'1' is BatchNorm1d") and all(isinstance(e, UnsupportedModuleError) for e in errors)
    assert not ModuleValidator.is_valid(model)
    with pytest.raises(UnsupportedModuleError, match="cannot be trained privately") as raised:
        ModuleValidator.validate(model, strict=True)
    assert [type(e) for e in raised.value.errors] == [ShouldReplaceModuleError, UnsupportableModuleError]


def test_validate_flags_eval_mode_and_fix_makes_valid() -> None:
    model = _cnn().eval()
    errors = ModuleValidator.validate(model)
    assert any(isinstance(e, IllegalModuleConfigurationError) and "eval mode" in str(e) for e in errors)
    fixed = ModuleValidator.fix(model.train())
    assert ModuleValidator.is_valid(fixed)
    assert ModuleValidator.fix_and_validate(model) is not model
    with pytest.raises(UnsupportedModuleError):
        ModuleValidator.fix_and_validate(nn.Sequential(nn.Embedding(3, 2, max_norm=1.0)))


def test_registered_validator_and_fixer(restore_validator_tables) -> None:
    class Legacy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.weight

    @register_module_validator(Legacy)
    def validate_legacy(module):
        return [ShouldReplaceModuleError("Legacy layers are replaced by Linear")]

    @register_module_fixer([Legacy])
    def fix_legacy(module, **kwargs):
        return nn.Linear(3, 3)

    model = nn.Sequential(nn.Linear(3, 3), Legacy())
    errors = ModuleValidator.validate(model)
    assert len(errors) == 1 and str(errors[0]) == "'1': Legacy layers are replaced by Linear"
    fixed, report = fix_module(model)
    assert isinstance(fixed[1], nn.Linear)
    assert report.changes == ("'1': Legacy -> Linear (registered fixer)",)
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        register_module_fixer(int)


def test_opacus_names_resolve_to_the_fixer() -> None:
    validators = pytest.importorskip("privacy_engine.opacus.validators")
    assert validators.ModuleValidator is ModuleValidator
    assert validators.register_module_fixer is register_module_fixer
    assert validators.ShouldReplaceModuleError is ShouldReplaceModuleError


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_instancenorm_with_running_statistics_is_refused_while_training_and_fixed_by_the_fixer(mode) -> None:
    from privacy_engine import GhostClippingModule, GradSampleModule, PerSampleGradientClipper, UnsupportedModuleError

    wrapper = GhostClippingModule if mode == "ghost" else GradSampleModule
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.InstanceNorm1d(4, affine=True, track_running_stats=True))
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(UnsupportedModuleError, match=r"'1' is InstanceNorm1d\(track_running_stats=True\)"):
        wrapper(model)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert not any(hasattr(m, "_forward_hooks") and m._forward_hooks for m in model.modules())
    fixed, _ = fix_module(model)
    wrapped = wrapper(fixed)
    if mode == "ghost":
        wrapped.attach_clipper(PerSampleGradientClipper(list(fixed.parameters()), 1.0))
    wrapped(torch.randn(3, 2, 5)).square().sum().backward()
    model.eval()  # in eval mode the running statistics are only read: wrapping is allowed
    wrapper(model)
