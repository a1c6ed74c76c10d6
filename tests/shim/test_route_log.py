"""The builder's route log: once per process for each of the first step with prefills, the first
on FlashAttention-2 and the first gathering cached context (the only sign in a vLLM log of which
path ran)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
from int8kv_shim import attention_impl  # noqa: E402


def _split(num_flash: int, context_tokens: int, num_ours: int) -> SimpleNamespace:
    ours = (SimpleNamespace(seq_lens=torch.zeros(num_ours)),) if num_ours else ()
    flash = SimpleNamespace(seq_lens=torch.zeros(num_flash), context_tokens=context_tokens)
    return SimpleNamespace(flash=flash, our_kernels=lambda: ours)


@pytest.fixture
def route_log(monkeypatch):
    """(the builder's _log_route, the lines it logged) in a fresh process state."""
    lines: list[str] = []
    monkeypatch.setattr(attention_impl, "_routes_logged", set())
    monkeypatch.setattr(
        attention_impl, "logger", SimpleNamespace(info=lambda f, *a: lines.append(f % a))
    )
    return attention_impl.Int8KVAttentionMetadataBuilder._log_route, lines


def test_each_route_is_logged_the_first_time_it_runs(route_log) -> None:
    log, lines = route_log
    steps = [
        (None, "our kernels (no sequence qualifies for FlashAttention-2)"),
        (None, "our kernels (no sequence qualifies for FlashAttention-2)"),
        (_split(2, 0, 3), None),
        (_split(1, 0, 0), None),
        (_split(1, 96, 0), None),
        (_split(3, 40, 1), None),
    ]
    for split, reason in steps:
        log(None, split, reason)
    assert lines == [
        "int8kv-shim: first step with prefills: our kernels (no sequence qualifies for "
        "FlashAttention-2)",
        "int8kv-shim: first FlashAttention-2 step with prefills: 2 sequence(s) on "
        "FlashAttention-2 (0 context tokens gathered), 3 on our kernels",
        "int8kv-shim: first context-gathering step with prefills: 1 sequence(s) on "
        "FlashAttention-2 (96 context tokens gathered), 0 on our kernels",
    ]


def test_a_first_step_with_context_says_everything_at_once(route_log) -> None:
    log, lines = route_log
    for split in (_split(2, 65, 0), _split(1, 0, 0), None):
        log(None, split, "our kernels (FlashAttention-2 failed earlier in this process)")
    assert lines == [
        "int8kv-shim: first step with prefills: 2 sequence(s) on FlashAttention-2 "
        "(65 context tokens gathered), 0 on our kernels"
    ]
