"""End to end in vLLM 0.24.0 on a GPU: ``--kv-cache-dtype int8`` against BF16 and against itself.

Run on the GPU host (``bash benchmarks/run_gpu_e2e.sh tests``), or directly with the bundle staged:
``python -m pytest tests/e2e -m gpu -v``. About a dozen engines are started, each once (a few
minutes on a fresh host, most of it the first torch.compile); ``-k tiny`` / ``-k "not tiny"`` split
the run.

What "identical" means here: greedy decoding (temperature 0, EOS ignored, 32 tokens) of the same
72 prompts (``e2e_support.PROMPT_ROUNDS`` = 3 rounds of 20 corpus slices of 12 to 2300 tokens + 4
sharing a 1200-token prefix), compared token by token. A divergence where both runs' tokens are in
each other's top-5 is a *near tie* (``benchmarks.greedy.compare_greedy``, which also prints the largest
logprob gap at a near tie); anything else is a real mismatch, and every test here requires none.
How many prompts stay identical is a property of the model as much as of the cache: SmolLM2-135M
continuing a novel sits on near ties so often that any rounding change flips some (measured on the
H200 with 24 prompts: int8 vs BF16 5/24 identical, every divergence a near tie; in BF16 alone,
CUDA graphs + torch.compile vs eager 12/24). So each count is judged against a *control measured
in the same run*:

- int8 vs BF16, and int8 prefix-cache hits vs BF16: against upstream's ``int8_per_token_head`` vs
  BF16 (an int8 cache that vLLM ships). A hit is a cross-dtype comparison with the default prefill:
  the miss pass attended over its fresh BF16 K/V, the hit reads the prefix from the quantized cache;
- int8 prefilled in chunks of 512 tokens vs BF16: against upstream's int8 cache prefilled in the
  same chunks (each chunk reads its context from the quantized cache, through the context gather
  when it is long enough for FlashAttention-2);
- prefix-cache hit vs miss with every token through the cache (``INT8KV_PREFILL=triton``), CUDA
  graphs vs eager, preempted vs not: against the same comparison with a BF16 cache (the
  schedule-dependent difference vLLM has without us);

ours may trail its control by at most ``SLACK`` of the prompts (env ``INT8KV_E2E_SLACK``,
default 0.15: about 11 of 72, two standard errors of the difference; see ``PROMPT_ROUNDS``).
A fixed bar (90% identical vs BF16, the original target) is applied when
``INT8KV_E2E_CROSS_MIN=0.9`` is set; it is off by default because no int8 cache reaches it on this
model.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from e2e_support import (
    GEN_TOKENS,
    MAX_MODEL_LEN,
    assert_like_control,
    generation_phase,
    kv_settings,
)

from benchmarks.greedy import Comparison, compare_greedy
from int8kv_shim.catalogue_loader import needs_tail_pool
from int8kv_shim.environment_variables import int4_tail_pages

pytestmark = pytest.mark.gpu

# the fixed bar (int8 vs BF16 identical for >= 90% of prompts): off unless set, see the docstring
CROSS_MIN = float(os.environ.get("INT8KV_E2E_CROSS_MIN", "0"))
TINY_MIN = float(os.environ.get("INT8KV_E2E_TINY_MIN", "0.25"))  # see the tiny model's test
# upstream's int8 cache: the control of the int8-vs-BF16 comparison
UPSTREAM = "int8_per_token_head"

COMMON = {
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 32,  # also bounds the CUDA graph capture sizes (shorter compile)
    "gpu_memory_utilization": 0.25,
    "seed": 0,
    "disable_log_stats": False,  # the preemption / prefix-cache counters need stats
}
# Preemption run: 200 blocks (3200 tokens at block size 16, more if the backend's blocks are
# larger) for 72 prompts totalling ~60K tokens: the scheduler fills the cache with prefills, then
# decoding requests need new blocks and the newest running ones get preempted and recomputed.
PREEMPT_BLOCKS = int(os.environ.get("INT8KV_E2E_PREEMPT_BLOCKS", "200"))
# The preemption run generates this many tokens (compared over the first GEN_TOKENS): each running
# sequence then needs 16 more blocks, which 200 blocks cannot give to the several sequences that
# fit at once. With only 32 tokens vLLM measured 0 preemptions (H200): admission stops early
# enough that 2 more blocks per sequence were always free.
PREEMPT_TOKENS = int(os.environ.get("INT8KV_E2E_PREEMPT_TOKENS", "256"))
# ... over the first PREEMPT_PROMPTS prompts only (one round of 24): that cache runs one to three
# sequences at a time, so all 72 took 151 s per engine on the H200 (29 preemptions with int8), and
# with the BF16 control the test outgrew a 10-minute GPU call.
PREEMPT_PROMPTS = int(os.environ.get("INT8KV_E2E_PREEMPT_PROMPTS", "24"))
# The chunked-prefill run's token budget per step: prompts longer than it are prefilled in chunks,
# and a chunk of at least flash_prefill.MIN_CONTINUATION_TOKENS new tokens attends over its
# context gathered from the quantized pages, then FlashAttention-2 (the route long prompts take on
# a server, where a step's budget is shared).
CHUNK_TOKENS = 512
# The dtypes under test (default int8; int8_static needs INT8KV_SCALES, int4
# can be listed too). The BF16 and upstream controls run whatever is listed.
DTYPES = [d.strip() for d in os.environ.get("INT8KV_E2E_DTYPES", "int8").split(",") if d.strip()]


def _kv(dtype: str) -> tuple[dict[str, Any], bool]:
    """(LLM kwargs, shim on?) of a KV-cache dtype; upstream ones run without the shim."""
    return kv_settings(dtype)


# --------------------------------------------------------------------------------------------
# engines (each started once per session; see conftest.engine)


# upstream's int8 is only a control of the int8-vs-BF16 comparison
@pytest.fixture(params=[d for d in DTYPES if d != UPSTREAM])
def dtype(request: pytest.FixtureRequest) -> str:
    return request.param


def _tiny(engine, tiny_model_dir, prompts, dtype: str) -> dict[str, Any]:
    kw, shim = _kv(dtype)
    kw |= {**COMMON, "model": str(tiny_model_dir), "enforce_eager": True}
    kw["enable_prefix_caching"] = False
    return engine(
        f"tiny_{dtype}",
        kw,
        [generation_phase("ref", prompts, skip_reading_prefix_cache=True)],
        shim,
    )


def _smol_eager(
    engine, smollm2_dir, prompts, dtype: str, through_cache: bool = False
) -> dict[str, Any]:
    """Eager engine with prefix caching on: a pass that may not read the prefix cache (all misses;
    it fills the cache), then the same prompts again (hits). The miss pass is the reference of its
    dtype for every other comparison. ``through_cache``: ``INT8KV_PREFILL=triton``, so
    prefills too read the quantized pages (int8kv_shim/flash_prefill.py)."""
    kw, shim = _kv(dtype)
    kw |= {**COMMON, "model": str(smollm2_dir), "enforce_eager": True}
    kw["enable_prefix_caching"] = True
    phases = [
        generation_phase("miss", prompts, skip_reading_prefix_cache=True),
        generation_phase("hit", prompts),
    ]
    if through_cache and shim:
        name, env = f"smol_{dtype}_prefill_triton", {"INT8KV_PREFILL": "triton"}
        return engine(name, kw, phases, shim, env)
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
    cmp = compare_greedy(ref, got, GEN_TOKENS)
    print(f"tiny {dtype} vs bf16: {cmp.summary()}")
    assert not cmp.mismatch and cmp.identical_fraction >= TINY_MIN, cmp.summary()


def _smol_graphs(engine, smollm2_dir, prompts, dtype: str) -> dict[str, Any]:
    """Default compilation (torch.compile + CUDA graphs, whatever mode the backend declares)."""
    kw, shim = _kv(dtype)
    kw |= {**COMMON, "model": str(smollm2_dir), "enable_prefix_caching": False}
    return engine(
        f"smol_{dtype}_graphs",
        kw,
        [generation_phase("ref", prompts, skip_reading_prefix_cache=True)],
        shim,
    )


def _smol_preempt(engine, smollm2_dir, prompts, dtype: str) -> dict[str, Any]:
    kw, shim = _kv(dtype)
    kw |= {**COMMON, "model": str(smollm2_dir), "enforce_eager": True}
    kw |= {"enable_prefix_caching": False, "num_gpu_blocks_override": PREEMPT_BLOCKS}
    phases = [
        generation_phase(
            "ref", prompts[:PREEMPT_PROMPTS], PREEMPT_TOKENS, skip_reading_prefix_cache=True
        )
    ]
    return engine(f"smol_{dtype}_preempt", kw, phases, shim)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "auto"])
def test_smollm2_matches_bf16(engine, smollm2_dir, prompts, dtype) -> None:
    """int8 vs BF16 greedy outputs, judged against upstream's int8 cache vs BF16."""
    ref = _smol_eager(engine, smollm2_dir, prompts, "auto")["phases"]["miss"]
    got = _smol_eager(engine, smollm2_dir, prompts, dtype)["phases"]["miss"]
    upstream = _smol_eager(engine, smollm2_dir, prompts, UPSTREAM)["phases"]["miss"]
    control = compare_greedy(ref, upstream, GEN_TOKENS)
    cmp = compare_greedy(ref, got, GEN_TOKENS)
    assert_like_control(cmp, control, f"SmolLM2 {dtype} vs bf16", f"{UPSTREAM} vs bf16")
    assert cmp.identical_fraction >= CROSS_MIN, cmp.summary()
    # Prefix-cache hits with the default prefill: the cached prefix is read quantized where the miss
    # pass attended over its fresh BF16 K/V, so a hit is an int8-vs-BF16 comparison too.
    hits = _smol_eager(engine, smollm2_dir, prompts, dtype)["phases"]["hit"]
    assert_like_control(
        compare_greedy(ref, hits, GEN_TOKENS),
        control,
        f"SmolLM2 {dtype} hits vs bf16",
        f"{UPSTREAM} vs bf16",
    )


def test_prefix_cache_hit_matches_miss(engine, smollm2_dir, prompts, dtype) -> None:
    """Every token through the quantized pages (INT8KV_PREFILL=triton), so a hit reads exactly the
    pages the miss pass wrote and only the chunking differs, as for BF16."""

    def hit_vs_miss(kv: str) -> Comparison:
        run = _smol_eager(engine, smollm2_dir, prompts, kv, through_cache=True)
        miss, hit = run["phases"]["miss"], run["phases"]["hit"]
        block = run["engine"]["block_size"]
        assert sum(miss["num_cached_tokens"]) == 0, f"{kv}: the miss pass read the prefix cache"
        # every prompt longer than what a hit recomputes must have been served partly from the
        # cache: the newest block, and with a two-page tail the one before it (patch P14)
        recomputed = block * (int4_tail_pages() if needs_tail_pool(kv) else 1)
        long_enough = [i for i, p in enumerate(prompts) if len(p) > recomputed]
        no_hit = [i for i in long_enough if hit["num_cached_tokens"][i] == 0]
        assert not no_hit, f"{kv}: prompts {no_hit} got no prefix-cache hit"
        return compare_greedy(miss, hit, GEN_TOKENS)

    assert_like_control(
        hit_vs_miss(dtype), hit_vs_miss("auto"), f"{dtype} prefix-cache hit vs miss", "bf16"
    )


def test_cuda_graphs_match_eager(engine, smollm2_dir, prompts, dtype) -> None:
    def graphs_vs_eager(kv: str) -> Comparison:
        eager = _smol_eager(engine, smollm2_dir, prompts, kv)["phases"]["miss"]
        return compare_greedy(
            eager, _smol_graphs(engine, smollm2_dir, prompts, kv)["phases"]["ref"], GEN_TOKENS
        )

    assert_like_control(
        graphs_vs_eager(dtype), graphs_vs_eager("auto"), f"{dtype} CUDA graphs vs eager", "bf16"
    )


def _smol_chunked(
    engine, engine_log, smollm2_dir, prompts, dtype: str
) -> tuple[dict[str, Any], str]:
    """(result, log text) of an eager engine prefilling in chunks of at most CHUNK_TOKENS."""
    kw, shim = _kv(dtype)
    kw |= {**COMMON, "model": str(smollm2_dir), "enforce_eager": True}
    kw |= {"enable_prefix_caching": False, "enable_chunked_prefill": True}
    kw["max_num_batched_tokens"] = CHUNK_TOKENS
    name = f"smol_{dtype}_chunked"
    run = engine(name, kw, [generation_phase("ref", prompts, skip_reading_prefix_cache=True)], shim)
    log = engine_log(name)
    return run, log.read_text(errors="replace") if log.exists() else ""


def test_chunked_prefill_through_the_gather_matches_bf16(
    engine, engine_log, smollm2_dir, prompts, dtype
) -> None:
    """Long prompts prefilled in chunks: each chunk's context comes back from the quantized pages
    (through the context gather for chunks long enough for FlashAttention-2, through our kernels
    for shorter ones), so this is a quantized-against-BF16 comparison, judged against upstream's
    int8 cache prefilled in the same chunks."""
    ref = _smol_eager(engine, smollm2_dir, prompts, "auto")["phases"]["miss"]
    upstream, _ = _smol_chunked(engine, engine_log, smollm2_dir, prompts, UPSTREAM)
    got, log = _smol_chunked(engine, engine_log, smollm2_dir, prompts, dtype)
    # the route log of attention_impl: without it this test would not know the gather ran
    assert "first context-gathering step with prefills" in log, (
        f"{dtype}: no step gathered cached context for FlashAttention-2 (see the engine's log)"
    )
    assert_like_control(
        compare_greedy(ref, got["phases"]["ref"], GEN_TOKENS),
        compare_greedy(ref, upstream["phases"]["ref"], GEN_TOKENS),
        f"SmolLM2 {dtype} chunked prefill vs bf16",
        f"{UPSTREAM} chunked prefill vs bf16",
    )


def test_preemption_matches_unpreempted(engine, smollm2_dir, prompts, dtype) -> None:
    def preempted_vs_not(kv: str) -> Comparison:
        eager = _smol_eager(engine, smollm2_dir, prompts, kv)["phases"]["miss"]
        run = _smol_preempt(engine, smollm2_dir, prompts, kv)
        pre = run["phases"]["ref"]["preemptions"]
        print(f"{kv} preemption run: {run['engine']}, {pre} preemptions")
        assert pre is not None, "no scheduler stats (disable_log_stats must be False)"
        assert pre > 0, f"{kv}: no preemption with {run['engine']['kv_cache_tokens']} KV tokens"
        eager = {key: eager[key][:PREEMPT_PROMPTS] for key in ("token_ids", "logprobs")}
        return compare_greedy(eager, run["phases"]["ref"], GEN_TOKENS)

    assert_like_control(
        preempted_vs_not(dtype), preempted_vs_not("auto"), f"{dtype} preempted vs not", "bf16"
    )
