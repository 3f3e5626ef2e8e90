"""Imports go down only: no module of src/posttrain imports, even inside a function or
for annotations only (`if TYPE_CHECKING:`), a module that imports it back (directly or
through others), and nothing below the command line imports it."""

import ast
from pathlib import Path

import posttrain

PACKAGE = Path(posttrain.__file__).parent


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("posttrain", *path.relative_to(PACKAGE).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the posttrain modules it imports anywhere in its text (a name imported
    from a package counts as the package unless it is a module of it)."""

    def known(name: str) -> str:
        while name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):  # under `if TYPE_CHECKING:` too
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names if a.name.split(".")[0] == "posttrain"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                if base.split(".")[0] == "posttrain":
                    deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else known(base) for a in node.names}
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_function_level_and_relative_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    real = import_graph(module_files())
    assert "posttrain.training.parallelize" in real["posttrain.worker.models"]  # imported inside its functions
    assert "posttrain.deploy.command" in real["posttrain.deploy.kuberay"]


def test_no_import_cycle():
    graph = import_graph(module_files())
    found = cycles(graph)
    detail = [{m: sorted(graph[m] & set(c)) for m in c} for c in found]
    assert not found, f"modules that import each other (module -> what it imports of the loop): {detail}"


def test_only_the_entry_points_import_the_cli():
    graph = import_graph(module_files())
    assert sorted(m for m, deps in graph.items() if "posttrain.cli" in deps) == ["posttrain.__main__"]
