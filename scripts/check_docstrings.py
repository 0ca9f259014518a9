"""List the public definitions of ``privacy_engine/``, ``grad_samplers/`` and ``accountants/`` that
have no docstring.

Run from anywhere: ``python scripts/check_docstrings.py [--count]``. Prints ``file:line: name`` for
each, grouped by file, then ``missing/total``; exits 1 if any is missing. ``--count`` prints only the
last line.

Public: a module-level function or class whose name does not start with ``_``, and a method (or
property) of such a class whose name does not start with ``_``, in a module whose path has no part
starting with ``_`` (``accountants/_pld_ops.py`` is private; ``__init__.py`` is not). Not counted:
dunder methods (a class's docstring documents its constructor), property setters and deleters (the
getter holds the docstring), ``typing.overload`` stubs. Read with ``ast``: nothing is imported.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("privacy_engine", "grad_samplers", "accountants")

_Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _is_public_module(path: Path, root: Path) -> bool:
    parts = path.relative_to(root).with_suffix("").parts
    return not any(part.startswith("_") and part != "__init__" for part in parts)


def _decorator_names(node: _Definition) -> set[str]:
    names = set()
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute):
            names.add(target.attr)
        elif isinstance(target, ast.Name):
            names.add(target.id)
    return names


def _counted(node: ast.AST) -> bool:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
        return False
    return not _decorator_names(node) & {"setter", "deleter", "overload"}


def public_definitions(root: Path = ROOT) -> Iterator[tuple[Path, int, str, bool]]:
    """(file, line, qualified name, has a docstring) for every public definition."""
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if not _is_public_module(path, root):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in tree.body:
                if not _counted(node):
                    continue
                yield path, node.lineno, node.name, ast.get_docstring(node) is not None
                if isinstance(node, ast.ClassDef):
                    for member in node.body:
                        if _counted(member) and not isinstance(member, ast.ClassDef):
                            qualified = f"{node.name}.{member.name}"
                            yield path, member.lineno, qualified, ast.get_docstring(member) is not None


def main(argv: list[str]) -> int:
    """Print what lacks a docstring; 1 if anything does, else 0."""
    definitions = list(public_definitions())
    missing = [(path, line, name) for path, line, name, documented in definitions if not documented]
    if "--count" not in argv:
        current = None
        for path, line, name in missing:
            where = path.relative_to(ROOT).as_posix()
            if where != current:
                print(where)
                current = where
            print(f"  {where}:{line}: {name}")
    print(f"{len(missing)} of {len(definitions)} public definitions have no docstring.")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
