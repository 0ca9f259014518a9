"""The import layering of the packages (``scripts/check_layering.py``): no upward import, no import
cycle, no deferred first-party import; and the checker itself finds each kind of violation."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_layering.py"

_spec = importlib.util.spec_from_file_location("check_layering", SCRIPT)
check_layering = importlib.util.module_from_spec(_spec)
sys.modules["check_layering"] = check_layering  # dataclasses look their module up by name
_spec.loader.exec_module(check_layering)


def _violations() -> dict[str, str]:
    return {violation.key: violation.text for violation in check_layering.find_violations()}


def test_no_layering_violation():
    violations = _violations()
    assert not violations, "\n".join(violations.values())


def test_the_script_exits_1_listing_each_violation_and_0_when_clean():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=False)
    texts = list(_violations().values())
    assert result.returncode == (1 if texts else 0), result.stdout + result.stderr
    assert all(text in result.stdout for text in texts)


def test_a_module_the_table_does_not_place_is_reported(tmp_path):
    layers = (("low", ("privacy_engine.low",)), ("top", ("privacy_engine",)))
    root = _tree(tmp_path, {"privacy_engine/__init__.py": "", "privacy_engine/low.py": "", "privacy_engine/new.py": ""})
    violations = check_layering.find_violations(root, packages=("privacy_engine",), layers=layers, allowed_deferred={})
    assert [violation.key for violation in violations] == ["unplaced module privacy_engine.new"]


# The checker against a small tree written for each case: a check that can fail.
LAYERS = (("low", ("pkg.low",)), ("high", ("pkg.high",)), ("top", ("pkg",)))


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in {"pkg/__init__.py": "", **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def _found(root: Path, allowed: dict | None = None) -> list[str]:
    violations = check_layering.find_violations(root, packages=("pkg",), layers=LAYERS, allowed_deferred=allowed or {})
    return [violation.key for violation in violations]


def test_an_upward_import_is_reported_and_a_downward_one_is_not(tmp_path):
    root = _tree(tmp_path, {"pkg/low.py": "from pkg import high\n", "pkg/high.py": "import os\n"})
    assert _found(root) == ["upward import pkg.low -> pkg.high"]
    root = _tree(tmp_path, {"pkg/low.py": "import os\n", "pkg/high.py": "from pkg.low import x\n"})
    assert _found(root) == []


def test_a_cycle_in_one_layer_is_reported(tmp_path):
    root = _tree(tmp_path, {"pkg/low/__init__.py": "", "pkg/low/a.py": "from . import b\n", "pkg/low/b.py": "import pkg.low.a\n"})
    assert _found(root) == ["cycle pkg.low.a, pkg.low.b"]


def test_a_deferred_first_party_import_is_reported_and_hides_no_cycle(tmp_path):
    files = {
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "from pkg.low import b\n",
        "pkg/low/b.py": "def f():\n    from pkg.low import a\n    import numpy\n",
    }
    assert _found(_tree(tmp_path, files)) == ["cycle pkg.low.a, pkg.low.b", "deferred import pkg.low.b -> pkg.low.a"]
    allowed = {("pkg.low.b", "pkg.low.a"): "a reason"}
    assert _found(_tree(tmp_path, files), allowed) == []


def test_imports_under_type_checking_are_layered_but_make_no_cycle(tmp_path):
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import X\n"
    root = _tree(tmp_path, {"pkg/low.py": guarded, "pkg/high.py": "from pkg.low import Y\n"})
    assert _found(root) == ["upward import pkg.low -> pkg.high"]
