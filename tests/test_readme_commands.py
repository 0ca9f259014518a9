"""The README's set-up commands are the ones CI runs, and the demo's install stays light."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the demo does not need: test runners, Opacus, Hugging Face, documentation tools.
NOT_FOR_THE_DEMO = {"pytest", "hypothesis", "opacus", "transformers", "peft", "accelerate", "sphinx", "myst-parser"}


def _indented_commands(prefix: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [line.strip() for line in text.splitlines() if line.startswith("    " + prefix)]


def _ci_script() -> str:
    return (ROOT / ".ci" / "run").read_text()


def _requirement_names(path: Path) -> set[str]:
    """Package names a requirements file installs, following ``-r`` includes."""
    names: set[str] = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r"):
            names |= _requirement_names(path.parent / line[2:].strip())
        elif line:
            names.add(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower())
    return names


def test_ci_runs_exactly_the_readme_test_command():
    _demo, tests = _indented_commands("python3 -m venv")
    assert tests.endswith("python -m pytest -q tests")
    assert tests in _ci_script()


def test_ci_runs_the_slow_tests_and_builds_the_docs_as_the_readme_says():
    (docs,) = _indented_commands("pip install -r requirements-docs.txt")
    script = _ci_script()
    assert docs in script and " -W " in docs
    assert "python -m pytest -q -m slow tests" in script
    assert "python -m pytest -q -m slow tests" in (ROOT / "README.md").read_text()
    # Each later step comes after the test command, so the test command's result is what CI reports first.
    _demo, tests = _indented_commands("python3 -m venv")
    assert script.index(tests) < script.index("-m slow") < script.index(docs)


def test_readme_demo_command_names_an_existing_tutorial():
    demo, _ = _indented_commands("python3 -m venv")
    script = demo.rsplit("python ", 1)[1].strip()
    assert (ROOT / script).is_file(), script


def test_the_demo_installs_no_test_or_hugging_face_package():
    demo, tests = _indented_commands("python3 -m venv")
    demo_requirements = re.search(r"pip install -r (\S+)", demo).group(1)
    test_requirements = re.search(r"pip install -r (\S+)", tests).group(1)
    installed = _requirement_names(ROOT / demo_requirements)
    assert {"torch", "scikit-learn"} <= installed
    assert not installed & NOT_FOR_THE_DEMO, installed & NOT_FOR_THE_DEMO
    # The tests install everything the demo does, with the same torch pin (one resolution).
    assert installed | {"pytest", "hypothesis", "opacus"} <= _requirement_names(ROOT / test_requirements)
