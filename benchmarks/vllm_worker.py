"""Run one vLLM engine through a list of generation phases, in a process of its own.

    python -m benchmarks.vllm_worker SPEC.json RESULT.json

Started by the vLLM end-to-end tests (tests/e2e/e2e_support.py) and benchmarks/long_context.py.

Why a subprocess: ``INT8KV_SHIM=1`` must be set before vLLM is imported (the shim patches at
import), and a test session must not have the shim active for the CPU tests collected with it; a
fresh process per engine also guarantees the GPU memory of the previous engine is gone.

SPEC: ``{"llm_kwargs": {...}, "phases": [{"name", "prompts": [[ids]], "max_tokens",
"logprobs", "skip_reading_prefix_cache"}]}``.
RESULT: ``{"engine": {...}, "phases": {name: {"token_ids", "logprobs", "num_cached_tokens",
"preemptions", "prefix_cache_hits", "seconds"}}}``; ``logprobs[prompt][pos]`` is a list of
``[token_id, logprob]`` of the top-k tokens (and the chosen one) at that generated position.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _counter(llm: Any, name: str) -> float | None:
    """Sum of a vLLM Prometheus counter (None when stats are off)."""
    try:
        metrics = llm.get_metrics()
    except AssertionError:  # LLM(disable_log_stats=True): no metrics
        return None
    return float(sum(getattr(m, "value", 0) for m in metrics if m.name == name))


def main(spec_path: str, result_path: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.monotonic()
    llm = LLM(**spec["llm_kwargs"])
    cc = llm.llm_engine.vllm_config.cache_config
    engine = {
        "start_s": round(time.monotonic() - t0, 1),
        "num_gpu_blocks": cc.num_gpu_blocks,
        "block_size": cc.block_size,
        "kv_cache_tokens": (cc.num_gpu_blocks or 0) * cc.block_size,
        "shim": os.environ.get("INT8KV_SHIM", ""),
    }
    print(f"engine up: {engine}", flush=True)
    phases: dict[str, Any] = {}
    for ph in spec["phases"]:
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=ph["max_tokens"],
            ignore_eos=True,  # fixed-length outputs, comparable position by position
            logprobs=ph["logprobs"],  # the spec says how many (greedy.NEAR_TIE_TOPK in the tests)
            detokenize=False,
            skip_reading_prefix_cache=ph.get("skip_reading_prefix_cache"),
        )
        pre0 = _counter(llm, "vllm:num_preemptions")
        hit0 = _counter(llm, "vllm:prefix_cache_hits")
        t1 = time.monotonic()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in ph["prompts"]], sp, use_tqdm=False
        )
        seconds = time.monotonic() - t1
        pre1 = _counter(llm, "vllm:num_preemptions")
        hit1 = _counter(llm, "vllm:prefix_cache_hits")
        phases[ph["name"]] = {
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [
                [
                    [[t, lp.logprob] for t, lp in pos.items()]
                    for pos in (o.outputs[0].logprobs or [])
                ]
                for o in outs
            ],
            "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs],
            "preemptions": None if pre0 is None or pre1 is None else pre1 - pre0,
            "prefix_cache_hits": None if hit0 is None or hit1 is None else hit1 - hit0,
            "seconds": round(seconds, 2),
        }
        print(
            f"phase {ph['name']}: {len(outs)} prompts in {seconds:.1f}s, "
            f"preemptions {phases[ph['name']]['preemptions']}, "
            f"cached tokens {sum(phases[ph['name']]['num_cached_tokens'])}",
            flush=True,
        )
    with open(result_path, "w") as f:
        json.dump({"engine": engine, "phases": phases}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
