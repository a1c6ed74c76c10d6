"""docs/vllm-touchpoints.md lists every site the shim patches, and its file:line references under
int8kv_shim/ and kernels/ still point at what they name."""

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
STRICT = ("int8kv_shim/", "kernels/")


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


def _names(line: str) -> set[str]:
    """What a row names: its code spans that are not paths, reduced to their last component."""
    names = set()
    for span in CODE.findall(line):
        if "/" in span or REFERENCE.fullmatch(f"`{span}`"):
            continue
        name = span.strip('"').removesuffix("()")
        names.add(name if " " in name else name.split(".")[-1])
    return names


def test_references_point_at_what_their_row_names() -> None:
    wrong = []
    checked = 0
    for text in DOC.read_text().splitlines():
        names = _names(text)
        for path, number in REFERENCE.findall(text):
            source = (REPO / path).read_text().splitlines()
            assert names, f"a row without a name cites {path}:{number}"
            if not path.startswith(STRICT):  # benchmarks/, tests/: the name is in the file
                assert any(n in "\n".join(source) for n in names), (path, names)
                continue
            checked += 1
            line = source[int(number) - 1] if int(number) <= len(source) else ""
            if not any(n in line for n in names):
                now = [i + 1 for i, s in enumerate(source) if any(n in s for n in names)]
                wrong.append(f"{path}:{number} holds none of {sorted(names)}; now at {now[:3]}")
    assert checked >= 30
    assert not wrong, "\n".join(wrong)
