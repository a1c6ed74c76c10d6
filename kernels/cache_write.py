"""Cache write: bf16/fp16 K and V of new tokens -> quantized INT8 pages (vLLM's reshape_and_cache).

``int4`` (pages quantized when they fill, from a tail pool) is cache_write_int4.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cache_write_int4 import write_kv_cache_int4
from .catalogue import INT4_DTYPES, get_dtype
from .e4m3 import check_v_format, e4m3_encode
from .launch import DirectLauncher, ReplayCache
from .page_layout import cached_page_layout
from .quantize import FP16_MAX, check_static_scales, rint, store_key_major

# Quantization constants of the int8 write; reference.py (the kernels' specification) imports them.
QMAX = get_dtype("int8").qmax  # int8_static's too: one write kernel serves both
# Smallest positive fp16 (subnormal, 2^-24). Flooring the scale here means a zero vector stores
# scale 2^-24 and q = 0 (dequantizes to exactly 0), with no branch and no 0/0.
SCALE_MIN = 2.0**-24
# absmax/127 above fp16's range (possible for bf16 inputs > 8.3e6) is clamped here and the int8
# values saturate at +-127: the page never holds Inf/NaN for finite inputs.
SCALE_MAX = FP16_MAX

_QMAX = tl.constexpr(QMAX)
_SCALE_MIN = tl.constexpr(SCALE_MIN)
_SCALE_MAX = tl.constexpr(SCALE_MAX)


# Tokens of the batch per program (one kv-head each). V is key-major in the page ([H][D][B]), so
# one token's V is D single bytes B apart; storing a tile of consecutive tokens with the token
# fastest across threads puts a warp's 32 byte stores into one or two 32-byte sectors when their
# slots are consecutive (a prefill), instead of one sector per two bytes. 16 tokens x 1 kv-head is
# as many bytes per program as 1 token x 8 kv-heads was, and 128 programs for 256 tokens x 8 heads.
# sm80 st.global/program, H=8 D=128 B=16 bf16: was 8 b8+1 v2.b32+2 b16, now 16 b8+1 v4.b32+2 b16
_TILE_T = 16
# Up to this many tokens (a decode step's batch, whose slots are scattered over pages) each
# program writes one token of one kv-head, with one warp: scattered slots share no sectors, so
# the 16-token tile gains nothing there and leaves only 8 programs per 16 tokens (H200: 256
# random slots took 6.0 us against 2.8 us for vLLM's BF16 write). Nor did fewer, larger
# programs gain: 2, 4 or 8 kv-heads of a token per program, with 1-8 warps, were all as fast or
# slower (an A/B of those variants on an H200; the script and its JSON are in commit c1c5ebb's
# benchmark logs). Prefill chunks, past it, keep the tile.
SMALL_BATCH_TOKENS = 512


def write_launch(num_tokens: int) -> tuple[int, int]:
    """(tokens per program, warps per program) of the int8 write for a batch of num_tokens."""
    return (1, 1) if num_tokens <= SMALL_BATCH_TOKENS else (_TILE_T, 4)


@triton.jit
def _quantize_store(
    x,  # [TILE_T, HEAD_SIZE] fp32: this kv-head of each token of the tile, as loaded
    cache_ptr,
    cache16_ptr,
    page_off,  # [TILE_T] byte offset of each token's page (int64)
    slot_in_block,  # [TILE_T]
    valid,  # [TILE_T] token inside the batch and not padding
    head,
    data_off: tl.constexpr,
    scale_off: tl.constexpr,
    static_scale_ptr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_T: tl.constexpr,
    NG: tl.constexpr,  # scale groups per (token, kv-head) (page_layout.py)
    DYNAMIC: tl.constexpr,
    E4M3: tl.constexpr,  # store E4M3FN codes instead of int8 integers (static scales only)
    KEY_MAJOR: tl.constexpr = False,  # V: element d of slot t at (h*D + d)*B + t (page_layout.py)
):
    offs_d = tl.arange(0, HEAD_SIZE)
    row = head * BLOCK_SIZE + slot_in_block  # (head, slot) row inside the page region
    # NaN/Inf handling is spelled out with comparisons (false for NaN on every target) because
    # tl.maximum / tl.max treat NaN differently on the GPU (ignored) and in the interpreter
    # (propagated). README "Limitations" documents the outcome; reference.py is its specification.
    if DYNAMIC:
        # A (token, head) vector with any NaN/Inf element is flagged, not quantized: its own scale
        # is stored as NaN and its data as 0, so attention over it gives NaN ("garbage in, flagged
        # out") rather than plausible numbers. Only this token's rows of the page are written.
        finite = tl.abs(x) < float("inf")  # False for NaN and +-Inf
        row_finite = tl.min(finite.to(tl.int32), axis=1) == 1
        x = tl.where(row_finite[:, None], x, 0.0)
        if NG == 1:
            absmax = tl.max(tl.abs(x), axis=1)
        else:
            # one scale per G channels: a group's absmax over the [TILE_T, NG, G] view of the tile
            G: tl.constexpr = HEAD_SIZE // NG
            x = tl.reshape(x, [TILE_T, NG, G])
            absmax = tl.max(tl.abs(x), axis=2)
        # IEEE division (tl.div_rn, not the approximate '/') so the scale matches torch bit for bit.
        scale = tl.div_rn(absmax, _QMAX)
        scale = tl.minimum(tl.maximum(scale, _SCALE_MIN), _SCALE_MAX).to(tl.float16)
        # multiply by the reciprocal of the stored scale (dequant == q * stored scale): one IEEE
        # division per group instead of one per element, the bulk of a decode step's write
        inv = tl.div_rn(1.0, scale.to(tl.float32))
        # scale of group g of (slot t, head h) at fp16 index (h*NG + g)*B + t (page_layout.py)
        scale_row = (cache16_ptr + page_off // 2 + scale_off // 2 + head * NG * BLOCK_SIZE
                     + slot_in_block)  # fmt: skip
        if NG == 1:
            stored = tl.where(row_finite, scale.to(tl.float32), float("nan")).to(tl.float16)
            tl.store(scale_row, stored, mask=valid)
            y = x * inv[:, None]
        else:
            flag = row_finite[:, None]
            stored = tl.where(flag, scale.to(tl.float32), float("nan")).to(tl.float16)
            offs_g = tl.arange(0, NG) * BLOCK_SIZE
            tl.store(scale_row[:, None] + offs_g[None, :], stored, mask=valid[:, None])
            y = tl.reshape(x * inv[:, :, None], [TILE_T, HEAD_SIZE])
    else:
        # one scale per (kv-head, channel), row ``head`` of the [H, D] scales
        scale = tl.load(static_scale_ptr + head * HEAD_SIZE + offs_d).to(tl.float32)[None, :]
        if not E4M3:
            # No per-token scale to flag with: NaN stores 0, +-Inf saturates at +-127 (the clamp
            # below). E4M3 codes saturate NaN and +-Inf at +-448 themselves (e4m3.py).
            x = tl.where(x == x, x, 0.0)
            y = x * tl.div_rn(1.0, scale)
        else:
            y = tl.div_rn(x, scale)  # the E4M3 contract divides (e4m3.py)
    if E4M3:
        q = e4m3_encode(y)  # saturates to +-448 itself
    else:
        q = rint(tl.minimum(tl.maximum(y, -_QMAX), _QMAX)).to(tl.int8)
    page = cache_ptr + page_off + data_off
    if KEY_MAJOR:
        store_key_major(page, head, slot_in_block, valid, q, HEAD_SIZE, BLOCK_SIZE, TILE_T)
    else:
        # K rows are D contiguous bytes: vectorized stores along D.
        addr = row[:, None] * HEAD_SIZE + offs_d[None, :]
        tl.store(page[:, None] + addr, q, mask=valid[:, None])


@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    cache16_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_block,  # bytes between pages (>= page_bytes when vLLM pads pages)
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_T: tl.constexpr,
    K_DATA: tl.constexpr,
    V_DATA: tl.constexpr,
    K_SCALE: tl.constexpr,
    V_SCALE: tl.constexpr,
    NG: tl.constexpr,
    DYNAMIC: tl.constexpr,
    V_E4M3: tl.constexpr,
):
    # One program per (tile of TILE_T consecutive tokens of the batch, kv-head): the grid depends
    # on the shapes only (CUDA-graph safe). The tile's tokens may sit on any pages, in any order.
    head = tl.program_id(1)
    t = tl.program_id(0).to(tl.int64) * TILE_T + tl.arange(0, TILE_T)
    in_batch = t < num_tokens
    # Every load is issued before the first store: the compiler cannot move a load of key/value
    # above a store to the cache (it cannot prove they do not alias), so loading V after storing
    # K, or masking the K/V loads with the slot (which needs the slot load first), chains up to
    # three global-memory latencies in a program that does little else. Padding tokens' K/V are
    # loaded but never stored. (H200, 256 random slots: 3.35 -> 2.99 us at 28/4 heads, session
    # 14's ab_write2.json under benchmarks/results/logs/.)
    slot = tl.load(slot_ptr + t, mask=in_batch, other=-1).to(tl.int64)
    offs_d = tl.arange(0, HEAD_SIZE)
    k = tl.load(key_ptr + (t * stride_kt + head * stride_kh)[:, None] + offs_d[None, :],
                mask=in_batch[:, None], other=0.0).to(tl.float32)  # fmt: skip
    v = tl.load(value_ptr + (t * stride_vt + head * stride_vh)[:, None] + offs_d[None, :],
                mask=in_batch[:, None], other=0.0).to(tl.float32)  # fmt: skip
    valid = in_batch & (slot >= 0)  # negative slot: padding token
    off = slot % BLOCK_SIZE
    page_off = (slot // BLOCK_SIZE) * stride_block
    _quantize_store(
        k, cache_ptr, cache16_ptr, page_off, off, valid, head, K_DATA, K_SCALE, k_scale_ptr,
        HEAD_SIZE, BLOCK_SIZE, TILE_T, NG, DYNAMIC, False,
    )  # fmt: skip
    _quantize_store(
        v, cache_ptr, cache16_ptr, page_off, off, valid, head, V_DATA, V_SCALE, v_scale_ptr,
        HEAD_SIZE, BLOCK_SIZE, TILE_T, NG, DYNAMIC, V_E4M3, True,
    )  # fmt: skip


launch_write = DirectLauncher(_write_kv_kernel)
_replays = ReplayCache()


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_dtype: str,
    block_size: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    v_format: str = "int8",
    tail: torch.Tensor | None = None,
    tail_page: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    slot_of_seq: torch.Tensor | None = None,
    slot_is_new: torch.Tensor | None = None,
    num_seqs: int | None = None,
    max_query_len: int | None = None,
) -> None:
    """Quantize ``key``/``value`` and store them into their slots of ``kv_cache``, in place.

    key, value: [num_tokens, num_kv_heads, head_size] bf16/fp16; any token/head strides, unit
    stride along head_size. kv_cache: int8 [num_blocks, >= page_bytes] (see page_layout.py).
    slot_mapping: int32/int64 [num_tokens], slot = block * block_size + offset; negative = padding,
    skipped; only the first min(len(key), len(slot_mapping)) tokens are written. ``int8_static``
    needs k_scale / v_scale: fp32 [num_kv_heads, head_size] (one per kv-head and channel,
    contiguous), > 0; each channel is quantized by its own scale. ``v_format="e4m3"``
    (``int8_static`` only) stores V as FP8-E4M3FN codes of v / v_scale (round half even,
    saturating at +-448; e4m3.py); K stays int8.
    No host sync, no allocation: safe inside CUDA-graph capture.
    ``int4``: ``write_kv_cache_int4``'s keywords (tail, tail_page, query_start_loc, seq_lens,
    block_table, slot_of_seq, slot_is_new, num_seqs, max_query_len); slot_mapping is not used.
    """
    if kv_dtype in INT4_DTYPES:
        if k_scale is not None or v_scale is not None:
            raise ValueError("int4 has no static scales: k_scale / v_scale must be None")
        check_v_format(kv_dtype, v_format)
        return write_kv_cache_int4(
            key, value, kv_cache, tail, tail_page, kv_dtype=kv_dtype, block_size=block_size,
            query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
            slot_of_seq=slot_of_seq, slot_is_new=slot_is_new, num_seqs=num_seqs,
            max_query_len=max_query_len,
        )  # fmt: skip
    # vLLM pads key/value and slot_mapping for CUDA graphs, not always to the same length: rows
    # without a slot have nowhere to go, and a slot index past the mapping must never be read.
    num_tokens = min(key.shape[0], value.shape[0], slot_mapping.shape[0])
    launch = write_launch(num_tokens)
    # Everything that decides the launch but the addresses of the calling layer's tensors and of
    # its KV-cache group's slot mapping (see paged_attention): every layer of a step repeats the
    # call with only those changed.
    memo = (
        key.shape, key.stride(), value.shape, value.stride(), kv_cache.stride(),
        slot_mapping.shape, slot_mapping.dtype, kv_dtype, block_size,
        None if k_scale is None else k_scale.shape, None if v_scale is None else v_scale.shape,
        v_format, launch,  # tests vary it
        # int4's keywords, unused here: passing one is another call (tests/kernels' key check)
        (tail, tail_page, query_start_loc, seq_lens, block_table, slot_of_seq, slot_is_new,
         num_seqs, max_query_len).count(None),
    )  # fmt: skip
    if _replays.run(memo, key_ptr=key, value_ptr=value, cache_ptr=kv_cache, k_scale_ptr=k_scale,
                    v_scale_ptr=v_scale, slot_ptr=slot_mapping):  # fmt: skip
        return
    _, num_kv_heads, head_size = key.shape
    layout = cached_page_layout(kv_dtype, block_size, num_kv_heads, head_size)
    v_e4m3 = check_v_format(kv_dtype, v_format)
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key/value must be contiguous along head_size")
    if kv_cache.dtype != torch.int8 or kv_cache.stride(1) != 1:
        raise ValueError("kv_cache must be int8 with contiguous pages")
    dynamic = layout.has_scales
    if not dynamic:
        check_static_scales(k_scale, v_scale, num_kv_heads, head_size)
    if num_tokens == 0:
        return
    cache16 = kv_cache.view(torch.float16) if dynamic else kv_cache
    # never read when DYNAMIC (the pointer must still be a tensor): a replay keeps the recorded one
    dummy = slot_mapping
    tile, warps = launch
    # the layer's tensors and its KV-cache group's slot mapping
    swap = [("key_ptr",), ("value_ptr",), ("cache_ptr", "cache16_ptr"), ("slot_ptr",)]
    if not dynamic:
        swap += [("k_scale_ptr",), ("v_scale_ptr",)]
    replay = launch_write.record(
        swap,
        (-(-num_tokens // tile), num_kv_heads),
        key,
        value,
        kv_cache,
        cache16,
        slot_mapping,
        k_scale if k_scale is not None else dummy,
        v_scale if v_scale is not None else dummy,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        TILE_T=tile,
        V_E4M3=v_e4m3,
        **layout.kernel_constexprs(),
        num_warps=warps,
    )
    if replay is not None:
        _replays.add(memo, [replay])
