"""Run Opacus 1.6's own test suite against this engine, with only its imports renamed.

Usage (from the repository root, Opacus 1.6 installed: it is in ``requirements-test.txt``)::

    python tests/opacus_suite/run.py                 # run, compare, exit 1 on any difference
    python tests/opacus_suite/run.py --keep /tmp/s   # also keep the rewritten copy there
    python tests/opacus_suite/run.py -k linear       # a subset (comparison limited to what ran)

Other arguments go to pytest (``--tb=short -rfE`` shows why each test fails).

What it does:

1. copies the installed wheel's ``opacus/tests`` folder into a temporary folder, as the package
   ``opacus_suite_copy`` (the suite imports its own helpers relatively: ``from .utils import ...``);
2. rewrites only the import lines, with the README's migration rule (the same regular expression as
   its ``sed`` line: on a line that starts with ``from`` or ``import``, the word ``opacus`` becomes
   ``privacy_engine.opacus``); nothing else in the tests changes;
3. runs them with pytest in a fresh process under a reduced Hypothesis profile (stated here, as the
   issue asks): ``max_examples=HYPOTHESIS_EXAMPLES`` per property test (Opacus runs 100),
   ``derandomize=True`` (the same examples every run, so the comparison is stable), no shrinking of a
   failing example and no example database (a failure is compared, not minimised: shrinking one
   calibration test took 5 minutes), no deadline and no health checks (the machine is shared, and
   timing says nothing about correctness);
4. compares each test's outcome with ``expected_failures.toml`` next to this file, which lists every
   test that may fail here, each with its class (``CLASSES``) and a one-line reason.

The exit status is 1 when a test not on the list fails (or a file not on the list does not import),
or when a listed test passes (the list must shrink when a gap closes); both are printed. Skipped tests
(CUDA, several GPUs) are counted but not compared. The copied suite lives in a temporary folder, so
``python -m pytest tests`` never collects it, and this file's name does not match pytest's patterns.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tomllib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EXPECTED_FILE = HERE / "expected_failures.toml"
#: torchvision and Pillow for the suite only (five of its files import torchvision), installed apart from the
#: virtual environment so that nothing else (transformers looks for torchvision) sees a torchvision whose
#: extension does not load: ``pip install --no-deps --target .venv/opacus-suite-site -r
#: tests/opacus_suite/requirements.txt`` (``.ci/run`` does it).
EXTRA_SITE = ROOT / ".venv" / "opacus-suite-site"
PACKAGE = "opacus_suite_copy"
#: Examples per Hypothesis property test (Opacus's default profile runs 100; see the module docstring).
HYPOTHESIS_EXAMPLES = 3
#: The classes a listed test may have, and what each means.
CLASSES = {
    "internal": "the test reads Opacus's internals (private attributes, its RNG stream, its log wording)",
    "documented": "a documented difference: README.md's migration table says what to do instead",
    "more-correct": "this engine refuses or computes what Opacus gets wrong",
    "pending": "a gap being closed by another part of the work (the list is updated when it lands)",
    "environment": "the test needs a package this project cannot install (named in the reason)",
    "gap": "a difference a user's code could hit, not closed yet (listed so CI sees any change; to be fixed)",
}

# The README's sed line: sed -i -E '/^\s*(from|import)\s/ s/\bopacus\b/privacy_engine.opacus/'
_IMPORT_LINE = re.compile(r"^\s*(from|import)\s")
_OPACUS_WORD = re.compile(r"\bopacus\b")

_CONFTEST = '''\
"""Written by tests/opacus_suite/run.py: the Hypothesis profile and a recorder of each test's outcome."""
import importlib.util
import json
import os
import sys


{torchvision_shim}

_TORCHVISION_OPS = import_torchvision_without_extension()

from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "opacus_suite",
    max_examples={examples},
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
    database=None,
)
settings.load_profile("opacus_suite")

_OUTCOMES = {{}}


def _name(nodeid):
    prefix = "{package}/"
    return nodeid[len(prefix):] if nodeid.startswith(prefix) else nodeid


def pytest_collectreport(report):
    if report.failed:
        _OUTCOMES[_name(report.nodeid)] = "error"


def pytest_runtest_logreport(report):
    name = _name(report.nodeid)
    if report.failed:
        _OUTCOMES[name] = "failed"
    elif report.skipped and _OUTCOMES.get(name) != "failed":
        _OUTCOMES[name] = "skipped"
    elif report.passed and report.when == "call":
        _OUTCOMES.setdefault(name, "passed")


def pytest_sessionfinish(session):
    with open(os.environ["OPACUS_SUITE_RESULTS"], "w") as handle:
        json.dump(_OUTCOMES, handle, indent=1, sort_keys=True)
'''

_PYTEST_INI = """\
[pytest]
python_files = *_test.py
addopts = -p no:cacheprovider
"""


@dataclass(frozen=True, kw_only=True)
class Expectation:
    """One listed test: its pytest id (relative to Opacus's ``tests`` folder), class and reason."""

    test: str
    kind: str
    reason: str


def load_expectations(path: Path = EXPECTED_FILE) -> dict[str, Expectation]:
    """The expectation file, checked: each entry has a known class and a real reason.

    The file maps a test id (or, for a file that does not import, the file's path) to
    ``{ class = "...", reason = "..." }``.
    """
    with open(path, "rb") as handle:
        table = tomllib.load(handle)
    expectations = {}
    for test, entry in table.get("tests", {}).items():
        kind, reason = entry.get("class"), str(entry.get("reason", "")).strip()
        if kind not in CLASSES:
            raise ValueError(f"{path}: {test!r} has class {kind!r}; use one of {sorted(CLASSES)}")
        if not reason or reason.lower() in {"missing", "todo", "?"}:
            raise ValueError(f"{path}: {test!r} needs a one-line reason (not {reason!r})")
        expectations[test] = Expectation(test=test, kind=kind, reason=reason)
    return expectations


README = ROOT / "README.md"
README_BEGIN = "<!-- opacus-suite-table: generated from tests/opacus_suite/expected_failures.toml by `python tests/opacus_suite/run.py --write-readme`; do not edit by hand -->"
README_END = "<!-- end of opacus-suite-table -->"


def render_readme_table(expectations: dict[str, Expectation]) -> str:
    """The README's table of the Opacus tests that fail here: one row per (class, reason), with the
    number of tests and the files they are in. The expectation file is the one place of truth; a
    test (tests/test_opacus_suite_table.py) checks that the README holds exactly this text."""
    groups: dict[tuple[str, str], list[str]] = {}
    for expectation in expectations.values():
        groups.setdefault((expectation.kind, expectation.reason), []).append(expectation.test)
    order = list(CLASSES)
    lines = [
        README_BEGIN,
        "",
        "| class | why the Opacus test fails here | tests | in (Opacus's test modules) |",
        "| --- | --- | --- | --- |",
    ]
    for (kind, reason), tests in sorted(groups.items(), key=lambda item: (order.index(item[0][0]), item[0][1])):
        # Opacus's test modules in dotted form (their paths are not this repository's files).
        files = sorted({test.split("::")[0].removesuffix(".py").replace("/", ".") for test in tests})
        reason_cell = reason.replace("|", "\\|")
        lines.append(f"| {kind} | {reason_cell} | {len(tests)} | {', '.join(f'`{name}`' for name in files)} |")
    counts = ", ".join(f"{kind} {sum(1 for e in expectations.values() if e.kind == kind)}" for kind in order)
    lines += ["", f"{len(expectations)} listed ({counts}); a file that does not import counts once.", "", README_END]
    return "\n".join(lines)


def readme_block(text: str) -> str | None:
    """The generated block in the README's text (markers included), or None when it is missing."""
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        return None
    return text[start : end + len(README_END)]


def write_readme(expectations: dict[str, Expectation]) -> None:
    """Replace the generated block of README.md with ``render_readme_table(expectations)``."""
    text = README.read_text()
    block = readme_block(text)
    if block is None:
        raise SystemExit(f"README.md has no block between {README_BEGIN!r} and {README_END!r}")
    README.write_text(text.replace(block, render_readme_table(expectations)))


def opacus_tests_folder() -> Path:
    """The ``tests`` folder of the installed Opacus wheel (Opacus itself is not imported)."""
    spec = importlib.util.find_spec("opacus")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("Opacus is not installed: pip install -r requirements-test.txt (it pins opacus==1.6.0)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "tests"
    if not folder.is_dir():
        raise SystemExit(f"{folder} is missing: this Opacus wheel ships no tests")
    return folder


def rewrite_imports(source: str) -> str:
    """``source`` with the README's migration rule applied: only lines starting with from/import change."""
    lines = source.splitlines(keepends=True)
    return "".join(_OPACUS_WORD.sub("privacy_engine.opacus", line) if _IMPORT_LINE.match(line) else line for line in lines)


def copy_suite(destination: Path) -> Path:
    """Copy Opacus's tests under ``destination/PACKAGE``, imports rewritten; return the package folder."""
    package = destination / PACKAGE
    shutil.copytree(opacus_tests_folder(), package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in package.rglob("*.py"):
        path.write_text(rewrite_imports(path.read_text()))
    shim = (HERE.parent / "torchvision_without_extension.py").read_text()
    (destination / "conftest.py").write_text(
        _CONFTEST.format(examples=HYPOTHESIS_EXAMPLES, package=PACKAGE, torchvision_shim=shim))
    (destination / "pytest.ini").write_text(_PYTEST_INI)
    return package


def run_suite(destination: Path, pytest_args: list[str]) -> dict[str, str]:
    """Run the copied suite in a fresh process; return ``{test id: passed|failed|error|skipped}``."""
    results = destination / "results.json"
    environment = dict(os.environ, OPACUS_SUITE_RESULTS=str(results))
    extra = str(EXTRA_SITE) if EXTRA_SITE.is_dir() else None
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH"), extra]))
    command = [sys.executable, "-m", "pytest", "-q", "-rN", "--tb=no", "-c", str(destination / "pytest.ini"),
               "--rootdir", str(destination), "--continue-on-collection-errors", PACKAGE, *pytest_args]  # fmt: skip
    subprocess.run(command, cwd=destination, env=environment, check=False)
    if not results.exists():
        raise SystemExit("pytest wrote no results: see its output above")
    return json.loads(results.read_text())


def compare(outcomes: dict[str, str], expectations: dict[str, Expectation], *, subset: bool) -> list[str]:
    """The differences between what ran and the list, one line each (empty when they agree).

    With ``subset`` (``-k`` or a path given), a listed test that did not run is not a difference.
    """
    differences = []
    for test, outcome in sorted(outcomes.items()):
        if outcome in {"failed", "error"} and test not in expectations:
            differences.append(f"NEW FAILURE   {test} ({outcome}): fix it, or list it with a class and a reason")
        if outcome == "passed" and test in expectations:
            differences.append(f"NOW PASSES    {test}: remove it from {EXPECTED_FILE.name}")
    if not subset:
        for test in sorted(set(expectations) - set(outcomes)):
            if "::" not in test and any(name.startswith(f"{test}::") for name in outcomes):
                differences.append(f"NOW IMPORTS   {test}: list its failing tests instead of the file")
            else:
                differences.append(f"NOT RUN       {test}: listed but not collected; remove or rename it")
    return differences


def main(argv: list[str] | None = None) -> int:
    """Copy, rewrite, run and compare; print the counts and every difference; 0 when none."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="keep the rewritten suite in this (new) folder")
    parser.add_argument("--write-observed", type=Path, help="write every failing test id to this file")
    parser.add_argument("--write-readme", action="store_true", help="regenerate README.md's table from the list, run nothing")
    known, pytest_args = parser.parse_known_args(argv)
    expectations = load_expectations()
    if known.write_readme:
        write_readme(expectations)
        return 0
    if not EXTRA_SITE.is_dir():
        print(f"{EXTRA_SITE} is missing: pip install --no-deps --target {EXTRA_SITE} -r "
              f"{HERE / 'requirements.txt'} (torchvision for five of the suite's files)")  # fmt: skip
        return 1
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="opacus_suite_") as scratch:
        destination = known.keep or Path(scratch)
        destination.mkdir(parents=True, exist_ok=True)
        copy_suite(destination)
        outcomes = run_suite(destination, pytest_args)
    elapsed = time.monotonic() - start
    counts = {kind: sum(1 for outcome in outcomes.values() if outcome == kind) for kind in ("passed", "failed", "error", "skipped")}
    listed_failing = sum(1 for test, outcome in outcomes.items() if test in expectations and outcome in {"failed", "error"})
    print(f"opacus suite: {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
          f"{counts['skipped']} skipped; {listed_failing} of the failures are listed "
          f"({len(expectations)} listed in all); {elapsed:.0f}s")  # fmt: skip
    if known.write_observed:
        failing = sorted(test for test, outcome in outcomes.items() if outcome in {"failed", "error"})
        known.write_observed.write_text("".join(f"{test}\n" for test in failing))
    # A selection (-k, -m, a file or a test id) runs part of the suite: listed tests outside it are not differences.
    subset = any(arg.startswith(("-k", "-m")) or "::" in arg or arg.endswith(".py") for arg in pytest_args)
    differences = compare(outcomes, expectations, subset=subset)
    for line in differences:
        print(line)
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
