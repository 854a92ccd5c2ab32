"""How the packages meet, checked from the source (ast), so a newcomer's map stays true:
the protocol front-ends reach models only through the neutral request path, no handler
imports the app that assembles them, and domain packages never reach up into HTTP.

`graph()` is the module import graph: `from bitserve.x import y` is an edge to the
module `bitserve.x.y` when that is a module, else to `bitserve.x`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "bitserve"
HANDLERS = [
    *("v2", "openai", "generate", "admin", "health", "metrics", "images", "grpc_server"),
    "console",
]


def modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        found[name] = path
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{alias.name}" for alias in node.names]
                targets.update([s for s in subs if s in known] or [node.module])
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        edges[name] = {t for t in targets if t in known and t != name}
    return edges


def imports(edges: dict[str, set[str]], source: str, target: str) -> list[str]:
    """Modules under `source` that import something under `target`."""
    return sorted(
        f"{m} -> {t}"
        for m, ts in edges.items()
        if m == source or m.startswith(source + ".")
        for t in ts
        if t == target or t.startswith(target + ".")
    )


def test_no_handler_imports_the_app():
    edges = graph()
    for handler in HANDLERS:
        assert not imports(edges, f"bitserve.server.{handler}", "bitserve.server.app")


def test_domain_packages_never_reach_up_into_the_server():
    edges = graph()
    domain = ("rollout", "repository", "backends", "batching", "llm", "quantize", "kernels")
    for package in (*domain, "vision", "diffusion", "plan", "loadtest"):
        assert not imports(edges, f"bitserve.{package}", "bitserve.server"), package


def test_only_the_server_and_the_cli_import_the_server():
    """Batch jobs and every other package use the protocol-neutral wire formats
    (bitserve.api), never the server's modules."""
    outside = [
        edge
        for edge in imports(graph(), "bitserve", "bitserve.server")
        if not edge.startswith(("bitserve.server", "bitserve.cli "))
    ]
    assert outside == [], outside


def test_repository_loading_is_a_leaf():
    edges = graph()
    assert not imports(edges, "bitserve.repository.loading", "bitserve.repository.instance")
    assert not imports(edges, "bitserve.repository.replica", "bitserve.repository.version")
    assert not imports(edges, "bitserve.repository.replica", "bitserve.repository.instance")


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def packages(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between bitserve's subpackages and top-level modules (`bitserve.llm`,
    `bitserve.config`): an edge where any module of one imports any module of another."""

    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {}
    for module, targets in edges.items():
        out.setdefault(package(module), set()).update(package(t) for t in targets)
    return {p: targets - {p} for p, targets in out.items()}


def test_no_module_import_cycle():
    assert cycles(graph()) == []


def test_no_package_import_cycle():
    """Packages form layers: config and kernels at the bottom, the server and the CLI on
    top; a package never imports one that imports it back."""
    assert cycles(packages(graph())) == []


def test_the_check_sees_a_deliberate_cycle(tmp_path):
    package = tmp_path / "bitserve"
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("")
    (package / "a" / "one.py").write_text("from bitserve.a import two\n")
    (package / "a" / "two.py").write_text("from bitserve.a.one import thing\n")
    (package / "a" / "three.py").write_text("import bitserve.a.two\n")
    edges = graph(package)
    assert cycles(edges) == [["bitserve.a.one", "bitserve.a.two"]]
    (package / "a" / "two.py").write_text("x = 1\n")
    assert cycles(graph(package)) == []


def test_the_check_sees_a_deliberate_package_cycle(tmp_path):
    """No module cycle, but package a imports b and b imports a."""
    package = tmp_path / "bitserve"
    for name in ("a", "b"):
        (package / name).mkdir(parents=True)
        (package / name / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "a" / "low.py").write_text("x = 1\n")
    (package / "a" / "high.py").write_text("from bitserve.b import mid\n")
    (package / "b" / "mid.py").write_text("from bitserve.a.low import x\n")
    edges = graph(package)
    assert cycles(edges) == []
    assert cycles(packages(edges)) == [["bitserve.a", "bitserve.b"]]
    (package / "a" / "high.py").write_text("y = 2\n")
    assert cycles(packages(graph(package))) == []
