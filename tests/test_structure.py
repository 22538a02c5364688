"""The package's shape: no import cycle, imports only downward in the declared layer order, no function-body
imports except optional heavy dependencies, no file over 600 lines, no function over 60 lines, no import of another
module's private name, no registry mutated outside its module."""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "opdjax"

# The data flow, bottom up: a module imports only from its own layer or the layers before it.
LAYERS = [
    {"core"},
    {"quant", "data"},
    {"models"},
    {"rollout", "teacher", "learner", "sync"},
    {"remote"},
    {"config"},
    {"pipeline"},
    {"admission"},
    {"study"},
    {"cli"},
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}
OPTIONAL_HEAVY = {"vllm", "torch", "transformers", "tokenizers", "matplotlib", "tensorboardX", "wandb"}
MAX_LINES = 600
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The opdjax module an import refers to (a submodule, or the package that defines the name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: pathlib.Path) -> tuple[set[str], list[tuple[int, str]]]:
    """(opdjax modules imported at module level, [(line, module)] of imports inside functions)."""
    tree = ast.parse(path.read_text())
    top, inner = set(), []
    nested = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    nested.add(id(sub))
                    mod = sub.module if isinstance(sub, ast.ImportFrom) else sub.names[0].name
                    inner.append((sub.lineno, mod or ""))
    for node in ast.walk(tree):
        if id(node) in nested or node.__class__.__name__ == "If" and _is_type_checking(node):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("opdjax"):
            for alias in node.names:
                m = _resolve(f"{node.module}.{alias.name}") or _resolve(node.module)
                top.add(m)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("opdjax"):
                    top.add(_resolve(alias.name))
    for node in ast.walk(tree):  # imports under `if TYPE_CHECKING:` are annotations only
        if isinstance(node, ast.If) and _is_type_checking(node):
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and sub.module:
                    for alias in sub.names:
                        top.discard(_resolve(f"{sub.module}.{alias.name}") or _resolve(sub.module))
    return {m for m in top if m}, inner


def _is_type_checking(node) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


GRAPH = {m: _imports(p) for m, p in MODULES.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYER_OF.get(parts[1]) if len(parts) > 1 else None


def test_every_subpackage_has_a_layer():
    top = {m.split(".")[1] for m in MODULES if m.count(".") >= 1}
    assert top <= set(LAYER_OF) | {"__main__"}, sorted(top - set(LAYER_OF))


def test_no_import_cycle():
    graph = {m: {d for d in deps if d != m and d != "opdjax"} for m, (deps, _) in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            # a package's __init__ importing its own submodules is not a cycle between concepts
            if m.startswith(d + "."):
                continue
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_imports_only_go_down_the_layer_order():
    bad = []
    for m, (deps, _) in GRAPH.items():
        lm = _layer(m)
        if lm is None:
            continue
        for d in deps:
            ld = _layer(d)
            if ld is not None and ld > lm:
                bad.append(f"{m} ({sorted(LAYERS[lm])}) imports {d} ({sorted(LAYERS[ld])})")
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_function_body_imports_are_only_optional_heavy_dependencies():
    bad = [f"{m}:{line} imports {mod}" for m, (_, inner) in GRAPH.items() for line, mod in inner
           if mod.split(".")[0] not in OPTIONAL_HEAVY]
    assert not bad, "\n".join(bad)


def test_no_file_over_600_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_registries_are_filled_only_where_they_are_defined():
    """RECIPES, LOSSES, CORRECTIONS, TASKS: no module but the defining one stores into them."""
    homes = {"RECIPES": "opdjax.quant.recipes", "LOSSES": "opdjax.core.losses", "CORRECTIONS": "opdjax.core.corrections",
             "TASKS": "opdjax.data.tasks"}
    bad = []
    for m, p in MODULES.items():
        for node in ast.walk(ast.parse(p.read_text())):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript):
                    base = t.value
                    name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
                    if name in homes and homes[name] != m:
                        bad.append(f"{m}:{node.lineno} stores into {name}")
    assert not bad, bad


def test_no_function_over_60_lines():
    """Every function and method, counted from its `def` line to its last line (decorators not counted)."""
    long = []
    for p in MODULES.values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append((n, f"{p.relative_to(PKG.parent)}:{node.lineno} {node.name} ({n} lines)"))
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(x for _, x in sorted(long)[::-1])


def _imported_from(module: str, node: ast.ImportFrom) -> str:
    """The absolute module of `from <node.module> import ...` written in `module` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def test_no_module_imports_a_private_name_of_another_module():
    """`from opdjax.x import _name` couples a module to another's internals: a shared helper is made public."""
    bad = []
    for m, p in MODULES.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _imported_from(m, node)
            if not source.startswith("opdjax") or source == m:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    bad.append(f"{m} (line {node.lineno}) imports {alias.name} from {source}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)
