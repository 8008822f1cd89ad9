"""rlsys's modules import each other in layers, never in a circle (docs/design.md "Where the parts meet").

Imports are read from the source with `ast`, at module level and inside functions alike: an import deferred into
a function still ties the two modules together, it only hides the circle from Python's import machinery.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rlsys"


def module_names(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its __init__.py)."""
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its source: `from a.b import c` counts a.b.c where c
    is a module, else a.b; a name not in the package counts its nearest enclosing module."""
    def nearest(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(nearest(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` levels above this module's
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else nearest(base))
    return {m for m in found if m and m != name}


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None: a depth-first search that meets a module still on its path."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every import below it is seen
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for child in sorted(graph.get(module, ())):
            if state.get(child) == "open":
                return path[path.index(child):] + [child]
            if child not in state:
                cycle = visit(child)
                if cycle:
                    return cycle
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


# The layers, lowest first (docs/design.md "Where the parts meet"): a module imports from its own layer or below,
# never above, even where no circle closes. A module is placed by its first name under rlsys (rlsys.control.tail:
# control); the package's own __init__ (rlsys) imports nothing.
LAYERS = (
    {"rlsys", "config", "errors", "plugins", "placement", "registry", "types", "runs"},  # the schema, shared types
    {"control", "data", "reward", "tools", "models", "weights", "rollout", "trainer", "cluster", "costs", "memory",
     "emulate", "checkpoint", "logger", "step_stats", "friction", "config_reference"},  # the parts
    {"startup", "evaluate", "plot", "train", "bench", "bench_budget", "sim", "cli"},  # assembling the parts, and showing a run
)


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Each import of a module from a layer above its own, as "a (layer i) imports b (layer j)"."""
    level = {name: i for i, names in enumerate(layers) for name in names}
    return sorted(f"{m} (layer {level[part(m)]}) imports {d} (layer {level[part(d)]})"
                  for m, imported in graph.items() for d in imported if level[part(d)] > level[part(m)])


def test_every_module_has_a_layer_and_none_imports_from_a_layer_above():
    graph = import_graph(PACKAGE)
    unplaced = {part(m) for m in graph} - set().union(*LAYERS)
    assert not unplaced, f"place {sorted(unplaced)} in tests/test_layering.py LAYERS (and docs/design.md)"
    assert upward_imports(graph) == [], "imports from a layer above: " + "; ".join(upward_imports(graph))


def test_the_layer_check_finds_a_low_module_importing_a_high_one_without_a_circle(tmp_path):
    package = tmp_path / "rlsys"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "types.py").write_text("def f():\n    from rlsys.plot import draw\n")
    (package / "plot.py").write_text("from rlsys import errors\n")
    (package / "errors.py").write_text("")
    graph = import_graph(package)
    assert find_cycle(graph) is None
    assert upward_imports(graph) == ["rlsys.types (layer 0) imports rlsys.plot (layer 2)"]


def test_rlsys_has_no_import_circle():
    cycle = find_cycle(import_graph(PACKAGE))
    assert cycle is None, "rlsys modules import each other in a circle: " + " -> ".join(cycle)


def test_the_config_schema_imports_nothing_of_rlsys():
    assert import_graph(PACKAGE)["rlsys.config"] == set()


def test_the_check_finds_a_circle_through_a_function_level_import(tmp_path):
    """The check itself: a relative import at module level and an absolute one inside a function close a circle."""
    package = tmp_path / "rlsys"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from rlsys.c import g\n")
    (package / "c.py").write_text("import os\n\ndef g():\n    from rlsys import a\n")
    graph = import_graph(package)
    assert graph["rlsys.a"] == {"rlsys.sub.b"} and graph["rlsys.c"] == {"rlsys.a"}
    assert find_cycle(graph) == ["rlsys.a", "rlsys.sub.b", "rlsys.c", "rlsys.a"]
    (package / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(package)) is None
