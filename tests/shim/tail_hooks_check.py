"""Runs in its own interpreter (INT8KV_SHIM=1): the tail-slot hooks on vLLM's two real model
runners. Prints one JSON line (probe.emit) for tests/shim/test_tail_slot_hooks.py.

V1: vLLM's real ``GPUModelRunner._update_states`` runs, with its real persistent ``InputBatch``
and decode-first reordering, on a stand-in runner holding just what that method reads (building a
real runner needs a GPU); the hook then reads the batch's final row order. V2's ``prepare_inputs``
needs GPU buffers, so there the hook is checked on vLLM's real ``finish_requests`` and on a class
shaped like the runner; that the real class gets the wrappers (and loses them) is checked for both.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace
from typing import Any

import probe

probe.stub_cuda_ops_without_driver()

import torch  # noqa: E402
import vllm.utils.torch_utils as torch_utils  # noqa: E402

torch_utils.PIN_MEMORY = False  # no driver: vLLM's InputBatch would pin its host buffers
import vllm.v1.worker.gpu.model_runner as v2  # noqa: E402
import vllm.v1.worker.gpu_model_runner as v1  # noqa: E402
import vllm.v1.worker.gpu_worker as gpu_worker  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.worker.gpu_input_batch import InputBatch  # noqa: E402

import int8kv_shim  # noqa: E402
from int8kv_shim import patch, tail_slots  # noqa: E402

V1_METHODS = ("_update_states", "_dummy_run")
V2_METHODS = ("finish_requests", "prepare_inputs", "_dummy_run", "capture_model")


def kinds() -> dict[str, str]:
    out = {f"v1.{m}": type(vars(v1.GPUModelRunner)[m]).__name__ for m in V1_METHODS}
    out.update({f"v2.{m}": type(vars(v2.GPUModelRunner)[m]).__name__ for m in V2_METHODS})
    method = vars(gpu_worker.Worker)["determine_available_memory"]
    out["worker.determine_available_memory"] = type(method).__name__
    return out


def originals_kept() -> bool:
    """Each wrapper wraps vLLM's own function directly (no wrapper around a wrapper)."""
    for cls, methods in (
        (v1.GPUModelRunner, V1_METHODS),
        (v2.GPUModelRunner, V2_METHODS),
        (gpu_worker.Worker, ("determine_available_memory",)),
    ):
        for m in methods:
            if type(getattr(vars(cls)[m], "__wrapped__", None)).__name__ != "function":
                return False
    return True


def new_req(req_id: str, prompt: int) -> NewRequestData:
    return NewRequestData(
        req_id=req_id, prompt_token_ids=list(range(prompt)), mm_features=[],
        sampling_params=SamplingParams(max_tokens=8), pooling_params=None, block_ids=([1],),
        num_computed_tokens=0, lora_request=None,
    )  # fmt: skip


def step(
    new: list[NewRequestData],
    cached: dict[str, int],
    scheduled: dict[str, int],
    finished: set[str] = frozenset(),
) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = new
    data = CachedRequestData.make_empty()
    data.req_ids = list(cached)
    data.num_computed_tokens = list(cached.values())
    data.new_token_ids = [[] for _ in cached]
    data.new_block_ids = [None for _ in cached]
    data.num_output_tokens = [0 for _ in cached]
    out.scheduled_cached_reqs = data
    out.num_scheduled_tokens = scheduled
    out.total_num_scheduled_tokens = sum(scheduled.values())
    out.finished_req_ids = set(finished)
    out.preempted_req_ids = set()
    return out


def v1_runner() -> Any:
    batch = InputBatch(
        max_num_reqs=4, max_model_len=256, max_num_batched_tokens=256,
        device=torch.device("cpu"), vocab_size=100, block_sizes=[64], kernel_block_sizes=[64],
    )  # fmt: skip
    runner = SimpleNamespace(
        requests={}, num_prompt_logprobs={}, input_batch=batch, encoder_cache={},
        late_interaction_runner=SimpleNamespace(
            on_requests_finished=lambda ids: None, register_request=lambda *a: None
        ),
        speculative_config=None, is_pooling_model=False, device=torch.device("cpu"),
        uses_mrope=False, uses_xdrope_dim=0, use_async_scheduling=False,
        use_async_spec_decode=False, reorder_batch_threshold=1,
        kv_cache_config=SimpleNamespace(kv_cache_groups=[object()]),
        _zero_block_ids=lambda ids: None,
    )  # fmt: skip
    runner._may_reorder_batch = lambda out: v1.GPUModelRunner._may_reorder_batch(runner, out)
    return runner


def bound(cls: type, name: str, runner: Any) -> Any:
    """``runner.name`` as a real instance of ``cls`` would resolve it (through the wrapper)."""
    return vars(cls)[name].__get__(runner, cls)


def rows(slots: tail_slots.TailSlots) -> list[list[int]]:
    return [slots.slot_of_seq.tolist(), slots.slot_is_new.tolist()]


def v1_steps(slots: tail_slots.TailSlots) -> dict[str, Any]:
    # one process, no pipeline parallelism (vLLM's group would need torch.distributed)
    v1.get_pp_group = lambda: SimpleNamespace(is_last_rank=True)
    runner = v1_runner()
    update = bound(v1.GPUModelRunner, "_update_states", runner)
    seen: dict[str, Any] = {}

    def run(label: str, out: SchedulerOutput) -> None:
        update(out)
        batch = runner.input_batch
        seen[label] = {"order": batch.req_ids[: batch.num_reqs], "rows": rows(slots)}

    # a: a 10-token prompt in two chunks; b: a 2-token prompt, then decodes
    run("1 two prefills", step([new_req("a", 10), new_req("b", 2)], {}, {"a": 6, "b": 2}))
    # b decodes, a continues: vLLM's reordering puts the decode first
    run("2 decode first", step([], {"a": 6, "b": 2}, {"a": 4, "b": 1}))
    # the budget went to b alone: a is running but unscheduled (out of the persistent batch)
    run("3 a unscheduled", step([], {"b": 3}, {"b": 1}))
    # b finished; a is back with its own slot, c is new and gets b's
    run(
        "4 b finished",
        step([new_req("c", 4)], {"a": 10}, {"a": 1, "c": 4}, finished={"b"}),
    )
    dummy = bound(v1.GPUModelRunner, "_dummy_run", runner)
    try:
        dummy(1)  # vLLM's own _dummy_run fails on the stand-in; the hook ran before it
    except Exception as exc:  # noqa: BLE001
        seen["dummy_error"] = type(exc).__name__
    seen["after_dummy"] = rows(slots)
    seen["held"] = {r: slots.slot_of(r) for r in "abc"}
    return seen


def v2_steps(slots: tail_slots.TailSlots) -> dict[str, Any]:
    removed: list[str] = []
    runner = SimpleNamespace(_remove_request=removed.append)
    out = step([], {}, {})
    out.finished_req_ids = {"a"}
    out.preempted_req_ids = {"c"}
    bound(v2.GPUModelRunner, "finish_requests", runner)(out)  # vLLM's real method
    return {"removed": sorted(removed), "held_after_finish": {r: slots.slot_of(r) for r in "abc"}}


def v2_shaped(slots: tail_slots.TailSlots) -> dict[str, Any]:
    """V2's wrappers on a class shaped like its runner (patched by the same function, once the
    real class is unpatched: each patch applies once per process)."""
    result: dict[str, Any] = {}

    # prepare_inputs' result is the row order (vLLM sorts the scheduled requests by token count,
    # decodes first)
    class Runner:
        def finish_requests(self, scheduler_output: SchedulerOutput) -> None:
            pass

        def prepare_inputs(self, scheduler_output: SchedulerOutput, batch_desc: Any) -> Any:
            n = scheduler_output.num_scheduled_tokens
            return SimpleNamespace(req_ids=sorted(n, key=n.get))

        def _dummy_run(self, num_tokens: int) -> None:
            pass

        def capture_model(self) -> int:
            return 0

    module = types.ModuleType("v2_shaped")
    module.GPUModelRunner = Runner
    patch.patch_v2_runner_tail_slots(module)
    runner2 = Runner()
    result["shaped_kind"] = type(vars(Runner)["prepare_inputs"]).__name__
    runner2.prepare_inputs(step([], {}, {"p": 7}), None)
    runner2.prepare_inputs(step([], {}, {"p": 3, "d": 1}), None)  # d (a decode) sorts first
    result["v2_rows"] = rows(slots)
    runner2.capture_model()
    result["v2_after_capture"] = rows(slots)
    patch.undo_all()
    return result


def worker_memory(slots: tail_slots.TailSlots) -> dict[str, Any]:
    """vLLM's real ``Worker.determine_available_memory`` with ``kv_cache_memory_bytes`` given (it
    then skips profiling), on a stand-in worker, before and after the layers count their pools."""
    gib = 2**30
    worker = SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_memory_bytes=2 * gib),
        model_runner=SimpleNamespace(profile_run=lambda: None),
        init_snapshot=SimpleNamespace(free_memory=70 * gib),
    )
    determine = bound(gpu_worker.Worker, "determine_available_memory", worker)
    result: dict[str, Any] = {"no_pool": determine()}
    slots.count_pool(gib // 2, 1)
    result["pool"] = determine()
    worker.cache_config.kv_cache_memory_bytes = gib // 4
    try:
        determine()
    except ValueError as exc:
        result["too_small"] = str(exc)
    return result


def worker_shaped() -> dict[str, Any]:
    """Without ``kv_cache_memory_bytes`` vLLM profiled, and the pool is already non-KV memory."""

    class Worker:
        cache_config = SimpleNamespace(kv_cache_memory_bytes=None)

        def determine_available_memory(self) -> int:
            return 10 * 2**30

    module = types.ModuleType("worker_shaped")
    module.Worker = Worker
    patch.patch_worker_kv_memory_holds_tail_pool(module)
    return {"profiled": Worker().determine_available_memory()}


def main() -> None:
    assert int8kv_shim.mode() == "active"
    result: dict[str, Any] = {"before_install": kinds(), "slots_before": tail_slots.manager()}
    slots = tail_slots.install(4, "cpu")
    result["after_install"] = kinds()
    tail_slots.install(4, "cpu")  # a second int4 layer: same manager, no second wrapper
    result["same_manager"] = tail_slots.manager() is slots
    result["originals_kept"] = originals_kept()
    try:
        tail_slots.install(8, "cpu")
    except ValueError as exc:
        result["other_size"] = str(exc)
    result["v1"] = v1_steps(slots)
    result["v2"] = v2_steps(slots)
    result["worker"] = worker_memory(slots)
    int8kv_shim.uninstrument()
    result["after_uninstrument"] = kinds()
    result["v2_shaped"] = v2_shaped(slots)
    result["worker"].update(worker_shaped())
    probe.emit(result)


if __name__ == "__main__":
    main()
    sys.exit(0)
