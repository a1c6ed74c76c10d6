"""Compile, at start-up, every variant of our kernels that serving can launch.

Triton compiles a kernel the first time it meets a new set of compile-time arguments. CUDA-graph
capture runs the decode path of every captured batch size, but the other launches of a layer
(the prefill configuration of our attention kernel, which serves chunked-prefill continuations
too short for FlashAttention-2; the context gather before FlashAttention-2; the write kernel's
launch for more than ``SMALL_BATCH_TOKENS`` tokens) were first met mid-serving: vLLM's JIT monitor
logged ``_gather_kv_kernel`` and ``_attn_fwd`` compiling inside timed ``vllm bench serve`` points
at 32 and 128 concurrent requests on an H200 (docs/results.md, Serving), where the
FlashAttention-2 server compiled nothing.

:func:`warm_up_layer` runs each of those launches once on a small scratch cache, with the layer's
own shapes, dtype, window, soft cap and scales. The metadata builder calls it for its layers
before vLLM captures CUDA graphs; a shape already warmed in this process is skipped. The
launches' arguments that vary from step to step or from engine to engine (sequence counts, the
block-table stride, the alignment of sliced metadata tensors and of int4's slot buffers) are not
specialized on by the kernels (``do_not_specialize``), so these few launches cover them.

The compiles come first, several at a time (``compile_in_parallel``, ``INT8KV_COMPILE_THREADS``
threads), then the launches, which find every binary built: one at a time, ``int4``'s variants of
Gemma 3 took about two minutes of a server's start.

``int4``'s kernels also read and write a tail pool (tail_slots.py): its launches run on a scratch
cache and a scratch pool of one slot, shaped like the layer's, never on the engine's pool, whose
slots hold live requests' unfinished pages. Its write has two launch shapes (a decode step, a
longer chunk), each a page flush then a tail store; its attention and context gather are warmed
as int8's, with sink pages
(``INT8KV_INT4_SINK_PAGE``, on by default) the variants that read them and their store too, and
with a tail of two pages (``INT8KV_INT4_TAIL_PAGES=2``, the default) the variants of all of them
that read and keep two pages a slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from int8kv_kernels import (
    gather_kv_context,
    make_workspace,
    paged_attention,
    write_kv_cache,
    write_sink_int4,
)
from int8kv_kernels.attention import MAX_SPLITS
from int8kv_kernels.cache_write import SMALL_BATCH_TOKENS
from int8kv_kernels.cache_write_int4 import tail_pool_shapes
from int8kv_kernels.catalogue import FLASH_CONTEXT_DTYPES, INT4_DTYPES, INT8_DTYPES, STATIC_DTYPE
from int8kv_kernels.launch import compile_in_parallel
from int8kv_kernels.page_layout import get_page_bytes
from int8kv_shim._logging import get_logger
from int8kv_shim.environment_variables import (
    compile_threads,
    int4_sink_page_enabled,
    int4_tail_pages,
)

logger = get_logger()

# The attention launches, as (query length, split counts): one decode token with every
# power-of-two split count (the split merge is compiled per count), two tokens (the decode
# configuration's multi-token case, or the prefill one for a large GQA group) split and not, and
# a prefill chunk split and not (a few new tokens over a long context split their keys).
_SPLIT_COUNTS = tuple(1 << i for i in range(MAX_SPLITS.bit_length()))
_ATTENTION_LAUNCHES = ((1, _SPLIT_COUNTS), (2, (1, 2)), (64, (1, 2)))
_PREFILL_LEN = _ATTENTION_LAUNCHES[-1][0]
# Context before the new tokens of the prefill and gather launches: a partial page read back.
_CONTEXT = 24


@dataclass(frozen=True)
class WarmupKey:
    """What decides which kernel variants a layer compiles."""

    kv_dtype: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    sliding_window: int | None
    soft_cap: float | None
    v_format: str
    gather: bool
    model_dtype: torch.dtype
    sink: bool = False  # int4 with sink pages: the attention variant that reads them, their store
    tail_pages: int = 1  # int4's pages per tail slot: the write and attention variants of a tail


_warmed: set[WarmupKey] = set()


def layer_key(impl: Any, block_size: int, model_dtype: torch.dtype) -> WarmupKey | None:
    """The warm-up key of one of our attention impls; None for a dtype it does not cover."""
    if impl.kv_cache_dtype not in INT8_DTYPES + INT4_DTYPES:
        return None
    return WarmupKey(
        kv_dtype=impl.kv_cache_dtype,
        num_heads=impl.num_heads,
        num_kv_heads=impl.num_kv_heads,
        head_size=impl.head_size,
        block_size=block_size,
        sliding_window=impl.sliding_window,
        soft_cap=impl.logits_soft_cap,
        v_format=impl.v_format,
        gather=impl.kv_cache_dtype in FLASH_CONTEXT_DTYPES and impl.flash_prefill,
        model_dtype=model_dtype,
        sink=impl.kv_cache_dtype in INT4_DTYPES and int4_sink_page_enabled(),
        tail_pages=int4_tail_pages() if impl.kv_cache_dtype in INT4_DTYPES else 1,
    )


def warm_up_layer(
    impl: Any, *, block_size: int, model_dtype: torch.dtype, device: torch.device
) -> int:
    """Launch each kernel variant of ``impl``'s layer once; the number of launches (0 when this
    process warmed the same shape before, or the dtype has no warm-up)."""
    key = layer_key(impl, block_size, model_dtype)
    if key is None or key in _warmed:
        return 0
    launches = _launch_all(key, impl.scale, impl.k_scale, impl.v_scale, device)
    _warmed.add(key)
    return launches


def warm_up_layers(
    impls: list[Any], *, block_size: int, model_dtype: torch.dtype, device: torch.device
) -> int:
    """:func:`warm_up_layer` for every impl, logged once with what it took; on a GPU every
    variant is compiled first, ``compile_threads()`` at a time. The number of launches."""
    start = time.perf_counter()
    threads = compile_threads() if device.type == "cuda" else 1
    if threads > 1:
        compile_variants(
            impls, block_size=block_size, model_dtype=model_dtype, device=device, threads=threads
        )
    launches = sum(
        warm_up_layer(i, block_size=block_size, model_dtype=model_dtype, device=device)
        for i in impls
    )
    if launches:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        logger.info(
            "int8kv-shim: compiled our kernels' serving variants at start-up (%d launches, %.1f s)",
            launches,
            time.perf_counter() - start,
        )
    return launches


def compile_variants(
    impls: list[Any],
    *,
    block_size: int,
    model_dtype: torch.dtype,
    device: torch.device,
    threads: int,
) -> int:
    """The warm-up's compile pass: every launch of the layer shapes of ``impls`` not warmed in
    this process yet, inside ``compile_in_parallel(threads)``, where a launch only compiles; the
    number of launches. Returns when every compile has finished."""
    pending: dict[WarmupKey, Any] = {}
    for impl in impls:
        key = layer_key(impl, block_size, model_dtype)
        if key is not None and key not in _warmed:
            pending.setdefault(key, impl)
    with compile_in_parallel(threads):
        return sum(
            _launch_all(key, impl.scale, impl.k_scale, impl.v_scale, device)
            for key, impl in pending.items()
        )


def _launch_all(
    key: WarmupKey,
    softmax_scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    device: torch.device,
) -> int:
    if key.kv_dtype in INT4_DTYPES:
        return _launch_all_int4(key, softmax_scale, device)
    b, hk, d = key.block_size, key.num_kv_heads, key.head_size
    tokens = SMALL_BATCH_TOKENS + b  # the write kernel's tiled launch
    num_blocks = -(-tokens // b) + 1
    page_bytes = get_page_bytes(key.kv_dtype, b, hk, d)
    kv_cache = torch.zeros(num_blocks, page_bytes, dtype=torch.int8, device=device)
    scales: dict[str, Any] = {"k_scale": None, "v_scale": None}
    if key.kv_dtype == STATIC_DTYPE:
        ones = torch.ones(hk, d, dtype=torch.float32, device=device)  # per (kv-head, channel)
        scales = {
            "k_scale": k_scale if k_scale is not None else ones,
            "v_scale": v_scale if v_scale is not None else ones,
            "v_format": key.v_format,
        }
    launches = 0
    for n in (1, tokens):
        kv = torch.zeros(n, hk, d, dtype=key.model_dtype, device=device)
        slots = torch.arange(n, dtype=torch.int64, device=device)
        write_kv_cache(kv, kv, kv_cache, slots, kv_dtype=key.kv_dtype, block_size=b, **scales)
        launches += 1
    block_table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]
    launches += _attention_launches(key, kv_cache, block_table, softmax_scale, device, **scales)
    if key.gather:
        q_len = _PREFILL_LEN
        new = torch.zeros(q_len, hk, d, dtype=key.model_dtype, device=device)
        gather_kv_context(
            kv_cache, new, new, kv_dtype=key.kv_dtype, block_size=b, block_table=block_table,
            cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32, device=device),
            cu_seqlens_k=torch.tensor([0, _CONTEXT + q_len], dtype=torch.int32, device=device),
            max_seqlen_k=_CONTEXT + q_len, num_k_tokens=_CONTEXT + q_len, **scales,
        )  # fmt: skip
        launches += 1
    return launches


def _launch_all_int4(key: WarmupKey, softmax_scale: float, device: torch.device) -> int:
    b, hk, d = key.block_size, key.num_kv_heads, key.head_size
    seq_len = _CONTEXT + _PREFILL_LEN
    num_blocks = -(-seq_len // b) + 1
    kv_cache = torch.zeros(
        num_blocks, get_page_bytes(key.kv_dtype, b, hk, d), dtype=torch.int8, device=device
    )
    # One slot, shaped as the impl's pool ([slots, 2, kv-heads, page tokens x pages, head size]
    # in the model's dtype): the engine's pool holds live requests' unfinished pages.
    shape, held = tail_pool_shapes(1, hk, d, key.tail_pages, b)
    tail = torch.zeros(shape, dtype=key.model_dtype, device=device)
    tail_page = torch.full(held, -1, dtype=torch.int32, device=device)
    slot_of_seq = torch.zeros(1, dtype=torch.int32, device=device)
    slot_is_new = torch.ones(1, dtype=torch.int32, device=device)
    block_table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]
    launches = 0
    # The flush's two launch shapes: a decode step (a program per sequence) and a longer chunk (a
    # program per page it touches); the tail store has one.
    for q_len in (1, _PREFILL_LEN):
        kv = torch.zeros(q_len, hk, d, dtype=key.model_dtype, device=device)
        write_kv_cache(
            kv, kv, kv_cache, torch.zeros(q_len, dtype=torch.int64, device=device),
            kv_dtype=key.kv_dtype, block_size=b, tail=tail, tail_page=tail_page,
            query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([_CONTEXT + q_len], dtype=torch.int32, device=device),
            block_table=block_table, slot_of_seq=slot_of_seq, slot_is_new=slot_is_new,
            num_seqs=1, max_query_len=q_len,
        )  # fmt: skip
        launches += 1
    sinks: dict[str, torch.Tensor] = {}
    if key.sink:  # a scratch sink pool of one page, read and written as the engine's would be
        sink = torch.zeros(1, 2, hk, b, d, dtype=key.model_dtype, device=device)
        sinks = {"sink": sink, "sink_of_seq": slot_of_seq}
        kv = torch.zeros(_PREFILL_LEN, hk, d, dtype=key.model_dtype, device=device)
        write_sink_int4(
            kv, kv, sinks["sink"], slot_of_seq,
            query_start_loc=torch.tensor([0, _PREFILL_LEN], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([_PREFILL_LEN], dtype=torch.int32, device=device), num_seqs=1,
        )  # fmt: skip
        launches += 1
    if key.gather:
        new = torch.zeros(_PREFILL_LEN, hk, d, dtype=key.model_dtype, device=device)
        gather_kv_context(
            kv_cache, new, new, kv_dtype=key.kv_dtype, block_size=b, block_table=block_table,
            cu_seqlens_q=torch.tensor([0, _PREFILL_LEN], dtype=torch.int32, device=device),
            cu_seqlens_k=torch.tensor([0, seq_len], dtype=torch.int32, device=device),
            max_seqlen_k=seq_len, num_k_tokens=seq_len, tail=tail, tail_page=tail_page,
            slot_of_seq=slot_of_seq, **sinks,
        )  # fmt: skip
        launches += 1
    return launches + _attention_launches(
        key, kv_cache, block_table, softmax_scale, device, tail=tail, tail_page=tail_page,
        slot_of_seq=slot_of_seq, **sinks,
    )  # fmt: skip


def _attention_launches(
    key: WarmupKey,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    device: torch.device,
    **dtype_args: Any,
) -> int:
    """Every launch of _ATTENTION_LAUNCHES on ``kv_cache``; ``dtype_args``: the format's own
    arguments (int8's scales, int4's tail and slots)."""
    h, hk, d = key.num_heads, key.num_kv_heads, key.head_size
    workspace = make_workspace(_PREFILL_LEN, h, d, device=device)
    launches = 0
    for q_len, split_counts in _ATTENTION_LAUNCHES:
        seq_len = _CONTEXT + q_len
        query = torch.zeros(q_len, h, d, dtype=key.model_dtype, device=device)
        for splits in split_counts:
            paged_attention(
                query, kv_cache, torch.empty_like(query), kv_dtype=key.kv_dtype,
                block_size=key.block_size, num_kv_heads=hk,
                query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=device),
                seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
                block_table=block_table, max_query_len=q_len, max_seq_len=seq_len,
                softmax_scale=softmax_scale, sliding_window=key.sliding_window,
                soft_cap=key.soft_cap, workspace=workspace, num_splits=splits, **dtype_args,
            )  # fmt: skip
            launches += 1
    return launches
