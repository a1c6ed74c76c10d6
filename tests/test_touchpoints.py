"""docs/vllm-touchpoints.md lists every site the shim patches, and its file:line references still
point at what they name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "vllm-touchpoints.md"
PATCH = REPO / "int8kv_shim" / "patch.py"
# a `path/to/file.py:123` reference, and any other `code` span of the same line
REFERENCE = re.compile(r"`([\w/.-]+\.py):(\d+)`")
CODE = re.compile(r"`([^`]+)`")
SHIM = ("int8kv_shim/", "kernels/")


def test_every_patch_and_guard_function_is_listed() -> None:
    tree = ast.parse(PATCH.read_text())
    functions = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith(("patch_", "guard_"))
    ]
    assert len(functions) >= 11  # P1..P9 and the two guards
    doc = DOC.read_text()
    missing = [name for name in functions if f"`{name}`" not in doc]
    assert not missing, f"add to {DOC.name}: {missing}"


def _name(span: str) -> str | None:
    """The name a code span gives (``None`` for a path or a file:line reference)."""
    if "/" in span or REFERENCE.fullmatch(f"`{span}`"):
        return None
    name = span.strip('"').removesuffix("()")
    return name if " " in name else name.split(".")[-1]


def _names(text: str) -> list[str]:
    """The names of ``text``'s code spans, in order."""
    return [n for n in map(_name, CODE.findall(text)) if n]


def test_references_point_at_what_their_row_names() -> None:
    """Each file:line holds the name it cites: the row's own (its first name) or the name just
    before the reference (a row citing a second site, "``x``, ``file.py:N``")."""
    wrong = []
    checked = 0
    for text in DOC.read_text().splitlines():
        names = _names(text)
        for ref in REFERENCE.finditer(text):
            path, number = ref.groups()
            source = (REPO / path).read_text().splitlines()
            assert names, f"a row without a name cites {path}:{number}"
            before = _names(text[: ref.start()])
            cited = {names[0], *before[-1:]}
            checked += path.startswith(SHIM)
            line = source[int(number) - 1] if int(number) <= len(source) else ""
            if not any(n in line for n in cited):
                now = [i + 1 for i, s in enumerate(source) if any(n in s for n in cited)]
                wrong.append(f"{path}:{number} holds none of {sorted(cited)}; now at {now[:3]}")
    assert checked >= 30
    assert not wrong, "\n".join(wrong)
