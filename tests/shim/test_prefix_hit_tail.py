"""Patch P14 on vLLM 0.24.0's real KV-cache managers (prefix_hit_check.py, in its own interpreter
with the shim active): with a two-page tail, a prefix-cache hit gives its last page back, so that
page is recomputed into the tail and read exact, as it is after a miss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

CHECK = Path(__file__).with_name("prefix_hit_check.py")
PAGE = 64


@pytest.fixture(scope="module")
def found(run_python) -> dict[str, Any]:
    return run_python(CHECK.read_text(), shim="1").result()


def vllm_hit(n: int) -> int:
    """vLLM's own longest hit: every full page of the first n - 1 tokens (the last is recomputed)."""
    return (n - 1) // PAGE * PAGE


def test_the_coordinators_are_wrapped_on_import_and_unwrapped_by_uninstrument(found) -> None:
    assert found["mode"] == "active" and found["applied_on_import"]
    assert set(found["wrapped"].values()) == {"FunctionWrapper"}
    assert set(found["unwrapped"].values()) == {"function"}


@pytest.mark.parametrize("config", ["int4_tail1", "int8_tail1", "int8_tail2", "int8_tail3"])
def test_hits_are_vllms_own_without_a_second_tail_page(found, config: str) -> None:
    assert found[config] == [vllm_hit(n) for n in found["lengths"]]


@pytest.mark.parametrize("config", ["int4_tail2", "hybrid_tail2"])
def test_a_two_page_tail_gives_the_hits_last_page_back(found, config: str) -> None:
    assert found[config] == [max(0, vllm_hit(n) - PAGE) for n in found["lengths"]]
    assert found["lengths"][0] == 65 and found[config][0] == 0  # one page and a token: no hit


def test_hybrid_hits_with_one_tail_page_are_vllms_own(found) -> None:
    assert found["hybrid_tail1"] == found["int4_tail1"]


def test_uninstrument_gives_vllms_hit_back(found) -> None:
    assert found["int4_tail2_uninstrumented"] == [vllm_hit(n) for n in found["lengths"]]
