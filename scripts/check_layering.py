"""Check the import layering of ``privacy_engine/``, ``grad_samplers/`` and ``accountants/``.

Run from anywhere: ``python scripts/check_layering.py``. Prints one line per violation and exits 1 if
there is any, 0 otherwise. Reads the source with ``ast`` (nothing is imported, so it needs no torch).

Three rules:

1. **No upward import.** ``LAYERS`` below is the data path, lowest layer first. A module may import
   modules of its own layer and of layers below it, never of a layer above (capture, clipping and noise
   never import training or engine). A module belongs to the layer of the longest name in ``LAYERS``
   that covers it (a name covers itself and the modules under it), so a new file lands where its
   folder is; a module under ``privacy_engine`` that no narrower name covers is reported as unplaced
   (add it to the table).
2. **No import cycle** between modules. Counted: every import that runs (module level, and inside
   functions); not counted: imports under ``if TYPE_CHECKING:`` (they never run) and the implicit import
   of a module's parent packages (``import a.b.c`` runs ``a/__init__``; every package that re-exports
   its submodules would otherwise be one cycle).
3. **No deferred import of a first-party module.** An import inside a function is how a cycle is
   hidden; one of ``privacy_engine``, ``grad_samplers`` or ``accountants`` is reported unless it is in
   ``ALLOWED_DEFERRED`` with its reason. Deferred imports of optional third-party libraries
   (``transformers``, ``datasets``, ...) are fine.

``privacy_engine.accountants`` and ``privacy_engine.grad_samplers`` are read as the top-level
packages they alias (``privacy_engine._namespaced``).
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The packages checked; first-party imports are imports of these.
PACKAGES = ("privacy_engine", "grad_samplers", "accountants")

#: The layers, lowest first: (layer, the module names it covers). One table; change it here only.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # The two top-level packages are usable alone: they import nothing of privacy_engine.
    ("accountants", ("accountants",)),
    ("grad_samplers", ("grad_samplers",)),
    # What every stage may use: the drawn batch, the one check of each setting, the errors that name an
    # unsupported model, the interrupt guard, loss helpers (capture reads transformers' per-example
    # loss hooks from integrations/hf_losses.py).
    (
        "foundations",
        (
            "privacy_engine._namespaced",
            "privacy_engine.batches",
            "privacy_engine.interrupts",
            "privacy_engine.losses",
            "privacy_engine.settings_checks",
            "privacy_engine.models.validation",
            "privacy_engine.integrations.hf_losses",
        ),
    ),
    ("capture", ("privacy_engine.capture",)),
    # Making a model trainable (fixer, DP recurrent layers): the fixer checks a model with capture.
    ("models", ("privacy_engine.models",)),
    ("clipping", ("privacy_engine.clipping",)),
    ("noise", ("privacy_engine.noise",)),
    ("training", ("privacy_engine.training",)),
    # Auditing sits between training and engine: its canaries implement the optimizer's declared canary
    # component (training/canary_slot.py), and the engine builds them for make_private(audit=...).
    ("auditing", ("privacy_engine.auditing",)),
    ("engine", ("privacy_engine.engine",)),
    # `privacy_engine` covers only the package's __init__: a new module directly under it is reported
    # as unplaced until it is added above.
    (
        "on top: integrations, Opacus compatibility",
        ("privacy_engine.integrations", "privacy_engine.opacus", "privacy_engine"),
    ),
)

#: Names in LAYERS that place only the package itself, not the modules under it.
_PACKAGE_ONLY = ("privacy_engine",)

#: Deferred (function-level) first-party imports that are allowed: (importing module, imported
#: module) -> why it is deferred. Keep it short: each entry is a cycle or a cost someone chose.
ALLOWED_DEFERRED: dict[tuple[str, str], str] = {}

_ALIASES = {f"privacy_engine.{name}": name for name in ("accountants", "grad_samplers")}


@dataclasses.dataclass(frozen=True)
class Violation:
    """One broken rule. ``key`` names it without line numbers (stable across edits); ``text`` is the
    line printed, with the file and line."""

    kind: str  # "upward import", "cycle", "deferred import", "unplaced module"
    key: str
    text: str


@dataclasses.dataclass(frozen=True)
class _Import:
    source: str  # the importing module
    target: str  # the imported module (or the package, for a name that is not a submodule)
    path: Path
    line: int
    deferred: bool  # inside a function
    type_only: bool  # under `if TYPE_CHECKING:`


def _canonical(name: str) -> str:
    for alias, real in _ALIASES.items():
        if name == alias or name.startswith(alias + "."):
            return real + name[len(alias) :]
    return name


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, root: Path, modules: set[str], packages: Sequence[str]) -> Iterator[_Import]:
    source = _module_name(path, root)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [_canonical(alias.name) for alias in node.names]
        if node.level:  # relative: resolve against this module's package
            package = source.split(".") if is_package else source.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        base = _canonical(base)
        found = []
        for alias in node.names:  # `from package import submodule` imports the submodule
            found.append(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        return list(dict.fromkeys(found))

    def walk(node: ast.AST, deferred: bool, type_only: bool) -> Iterator[_Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in targets(child):
                    if target.split(".")[0] in packages:
                        yield _Import(source, target, path, child.lineno, deferred, type_only)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, True, type_only)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for statement in child.body:
                    yield from walk(ast.Module(body=[statement], type_ignores=[]), deferred, True)
                for statement in child.orelse:
                    yield from walk(ast.Module(body=[statement], type_ignores=[]), deferred, type_only)
            else:
                yield from walk(child, deferred, type_only)

    yield from walk(tree, False, False)


def layer_of(module: str, layers: Sequence[tuple[str, Sequence[str]]] = LAYERS) -> tuple[int, str] | None:
    """(index, name) of the layer covering ``module`` (the longest covering name wins), or None."""
    covering = _covering_name(module, layers)
    for index, (layer, names) in enumerate(layers):
        if covering in names:
            return index, layer
    return None


def _covering_name(module: str, layers: Sequence[tuple[str, Sequence[str]]]) -> str | None:
    names = [name for _, names in layers for name in names if module == name or module.startswith(name + ".")]
    return max(names, key=len, default=None)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:  # recursive: the graph is a few hundred modules deep at most
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(edges.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(components)


def _one_cycle(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module, for the message."""
    start = component[0]
    members = set(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(edges.get(node, ()) & members):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if successor not in previous:
                    previous[successor] = node
                    following.append(successor)
        frontier = following
    return [start, start]


def find_violations(
    root: Path = ROOT,
    packages: Sequence[str] = PACKAGES,
    layers: Sequence[tuple[str, Sequence[str]]] = LAYERS,
    allowed_deferred: dict[tuple[str, str], str] | None = None,
) -> list[Violation]:
    """Every violation of the three rules in ``packages`` under ``root``, in a stable order."""
    allowed = ALLOWED_DEFERRED if allowed_deferred is None else allowed_deferred
    files = sorted(path for package in packages for path in (root / package).rglob("*.py"))
    modules = {_module_name(path, root) for path in files}
    imports = [found for path in files for found in _imports(path, root, modules, packages)]
    violations: list[Violation] = []
    for module in sorted(modules):
        placed = layer_of(module, layers)
        if placed is None or (module not in _PACKAGE_ONLY and _covering_name(module, layers) in _PACKAGE_ONLY):
            violations.append(
                Violation("unplaced module", f"unplaced module {module}", f"unplaced module: {module} has no layer in LAYERS")
            )
    for found in imports:
        where = f"{found.path.relative_to(root).as_posix()}:{found.line}"
        source_layer, target_layer = layer_of(found.source, layers), layer_of(found.target, layers)
        if source_layer and target_layer and target_layer[0] > source_layer[0]:
            violations.append(
                Violation(
                    "upward import",
                    f"upward import {found.source} -> {found.target}",
                    f"upward import ({source_layer[1]} -> {target_layer[1]}): {where} imports {found.target}",
                )
            )
        if found.deferred and (found.source, found.target) not in allowed:
            violations.append(
                Violation(
                    "deferred import",
                    f"deferred import {found.source} -> {found.target}",
                    f"deferred import: {where} imports {found.target} inside a function",
                )
            )
    edges: dict[str, set[str]] = {}
    for found in imports:
        if not found.type_only and found.source != found.target and (found.source, found.target) not in allowed:
            edges.setdefault(found.source, set()).add(found.target)
    for component in _cycles(edges):
        cycle = " -> ".join(_one_cycle(component, edges))
        violations.append(
            Violation(
                "cycle",
                f"cycle {', '.join(component)}",
                f"import cycle between {len(component)} modules ({', '.join(component)}): {cycle}",
            )
        )
    unique = {violation.key: violation for violation in violations}
    return sorted(unique.values(), key=lambda violation: (violation.kind, violation.key))


def main(argv: Iterable[str] = ()) -> int:
    """Print the violations; 1 if there is any, else 0."""
    violations = find_violations()
    for violation in violations:
        print(violation.text)
    if violations:
        print(f"{len(violations)} layering violation(s); the layers are LAYERS in {Path(__file__).name}.")
        return 1
    print("layering: no upward import, no import cycle, no deferred first-party import.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
