"""The package's import arrows run one way (the layering of the design): read from the source
with `ast`, every import of a scalerl_jax package, at module level or inside a function."""

import ast
import pathlib

import scalerl_jax

PACKAGE = pathlib.Path(scalerl_jax.__file__).parent

# Which of the package's parts each part may import. Lower layers know nothing of higher ones:
# `rl/` and `scaling/` are pure math; `models/` knows nothing of RL; `sampler/` nothing of
# processes; only the composition root (`run/`) and the entry points see everything.
ALLOWED = {
    "batch_layout": set(),  # the train batch's layout: the contract between pipeline/ and train/
    "rl": set(),
    "threads": set(),  # the first failure among cooperating threads
    "scaling": set(),
    "hardware": set(),  # published accelerator facts: the bottom layer
    "models": {"hardware"},
    "sampler": {"models"},
    "train": {"batch_layout", "hardware", "models", "rl"},
    "data": {"rl"},
    "pipeline": {"batch_layout", "data", "rl", "sampler", "threads"},
    "distributed": {"models", "pipeline", "sampler"},
}
# Single files allowed one more arrow, and why: the memory planner's command line takes its
# defaults from the 8B recipe (inside `main`; the planner's functions take explicit sizes).
FILE_EXCEPTIONS = {"models/memory.py": {"recipe"}}


def imported_parts(path: pathlib.Path) -> set[str]:
    """The top-level parts of scalerl_jax (`models`, `rl`, `fit`, ...) that a file imports."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "scalerl_jax" else [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        parts |= {name.split(".")[1] for name in names if name.startswith("scalerl_jax.")}
    return parts


def import_graph() -> dict[str, set[str]]:
    """Part -> the other parts its files import."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).parts
        part = relative[0].removesuffix(".py")  # a subpackage's name, or a top-level module's
        allowed_here = FILE_EXCEPTIONS.get("/".join(relative), set())
        graph.setdefault(part, set()).update(imported_parts(path) - {part} - allowed_here)
    return graph


def test_imported_parts_reads_every_import_form(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import scalerl_jax.rl\nfrom scalerl_jax import models\nfrom scalerl_jax.sampler.engine import Engine\n"
        "import numpy\nfrom . import sibling\n\ndef f():\n    from scalerl_jax.data import rows\n"
    )
    assert imported_parts(source) == {"rl", "models", "sampler", "data"}


def test_lower_layers_import_only_what_the_design_allows():
    graph = import_graph()
    wrong = {part: sorted(graph[part] - allowed) for part, allowed in ALLOWED.items() if graph[part] - allowed}
    assert wrong == {}


def test_only_the_entry_points_import_the_composition_root():
    """`main` runs the run; `compile_check` compiles every program of it for devices not attached."""
    graph = import_graph()
    assert sorted(part for part, imports in graph.items() if "run" in imports and part != "run") == [
        "compile_check",
        "main",
    ]
