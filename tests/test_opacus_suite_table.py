"""The Opacus-suite runner's pieces that need no Opacus run: the expectation file is well formed, the
README's table is exactly what it generates, and the import rewrite is the README's sed line."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("opacus_suite_run", ROOT / "tests" / "opacus_suite" / "run.py")
run = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = run  # dataclasses resolve their module by name
_spec.loader.exec_module(run)


def test_expectation_file_loads_with_a_known_class_and_a_reason_for_each_test():
    expectations = run.load_expectations()
    assert expectations
    for expectation in expectations.values():
        assert expectation.kind in run.CLASSES
        assert len(expectation.reason) > 20, expectation.test


@pytest.mark.parametrize("reason", ["", "missing", "  "])
def test_expectation_without_a_real_reason_is_refused(tmp_path, reason):
    path = tmp_path / "expected.toml"
    path.write_text(f'[tests]\n"a_test.py::T::t" = {{ class = "internal", reason = "{reason}" }}\n')
    with pytest.raises(ValueError, match="reason"):
        run.load_expectations(path)


def test_expectation_with_an_unknown_class_is_refused(tmp_path):
    path = tmp_path / "expected.toml"
    path.write_text('[tests]\n"a_test.py::T::t" = { class = "flaky", reason = "a reason long enough to count" }\n')
    with pytest.raises(ValueError, match="class"):
        run.load_expectations(path)


def test_readme_table_is_generated_from_the_expectation_file():
    block = run.readme_block((ROOT / "README.md").read_text())
    assert block is not None, "README.md lost the generated table's markers"
    assert block == run.render_readme_table(run.load_expectations()), (
        "README.md's table differs from tests/opacus_suite/expected_failures.toml: "
        "run python tests/opacus_suite/run.py --write-readme"
    )


def test_readme_table_counts_every_listed_test_once():
    expectations = run.load_expectations()
    rows = [line for line in run.render_readme_table(expectations).splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert sum(int(row.split(" | ")[2]) for row in rows) == len(expectations)


def test_import_rewrite_is_the_readmes_sed_line():
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"sed -i -E '/(.+?)/ s/(.+?)/(.+?)/' train\.py", readme)
    assert match, "README.md's sed line moved or changed"
    # GNU sed -E and Python's re read these three the same way (\s, \b, groups, alternation).
    line_filter, pattern, replacement = re.compile(match[1]), match[2], match[3]
    source = ("from opacus import PrivacyEngine\nimport opacus.layers as layers\n  from opacus.utils.x import (\n"
              "x = 'opacus is not renamed here'\n# import opacus in a comment stays\nfrom opacus_helpers import y\n")  # fmt: skip
    expected = "".join(re.sub(pattern, replacement, line) if line_filter.match(line) else line
                       for line in source.splitlines(keepends=True))  # fmt: skip
    assert run.rewrite_imports(source) == expected
    assert "from privacy_engine.opacus import PrivacyEngine" in expected and "'opacus is not renamed here'" in expected
    assert "from opacus_helpers import y" in expected


def test_compare_reports_new_failures_and_listed_tests_that_pass():
    expectation = run.Expectation(test="a.py::T::listed", kind="internal", reason="reads a private attribute of Opacus")
    outcomes = {"a.py::T::listed": "passed", "a.py::T::new": "failed", "a.py::T::fine": "passed", "b.py": "error"}
    differences = run.compare(outcomes, {expectation.test: expectation}, subset=False)
    assert sorted(line.split()[0] for line in differences) == ["NEW", "NEW", "NOW"]
    assert any("a.py::T::listed" in line and "NOW PASSES" in line for line in differences)
    assert any("a.py::T::new" in line for line in differences) and any("b.py" in line for line in differences)
    assert run.compare({"a.py::T::listed": "failed"}, {expectation.test: expectation}, subset=False) == []
    assert run.compare({}, {expectation.test: expectation}, subset=True) == []
    assert run.compare({}, {expectation.test: expectation}, subset=False)[0].startswith("NOT RUN")


def test_compare_reports_a_listed_file_that_now_imports():
    expectation = run.Expectation(test="c.py", kind="internal", reason="imports an internal module of Opacus")
    differences = run.compare({"c.py::T::t": "passed"}, {"c.py": expectation}, subset=False)
    assert len(differences) == 1 and differences[0].startswith("NOW IMPORTS")
