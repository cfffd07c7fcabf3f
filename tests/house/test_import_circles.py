"""No import circles in the engine, the aligner, the command line, the clients and the benchmarks:
every import, at the top of a module or inside a function, counts."""

from __future__ import annotations

from tests.house.test_architecture import ROOT, imports_of

PACKAGES = ("engine", "aligner", "gateway", "cadence", "clients", "bench")


def import_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Each module of `packages` -> the modules of `packages` it imports."""
    paths = {}
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {
        module: {name for name in imports_of(path.read_text(encoding="utf-8"), module) if name in paths}
        - {module}
        for module, path in paths.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    part.append(member)
                    if member == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    found = circles(import_graph(PACKAGES))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(part) for part in found)


def test_the_finder_sees_a_circle_through_a_function_level_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert "engine.bridge" in imports_of("def f():\n    from engine.bridge import listen\n", "engine.api")
