"""``privacy_engine.accountants`` and ``privacy_engine.grad_samplers`` are the top-level packages
``accountants`` and ``grad_samplers`` under the package's name: the same module objects, submodules
included, so classes, ``isinstance`` and the grad-sampler registry are shared between old and new code."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import accountants
import grad_samplers
import privacy_engine

ROOT = Path(__file__).resolve().parents[1]


def _submodule_names(package) -> list[str]:
    return sorted(info.name for info in pkgutil.iter_modules(package.__path__))


@pytest.mark.parametrize("package", [accountants, grad_samplers], ids=lambda p: p.__name__)
def test_the_namespaced_package_is_the_top_level_package(package):
    namespaced = importlib.import_module(f"privacy_engine.{package.__name__}")
    assert namespaced is package
    assert getattr(privacy_engine, package.__name__) is package  # reachable as an attribute too
    assert package.__spec__.name == package.__name__  # the alias did not rewrite where it lives


@pytest.mark.parametrize("package", [accountants, grad_samplers], ids=lambda p: p.__name__)
def test_every_submodule_is_the_same_object_under_both_names(package):
    names = _submodule_names(package)
    assert len(names) >= 5  # the walk found the package's files
    for name in names:
        namespaced = importlib.import_module(f"privacy_engine.{package.__name__}.{name}")
        assert namespaced is importlib.import_module(f"{package.__name__}.{name}"), name


def test_classes_and_isinstance_are_shared():
    from privacy_engine.accountants import Accountant, RDPAccountant, make_accountant

    assert RDPAccountant is accountants.RDPAccountant and Accountant is accountants.base.Accountant
    made = accountants.make_accountant("rdp")
    assert isinstance(made, RDPAccountant) and isinstance(make_accountant("pld"), Accountant)


def test_a_sampler_registered_through_one_name_is_found_through_the_other(restore_sampler_registry):
    from privacy_engine.grad_samplers import grad_sampler_for, register_grad_sampler

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    @register_grad_sampler(Scale)
    def scale_grad_sample(layer, activations, backprops):
        return {layer.weight: activations[0] * backprops}

    assert grad_samplers.grad_sampler_for(Scale()) is scale_grad_sample
    assert grad_sampler_for(Scale()) is scale_grad_sample


def test_a_missing_submodule_is_named_by_the_path_asked_for():
    with pytest.raises(ModuleNotFoundError, match=r"privacy_engine\.accountants\.no_such_module"):
        importlib.import_module("privacy_engine.accountants.no_such_module")


@pytest.mark.slow  # a fresh interpreter importing torch and the package: seconds on 2 cores
def test_importing_the_namespaced_path_first_gives_one_module_object():
    """In a fresh process, ``privacy_engine.grad_samplers.linear`` imported before anything else is the
    module ``grad_samplers.linear`` (run once, under its own name), not a second copy of the file."""
    script = (
        "import sys\n"
        "import privacy_engine.grad_samplers.linear as namespaced\n"
        "import grad_samplers.linear as plain\n"
        "assert namespaced is plain, 'two module objects'\n"
        "assert sys.modules['privacy_engine.grad_samplers.linear'] is plain\n"
        "assert plain.__name__ == 'grad_samplers.linear' and plain.__spec__.name == 'grad_samplers.linear'\n"
        "copies = [name for name, module in sys.modules.items() if getattr(module, '__file__', None) == plain.__file__]\n"
        "print(sorted(copies))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(["grad_samplers.linear", "privacy_engine.grad_samplers.linear"])
