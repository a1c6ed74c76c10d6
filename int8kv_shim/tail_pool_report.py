"""What a tail pool costs beside the KV cache vLLM sized: one line at start-up.

``int4`` keeps every running sequence's newest page in the model's dtype, ``max_num_seqs`` slots
in every layer (``int8kv_shim/tail_slots.py``), allocated with the model, so vLLM sizes the cache
from the memory the pool left. Beside tens of GiB of KV memory the pool is a rounding error; beside
a few GiB (an 8B model on a 24 GB card at vLLM's default of 256 sequences) it takes much of what the
4-bit pages save, and a user who reads only "3.6x" would never know. The engine core knows both
numbers once it has sized the cache: patch P13 (``int8kv_shim/patch.py``) calls :func:`report`
right after vLLM's ``GPU KV cache size`` line, with the cache's bytes and the pool's, the tokens
per byte against a BF16 cache of the same memory, and, when the pool takes more than
``WARN_SHARE`` of it, the ``--max-num-seqs`` that would bring it under ``GOAL_SHARE``.

Pure arithmetic on vLLM's specs and configs (duck-typed): never imports vLLM or torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from int8kv_shim._logging import get_logger
from int8kv_shim.catalogue_loader import load_catalogue, needs_tail_pool

logger = get_logger()

# Above this share of the KV memory (cache and pool together) the line is a warning ...
WARN_SHARE = 0.10
# ... that names the --max-num-seqs bringing the pool under this one.
GOAL_SHARE = 0.05
GIB = 2**30


@dataclass(frozen=True)
class TailPoolCost:
    """One worker's tail pool against its KV cache (bytes; per-token sums over the pool's layers)."""

    dtype: str
    slots: int
    layers: int
    slot_bytes: int  # one slot in every layer
    cache_bytes: int  # the KV cache vLLM allocated
    cache_bytes_per_token: int  # what a token costs this dtype's pages, every layer
    bf16_bytes_per_token: int  # and a BF16 cache's

    @property
    def pool_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def kv_memory(self) -> int:
        """The memory a BF16 cache would have had: the cache's and the pool's."""
        return self.cache_bytes + self.pool_bytes

    def share(self, slots: int | None = None) -> float:
        """The pool's share of the KV memory with ``slots`` slots (default: as allocated)."""
        slots = self.slots if slots is None else slots
        return slots * self.slot_bytes / max(self.kv_memory, 1)

    def vs_bf16(self, slots: int | None = None) -> float:
        """This dtype's tokens over a BF16 cache's in the same KV memory, ``slots`` slots out."""
        slots = self.slots if slots is None else slots
        tokens = max(self.kv_memory - slots * self.slot_bytes, 0) / self.cache_bytes_per_token
        return tokens / (self.kv_memory / self.bf16_bytes_per_token)

    def slots_for_share(self, share: float = GOAL_SHARE) -> int:
        """The largest power of two up to ``slots`` whose pool is at most ``share`` of the KV
        memory (1 when even one slot is more)."""
        best = 1
        while best * 2 <= self.slots and self.share(best * 2) <= share:
            best *= 2
        return best


def tail_pool_cost(
    specs: Mapping[str, Any], max_num_seqs: int, elem_bytes: int, cache_bytes: int
) -> TailPoolCost | None:
    """The pool of the layers in ``specs`` (layer name -> vLLM KV-cache spec) whose dtype has a
    tail, or None when none has: ``max_num_seqs`` slots of ``elem_bytes`` elements."""
    ours = [s for s in specs.values() if needs_tail_pool(getattr(s, "int8kv_dtype", None))]
    if not ours:
        return None
    names = {s.int8kv_dtype for s in ours}
    if len(names) != 1:
        raise ValueError(f"int8kv-shim: tail pools of several dtypes {sorted(names)}")
    entry = load_catalogue().get_dtype(names.pop())
    return TailPoolCost(
        dtype=entry.name,
        slots=max_num_seqs,
        layers=len(ours),
        slot_bytes=sum(entry.tail_slot_bytes(s.num_kv_heads, s.head_size, elem_bytes) for s in ours),
        cache_bytes=cache_bytes,
        cache_bytes_per_token=sum(s.num_kv_heads * entry.bytes_per_token_head(s.head_size) for s in ours),
        bf16_bytes_per_token=sum(s.num_kv_heads * 2 * 2 * s.head_size for s in ours),
    )  # fmt: skip


def message(cost: TailPoolCost) -> str:
    """The start-up line for ``cost``; its advice when the pool's share is above ``WARN_SHARE``."""
    line = (
        f"int8kv-shim: {cost.dtype}'s tail pool ({cost.slots} slots = max_num_seqs, x "
        f"{cost.layers} layers) takes {cost.pool_bytes / GIB:.2f} GiB of "
        f"{cost.kv_memory / GIB:.2f} GiB of KV memory ({cost.share():.0%}): the cache holds "
        f"{cost.vs_bf16():.2f}x the tokens BF16 would in that memory, "
        f"{cost.vs_bf16(0):.2f}x without the pool"
    )
    if cost.share() <= WARN_SHARE:
        return line
    better = cost.slots_for_share()
    return (
        f"{line}. --max-num-seqs {better} would give it {cost.share(better):.0%} "
        f"({cost.vs_bf16(better):.2f}x), if that many concurrent sequences are enough"
    )


def report(
    vllm_config: Any, kv_cache_specs: Sequence[Mapping[str, Any]], kv_cache_configs: Sequence[Any]
) -> TailPoolCost | None:
    """Log what the first worker's tail pool costs beside its cache (every worker of a run has the
    same layers and slots); None, and nothing logged, without a tail pool."""
    if not kv_cache_specs or not kv_cache_configs:
        return None
    cost = tail_pool_cost(
        kv_cache_specs[0],
        vllm_config.scheduler_config.max_num_seqs,
        vllm_config.model_config.dtype.itemsize,
        sum(t.size for t in kv_cache_configs[0].kv_cache_tensors),
    )
    if cost is not None:
        log = logger.warning if cost.share() > WARN_SHARE else logger.info
        log(message(cost))
    return cost
