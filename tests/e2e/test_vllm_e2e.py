"""End to end in vLLM 0.24.0 on a GPU: ``--kv-cache-dtype int8`` against BF16 and against itself.

Run on the GPU host (``bash benchmarks/run_gpu_e2e.sh tests``), or directly with the bundle staged:
``python -m pytest tests/e2e -m gpu -v``. Six engines are started, each once (about 8-10 minutes on
a fresh host, most of it the one torch.compile); ``-k tiny`` / ``-k "not tiny"`` split the run.

What "identical" means here: greedy decoding (temperature 0, EOS ignored, 32 tokens) of the same
24 prompts (20 corpus slices of 12 to 2300 tokens + 4 sharing a 1200-token prefix), compared
token by token. SmolLM2 int8 vs BF16 must give identical first 32 tokens for >= 90% of prompts
(issue 4; see that test for why this is likely out of reach for any int8 cache); for the random
tiny model that bar is unreachable by construction, see its test.
Runs of the same dtype that only differ in how the work is scheduled (prefix-cache hit vs miss,
CUDA graphs vs eager, preempted vs not) must give identical outputs for >= ``SAME_MIN`` of the
prompts (default 0.9, env ``INT8KV_E2E_SAME_MIN``) and no divergence other than a near tie (both
tokens in each other's top-5, see ``e2e_support.compare_greedy``): different batch shapes change
the rounding of the matmuls, which can flip a near tie even in BF16.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_support import GEN_TOKENS, MAX_MODEL_LEN, compare_greedy  # noqa: E402

pytestmark = pytest.mark.gpu

# issue 4: int8 vs BF16, first 32 tokens identical for >= 90% of prompts
CROSS_MIN = float(os.environ.get("INT8KV_E2E_CROSS_MIN", "0.9"))
SAME_MIN = float(os.environ.get("INT8KV_E2E_SAME_MIN", "0.9"))
TINY_MIN = float(os.environ.get("INT8KV_E2E_TINY_MIN", "0.25"))  # see the tiny model's test

# auto (BF16) needs a named backend on the H200 bundle (no FA3); TRITON_ATTN is the backend of
# upstream's quantized caches too. Our dtypes name no backend: the shim's plugin must pick ours.
BF16 = {"kv_cache_dtype": "auto", "attention_backend": "TRITON_ATTN"}
COMMON = {
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 32,  # also bounds the CUDA graph capture sizes (shorter compile)
    "gpu_memory_utilization": 0.25,
    "seed": 0,
    "disable_log_stats": False,  # the preemption / prefix-cache counters need stats
}
# Preemption run: 200 blocks (3200 tokens at block size 16, more if the backend's blocks are
# larger) for 24 prompts totalling ~20K tokens: the scheduler fills the cache with prefills, then
# decoding requests need new blocks and the newest running ones get preempted and recomputed.
PREEMPT_BLOCKS = int(os.environ.get("INT8KV_E2E_PREEMPT_BLOCKS", "200"))
# The dtypes under test (default int8, issue 4's subject). Controls: "auto" runs the same-dtype
# consistency tests on BF16 (a schedule-dependent difference there is vLLM's, not ours);
# "int8_per_token_head" measures upstream's int8 cache against BF16 with the same bar. Other dtypes
# of ours (int8_static, int4) can be listed too.
DTYPES = [d.strip() for d in os.environ.get("INT8KV_E2E_DTYPES", "int8").split(",") if d.strip()]


def _kv(dtype: str) -> tuple[dict[str, Any], bool]:
    """(LLM kwargs, shim on?) of a KV-cache dtype; upstream ones run without the shim."""
    if dtype == "auto":
        return dict(BF16), False
    if dtype == "int8_per_token_head":  # upstream's, as a yardstick for ours
        return {"kv_cache_dtype": dtype, "attention_backend": "TRITON_ATTN"}, False
    return {"kv_cache_dtype": dtype}, True


def _phase(name: str, prompts: list[list[int]], skip_reading: bool | None) -> dict[str, Any]:
    return {
        "name": name,
        "prompts": prompts,
        "max_tokens": GEN_TOKENS,
        "logprobs": 5,
        "skip_reading_prefix_cache": skip_reading,
    }


def _assert_same(ref: dict[str, Any], other: dict[str, Any], what: str) -> None:
    cmp = compare_greedy(ref, other)
    print(f"{what}: {cmp.summary()}")
    assert not cmp.mismatch and cmp.identical_fraction >= SAME_MIN, f"{what}: {cmp.summary()}"


# --------------------------------------------------------------------------------------------
# engines (each started once per session; see conftest.engine)


# upstream's int8 is only a yardstick for the int8-vs-BF16 comparisons
@pytest.fixture(params=[d for d in DTYPES if d != "int8_per_token_head"])
def dtype(request: pytest.FixtureRequest) -> str:
    return request.param


def _tiny(engine, tiny_model_dir, prompts, dtype: str) -> dict[str, Any]:
    kw, shim = _kv(dtype)
    kw |= {**COMMON, "model": str(tiny_model_dir), "enforce_eager": True}
    kw["enable_prefix_caching"] = False
    return engine(f"tiny_{dtype}", kw, [_phase("ref", prompts, True)], shim)


def _smol_eager(engine, smollm2_dir, prompts, dtype: str) -> dict[str, Any]:
    """Eager engine with prefix caching on: a pass that may not read the prefix cache (all misses;
    it fills the cache), then the same prompts again (hits). The miss pass is the reference of its
    dtype for every other comparison."""
    kw, shim = _kv(dtype)
    kw |= {**COMMON, "model": str(smollm2_dir), "enforce_eager": True}
    kw["enable_prefix_caching"] = True
    phases = [_phase("miss", prompts, True), _phase("hit", prompts, None)]
    return engine(f"smol_{dtype}", kw, phases, shim)


# --------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "auto"])
def test_tiny_gqa_matches_bf16(engine, tiny_model_dir, prompts, dtype) -> None:
    """Random 4-layer GQA Llama (8 q / 2 kv heads, head_dim 128): quantized cache vs BF16 cache.

    A randomly initialised model's next-token distribution is almost flat over 49K tokens, so its
    greedy text flips at near ties under ANY small perturbation and 90% identical prompts is out of
    reach for it (a CPU simulation of int8 per-token-head K/V rounding on this very model: 8 of 12
    prompts identical, the other 4 diverging at near ties). What separates a correct cache from a
    broken one is *how* outputs diverge: in the same simulation, attention reading V from the wrong
    block gave 11/12 real mismatches, mostly at the first token. So: no real mismatch, and at least
    ``TINY_MIN`` identical (a floor far above the broken case's 1/12).
    """
    ref = _tiny(engine, tiny_model_dir, prompts, "auto")["phases"]["ref"]
    got = _tiny(engine, tiny_model_dir, prompts, dtype)["phases"]["ref"]
    cmp = compare_greedy(ref, got)
    print(f"tiny {dtype} vs bf16: {cmp.summary()}")
    assert not cmp.mismatch and cmp.identical_fraction >= TINY_MIN, cmp.summary()


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "auto"])
def test_smollm2_matches_bf16(engine, smollm2_dir, prompts, dtype) -> None:
    """Issue 4: first 32 greedy tokens identical to BF16's for >= 90% of the prompts, and no
    divergence other than a near tie.

    Expect trouble with the 90%: a CPU simulation on this model and these prompts (HF SmolLM2,
    per-token-head absmax rounding of K and V in every layer) gave 10/24 identical for int8 and
    only 14/24 for a 16-bit rounding (about one BF16 ulp), every divergence a near tie: SmolLM2-135M
    continuing a novel sits on near ties so often that any rounding change flips some within 32
    tokens. List ``int8_per_token_head`` in ``INT8KV_E2E_DTYPES`` to measure upstream's int8 with the
    same bar in the same run; ``INT8KV_E2E_CROSS_MIN`` sets the bar.
    """
    ref = _smol_eager(engine, smollm2_dir, prompts, "auto")["phases"]["miss"]
    got = _smol_eager(engine, smollm2_dir, prompts, dtype)["phases"]["miss"]
    cmp = compare_greedy(ref, got)
    print(f"SmolLM2 {dtype} vs bf16: {cmp.summary()}")
    assert not cmp.mismatch and cmp.identical_fraction >= CROSS_MIN, cmp.summary()


def test_prefix_cache_hit_matches_miss(engine, smollm2_dir, prompts, dtype) -> None:
    run = _smol_eager(engine, smollm2_dir, prompts, dtype)
    miss, hit = run["phases"]["miss"], run["phases"]["hit"]
    block = run["engine"]["block_size"]
    assert sum(miss["num_cached_tokens"]) == 0, "the miss pass read the prefix cache"
    # every prompt longer than one block must have been served partly from the cache
    long_enough = [i for i, p in enumerate(prompts) if len(p) > block]
    no_hit = [i for i in long_enough if hit["num_cached_tokens"][i] == 0]
    assert not no_hit, f"prompts {no_hit} got no prefix-cache hit"
    _assert_same(miss, hit, f"{dtype} prefix-cache hit vs miss")


def test_cuda_graphs_match_eager(engine, smollm2_dir, prompts, dtype) -> None:
    """Default compilation (torch.compile + CUDA graphs, whatever mode the backend declares)."""
    eager = _smol_eager(engine, smollm2_dir, prompts, dtype)["phases"]["miss"]
    kw, shim = _kv(dtype)
    kw |= {**COMMON, "model": str(smollm2_dir), "enable_prefix_caching": False}
    graphs = engine(f"smol_{dtype}_graphs", kw, [_phase("ref", prompts, True)], shim)
    _assert_same(eager, graphs["phases"]["ref"], f"{dtype} CUDA graphs vs eager")


def test_preemption_matches_unpreempted(engine, smollm2_dir, prompts, dtype) -> None:
    eager = _smol_eager(engine, smollm2_dir, prompts, dtype)["phases"]["miss"]
    kw, shim = _kv(dtype)
    kw |= {**COMMON, "model": str(smollm2_dir), "enforce_eager": True}
    kw |= {"enable_prefix_caching": False, "num_gpu_blocks_override": PREEMPT_BLOCKS}
    run = engine(f"smol_{dtype}_preempt", kw, [_phase("ref", prompts, True)], shim)
    pre = run["phases"]["ref"]["preemptions"]
    print(f"{dtype} preemption run: {run['engine']}, {pre} preemptions")
    assert pre is not None, "no scheduler stats (disable_log_stats must be False)"
    assert pre > 0, f"no preemption happened with {run['engine']['kv_cache_tokens']} KV tokens"
    _assert_same(eager, run["phases"]["ref"], f"{dtype} preempted vs not")
