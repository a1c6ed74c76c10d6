"""Cache write for ``int4``: new K/V go to the sequence's tail (model dtype) until their page fills;
then the whole page is quantized into its int4 page (K per channel over the page's 64 tokens, V per
token and group).

Two launches per call, in this order:

1. **flush**, grid (page programs, kv-heads, parts): each page program owns one page a sequence
   touches this step, in parts (K's channels, V's tokens: int4_flush_launch); a page complete at
   ``seq_lens[r]`` is quantized from the new tokens' K/V and, for its positions before this step,
   the sequence's tail rows -- only when those are the page's (``slot_is_new[r] == 0`` and
   ``tail_page[slot] == block``); otherwise the page is a full prefix-cache hit whose last token
   vLLM recomputes, and it is left as it is.
2. **tail**, grid (sequences, kv-heads): the new tokens of a sequence's last page are stored into
   its tail rows (unchanged, in the model's dtype), and ``tail_page[slot]`` is set to that page's
   block. A last page this step completed stays there too, when the flush quantized it (it was
   begun this step, or its earlier rows were the slot's): attention reads it in the model's dtype
   until the sequence's next token starts a new page, while prefix-cache sharers and later steps
   read its int4 page. A complete last page the flush left (a full prefix-cache hit whose last
   token vLLM recomputes) sets -1: the slot holds nothing.

The flush reads tail rows that the tail launch of the same step may overwrite (the same slot, a
chunk that completes one page and ends inside the next) and reads ``tail_page`` that it writes:
the launch order is what keeps every read before those writes (the tail launch reads the
``tail_page`` it overwrites only in its own program). Programs of one launch never write what
another program of it reads.

A tail of two pages (``TAIL_PAGES`` 2: the pool [slots, 2, H, 128, D], ``tail_page`` [slots, 2])
holds page pg in half pg % 2 (position p in row p % 128), and ``tail_page[slot, pg % 2]`` names its
block. The flush reads a page's earlier rows from its half; the tail store keeps the page before
the last as it keeps a complete last page (quantized this step), and also when the step did not
touch it and its half still names it, so a query reads its last 65..128 keys exact; otherwise (a
new slot: a prefix-cache hit, a resumed request) that half's entry is -1, as is the other half's
while the sequence has one page. Both halves change only after the flush read them.

``write_sink_int4`` is a launch of its own, for the sequences given a sink (their first page, the
attention-sink tokens, kept exact for good): it copies the new tokens at positions 0..63 into
``sink`` in the model's dtype and leaves the two launches above as they are (page 0 is quantized
into the cache all the same: a prefix-cache sharer without a sink reads it there). It reads only
key/value and writes only ``sink``, so it may run before or after them.

Page programs are numbered per sequence from ``qsl[r] // 64 + 2 r`` (a bound on the pages a
sequence of q_len new tokens touches, ceil((q_len - 1) / 64) + 1, that needs no prefix sum); a
decode step (max_query_len == 1: one page per sequence) uses one program per sequence.
reference_int4.py is the specification; the kernels do its arithmetic (IEEE division, round half
even) so the bytes match bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_plan import SLICED_METADATA_PTRS, find_seq
from .catalogue import get_dtype
from .launch import DirectLauncher, ReplayCache
from .page_layout import Int4PageLayout, cached_int4_layout
from .quantize import FP16_MAX, rint

# Codes 0..15; reference_int4.py (the kernels' specification) imports this and FP16_MAX.
INT4_LEVELS = get_dtype("int4").qmax

_LEVELS = tl.constexpr(INT4_LEVELS)
_FP16_MAX = tl.constexpr(FP16_MAX)


@triton.jit
def _codes(x, mn, mx, AXIS: tl.constexpr):
    """Codes (int32 0..15) of x [B, C] and the fp16 (scale, zero) of its groups, the rows
    (AXIS = 1) or the columns (AXIS = 0), from their fp32 min / max: reference_int4's steps."""
    lo = tl.minimum(tl.maximum(mn, -_FP16_MAX), _FP16_MAX)
    hi = tl.minimum(tl.maximum(mx, -_FP16_MAX), _FP16_MAX)
    scale = tl.div_rn(hi - lo, _LEVELS).to(tl.float16)
    zero = lo.to(tl.float16)
    if AXIS == 0:
        s = scale.to(tl.float32)[None, :]
        z = zero.to(tl.float32)[None, :]
    else:
        s = scale.to(tl.float32)[:, None]
        z = zero.to(tl.float32)[:, None]
    pos = s > 0.0
    y = tl.where(pos, tl.div_rn(x - z, tl.where(pos, s, 1.0)), 0.0)
    # y is never NaN here (finite x, positive divisor), so minimum/maximum agree on every target.
    q = rint(tl.minimum(tl.maximum(y, 0.0), _LEVELS)).to(tl.int32)
    return q, scale, zero


@triton.jit
def _finite(x, AXIS: tl.constexpr):
    # Comparisons, not tl.max: NaN propagation differs between the GPU and the interpreter.
    return tl.min((tl.abs(x) < float("inf")).to(tl.int32), axis=AXIS) == 1


@triton.jit
def _page_rows(new_row, tail_row, new, cols):
    """fp32 [B, len(cols)]: row r from ``new_row[r]`` (this step's K or V) where ``new[r]``, else
    from ``tail_row[r]`` (the slot's row of an earlier step)."""
    a = tl.load(new_row[:, None] + cols[None, :], mask=new[:, None], other=0.0)
    b = tl.load(tail_row[:, None] + cols[None, :], mask=~new[:, None], other=0.0)
    return tl.where(new[:, None], a.to(tl.float32), b.to(tl.float32))


@triton.jit
def _flush_k(
    new_row, tail_row, new, page, page16, head, c,
    HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, K_DATA: tl.constexpr, K_SZ: tl.constexpr,
):  # fmt: skip
    """Quantize the K channels c and HALF + c (c in [0, D/2): the two nibbles of one byte column)
    of a page per channel over its tokens (new_row, tail_row, new: all of them) and store their
    codes and (scale, zero)."""
    HALF: tl.constexpr = HEAD_SIZE // 2
    r = tl.arange(0, BLOCK_SIZE)
    x_lo = _page_rows(new_row, tail_row, new, c)  # channels [0, D/2): low nibbles
    x_hi = _page_rows(new_row, tail_row, new, HALF + c)  # [D/2, D): high nibbles
    # A channel with any NaN/Inf in the page is flagged: scale = zero = NaN, codes 0.
    f_lo = _finite(x_lo, 0)
    f_hi = _finite(x_hi, 0)
    x_lo = tl.where(f_lo[None, :], x_lo, 0.0)
    x_hi = tl.where(f_hi[None, :], x_hi, 0.0)
    q_lo, s_lo, z_lo = _codes(x_lo, tl.min(x_lo, axis=0), tl.max(x_lo, axis=0), 0)
    q_hi, s_hi, z_hi = _codes(x_hi, tl.min(x_hi, axis=0), tl.max(x_hi, axis=0), 0)
    packed = (q_lo | (q_hi << 4)).to(tl.uint8)
    tl.store(page + K_DATA + (head * BLOCK_SIZE + r)[:, None] * HALF + c[None, :], packed)
    sz = page16 + K_SZ // 2 + head * 2 * HEAD_SIZE
    nan = float("nan")
    tl.store(sz + c, tl.where(f_lo, s_lo, nan))
    tl.store(sz + HALF + c, tl.where(f_hi, s_hi, nan))
    tl.store(sz + HEAD_SIZE + c, tl.where(f_lo, z_lo, nan))
    tl.store(sz + HEAD_SIZE + HALF + c, tl.where(f_hi, z_hi, nan))


@triton.jit
def _flush_v(
    new_row, tail_row, new, page, page16, head, r,
    HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NGV: tl.constexpr, V_DATA: tl.constexpr,
    V_SZ: tl.constexpr,
):  # fmt: skip
    """Quantize the V of a page's tokens r (new_row, tail_row, new: theirs) per (token, group)
    and store their codes (key-major) and (scale, zero)."""
    HALF: tl.constexpr = HEAD_SIZE // 2
    c = tl.arange(0, HALF)
    x_lo = _page_rows(new_row, tail_row, new, c)
    x_hi = _page_rows(new_row, tail_row, new, HALF + c)
    # A token whose V has any NaN/Inf is flagged in every group.
    ok = _finite(x_lo, 1) & _finite(x_hi, 1)
    x_lo = tl.where(ok[:, None], x_lo, 0.0)
    x_hi = tl.where(ok[:, None], x_hi, 0.0)
    mn_lo = tl.min(x_lo, axis=1)
    mx_lo = tl.max(x_lo, axis=1)
    mn_hi = tl.min(x_hi, axis=1)
    mx_hi = tl.max(x_hi, axis=1)
    if NGV == 1:  # one group over both nibble halves
        mn_lo = tl.minimum(mn_lo, mn_hi)
        mx_lo = tl.maximum(mx_lo, mx_hi)
        mn_hi = mn_lo
        mx_hi = mx_lo
    q_lo, s_lo, z_lo = _codes(x_lo, mn_lo, mx_lo, 1)
    q_hi, s_hi, z_hi = _codes(x_hi, mn_hi, mx_hi, 1)
    packed = (q_lo | (q_hi << 4)).to(tl.uint8)
    # key-major: byte column i of the head is one B-byte run, tokens contiguous
    tl.store(page + V_DATA + (head * HALF + c)[None, :] * BLOCK_SIZE + r[:, None], packed)
    sz = page16 + V_SZ // 2 + head * NGV * 2 * BLOCK_SIZE
    nan = float("nan")
    tl.store(sz + r, tl.where(ok, s_lo, nan))
    tl.store(sz + BLOCK_SIZE + r, tl.where(ok, z_lo, nan))
    if NGV == 2:  # the high nibbles are group 1
        tl.store(sz + 2 * BLOCK_SIZE + r, tl.where(ok, s_hi, nan))
        tl.store(sz + 3 * BLOCK_SIZE + r, tl.where(ok, z_hi, nan))


# Batch-dependent ints are not specialized on (== 1, % 16), nor the alignment of the metadata
# pointers: one compiled variant for every batch and engine. The block table's stride is the
# engine's max_model_len in pages, and slot_is_new is the second row of the slot manager's
# (2, max_num_seqs) buffer (tail_slots.py), so neither is known to the start-up warm-up.
@triton.jit(
    do_not_specialize=["num_seqs", "stride_bt"],
    do_not_specialize_on_alignment=[*SLICED_METADATA_PTRS, "slot_of_seq_ptr", "slot_is_new_ptr"],
)
def _flush_pages_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,  # uint8 view of the cache
    cache16_ptr,  # fp16 view of the same storage
    tail_ptr,
    tail_page_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_table_ptr,
    slot_of_seq_ptr,
    slot_is_new_ptr,
    num_seqs,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_block,  # bytes between pages (>= page_bytes when vLLM pads pages)
    stride_bt,
    stride_ts,  # tail strides: slot, K/V, head, position (elements)
    stride_tkv,
    stride_th,
    stride_tp,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NGV: tl.constexpr,
    K_DATA: tl.constexpr,
    V_DATA: tl.constexpr,
    K_SZ: tl.constexpr,
    V_SZ: tl.constexpr,
    PAGES_PER_SEQ: tl.constexpr,  # 0: one program per sequence (a decode step), else 2
    TAIL_PAGES: tl.constexpr,  # pages per tail slot: 1, or 2 (page pg in half pg % 2)
    K_PARTS: tl.constexpr,  # a page's programs: K_PARTS over K's channels, V_PARTS over V's
    V_PARTS: tl.constexpr,  # tokens (int4_flush_launch)
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    part = tl.program_id(2)
    if PAGES_PER_SEQ == 0:
        seq = pid
        k = 0
    else:
        seq = find_seq(qsl_ptr, pid, num_seqs, BLOCK_SIZE, PAGES_PER_SEQ)
        k = pid - (tl.load(qsl_ptr + seq) // BLOCK_SIZE + seq * PAGES_PER_SEQ)
    q0 = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q0
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len
    pg = ctx // BLOCK_SIZE + k
    p0 = pg * BLOCK_SIZE
    slot = tl.load(slot_of_seq_ptr + seq).to(tl.int64)
    has_slot = slot >= 0
    # A row without a slot is no request (CUDA-graph padding, a dummy run over whatever the block
    # table still holds): it writes nothing, not even a page it would complete.
    complete = has_slot & (q_len > 0) & (p0 + BLOCK_SIZE <= seq_len)
    block = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + pg, mask=complete, other=0)
    block = block.to(tl.int64)
    kept = tl.load(slot_is_new_ptr + seq) == 0  # the slot's rows are this sequence's
    holder = tl.load(tail_entry(tail_page_ptr, slot, pg, TAIL_PAGES), mask=complete & has_slot,
                     other=-1)  # fmt: skip
    tail_ok = has_slot & kept & (holder.to(tl.int64) == block)
    # a page with positions before this step needs them from the tail (else: leave it)
    if complete & ((p0 >= ctx) | tail_ok):
        page = cache_ptr + block * stride_block
        page16 = cache16_ptr + block * (stride_block // 2)
        slot_row = tail_ptr + tl.maximum(slot, 0) * stride_ts + head * stride_th
        half = tail_half(pg, TAIL_PAGES) * BLOCK_SIZE
        if part < K_PARTS:  # K channels [part * KC, part * KC + KC) and their high-nibble twins
            KC: tl.constexpr = HEAD_SIZE // 2 // K_PARTS
            # (each branch's own names: Triton types a name assigned in both by both)
            rk = tl.arange(0, BLOCK_SIZE)
            new_k, tok_k = _flush_tokens(p0 + rk, q0, ctx)
            _flush_k(key_ptr + tok_k * stride_kt + head * stride_kh,
                     slot_row + (half + rk) * stride_tp, new_k, page, page16, head,
                     part * KC + tl.arange(0, KC), HEAD_SIZE, BLOCK_SIZE, K_DATA, K_SZ)  # fmt: skip
        else:  # V of the page's tokens [v * VR, v * VR + VR), v = part - K_PARTS
            VR: tl.constexpr = BLOCK_SIZE // V_PARTS
            rv = (part - K_PARTS) * VR + tl.arange(0, VR)
            new_v, tok_v = _flush_tokens(p0 + rv, q0, ctx)
            _flush_v(value_ptr + tok_v * stride_vt + head * stride_vh,
                     slot_row + stride_tkv + (half + rv) * stride_tp, new_v, page, page16, head,
                     rv, HEAD_SIZE, BLOCK_SIZE, NGV, V_DATA, V_SZ)  # fmt: skip


@triton.jit
def _flush_tokens(pos, q0, ctx):
    """Of a page's positions ``pos``: which are this step's new tokens, and their token index in
    the batch (0 for the others, which the flush reads from the tail)."""
    new = pos >= ctx
    tok = tl.where(new, (q0 + pos - ctx).to(tl.int64), 0)
    return new, tok


@triton.jit
def _store_rows(key_ptr, value_ptr, dst, stride_dkv, pos, q0, ctx, seq_len, head, stride_kt,
                stride_kh, stride_vt, stride_vh, HEAD_SIZE: tl.constexpr):  # fmt: skip
    """The step's new tokens among positions ``pos`` (those in [ctx, seq_len): token
    q0 + pos - ctx of the batch) of one kv-head, K and V, into a model-dtype page's rows ``dst``
    (K there, V ``stride_dkv`` after): a tail slot's or a sink's."""
    m = (pos >= ctx) & (pos < seq_len)
    tok = tl.where(m, q0 + pos - ctx, 0).to(tl.int64)
    d = tl.arange(0, HEAD_SIZE)
    k = tl.load(key_ptr + (tok * stride_kt + head * stride_kh)[:, None] + d[None, :],
                mask=m[:, None])  # fmt: skip
    v = tl.load(value_ptr + (tok * stride_vt + head * stride_vh)[:, None] + d[None, :],
                mask=m[:, None])  # fmt: skip
    ty = dst.dtype.element_ty
    tl.store(dst[:, None] + d[None, :], k.to(ty), mask=m[:, None])
    tl.store(dst[:, None] + stride_dkv + d[None, :], v.to(ty), mask=m[:, None])


@triton.jit
def tail_half(pg, TAIL_PAGES: tl.constexpr):
    """The half of a tail slot that holds page ``pg`` (>= -1): 0 with one page a slot, pg % 2
    with two."""
    return (pg + TAIL_PAGES) % TAIL_PAGES


@triton.jit
def tail_entry(tail_page_ptr, slot, pg, TAIL_PAGES: tl.constexpr):
    """Where ``tail_page`` names the block a slot holds for page ``pg`` (>= -1): [slots] with one
    page a slot, [slots, 2] (its half) with two."""
    return tail_page_ptr + slot * TAIL_PAGES + tail_half(pg, TAIL_PAGES)


@triton.jit
def exact_keys_start(tail_page_ptr, bt_row, slot, seq_len, BLOCK_SIZE: tl.constexpr,
                     TAIL_PAGES: tl.constexpr):  # fmt: skip
    """The first key a sequence reads from its slot's tail, in the model's dtype (a page start;
    keys below it come from int4 pages): its partial last page; a complete last page the step
    left in the tail (its entry names the block of the sequence's block-table row ``bt_row``);
    with two pages a slot, the page before that when its half names its block too. Slot -1: no
    tail. reference_int4.tail_start is the spec."""
    full = (seq_len // BLOCK_SIZE) * BLOCK_SIZE
    if (full == seq_len) & (full > 0) & (slot >= 0):
        pg = full // BLOCK_SIZE - 1
        entry = tail_entry(tail_page_ptr, tl.maximum(slot, 0), pg, TAIL_PAGES)
        if tl.load(entry) == tl.load(bt_row + pg):
            full = full - BLOCK_SIZE
    if TAIL_PAGES == 2:
        if (full > 0) & (full < seq_len) & (slot >= 0):
            pg = full // BLOCK_SIZE - 1
            if tl.load(tail_entry(tail_page_ptr, slot, pg, TAIL_PAGES)) == tl.load(bt_row + pg):
                full = full - BLOCK_SIZE
    return full


@triton.jit(  # as _flush_pages_kernel
    do_not_specialize=["num_seqs", "stride_bt"],
    do_not_specialize_on_alignment=[*SLICED_METADATA_PTRS, "slot_of_seq_ptr", "slot_is_new_ptr"],
)
def _store_tail_kernel(
    key_ptr,
    value_ptr,
    tail_ptr,
    tail_page_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_table_ptr,
    slot_of_seq_ptr,
    slot_is_new_ptr,
    num_seqs,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ts,
    stride_tkv,
    stride_th,
    stride_tp,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TAIL_PAGES: tl.constexpr,  # as _flush_pages_kernel's
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q0 = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q0
    seq_len = tl.load(seq_lens_ptr + seq)
    slot = tl.load(slot_of_seq_ptr + seq).to(tl.int64)
    if (q_len > 0) & (slot >= 0):
        ctx = seq_len - q_len
        last = (seq_len - 1) // BLOCK_SIZE
        new = tl.load(slot_is_new_ptr + seq) != 0
        for i in tl.static_range(TAIL_PAGES):  # with two pages the one before the newest first
            _keep_page(key_ptr, value_ptr, tail_ptr, tail_page_ptr, block_table_ptr, seq, slot,
                       last - TAIL_PAGES + 1 + i, q0, ctx, seq_len, head, new, stride_kt,
                       stride_kh, stride_vt, stride_vh, stride_bt, stride_ts, stride_tkv,
                       stride_th, stride_tp, HEAD_SIZE, BLOCK_SIZE, TAIL_PAGES)  # fmt: skip


@triton.jit
def _keep_page(key_ptr, value_ptr, tail_ptr, tail_page_ptr, block_table_ptr, seq, slot, pg, q0,
               ctx, seq_len, head, new, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
               stride_ts, stride_tkv, stride_th, stride_tp, HEAD_SIZE: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, TAIL_PAGES: tl.constexpr):  # fmt: skip
    """The tail store of page pg (>= -1) of a sequence: its new rows into the page's half and its
    block into that half's entry when the slot keeps it, else -1. A slot keeps a partial page,
    and a complete one the flush quantized (it began this step, or its earlier rows were the
    slot's: the flush's own condition, on tail_page as it was before this step) or, with two
    pages, that the step did not touch and the half still names (the page before the newest).
    -1: a prefix-cache page the flush left, or pg -1 (a sequence of one page, two-page tail).
    Every head's program reads the entry and head 0's rewrites it, which never flips the
    comparison: it stores block when equal, else -1."""
    entry = tail_entry(tail_page_ptr, slot, pg, TAIL_PAGES)
    if pg < 0:
        if head == 0:
            tl.store(entry, -1)
    else:
        p0 = pg * BLOCK_SIZE
        block = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + pg)
        named = (~new) & (tl.load(entry) == block)
        if (p0 + BLOCK_SIZE > seq_len) | (p0 >= ctx) | named:
            # only the page's new rows, [max(p0, ctx), min(p0 + B, seq_len)), in tiles of 16: a
            # decode step's one row is one small tile, not a masked [B, D] page
            lo = tl.maximum(p0, ctx)
            hi = tl.minimum(p0 + BLOCK_SIZE, seq_len)
            row0 = tail_ptr + slot * stride_ts + head * stride_th  # the page's first tail row
            row0 += (tail_half(pg, TAIL_PAGES) * BLOCK_SIZE) * stride_tp
            for r0 in range(lo, hi, 16):
                pos = r0 + tl.arange(0, 16)
                dst = row0 + (pos - p0) * stride_tp
                _store_rows(key_ptr, value_ptr, dst, stride_tkv, pos, q0, ctx, hi, head,
                            stride_kt, stride_kh, stride_vt, stride_vh, HEAD_SIZE)  # fmt: skip
            if head == 0:
                tl.store(entry, block)
        elif head == 0:
            tl.store(entry, -1)


# As _store_tail_kernel, but no block table: the sink rows are addressed by position alone.
@triton.jit(do_not_specialize_on_alignment=["qsl_ptr", "seq_lens_ptr", "sink_of_seq_ptr"])
def _store_sink_kernel(
    key_ptr,
    value_ptr,
    sink_ptr,
    qsl_ptr,
    seq_lens_ptr,
    sink_of_seq_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ss,  # sink strides: sink, K/V, head, position (elements)
    stride_skv,
    stride_sh,
    stride_sp,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q0 = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q0
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len
    sink = tl.load(sink_of_seq_ptr + seq).to(tl.int64)
    # a row past page 0 (every decode step after the 64th token) stops here: one program of
    # scalar loads per row and kv-head
    if (sink >= 0) & (ctx < BLOCK_SIZE) & (q_len > 0):
        r = tl.arange(0, BLOCK_SIZE)  # positions 0..63, the sink rows
        dst = sink_ptr + sink * stride_ss + head * stride_sh + r * stride_sp
        _store_rows(key_ptr, value_ptr, dst, stride_skv, r, q0, ctx, seq_len, head, stride_kt,
                    stride_kh, stride_vt, stride_vh, HEAD_SIZE)  # fmt: skip


def int4_flush_launch(layout: Int4PageLayout) -> dict[str, int]:
    """The flush's programs a page and their warps. K is quantized per channel and V per token,
    so a page splits into programs without changing a bit: K_PARTS programs of 16 channel pairs
    (a [64, 32] fp32 tile) and V_PARTS of 16 tokens (a [16, D] tile). With one program a page,
    its K and V each [64, D] fp32 in registers, a decode step's flush and tail store at Gemma 3's
    4/1 heads of 256 took 33.6 µs on an H100 against ``int8``'s 2.6 µs write
    (benchmarks/results/kernels_gemma3_write.json), where only the sequences whose token
    completes a page (about one in 64) quantize one."""
    return {"K_PARTS": layout.head_size // 32, "V_PARTS": layout.block_size // 16, "num_warps": 4}


launch_flush = DirectLauncher(_flush_pages_kernel)
launch_tail = DirectLauncher(_store_tail_kernel)
launch_sink = DirectLauncher(_store_sink_kernel)
_replays = ReplayCache()


def tail_pool_shapes(
    num_slots: int, num_kv_heads: int, head_size: int, pages: int = 1, block_size: int = 64
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tail, tail_page) shapes of a pool of ``pages`` pages a slot, as :func:`check_tail` wants
    them: [slots, 2, H, block_size x pages, D], and [slots] for one page, [slots, pages] for two."""
    tail = (num_slots, 2, num_kv_heads, block_size * pages, head_size)
    return tail, (num_slots,) if pages == 1 else (num_slots, pages)


def check_tail(tail: torch.Tensor, tail_page: torch.Tensor, layout: Int4PageLayout) -> int:
    """The tail pool's shape contract: [slots, 2, H, 64, D] model dtype and int32 [slots] (one
    page a slot), or [slots, 2, H, 128, D] and int32 [slots, 2] contiguous (two pages, page pg in
    half pg % 2). Returns the pages a slot holds."""
    pages = 2 if tail.dim() == 5 and tail.shape[3] == 2 * layout.block_size else 1
    _check_page_pool(tail, "tail", "num_slots", layout, pages)
    held = tail_pool_shapes(tail.shape[0], layout.num_kv_heads, layout.head_size, pages)[1]
    if tail_page is not None and (
        tail_page.dtype != torch.int32
        or tuple(tail_page.shape) != held
        or not tail_page.is_contiguous()
    ):
        raise ValueError(f"tail_page must be int32 {list(held)} for a tail of {pages} page(s)")
    return pages


def check_sink(
    sink: torch.Tensor, sink_of_seq: torch.Tensor, layout: Int4PageLayout, num_seqs: int
) -> None:
    """The sink pool's shape contract, the tail's: [sinks, 2, H, 64, D] model dtype; sink_of_seq
    int32, one entry per row of the batch's ``num_seqs`` at least."""
    _check_page_pool(sink, "sink", "num_sinks", layout)
    if sink_of_seq.dtype != torch.int32 or sink_of_seq.dim() != 1:
        raise ValueError("sink_of_seq must be int32 [>= num_seqs]")
    if sink_of_seq.shape[0] < num_seqs:
        raise ValueError(f"sink_of_seq has {sink_of_seq.shape[0]} entries for {num_seqs} rows")


def check_pools(
    tail: torch.Tensor,
    tail_page: torch.Tensor,
    sink: torch.Tensor | None,
    sink_of_seq: torch.Tensor | None,
    layout: Int4PageLayout,
    num_seqs: int,
    reader: str,
) -> int:
    """The pools a reader of int4 keys takes (``paged_attention_int4``, the context gather,
    named by ``reader`` in the messages): the tail pool (``check_tail``; its pages a slot are
    returned) and, both or neither, the sink pool and its rows (``check_sink``)."""
    tail_pages = check_tail(tail, tail_page, layout)
    if (sink is None) != (sink_of_seq is None):
        raise ValueError(f"{reader} takes sink and sink_of_seq together, or neither")
    if sink is not None:
        check_sink(sink, sink_of_seq, layout, num_seqs)
    return tail_pages


def _check_page_pool(
    pool: torch.Tensor, name: str, rows: str, layout: Int4PageLayout, pages: int = 1
) -> None:
    h, b, d = layout.num_kv_heads, layout.block_size * pages, layout.head_size
    if pool.dim() != 5 or tuple(pool.shape[1:]) != (2, h, b, d) or pool.stride(4) != 1:
        raise ValueError(
            f"{name} must be [{rows}, 2, {h}, {b}, {d}] with unit stride along head_size, "
            f"got {tuple(pool.shape)}"
        )
    if pool.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{name} must be bf16 or fp16, got {pool.dtype}")


def write_kv_cache_int4(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    tail: torch.Tensor,
    tail_page: torch.Tensor,
    *,
    block_size: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_of_seq: torch.Tensor,
    slot_is_new: torch.Tensor,
    num_seqs: int,
    max_query_len: int,
    kv_dtype: str = "int4",
) -> None:
    """Write this step's K/V of ``int4`` sequences: complete pages into ``kv_cache``, last pages
    into ``tail``, a complete one as well when this step's flush quantized it (module docstring;
    reference_int4.write_kv_cache_int4_ref is the spec).

    key, value: [num_tokens, num_kv_heads, head_size] bf16/fp16, unit stride along head_size;
    sequence r's new tokens are rows [query_start_loc[r], query_start_loc[r + 1]) at positions
    [seq_lens[r] - q_len, seq_lens[r]). kv_cache: int8 [num_blocks, >= page_bytes]; tail:
    [num_slots, 2, num_kv_heads, 64, head_size] (tail[s, 0] K, tail[s, 1] V, position p in row
    p % 64); tail_page: int32 [num_slots]. A tail of two pages (``INT8KV_INT4_TAIL_PAGES=2``) is
    [num_slots, 2, num_kv_heads, 128, head_size] (position p in row p % 128) with tail_page int32
    [num_slots, 2], and keeps the page before the last too (module docstring); slot_of_seq, slot_is_new: int32 [>= num_seqs] (slot -1:
    no request, e.g. CUDA-graph padding or a dummy run: nothing of it is written, not even a page
    it completes). Two launches, shapes from Python ints only:
    no host sync, CUDA-graph safe.
    """
    # Everything that decides the launches but the addresses of the calling layer's own tensors
    # (new K/V, cache, tail pool and its pages) and of the batch's block table, query starts and
    # lengths (each KV-cache group has its own block table): every layer of a step repeats the
    # call with only those changed, and replays the first layer's launches (launch.py).
    memo = (
        key.shape, key.stride(), value.shape, value.stride(), kv_cache.stride(), tail.shape,
        tail.stride(), tail_page.shape, tail_page.stride(), kv_dtype, block_size,
        query_start_loc.dtype, seq_lens.dtype, block_table.stride(), block_table.dtype,
        slot_of_seq.data_ptr(), slot_of_seq.dtype, slot_is_new.data_ptr(), slot_is_new.dtype,
        num_seqs, max_query_len,
    )  # fmt: skip
    if _replays.run(memo, key_ptr=key, value_ptr=value, cache_ptr=kv_cache.view(torch.uint8),
                    tail_ptr=tail, tail_page_ptr=tail_page, block_table_ptr=block_table,
                    qsl_ptr=query_start_loc, seq_lens_ptr=seq_lens):  # fmt: skip
        return
    _, num_kv_heads, head_size = key.shape
    layout = cached_int4_layout(kv_dtype, block_size, num_kv_heads, head_size)
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key/value must be contiguous along head_size")
    if kv_cache.dtype != torch.int8 or kv_cache.stride(1) != 1 or kv_cache.stride(0) % 2:
        raise ValueError("kv_cache must be int8 [num_blocks, page_bytes] with an even block stride")
    tail_pages = check_tail(tail, tail_page, layout)
    if num_seqs == 0 or key.shape[0] == 0:
        return
    per_seq = 0 if max_query_len <= 1 else 2
    programs = num_seqs if per_seq == 0 else key.shape[0] // block_size + per_seq * num_seqs
    ts = tail.stride()
    layer = [("key_ptr",), ("value_ptr",), ("tail_ptr",), ("tail_page_ptr",),
             *((name,) for name in SLICED_METADATA_PTRS)]  # fmt: skip
    parts = int4_flush_launch(layout)
    flush = launch_flush.record(
        [*layer, ("cache_ptr", "cache16_ptr")],
        (programs, num_kv_heads, parts["K_PARTS"] + parts["V_PARTS"]),
        key,
        value,
        kv_cache.view(torch.uint8),
        kv_cache.view(torch.float16),
        tail,
        tail_page,
        query_start_loc,
        seq_lens,
        block_table,
        slot_of_seq,
        slot_is_new,
        num_seqs,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        block_table.stride(0),
        ts[0],
        ts[1],
        ts[2],
        ts[3],
        PAGES_PER_SEQ=per_seq,
        TAIL_PAGES=tail_pages,
        **layout.kernel_constexprs(),
        **parts,
    )
    store = launch_tail.record(
        layer,
        (num_seqs, num_kv_heads),
        key,
        value,
        tail,
        tail_page,
        query_start_loc,
        seq_lens,
        block_table,
        slot_of_seq,
        slot_is_new,
        num_seqs,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        block_table.stride(0),
        ts[0],
        ts[1],
        ts[2],
        ts[3],
        HEAD_SIZE=head_size,
        BLOCK_SIZE=block_size,
        TAIL_PAGES=tail_pages,
        num_warps=4,
    )
    if flush is not None and store is not None:
        _replays.add(memo, [flush, store])


def write_sink_int4(
    key: torch.Tensor,
    value: torch.Tensor,
    sink: torch.Tensor,
    sink_of_seq: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
    block_size: int = 64,
    kv_dtype: str = "int4",
) -> None:
    """Copy the new tokens at positions 0..63 (a sequence's first page, its attention-sink tokens)
    into the sequence's sink rows, exact in ``sink``'s dtype, beside the int4 write (which still
    quantizes that page into the cache); ``paged_attention_int4`` reads them instead of the page.
    reference_int4.write_sink_int4_ref is the spec.

    key, value, query_start_loc, seq_lens: as ``write_kv_cache_int4``. sink: [num_sinks, 2,
    num_kv_heads, 64, head_size] bf16/fp16 (sink[s, 0] K, sink[s, 1] V, position p in row p);
    sink_of_seq: int32 [>= num_seqs], the row's sink or -1 (nothing written). Tokens at positions
    >= 64 and rows past num_seqs write nothing. One launch, grid (num_seqs, num_kv_heads): no host
    sync, CUDA-graph safe.
    """
    # as write_kv_cache_int4's: the layer's own new K/V and sink pool are swapped into a replay
    memo = (
        "sink", key.shape, key.stride(), value.shape, value.stride(), sink.shape, sink.stride(),
        query_start_loc.data_ptr(), query_start_loc.dtype, seq_lens.data_ptr(), seq_lens.dtype,
        sink_of_seq.data_ptr(), sink_of_seq.shape, sink_of_seq.dtype, num_seqs, block_size,
        kv_dtype,
    )  # fmt: skip
    if _replays.run(memo, key_ptr=key, value_ptr=value, sink_ptr=sink):
        return
    _, num_kv_heads, head_size = key.shape
    layout = cached_int4_layout(kv_dtype, block_size, num_kv_heads, head_size)
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key/value must be contiguous along head_size")
    check_sink(sink, sink_of_seq, layout, num_seqs)
    if num_seqs == 0 or key.shape[0] == 0:
        return
    ss = sink.stride()
    replay = launch_sink.record(
        [("key_ptr",), ("value_ptr",), ("sink_ptr",)],
        (num_seqs, num_kv_heads),
        key,
        value,
        sink,
        query_start_loc,
        seq_lens,
        sink_of_seq,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        ss[0],
        ss[1],
        ss[2],
        ss[3],
        HEAD_SIZE=head_size,
        BLOCK_SIZE=block_size,
        num_warps=4,
    )
    if replay is not None:
        _replays.add(memo, [replay])
