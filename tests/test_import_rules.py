"""The package's layering, read from the source's own import statements (no module is run).

Every `import` counts, those inside functions included (a lazy import still ties two modules
together); only imports under `if TYPE_CHECKING:` are left out, as they never run. The rules:
the core is pure Python (no torch, no server, no models); the console reaches nothing of the
engine, however deep it follows its imports; the server talks to the engine core only through
the client and the IPC messages; and no two modules of the package import each other, directly
or around a circle.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Folders and the import names they are installed as (pyproject's package-dir).
SOURCES = {
    "appliance": ROOT / "appliance",
    "appliance.console": ROOT / "console",
    "appliance.kernels": ROOT / "kernels",
    "appliance.templates": ROOT / "templates",
}


def _module_files() -> dict[str, Path]:
    files: dict[str, Path] = {}
    for prefix, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([prefix, *parts])] = path
    return files


MODULES = _module_files()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST, module: str) -> set[str]:
    """Dotted names imported anywhere in `tree` except under `if TYPE_CHECKING:`."""
    names: set[str] = set()
    is_package = MODULES[module].name == "__init__.py"
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub when there is one; the
            # package itself counts for the names that are not submodules (its __init__ runs
            # either way: `reachable` adds every package on a module's path).
            subs = {f"{base}.{a.name}" for a in node.names} & MODULES.keys()
            names.update(subs)
            if len(subs) < len(node.names):
                names.add(base)
        stack.extend(ast.iter_child_nodes(node))
    return names


@cache
def imports_of(module: str) -> frozenset[str]:
    """What `module` imports: the package's own modules by name, anything else by its top
    level name (torch, litestar, ...)."""
    tree = ast.parse(MODULES[module].read_text("utf-8"))
    out: set[str] = set()
    for name in _imported_names(tree, module):
        if name in MODULES:
            out.add(name)
        elif name.split(".")[0] == "appliance":
            # `appliance.x.y` where y is a name inside module appliance.x
            parent = name.rsplit(".", 1)[0]
            if parent in MODULES:
                out.add(parent)
        else:
            out.add(name.split(".")[0])
    out.discard(module)
    return frozenset(out)


def parents(module: str) -> list[str]:
    """The packages Python imports before `module` (their __init__ runs first), below the
    top level: appliance/__init__.py reaches the engine only lazily, through __getattr__ (the
    reader counts imports inside functions, so it would see the engine everywhere)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts)) if ".".join(parts[:i]) in MODULES]


def reachable(module: str) -> set[str]:
    """Everything importing `module` imports: its imports, theirs, and every package on the
    way (importing appliance.kernels.kv_formats runs kernels/__init__.py first)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        for dep in [*imports_of(current), *parents(current)]:
            if dep not in seen:
                seen.add(dep)
                if dep in MODULES:
                    todo.append(dep)
    return seen


def _in(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _modules_in(package: str) -> list[str]:
    return sorted(m for m in MODULES if _in(m, package))


def test_the_reader_sees_imports_inside_functions_and_skips_type_checking_blocks() -> None:
    # The engine client imports the core process's entry point at module level, the daemon
    # imports uvicorn inside a function; the server's state names Generation for typing only.
    assert "appliance.engine.core_process" in imports_of("appliance.engine.client")
    assert "uvicorn" in imports_of("appliance.server.daemon")
    assert "appliance.server.generate" not in imports_of("appliance.server.state")


def test_core_imports_no_torch_no_server_no_models() -> None:
    bad = {
        m: sorted(
            d
            for d in reachable(m)
            if d == "torch"
            or _in(
                d,
                "appliance.server",
                "appliance.models",
                "appliance.engine",
                "appliance.layers",
                "appliance.kernels",
            )
        )
        for m in _modules_in("appliance.core")
    }
    assert {m: d for m, d in bad.items() if d} == {}


def test_console_reaches_nothing_of_the_engine() -> None:
    engine_side = (
        "appliance.engine",
        "appliance.core",
        "appliance.models",
        "appliance.layers",
        "appliance.kernels",
        "appliance.server.state",
        "appliance.server.app",
    )
    # What a model is (its config's shape, a GGUF file's metadata) and what the kernels can
    # run (the CPU's features, the KV formats' names) are read torch-free by the plan the
    # console shows; torch stays unreachable whatever they import.
    model_description = (
        "appliance.models",
        "appliance.models.args",
        "appliance.models.demo_spec",
        "appliance.models.gguf_meta",
        "appliance.kernels",
        "appliance.kernels.cpu_features",
        "appliance.kernels.kv_formats",
    )
    bad = {
        m: sorted(
            d
            for d in reachable(m)
            if d == "torch" or (_in(d, *engine_side) and d not in model_description)
        )
        for m in _modules_in("appliance.console")
    }
    assert {m: d for m, d in bad.items() if d} == {}


def test_server_reaches_the_core_process_only_through_the_client() -> None:
    # The client names core_main as the child process's target; nothing else of the core
    # process (its loop, its request table) is the server's business.
    bad = {
        m: sorted(d for d in imports_of(m) if d == "appliance.engine.core_process")
        for m in _modules_in("appliance.server")
    }
    assert {m: d for m, d in bad.items() if d} == {}
    assert "appliance.engine.core_process" not in reachable("appliance.server.openai") - reachable(
        "appliance.engine.client"
    )


def package_graph() -> dict[str, list[str]]:
    return {m: sorted(d for d in imports_of(m) if d in MODULES) for m in MODULES}


def circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, deps = work[-1]
            advanced = False
            for dep in deps:
                if dep not in index:
                    index[dep] = low[dep] = counter
                    counter += 1
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(graph[dep])))
                    advanced = True
                    break
                if dep in on_stack:
                    low[node] = min(low[node], index[dep])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_the_circle_finder_finds_a_circle_and_leaves_a_chain_alone() -> None:
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": [], "e": ["d"]}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": ["b"], "b": ["c"], "c": []}) == []


def test_no_import_circles() -> None:
    assert circles(package_graph()) == []


# -- folders -------------------------------------------------------------------------------------


def room(module: str) -> str:
    """Where a module lives, by folder (import names mapped through SOURCES: appliance.kernels.x
    is kernels/x.py); the package's top-level modules (config, plan, stats, ...) are each their
    own room, as they are imported by folders that they do not import back."""
    folder = str(MODULES[module].parent.relative_to(ROOT))
    return module if folder == "appliance" else folder


def folder_graph() -> dict[str, list[str]]:
    graph: dict[str, set[str]] = {room(m): set() for m in MODULES}
    for m in MODULES:
        for dep in imports_of(m):
            if dep in MODULES and room(dep) != room(m):
                graph[room(m)].add(room(dep))
    return {r: sorted(deps) for r, deps in graph.items()}


def test_import_names_map_to_the_design_cards_folders() -> None:
    assert room("appliance.kernels.paged_attention") == "kernels"
    assert room("appliance.console.app") == "console"
    assert room("appliance.engine.loader") == "appliance/engine"
    assert room("appliance.config") == "appliance.config"
    assert "kernels" in folder_graph()["appliance/layers"]


def test_no_folder_circles() -> None:
    """Two folders never import each other, directly or around a circle (the module-level
    test above cannot see a circle of folders whose modules form none)."""
    assert circles(folder_graph()) == []


def test_kernels_are_leaves() -> None:
    """kernels/ imports torch, triton, the standard library and its own files: what a kernel
    needs from the policy (limits, layouts, formats) lives in kernels/."""
    bad = {
        m: sorted(d for d in imports_of(m) if _in(d, "appliance") and room(d) != "kernels")
        for m in MODULES
        if room(m) == "kernels"
    }
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_engine_imports_no_operator_tool() -> None:
    """The engine, its device backends, layers, models and kernels import nothing of the
    operator tools, the benches, the server or the console (a tool may import the engine)."""
    engine_side = ("appliance.engine", "appliance.cpu", "appliance.layers", "appliance.models")
    tools = ("appliance.tools", "appliance.bench", "appliance.server", "appliance.console")
    bad = {
        m: sorted(d for d in reachable(m) if _in(d, *tools))
        for m in MODULES
        if _in(m, *engine_side, "appliance.kernels", "appliance.core")
    }
    assert {m: d for m, d in bad.items() if d} == {}


# -- the layout table of docs/architecture.md, row by row ------------------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _room_name(text: str) -> str:
    """A table cell's `kernels/` or `appliance/engine/` -> its room; module names as they are."""
    return text.rstrip("/")


def layout_table() -> dict[str, set[str] | None]:
    """room -> the rooms its row says it may import (None: anything)."""
    section = ARCHITECTURE.read_text("utf-8").split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[str] | None] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rooms = [_room_name(x) for x in re.findall(r"`([^`]+)`", cells[0])]
        allowed = cells[-1]
        names = None if allowed == "anything" else set(re.findall(r"`([^`]+)`", allowed))
        for r in rooms:
            table[r] = None if names is None else {_room_name(x) for x in names}
    return table


def test_the_layout_table_reads_as_rooms() -> None:
    table = layout_table()
    assert table["kernels"] == set() and table["appliance/tools"] is None
    assert table["appliance/layers"] == {"kernels"}
    assert "appliance.config" in table and "appliance.stats" in table


def test_every_room_is_in_the_layout_table_and_every_row_is_a_room() -> None:
    rooms = set(folder_graph())
    table = set(layout_table())
    assert (rooms - table, table - rooms) == (set(), set())


def test_each_room_imports_only_what_its_row_allows() -> None:
    table = layout_table()
    bad = {
        r: sorted(set(deps) - allowed)
        for r, deps in folder_graph().items()
        if (allowed := table.get(r, set())) is not None and set(deps) - allowed
    }
    assert bad == {}
