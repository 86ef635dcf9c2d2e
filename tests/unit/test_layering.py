"""The package's import arrows run one way (the layering of the design): read from the source
with `ast`, every import of a scalerl_jax package, at module level or inside a function."""

import ast
import pathlib

import scalerl_jax

PACKAGE = pathlib.Path(scalerl_jax.__file__).parent

# Which of the package's parts each part may import. Lower layers know nothing of higher ones:
# `rl/` and `scaling/` are pure math; `models/` knows nothing of RL; `sampler/` nothing of
# processes; `config/` reads the run's configs and knows the libraries only for their choice lists
# and dataclasses; only the composition root (`run/`) and the entry points (`cli/`) see everything.
LIBRARIES = {
    "contracts",
    "rl",
    "scaling",
    "hardware",
    "telemetry",
    "models",
    "sampler",
    "train",
    "data",
    "pipeline",
    "sandbox",
}
ALLOWED = {
    "contracts": set(),  # the train batch's layout, the first failure among threads, a workdir's lock
    "rl": set(),
    "scaling": set(),
    "hardware": set(),  # published accelerator facts: the bottom layer
    "telemetry": set(),  # metrics rows, W&B, compile events, the console
    "sandbox": set(),  # untrusted code contained by bubblewrap, and the code verifier on it
    "models": {"hardware"},
    "sampler": {"contracts", "models"},  # contracts: the routing it records is in the batch's dtype
    "train": {"contracts", "hardware", "models", "rl"},
    "data": {"rl", "sandbox"},
    "pipeline": {"contracts", "data", "rl", "sampler"},
    "distributed": {"models", "pipeline", "sampler"},
    "config": {"contracts", "data", "models", "pipeline", "rl", "sampler", "telemetry", "train"},
    "study": {"config", "contracts", "data", "scaling", "telemetry"},
    "run": LIBRARIES | {"config", "distributed"},
    "cli": LIBRARIES | {"config", "distributed", "run", "study"},
    "main": {"cli"},  # `python -m scalerl_jax.main`, the documented command
    "__init__": set(),
}


def imported_modules(path: pathlib.Path) -> set[str]:
    """The scalerl_jax names (dotted) that a file imports, at any depth of the file: `import a.b`
    gives a.b, `from a.b import c` gives a.b.c (a module, or a name defined in a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {name for name in names if name.startswith("scalerl_jax.")}


def imported_parts(path: pathlib.Path) -> set[str]:
    """The top-level parts of scalerl_jax (`models`, `rl`, `cli`, ...) that a file imports."""
    return {name.split(".")[1] for name in imported_modules(path)}


def import_graph() -> dict[str, set[str]]:
    """Part -> the other parts its files import."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        part = path.relative_to(PACKAGE).parts[0].removesuffix(".py")  # a subpackage's name, or a top-level module's
        graph.setdefault(part, set()).update(imported_parts(path) - {part})
    return graph


def module_graph() -> dict[str, set[str]]:
    """Module (dotted) -> the package's modules it imports. Packages' `__init__` files, facades that
    re-export their own modules, are left out: an import through one counts for no module."""
    modules = {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts): path
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    }
    graph = {}
    for name, path in modules.items():
        # `from a.b import c`: the module a.b.c when there is one, else a.b
        targets = {
            imported if imported in modules else imported.rpartition(".")[0] for imported in imported_modules(path)
        }
        graph[name] = {t for t in targets if t in modules} - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_imported_parts_reads_every_import_form(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import scalerl_jax.rl\nfrom scalerl_jax import models\nfrom scalerl_jax.sampler.engine import Engine\n"
        "import numpy\nfrom . import sibling\n\ndef f():\n    from scalerl_jax.data import rows\n"
    )
    assert imported_parts(source) == {"rl", "models", "sampler", "data"}


def test_every_part_of_the_package_has_a_rule():
    assert sorted(set(import_graph()) - set(ALLOWED)) == []


def test_lower_layers_import_only_what_the_design_allows():
    graph = import_graph()
    wrong = {
        part: sorted(graph[part] - allowed) for part, allowed in ALLOWED.items() if graph.get(part, set()) - allowed
    }
    assert wrong == {}


def test_only_the_entry_points_import_the_composition_root_and_the_commands():
    graph = import_graph()
    assert sorted(part for part, imports in graph.items() if "run" in imports and part != "run") == ["cli"]
    assert sorted(part for part, imports in graph.items() if "cli" in imports and part != "cli") == ["main"]


def parts_importing(module: str) -> set[str]:
    """The parts of the package with a file that imports the top-level module `module`."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else []
            )
            if any(name == module or name.startswith(module + ".") for name in names):
                found.add(path.relative_to(PACKAGE).parts[0].removesuffix(".py"))
    return found


def test_only_the_configuration_the_run_and_the_commands_read_config_dicts():
    """Libraries take their own dataclasses (`config.adapters` builds them): no ConfigDict below."""
    assert sorted(parts_importing("ml_collections")) == ["cli", "config", "run"]


def test_cycles_finds_a_circle_by_hand():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others():
    """No import circle between modules, counting imports inside functions (a lazy import that
    breaks a circle at load time still ties the two modules together)."""
    assert cycles(module_graph()) == []
