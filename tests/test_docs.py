"""The docs name real things: every file path and module they cite exists, every Note the
code defines is in docs/architecture.md's table at the file that defines it, and nothing
cites a design document the repository does not hold."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("coordinator", "worker", "shared", "protocol", "roundpipe")
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
#: a Note is defined where its title stands alone on a line (the text follows below it)
NOTE_DEFINITION = re.compile(r"^\s*(?:#\s*)?Note \[([^\]]+)\]\s*$")
NOTE_ROW = re.compile(r"^\| \[([^\]]+)\] \| `([^`]+)` \|")
FOLDER_OF = {
    "roundpipe.coordinator": "coordinator",
    "roundpipe.worker": "worker",
    "roundpipe.shared": "shared",
    "roundpipe.protocol": "protocol",
    "roundpipe": "roundpipe",
}


def _product_files() -> list[Path]:
    return [p for folder in PRODUCT for p in sorted((ROOT / folder).rglob("*.py"))]


def _module_exists(dotted: str) -> bool:
    """``roundpipe.a.b`` names a module or package, or something inside one."""
    for prefix, folder in FOLDER_OF.items():
        if dotted == prefix or dotted.startswith(prefix + "."):
            parts = dotted[len(prefix) :].strip(".").split(".") if dotted != prefix else []
            # the longest leading run of parts that is a module; the rest names attributes
            for n in range(len(parts), -1, -1):
                base = ROOT / folder / Path(*parts[:n]) if n else ROOT / folder
                if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
                    return n >= len(parts) - 2  # at most Class.attribute after a module
            return False
    return False


def test_notes_table_matches_the_code() -> None:
    defined: dict[str, str] = {}
    for path in _product_files():
        for line in path.read_text().splitlines():
            if m := NOTE_DEFINITION.match(line):
                rel = str(path.relative_to(ROOT))
                assert m[1] not in defined or defined[m[1]] == rel, (
                    f"Note [{m[1]}] is defined twice: {defined[m[1]]} and {rel}"
                )
                defined[m[1]] = rel
    table = {
        m[1]: m[2]
        for line in (ROOT / "docs" / "architecture.md").read_text().splitlines()
        if (m := NOTE_ROW.match(line))
    }
    assert table == defined, (
        "docs/architecture.md, 'Where each Note lives', differs from the code:\n"
        f"missing: {sorted(set(defined) - set(table))}\n"
        f"not in the code: {sorted(set(table) - set(defined))}\n"
        f"moved: {sorted(n for n in table.keys() & defined.keys() if table[n] != defined[n])}"
    )


def test_every_cited_note_is_defined() -> None:
    defined = {
        m[1]
        for path in _product_files()
        for line in path.read_text().splitlines()
        if (m := NOTE_DEFINITION.match(line))
    }
    cited = {}
    for path in _product_files() + DOCS:
        for raw in re.findall(r"Note \[([^\]]+)\]", path.read_text()):
            # a name broken over lines: comment markers, quotes and indentation between
            name = re.sub(r'[\s"#]+', " ", raw).strip()
            cited.setdefault(name, str(path.relative_to(ROOT)))
    missing = {name: where for name, where in cited.items() if name not in defined}
    assert not missing, f"Notes cited but defined nowhere: {missing}"


def test_docs_cite_files_and_modules_that_exist() -> None:
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        for path in re.findall(
            r"(?<![\w./-])((?:coordinator|worker|shared|protocol|roundpipe|tests|benchmarks|"
            r"scripts|deploy)/[\w./-]*\.(?:py|sh|service|target|env|yaml))",
            text,
        ):
            if not (ROOT / path).exists():
                stale.append(f"{doc.name}: {path}")
        for dotted in re.findall(r"\broundpipe(?:\.\w+)+", text):
            if not _module_exists(dotted.rstrip(".")):
                stale.append(f"{doc.name}: {dotted}")
    assert not stale, "docs name things that do not exist:\n" + "\n".join(sorted(set(stale)))


def test_nothing_cites_a_design_document_outside_the_repository() -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in _product_files() + DOCS + sorted((ROOT / "tests").glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "ARCHITECTURE.md" in line and path.name != "test_docs.py"
    ]
    assert not hits, "say it in the project's words (docs/architecture.md):\n" + "\n".join(hits)
