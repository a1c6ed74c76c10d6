"""The tail-slot hooks on vLLM 0.24.0's two model runners (tail_hooks_check.py, in its own
interpreter with the shim active): attached only once an int4 layer installs the slot manager,
fed by vLLM's real V1 ``_update_states`` (decode-first reordering, an unscheduled running request,
a finished one), V2's real ``finish_requests``, dummy runs, and detached by ``uninstrument()``;
and the worker's KV memory, which holds the pool when the user gave its size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

CHECK = Path(__file__).with_name("tail_hooks_check.py")
V1 = ("v1._dummy_run", "v1._update_states")
V2 = ("v2._dummy_run", "v2.capture_model", "v2.finish_requests", "v2.prepare_inputs")
WORKER = ("worker.determine_available_memory",)


@pytest.fixture(scope="module")
def hooks(run_python) -> dict[str, Any]:
    return run_python(CHECK.read_text(), shim="1").result()


def test_the_runners_are_untouched_until_an_int4_layer_installs_the_manager(hooks) -> None:
    assert hooks["slots_before"] is None
    assert set(hooks["before_install"].values()) == {"function"}
    assert hooks["after_install"] == {name: "FunctionWrapper" for name in V1 + V2 + WORKER}
    # a second layer shares the manager and wraps nothing twice; another size is refused
    assert hooks["same_manager"] and hooks["originals_kept"]
    assert hooks["other_size"] == (
        "int8kv-shim: this process's tail pool has 4 slots on cpu; a layer asked for 8 on cpu"
    )


def test_uninstrument_gives_vllm_its_own_methods_back(hooks) -> None:
    assert hooks["after_uninstrument"] == {name: "function" for name in V1 + V2 + WORKER}


def test_v1_rows_follow_the_batch_after_update_states(hooks) -> None:
    v1 = hooks["v1"]
    assert v1["1 two prefills"] == {"order": ["a", "b"], "rows": [[0, 1, -1, -1], [1, 1, 0, 0]]}
    # vLLM moved the decode (b) in front of the continuation (a): the slots moved with them
    assert v1["2 decode first"] == {"order": ["b", "a"], "rows": [[1, 0, -1, -1], [0, 0, 0, 0]]}
    # a is running but unscheduled: out of the batch, its slot still its own
    assert v1["3 a unscheduled"] == {"order": ["b"], "rows": [[1, -1, -1, -1], [0, 0, 0, 0]]}
    # b finished: a is back on slot 0 (not new), c takes b's slot (new)
    assert v1["4 b finished"] == {"order": ["a", "c"], "rows": [[0, 1, -1, -1], [0, 1, 0, 0]]}
    assert v1["held"] == {"a": 0, "b": None, "c": 1}


def test_a_dummy_run_clears_the_rows_before_vllm_runs_it(hooks) -> None:
    # vLLM's own _dummy_run then failed on the stand-in runner: the hook ran first
    assert hooks["v1"]["dummy_error"] == "AttributeError"
    assert hooks["v1"]["after_dummy"] == [[-1] * 4, [0] * 4]
    assert hooks["v2_shaped"]["v2_after_capture"] == [[-1] * 4, [0] * 4]


def test_v2_frees_in_finish_requests_and_fills_from_prepare_inputs(hooks) -> None:
    # vLLM's real finish_requests removed the finished and the preempted request; both freed
    assert hooks["v2"] == {"removed": ["a", "c"], "held_after_finish": dict.fromkeys("abc")}
    assert hooks["v2_shaped"]["shaped_kind"] == "FunctionWrapper"
    # p kept slot 0 behind the decode d, which is new
    assert hooks["v2_shaped"]["v2_rows"] == [[1, 0, -1, -1], [1, 0, 0, 0]]


def test_a_given_kv_cache_memory_holds_the_tail_pool(hooks) -> None:
    gib = 2**30
    worker = hooks["worker"]
    # vLLM's own method returned the user's bytes; the hook took the layers' pools out of them
    assert worker["no_pool"] == 2 * gib
    assert worker["pool"] == 2 * gib - gib // 2
    assert worker["too_small"] == (
        "int8kv-shim: --kv-cache-memory-bytes 268435456 cannot hold the tail pool of 4 slots "
        "(536870912 bytes) and a cache: give more bytes or a lower --max-num-seqs"
    )
    # profiled memory already counted the pool: nothing taken twice
    assert worker["profiled"] == 10 * gib
