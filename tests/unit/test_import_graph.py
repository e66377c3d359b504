"""The package's imports run one way: no module reaches itself through the modules it imports.

Every ``import`` / ``from ... import`` of an ``hf_paged`` module counts, at module level or
inside a function, ``TYPE_CHECKING`` blocks included; read from the source, nothing imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hf_paged

ROOT = Path(hf_paged.__file__).parent


def _modules() -> dict[str, Path]:
    """Module name -> its file, for every module of the package."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from pkg import sub`` names ``pkg.sub``
    where ``sub`` is a module, else ``pkg``)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = [f"{node.module}.{alias.name}" for alias in node.names]
                found = [sub for sub in subs if sub in modules]
                imported.update(found if len(found) == len(subs) else [node.module, *found])
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_scheduler_and_plain_data_import_no_speculation():
    """The scheduler knows speculation through its ``Verifier`` alone; ``sampling_params``
    sits below everything; no proposer needs the engine core."""
    graph = import_graph()
    assert not any(m.startswith("hf_paged.engine.speculation") for m in
                   graph["hf_paged.engine.scheduler"] | graph["hf_paged.engine.queues"])
    assert graph["hf_paged.sampling_params"] == set()
    for name, imported in graph.items():
        if name.startswith("hf_paged.engine.speculation"):
            assert "hf_paged.engine.engine" not in imported, name


def test_lora_imports_nothing_of_the_package():
    for name, imported in import_graph().items():
        if name.startswith("hf_paged.lora"):
            assert all(m.startswith("hf_paged.lora") for m in imported), name
