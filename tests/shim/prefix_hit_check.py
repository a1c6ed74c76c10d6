"""Runs in its own interpreter (INT8KV_SHIM=1): vLLM's real KV-cache managers with our int4 and int8
specs, each prompt computed once and then looked up again, the way the scheduler asks for a
prefix-cache hit. Prints one JSON line (probe.emit) for tests/shim/test_prefix_hit_tail.py."""

from __future__ import annotations

import itertools
import os

import probe

probe.stub_cuda_ops_without_driver()

import torch  # noqa: E402
import vllm.v1.core.kv_cache_coordinator as coordinator  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import int8kv_shim  # noqa: E402
from int8kv_shim import patch  # noqa: E402
from int8kv_shim.kv_spec import Int8KVFullAttentionSpec, Int8KVSlidingWindowSpec  # noqa: E402

PAGE = 64
LENGTHS = (65, 128, 129, 300, 320, 600)
init_none_hash(sha256)
hasher = get_request_block_hasher(PAGE, sha256)
ids = itertools.count()


def spec(dtype: str, window: int | None = None) -> Int8KVFullAttentionSpec:
    common = dict(block_size=PAGE, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    if window is None:
        return Int8KVFullAttentionSpec(**common, int8kv_dtype=dtype)
    return Int8KVSlidingWindowSpec(**common, int8kv_dtype=dtype, sliding_window=window)


def manager(*specs: Int8KVFullAttentionSpec) -> KVCacheManager:
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(
        config, max_model_len=4096, scheduler_block_size=PAGE, hash_block_size=PAGE
    )


def request(n: int) -> Request:
    # the same tokens for every request of length n: the second one finds the first one's pages
    return Request(
        f"r{next(ids)}", list(range(n)), SamplingParams(max_tokens=1), None, block_hasher=hasher
    )


def hits(kv: KVCacheManager) -> list[int]:
    """Tokens of each prompt length (LENGTHS) a second request finds cached after a first computed
    the prompt."""
    found = []
    for n in LENGTHS:
        first = request(n)
        blocks, computed = kv.get_computed_blocks(first)
        kv.allocate_slots(first, n - computed, computed, blocks)
        first.num_computed_tokens = n
        kv.free(first)
        blocks, hit = kv.get_computed_blocks(request(n))
        # every group's blocks cover the hit (a sliding window's out-of-window ones are null blocks)
        assert all(len(group) * PAGE == hit for group in blocks.blocks), (n, hit, blocks.blocks)
        found.append(hit)
    return found


def lookup_types() -> dict[str, str]:
    """The type of each coordinator's ``find_longest_cache_hit`` (a wrapper or vLLM's function)."""
    return {
        name: type(vars(getattr(coordinator, name))["find_longest_cache_hit"]).__name__
        for name in ("UnitaryKVCacheCoordinator", "HybridKVCacheCoordinator")
    }


r: dict = {
    "lengths": LENGTHS,
    "mode": int8kv_shim.mode(),
    "applied_on_import": patch.is_applied("prefix_hit_recomputes_tail"),
}
r["wrapped"] = lookup_types()
for pages in ("1", "2"):
    os.environ["INT8KV_INT4_TAIL_PAGES"] = pages
    r[f"int4_tail{pages}"] = hits(manager(spec("int4")))
    r[f"int8_tail{pages}"] = hits(manager(spec("int8")))
    r[f"hybrid_tail{pages}"] = hits(manager(spec("int4"), spec("int4", window=128)))
# a value the int4 layers would refuse at start-up is no concern of an int8 cache's scheduler
os.environ["INT8KV_INT4_TAIL_PAGES"] = "3"
r["int8_tail3"] = hits(manager(spec("int8")))
os.environ["INT8KV_INT4_TAIL_PAGES"] = "2"
int8kv_shim.uninstrument()
r["unwrapped"] = lookup_types()
r["int4_tail2_uninstrumented"] = hits(manager(spec("int4")))
probe.emit(r)
