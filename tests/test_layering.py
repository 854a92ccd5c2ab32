"""No request path asks what kind of model it serves: the kind-of-model check.

Front-ends (server/), the wire formats (api/), the shadow mirror (rollout/), batch jobs
(offline/) and everything else reach a model through its version's execution path
(repository/paths/) and ask it for a task by name (`serves`, `serving`), so a new kind
of model is a new path, not an edit in every protocol. Only repository/ (which picks the
path) and llm/ (the engine) may know the kinds; so may the modules in ALLOWED, which
are not request paths and work on one kind by design.

The check (`kind_switches`), from the source (ast), flags:
- reading a version's per-kind state: `.llm`, `.step_engine`, `.batcher`,
  `.instances`, `.unhealthy` on anything but `self`;
- comparing a backend name: `config.backend == "llm"`, `backends[name] in ("hf", ...)`;
- `isinstance(x, C)` for a kind's class (LLMService, the paths, the engines);
- `is_llm(...)`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "bitserve"
KNOWING = ("repository", "llm")  # packages that may know the kinds
ALLOWED = {
    "backends": "each backend is one kind's code",
    "config.py": "the config schema's per-backend rules (an llm takes no dynamic_batching)",
    "quantize": "quantizes a model folder by its kind (an llm or hf folder), no requests",
    "plan": "`batching.instances` there is a capacity plan's instance count",
}
STATE = {"llm", "step_engine", "batcher", "instances", "unhealthy"}
BACKENDS = {"python", "torch", "onnx", "hf", "llm", "detector", "diffusion"}
KIND_CLASSES = {"LLMService", "LLMPath", "BatchedPath", "DiffusionPath"}
KIND_CLASSES |= {"DiffusionEngine", "LLMEngine", "AsyncLLMEngine"}


def _names(node: ast.AST) -> set[str]:
    found = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.Attribute):
            found.add(n.attr)
    return found


def _constants(node: ast.AST) -> set:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)}


def _switch(node: ast.AST) -> str | None:
    own = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
    if (
        isinstance(node, ast.Attribute)
        and node.attr in STATE
        and not (own and node.value.id == "self")
    ):
        return f"reads .{node.attr}"
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        names = [_constants(s) & BACKENDS for s in sides]
        about = [any("backend" in n for n in _names(s)) for s in sides]
        if any(names) and any(about):
            return "compares a backend name"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        kinds = node.func.id == "isinstance" and _names(node.args[-1]) & KIND_CLASSES
        if kinds:
            return "isinstance on a kind's class"
        if node.func.id == "is_llm":
            return "calls is_llm"
    return None


def kind_switches(root: Path = ROOT) -> list[str]:
    """`module:line: what` for every switch on the kind of model outside KNOWING and
    ALLOWED."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in KNOWING or parts[0] in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (why := _switch(node)) is not None:
                found.append(f"{'/'.join(parts)}:{node.lineno}: {why}")
    return found


def test_no_request_path_switches_on_the_kind_of_model():
    assert kind_switches() == []


def test_every_allowance_names_a_real_module():
    for name in ALLOWED:
        assert (ROOT / name).exists(), name


def test_the_check_sees_each_kind_of_switch(tmp_path):
    root = tmp_path / "bitserve"
    (root / "server").mkdir(parents=True)
    (root / "repository").mkdir()
    cases = {
        "a.py": "if version.llm is not None:\n    pass\n",
        "b.py": "engine = version.step_engine()\n",
        "c.py": 'ok = config.backend in ("llm", "hf")\n',
        "d.py": 'llms = [n for n in models if backends[n] == "llm"]\n',
        "e.py": "ok = isinstance(thing, LLMService)\n",
        "f.py": "ok = is_llm(name)\n",
    }
    for name, source in cases.items():
        (root / "server" / name).write_text(source)
    (root / "repository" / "g.py").write_text("x = version.llm\n")  # allowed there
    (root / "server" / "h.py").write_text('ok = version.serves("generate") and self.llm\n')
    found = kind_switches(root)
    assert sorted(f.split(":")[0] for f in found) == [f"server/{n}" for n in sorted(cases)]
