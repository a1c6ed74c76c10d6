"""Dequantize-gather of chunked-prefill contexts into contiguous BF16/FP16 K/V for FlashAttention.

A chunked-prefill continuation (``num_computed > 0`` cached tokens, ``q_len > 1`` new ones) can run
on a dense varlen attention (vLLM's FlashAttention-2) if its keys are laid out as one contiguous
run per sequence: the context read back from the quantized pages, then the new tokens' own K/V.
``gather_kv_context`` builds that batch in one launch::

    rows [cu_k[i], cu_k[i] + ctx_i)      dequantized context of sequence i (its first ctx_i tokens)
    rows [cu_k[i] + ctx_i, cu_k[i + 1])  new_key / new_value rows [cu_q[i], cu_q[i + 1]), copied

with ``ctx_i = (cu_k[i + 1] - cu_k[i]) - (cu_q[i + 1] - cu_q[i])``, read on the device (no host
sync, no per-sequence launch).

Dequantization is the spec of ``reference.dequantize_cache`` followed by one rounding to the output
dtype, bit for bit: int8 (or the exact E4M3 value) times the fp32 scale in fp32 -- for ``int8`` its
group's fp16 scale, whose product with an int8 is exact in fp32 -- then round to nearest even. The bf16
rounding is done with integer ops, not a cast: the Triton interpreter truncates fp32 -> bf16 casts
(GPUs round to nearest even), and one code path for both keeps the CPU tests meaningful.

``int4`` keeps part of a context outside its pages: the sequence's newest one or two pages in its
tail slot and, with sink pages, its first page in its sink, both in the model's dtype. Its gather
reads each key where ``paged_attention_int4`` reads it (``exact_keys_start`` decides the tail's
share, the same function in both kernels): tail and sink rows are copied, int4 rows dequantized
as ``reference_int4.dequantize_cache_int4`` (code x fp16 scale, exact in fp32, plus the fp16 zero:
one rounding) and rounded once to the output dtype. ``reference_int4.gather_kv_context_int4_ref``
is the spec.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import v_column
from .cache_write_int4 import check_pools, exact_keys_start
from .catalogue import INT4_DTYPES
from .e4m3 import check_v_format, e4m3_decode
from .launch import DirectLauncher, ReplayCache
from .page_layout import cached_int4_layout, cached_page_layout
from .quantize import check_static_scales

# Rows (tokens of one kv head) per program: 16-byte loads of whole rows, and few enough programs
# that a long context is still one pass over its pages.
_BLOCK_T = 32

_BF16_QNAN = tl.constexpr(0x7FC0)
_BATCH_PTRS = ["block_table_ptr", "cu_q_ptr", "cu_k_ptr"]


@triton.jit
def _round_to_out(x, OUT_BF16: tl.constexpr):
    """fp32 -> the output dtype, round to nearest even (what torch's ``.to`` does)."""
    if OUT_BF16:
        u = x.to(tl.int32, bitcast=True)
        # Add just under half an ulp of bf16, plus one when the kept LSB is odd (ties to even);
        # a carry into the exponent is the correct rounding up. NaN kept apart: a NaN with a full
        # mantissa (GPUs produce 0x7fffffff) would carry into the sign bit.
        r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        r = tl.where(x == x, r, _BF16_QNAN)
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.float16)  # IEEE round to nearest even, on GPUs and in the interpreter


@triton.jit
def _key_run(cu_q_ptr, cu_k_ptr, seq):
    """Sequence ``seq``'s key run: (its first output row, its length, its first new row, its
    context length)."""
    k0 = tl.load(cu_k_ptr + seq)
    k_len = tl.load(cu_k_ptr + seq + 1) - k0
    q0 = tl.load(cu_q_ptr + seq)
    return k0, k_len, q0, k_len - (tl.load(cu_q_ptr + seq + 1) - q0)


@triton.jit
def _store_rows(
    k_ctx, v_ctx, new_k_ptr, new_v_ptr, k_out_ptr, v_out_ptr, t, ctx, k_len, q0, k0, kvh,
    stride_nk_t, stride_nk_h, stride_nv_t, stride_nv_h, stride_ko_t, stride_ko_h, stride_vo_t,
    stride_vo_h, HEAD_SIZE: tl.constexpr,
):  # fmt: skip
    """Rows ``t`` [BLOCK_T] of one sequence's key run for one kv head: the context rows (t < ctx)
    from ``k_ctx`` / ``v_ctx`` [BLOCK_T, D] (already in the output dtype), the new rows from the
    sequence's own fresh K/V (row q0 + t - ctx of new_key / new_value), into rows k0 + t."""
    d = tl.arange(0, HEAD_SIZE)
    m_ctx = (t < ctx)[:, None]
    m_new = ((t >= ctx) & (t < k_len))[:, None]
    src = (q0 + t - ctx).to(tl.int64)
    k_new = tl.load(
        new_k_ptr + src[:, None] * stride_nk_t + kvh * stride_nk_h + d[None, :], mask=m_new
    )
    v_new = tl.load(
        new_v_ptr + src[:, None] * stride_nv_t + kvh * stride_nv_h + d[None, :], mask=m_new
    )
    dst = (k0 + t).to(tl.int64)
    m_out = (t < k_len)[:, None]
    tl.store(
        k_out_ptr + dst[:, None] * stride_ko_t + kvh * stride_ko_h + d[None, :],
        tl.where(m_ctx, k_ctx, k_new),
        mask=m_out,
    )
    tl.store(
        v_out_ptr + dst[:, None] * stride_vo_t + kvh * stride_vo_h + d[None, :],
        tl.where(m_ctx, v_ctx, v_new),
        mask=m_out,
    )


@triton.jit(
    do_not_specialize=["num_seqs", "stride_bt"],
    do_not_specialize_on_alignment=_BATCH_PTRS,  # sliced per batch
)
def _gather_kv_kernel(
    cache_ptr, cache16_ptr, new_k_ptr, new_v_ptr, k_out_ptr, v_out_ptr,
    block_table_ptr, cu_q_ptr, cu_k_ptr, k_scale_ptr, v_scale_ptr,
    stride_block, stride_bt, stride_nk_t, stride_nk_h, stride_nv_t, stride_nv_h,
    stride_ko_t, stride_ko_h, stride_vo_t, stride_vo_h, num_seqs,
    HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
    K_DATA: tl.constexpr, V_DATA: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr,
    NG: tl.constexpr, DYNAMIC: tl.constexpr, V_E4M3: tl.constexpr, OUT_BF16: tl.constexpr,
):  # fmt: skip
    """Grid (row blocks of the longest key run, sequences, kv heads)."""
    pid_t = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    k0, k_len, q0, ctx = _key_run(cu_q_ptr, cu_k_ptr, seq)
    if pid_t * BLOCK_T >= k_len:
        return
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, HEAD_SIZE)
    is_ctx = t < ctx

    # Context rows: page of each token from the block table, row (kvh, t % B) of that page.
    page = tl.load(block_table_ptr + seq * stride_bt + t // BLOCK_SIZE, mask=is_ctx, other=0)
    row = page.to(tl.int64) * stride_block + (kvh * BLOCK_SIZE + t % BLOCK_SIZE) * HEAD_SIZE
    m_ctx = is_ctx[:, None]
    kq = tl.load(cache_ptr + K_DATA + row[:, None] + d[None, :], mask=m_ctx, other=0)
    v_col = v_column(page.to(tl.int64), t, kvh, stride_block, HEAD_SIZE, BLOCK_SIZE)
    vq = tl.load(cache_ptr + V_DATA + v_col[:, None] + d[None, :] * BLOCK_SIZE, mask=m_ctx, other=0)
    if V_E4M3:
        vf = e4m3_decode(vq)  # exact fp32 value, as e4m3_decode_ref
    else:
        vf = vq.to(tl.float32)
    if DYNAMIC and NG == 1:
        sidx = page.to(tl.int64) * (stride_block // 2) + kvh * BLOCK_SIZE + t % BLOCK_SIZE
        k_sc = tl.load(cache16_ptr + K_SCALE // 2 + sidx, mask=is_ctx, other=0.0).to(tl.float32)
        v_sc = tl.load(cache16_ptr + V_SCALE // 2 + sidx, mask=is_ctx, other=0.0).to(tl.float32)
        k_deq = kq.to(tl.float32) * k_sc[:, None]
        v_deq = vf * v_sc[:, None]
    elif DYNAMIC:
        # each of a token's NG scales multiplies its group of G channels
        G: tl.constexpr = HEAD_SIZE // NG
        sidx = page.to(tl.int64) * (stride_block // 2) + kvh * NG * BLOCK_SIZE + t % BLOCK_SIZE
        sidx = sidx[:, None] + tl.arange(0, NG)[None, :] * BLOCK_SIZE
        k_sc = tl.load(cache16_ptr + K_SCALE // 2 + sidx, mask=m_ctx, other=0.0).to(tl.float32)
        v_sc = tl.load(cache16_ptr + V_SCALE // 2 + sidx, mask=m_ctx, other=0.0).to(tl.float32)
        k3 = tl.reshape(kq.to(tl.float32), [BLOCK_T, NG, G]) * k_sc[:, :, None]
        v3 = tl.reshape(vf, [BLOCK_T, NG, G]) * v_sc[:, :, None]
        k_deq = tl.reshape(k3, [BLOCK_T, HEAD_SIZE])
        v_deq = tl.reshape(v3, [BLOCK_T, HEAD_SIZE])
    else:
        # one scale per (kv-head, channel): row kvh of the [H, D] scales
        k_deq = kq.to(tl.float32) * tl.load(k_scale_ptr + kvh * HEAD_SIZE + d)[None, :]
        v_deq = vf * tl.load(v_scale_ptr + kvh * HEAD_SIZE + d)[None, :]
    _store_rows(
        _round_to_out(k_deq, OUT_BF16), _round_to_out(v_deq, OUT_BF16), new_k_ptr, new_v_ptr,
        k_out_ptr, v_out_ptr, t, ctx, k_len, q0, k0, kvh, stride_nk_t, stride_nk_h, stride_nv_t,
        stride_nv_h, stride_ko_t, stride_ko_h, stride_vo_t, stride_vo_h, HEAD_SIZE,
    )  # fmt: skip


@triton.jit(
    do_not_specialize=["num_seqs", "stride_bt"],
    # sliced per batch
    do_not_specialize_on_alignment=[*_BATCH_PTRS, "slot_of_seq_ptr", "sink_of_seq_ptr"],
)
def _gather_int4_kernel(
    cache_ptr, cache16_ptr, tail_ptr, tail_page_ptr, sink_ptr, new_k_ptr, new_v_ptr, k_out_ptr,
    v_out_ptr, block_table_ptr, cu_q_ptr, cu_k_ptr, slot_of_seq_ptr, sink_of_seq_ptr,
    stride_block, stride_bt, stride_ts, stride_tkv, stride_th, stride_tp, stride_ss, stride_skv,
    stride_sh, stride_sp, stride_nk_t, stride_nk_h, stride_nv_t, stride_nv_h, stride_ko_t,
    stride_ko_h, stride_vo_t, stride_vo_h, num_seqs,
    HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, NGV: tl.constexpr,
    K_DATA: tl.constexpr, V_DATA: tl.constexpr, K_SZ: tl.constexpr, V_SZ: tl.constexpr,
    TAIL_PAGES: tl.constexpr, HAS_SINK: tl.constexpr, OUT_BF16: tl.constexpr,
):  # fmt: skip
    """Grid (row blocks of the longest key run, sequences, kv heads); a block's rows lie in one
    page (BLOCK_T divides the page). Context rows come from where the attention kernel reads
    them: the tail from ``exact_keys_start`` on, the sink for keys 0..63 of a row that has one
    (page 0 full and not the tail's), the int4 page otherwise."""
    HALF: tl.constexpr = HEAD_SIZE // 2
    G: tl.constexpr = HEAD_SIZE // NGV  # channels of a V (scale, zero) group
    pid_t = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    k0, k_len, q0, ctx = _key_run(cu_q_ptr, cu_k_ptr, seq)
    if pid_t * BLOCK_T >= k_len:
        return
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, HEAD_SIZE)
    j = t % BLOCK_SIZE  # row in the page
    is_ctx = t < ctx

    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    slot = tl.load(slot_of_seq_ptr + seq).to(tl.int64)
    # the attention kernel's split of the keys, for the whole sequence (its new tokens included:
    # the step's write ran first)
    full = exact_keys_start(tail_page_ptr, bt_row, slot, k_len, BLOCK_SIZE, TAIL_PAGES)
    from_page = is_ctx & (t < full)
    from_tail = is_ctx & (t >= full) & (slot >= 0)  # slot -1: no tail, those rows are zeros
    from_sink = t < 0  # none
    sink = 0
    if HAS_SINK:
        sink = tl.load(sink_of_seq_ptr + seq).to(tl.int64)
        from_sink = from_page & (t < BLOCK_SIZE) & (sink >= 0)
        from_page = from_page & ~from_sink

    # int4 page: the byte of channel d is byte d % (D/2) of the row, its low nibble for d < D/2
    page_rows = pid_t * BLOCK_T < full
    page = tl.load(bt_row + (pid_t * BLOCK_T) // BLOCK_SIZE, mask=page_rows, other=0).to(tl.int64)
    base16 = page * (stride_block // 2)
    byte = d % HALF
    high = (d >= HALF)[None, :]
    m_page = from_page[:, None]
    kb = tl.load(cache_ptr + page * stride_block + K_DATA + (kvh * BLOCK_SIZE + j)[:, None] * HALF
                 + byte[None, :], mask=m_page, other=0)  # fmt: skip
    vb = tl.load(cache_ptr + page * stride_block + V_DATA + (kvh * HALF + byte)[None, :] * BLOCK_SIZE
                 + j[:, None], mask=m_page, other=0)  # fmt: skip
    k_code = tl.where(high, kb >> 4, kb & 15).to(tl.float32)
    v_code = tl.where(high, vb >> 4, vb & 15).to(tl.float32)
    # code * scale is exact in fp32 (4 x 11 significant bits): one rounding, fused or not
    k_sz = cache16_ptr + base16 + K_SZ // 2 + kvh * 2 * HEAD_SIZE + d
    k_scale = tl.load(k_sz, mask=page_rows, other=0.0).to(tl.float32)
    k_zero = tl.load(k_sz + HEAD_SIZE, mask=page_rows, other=0.0).to(tl.float32)
    k_deq = k_code * k_scale[None, :] + k_zero[None, :]
    v_sz = (cache16_ptr + base16 + V_SZ // 2 + (kvh * NGV + d // G)[None, :] * (2 * BLOCK_SIZE)
            + j[:, None])  # fmt: skip
    v_scale = tl.load(v_sz, mask=m_page, other=0.0).to(tl.float32)
    v_zero = tl.load(v_sz + BLOCK_SIZE, mask=m_page, other=0.0).to(tl.float32)
    v_deq = v_code * v_scale + v_zero

    # tail: key p in row p % (64 x pages) of the slot, in the model's dtype
    m_tail = from_tail[:, None]
    t_row = (tail_ptr + tl.maximum(slot, 0) * stride_ts + kvh * stride_th
             + (t % (TAIL_PAGES * BLOCK_SIZE)).to(tl.int64) * stride_tp)  # fmt: skip
    k_t = tl.load(t_row[:, None] + d[None, :], mask=m_tail, other=0.0).to(tl.float32)
    v_t = tl.load(t_row[:, None] + stride_tkv + d[None, :], mask=m_tail, other=0.0)
    k_deq = tl.where(m_tail, k_t, k_deq)
    v_deq = tl.where(m_tail, v_t.to(tl.float32), v_deq)
    if HAS_SINK:
        m_sink = from_sink[:, None]
        s_row = sink_ptr + tl.maximum(sink, 0) * stride_ss + kvh * stride_sh + j * stride_sp
        k_s = tl.load(s_row[:, None] + d[None, :], mask=m_sink, other=0.0).to(tl.float32)
        v_s = tl.load(s_row[:, None] + stride_skv + d[None, :], mask=m_sink, other=0.0)
        k_deq = tl.where(m_sink, k_s, k_deq)
        v_deq = tl.where(m_sink, v_s.to(tl.float32), v_deq)
    _store_rows(
        _round_to_out(k_deq, OUT_BF16), _round_to_out(v_deq, OUT_BF16), new_k_ptr, new_v_ptr,
        k_out_ptr, v_out_ptr, t, ctx, k_len, q0, k0, kvh, stride_nk_t, stride_nk_h, stride_nv_t,
        stride_nv_h, stride_ko_t, stride_ko_h, stride_vo_t, stride_vo_h, HEAD_SIZE,
    )  # fmt: skip


launch_gather = DirectLauncher(_gather_kv_kernel)
launch_gather_int4 = DirectLauncher(_gather_int4_kernel)
_replays = ReplayCache()


def gather_kv_context(
    kv_cache: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    *,
    kv_dtype: str,
    block_size: int,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_k: int,
    num_k_tokens: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    v_format: str = "int8",
    tail: torch.Tensor | None = None,
    tail_page: torch.Tensor | None = None,
    slot_of_seq: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    sink_of_seq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous K, V [num_k_tokens, num_kv_heads, head_size] of a varlen batch: per sequence its
    dequantized context, then its new tokens' K/V (see the module docstring).

    new_key, new_value: [cu_seqlens_q[-1], num_kv_heads, head_size] bf16/fp16, the new tokens of
    each sequence (unit stride on head_size); the output has their dtype. kv_cache: int8
    [num_blocks, >= page_bytes] (``int8`` / ``int8_static``). block_table: int32 [seqs, max_blocks],
    each row covering at least the sequence's context. cu_seqlens_q / cu_seqlens_k: int32
    [seqs + 1] of new tokens / context + new tokens. ``max_seqlen_k`` (launch shape) and
    ``num_k_tokens`` (== cu_seqlens_k[-1], the allocation) are host ints, so no device sync.
    ``int8_static`` needs k_scale / v_scale (fp32 [num_kv_heads, head_size], one per kv-head and
    channel); ``v_format="e4m3"`` as in ``paged_attention``.

    ``int4`` takes ``paged_attention_int4``'s tail pool and sink pages (``tail``, ``tail_page``,
    ``slot_of_seq``, optional ``sink`` / ``sink_of_seq``, each row r of them the sequence r of
    cu_seqlens) and reads each context key where that kernel reads it: from the sequence's tail
    (``exact_keys_start`` on) or its sink in the model's dtype, else from its int4 page. Runs
    after the step's write, like attention: cu_seqlens_k's runs are the sequences' lengths.
    """
    if kv_dtype in INT4_DTYPES:
        if tail is None or tail_page is None or slot_of_seq is None:
            raise ValueError("the int4 gather needs tail, tail_page and slot_of_seq")
        if k_scale is not None or v_scale is not None:
            raise ValueError("int4 has no static scales: k_scale / v_scale must be None")
        check_v_format(kv_dtype, v_format)
        return gather_kv_context_int4(
            kv_cache, new_key, new_value, kv_dtype=kv_dtype, block_size=block_size,
            block_table=block_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_k=max_seqlen_k, num_k_tokens=num_k_tokens, tail=tail, tail_page=tail_page,
            slot_of_seq=slot_of_seq, sink=sink, sink_of_seq=sink_of_seq,
        )  # fmt: skip
    num_kv_heads, head_size = new_key.shape[1], new_key.shape[2]
    shape = (num_k_tokens, num_kv_heads, head_size)
    # Everything that decides the launch but the addresses of the calling layer's own tensors
    # (its cache, new K/V, static scales and the buffers made here): every layer of a step repeats
    # the call with only those changed, and replays the first layer's launch (launch.py).
    key = (
        *_batch_key(new_key, new_value, kv_cache, block_table, cu_seqlens_q, cu_seqlens_k),
        kv_dtype, block_size, max_seqlen_k, num_k_tokens,
        None if k_scale is None else k_scale.shape, None if v_scale is None else v_scale.shape,
        v_format,
        # int4's keywords, unused here: passing one is another call (tests/kernels' key check)
        (tail, tail_page, slot_of_seq, sink, sink_of_seq).count(None),
    )  # fmt: skip
    k_out = torch.empty(shape, dtype=new_key.dtype, device=new_key.device)
    v_out = torch.empty_like(k_out)
    if _replays.run(key, cache_ptr=kv_cache, new_k_ptr=new_key, new_v_ptr=new_value,
                    k_out_ptr=k_out, v_out_ptr=v_out, k_scale_ptr=k_scale,
                    v_scale_ptr=v_scale, block_table_ptr=block_table, cu_q_ptr=cu_seqlens_q,
                    cu_k_ptr=cu_seqlens_k):  # fmt: skip
        return k_out, v_out
    layout = cached_page_layout(kv_dtype, block_size, num_kv_heads, head_size)  # refuses int4
    v_e4m3 = check_v_format(kv_dtype, v_format)
    dynamic = layout.has_scales
    if not dynamic:
        check_static_scales(k_scale, v_scale, num_kv_heads, head_size)
    _check_new_kv(new_key, new_value)
    _check_cache(kv_cache)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_k_tokens == 0 or num_seqs == 0:
        return k_out, v_out
    # never read when DYNAMIC (the pointer must still be a tensor): a replay keeps the recorded one
    dummy = cu_seqlens_q
    grid = (-(-max_seqlen_k // _BLOCK_T), num_seqs, num_kv_heads)  # no triton.cdiv: ~2 us per call
    # the layer's tensors and the batch's (each KV-cache group has its own block table)
    swap = [("cache_ptr", "cache16_ptr"), ("new_k_ptr",), ("new_v_ptr",), ("k_out_ptr",),
            ("v_out_ptr",), *((name,) for name in _BATCH_PTRS)]  # fmt: skip
    if not dynamic:
        swap += [("k_scale_ptr",), ("v_scale_ptr",)]
    replay = launch_gather.record(
        swap,
        grid,
        kv_cache,
        kv_cache.view(torch.float16) if dynamic else kv_cache,
        new_key,
        new_value,
        k_out,
        v_out,
        block_table,
        cu_seqlens_q,
        cu_seqlens_k,
        k_scale if k_scale is not None else dummy,
        v_scale if v_scale is not None else dummy,
        kv_cache.stride(0),
        block_table.stride(0),
        *_row_strides(new_key, new_value, k_out, v_out),
        num_seqs,
        BLOCK_T=_BLOCK_T,
        V_E4M3=v_e4m3,
        **layout.kernel_constexprs(),
        OUT_BF16=new_key.dtype == torch.bfloat16,
        num_warps=4,
    )
    if replay is not None:
        _replays.add(key, [replay])
    return k_out, v_out


def _batch_key(
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
) -> tuple:
    """The part of both gathers' replay keys that describes the batch and the layer's tensors'
    shapes: everything but the addresses of the layer's own tensors (new K/V, cache) and of the
    batch's (block table, cumulative lengths: each KV-cache group has its own block table), which
    the replays swap."""
    return (
        new_key.shape, new_key.stride(), new_value.shape, new_value.stride(), kv_cache.stride(),
        block_table.shape, block_table.stride(), block_table.dtype, cu_seqlens_q.shape,
        cu_seqlens_q.dtype, cu_seqlens_k.shape, cu_seqlens_k.dtype,
    )  # fmt: skip


def _row_strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """(token, head) strides of each [tokens, heads, head_size] tensor, in order: the kernels'
    stride arguments of the new K/V and of the output."""
    return tuple(n for t in tensors for n in t.stride()[:2])


def _check_new_kv(new_key: torch.Tensor, new_value: torch.Tensor) -> None:
    if new_key.dtype not in (torch.bfloat16, torch.float16) or new_value.dtype != new_key.dtype:
        raise ValueError(
            f"new K/V must be bf16 or fp16 alike, not {new_key.dtype}/{new_value.dtype}"
        )
    if new_key.stride(2) != 1 or new_value.stride(2) != 1:
        raise ValueError("new_key/new_value must be contiguous along head_size")


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dtype != torch.int8 or kv_cache.stride(1) != 1 or kv_cache.stride(0) % 2:
        raise ValueError("kv_cache must be int8 [num_blocks, page_bytes] with an even block stride")


def gather_kv_context_int4(
    kv_cache: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    *,
    kv_dtype: str = "int4",
    block_size: int,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_k: int,
    num_k_tokens: int,
    tail: torch.Tensor,
    tail_page: torch.Tensor,
    slot_of_seq: torch.Tensor,
    sink: torch.Tensor | None = None,
    sink_of_seq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gather_kv_context`` over ``int4`` pages, tails and sinks (the module docstring): its
    arguments, and ``paged_attention_int4``'s pools, row r of ``slot_of_seq`` / ``sink_of_seq``
    the sequence r of the cu_seqlens."""
    num_kv_heads, head_size = new_key.shape[1], new_key.shape[2]
    shape = (num_k_tokens, num_kv_heads, head_size)
    # as gather_kv_context's key, with the pools' shapes and the rows' slots and sinks
    key = (
        *_batch_key(new_key, new_value, kv_cache, block_table, cu_seqlens_q, cu_seqlens_k),
        kv_dtype, block_size, max_seqlen_k, num_k_tokens,
        tail.shape, tail.stride(), tail.dtype, tail_page.shape, tail_page.stride(),
        slot_of_seq.data_ptr(), slot_of_seq.shape, slot_of_seq.dtype,
        None if sink is None else (sink.shape, sink.stride(), sink.dtype),
        None if sink_of_seq is None else (sink_of_seq.data_ptr(), sink_of_seq.shape,
                                          sink_of_seq.dtype),
    )  # fmt: skip
    k_out = torch.empty(shape, dtype=new_key.dtype, device=new_key.device)
    v_out = torch.empty_like(k_out)
    if _replays.run(key, cache_ptr=kv_cache.view(torch.uint8), new_k_ptr=new_key,
                    new_v_ptr=new_value, k_out_ptr=k_out, v_out_ptr=v_out, tail_ptr=tail,
                    tail_page_ptr=tail_page, sink_ptr=sink, block_table_ptr=block_table,
                    cu_q_ptr=cu_seqlens_q, cu_k_ptr=cu_seqlens_k):  # fmt: skip
        return k_out, v_out
    layout = cached_int4_layout(kv_dtype, block_size, num_kv_heads, head_size)
    num_seqs = cu_seqlens_q.shape[0] - 1
    tail_pages = check_pools(
        tail, tail_page, sink, sink_of_seq, layout, num_seqs, "the int4 gather"
    )
    if slot_of_seq.dtype != torch.int32 or slot_of_seq.shape[0] < num_seqs:
        raise ValueError(f"slot_of_seq must be int32 [>= {num_seqs}]")
    _check_new_kv(new_key, new_value)
    _check_cache(kv_cache)
    if num_k_tokens == 0 or num_seqs == 0:
        return k_out, v_out
    has_sink = sink is not None
    if not has_sink:  # the tail stands in for the sink's pointers and strides, never read
        sink, sink_of_seq = tail, slot_of_seq
    ts, ss = tail.stride(), sink.stride()
    swap = [("cache_ptr", "cache16_ptr"), ("new_k_ptr",), ("new_v_ptr",), ("k_out_ptr",),
            ("v_out_ptr",), ("tail_ptr", *(() if has_sink else ("sink_ptr",))),
            ("tail_page_ptr",), *((name,) for name in _BATCH_PTRS)]  # fmt: skip
    if has_sink:
        swap.append(("sink_ptr",))
    grid = (-(-max_seqlen_k // _BLOCK_T), num_seqs, num_kv_heads)
    replay = launch_gather_int4.record(
        swap,
        grid,
        kv_cache.view(torch.uint8),
        kv_cache.view(torch.float16),
        tail,
        tail_page,
        sink,
        new_key,
        new_value,
        k_out,
        v_out,
        block_table,
        cu_seqlens_q,
        cu_seqlens_k,
        slot_of_seq,
        sink_of_seq,
        kv_cache.stride(0),
        block_table.stride(0),
        *ts[:4],
        *ss[:4],
        *_row_strides(new_key, new_value, k_out, v_out),
        num_seqs,
        BLOCK_T=_BLOCK_T,
        TAIL_PAGES=tail_pages,
        HAS_SINK=has_sink,
        **layout.kernel_constexprs(),
        OUT_BF16=new_key.dtype == torch.bfloat16,
        num_warps=4,
    )
    if replay is not None:
        _replays.add(key, [replay])
    return k_out, v_out
