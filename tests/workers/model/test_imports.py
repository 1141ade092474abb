"""The whole tree imports without circles, and never from a lower layer up to a higher one.

Reads every module's imports with `ast` (no module is executed), resolves relative names, and checks that the graph
of the tree's modules (`workers`, `pipeline`, `jobs`, `bench`) is acyclic and follows `LAYERS`. Imports inside functions count: a deferred import that closes a circle hides
it from the interpreter, not from a reader. Imports under `if TYPE_CHECKING:` do not run, so they do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import workers

PACKAGE_ROOT = Path(workers.__file__).resolve().parent
REPO_ROOT = PACKAGE_ROOT.parent
PACKAGES = ("workers", "pipeline", "jobs", "bench")

# The layers, low to high: a module imports from its own layer and the layers below it, never from one above. A
# module belongs to the layer of the longest prefix that names it.
LAYERS = (
    ("workers.model.kernels",),  # native, Triton and reference kernels
    ("workers.model.checkpoint",),  # HybridConfig, the families' config readers and weight maps
    ("workers.model.distributed",),  # tensor parallelism: the rank group's collectives, how a model splits
    ("workers.model.state", "workers.model.kv_blocks"),  # state slots, KV caches, block tables
    ("workers.model.layers",),  # the modules of a hybrid model
    ("workers.model.steps",),  # decode plans, CUDA graph plans, draft chains over the layers
    ("workers.model.loader", "workers.model"),  # loading a checkpoint into a model; the package's face
    ("workers.sampling", "workers.structured_outputs", "workers.spec_stats", "workers.requests", "workers.budget",
     "workers.tokenizer", "workers.columns", "workers.heartbeat", "workers.prefix_cache", "workers.logprobs",
     "workers.detokenize"),  # a request and how it samples
    ("workers.spec_decode",),  # proposers, policies, rejection sampling
    ("workers",),  # the engine: config, scheduler, executors, runner, scorer, rows, stream
    ("workers.actor",),  # the Ray actor's plain class
    ("pipeline",),  # the driver side
    ("bench", "jobs"),  # benchmark code and the entry points
)  # fmt: skip


def module_names(root: Path) -> dict[str, Path]:
    """Every module under `root`, by dotted name (a package by its own name, for its `__init__.py`)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def is_type_checking_guard(node: ast.If) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(tree: ast.AST):
    """Every `import` / `from ... import` node, skipping the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and is_type_checking_guard(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The `workers.*` modules that module `name` (file `path`) imports.

    `from a.b import c` names module `a.b.c` when that is a module, else `a.b` (c is an attribute of it). Importing a
    submodule also runs its parents' `__init__`, but a package initialising its own children is not a circle, so
    only the named module counts.
    """
    is_package = path.name == "__init__.py"
    targets = set()
    for node in import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = name.split(".") if is_package else name.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            targets.add(submodule if submodule in known else base)
    return {target for target in targets if target in known and target != name}


def import_graph(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """Module name → the package's modules it imports."""
    modules = module_names(root)
    known = set(modules)
    return {name: imported_modules(name, path, known) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None when it is acyclic (iterative depth-first search)."""
    unvisited, on_path, done = 0, 1, 2
    color = dict.fromkeys(graph, unvisited)
    for start in sorted(graph):
        if color[start] != unvisited:
            continue
        path = [start]
        color[start] = on_path
        pending = [iter(sorted(graph[start]))]
        while pending:
            nxt = next(pending[-1], None)
            if nxt is None:
                color[path.pop()] = done
                pending.pop()
            elif color[nxt] == on_path:
                return path[path.index(nxt) :] + [nxt]
            elif color[nxt] == unvisited:
                color[nxt] = on_path
                path.append(nxt)
                pending.append(iter(sorted(graph[nxt])))
    return None


def test_find_cycle_reports_the_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_imported_modules_resolves_relative_and_skips_type_checking(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .sub import thing\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "thing.py").write_text(
        "from typing import TYPE_CHECKING\nfrom .. import other\nif TYPE_CHECKING:\n    from pkg import late\n"
        "def f():\n    from pkg.sub import missing_name\n"
    )
    (package / "other.py").write_text("")
    (package / "late.py").write_text("")
    graph = import_graph(package)
    assert graph["pkg"] == {"pkg.sub.thing"}
    assert graph["pkg.sub.thing"] == {"pkg.other", "pkg.sub"}


def test_workers_imports_are_acyclic():
    graph = import_graph()
    assert "workers.model" in graph and graph["workers.model"], "the graph should see workers.model's imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in workers: " + " -> ".join(cycle)


def tree_graph() -> dict[str, set[str]]:
    """Module name → the tree's modules it imports, over every package of the tree."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        modules.update(module_names(REPO_ROOT / package))
    known = set(modules)
    return {name: imported_modules(name, path, known) for name, path in modules.items()}


def layer_of(name: str) -> int:
    """The index in `LAYERS` of the longest prefix naming module `name`."""
    matches = [
        (len(prefix), i)
        for i, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if name == prefix or name.startswith(prefix + ".")
    ]
    assert matches, f"{name} is in no layer: add it to LAYERS"
    return max(matches)[1]


def test_layer_of_takes_the_longest_prefix():
    assert layer_of("workers.model.layers.attention") == 4
    assert layer_of("workers.model") == layer_of("workers.model.loader") == 6
    assert layer_of("workers.scheduler") == 9 and layer_of("workers.actor") == 10
    assert layer_of("bench.generation") == layer_of("jobs.generate")


def test_the_tree_imports_are_acyclic():
    graph = tree_graph()
    assert {"pipeline.driver", "jobs.generate", "bench.generation"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_imports_from_a_higher_layer():
    graph = tree_graph()
    upward = [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a]) if layer_of(b) > layer_of(a)]
    assert not upward, "imports from a higher layer: " + "; ".join(upward)
