"""List file paths and module names mentioned in the documentation that do not exist.

Run from anywhere: ``python scripts/check_paths.py``. Prints ``where: what`` for each stale mention and
exits 1 if there is any. Read: the docstrings of every ``.py`` file in the repository (packages,
benchmarks, tests, tutorials, scripts), ``README.md``, ``NOTES.md``, ``benchmarks/README.md`` and
``docs/`` (``.md``, ``.rst``). ``CHANGELOG.md`` is left out: it names files as they were.

Two kinds of mention:

* a path ending in ``.py``/``.md``/``.rst`` with at least one ``/`` (``grad_samplers/rnn.py``): it
  exists if it is found relative to the repository root, to ``privacy_engine/``, or to the folder of
  the file that mentions it (or one of that folder's parents);
* a dotted name under ``privacy_engine``, ``grad_samplers`` or ``accountants``
  (``privacy_engine.training.sampling``): it exists if its longest prefix that is a module is
  followed by at most one name that module defines or imports (a class, function, assignment or
  import; read with ``ast``), and at most one more (an attribute of that name, not checked).
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("privacy_engine", "grad_samplers", "accountants")
PYTHON_FOLDERS = (*PACKAGES, "benchmarks", "tests", "tutorials", "scripts", "docs")
TEXT_FILES = ("README.md", "NOTES.md", "benchmarks/README.md")
#: Mentions that are meant not to exist here: (file, mention) -> why.
INTENTIONAL: dict[tuple[str, str], str] = {
    ("NOTES.md", "privacy_engine.optimizer"): "names an old module path, to say that it is gone",
}
#: Path prefixes of other repositories' files: tests/opacus_examples name the Opacus examples they rewrite.
OTHER_REPOSITORIES = ("examples/",)
ALIASES = {"privacy_engine.accountants": "accountants", "privacy_engine.grad_samplers": "grad_samplers"}

_PATH = re.compile(r"(?<![\w./:-])((?:\.\./)?[A-Za-z_][\w.-]*(?:/[\w.-]+)+\.(?:py|md|rst))(?![\w/])")
_DOTTED = re.compile(r"(?<![\w./-])((?:privacy_engine|grad_samplers|accountants)(?:\.[A-Za-z_]\w*)+)")


def _docstrings(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                yield first.lineno, first.value.value


def _texts(root: Path) -> Iterator[tuple[Path, int, str]]:
    """(file, line, text) of every piece of documentation read."""
    for folder in PYTHON_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            for line, text in _docstrings(path):
                yield path, line, text
    documents = [root / name for name in TEXT_FILES]
    documents += sorted((root / "docs").rglob("*.md")) + sorted((root / "docs").rglob("*.rst"))
    for path in documents:
        if path.exists():
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                yield path, number, line


def _path_exists(mention: str, mentioned_in: Path, root: Path) -> bool:
    folders = [root, root / "privacy_engine", *mentioned_in.parents]
    return any((folder / mention).exists() for folder in folders if root in (folder, *folder.parents))


def _module_file(name: str, root: Path) -> Path | None:
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _defined_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


def _dotted_exists(mention: str, root: Path) -> bool:
    for alias, real in ALIASES.items():
        if mention == alias or mention.startswith(alias + "."):
            mention = real + mention[len(alias) :]
    parts = mention.split(".")
    for length in range(len(parts), 0, -1):
        found = _module_file(".".join(parts[:length]), root)
        if found is not None:
            rest = parts[length:]
            return not rest or (len(rest) <= 2 and rest[0] in _defined_names(found))
    return False


def _is_file_name(mention: str) -> bool:
    """``privacy_engine.py``: a file name, not a module; it exists if some file has that name."""
    return mention.rsplit(".", 1)[-1] in ("py", "md", "rst")


def stale_mentions(root: Path = ROOT) -> list[str]:
    """``file:line: mention`` for every mention that does not exist, sorted, each once per file."""
    found: dict[tuple[str, str], int] = {}
    file_names = {path.name for folder in PYTHON_FOLDERS for path in (root / folder).rglob("*")}
    for path, first_line, text in _texts(root):
        where = path.relative_to(root).as_posix()
        for match in _PATH.finditer(text):
            mention = match.group(1)
            if mention.startswith(OTHER_REPOSITORIES) or _path_exists(mention, path, root):
                continue
            found.setdefault((where, mention), first_line + text.count("\n", 0, match.start()))
        for match in _DOTTED.finditer(text):
            mention, before, after = match.group(1), text[match.start() - 1 : match.start()], text[match.end() :]
            if (before and before in "\"'") or after.startswith(("*", "...")):  # a string key, or a wildcard
                continue
            if _is_file_name(mention):
                if mention in file_names:
                    continue
            elif _dotted_exists(mention, root):
                continue
            found.setdefault((where, mention), first_line + text.count("\n", 0, match.start()))
    for key in INTENTIONAL:
        found.pop(key, None)
    return sorted(f"{where}:{line}: {mention}" for (where, mention), line in found.items())


def main() -> int:
    """Print the stale mentions; 1 if there is any, else 0."""
    stale = stale_mentions()
    for mention in stale:
        print(mention)
    print(f"{len(stale)} stale path(s) or module name(s)." if stale else "every path and module name mentioned exists.")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
