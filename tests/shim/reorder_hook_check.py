"""Runs in its own interpreter (INT8KV_SHIM=1): the decode-only reorder skip on vLLM's real V1
model runner. Prints one JSON line (probe.emit) for tests/shim/test_batch_reorder.py.

The real ``GPUModelRunner._may_reorder_batch`` runs on a stand-in runner holding what it reads
(building a real runner needs a GPU); vLLM's reorder function is counted where the method looks it
up, so the check sees whether it ran, and what it moved.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import probe

probe.stub_cuda_ops_without_driver()

import vllm.v1.worker.gpu_model_runner as v1  # noqa: E402

import int8kv_shim  # noqa: E402
from int8kv_shim import patch  # noqa: E402

upstream = v1.reorder_batch_to_split_decodes_and_prefills
calls: list[int] = []


def counted(*args, **kwargs):
    calls.append(1)
    return upstream(*args, **kwargs)


v1.reorder_batch_to_split_decodes_and_prefills = counted


def step(computed: list[int], prompt: list[int], scheduled: list[int]) -> dict:
    """One ``_may_reorder_batch`` call on a batch of requests r0, r1, ...: vLLM's calls and order."""
    req_ids = [f"r{i}" for i in range(len(computed))]
    batch = SimpleNamespace(
        req_ids=req_ids,
        num_computed_tokens_cpu=np.array(computed),
        num_prompt_tokens=np.array(prompt),
    )

    def swap_states(i: int, j: int) -> None:
        req_ids[i], req_ids[j] = req_ids[j], req_ids[i]
        for a in (batch.num_computed_tokens_cpu, batch.num_prompt_tokens):
            a[[i, j]] = a[[j, i]]

    batch.swap_states = swap_states
    runner = SimpleNamespace(
        input_batch=batch,
        reorder_batch_threshold=1,
        kv_cache_config=SimpleNamespace(kv_cache_groups=[object()]),
    )
    out = SimpleNamespace(num_scheduled_tokens=dict(zip(list(req_ids), scheduled, strict=True)))
    calls.clear()
    v1.GPUModelRunner._may_reorder_batch(runner, out)
    return {"vllm_calls": len(calls), "order": req_ids}


def steps() -> dict:
    return {
        # three decodes: nothing to move, vLLM's function need not run
        "decodes": step([100, 50, 7], [90, 50, 3], [1, 1, 1]),
        # a first chunk ahead of a decode: vLLM moves the decode first
        "prefill first": step([0, 50], [4096, 40], [2048, 1]),
        # the last token of a prompt (one token, still prefilling) ahead of a decode
        "prompt remainder first": step([99, 50], [100, 40], [1, 1]),
    }


int8kv_shim.instrument()
result = {"before": type(vars(v1.GPUModelRunner)["_may_reorder_batch"]).__name__}
result["unpatched"] = steps()
patch.attach_reorder_hook()
patch.attach_reorder_hook()
method = vars(v1.GPUModelRunner)["_may_reorder_batch"]
result["after"] = type(method).__name__
result["wraps_vllm_directly"] = type(method.__wrapped__).__name__
result["patched"] = steps()
int8kv_shim.uninstrument()
result["after_uninstrument"] = type(vars(v1.GPUModelRunner)["_may_reorder_batch"]).__name__
probe.emit(result)
