"""The folder layout is the architecture (docs/layout.md): coordinator/ and worker/ depend
only on shared/ and protocol/, never on each other; shared/ and protocol/ on neither."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "coordinator": ("roundpipe.worker",),
    "worker": ("roundpipe.coordinator",),
    "shared": ("roundpipe.coordinator", "roundpipe.worker"),
    "protocol": ("roundpipe.coordinator", "roundpipe.worker"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_go_one_way(package: str) -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / package).glob("*.py"))
        for line, name in _imports(path)
        if name.startswith(FORBIDDEN[package])
    ]
    assert not bad, "move the shared helper to shared/:\n" + "\n".join(bad)


def test_the_demo_does_not_import_the_cli() -> None:
    """The CLI runs the demo; both render progress through roundpipe.progress, so the demo
    never imports the CLI back (an import cycle)."""
    names = [name for _, name in _imports(ROOT / "roundpipe" / "demo.py")]
    assert "roundpipe.cli" not in names and "roundpipe.progress" in names
