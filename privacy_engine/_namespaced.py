"""``privacy_engine.accountants`` and ``privacy_engine.grad_samplers``: the repository's top-level
packages ``accountants`` and ``grad_samplers`` under the package's own name.

Both names give the *same* module objects (``privacy_engine.accountants is accountants``, and so for
every submodule: ``privacy_engine.grad_samplers.registry is grad_samplers.registry``), so classes,
``isinstance`` checks and the grad-sampler registry are shared whichever path a script imports.
``import accountants`` keeps working for old code; new code can use the namespaced path, which
cannot clash with a user's own module named ``accountants``.

How: a finder at the front of ``sys.meta_path`` answers only for ``privacy_engine.accountants[.*]``
and ``privacy_engine.grad_samplers[.*]``, imports the module under its real name and hands that
object back. Nothing is executed twice and nothing is copied. Static type checkers read the stubs
``privacy_engine/accountants.pyi`` and ``privacy_engine/grad_samplers.pyi`` (which re-export the
packages' public names) instead.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["ALIASED_PACKAGES", "install"]

#: The top-level packages that ``privacy_engine.<name>`` also reaches.
ALIASED_PACKAGES = ("accountants", "grad_samplers")
_PREFIX = "privacy_engine."


class _AliasLoader(importlib.abc.Loader):
    """Hands back the module ``real_name`` (imported under that name) for its alias."""

    def __init__(self, real_name: str) -> None:
        self.real_name = real_name
        self._real_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.real_name)
        self._real_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The module already ran under its real name; the import system has just set its __spec__
        # to the alias's spec (module_from_spec does so unconditionally): put the real one back, so
        # that importlib.reload and tools reading __spec__ see where the module really lives.
        module.__spec__ = self._real_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``privacy_engine.<package>[.<submodule>]`` for the packages in ``ALIASED_PACKAGES``."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:  # fmt: skip
        if not fullname.startswith(_PREFIX):
            return None
        real_name = fullname[len(_PREFIX):]
        if real_name.split(".", 1)[0] not in ALIASED_PACKAGES or importlib.util.find_spec(real_name) is None:
            return None  # a missing submodule: ModuleNotFoundError names the path the script asked for
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real_name))


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (once per process; a second call does nothing)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
