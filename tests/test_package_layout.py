"""The folder layout is the architecture (docs/layout.md, docs/architecture.md).

Layers, top to bottom: the facade (roundpipe/*.py) -> coordinator | worker -> shared ->
protocol. Inside the coordinator the rooms are layered too: service -> training ->
planning, spec. Every product module is checked, at any depth; imports inside functions
and under ``TYPE_CHECKING`` count (a lazy import still ties two modules together)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: import-name prefix -> folder, as pyproject.toml's package-dir maps them
FOLDERS = {
    "roundpipe.coordinator": "coordinator",
    "roundpipe.worker": "worker",
    "roundpipe.protocol": "protocol",
    "roundpipe.shared": "shared",
    "roundpipe": "roundpipe",
}
#: layer -> the layers it may import (itself included)
ALLOWED = {
    "facade": {"facade", "service", "training", "planning", "spec", "coordinator", "worker"}
    | {"shared", "protocol"},
    "coordinator": {"coordinator"},
    "service": {"service", "training", "planning", "spec", "shared", "protocol"},
    "training": {"training", "planning", "spec", "shared", "protocol"},
    "planning": {"planning", "shared", "protocol"},
    "spec": {"spec", "shared", "protocol"},
    "worker": {"worker", "shared", "protocol"},
    "shared": {"shared", "protocol"},
    "protocol": {"protocol"},
}
MAX_MODULE_LINES = 1000


def _modules() -> dict[str, Path]:
    """Every product module by its import name."""
    out = {}
    for prefix, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if folder == "roundpipe" and parts and parts[0] == "demo_data":
                continue  # data generators, not product code
            out[".".join([prefix, *parts])] = path
    return out


MODULES = _modules()


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[1:2] == ["coordinator"]:
        return (
            parts[2]
            if len(parts) > 3 or (len(parts) == 3 and parts[2] in ALLOWED)
            else ("coordinator")
        )
    if len(parts) > 1 and parts[1] in ("worker", "shared", "protocol"):
        return parts[1]
    return "facade"


def _imports(module: str) -> list[tuple[int, str]]:
    """(line, imported project module) for every import in ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from package import module` imports the module; otherwise the package
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        out += [(node.lineno, name) for name in names if name in MODULES]
    return out


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module: str) -> None:
    layer = _layer(module)
    bad = [
        f"{MODULES[module].relative_to(ROOT)}:{line} ({layer}) imports {name} ({_layer(name)})"
        for line, name in _imports(module)
        if _layer(name) not in ALLOWED[layer]
    ]
    assert not bad, "imports must go down the layers (docs/layout.md):\n" + "\n".join(bad)


def test_no_import_circles() -> None:
    """No module reaches itself through imports (package ``__init__`` re-exports aside:
    importing a package's name runs its ``__init__``, which is not a dependency of the
    modules it re-exports)."""
    graph = {
        m: {name for _, name in _imports(m) if name != m}
        for m in MODULES
        if MODULES[m].name != "__init__.py"
    }
    for m in graph:
        graph[m] = {n for n in graph[m] if n in graph}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_product_module_is_over_1000_lines() -> None:
    big = {
        str(path.relative_to(ROOT)): n
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not big, f"split these along their jobs (one module, one job): {big}"


def test_every_folder_is_checked() -> None:
    """A sub-package the layer map does not know would be checked as the facade."""
    for module in MODULES:
        parts = module.split(".")
        if parts[1:2] == ["coordinator"] and len(parts) > 3:
            assert parts[2] in ALLOWED, f"{module}: add its room to ALLOWED"


def test_the_demo_does_not_import_the_cli() -> None:
    """The CLI runs the demo; both render progress through roundpipe.progress, so the demo
    never imports the CLI back (an import cycle)."""
    names = [name for _, name in _imports("roundpipe.demo")]
    assert "roundpipe.cli" not in names and "roundpipe.progress" in names


def test_the_client_and_the_cli_start_without_torch() -> None:
    """`roundpipe status` and friends, and `import roundpipe.client`, load no torch (nor
    transformers): that import costs seconds per command. A verb that computes (plan,
    demo, chaos) imports what it needs when it runs."""
    probe = (
        "import sys, roundpipe.cli, roundpipe.client;"
        "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
