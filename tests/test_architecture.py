"""The shape of the package: data flows one way (no import circles between files, nor between
rooms: a folder, or a single-file module, taken whole), and `import remat` needs nothing a platform
may lack.

The import graph is built from the source with `ast`, so it sees every import a module makes:
at the top, inside functions, and under `TYPE_CHECKING`. A lazy import still says which room
depends on which, and a circle through one is a circle all the same.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "src" / "remat"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """{module: the modules of the package it imports}, by reading every file's imports."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # `from . import sibling` names a module, not the package's __init__.
                candidates = [f"{target}.{a.name}" if f"{target}.{a.name}" in files else target for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(c for c in candidates if c in files and c != name)
    return graph


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{room: the other rooms it imports}; `remat.X...` is in room X, the package's face (`remat`) in none."""

    def room(module: str) -> str | None:
        return module.split(".")[1] if "." in module else None

    rooms: dict[str, set[str]] = {}
    for name, targets in graph.items():
        if (here := room(name)) is not None:
            rooms.setdefault(here, set()).update(r for r in map(room, targets) if r not in (None, here))
    return rooms


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_reader_finds_a_circle():
    """The checker itself: a circle made by hand is found, a chain is not."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    # No circle between files, one between rooms (a.top -> b -> a.low: room a -> b -> a).
    files = {"remat": {"remat.a.top"}, "remat.a.top": {"remat.b"}, "remat.b": {"remat.a.low"}, "remat.a.low": set()}
    assert cycles(files) == [] and cycles(room_graph(files)) == [["a", "b"]]


def test_the_graph_sees_lazy_and_type_checking_imports():
    graph = import_graph()
    assert "remat.config" in graph["remat.plan"]  # a top-level import
    assert len(graph) > 20 and sum(map(len, graph.values())) > 50
    assert "saving" in room_graph(graph)["config"] and "remat" not in room_graph(graph)


@pytest.mark.parametrize("level", ["files", "rooms"])
def test_no_import_circles_in_the_package(level):
    graph = import_graph() if level == "files" else room_graph(import_graph())
    found = cycles(graph)
    assert found == [], f"import circles between {level} (each list imports itself through the others): {found}"


def test_no_room_below_the_wrapper_imports_it():
    """`remat.model` (the wrapper) is the top: only the package's face imports it."""
    importers = sorted(name for name, targets in import_graph().items() if "remat.model" in targets)
    assert importers == ["remat", "remat.demo"] or importers == ["remat"], importers


def test_import_remat_works_without_fcntl(tmp_path):
    """Windows has no `fcntl`: remat's locks come from `filelock`. A save and a load run with
    `fcntl` made unimportable."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["fcntl"] = None  # `import fcntl` now raises ImportError
        import remat
        from remat import CheckpointConfig
        config = CheckpointConfig(every_n_layers=2)
        config.save_pretrained({str(tmp_path)!r})
        assert CheckpointConfig.from_pretrained({str(tmp_path)!r}).every_n_layers == 2
        assert "fcntl" not in sys.modules or sys.modules["fcntl"] is None
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_no_torch_cuda_call_outside_the_cuda_transport_and_the_device_shims():
    """Every other device call goes through `remat.compat.accelerator` (`torch.accelerator`): a CUDA-only call
    elsewhere would make that path silently do nothing on XPU, NPU or MPS."""
    allowed = {PACKAGE / "transport.py", *(PACKAGE / "compat").glob("*.py")}
    found = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in allowed
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "torch.cuda" in line.split("#")[0]
    ]
    assert found == [], found
