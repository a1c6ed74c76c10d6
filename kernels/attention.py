"""Paged attention over INT8 pages for vLLM's mixed batches (decodes, prefills, continuations).

One Triton kernel, two launch shapes chosen on the host from Python ints only:

* **decode / split-KV** (short queries, ``max_query_len * group <= 16``): grid
  (query blocks, kv-heads, splits). All query heads of a GQA group are packed into the M dimension
  of one program (padded to 16 rows, the smallest tl.dot), so each K/V tile is loaded once per
  group; long contexts are split across programs (flash-decoding) so a single 32K sequence still
  fills the GPU. Partial (acc, max, sum) go to a workspace and a small kernel merges them.
* **prefill / mixed**: grid (query blocks, kv-heads, splits) with 64-128 rows of (query token,
  head) per program; split only where those programs would leave SMs idle (a few new tokens over
  a long context: the end of a chunked prompt).

Dequantization never multiplies K/V elements. QK runs on int8 tensor cores: the query is split
into two int8 halves per row (``_split_q_i8``, a 16-bit grid) and dotted with the cached K bytes
as they are; the row's unit and the softmax scale multiply the score rows, the per-token K scale
the score columns. PV is an fp16 ``tl.dot``: V's int8 is pasted into fp16 in registers and the
per-token V scale multiplies the P column first. ``int8``'s scales cover 64 channels each
above head size 128 (page_layout.py): there both products run one dot per group (the groups' QK dots
summed after their column scaling, the PV dots into their own slices of the output), the same
tensor-core work as one dot over the head. ``int8_static``'s per-channel scales fold into the
query (K's: q * s, once, before the split) and the output (V's: one multiply per channel of the
accumulator). Accumulation is int32 / fp32 (sm80 mma.sync; nothing Hopper-specific is asked
for). No host syncs and no data-dependent grid: safe under CUDA-graph capture when
``workspace`` is given.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .attention_int4 import paged_attention_int4
from .attention_plan import (
    M_INIT,
    MAX_SPLITS,
    SLICED_METADATA_PTRS,
    AttentionWorkspace,
    LaunchConfig,
    LaunchPlan,
    block_rows,
    check_shapes,
    choose_num_splits,
    device_cc_major,
    launch_merge,
    launch_split_merge,
    make_workspace,
    plan_launch,
    query_block,
    score_scale_of,
    soft_capped,
    softmax_step,
    store_split_stats,
    visible_keys,
)
from .catalogue import INT4_DTYPES
from .e4m3 import E4M3_F16_UNSCALE, check_v_format, e4m3_decode_f16
from .launch import DirectLauncher, ReplayCache
from .page_layout import cached_page_layout, next_power_of_2
from .quantize import check_static_scales, rint

# Re-exported: the int8 attention's public names from before the planning had its own module.
__all__ = ["AttentionWorkspace", "LaunchConfig", "MAX_SPLITS", "choose_num_splits",
           "launch_merge", "make_workspace", "paged_attention"]  # fmt: skip

_E4M3_UNSCALE = tl.constexpr(E4M3_F16_UNSCALE)


@triton.jit
def _i8_to_f16(x):
    # int8 -> fp16 without the conversion unit (cvt runs at 16/clk/SM, a quarter of what the
    # bandwidth needs): flip the sign bit (offset binary u = x + 128), paste each byte under the
    # fp16 exponent of 1024 with a byte permute (0x64uu = 1024 + u = 1152 + x), two lanes at a
    # time, then subtract 1152 in fp16x2. 5 instructions per 4 elements; exact for every int8.
    pasted = tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, b;
        mov.b32 b, 0x64646464;
        xor.b32 t, $2, 0x80808080;
        prmt.b32 $0, t, b, 0x5150;
        prmt.b32 $1, t, b, 0x5352;
        }
        """,
        constraints="=r,=r,r",
        args=[x],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )
    return pasted - tl.full([], 1152.0, tl.float16)


@triton.jit
def _split_q_i8(q, DOT_F32: tl.constexpr):
    """q [M, D] -> (hi, lo, unit): q ~= unit * (256 * hi + lo) per row, hi and lo int8.

    unit = max|q_row| / (127 * 256), so 256 * hi + lo is q on a 16-bit grid: the error per
    element is at most max|q_row| / 65024 (clamping lo at 127 costs at most twice that). In a
    score that is at most sqrt(D) * 254 / 65024 (4% at D=128) of the error K's own int8 rounding
    (max|k| / 254 per element) already makes, outlier channels or not. With it the QK product
    runs on int8 tensor cores straight from the cached K bytes: no K conversion at all, and hi
    and lo each take half the MMA time of one fp16 dot."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.abs(qf), axis=1)
    step = tl.where(amax > 0.0, amax / 127.0, 1.0)
    hi, lo = _split_on_grid(qf, step, DOT_F32)
    return hi, lo, step * (1.0 / 256.0)


@triton.jit
def _split_on_grid(qf, step, DOT_F32: tl.constexpr):
    x = qf / step[:, None]
    hi = rint(x)
    lo = tl.minimum(rint((x - hi) * 256.0), 127.0)
    if not DOT_F32:
        hi = hi.to(tl.int8)
        lo = lo.to(tl.int8)
    return hi, lo


@triton.jit
def _split_q_groups(
    q_rows, row_ok, HEAD_SIZE: tl.constexpr, NG: tl.constexpr, DOT_F32: tl.constexpr
):  # fmt: skip
    """``_split_q_i8`` of the query rows at pointers ``q_rows`` [M], with hi and lo as tuples of
    NG tiles [M, HEAD_SIZE / NG], one per K scale group: each group's dot is its own tl.dot (its
    score columns take that group's K scales), and loading the groups apart spares slicing a
    register tile. One grid per row over all groups, so the row unit still factors out."""
    G: tl.constexpr = HEAD_SIZE // NG
    offs_g = tl.arange(0, G)
    qs = ()
    for g in tl.static_range(NG):
        qg = tl.load(q_rows[:, None] + g * G + offs_g[None, :], mask=row_ok[:, None], other=0.0)
        qs = qs + (qg.to(tl.float32),)
    amax = tl.max(tl.abs(qs[0]), axis=1)
    for g in tl.static_range(1, NG):
        amax = tl.maximum(amax, tl.max(tl.abs(qs[g]), axis=1))
    step = tl.where(amax > 0.0, amax / 127.0, 1.0)
    his = ()
    los = ()
    for g in tl.static_range(NG):
        hi, lo = _split_on_grid(qs[g], step, DOT_F32)
        his = his + (hi,)
        los = los + (lo,)
    return his, los, step * (1.0 / 256.0)


@triton.jit
def _qk_i8(q_hi, q_lo, k, DOT_F32: tl.constexpr):
    """256 * (q_hi . k) + q_lo . k as fp32: int32 MMAs, exact until the final conversion."""
    if DOT_F32:
        kf = k.to(tl.float32)  # the interpreter's fp32 dot is exact on these integers
        return tl.dot(q_hi, kf) * 256.0 + tl.dot(q_lo, kf)
    hi = tl.dot(q_hi, k, out_dtype=tl.int32)
    return tl.dot(q_lo, k, hi * 256, out_dtype=tl.int32).to(tl.float32)


@triton.jit
def _p_to_dot(p, NG: tl.constexpr, DOT_F32: tl.constexpr):
    """P in the PV dot's dtype, converted once for all NG scale groups: each group's V scales
    then multiply it in fp16 (half2, two columns an instruction), not in fp32 before a conversion
    per group. That rounds twice (p to fp16, then the product), 2^-11 relative each, where one
    group's P, scaled in fp32, is rounded once to the dot operand."""
    if NG == 1 or DOT_F32:
        out = p
    else:
        out = p.to(tl.float16)
    return out


@triton.jit
def _v_to_dot(v, V_E4M3: tl.constexpr, DOT_F32: tl.constexpr):
    """V bytes -> the dot operand: int8 integers, or E4M3 codes as value / 256 (the 256 and the
    static scale multiply the output once, so no per-element multiply here)."""
    if V_E4M3:
        v = e4m3_decode_f16(v)  # exact in fp16; fp32 for the interpreter's dot is exact too
        if DOT_F32:
            v = v.to(tl.float32)
    elif DOT_F32:
        v = v.to(tl.float32)
    else:
        v = _i8_to_f16(v)
    return v


@triton.jit
def _load_pages(bt_row, key, key_hi, BLOCK_SIZE: tl.constexpr, PAIRS: tl.constexpr = False):
    """Page of each key of a tile (block-table gather); 0 for keys past the end.

    ``PAIRS`` (``key`` a 1-D tile from an even key, ``BLOCK_SIZE`` even): 0 only for keys past
    the end of the last page, so that the two keys of each pair (2i, 2i + 1) get one page, as the
    compiler is told (``_load_scales``' pair loads)."""
    if PAIRS:
        ok = key - key % BLOCK_SIZE < key_hi
    else:
        ok = key < key_hi
    page = tl.load(bt_row + key // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    if PAIRS:
        page = tl.max_constancy(page, 2)
    return page


@triton.jit
def _load_scales(
    cache16_ptr, page, key, key_hi, kvh, stride_block,
    BLOCK_SIZE: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr, DYNAMIC: tl.constexpr,
    NG: tl.constexpr, PAIRS: tl.constexpr = False,
):  # fmt: skip
    """fp16 K and V scales of ``key`` (a tile of key positions on pages ``page``), as tuples of
    one tile per scale group; ones if static.

    ``PAIRS`` (``page`` from ``_load_pages(..., PAIRS=True)``): the scales of each pair of keys
    (2i, 2i + 1) as one 4-byte load, unmasked. The two share a page, so their scales are adjacent
    (and 4-byte aligned where ``stride_block`` is a multiple of 4, which Triton's specialization
    on 16 tells the compiler; otherwise the loads stay 2 bytes wide). Keys past ``key_hi`` read
    their slot in the last page or in block 0, in bounds, and come back as whatever is there:
    the caller zeroes their V scales (``_v_scales_ok``); their K scales only reach scores that
    the causal mask replaces. The two-deep prefetch holds two tiles of 2 * NG scale vectors in
    registers, at NG = 4 most of the difference between the head-256 loop's 183 registers
    without it and 255 with it (sm90); two scales a register instead of one."""
    if DYNAMIC:
        slot = key % BLOCK_SIZE
        if PAIRS:
            slot = tl.max_contiguous(tl.multiple_of(slot, 2), 2)
        idx = page * (stride_block // 2) + kvh * NG * BLOCK_SIZE + slot
        k_sc = ()
        v_sc = ()
        for g in tl.static_range(NG):
            if PAIRS:
                k_g = tl.load(cache16_ptr + K_SCALE // 2 + g * BLOCK_SIZE + idx)
                v_g = tl.load(cache16_ptr + V_SCALE // 2 + g * BLOCK_SIZE + idx)
            else:
                ok = key < key_hi
                k_g = tl.load(cache16_ptr + K_SCALE // 2 + g * BLOCK_SIZE + idx, mask=ok,
                              other=0.0)  # fmt: skip
                v_g = tl.load(cache16_ptr + V_SCALE // 2 + g * BLOCK_SIZE + idx, mask=ok,
                              other=0.0)  # fmt: skip
            k_sc = k_sc + (k_g,)
            v_sc = v_sc + (v_g,)
    else:
        k_sc = (tl.full(key.shape, 1.0, tl.float16),)
        v_sc = k_sc
    return k_sc, v_sc


@triton.jit
def _v_scales_ok(v_sc, key_ok, PAIRS: tl.constexpr):
    """V scales of keys past the end zeroed where ``_load_scales`` read them unmasked: their p is
    0, but a stale slot can hold an fp16 NaN or infinity, and 0 * NaN is not 0. Done where the
    scales are used, not where loaded, so the prefetch never waits on a load it just issued."""
    if PAIRS:
        out = ()
        for g in tl.static_range(len(v_sc)):
            out = out + (tl.where(key_ok, v_sc[g], 0.0),)
    else:
        out = v_sc
    return out


@triton.jit
def _load_tile_pages(bt_row, start, key_hi, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Pages of the tile of keys ``start + arange(TILE_N)`` (``start`` and ``TILE_N`` multiples of
    ``BLOCK_SIZE``), one per page from contiguous block-table entries, and which hold any key
    below ``key_hi``."""
    offs_p = tl.arange(0, TILE_N // BLOCK_SIZE)
    page_ok = start + offs_p * BLOCK_SIZE < key_hi
    pages = tl.load(bt_row + start // BLOCK_SIZE + offs_p, mask=page_ok, other=0).to(tl.int64)
    return pages, page_ok


@triton.jit
def v_column(page, key, kvh, stride_block, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Byte offset (from the V region) of element 0 of ``key``'s V in head ``kvh``: V is key-major,
    element d sits ``d * BLOCK_SIZE`` bytes further (page_layout.py)."""
    return page * stride_block + kvh * HEAD_SIZE * BLOCK_SIZE + key % BLOCK_SIZE


@triton.jit
def _load_key_major_tile(
    head_ptr, bt_row, page, start, key, key_ok, key_hi, stride_block, cols,
    COLS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
):  # fmt: skip
    """Bytes [TILE_N, COLS] of columns ``cols`` of the keys ``start + arange(TILE_N)`` from a
    key-major region (column c of slot t at ``head_ptr + page * stride_block + c * B + t``: int8 V,
    and int4 V's packed byte columns, page_layout.py).

    Key-major puts the tile in shared memory with keys contiguous: the PV product's B operand then
    loads four keys per 32-bit word, where a column-contiguous V had to be read one byte per
    instruction. When whole pages fit the tile, it is read a page at a time (B contiguous bytes per
    column: 16-byte asynchronous copies), and keys past ``key_hi`` inside a valid page come back as
    whatever bytes are there; otherwise per key, from ``page`` (narrower loads, 0 past key_hi).
    """
    if TILE_N % BLOCK_SIZE == 0:
        pages, page_ok = _load_tile_pages(bt_row, start, key_hi, TILE_N, BLOCK_SIZE)
        offs_b = tl.arange(0, BLOCK_SIZE)
        addr = (
            pages[:, None, None] * stride_block + cols[None, None, :] * BLOCK_SIZE
            + offs_b[None, :, None]
        )  # fmt: skip
        tile = tl.load(head_ptr + addr, mask=page_ok[:, None, None], other=0)
        return tl.reshape(tile, [TILE_N, COLS])
    col = page * stride_block + key % BLOCK_SIZE
    return tl.load(head_ptr + col[:, None] + cols[None, :] * BLOCK_SIZE, mask=key_ok[:, None],
                   other=0)  # fmt: skip


@triton.jit
def _load_v_tile(
    cache_ptr, bt_row, page, start, key, key_ok, key_hi, kvh, stride_block,
    HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, V_DATA: tl.constexpr,
    V_E4M3: tl.constexpr, COL0: tl.constexpr = 0, COLS: tl.constexpr = None,
):  # fmt: skip
    """The int8 V tile [TILE_N, COLS] of channels [COL0, COL0 + COLS) (all HEAD_SIZE by default)
    of keys ``start + arange(TILE_N)`` (V is key-major: element d of slot t at (h*D + d)*B + t,
    page_layout.py)."""
    W: tl.constexpr = HEAD_SIZE if COLS is None else COLS
    v = _load_key_major_tile(
        cache_ptr + V_DATA + kvh * HEAD_SIZE * BLOCK_SIZE, bt_row, page, start, key, key_ok,
        key_hi, stride_block, COL0 + tl.arange(0, W), W, BLOCK_SIZE, TILE_N,
    )  # fmt: skip
    if V_E4M3 and TILE_N % BLOCK_SIZE == 0:
        # keys past key_hi inside a valid page are read (in bounds); their p is 0, but a stale
        # byte there can be an E4M3 NaN code and 0 * NaN is not 0 (int8 codes are all finite)
        v = tl.where(key_ok[:, None], v, 0)
    return v


@triton.jit
def _load_scales_by_page(
    cache16_ptr, bt_row, start, key, key_hi, kvh, stride_block, TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr, NG: tl.constexpr,
):  # fmt: skip
    """fp16 K and V scales of the tile of keys ``start + arange(TILE_N)``, read a page at a time,
    as tuples of one [TILE_N] tile per scale group.

    For ``start`` and ``TILE_N`` multiples of ``BLOCK_SIZE``. A page's scales of one head are
    ``BLOCK_SIZE`` contiguous fp16, so this reads 16-byte vectors that the pipeliner turns into
    asynchronous copies, where per-key 2-byte gathers (``_load_scales``) stay synchronous and
    expose a dependent block-table + scale round trip in every iteration. The block-table rows are
    loaded here too (contiguous), not taken from the per-key gather. Scales of keys past
    ``key_hi`` inside a valid page are read (in bounds) and zeroed here: a stale NaN there would
    otherwise survive the masked score as p * NaN.
    """
    pages, page_ok = _load_tile_pages(bt_row, start, key_hi, TILE_N, BLOCK_SIZE)
    offs_b = tl.arange(0, BLOCK_SIZE)
    idx = pages[:, None] * (stride_block // 2) + kvh * NG * BLOCK_SIZE + offs_b[None, :]
    ok = key < key_hi
    k_sc = ()
    v_sc = ()
    for g in tl.static_range(NG):
        k_g = tl.load(cache16_ptr + K_SCALE // 2 + g * BLOCK_SIZE + idx, mask=page_ok[:, None],
                      other=0.0)  # fmt: skip
        v_g = tl.load(cache16_ptr + V_SCALE // 2 + g * BLOCK_SIZE + idx, mask=page_ok[:, None],
                      other=0.0)  # fmt: skip
        k_sc = k_sc + (tl.where(ok, tl.reshape(k_g, [TILE_N]), 0.0),)
        v_sc = v_sc + (tl.where(ok, tl.reshape(v_g, [TILE_N]), 0.0),)
    return k_sc, v_sc


@triton.jit
def _prefetch_scales(
    cache16_ptr, bt_row, sc_page, key, key_hi, kvh, stride_block, TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr,
    DYNAMIC: tl.constexpr, NG: tl.constexpr, PAIRS: tl.constexpr = False,
):  # fmt: skip
    """One step of the two-deep scale prefetch for the tile after ``key`` (pages ``sc_page``,
    gathered one step earlier): its K and V scales, and the pages of the tile after that."""
    k_sc, v_sc = _load_scales(
        cache16_ptr, sc_page, key + TILE_N, key_hi, kvh, stride_block,
        BLOCK_SIZE, K_SCALE, V_SCALE, DYNAMIC, NG, PAIRS,
    )  # fmt: skip
    return k_sc, v_sc, _load_pages(bt_row, key + 2 * TILE_N, key_hi, BLOCK_SIZE, PAIRS)


@triton.jit
def _chunked_kv_loop(
    q_his, q_los, row_scale, cache_ptr, cache16_ptr, bt_row, key_lo, key_hi, pos, kvh,
    stride_block, window, soft_cap,
    BLOCK_M: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    CHUNKS: tl.constexpr, K_DATA: tl.constexpr, V_DATA: tl.constexpr, K_SCALE: tl.constexpr,
    V_SCALE: tl.constexpr, DYNAMIC: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr, V_E4M3: tl.constexpr, NG: tl.constexpr,
):  # fmt: skip
    """The KV loop of the decode path, split-K inside the program (flash-decoding within a CTA).

    Each tile of TILE_N keys is cut into CHUNKS chunks that keep their own running softmax: the
    dots are batched over chunks, so the compiler gives each warp its own chunk, and the row max /
    sum reductions stay inside a warp (no cross-warp barrier per tile, which is what bounds a
    16-row decode tile whose keys are spread over all warps). The chunks merge once, at the end.
    q_his / q_los: one tile per scale group (``_split_q_groups``). Returns (m, l, accs) over the
    program's keys, in the 2D loop's units, accs one [BLOCK_M, HEAD_SIZE / NG] tile per group.
    """
    C: tl.constexpr = TILE_N // CHUNKS
    G: tl.constexpr = HEAD_SIZE // NG
    offs_g = tl.arange(0, G)
    offs_k = tl.arange(0, CHUNKS)[:, None] * C + tl.arange(0, C)[None, :]  # [CHUNKS, C]
    q3_his = ()
    q3_los = ()
    accs = ()
    for g in tl.static_range(NG):
        q3_his = q3_his + (tl.broadcast_to(q_his[g][None, :, :], (CHUNKS, BLOCK_M, G)),)
        q3_los = q3_los + (tl.broadcast_to(q_los[g][None, :, :], (CHUNKS, BLOCK_M, G)),)
        accs = accs + (tl.zeros([CHUNKS, BLOCK_M, G], tl.float32),)
    m_i = tl.full([CHUNKS, BLOCK_M], M_INIT, tl.float32)
    l_i = tl.zeros([CHUNKS, BLOCK_M], tl.float32)
    # Scales prefetched two deep, as in the 2D loop.
    # Step -1 of the prefetch: pages of the first tile, then as in the loop.
    k_sc, v_sc, sc_page = _prefetch_scales(
        cache16_ptr, bt_row, _load_pages(bt_row, key_lo + offs_k, key_hi, BLOCK_SIZE),
        key_lo + offs_k - TILE_N, key_hi, kvh, stride_block,
        TILE_N, BLOCK_SIZE, K_SCALE, V_SCALE, DYNAMIC, NG,
    )  # fmt: skip
    for start in range(key_lo, key_hi, TILE_N):
        key = start + offs_k
        key_ok = key < key_hi
        page = _load_pages(bt_row, key, key_hi, BLOCK_SIZE)
        base = page * stride_block + (kvh * BLOCK_SIZE + key % BLOCK_SIZE) * HEAD_SIZE
        if DYNAMIC:
            k_sc_next, v_sc_next, sc_page = _prefetch_scales(
                cache16_ptr, bt_row, sc_page, key, key_hi, kvh, stride_block,
                TILE_N, BLOCK_SIZE, K_SCALE, V_SCALE, DYNAMIC, NG,
            )  # fmt: skip
        else:
            k_sc_next, v_sc_next = k_sc, v_sc

        # one int8 dot per scale group, its columns scaled by that group's K scales
        for g in tl.static_range(NG):
            k = tl.load(
                cache_ptr + K_DATA + base[:, None, :] + (g * G + offs_g)[None, :, None],
                mask=key_ok[:, None, :],
                other=0,
            )  # [CHUNKS, G, C]
            s_g = _qk_i8(q3_his[g], q3_los[g], k, DOT_F32)  # [CHUNKS, BLOCK_M, C]
            if NG == 1:
                s = s_g * row_scale[None, :, None]
                if DYNAMIC:
                    s = s * k_sc[0].to(tl.float32)[:, None, :]
            elif g == 0:
                s = s_g * k_sc[g].to(tl.float32)[:, None, :]
            else:
                s = s + s_g * k_sc[g].to(tl.float32)[:, None, :]
        if NG > 1:
            s = s * row_scale[None, :, None]
        if USE_SOFTCAP:
            s = soft_capped(s, soft_cap)
        visible = key_ok[:, None, :] & (key[:, None, :] <= pos[None, :, None])
        if USE_WINDOW:
            visible = visible & (pos[None, :, None] - key[:, None, :] < window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=2))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, :, None])
        l_i = l_i * alpha + tl.sum(p, axis=2)
        m_i = m_new

        # V is key-major in the page (see _load_v_tile); per key here
        v_col = cache_ptr + V_DATA + v_column(page, key, kvh, stride_block, HEAD_SIZE, BLOCK_SIZE)
        p_dot = _p_to_dot(p, NG, DOT_F32)
        new_accs = ()
        for g in tl.static_range(NG):
            v = tl.load(
                v_col[:, :, None] + (g * G + offs_g)[None, None, :] * BLOCK_SIZE,
                mask=key_ok[:, :, None],
                other=0,
            )  # [CHUNKS, C, G]
            if NG == 1:
                p_g = p
                if DYNAMIC:
                    p_g = p * v_sc[0].to(tl.float32)[:, None, :]
            else:
                p_g = p_dot * v_sc[g].to(p_dot.dtype)[:, None, :]
            v = _v_to_dot(v, V_E4M3, DOT_F32)
            new_accs = new_accs + (accs[g] * alpha[:, :, None] + tl.dot(p_g.to(v.dtype), v),)
        accs = new_accs
        k_sc, v_sc = k_sc_next, v_sc_next

    m = tl.max(m_i, axis=0)
    w = tl.exp2(m_i - m[None, :])
    out_accs = ()
    for g in tl.static_range(NG):
        out_accs = out_accs + (tl.sum(accs[g] * w[:, :, None], axis=0),)
    return m, tl.sum(l_i * w, axis=0), out_accs


# Batch-dependent ints are not specialized on (== 1, % 16), nor the alignment of batch-dependent
# pointers: one compiled variant serves every batch instead of a Triton compile mid-serving when
# a new size class shows up (tests/shim/warmup_variants.py lists what still varies: constexprs,
# compiled at start-up by int8kv_shim/kernel_warmup.py).
@triton.jit(
    do_not_specialize=["num_seqs", "window", "stride_bt"],
    # Sliced per batch (the sequences after the decodes of a mixed batch start at any row); a
    # dynamic-scale launch passes seq_lens in the static scales' slots.
    do_not_specialize_on_alignment=[*SLICED_METADATA_PTRS, "static_k_ptr", "static_v_ptr"],
)
def _attn_fwd(
    q_ptr,
    out_ptr,
    cache_ptr,
    cache16_ptr,
    block_table_ptr,
    qsl_ptr,
    seq_lens_ptr,
    static_k_ptr,
    static_v_ptr,
    ws_acc_ptr,
    ws_m_ptr,
    ws_l_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_block,
    stride_bt,
    num_seqs,
    softmax_scale,
    soft_cap,
    window,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    CHUNKS: tl.constexpr,
    K_DATA: tl.constexpr,
    V_DATA: tl.constexpr,
    K_SCALE: tl.constexpr,
    V_SCALE: tl.constexpr,
    NG: tl.constexpr,  # K and V scale groups per (token, kv-head) (page_layout.py)
    DYNAMIC: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr,
    DECODE: tl.constexpr,  # the decode launch configuration (LaunchConfig.split), split or not
    DOT_F32: tl.constexpr,
    V_E4M3: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq, q_start, q_len, qb = query_block(qsl_ptr, pid_q, num_seqs, BLOCK_Q)
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    offs_d = tl.arange(0, HEAD_SIZE)
    q_idx, head, row_ok, token = block_rows(q_start, q_len, qb, kvh, BLOCK_M, BLOCK_Q, GROUP)
    q_rows = q_ptr + token * stride_qt + head * stride_qh
    pos = ctx + q_idx  # absolute position of each row's query token
    key_lo, key_hi = visible_keys(ctx, seq_len, qb, window, split, num_splits, BLOCK_Q, TILE_N,
                                  TILE_N, USE_WINDOW, SPLIT)  # fmt: skip
    score_scale = score_scale_of(softmax_scale, USE_SOFTCAP)
    # q as two int8 halves; each row's unit and the softmax scale fold into one factor per row,
    # the per-token K scales into one per column (of each scale group's dot). Static K scales
    # are per channel: q . (codes * s) = (q * s) . codes, so they multiply q once, before its
    # split (the split's grid then fits q * s, whose row max it takes).
    # DOT_F32 (the Triton interpreter of the CPU tests: no inline asm, a wrong bf16 tl.dot) runs
    # the same arithmetic in fp32 dots, exact on these integers.
    G: tl.constexpr = HEAD_SIZE // NG
    offs_g = tl.arange(0, G)
    if NG == 1:
        q = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        if not DYNAMIC:
            q = q.to(tl.float32) * tl.load(static_k_ptr + kvh * HEAD_SIZE + offs_d)[None, :]
        q_hi, q_lo, q_unit = _split_q_i8(q, DOT_F32)
        q_his = (q_hi,)
        q_los = (q_lo,)
    else:
        q_his, q_los, q_unit = _split_q_groups(q_rows, row_ok, HEAD_SIZE, NG, DOT_F32)
    row_scale = q_unit * score_scale

    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    if CHUNKS > 1:
        m_i, l_i, accs = _chunked_kv_loop(
            q_his, q_los, row_scale, cache_ptr, cache16_ptr, bt_row, key_lo, key_hi, pos, kvh,
            stride_block, window, soft_cap, BLOCK_M, HEAD_SIZE, BLOCK_SIZE, TILE_N, CHUNKS,
            K_DATA, V_DATA, K_SCALE, V_SCALE, DYNAMIC, USE_WINDOW, USE_SOFTCAP, DOT_F32, V_E4M3,
            NG,
        )  # fmt: skip
    else:
        m_i = tl.full([BLOCK_M], M_INIT, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        accs = ()
        for _g in tl.static_range(NG):
            accs = accs + (tl.zeros([BLOCK_M, G], tl.float32),)
        offs_n = tl.arange(0, TILE_N)
        # Per-token scales are 2-byte gathers, too narrow for the pipeliner's asynchronous copies.
        # On the (memory-bound) decode path they are prefetched by hand, two deep: iteration i
        # gathers the pages of tile i+2 and the scales of tile i+1 (from pages gathered in
        # iteration i-1) and reads only what iteration i-1 issued, so no load is waited on in the
        # iteration that issues it. Prefill tiles have enough math to hide a plain gather, and the
        # carried registers would spill there. Decode launches that are not split (many
        # sequences: splits == 1) prefetch too: with the page-wise loads instead, batch 128 at 8K
        # ran at 65% of copy bandwidth against int8_static's 85%; prefetching, 14-16% faster
        # (an A/B of both versions on an H200, batch 128 at 8K: 793 -> 663 us, int8_static 606 us;
        # the script and its JSON are in commit c1c5ebb's benchmark logs).
        PREFETCH: tl.constexpr = DECODE and DYNAMIC
        # Scales a pair of keys per load where there are several scale groups (head size 256);
        # key_lo is a multiple of TILE_N (visible_keys), so every tile starts at an even key.
        PAIRS: tl.constexpr = PREFETCH and NG > 1 and BLOCK_SIZE % 2 == 0
        if PREFETCH:
            # Step -1 of the prefetch: pages of the first tile, then as in the loop.
            k_sc, v_sc, sc_page = _prefetch_scales(
                cache16_ptr, bt_row,
                _load_pages(bt_row, key_lo + offs_n, key_hi, BLOCK_SIZE, PAIRS),
                key_lo + offs_n - TILE_N, key_hi, kvh, stride_block,
                TILE_N, BLOCK_SIZE, K_SCALE, V_SCALE, DYNAMIC, NG, PAIRS,
            )  # fmt: skip

        for start in range(key_lo, key_hi, TILE_N):
            key = start + offs_n
            key_ok = key < key_hi
            page = _load_pages(bt_row, key, key_hi, BLOCK_SIZE)
            row = kvh * BLOCK_SIZE + key % BLOCK_SIZE  # (head, slot) row inside a page region
            base = page * stride_block + row * HEAD_SIZE
            if PREFETCH:
                k_sc_next, v_sc_next, sc_page = _prefetch_scales(
                    cache16_ptr, bt_row, sc_page, key, key_hi, kvh, stride_block,
                    TILE_N, BLOCK_SIZE, K_SCALE, V_SCALE, DYNAMIC, NG, PAIRS,
                )  # fmt: skip
            elif DYNAMIC and TILE_N % BLOCK_SIZE == 0:
                k_sc, v_sc = _load_scales_by_page(
                    cache16_ptr, bt_row, start, key, key_hi, kvh, stride_block,
                    TILE_N, BLOCK_SIZE, K_SCALE, V_SCALE, NG,
                )  # fmt: skip
            else:
                k_sc, v_sc = _load_scales(
                    cache16_ptr, page, key, key_hi, kvh, stride_block,
                    BLOCK_SIZE, K_SCALE, V_SCALE, DYNAMIC, NG,
                )  # fmt: skip

            # one int8 dot per scale group, its columns scaled by that group's K scales
            for g in tl.static_range(NG):
                k = tl.load(
                    cache_ptr + K_DATA + base[None, :] + (g * G + offs_g)[:, None],
                    mask=key_ok[None, :],
                    other=0,
                )
                s_g = _qk_i8(q_his[g], q_los[g], k, DOT_F32)
                if NG == 1:
                    s = s_g * row_scale[:, None]
                    if DYNAMIC:
                        s = s * k_sc[0].to(tl.float32)[None, :]
                elif g == 0:
                    s = s_g * k_sc[g].to(tl.float32)[None, :]
                else:
                    s = s + s_g * k_sc[g].to(tl.float32)[None, :]
            if NG > 1:
                s = s * row_scale[:, None]
            p, alpha, m_i, l_i = softmax_step(
                s, key, key_ok, pos, window, soft_cap, m_i, l_i, USE_WINDOW, USE_SOFTCAP
            )

            # one dot per V scale group into its slice of the output, P's columns scaled by
            # that group's V scales
            p_dot = _p_to_dot(p, NG, DOT_F32)
            if PREFETCH:
                v_sc = _v_scales_ok(v_sc, key_ok, PAIRS)
            new_accs = ()
            for g in tl.static_range(NG):
                v = _load_v_tile(
                    cache_ptr, bt_row, page, start, key, key_ok, key_hi, kvh, stride_block,
                    HEAD_SIZE, BLOCK_SIZE, TILE_N, V_DATA, V_E4M3, g * G, G,
                )  # fmt: skip
                if NG == 1:
                    p_g = p
                    if DYNAMIC:
                        p_g = p * v_sc[0].to(tl.float32)[None, :]
                else:
                    p_g = p_dot * v_sc[g].to(p_dot.dtype)[None, :]
                v = _v_to_dot(v, V_E4M3, DOT_F32)
                new_accs = new_accs + (accs[g] * alpha[:, None] + tl.dot(p_g.to(v.dtype), v),)
            accs = new_accs
            if PREFETCH:
                k_sc, v_sc = k_sc_next, v_sc_next

    if not DYNAMIC:
        # out[c] = s_v[c] * sum_j p_j codes[j, c]: each channel's scale multiplies its column of
        # the accumulator once (before a split's partial is stored, so the merge sees scaled ones)
        v_out_scale = tl.load(static_v_ptr + kvh * HEAD_SIZE + offs_d)
        if V_E4M3:
            v_out_scale = v_out_scale * _E4M3_UNSCALE  # exact (power of two)
        accs = (accs[0] * v_out_scale[None, :],)  # static scales: one group
    if SPLIT:
        ws = store_split_stats(ws_m_ptr, ws_l_ptr, token, head, split, num_splits, m_i, l_i,
                               row_ok, NUM_Q_HEADS)  # fmt: skip
        for g in tl.static_range(NG):
            cols = g * G + offs_g
            tl.store(ws_acc_ptr + ws[:, None] * HEAD_SIZE + cols[None, :], accs[g],
                     mask=row_ok[:, None])  # fmt: skip
    else:
        l_safe = tl.where(row_ok, l_i, 1.0)[:, None]  # padding rows: no 0/0
        out_rows = out_ptr + token * stride_ot + head * stride_oh
        for g in tl.static_range(NG):
            cols = g * G + offs_g
            tl.store(out_rows[:, None] + cols[None, :],
                     (accs[g] / l_safe).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])  # fmt: skip


launch_attn = DirectLauncher(_attn_fwd)
_replays = ReplayCache()


@functools.cache  # on the host path of every launch
def _choose_config(
    group: int, head_size: int, max_query_len: int, cc_major: int = 8, v_e4m3: bool = False
) -> LaunchConfig:
    # Shared memory grows with tile_n * head_size (K and V tiles, two buffers of each): at head
    # size 256, 128-key decode tiles took 141-205 KB and 64-key prefill tiles up to 104 KB, past
    # MAX_SHARED_BYTES; 32-key tiles take 41-68 KB (compiled for sm80).
    if max_query_len * group <= 16 or max_query_len == 1:
        block_m = max(16, next_power_of_2(group * max_query_len))
        # 128-token tiles, 4 warps, 5 stages (two K/V buffers): the best int8 config at the large
        # decode shapes of benchmarks/tune_decode.py on an H200 (same code path as sm80: mma.sync).
        # E4M3 V's decode keeps a third tile buffer at 5 stages (105 KB at head size 128); 4
        # stages keep two (73 KB)
        if head_size > 128:
            # 64-key tiles at 4 stages: 42 KB of shared memory (E4M3 V within MAX_SHARED_BYTES
            # too, benchmarks/compile_sm80.py); faster than the 32-key, 5-stage tile (up to 1.19x) or level with it at
            # every shape of the head-256 sweeps (tune_decode_4_1_256.json, _16_8_256.json)
            return LaunchConfig(block_m, tile_n=64, num_warps=4, num_stages=4, split=True)
        stages = 4 if v_e4m3 else 5
        return LaunchConfig(block_m, tile_n=128, num_warps=4, num_stages=stages, split=True)
    block_m = 64 if head_size > 128 else 128
    block_m = max(block_m, next_power_of_2(group))
    tile_n = 64 if head_size <= 128 else 32
    # A 128x128 fp32 accumulator over 4 warps spills on sm80 (ptxas: ~700 bytes) but not over 8;
    # Hopper's wgmma keeps it in fewer registers, and 4 warps measured fastest on the H200
    # (benchmarks/tune_kernels.py prefill sweep).
    num_warps = 4 if cc_major >= 9 else 8
    return LaunchConfig(block_m, tile_n=tile_n, num_warps=num_warps, num_stages=2, split=False)


def _plan_launch(
    query: torch.Tensor,
    num_seqs: int,
    group: int,
    max_query_len: int,
    max_seq_len: int,
    num_kv_heads: int,
    workspace: AttentionWorkspace | None,
    num_splits: int | None,
    v_e4m3: bool = False,
    sliding_window: int | None = None,
) -> LaunchPlan:
    """The int8 kernel's launch: its config (``_choose_config``, which tuning swaps), planned."""
    cc_major = device_cc_major(query.device)
    cfg = _choose_config(group, query.shape[2], max_query_len, cc_major, v_e4m3=v_e4m3)
    return plan_launch(query, cfg, num_seqs, group, max_seq_len, num_kv_heads, workspace,
                       num_splits, sliding_window)  # fmt: skip


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    kv_dtype: str,
    block_size: int,
    num_kv_heads: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    softmax_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    workspace: AttentionWorkspace | None = None,
    num_splits: int | None = None,
    v_format: str = "int8",
    tail: torch.Tensor | None = None,
    slot_of_seq: torch.Tensor | None = None,
    tail_page: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    sink_of_seq: torch.Tensor | None = None,
) -> None:
    """Causal varlen attention of ``query`` over the INT8 paged cache, written into ``output``.

    query, output: [num_tokens, num_q_heads, head_size] bf16/fp16 (unit stride on head_size).
    kv_cache: int8 [num_blocks, >= page_bytes] (page_layout.py); the new tokens' K/V must already
    be written. query_start_loc: int32 [num_seqs + 1]; seq_lens: int32 [num_seqs], context + new
    tokens; block_table: int32 [num_seqs, max_blocks_per_seq]. Query token i of a sequence with
    q_len new tokens sits at position seq_len - q_len + i and sees keys j <= that position (and,
    with ``sliding_window``, position - j < sliding_window). ``soft_cap``: s = cap * tanh(s / cap).
    ``int8_static`` needs k_scale / v_scale: fp32 [num_kv_heads, head_size] (one per kv-head and
    channel: K's fold into the query, V's multiply the output's channels); with ``v_format="e4m3"``
    (``int8_static`` only) the V bytes are FP8-E4M3FN codes (as ``write_kv_cache`` stores them)
    dequantized as e4m3 value * v_scale. ``num_splits`` overrides the
    decode split heuristic (tests, tuning). max_query_len / max_seq_len only pick the launch shape.
    ``int4`` (attention_int4.py): no static scales, and ``tail`` [num_slots, 2, num_kv_heads, 64,
    head_size] / ``slot_of_seq`` int32 [>= num_seqs] / ``tail_page`` int32 [num_slots]: the
    sequences' last pages in the model's dtype and the block each slot holds (a tail of two
    pages: [num_slots, 2, num_kv_heads, 128, head_size] and [num_slots, 2]); ``sink`` /
    ``sink_of_seq`` (optional): the sequences' first pages in the model's dtype
    (``paged_attention_int4``).
    """
    if kv_dtype in INT4_DTYPES:
        if k_scale is not None or v_scale is not None:
            raise ValueError("int4 has no static scales: k_scale / v_scale must be None")
        check_v_format(kv_dtype, v_format)
        if tail is None or slot_of_seq is None or tail_page is None:
            raise ValueError("int4 attention needs tail, tail_page and slot_of_seq")
        return paged_attention_int4(
            query, kv_cache, output, kv_dtype=kv_dtype, block_size=block_size,
            num_kv_heads=num_kv_heads, query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_table=block_table, max_query_len=max_query_len, max_seq_len=max_seq_len,
            softmax_scale=softmax_scale, tail=tail, tail_page=tail_page, slot_of_seq=slot_of_seq,
            sliding_window=sliding_window, soft_cap=soft_cap, workspace=workspace,
            num_splits=num_splits, sink=sink, sink_of_seq=sink_of_seq,
        )  # fmt: skip
    # Everything that decides the launches (checks, grid, binary, arguments) but the addresses of
    # the calling layer's own tensors and of the batch's metadata: a model's layers repeat one
    # step's call with only those changed (each KV-cache group its own block table, a mixed batch
    # metadata sliced per step), and a replay skips this wrapper and Triton's binder (launch.py,
    # ReplayCache). The kernels take the metadata at any alignment, so any address replays.
    key = (
        query.shape, query.stride(), output.shape, output.stride(), kv_cache.stride(),
        query_start_loc.shape, query_start_loc.dtype, seq_lens.shape, seq_lens.dtype,
        block_table.stride(), block_table.dtype,
        kv_dtype, block_size, num_kv_heads, max_query_len, softmax_scale, sliding_window, soft_cap,
        # max_seq_len only picks the split count, which a given num_splits fixes: then the next
        # step of a batch that keeps its shape and buffers replays from its first layer on
        max_seq_len if num_splits is None else None, None if k_scale is None else k_scale.shape,
        None if v_scale is None else v_scale.shape, id(workspace), num_splits,
        v_format, _choose_config,  # tune_decode.py and tests swap the config chooser
        tail is None, slot_of_seq is None, tail_page is None,  # int4's, unused here
        sink is None, sink_of_seq is None,  # int4's sink pages, unused here
    )  # fmt: skip
    if _replays.run(key, q_ptr=query, out_ptr=output, cache_ptr=kv_cache, static_k_ptr=k_scale,
                    static_v_ptr=v_scale, block_table_ptr=block_table, qsl_ptr=query_start_loc,
                    seq_lens_ptr=seq_lens):  # fmt: skip
        return
    num_tokens, num_q_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    layout = cached_page_layout(kv_dtype, block_size, num_kv_heads, head_size)
    v_e4m3 = check_v_format(kv_dtype, v_format)
    check_shapes(query, output, kv_cache, num_kv_heads)
    dynamic = layout.has_scales
    if not dynamic:
        check_static_scales(k_scale, v_scale, num_kv_heads, head_size)
    if num_tokens == 0 or num_seqs == 0:
        return
    group = num_q_heads // num_kv_heads
    plan = _plan_launch(
        query, num_seqs, group, max_query_len, max_seq_len, num_kv_heads, workspace, num_splits,
        v_e4m3=v_e4m3, sliding_window=sliding_window,
    )  # fmt: skip
    cfg, block_q, num_q_blocks, splits = plan.cfg, plan.block_q, plan.num_q_blocks, plan.splits
    use_split = splits > 1
    ws_acc, ws_m, ws_l = (
        (plan.workspace.acc, plan.workspace.m, plan.workspace.l)
        if use_split
        else (output, output, output)
    )
    cache16 = kv_cache.view(torch.float16) if dynamic else kv_cache
    dummy = seq_lens
    # The tensors a replay swaps: the layer's own (ws_* alias the output when nothing is split)
    # and the batch's metadata. Dynamic pages never read the static scales' slots (seq_lens stands
    # in): a replay keeps the recorded address, as the write and the gather do.
    swap = [("q_ptr",), ("out_ptr", *(() if use_split else ("ws_acc_ptr", "ws_m_ptr", "ws_l_ptr"))),
            ("cache_ptr", "cache16_ptr"), *((name,) for name in SLICED_METADATA_PTRS)]  # fmt: skip
    if not dynamic:
        swap += [("static_k_ptr",), ("static_v_ptr",)]
    attn = launch_attn.record(
        swap,
        (num_q_blocks, num_kv_heads, splits),
        query,
        output,
        kv_cache,
        cache16,
        block_table,
        query_start_loc,
        seq_lens,
        k_scale if k_scale is not None else dummy,
        v_scale if v_scale is not None else dummy,
        ws_acc,
        ws_m,
        ws_l,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        kv_cache.stride(0),
        block_table.stride(0),
        num_seqs,
        float(softmax_scale),
        float(soft_cap) if soft_cap else 1.0,
        int(sliding_window) if sliding_window else 0,
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=block_q,
        TILE_N=cfg.tile_n,
        CHUNKS=cfg.chunks,
        USE_WINDOW=bool(sliding_window),
        USE_SOFTCAP=bool(soft_cap),
        SPLIT=use_split,
        DECODE=cfg.split,
        DOT_F32=query.device.type != "cuda",
        V_E4M3=v_e4m3,
        **layout.kernel_constexprs(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    merge = None
    if use_split:
        merge = launch_split_merge(output, plan.workspace, query_start_loc, num_seqs, splits,
                                   launch_merge)  # fmt: skip
    # A workspace made by this call would be freed under a replay of it
    if attn is not None and (merge is not None or not use_split) and workspace is plan.workspace:
        _replays.add(key, [attn] if merge is None else [attn, merge], workspace)
