"""The decode-only skip of vLLM's decodes-first reorder: ``is_decode_only`` against vLLM 0.24.0's
own ``reorder_batch_to_split_decodes_and_prefills`` on generated batches, and the hook on the real
V1 model runner (reorder_hook_check.py, in its own interpreter with the shim active)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from int8kv_shim.batch_reorder import is_decode_only

CHECK = Path(__file__).with_name("reorder_hook_check.py")

# (computed, prompt, scheduled) of one request in each of vLLM's four regions
DECODE = st.tuples(st.integers(1, 300), st.integers(1, 300), st.just(1)).map(
    lambda r: (max(r[0], r[1]), r[1], 1)
)
PROMPT_REMAINDER = (
    st.tuples(st.integers(1, 299), st.integers(2, 300))
    .filter(lambda r: r[0] < r[1])
    .map(lambda r: (r[0], r[1], 1))
)
CONTINUATION = st.tuples(st.integers(1, 300), st.integers(2, 300), st.integers(2, 64))
FIRST_CHUNK = st.tuples(st.just(0), st.integers(1, 300), st.integers(1, 64))


def _batch(requests: list[tuple[int, int, int]]) -> tuple[Any, Any, list[tuple[int, int]]]:
    req_ids = [f"r{i}" for i in range(len(requests))]
    swaps: list[tuple[int, int]] = []
    batch = SimpleNamespace(
        req_ids=req_ids,
        num_computed_tokens_cpu=np.array([r[0] for r in requests], dtype=np.int32),
        num_prompt_tokens=np.array([r[1] for r in requests], dtype=np.int32),
        swap_states=lambda i, j: swaps.append((i, j)),
    )
    out = SimpleNamespace(
        num_scheduled_tokens={i: r[2] for i, r in zip(req_ids, requests, strict=True)}
    )
    return batch, out, swaps


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(DECODE, DECODE, PROMPT_REMAINDER, CONTINUATION, FIRST_CHUNK),
        min_size=0,
        max_size=12,
    )
)
def test_decode_only_batches_are_the_ones_vllm_leaves_alone(
    requests: list[tuple[int, int, int]],
) -> None:
    utils = pytest.importorskip("vllm.v1.attention.backends.utils")
    batch, out, swaps = _batch(requests)
    skip = is_decode_only(batch, out, 1)
    moved = utils.reorder_batch_to_split_decodes_and_prefills(batch, out, decode_threshold=1)
    if skip:
        assert not moved and not swaps
    # and it is not a test of a function that never skips: all decodes is exactly when it does
    all_decodes = all(c > 0 and c >= p and s == 1 for c, p, s in requests)
    assert skip == all_decodes


def test_no_threshold_means_no_reorder_to_skip() -> None:
    batch, out, _ = _batch([(10, 5, 1)])
    assert is_decode_only(batch, out, 1)
    assert not is_decode_only(batch, out, None)


@pytest.fixture(scope="module")
def hook(run_python) -> dict[str, Any]:
    return run_python(CHECK.read_text(), shim="1").result()


def test_the_hook_skips_vllms_reorder_only_when_it_would_move_nothing(hook) -> None:
    assert hook["before"] == "function"
    assert hook["after"] == "FunctionWrapper" and hook["wraps_vllm_directly"] == "function"
    assert hook["unpatched"]["decodes"] == {"vllm_calls": 1, "order": ["r0", "r1", "r2"]}
    assert hook["patched"]["decodes"] == {"vllm_calls": 0, "order": ["r0", "r1", "r2"]}
    # anything but decodes goes to vLLM, which moves the decode first, as without the hook
    for name in ("prefill first", "prompt remainder first"):
        assert hook["patched"][name] == hook["unpatched"][name]
        assert hook["patched"][name] == {"vllm_calls": 1, "order": ["r1", "r0"]}


def test_uninstrument_gives_vllm_its_reorder_back(hook) -> None:
    assert hook["after_uninstrument"] == "function"
