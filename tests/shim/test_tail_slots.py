"""The tail-slot manager's lifecycle (int8kv_shim/tail_slots.py), fed with vLLM's real
SchedulerOutput: a slot per running request for its life, freed when it finishes or is preempted,
kept while it sits unscheduled, and the per-step buffers in the batch's row order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput  # noqa: E402

from int8kv_shim import tail_slots  # noqa: E402
from int8kv_shim.tail_slots import TailSlots, TailSlotsExhaustedError  # noqa: E402


def _output(
    finished: set[str] = frozenset(),
    preempted: set[str] | None = None,
    resumed: set[str] = frozenset(),
) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.finished_req_ids = set(finished)
    out.preempted_req_ids = None if preempted is None else set(preempted)
    cached = CachedRequestData.make_empty()
    cached.resumed_req_ids = set(resumed)
    out.scheduled_cached_reqs = cached
    return out


def _rows(slots: TailSlots) -> tuple[list[int], list[int]]:
    return slots.slot_of_seq.tolist(), slots.slot_is_new.tolist()


@pytest.fixture
def slots():
    """A 4-slot manager installed as this process's, without the runner hooks (no patching in
    the pytest process: the hooks are tested in their own interpreter, test_tail_slot_hooks.py)."""
    manager = TailSlots(4, "cpu")
    tail_slots._manager = manager
    yield manager
    tail_slots.uninstall()


def _step(batch: list[str], **events: set[str]) -> None:
    """One V1 step: the runner's persistent batch after _update_states is `batch`."""
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=[*batch, None], num_reqs=len(batch))
    )
    tail_slots.v1_states_updated(runner, _output(**events))


def test_new_requests_get_the_lowest_free_slots_and_are_marked_new(slots) -> None:
    _step(["a", "b"])
    assert _rows(slots) == ([0, 1, -1, -1], [1, 1, 0, 0])
    assert (slots.slot_of("a"), slots.slot_of("b"), slots.num_held) == (0, 1, 2)


def test_a_continuing_request_keeps_its_slot_in_whatever_row_it_lands(slots) -> None:
    _step(["a", "b"])
    # vLLM's decode-first reordering moved b in front, and c joined
    _step(["b", "a", "c"])
    assert _rows(slots) == ([1, 0, 2, -1], [0, 0, 1, 0])


def test_an_unscheduled_running_request_keeps_its_slot(slots) -> None:
    _step(["a", "b"])
    # the token budget ran out: a is running but not in this step's batch
    _step(["b", "c"])
    assert _rows(slots) == ([1, 2, -1, -1], [0, 1, 0, 0])
    _step(["a", "b", "c"])  # a comes back to its own, untouched tail
    assert _rows(slots) == ([0, 1, 2, -1], [0, 0, 0, 0])


def test_finished_and_preempted_requests_free_their_slots(slots) -> None:
    _step(["a", "b", "c"])
    _step(["c", "d"], finished={"a"}, preempted={"b"})
    assert slots.slot_of("a") is None and slots.slot_of("b") is None
    # d gets a's slot (the lowest free one): new, so its old rows are someone else's
    assert _rows(slots) == ([2, 0, -1, -1], [0, 1, 0, 0])
    # a preempted request resumes into a fresh slot
    _step(["c", "d", "b"])
    assert _rows(slots) == ([2, 0, 1, -1], [0, 0, 1, 0])


def test_a_resumed_request_is_renewed_even_when_its_preemption_was_not_reported(slots) -> None:
    _step(["a"])
    _step(["b", "a"], resumed={"a"})
    # a's old slot went back first, so the new b got it; a has a fresh one, marked new
    assert _rows(slots) == ([0, 1, -1, -1], [1, 1, 0, 0])


def test_an_aborted_and_resubmitted_id_is_a_new_request(slots) -> None:
    # finished_req_ids and the batch overlap when a request is aborted and resubmitted: the old
    # one's slot is freed first, the new one gets a slot marked new
    _step(["a", "b"])
    _step(["b", "a"], finished={"a"})
    assert _rows(slots) == ([1, 0, -1, -1], [0, 1, 0, 0])


def test_v2_frees_in_finish_requests_and_fills_from_the_input_batch(slots) -> None:
    tail_slots.v2_inputs_prepared(SimpleNamespace(req_ids=["a", "b"]), _output())
    tail_slots.v2_requests_finished(_output(finished={"a"}, preempted={"b"}))
    assert slots.num_held == 0
    tail_slots.v2_inputs_prepared(SimpleNamespace(req_ids=["c"]), _output())
    assert _rows(slots) == ([0, -1, -1, -1], [1, 0, 0, 0])


def test_dummy_runs_read_and_write_no_tail(slots) -> None:
    _step(["a", "b"])
    tail_slots.dummy_run_starts()
    assert _rows(slots) == ([-1] * 4, [0] * 4)
    assert slots.slot_of("a") == 0  # the requests keep their slots for the next real step
    _step(["a", "b"])
    assert _rows(slots) == ([0, 1, -1, -1], [0, 0, 0, 0])


def test_the_buffers_stay_where_a_cuda_graph_captured_them(slots) -> None:
    addresses = (slots.slot_of_seq.data_ptr(), slots.slot_is_new.data_ptr())
    for batch in (["a"], ["b", "a"], []):
        _step(batch)
        tail_slots.dummy_run_starts()
    assert (slots.slot_of_seq.data_ptr(), slots.slot_is_new.data_ptr()) == addresses
    assert slots.slot_of_seq.dtype == slots.slot_is_new.dtype == torch.int32


def test_made_under_a_default_device_its_host_buffer_stays_on_the_host() -> None:
    """vLLM constructs attention layers (and so the manager) inside ``with torch.device(cuda)``;
    a host buffer that names no device then lands there (pinning it fails on a GPU). The meta
    device stands in for the GPU's default here."""
    with torch.device("meta"):
        made = TailSlots(4, torch.device("cpu"))
    assert made._host.device.type == "cpu"
    assert made.slot_of_seq.device.type == "cpu"


def test_running_out_of_slots_is_a_clear_error(slots) -> None:
    _step(["a", "b", "c", "d"])
    with pytest.raises(TailSlotsExhaustedError, match="4 slots .max_num_seqs. and every one"):
        _step(["e"])
    with pytest.raises(TailSlotsExhaustedError, match="a batch of 5 requests"):
        _step(["a", "b", "c", "d", "e"])


def test_without_a_manager_the_hooks_do_nothing() -> None:
    assert tail_slots.manager() is None
    _step(["a"])
    tail_slots.v2_inputs_prepared(SimpleNamespace(req_ids=["a"]), _output())
    tail_slots.v2_requests_finished(_output(finished={"a"}))
    tail_slots.dummy_run_starts()
    assert tail_slots.manager() is None
