"""The README's set-up commands are the ones CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _indented_commands(text: str) -> list:
    return [line.strip() for line in text.splitlines() if line.startswith("    python3 -m venv")]


def test_ci_runs_exactly_the_readme_test_command():
    _demo, tests = _indented_commands((ROOT / "README.md").read_text())
    assert tests.endswith("python -m pytest -q tests")
    assert tests in (ROOT / ".ci" / "run").read_text()


def test_readme_demo_command_names_an_existing_tutorial():
    demo, _ = _indented_commands((ROOT / "README.md").read_text())
    script = demo.rsplit("python ", 1)[1].strip()
    assert (ROOT / script).is_file(), script
