"""Paged attention over ``int4`` pages plus each sequence's tail (its unfinished page, model dtype).

Keys of sequence r: positions [0, F) from int4 pages and [F, seq_len) from
``tail[slot_of_seq[r]]`` rows 0.. (slot -1: none of them), F = (seq_len // 64) * 64 but one page
less when seq_len is a multiple of 64 and ``tail_page[slot]`` is the last page's block (the step
that completed it left it in the tail, cache_write_int4.py: it is read exact until the sequence's
next token starts a new page; a page another sequence's tail holds, or a prefix-cache page, is
read from the cache). A tail of two pages (``tail`` [slots, 2, H, 128, D], ``tail_page``
[slots, 2]: page pg in half pg % 2, key p in row p % 128) moves F one page lower again when the
half of the page before F names that page's block: the page before the newest is read exact too
(cache_write_int4.py keeps it there until the sequence is two pages on). With a sink page (``sink`` / ``sink_of_seq``, paged_attention_int4), keys
[0, 64) of a row that has one come from its sink, in the model's dtype, whenever they would
otherwise come from int4 page 0. The same launch shapes as the int8
kernel (attention_plan.py): decode packs the query heads of a GQA group into the rows of one
program, so each page is read once per group, and long contexts are split across programs
(flash-decoding) with the shared workspace and merge; prefill / mixed batches take blocks of query
tokens. A tile is one page: its keys share K's per-channel (scale s, zero z), so

    score[i, j] = (q_i * s) . c_j + q_i . z          (c_j: the 4-bit codes of key j)
    out[i, d]   = sum_j (p_ij s^V_j) c_jd + sum_j p_ij z^V_j     (per V group)

and no K or V element is ever multiplied: the codes (exact small integers) go straight into
``tl.dot``; s folds into q once per page, q . z is one value per row and page, V's scale multiplies
P's columns and its zero is a row sum. Each packed byte is loaded once and split into two nibble
tiles: the low nibbles are channels [0, D/2), the high ones [D/2, D) (page_layout.py), each a whole
dot operand against the matching half of q (scores) or of the output (PV).

fp16 dots on the GPU: q is scaled by a power of two per row once (max |q| <= 2^Q_EXP, undone in
the score's scale), so q * s stays inside fp16, with its 11 significant bits, for any K scale of
a realistic range (Q_EXP). The codes are unpacked four bytes at a time by inline PTX (_nibbles:
bit operations and exact fp16-pair arithmetic, no integer conversion). Under the interpreter
(DOT_F32) the same steps run in fp32.
The tail tile, and the sink page's, is the model's dtype, dotted as it is (as FlashAttention does
with a BF16 cache: _exact_page).

Decode (the configuration with at most 16 query rows) runs its own loop, _decode_pages: the dot's
M side would pad a GQA group's 1-16 rows to 16, so the keys take M and the rows N (padded to 8),
scores and output transposed (scores^T = codes @ (q * s)^T, out^T = codes^T @ (scale * p)^T; the
codes are loaded straight into the dot operand's layout either way). A step takes two pages, 128
keys, under one running max and one rescale; l and sum_j p_ij z^V_j stay [keys, rows] tiles summed
once after the loop; steps whose keys every row sees skip the masks. Prefill and mixed batches
keep one page a tile with the rows as M.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .attention_plan import (
    M_INIT,
    SLICED_METADATA_PTRS,
    AttentionWorkspace,
    LaunchConfig,
    block_rows,
    check_shapes,
    device_cc_major,
    launch_split_merge,
    plan_launch,
    query_block,
    score_scale_of,
    soft_capped,
    softmax_step,
    store_split_stats,
    visible_keys,
)
from .cache_write_int4 import check_pools, exact_keys_start
from .launch import DirectLauncher, ReplayCache
from .page_layout import cached_int4_layout, next_power_of_2

# Each query row is scaled to max |q| <= 2^Q_EXP: q * s then stays inside fp16 (65504) for a K
# scale s below 2^(15 - Q_EXP) = 8192, a K channel spanning 122880 within one page (a larger one
# overflows to inf, and the output to NaN, not to a wrong number). Products under 2^-14 are
# subnormal and lose bits, their share of a score being as small.
Q_EXP = tl.constexpr(2)


@triton.jit
def _nibbles(b, DOT_F32: tl.constexpr):
    """uint8 tile -> (low-nibble codes, high-nibble codes) as exact dot operands."""
    if DOT_F32:  # interpreter
        return (b & 15).to(tl.float32), (b >> 4).to(tl.float32)
    # No int -> fp16 conversion (a quarter-rate unit): the fp16 with bits 0x6400 | x is 1024 + x
    # (x < 1024), so a nibble masked in place under that exponent, less 1024, is its code, and a
    # high nibble masked in place is 16 codes: times 1/16 less 64 in one fma. Four bytes per
    # 32-bit register: a byte permute, a shift, four and-ors (lop3) and four fp16-pair ops give
    # their eight codes as four fp16 pairs, all exact.
    # The three fp16-pair constants come in as operands (an f16x2 instruction takes no immediate):
    # materialized once, not three moves per four bytes. A 32-bit operand of a pack-4 asm is four
    # registers, so they are $5, $9 and $13.
    m = tl.full(b.shape, 0x64006400, tl.uint32)
    h = tl.full(b.shape, 0x2C002C00, tl.uint32)
    n = tl.full(b.shape, 0xD400D400, tl.uint32)
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, u, a, b, c, d;
        prmt.b32 t, $4, 0, 0x3120;
        shr.b32 u, t, 8;
        lop3.b32 a, t, 0x000f000f, 0x64006400, 0xea;
        lop3.b32 b, u, 0x000f000f, 0x64006400, 0xea;
        lop3.b32 c, t, 0x00f000f0, 0x64006400, 0xea;
        lop3.b32 d, u, 0x00f000f0, 0x64006400, 0xea;
        sub.f16x2 $0, a, $5;
        sub.f16x2 $1, b, $5;
        fma.rn.f16x2 $2, c, $9, $13;
        fma.rn.f16x2 $3, d, $9, $13;
        }
        """,
        constraints="=r,=r,=r,=r,r" + ",r" * 12,
        args=[b, m, h, n],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _pow2_at_most(x, E: tl.constexpr):
    """2^(E - ceil(log2 x)) for x > 0 (1 for x == 0): a power of two that scales x to <= 2^E."""
    return tl.exp2(E - tl.ceil(tl.log2(tl.where(x > 0.0, x, 1.0))))


@triton.jit
def _to_dot(x, DOT_F32: tl.constexpr):
    """fp32 -> fp16 dot operand, rounded to nearest, two values per instruction."""
    if DOT_F32:
        return x
    return tl.inline_asm_elementwise(
        asm="cvt.rn.f16x2.f32 $0, $2, $1;",
        constraints="=r,r,r",
        args=[x],
        dtype=tl.float16,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _k_sz(cache16_ptr, page, kvh, stride_block, HEAD_SIZE: tl.constexpr, K_SZ: tl.constexpr):
    """Where K's per-channel (scale [D], zero [D]) of a page and kv-head start (fp16 view)."""
    return cache16_ptr + page * (stride_block // 2) + K_SZ // 2 + kvh * 2 * HEAD_SIZE


@triton.jit
def _v_sz(cache16_ptr, page, kvh, stride_block, BLOCK_SIZE: tl.constexpr, NGV: tl.constexpr,
          V_SZ: tl.constexpr):  # fmt: skip
    """Where V's per-token (scale [B], zero [B]) of group 0 of a page and kv-head start (group g's
    follow at 2 g B; fp16 view)."""
    return cache16_ptr + page * (stride_block // 2) + V_SZ // 2 + kvh * NGV * 2 * BLOCK_SIZE


@triton.jit
def _k_scales(cache16_ptr, page, kvh, stride_block, HEAD_SIZE: tl.constexpr, K_SZ: tl.constexpr,
              DOT_F32: tl.constexpr):  # fmt: skip
    """K's per-channel scales of a page and kv-head, its low and high nibble halves [D/2], fp16
    (dot operands; fp32 under the interpreter)."""
    HALF: tl.constexpr = HEAD_SIZE // 2
    c = tl.arange(0, HALF)
    sz = _k_sz(cache16_ptr, page, kvh, stride_block, HEAD_SIZE, K_SZ)
    s_lo = tl.load(sz + c)
    s_hi = tl.load(sz + HALF + c)
    if DOT_F32:
        s_lo = s_lo.to(tl.float32)
        s_hi = s_hi.to(tl.float32)
    return s_lo, s_hi


@triton.jit
def _k_scale_zero(cache16_ptr, page, kvh, stride_block, HEAD_SIZE: tl.constexpr,
                  K_SZ: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """_k_scales and K's per-channel zeros of the page, [D/2] halves as well, fp32."""
    HALF: tl.constexpr = HEAD_SIZE // 2
    c = tl.arange(0, HALF)
    zeros = _k_sz(cache16_ptr, page, kvh, stride_block, HEAD_SIZE, K_SZ) + HEAD_SIZE
    s_lo, s_hi = _k_scales(cache16_ptr, page, kvh, stride_block, HEAD_SIZE, K_SZ, DOT_F32)
    z_lo = tl.load(zeros + c).to(tl.float32)
    z_hi = tl.load(zeros + HALF + c).to(tl.float32)
    return s_lo, s_hi, z_lo, z_hi


@triton.jit
def _v_scale_zero(cache16_ptr, page, kvh, stride_block, key_ok, g: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, NGV: tl.constexpr, V_SZ: tl.constexpr,
                  MASKED: tl.constexpr):  # fmt: skip
    """V's per-token (scale, zero) of group g for a page's keys, [B] fp32 (_masked_scale_zero)."""
    r = tl.arange(0, BLOCK_SIZE)
    sz = _v_sz(cache16_ptr, page, kvh, stride_block, BLOCK_SIZE, NGV, V_SZ)
    sc = tl.load(sz + 2 * g * BLOCK_SIZE + r)
    z = tl.load(sz + (2 * g + 1) * BLOCK_SIZE + r)
    return _masked_scale_zero(sc, z, key_ok, MASKED)


@triton.jit
def _masked_scale_zero(sc, z, key_ok, MASKED: tl.constexpr):
    """V's (scale, zero) [B] as stored (fp16), in fp32; keys past the end of a page's visible
    part are zeroed when MASKED: a flagged (NaN) scale there would otherwise survive p = 0 as
    0 * NaN."""
    sc = sc.to(tl.float32)
    z = z.to(tl.float32)
    if MASKED:
        sc = tl.where(key_ok, sc, 0.0)
        z = tl.where(key_ok, z, 0.0)
    return sc, z


@triton.jit
def _page_side(cache16_ptr, page, kvh, stride_block, HEAD_SIZE: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, NGV: tl.constexpr, K_SZ: tl.constexpr,
               V_SZ: tl.constexpr, K_SCALES_AHEAD: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """The per-page values that are no dot operand, as stored (fp16): K's zeros (low, high half
    [D/2]) and V's (scale, zero) [B] of group 0 and group 1 (group 0's again when NGV == 1), and
    with K_SCALES_AHEAD K's scales after them (as _k_scales gives them). The decode loop loads
    them a step ahead of their use, into registers."""
    HALF: tl.constexpr = HEAD_SIZE // 2
    c = tl.arange(0, HALF)
    r = tl.arange(0, BLOCK_SIZE)
    kz = _k_sz(cache16_ptr, page, kvh, stride_block, HEAD_SIZE, K_SZ) + HEAD_SIZE
    z_lo = tl.load(kz + c)
    z_hi = tl.load(kz + HALF + c)
    vsz = _v_sz(cache16_ptr, page, kvh, stride_block, BLOCK_SIZE, NGV, V_SZ)
    sc0 = tl.load(vsz + r)
    z0 = tl.load(vsz + BLOCK_SIZE + r)
    sc1 = sc0
    z1 = z0
    if NGV == 2:
        sc1 = tl.load(vsz + 2 * BLOCK_SIZE + r)
        z1 = tl.load(vsz + 3 * BLOCK_SIZE + r)
    if K_SCALES_AHEAD:
        s_lo, s_hi = _k_scales(cache16_ptr, page, kvh, stride_block, HEAD_SIZE, K_SZ, DOT_F32)
        return z_lo, z_hi, sc0, z0, sc1, z1, s_lo, s_hi
    else:
        return z_lo, z_hi, sc0, z0, sc1, z1


@triton.jit
def _step_pages(bt_row, start, page_hi, BLOCK_SIZE: tl.constexpr):
    """The page ids (int64) of the decode step at keys [start, start + 2B): a second page past
    page_hi is the first again (every key of it is masked, and reading a real page keeps its
    (scale, zero) finite); a step past page_hi reads page 0 (a prefetch nothing uses)."""
    a = tl.load(bt_row + start // BLOCK_SIZE, mask=start < page_hi, other=0).to(tl.int64)
    b = tl.load(bt_row + start // BLOCK_SIZE + 1, mask=start + BLOCK_SIZE < page_hi, other=0)
    return a, tl.where(start + BLOCK_SIZE < page_hi, b.to(tl.int64), a)


@triton.jit
def _page_scores(
    cache_ptr, cache16_ptr, page, kvh, stride_block, q_lo, q_hi, q16_lo, q16_hi, row_scale,
    HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, K_DATA: tl.constexpr, K_SZ: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    """Scaled scores [BLOCK_M, B] of the page's keys: q_lo / q_hi are the query halves
    [BLOCK_M, D/2] in fp32, scaled per row by a power of two that ``row_scale`` (the softmax scale
    over it) undoes."""
    HALF: tl.constexpr = HEAD_SIZE // 2
    c = tl.arange(0, HALF)
    r = tl.arange(0, BLOCK_SIZE)
    s_lo, s_hi, z_lo, z_hi = _k_scale_zero(cache16_ptr, page, kvh, stride_block, HEAD_SIZE, K_SZ,
                                           DOT_F32)  # fmt: skip
    kb = tl.load(
        cache_ptr
        + page * stride_block
        + K_DATA
        + (kvh * BLOCK_SIZE + r)[None, :] * HALF
        + c[:, None]
    )  # fmt: skip  [D/2, B]: each key's row is D/2 contiguous bytes
    k_lo, k_hi = _nibbles(kb, DOT_F32)
    # the page's scale folds into q (|q| <= 2^Q_EXP: fp16 holds q * s for any s < 2^(15 - Q_EXP))
    # (in fp16 pairs on the GPU: q16 is exact, so one rounding of the exact product, as in fp32)
    qs_lo = q16_lo * s_lo[None, :]
    qs_hi = q16_hi * s_hi[None, :]
    s = tl.dot(qs_hi, k_hi, tl.dot(qs_lo, k_lo))
    zq = tl.sum(q_lo * z_lo[None, :] + q_hi * z_hi[None, :], axis=1)
    return (s + zq[:, None]) * row_scale[:, None]


@triton.jit
def _page_pv(
    cache_ptr, cache16_ptr, page, kvh, stride_block, p, key_ok, acc_lo, acc_hi, az_lo, az_hi,
    HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NGV: tl.constexpr, V_DATA: tl.constexpr,
    V_SZ: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """acc += (p * scale) @ codes and az += p @ zero for the page's V, per nibble half (V group g
    of the half: 0, or 1 for the high half when NGV == 2). p is already alpha-rescaled into."""
    HALF: tl.constexpr = HEAD_SIZE // 2
    c = tl.arange(0, HALF)
    r = tl.arange(0, BLOCK_SIZE)
    vb = tl.load(
        cache_ptr
        + page * stride_block
        + V_DATA
        + (kvh * HALF + c)[None, :] * BLOCK_SIZE
        + r[:, None]
    )  # fmt: skip  [B, D/2], keys contiguous (key-major V)
    v_lo, v_hi = _nibbles(vb, DOT_F32)
    sc0, z0 = _v_scale_zero(cache16_ptr, page, kvh, stride_block, key_ok, 0, BLOCK_SIZE, NGV, V_SZ,
                            True)  # fmt: skip
    ps_lo = _to_dot(p * sc0[None, :], DOT_F32)
    acc_lo += tl.dot(ps_lo, v_lo)
    az_lo += tl.sum(p * z0[None, :], axis=1)
    if NGV == 2:
        sc1, z1 = _v_scale_zero(cache16_ptr, page, kvh, stride_block, key_ok, 1, BLOCK_SIZE, NGV,
                                V_SZ, True)  # fmt: skip
        acc_hi += tl.dot(_to_dot(p * sc1[None, :], DOT_F32), v_hi)
        az_hi += tl.sum(p * z1[None, :], axis=1)
    else:
        acc_hi += tl.dot(ps_lo, v_hi)
    return acc_lo, acc_hi, az_lo, az_hi


@triton.jit
def _page_scores_t(
    cache_ptr, cache16_ptr, page, kvh, stride_block, qt_lo, qt_hi, q16t_lo, q16t_hi, side,
    HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, K_DATA: tl.constexpr, K_SZ: tl.constexpr,
    K_SCALES_AHEAD: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """Unscaled scores of the page's keys transposed, [B, BLOCK_M] (keys on the MMA's M side):
    qt_lo / qt_hi are the power-of-two-scaled query halves transposed, [D/2, BLOCK_M], fp32.
    K's zeros are side[0:2] (_page_side, loaded a step earlier), not loaded here; so are K's
    scales, side[6:8], with K_SCALES_AHEAD (else loaded here)."""
    HALF: tl.constexpr = HEAD_SIZE // 2
    c = tl.arange(0, HALF)
    r = tl.arange(0, BLOCK_SIZE)
    if K_SCALES_AHEAD:
        s_lo = side[6]
        s_hi = side[7]
    else:
        s_lo, s_hi = _k_scales(cache16_ptr, page, kvh, stride_block, HEAD_SIZE, K_SZ, DOT_F32)
    z_lo = side[0].to(tl.float32)
    z_hi = side[1].to(tl.float32)
    kb = tl.load(
        cache_ptr
        + page * stride_block
        + K_DATA
        + (kvh * BLOCK_SIZE + r)[:, None] * HALF
        + c[None, :]
    )  # fmt: skip  [B, D/2]: each key's row is D/2 contiguous bytes, the dot's K dimension
    k_lo, k_hi = _nibbles(kb, DOT_F32)
    qs_lo = q16t_lo * s_lo[:, None]
    qs_hi = q16t_hi * s_hi[:, None]
    # q . z is one value per query row: it starts the accumulator instead of a separate add
    zq = tl.sum(qt_lo * z_lo[:, None] + qt_hi * z_hi[:, None], axis=0)
    zq = tl.broadcast_to(zq[None, :], (BLOCK_SIZE, zq.shape[0]))
    return tl.dot(k_hi, qs_hi, tl.dot(k_lo, qs_lo, zq))


@triton.jit
def _page_pv_t(
    cache_ptr, page, kvh, stride_block, p, key_ok, acc_lo, acc_hi, az_lo, az_hi, side,
    HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NGV: tl.constexpr,
    V_DATA: tl.constexpr, MASKED: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """_page_pv transposed: acc^T [D/2, BLOCK_M] += codes^T @ (scale * p^T) per nibble half, and
    the [B, BLOCK_M] tiles az += zero * p^T, summed over the keys once after the loop.
    V's (scale, zero) are side[2:6] (_page_side, loaded a step earlier)."""
    HALF: tl.constexpr = HEAD_SIZE // 2
    c = tl.arange(0, HALF)
    r = tl.arange(0, BLOCK_SIZE)
    vb = tl.load(
        cache_ptr
        + page * stride_block
        + V_DATA
        + (kvh * HALF + c)[:, None] * BLOCK_SIZE
        + r[None, :]
    )  # fmt: skip  [D/2, B], keys contiguous: the dot's K dimension
    v_lo, v_hi = _nibbles(vb, DOT_F32)
    # (unmasked steps have no keys past the end to zero)
    sc0, z0 = _masked_scale_zero(side[2], side[3], key_ok, MASKED)
    ps_lo = _to_dot(p * sc0[:, None], DOT_F32)
    acc_lo = tl.dot(v_lo, ps_lo, acc_lo)
    az_lo += p * z0[:, None]
    if NGV == 2:
        sc1, z1 = _masked_scale_zero(side[4], side[5], key_ok, MASKED)
        acc_hi = tl.dot(v_hi, _to_dot(p * sc1[:, None], DOT_F32), acc_hi)
        az_hi += p * z1[:, None]
    else:
        acc_hi = tl.dot(v_hi, ps_lo, acc_hi)
    return acc_lo, acc_hi, az_lo, az_hi


@triton.jit
def _visible_t(s, key, key_ok, pos, window, soft_cap, USE_WINDOW: tl.constexpr,
               USE_SOFTCAP: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """softmax_step's soft-cap and masks on a transposed [keys, BLOCK_M] tile of scaled scores
    (MASKED False: a step whose keys every row sees)."""
    if USE_SOFTCAP:
        s = soft_capped(s, soft_cap)
    if MASKED:
        visible = key_ok[:, None] & (key[:, None] <= pos[None, :])
        if USE_WINDOW:
            visible = visible & (pos[None, :] - key[:, None] < window)
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def _decode_step(
    cache_ptr, cache16_ptr, bt_row, kvh, stride_block, start, page_hi, pos, window, soft_cap,
    qt_lo, qt_hi, q16t_lo, q16t_hi, row_scale, m_i, l_t, acc_lo, acc_hi, az_lo, az_hi, page_a,
    page_b, ahead, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NGV: tl.constexpr,
    K_DATA: tl.constexpr, V_DATA: tl.constexpr, K_SZ: tl.constexpr, V_SZ: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
    K_SCALES_AHEAD: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """One step of _decode_pages over the pages page_a, page_b (keys [start, start + 2B)): the
    new (m, l, acc, az) and the next step's (page_a, page_b, ahead). ahead is this step's
    (_page_side of page_a, of page_b), loaded at the end of the step before; this step ends by
    loading the next step's."""
    r = tl.arange(0, BLOCK_SIZE)
    STEP: tl.constexpr = 2 * BLOCK_SIZE
    # Page ids one step ahead (a tile's loads never wait on the gather of their own page id).
    next_a, next_b = _step_pages(bt_row, start + STEP, page_hi, BLOCK_SIZE)
    side_a, side_b = ahead
    key_a = start + r
    key_b = start + BLOCK_SIZE + r
    ok_a = key_a < page_hi
    ok_b = key_b < page_hi
    s_a = _page_scores_t(cache_ptr, cache16_ptr, page_a, kvh, stride_block, qt_lo, qt_hi,
                         q16t_lo, q16t_hi, side_a, HEAD_SIZE, BLOCK_SIZE, K_DATA, K_SZ,
                         K_SCALES_AHEAD, DOT_F32)  # fmt: skip
    s_b = _page_scores_t(cache_ptr, cache16_ptr, page_b, kvh, stride_block, qt_lo, qt_hi,
                         q16t_lo, q16t_hi, side_b, HEAD_SIZE, BLOCK_SIZE, K_DATA, K_SZ,
                         K_SCALES_AHEAD, DOT_F32)  # fmt: skip
    s_a = _visible_t(s_a * row_scale[None, :], key_a, ok_a, pos, window, soft_cap, USE_WINDOW,
                     USE_SOFTCAP, MASKED)  # fmt: skip
    s_b = _visible_t(s_b * row_scale[None, :], key_b, ok_b, pos, window, soft_cap, USE_WINDOW,
                     USE_SOFTCAP, MASKED)  # fmt: skip
    m_new = tl.maximum(m_i, tl.max(tl.maximum(s_a, s_b), axis=0))
    alpha = tl.exp2(m_i - m_new)
    p_a = tl.exp2(s_a - m_new[None, :])
    p_b = tl.exp2(s_b - m_new[None, :])
    l_t = l_t * alpha[None, :] + p_a + p_b
    acc_lo, acc_hi, az_lo, az_hi = _page_pv_t(
        cache_ptr, page_a, kvh, stride_block, p_a, ok_a, acc_lo * alpha[None, :],
        acc_hi * alpha[None, :], az_lo * alpha[None, :], az_hi * alpha[None, :], side_a,
        HEAD_SIZE, BLOCK_SIZE, NGV, V_DATA, MASKED, DOT_F32,
    )  # fmt: skip
    acc_lo, acc_hi, az_lo, az_hi = _page_pv_t(
        cache_ptr, page_b, kvh, stride_block, p_b, ok_b, acc_lo, acc_hi, az_lo, az_hi, side_b,
        HEAD_SIZE, BLOCK_SIZE, NGV, V_DATA, MASKED, DOT_F32,
    )  # fmt: skip
    # The next step's, after this step's math: its page ids have arrived by now, and these
    # loads are in flight with the next step's asynchronous copies (issued here too).
    ahead = (_page_side(cache16_ptr, next_a, kvh, stride_block, HEAD_SIZE, BLOCK_SIZE, NGV, K_SZ,
                        V_SZ, K_SCALES_AHEAD, DOT_F32),
             _page_side(cache16_ptr, next_b, kvh, stride_block, HEAD_SIZE, BLOCK_SIZE, NGV, K_SZ,
                        V_SZ, K_SCALES_AHEAD, DOT_F32))  # fmt: skip
    return m_new, l_t, acc_lo, acc_hi, az_lo, az_hi, next_a, next_b, ahead


@triton.jit
def _decode_pages(
    cache_ptr, cache16_ptr, bt_row, kvh, stride_block, key_lo, page_hi, first_pos, pos, window,
    soft_cap, qn_lo, qn_hi, q16_lo, q16_hi, row_scale,
    BLOCK_M: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NGV: tl.constexpr,
    K_DATA: tl.constexpr, V_DATA: tl.constexpr, K_SZ: tl.constexpr, V_SZ: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """The decode loop over the int4 pages of keys [key_lo, page_hi), two pages a step, keys on
    the MMA's M side: (m, l, acc_lo, acc_hi, az_lo, az_hi) as the kernel's own loop leaves them.

    A decode program has 1-16 query rows; as the dot's M they would be padded to 16, as its N
    (scores^T = codes @ (q * s)^T, out^T = codes^T @ (scale * p)^T) to 8, and the softmax runs
    over [keys, rows] tiles a quarter to a half the size. Two pages a step halve the running
    max's reductions, the rescales and the loop control per key; l and the V zeros' sums stay
    [keys, rows] tiles, reduced over the keys once at the end. Without a window, the steps whose
    keys every row sees (all below the first row's position) run unmasked and the at most two
    after them masked; with one, every step is masked.

    The K zeros and V (scale, zero), which are no dot operand and too narrow for the
    pipeliner's asynchronous copies, are loaded into registers a step ahead of their use
    (_page_side, at the end of the step before), and so are the K scales at head size 256,
    where the pipeliner does not copy them either (K_SCALES_AHEAD); the loop is launched with two
    shared-memory buffers (3 stages, choose_config_int4). Compiled for sm80 (Triton 3.6), a
    step's codes and (at head sizes 64 and 128) K scales are then copied a whole step before it
    waits on them (cp.async.wait_group 8: the next step's copies stay in flight) and no global
    load is used in the step that issues it; the page-id load before the copies of the step
    after next is still waited on at the end of each step (loading the page ids two steps ahead
    instead made Triton drop the loop's pipelining altogether). Loaded at their use with one
    buffer, as the loop was before 2026-12-04, the copies were issued at the very end of the
    step before (after its last dot) and waited on (wait_group 0) first thing, the zeros and V
    scales loaded and waited on inside the step: about five dependent global-memory round trips
    a step, one after another; the H200 ran that loop 1.20-1.68x slower at every model shape,
    batch and context timed (the same arithmetic on the same values)."""
    HALF: tl.constexpr = HEAD_SIZE // 2
    STEP: tl.constexpr = 2 * BLOCK_SIZE
    # The pipeliner copies a load asynchronously only where each thread holds >= 4 contiguous
    # bytes of it: the K scales' [D/2] fp16 halves at D <= 128 (64 or 32 elements over the
    # threads, 4 a thread), not at D = 256 (128 over 128 threads, 2 bytes a thread), where they
    # stayed plain loads at their use: the H200's PC sampling (2026-12-05, 4 q / 1 kv heads,
    # batch 32, 32K context) found 36% of the kernel's samples on their first use, waiting on
    # them. There they are loaded a step ahead with the zeros instead.
    K_SCALES_AHEAD: tl.constexpr = HEAD_SIZE > 128
    qt_lo = tl.trans(qn_lo)
    qt_hi = tl.trans(qn_hi)
    q16t_lo = tl.trans(q16_lo)
    q16t_hi = tl.trans(q16_hi)
    m_i = tl.full([BLOCK_M], M_INIT, tl.float32)
    l_t = tl.zeros([BLOCK_SIZE, BLOCK_M], tl.float32)
    acc_lo = tl.zeros([HALF, BLOCK_M], tl.float32)
    acc_hi = tl.zeros([HALF, BLOCK_M], tl.float32)
    az_lo = tl.zeros([BLOCK_SIZE, BLOCK_M], tl.float32)
    az_hi = tl.zeros([BLOCK_SIZE, BLOCK_M], tl.float32)
    page_a, page_b = _step_pages(bt_row, key_lo, page_hi, BLOCK_SIZE)
    ahead = (_page_side(cache16_ptr, page_a, kvh, stride_block, HEAD_SIZE, BLOCK_SIZE, NGV, K_SZ,
                        V_SZ, K_SCALES_AHEAD, DOT_F32),
             _page_side(cache16_ptr, page_b, kvh, stride_block, HEAD_SIZE, BLOCK_SIZE, NGV, K_SZ,
                        V_SZ, K_SCALES_AHEAD, DOT_F32))  # fmt: skip
    if USE_WINDOW:
        for start in range(key_lo, page_hi, STEP):
            m_i, l_t, acc_lo, acc_hi, az_lo, az_hi, page_a, page_b, ahead = _decode_step(
                cache_ptr, cache16_ptr, bt_row, kvh, stride_block, start, page_hi, pos, window,
                soft_cap, qt_lo, qt_hi, q16t_lo, q16t_hi, row_scale, m_i, l_t, acc_lo, acc_hi,
                az_lo, az_hi, page_a, page_b, ahead, HEAD_SIZE, BLOCK_SIZE, NGV, K_DATA, V_DATA,
                K_SZ, V_SZ, USE_WINDOW, USE_SOFTCAP, True, K_SCALES_AHEAD, DOT_F32,
            )  # fmt: skip
    else:
        seen = tl.minimum(page_hi, first_pos + 1) - key_lo
        mid = key_lo + tl.maximum(seen, 0) // STEP * STEP
        for start in range(key_lo, mid, STEP):
            m_i, l_t, acc_lo, acc_hi, az_lo, az_hi, page_a, page_b, ahead = _decode_step(
                cache_ptr, cache16_ptr, bt_row, kvh, stride_block, start, page_hi, pos, window,
                soft_cap, qt_lo, qt_hi, q16t_lo, q16t_hi, row_scale, m_i, l_t, acc_lo, acc_hi,
                az_lo, az_hi, page_a, page_b, ahead, HEAD_SIZE, BLOCK_SIZE, NGV, K_DATA, V_DATA,
                K_SZ, V_SZ, USE_WINDOW, USE_SOFTCAP, False, K_SCALES_AHEAD, DOT_F32,
            )  # fmt: skip
        # the keys left, [mid, page_hi), are fewer than 2B + 16: at most two masked steps
        for i in tl.static_range(2):
            if mid + i * STEP < page_hi:
                m_i, l_t, acc_lo, acc_hi, az_lo, az_hi, page_a, page_b, ahead = _decode_step(
                    cache_ptr, cache16_ptr, bt_row, kvh, stride_block, mid + i * STEP, page_hi,
                    pos, window, soft_cap, qt_lo, qt_hi, q16t_lo, q16t_hi, row_scale, m_i, l_t,
                    acc_lo, acc_hi, az_lo, az_hi, page_a, page_b, ahead, HEAD_SIZE, BLOCK_SIZE,
                    NGV, K_DATA, V_DATA, K_SZ, V_SZ, USE_WINDOW, USE_SOFTCAP, True,
                    K_SCALES_AHEAD, DOT_F32,
                )  # fmt: skip
    l_i = tl.sum(l_t, axis=0)
    return (m_i, l_i, tl.trans(acc_lo), tl.trans(acc_hi), tl.sum(az_lo, axis=0),
            tl.sum(az_hi, axis=0))  # fmt: skip


@triton.jit
def _exact_page(
    row, stride_kv, key, key_ok, q_lo, q_hi, score_scale, pos, window, soft_cap, m_i, l_i, acc_lo,
    acc_hi, az_lo, az_hi, HEAD_SIZE: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """A page of keys held in the model's dtype (a tail, a sink), dotted as it is (as
    FlashAttention does with a BF16 cache): key j's K row at row[j], its V row at
    row[j] + stride_kv ([B] pointers), keys ``key`` [B], visible where key_ok (the rest load as 0:
    a pool's rows there may hold anything, NaN included). One online-softmax step:
    (m, l, acc_lo, acc_hi, az_lo, az_hi) as the int4 loops keep them."""
    HALF: tl.constexpr = HEAD_SIZE // 2
    c = tl.arange(0, HALF)
    kt_lo = tl.load(row[None, :] + c[:, None], mask=key_ok[None, :], other=0.0)  # [D/2, B]
    kt_hi = tl.load(row[None, :] + HALF + c[:, None], mask=key_ok[None, :], other=0.0)
    vt_lo = tl.load(row[:, None] + stride_kv + c[None, :], mask=key_ok[:, None], other=0.0)
    vt_hi = tl.load(row[:, None] + stride_kv + HALF + c[None, :], mask=key_ok[:, None], other=0.0)
    dt = kt_lo.dtype
    if DOT_F32:
        dt = tl.float32
    s = tl.dot(q_lo.to(dt), kt_lo.to(dt)) + tl.dot(q_hi.to(dt), kt_hi.to(dt))
    p, alpha, m_i, l_i = softmax_step(
        s * score_scale, key, key_ok, pos, window, soft_cap, m_i, l_i, USE_WINDOW, USE_SOFTCAP
    )
    acc_lo = acc_lo * alpha[:, None] + tl.dot(p.to(dt), vt_lo.to(dt))
    acc_hi = acc_hi * alpha[:, None] + tl.dot(p.to(dt), vt_hi.to(dt))
    return m_i, l_i, acc_lo, acc_hi, az_lo * alpha, az_hi * alpha


# Batch-dependent ints are not specialized on (== 1, % 16), nor the alignment of the metadata
# pointers: one compiled variant serves every batch instead of a Triton compile mid-serving when
# a new size class shows up (as _attn_fwd; int8kv_shim/kernel_warmup.py compiles it at start-up).
@triton.jit(
    do_not_specialize=["num_seqs", "window", "stride_bt"],
    do_not_specialize_on_alignment=[*SLICED_METADATA_PTRS, "slot_of_seq_ptr", "sink_of_seq_ptr"],
)
def _attn_int4_fwd(
    q_ptr,
    out_ptr,
    cache_ptr,  # uint8 view of the cache
    cache16_ptr,  # fp16 view of the same storage
    tail_ptr,
    tail_page_ptr,
    block_table_ptr,
    qsl_ptr,
    seq_lens_ptr,
    slot_of_seq_ptr,
    sink_ptr,  # HAS_SINK: sink pool [sinks, 2, H, 64, D] and each row's sink (-1: none)
    sink_of_seq_ptr,
    ws_acc_ptr,
    ws_m_ptr,
    ws_l_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_block,
    stride_bt,
    stride_ts,  # tail strides: slot, K/V, head, position (elements)
    stride_tkv,
    stride_th,
    stride_tp,
    stride_ss,  # sink strides: sink, K/V, head, position (elements)
    stride_skv,
    stride_sh,
    stride_sp,
    num_seqs,
    softmax_scale,
    soft_cap,
    window,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv-head
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # one page = one tile of keys
    NGV: tl.constexpr,
    K_DATA: tl.constexpr,
    V_DATA: tl.constexpr,
    K_SZ: tl.constexpr,
    V_SZ: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_SINK: tl.constexpr,
    DOT_F32: tl.constexpr,
    TAIL_PAGES: tl.constexpr,  # pages per tail slot: 1, or 2 (page pg in half pg % 2)
):
    HALF: tl.constexpr = HEAD_SIZE // 2
    # The decode configuration (choose_config_int4) is the only one with at most 16 rows: keys on
    # the MMA's M side, two pages a step (_decode_pages).
    DECODE: tl.constexpr = BLOCK_M <= 16
    TILE_N: tl.constexpr = 2 * BLOCK_SIZE if DECODE else BLOCK_SIZE
    pid_q = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq, q_start, q_len, qb = query_block(qsl_ptr, pid_q, num_seqs, BLOCK_Q)
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    c = tl.arange(0, HALF)
    q_idx, head, row_ok, token = block_rows(q_start, q_len, qb, kvh, BLOCK_M, BLOCK_Q, GROUP)
    q_row = q_ptr + token * stride_qt + head * stride_qh
    q_lo = tl.load(q_row[:, None] + c[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q_hi = tl.load(q_row[:, None] + HALF + c[None, :], mask=row_ok[:, None], other=0.0)
    q_hi = q_hi.to(tl.float32)
    pos = ctx + q_idx

    # (a window starts at a page: the loops' tiles are pages, decode's steps pairs of them)
    key_lo, key_hi = visible_keys(ctx, seq_len, qb, window, split, num_splits, BLOCK_Q,
                                  BLOCK_SIZE, TILE_N, USE_WINDOW, SPLIT)  # fmt: skip
    score_scale = score_scale_of(softmax_scale, USE_SOFTCAP)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    slot = tl.load(slot_of_seq_ptr + seq).to(tl.int64)
    # keys below it are read from int4 pages (split boundaries stay at pages)
    full = exact_keys_start(tail_page_ptr, bt_row, slot, seq_len, BLOCK_SIZE, TAIL_PAGES)
    page_hi = tl.minimum(key_hi, full)

    # rows scaled by a power of two to max |q| <= 2^Q_EXP (q * s then fits fp16, see the docstring)
    q_unit = _pow2_at_most(tl.maximum(tl.max(tl.abs(q_lo), axis=1), tl.max(tl.abs(q_hi), axis=1)),
                           Q_EXP)  # fmt: skip
    qn_lo = q_lo * q_unit[:, None]
    qn_hi = q_hi * q_unit[:, None]
    # exact (q's own bf16 / fp16 bits times a power of two) but for values under 2^-14
    q16_lo = _to_dot(qn_lo, DOT_F32)
    q16_hi = _to_dot(qn_hi, DOT_F32)
    row_scale = score_scale / q_unit

    m_i = tl.full([BLOCK_M], M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HALF], tl.float32)  # output channels [0, D/2)
    acc_hi = tl.zeros([BLOCK_M, HALF], tl.float32)  # [D/2, D)
    az_lo = tl.zeros([BLOCK_M], tl.float32)  # sum_j p z of the low half's V group
    az_hi = tl.zeros([BLOCK_M], tl.float32)  # of the high half's (the same group when NGV == 1)
    offs_n = tl.arange(0, BLOCK_SIZE)
    pages_lo = key_lo  # the int4 loops read keys [pages_lo, page_hi)
    if HAS_SINK:
        # page 0 is read from the row's sink (after the loops) instead: they start a page later
        # (decode's page pairs need no alignment)
        sink = tl.load(sink_of_seq_ptr + seq)
        pages_lo = tl.where((sink >= 0) & (full > 0) & (key_lo == 0), BLOCK_SIZE, key_lo)
    if DECODE:
        m_i, l_i, acc_lo, acc_hi, az_lo, az_hi = _decode_pages(
            cache_ptr, cache16_ptr, bt_row, kvh, stride_block, pages_lo, page_hi,
            ctx + qb * BLOCK_Q, pos, window, soft_cap, qn_lo, qn_hi, q16_lo, q16_hi, row_scale,
            BLOCK_M, HEAD_SIZE, BLOCK_SIZE, NGV, K_DATA, V_DATA, K_SZ, V_SZ, USE_WINDOW,
            USE_SOFTCAP, DOT_F32,
        )  # fmt: skip
    else:
        # The block-table entry of the next page is loaded one tile ahead, so a tile's loads never
        # wait on the gather of their own page id.
        page = tl.load(bt_row + pages_lo // BLOCK_SIZE, mask=pages_lo < page_hi, other=0)
        page = page.to(tl.int64)
        for start in range(pages_lo, page_hi, BLOCK_SIZE):
            nxt = start + BLOCK_SIZE
            page_next = tl.load(bt_row + nxt // BLOCK_SIZE, mask=nxt < page_hi, other=0)
            page_next = page_next.to(tl.int64)
            key = start + offs_n
            key_ok = key < key_hi
            s = _page_scores(cache_ptr, cache16_ptr, page, kvh, stride_block, qn_lo, qn_hi, q16_lo,
                             q16_hi, row_scale,
                             HEAD_SIZE, BLOCK_SIZE, K_DATA, K_SZ, DOT_F32)  # fmt: skip
            p, alpha, m_i, l_i = softmax_step(
                s, key, key_ok, pos, window, soft_cap, m_i, l_i, USE_WINDOW, USE_SOFTCAP
            )
            acc_lo = acc_lo * alpha[:, None]
            acc_hi = acc_hi * alpha[:, None]
            acc_lo, acc_hi, az_lo, az_hi = _page_pv(
                cache_ptr, cache16_ptr, page, kvh, stride_block, p, key_ok, acc_lo, acc_hi,
                az_lo * alpha, az_hi * alpha, HEAD_SIZE, BLOCK_SIZE, NGV, V_DATA, V_SZ, DOT_F32,
            )  # fmt: skip
            page = page_next

    # The sink: keys [0, 64) exact from the row's sink instead of int4 page 0, when page 0 is a
    # full int4 page (while it is the tail's, full == 0: the tail below reads it) and this
    # program's keys start at it (one split of a split sequence; a window reaching back to page
    # 0, whose masks apply as to any page's). After the loops, and its index loaded again
    # (volatile: not merged with the load above), so nothing of it is live across them: read
    # before the loops, its page took the D=128 decode program from 168 registers to 247 (two
    # programs per SM instead of three), and its index kept live spilled 12 bytes per step of
    # the 32/8 decode loop (sm80, Triton 3.6).
    if HAS_SINK:
        sink = tl.load(sink_of_seq_ptr + seq, volatile=True).to(tl.int64)
        if (sink >= 0) & (full > 0) & (key_lo == 0):
            s_row = sink_ptr + sink * stride_ss + kvh * stride_sh + offs_n * stride_sp
            m_i, l_i, acc_lo, acc_hi, az_lo, az_hi = _exact_page(
                s_row, stride_skv, offs_n, offs_n < key_hi, q_lo, q_hi, score_scale, pos,
                window, soft_cap, m_i, l_i, acc_lo, acc_hi, az_lo, az_hi, HEAD_SIZE, USE_WINDOW,
                USE_SOFTCAP, DOT_F32,
            )  # fmt: skip

    # The tail: keys [full, seq_len), at most TAIL_PAGES pages, key p in row p % (64 x pages) of
    # the sequence's slot.
    for i in tl.static_range(TAIL_PAGES):
        t0 = full + i * BLOCK_SIZE
        if (key_hi > t0) & (slot >= 0) & (key_lo < key_hi):
            key = t0 + offs_n
            rows = offs_n
            readable = key < key_hi
            if TAIL_PAGES == 2:
                # a split boundary may fall between the two pages (64-key pages, splits of 128
                # or 64 keys), so each split reads only its keys
                rows = t0 % (2 * BLOCK_SIZE) + offs_n
                readable = readable & (key >= key_lo)
            t_row = tail_ptr + slot * stride_ts + kvh * stride_th + rows * stride_tp
            m_i, l_i, acc_lo, acc_hi, az_lo, az_hi = _exact_page(
                t_row, stride_tkv, key, readable, q_lo, q_hi, score_scale, pos, window, soft_cap,
                m_i, l_i, acc_lo, acc_hi, az_lo, az_hi, HEAD_SIZE, USE_WINDOW, USE_SOFTCAP,
                DOT_F32,
            )  # fmt: skip

    if NGV == 1:
        az_hi = az_lo
    out_lo = acc_lo + az_lo[:, None]
    out_hi = acc_hi + az_hi[:, None]
    if SPLIT:
        ws = store_split_stats(ws_m_ptr, ws_l_ptr, token, head, split, num_splits, m_i, l_i,
                               row_ok, NUM_Q_HEADS)  # fmt: skip
        dst = ws_acc_ptr + ws[:, None] * HEAD_SIZE + c[None, :]
        tl.store(dst, out_lo, mask=row_ok[:, None])
        tl.store(dst + HALF, out_hi, mask=row_ok[:, None])
    else:
        # no key at all (a slot-less sequence's tail page) and padding rows: 0, not 0/0
        inv = 1.0 / tl.where(row_ok & (l_i > 0.0), l_i, 1.0)
        dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + c[None, :]
        ty = out_ptr.dtype.element_ty
        tl.store(dst, (out_lo * inv[:, None]).to(ty), mask=row_ok[:, None])
        tl.store(dst + HALF, (out_hi * inv[:, None]).to(ty), mask=row_ok[:, None])


launch_attn_int4 = DirectLauncher(_attn_int4_fwd)
_replays = ReplayCache()


@functools.cache  # on the host path of every launch
def choose_config_int4(
    group: int, head_size: int, max_query_len: int, cc_major: int = 8
) -> LaunchConfig:
    """Prefill / mixed: tiles of one page (64 keys: its K scales fold into q once per tile).
    Decode: two pages a step with keys on the MMA's M side (_decode_pages), the GQA group's rows
    (padded to 8, the smallest MMA N) on N, 4 warps (2 at head size 64, and for the 16-row
    variant on sm90+, where four made Triton compile its dots to wgmma: see
    benchmarks/compile_sm80.py's compile_int4_decode_sm90), 3 stages."""
    if max_query_len * group <= 16 or max_query_len == 1:
        block_m = next_power_of_2(group * max_query_len)
        if block_m <= 16:
            # one token per sequence: 8 rows; more (speculative tokens): 16, one variant for
            # every query length that fits
            block_m = 8 if max_query_len == 1 and block_m <= 8 else 16
            # a stage (two pages of codes and scales) is 9 KiB at head size 64, 18 at 128, 36 at
            # 256. 3 stages at every head size: two buffers, so a step's copies are issued a
            # whole step before it waits on them (with one, at the end of the step before:
            # nothing between issue and wait); 168 registers at head size 128, 255 at 256, no
            # spills, 72 KiB shared memory at 256 (decode_issue_budget.json).
            stages = 3
            # on sm90+, four warps make Triton 3.6 compile the 16-row variant's dots to wgmma,
            # which faulted on the H200; two keep them mma.sync, as on sm80
            warps = 2 if head_size == 64 or (block_m == 16 and cc_major >= 9) else 4
            return LaunchConfig(block_m, tile_n=128, num_warps=warps, num_stages=stages, split=True)
        # a group of more than 16 query heads: one page a tile, as prefill
        stages = {64: 6, 128: 4}.get(head_size, 3)
        return LaunchConfig(block_m, tile_n=64, num_warps=4, num_stages=stages, split=True)
    block_m = max(64 if head_size <= 128 else 32, next_power_of_2(group))
    return LaunchConfig(block_m, tile_n=64, num_warps=4, num_stages=2, split=False)


def paged_attention_int4(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    kv_dtype: str = "int4",
    block_size: int,
    num_kv_heads: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    softmax_scale: float,
    tail: torch.Tensor,
    tail_page: torch.Tensor,
    slot_of_seq: torch.Tensor,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    workspace: AttentionWorkspace | None = None,
    num_splits: int | None = None,
    sink: torch.Tensor | None = None,
    sink_of_seq: torch.Tensor | None = None,
) -> None:
    """``paged_attention`` over ``int4`` pages and the sequences' tails (module docstring): the
    same arguments and semantics, plus ``tail`` [num_slots, 2, num_kv_heads, 64, head_size]
    (model dtype), ``tail_page`` int32 [num_slots] (the block each slot holds) and
    ``slot_of_seq`` int32 [>= num_seqs] (-1: the sequence's partial page is not read, its
    complete pages are read from the cache). A tail of two pages: ``tail`` [num_slots, 2,
    num_kv_heads, 128, head_size] and ``tail_page`` int32 [num_slots, 2] (page pg in half pg % 2),
    as ``write_kv_cache_int4`` keeps them; the page before the newest is read from its half when
    the half names its block. Runs after the step's ``write_kv_cache_int4``. Rows
    past query_start_loc[num_seqs] (CUDA-graph padding) keep what they held. No host sync,
    CUDA-graph safe with ``workspace``.

    ``sink`` [num_sinks, 2, num_kv_heads, 64, head_size] (bf16/fp16) and ``sink_of_seq`` int32
    [>= num_seqs], both or neither: a row r with sink_of_seq[r] = s >= 0 reads its keys 0..63
    exact from sink[s] (as ``write_sink_int4`` stores them) instead of from int4 page 0, whenever
    page 0 is a full page read from the cache; while page 0 is the tail's, the tail is read and
    the sink is not. Without them (or with every sink_of_seq -1) the output is bit for bit the
    same. reference_int4.paged_attention_int4_ref is the spec.
    """
    # Everything that decides the launches but the addresses of the calling layer's own tensors
    # (query, output, cache, tail pool and its pages, sink pool) and of the batch's block table,
    # query starts and lengths (each KV-cache group has its own block table): every layer of a
    # step repeats the call with only those changed, and replays the first layer's launches
    # (launch.py; paged_attention's key).
    key = (
        query.shape, query.stride(), output.shape, output.stride(), kv_cache.stride(),
        tail.shape, tail.stride(), tail_page.shape, tail_page.stride(),
        None if sink is None else (sink.shape, sink.stride()),
        query_start_loc.shape, query_start_loc.dtype, seq_lens.shape, seq_lens.dtype,
        block_table.stride(), block_table.dtype,
        slot_of_seq.data_ptr(), slot_of_seq.shape, slot_of_seq.dtype,
        None if sink_of_seq is None else (sink_of_seq.data_ptr(), sink_of_seq.shape,
                                          sink_of_seq.dtype),
        kv_dtype, block_size, num_kv_heads, max_query_len, softmax_scale, sliding_window, soft_cap,
        id(workspace), num_splits,
        max_seq_len if num_splits is None else None,  # as paged_attention's key
        choose_config_int4,  # tests swap the config chooser
    )  # fmt: skip
    if _replays.run(key, q_ptr=query, out_ptr=output, cache_ptr=kv_cache.view(torch.uint8),
                    tail_ptr=tail, tail_page_ptr=tail_page, sink_ptr=sink,
                    block_table_ptr=block_table, qsl_ptr=query_start_loc,
                    seq_lens_ptr=seq_lens):  # fmt: skip
        return
    num_tokens, num_q_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    layout = cached_int4_layout(kv_dtype, block_size, num_kv_heads, head_size)
    check_shapes(query, output, kv_cache, num_kv_heads)
    tail_pages = check_pools(tail, tail_page, sink, sink_of_seq, layout, num_seqs, "int4 attention")
    if num_tokens == 0 or num_seqs == 0:
        return
    group = num_q_heads // num_kv_heads
    cfg = choose_config_int4(group, head_size, max_query_len, device_cc_major(query.device))
    plan = plan_launch(query, cfg, num_seqs, group, max_seq_len, num_kv_heads, workspace,
                       num_splits, sliding_window)  # fmt: skip
    use_split = plan.splits > 1
    ws = plan.workspace
    ws_acc, ws_m, ws_l = (ws.acc, ws.m, ws.l) if use_split else (output, output, output)
    ts = tail.stride()
    # no sink: the tail stands in for its pointers and strides, never read (HAS_SINK False)
    has_sink = sink is not None
    if not has_sink:
        sink, sink_of_seq = tail, slot_of_seq
    ss = sink.stride()
    # The tensors a replay swaps: the layer's own (ws_* alias the output when nothing is split;
    # without a sink pool the tail stands in for it) and the batch's
    swap = [("q_ptr",), ("out_ptr", *(() if use_split else ("ws_acc_ptr", "ws_m_ptr", "ws_l_ptr"))),
            ("cache_ptr", "cache16_ptr"), ("tail_ptr", *(() if has_sink else ("sink_ptr",))),
            ("tail_page_ptr",), *((name,) for name in SLICED_METADATA_PTRS)]  # fmt: skip
    if has_sink:
        swap.append(("sink_ptr",))
    attn = launch_attn_int4.record(
        swap,
        (plan.num_q_blocks, num_kv_heads, plan.splits),
        query,
        output,
        kv_cache.view(torch.uint8),
        kv_cache.view(torch.float16),
        tail,
        tail_page,
        block_table,
        query_start_loc,
        seq_lens,
        slot_of_seq,
        sink,
        sink_of_seq,
        ws_acc,
        ws_m,
        ws_l,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        kv_cache.stride(0),
        block_table.stride(0),
        ts[0],
        ts[1],
        ts[2],
        ts[3],
        ss[0],
        ss[1],
        ss[2],
        ss[3],
        num_seqs,
        float(softmax_scale),
        float(soft_cap) if soft_cap else 1.0,
        int(sliding_window) if sliding_window else 0,
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=plan.block_q,
        USE_WINDOW=bool(sliding_window),
        USE_SOFTCAP=bool(soft_cap),
        SPLIT=use_split,
        HAS_SINK=has_sink,
        DOT_F32=query.device.type != "cuda",
        TAIL_PAGES=tail_pages,
        **layout.kernel_constexprs(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    merge = None
    if use_split:
        merge = launch_split_merge(output, ws, query_start_loc, num_seqs, plan.splits)
    # A workspace made by this call would be freed under a replay of it
    if attn is not None and (merge is not None or not use_split) and workspace is ws:
        _replays.add(key, [attn] if merge is None else [attn, merge], workspace)
