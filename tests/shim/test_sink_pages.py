"""Which sink page each row of a step reads and writes (int8kv_shim/sink_pages.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from int8kv_shim import sink_pages
from int8kv_shim.sink_pages import PAGE_TOKENS, SinkPages, sink_key

X = list(range(100, 200))  # a 100-token prompt
Y = list(range(300, 400))
Z = list(range(500, 600))


def _rows(pages: SinkPages, *req_ids: str) -> list[tuple[int, int]]:
    pages.assign(list(req_ids))
    read, store = pages.sink_of_seq.tolist(), pages.sink_store_of_seq.tolist()
    assert read[len(req_ids) :] == [-1] * (len(read) - len(req_ids))  # rows past the batch
    assert store[len(req_ids) :] == [-1] * (len(store) - len(req_ids))
    return list(zip(read[: len(req_ids)], store[: len(req_ids)], strict=True))


def _start(pages: SinkPages, req_id: str, prompt: list[int], computed: int, scheduled: int) -> None:
    pages.add(req_id, sink_key(prompt), computed)
    pages.computed(req_id, computed, scheduled)


def test_the_key_is_the_first_page_and_the_adapter() -> None:
    assert sink_key(X) == (tuple(X[:PAGE_TOKENS]), 0)
    assert sink_key(X, lora_id=3) != sink_key(X)
    assert sink_key(X[:64] + [1, 2]) == sink_key(X)  # only the first page counts
    assert sink_key(X[:63]) is None  # shorter than a page
    assert sink_key(None) is None  # prompt embeddings
    assert sink_key(X, has_multimodal=True) is None


def test_an_owner_writes_its_page_then_everyone_reads_it() -> None:
    pages = SinkPages(4, 8, "cpu")
    _start(pages, "a", X, 0, 100)
    assert _rows(pages, "a") == [(0, 0)]  # reads (where its page is full) and writes sink 0
    assert pages.stores  # a row writes its sink: the step launches the sink store
    pages.computed("a", 100, 1)
    # a prefix hit on the same first page, and a miss with the same start: both read it
    _start(pages, "b", X, 64, 36)
    _start(pages, "c", X + [7], 0, 101)
    assert _rows(pages, "a", "b", "c") == [(0, -1), (0, -1), (0, -1)]
    assert not pages.stores  # nobody writes: an eager step launches none


def test_a_page_still_being_written_is_read_by_nobody_else() -> None:
    pages = SinkPages(4, 8, "cpu")
    _start(pages, "a", X, 0, 32)  # a chunked prefill: half its first page this step
    _start(pages, "b", X, 0, 100)
    assert _rows(pages, "a", "b") == [(0, 0), (-1, -1)]
    pages.computed("a", 32, 32)
    assert _rows(pages, "a", "b") == [(0, 0), (-1, -1)]
    pages.computed("a", 64, 1)  # complete from this step on
    assert _rows(pages, "a", "b") == [(0, -1), (0, -1)]


def test_an_owner_that_ends_before_its_page_is_done_drops_the_sink() -> None:
    pages = SinkPages(2, 8, "cpu")
    _start(pages, "a", X, 0, 32)
    assert _rows(pages, "a") == [(0, 0)]
    pages.end(["a"])  # aborted half-way through its first page
    _start(pages, "b", X, 64, 10)  # cannot be a hit in vLLM, but the page must not be read
    assert _rows(pages, "b") == [(-1, -1)]
    _start(pages, "c", X, 0, 100)
    assert _rows(pages, "c") == [(0, 0)]  # a fresh owner


def test_a_finished_sink_stays_until_its_slot_is_needed_least_recently_used_first() -> None:
    pages = SinkPages(2, 8, "cpu")
    for req, prompt in (("a", X), ("b", Y)):
        _start(pages, req, prompt, 0, 100)
        assert _rows(pages, req) == [(0 if req == "a" else 1,) * 2]
        pages.end([req])  # its last step computed all 100 tokens: complete, kept
    _start(pages, "again", X, 64, 5)  # a later turn of a's conversation: a's sink
    assert _rows(pages, "again") == [(0, -1)]
    pages.end(["again"])
    # a new content takes the sink read longest ago: b's
    _start(pages, "z", Z, 0, 100)
    assert _rows(pages, "z") == [(1, 1)]
    _start(pages, "y", Y, 64, 5)  # b's page was cached, its sink is gone: the 4-bit page
    assert _rows(pages, "y") == [(-1, -1)]


def test_every_sink_read_by_a_running_request_leaves_a_new_one_without() -> None:
    pages = SinkPages(1, 8, "cpu")
    _start(pages, "a", X, 0, 100)
    _start(pages, "b", Y, 0, 100)
    assert _rows(pages, "a", "b") == [(0, 0), (-1, -1)]
    assert pages.full_misses == 1


def test_a_preempted_owner_keeps_its_complete_sink_and_reads_it_when_it_resumes() -> None:
    pages = SinkPages(2, 8, "cpu")
    _start(pages, "a", X, 0, 100)
    assert _rows(pages, "a") == [(0, 0)]
    pages.end(["a"], finished=False)  # preempted after that step: its page was complete
    pages.computed("a", 0, 100)  # resumed, recomputed from scratch
    assert _rows(pages, "a") == [(0, -1)]
    # preempted half-way through the page: the partial sink goes, the resumed request owns anew
    _start(pages, "b", Y, 0, 32)
    assert _rows(pages, "a", "b") == [(0, -1), (1, 1)]
    pages.end(["b"], finished=False)
    pages.computed("b", 0, 100)
    assert _rows(pages, "b") == [(1, 1)]


def test_short_prompts_and_dummy_runs_read_and_write_nothing() -> None:
    pages = SinkPages(2, 8, "cpu")
    _start(pages, "short", X[:10], 0, 10)
    assert _rows(pages, "short", "unknown") == [(-1, -1), (-1, -1)]
    _start(pages, "a", X, 0, 100)
    assert _rows(pages, "a") == [(0, 0)]
    assert pages.stores
    pages.clear_rows()
    assert pages.sink_of_seq.tolist() == [-1] * 8 and pages.sink_store_of_seq.tolist() == [-1] * 8
    assert not pages.stores


def test_from_vllms_scheduler_output() -> None:
    pytest.importorskip("vllm")
    import dataclasses

    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    # the fields read here are vLLM 0.24.0's
    assert {"req_id", "prompt_token_ids", "mm_features", "num_computed_tokens",
            "lora_request"} <= {f.name for f in dataclasses.fields(NewRequestData)}  # fmt: skip
    assert {"req_ids", "num_computed_tokens"} <= {
        f.name for f in dataclasses.fields(CachedRequestData)
    }
    assert {"scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
            "finished_req_ids", "preempted_req_ids"} <= {f.name for f in dataclasses.fields(SchedulerOutput)}  # fmt: skip

    def new(req_id: str, prompt: list[int], computed: int, lora: int = 0) -> SimpleNamespace:
        return SimpleNamespace(req_id=req_id, prompt_token_ids=prompt, mm_features=[],
                               num_computed_tokens=computed,
                               lora_request=SimpleNamespace(lora_int_id=lora) if lora else None)  # fmt: skip

    def step(new_reqs, cached, scheduled, finished=(), preempted=()) -> SimpleNamespace:
        return SimpleNamespace(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                                  num_computed_tokens=[c for _, c in cached]),
            num_scheduled_tokens=scheduled, finished_req_ids=set(finished),
            preempted_req_ids=set(preempted),
        )  # fmt: skip

    pages = SinkPages(4, 8, "cpu")
    out = step([new("a", X, 0), new("l", X, 0, lora=2)], [], {"a": 100, "l": 100})
    sink_pages.ended(pages, out)
    sink_pages.scheduled(pages, out)
    assert _rows(pages, "a", "l") == [(0, 0), (1, 1)]  # another adapter: another sink
    out = step([new("b", X, 64)], [("a", 100)], {"a": 1, "b": 36}, finished=["l"])
    sink_pages.ended(pages, out)
    sink_pages.scheduled(pages, out)
    assert _rows(pages, "a", "b") == [(0, -1), (0, -1)]


def test_the_tail_slot_hooks_fill_the_sink_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from int8kv_shim import tail_slots

    slots = tail_slots.TailSlots(4, "cpu")
    sinks = SinkPages(2, 4, "cpu")
    monkeypatch.setattr(tail_slots, "_manager", slots)
    monkeypatch.setattr(sink_pages, "_manager", sinks)

    def out(new_reqs=(), cached=(), scheduled=None, finished=()):
        return SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=p, mm_features=None,
                                                num_computed_tokens=c, lora_request=None)
                                for r, p, c in new_reqs],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                                  num_computed_tokens=[c for _, c in cached],
                                                  resumed_req_ids=set()),
            num_scheduled_tokens=scheduled or {}, finished_req_ids=set(finished),
            preempted_req_ids=set(),
        )  # fmt: skip

    # V1: rows in the persistent batch's order
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "s"], num_reqs=2))
    tail_slots.v1_states_updated(
        runner, out([("a", X, 0), ("s", X[:9], 0)], (), {"a": 100, "s": 9})
    )
    assert sinks.sink_of_seq.tolist() == [0, -1, -1, -1]
    assert sinks.sink_store_of_seq.tolist() == [0, -1, -1, -1]
    # V2: finish_requests, then prepare_inputs with its own row order
    tail_slots.v2_requests_finished(out(finished=["s"]))
    batch = SimpleNamespace(req_ids=["b", "a"])
    tail_slots.v2_inputs_prepared(batch, out([("b", X, 64)], [("a", 100)], {"a": 1, "b": 36}))
    assert sinks.sink_of_seq.tolist() == [0, 0, -1, -1]  # rows b, a: both read a's sink
    assert sinks.sink_store_of_seq.tolist() == [-1] * 4
    tail_slots.dummy_run_starts()
    assert sinks.sink_of_seq.tolist() == [-1] * 4
