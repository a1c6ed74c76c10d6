"""Paged attention over ``int4`` pages (Hadamard-rotated 4-bit K/V, fp16 scale and zero per group).

Same launch shapes, masking, online softmax, split-KV workspace and merge kernel as the INT8
kernel (attention.py): decode packs the query heads of a GQA group into one program so each K/V
tile is read once per group, and long contexts are split across programs.

The math, per key j, with groups g of G elements (codes c, fp16 scale s and zero z per group, all
in the rotated basis; q~ = qH is the rotated query):

    score[i, j] = sum_g s_g[j] * (q~_g[i] . c_g[j]) + z_g[j] * sum_{d in g} q~[i, d]
    out~[i, d in g] = sum_j (p[i, j] s_g[j]) c_g[j, d] + sum_j p[i, j] z_g[j]
    out = out~ H

so dequantization never multiplies a K/V element: codes (exact small integers) go straight into
``tl.dot``, scales multiply score columns / P columns, zeros are an outer product of per-row query
group sums and per-column zeros (scores) or a per-row running sum (output).

Nibble halves: byte i of a token's K or V holds dims i (low nibble) and i + D/2 (high). A "piece"
is GH = min(G, D/2) byte columns: loaded once as a byte tile ([GH, TILE_N] of K, [TILE_N, GH] of
V) and split with ``& 15`` / ``>> 4`` into two code tiles, each inside one group, each a 2D
``tl.dot`` against the matching query piece (K) or P (V). V is key-major in the page, so its tile
is keys-contiguous in shared memory, what the PV operand reads in words (see ``_load_v_piece``).
D = 128, G = 64: one piece, low nibbles group 0, high group 1; D = 256: two pieces (byte columns
[0, 64) -> groups 0 and 2, [64, 128) -> groups 1 and 3); D = 64: one piece, both nibbles in
group 0. (At most two pieces: group size >= D / 4.)

The rotations are fp32 torch matmuls in the wrapper (q~ = qH before, out = out~ H after): two
extra launches and two fp32 temporaries per call, see ``paged_attention_int4``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import (
    _LOG2E,
    _M_INIT,
    AttentionWorkspace,
    _check_shapes,
    _find_seq,
    _launch_merge,
    _load_key_major_tile,
    _load_pages,
    _load_tile_pages,
    _plan_launch,
    _softmax_step,
)
from .e4m3 import check_v_format
from .hadamard import rotate
from .launch import DirectLauncher
from .page_layout import Int4PageLayout


@triton.jit
def _codes_to_dot(b, DOT_F32: tl.constexpr):
    """uint8 tile -> (low-nibble codes, high-nibble codes) as dot operands (exact 0..15)."""
    lo = b & 15
    hi = b >> 4
    if DOT_F32:  # interpreter
        return lo.to(tl.float32), hi.to(tl.float32)
    # No int -> fp16 conversion instruction (a quarter-rate unit): the fp16 with bits 0x6400 | c
    # is 1024 + c, so an OR, a free bitcast and an exact subtraction give c.
    lo = (lo.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    hi = (hi.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return lo, hi


@triton.jit
def _load_sz(cache16_ptr, sz_row, g, key_ok, SZ: tl.constexpr):
    """fp32 (scale, zero) [TILE_N] of group ``g`` for keys whose group-0 scale sits at fp16
    index ``sz_row`` of the region; 0 for keys past the end."""
    ptr = cache16_ptr + SZ // 2 + sz_row + g * 2
    sc = tl.load(ptr, mask=key_ok, other=0.0).to(tl.float32)
    z = tl.load(ptr + 1, mask=key_ok, other=0.0).to(tl.float32)
    return sc, z


@triton.jit
def _load_sz_tile(
    cache16_ptr, bt_row, start, key, key_hi, kvh, stride_block, SZ: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NG: tl.constexpr,
):  # fmt: skip
    """fp32 (scale, zero) [TILE_N, NG] of every group of the tile's keys, read a page at a time.

    For ``start`` and ``TILE_N`` multiples of ``BLOCK_SIZE``: a page's (scale, zero) pairs of one
    head are ``BLOCK_SIZE * NG`` contiguous 32-bit words, so this is one vector load per page
    that the pipeliner can copy asynchronously, instead of four 2-byte gathers per key and piece. Keys past
    ``key_hi`` inside a valid page are read (in bounds) and zeroed: a stale NaN there would
    otherwise survive the masked softmax as p * NaN.
    """
    ROW: tl.constexpr = BLOCK_SIZE * NG  # (scale, zero) pairs of one page and head
    pages, page_ok = _load_tile_pages(bt_row, start, key_hi, TILE_N, BLOCK_SIZE)
    # One pair = one 32-bit word (scale in the low half: little endian), so even one pair per
    # thread is a 4-byte load, the smallest an asynchronous copy takes.
    words_ptr = cache16_ptr.to(tl.pointer_type(tl.int32))
    idx = pages[:, None] * (stride_block // 4) + kvh * ROW + tl.arange(0, ROW)[None, :]
    words = tl.load(words_ptr + SZ // 4 + idx, mask=page_ok[:, None], other=0)
    words = tl.reshape(words, [TILE_N, NG])
    sc = (words & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    z = (words >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    ok = (key < key_hi)[:, None]
    return tl.where(ok, sc, 0.0), tl.where(ok, z, 0.0)


@triton.jit
def _group(x, g: tl.constexpr, NG: tl.constexpr):
    """Column ``g`` of ``x`` [TILE_N, NG] as [TILE_N] (a select and an in-register sum)."""
    return tl.sum(tl.where(tl.arange(0, NG)[None, :] == g, x, 0.0), axis=1)


@triton.jit
def _piece_sz(
    cache16_ptr, sz_row, key_ok, sc_tile, z_tile, J: tl.constexpr, HALF: tl.constexpr,
    GH: tl.constexpr, QGROUP: tl.constexpr, NG: tl.constexpr, SZ: tl.constexpr,
    PAGED: tl.constexpr,
):  # fmt: skip
    """(scale, zero) [TILE_N] of the low- and high-nibble groups of piece J: from the page-wise
    tile (``PAGED``), or gathered per key."""
    g_lo: tl.constexpr = (J * GH) // QGROUP
    g_hi: tl.constexpr = (HALF + J * GH) // QGROUP
    if PAGED:
        return (_group(sc_tile, g_lo, NG), _group(z_tile, g_lo, NG),
                _group(sc_tile, g_hi, NG), _group(z_tile, g_hi, NG))  # fmt: skip
    sc_lo, z_lo = _load_sz(cache16_ptr, sz_row, g_lo, key_ok, SZ)
    sc_hi, z_hi = _load_sz(cache16_ptr, sz_row, g_hi, key_ok, SZ)
    return sc_lo, z_lo, sc_hi, z_hi


@triton.jit
def _load_q_piece(q_row, row_ok, d0, GH: tl.constexpr):
    """Rotated query dims [d0, d0 + GH) of every row: fp32 [BLOCK_M, GH]."""
    return tl.load(q_row[:, None] + d0 + tl.arange(0, GH)[None, :], mask=row_ok[:, None], other=0.0)


@triton.jit
def _piece_scores(
    cache_ptr, base, key_ok, q_lo, q_hi, qs_lo, qs_hi, sc_lo, z_lo, sc_hi, z_hi,
    J: tl.constexpr, GH: tl.constexpr, K_DATA: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """Unscaled scores [BLOCK_M, TILE_N] of byte columns [J*GH, (J+1)*GH) of the K rows: their
    low nibbles are dims J*GH + e, their high nibbles HALF + J*GH + e, one group each."""
    kb = tl.load(
        cache_ptr + K_DATA + base[None, :] + J * GH + tl.arange(0, GH)[:, None],
        mask=key_ok[None, :],
        other=0,
    )  # [GH, TILE_N]
    k_lo, k_hi = _codes_to_dot(kb, DOT_F32)
    s = tl.dot(q_lo, k_lo) * sc_lo[None, :] + tl.dot(q_hi, k_hi) * sc_hi[None, :]
    return s + qs_lo[:, None] * z_lo[None, :] + qs_hi[:, None] * z_hi[None, :]


@triton.jit
def _load_v_piece(
    cache_ptr, bt_row, page, start, key, key_ok, key_hi, kvh, stride_block, d0,
    GH: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    V_DATA: tl.constexpr,
):  # fmt: skip
    """Packed V bytes [TILE_N, GH] of byte columns [d0, d0 + GH) of the tile's keys (V is
    key-major: byte i of slot t at (h*D/2 + i)*B + t, page_layout.py). Keys past key_hi inside a
    valid page are stale codes, finite: their p is 0."""
    return _load_key_major_tile(
        cache_ptr + V_DATA + kvh * HALF * BLOCK_SIZE, bt_row, page, start, key, key_ok, key_hi,
        stride_block, d0 + tl.arange(0, GH), GH, BLOCK_SIZE, TILE_N,
    )  # fmt: skip


@triton.jit
def _piece_pv(
    vb, p, alpha, acc_lo, acc_hi, az_lo, az_hi, sc_lo, z_lo, sc_hi, z_hi, DOT_F32: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of the output dims of V byte tile ``vb`` [TILE_N, GH] (byte columns
    [J*GH, (J+1)*GH), as in ``_piece_scores``): acc += (p * scale) @ codes, az += p @ zero (added
    to every dim at the end)."""
    v_lo, v_hi = _codes_to_dot(vb, DOT_F32)
    acc_lo = acc_lo * alpha[:, None] + tl.dot((p * sc_lo[None, :]).to(v_lo.dtype), v_lo)
    acc_hi = acc_hi * alpha[:, None] + tl.dot((p * sc_hi[None, :]).to(v_hi.dtype), v_hi)
    az_lo = az_lo * alpha + tl.sum(p * z_lo[None, :], axis=1)
    az_hi = az_hi * alpha + tl.sum(p * z_hi[None, :], axis=1)
    return acc_lo, acc_hi, az_lo, az_hi


@triton.jit
def _store_piece(dst_row, row_ok, acc_lo, acc_hi, az_lo, az_hi, inv, J: tl.constexpr,
                 HALF: tl.constexpr, GH: tl.constexpr):  # fmt: skip
    d = J * GH + tl.arange(0, GH)[None, :]
    tl.store(dst_row[:, None] + d, (acc_lo + az_lo[:, None]) * inv, mask=row_ok[:, None])
    tl.store(dst_row[:, None] + HALF + d, (acc_hi + az_hi[:, None]) * inv, mask=row_ok[:, None])


# Batch-dependent ints are not specialized on (== 1, % 16): one compiled variant serves
# every batch instead of a Triton compile mid-serving when a new size class shows up.
@triton.jit(do_not_specialize=["num_seqs", "window"])
def _attn_int4_fwd(
    q_ptr,  # rotated query, fp32
    out_ptr,  # rotated output, fp32
    cache_ptr,  # uint8 view of the cache
    cache16_ptr,  # fp16 view of the same storage
    block_table_ptr,
    qsl_ptr,
    seq_lens_ptr,
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
    GROUP: tl.constexpr,  # query heads per kv-head
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    QGROUP: tl.constexpr,  # quantization group size G
    GH: tl.constexpr,  # min(G, HEAD_SIZE // 2): byte columns of one piece
    NGH: tl.constexpr,  # (HEAD_SIZE // 2) // GH: pieces per row, 1 or 2
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    K_DATA: tl.constexpr,
    V_DATA: tl.constexpr,
    K_SZ: tl.constexpr,
    V_SZ: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_SIZE // 2
    NG: tl.constexpr = HEAD_SIZE // QGROUP
    TWO: tl.constexpr = NGH == 2  # D = 256 with G = 64: piece 1 = byte columns [GH, 2*GH)
    # (scale, zero) read a page at a time (_load_sz_tile) when a tile is whole pages
    PAGED: tl.constexpr = TILE_N % BLOCK_SIZE == 0
    pid_q = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq = _find_seq(qsl_ptr, pid_q, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    qb = pid_q - (q_start // BLOCK_Q + seq)
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = qb * BLOCK_Q + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    token = (q_start + q_idx).to(tl.int64)
    q_row = q_ptr + token * stride_qt + head * stride_qh
    # Query pieces matching the K pieces: (low, high) nibble dims of byte columns of piece j.
    q_lo0 = _load_q_piece(q_row, row_ok, 0, GH)
    q_hi0 = _load_q_piece(q_row, row_ok, HALF, GH)
    q_max = tl.maximum(tl.max(tl.abs(q_lo0), axis=1), tl.max(tl.abs(q_hi0), axis=1))
    if TWO:
        q_lo1 = _load_q_piece(q_row, row_ok, GH, GH)
        q_hi1 = _load_q_piece(q_row, row_ok, HALF + GH, GH)
        q_max = tl.maximum(q_max, tl.max(tl.abs(q_lo1), axis=1))
        q_max = tl.maximum(q_max, tl.max(tl.abs(q_hi1), axis=1))
    else:
        q_lo1 = q_lo0  # unused
        q_hi1 = q_hi0
    score_scale = softmax_scale
    if not DOT_F32:
        # fp16 dots against exact fp16 codes: scale q so its largest element is <= 2^14 (inside
        # fp16 range, 11 significant bits); 1/c folds into the score scale.
        c = tl.exp2(14.0 - tl.ceil(tl.log2(tl.maximum(tl.max(q_max, axis=0), 1.0e-30))))
        q_lo0 = (q_lo0 * c).to(tl.float16)
        q_hi0 = (q_hi0 * c).to(tl.float16)
        q_lo1 = (q_lo1 * c).to(tl.float16)
        q_hi1 = (q_hi1 * c).to(tl.float16)
        score_scale = score_scale / c
    # Per-row piece sums for the zero-point term, from the same (rounded) q the dots see.
    qs_lo0 = tl.sum(q_lo0.to(tl.float32), axis=1)
    qs_hi0 = tl.sum(q_hi0.to(tl.float32), axis=1)
    qs_lo1 = tl.sum(q_lo1.to(tl.float32), axis=1)
    qs_hi1 = tl.sum(q_hi1.to(tl.float32), axis=1)
    pos = ctx + q_idx

    key_hi = tl.minimum(ctx + (qb + 1) * BLOCK_Q, seq_len)
    key_lo = 0
    if USE_WINDOW:
        key_lo = tl.maximum(ctx + qb * BLOCK_Q - window + 1, 0)
        key_lo = (key_lo // TILE_N) * TILE_N
    if SPLIT:
        n_tiles = tl.cdiv(key_hi - key_lo, TILE_N)
        per_split = tl.cdiv(n_tiles, num_splits) * TILE_N
        key_lo = key_lo + split * per_split
        key_hi = tl.minimum(key_lo + per_split, key_hi)
    if not USE_SOFTCAP:
        score_scale = score_scale * _LOG2E

    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], _M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo0 = tl.zeros([BLOCK_M, GH], tl.float32)  # sum_j p s c, rotated dims of piece 0
    acc_hi0 = tl.zeros([BLOCK_M, GH], tl.float32)
    az_lo0 = tl.zeros([BLOCK_M], tl.float32)  # sum_j p z of the piece's group
    az_hi0 = tl.zeros([BLOCK_M], tl.float32)
    acc_lo1 = acc_lo0  # piece 1: only carried (and compiled) when TWO
    acc_hi1 = acc_hi0
    az_lo1 = az_lo0
    az_hi1 = az_hi0
    offs_n = tl.arange(0, TILE_N)
    for start in range(key_lo, key_hi, TILE_N):
        key = start + offs_n
        key_ok = key < key_hi
        page = _load_pages(bt_row, key, key_hi, BLOCK_SIZE)
        row = kvh * BLOCK_SIZE + key % BLOCK_SIZE  # (head, slot) row inside a page region
        base = page * stride_block + row * HALF  # byte offset of each key's K row
        sz_row = page * (stride_block // 2) + row * (NG * 2)  # fp16 index of its group 0 scale
        if PAGED:
            ksc, kz = _load_sz_tile(cache16_ptr, bt_row, start, key, key_hi, kvh, stride_block,
                                    K_SZ, TILE_N, BLOCK_SIZE, NG)  # fmt: skip
            vsc, vz = _load_sz_tile(cache16_ptr, bt_row, start, key, key_hi, kvh, stride_block,
                                    V_SZ, TILE_N, BLOCK_SIZE, NG)  # fmt: skip
        else:  # unused placeholders
            ksc = tl.zeros([TILE_N, NG], tl.float32)
            kz = ksc
            vsc = ksc
            vz = ksc

        s = _piece_scores(
            cache_ptr, base, key_ok, q_lo0, q_hi0, qs_lo0, qs_hi0,
            *_piece_sz(cache16_ptr, sz_row, key_ok, ksc, kz, 0, HALF, GH, QGROUP, NG, K_SZ, PAGED),
            0, GH, K_DATA, DOT_F32,
        )  # fmt: skip
        if TWO:
            s += _piece_scores(
                cache_ptr, base, key_ok, q_lo1, q_hi1, qs_lo1, qs_hi1,
                *_piece_sz(cache16_ptr, sz_row, key_ok, ksc, kz, 1, HALF, GH, QGROUP, NG, K_SZ,
                           PAGED),
                1, GH, K_DATA, DOT_F32,
            )  # fmt: skip
        p, alpha, m_i, l_i = _softmax_step(
            s * score_scale, key, key_ok, pos, window, soft_cap, m_i, l_i, USE_WINDOW, USE_SOFTCAP
        )

        vb = _load_v_piece(cache_ptr, bt_row, page, start, key, key_ok, key_hi, kvh, stride_block,
                           0, GH, HALF, BLOCK_SIZE, TILE_N, V_DATA)  # fmt: skip
        acc_lo0, acc_hi0, az_lo0, az_hi0 = _piece_pv(
            vb, p, alpha, acc_lo0, acc_hi0, az_lo0, az_hi0,
            *_piece_sz(cache16_ptr, sz_row, key_ok, vsc, vz, 0, HALF, GH, QGROUP, NG, V_SZ, PAGED),
            DOT_F32,
        )  # fmt: skip
        if TWO:
            vb = _load_v_piece(cache_ptr, bt_row, page, start, key, key_ok, key_hi, kvh,
                               stride_block, GH, GH, HALF, BLOCK_SIZE, TILE_N, V_DATA)  # fmt: skip
            acc_lo1, acc_hi1, az_lo1, az_hi1 = _piece_pv(
                vb, p, alpha, acc_lo1, acc_hi1, az_lo1, az_hi1,
                *_piece_sz(cache16_ptr, sz_row, key_ok, vsc, vz, 1, HALF, GH, QGROUP, NG, V_SZ,
                           PAGED),
                DOT_F32,
            )  # fmt: skip

    if SPLIT:
        ws = (token * NUM_Q_HEADS + head) * num_splits + split
        tl.store(ws_m_ptr + ws, m_i, mask=row_ok)
        tl.store(ws_l_ptr + ws, l_i, mask=row_ok)
        dst = ws_acc_ptr + ws * HEAD_SIZE
        inv = 1.0  # the merge divides by the combined l
    else:
        dst = out_ptr + token * stride_ot + head * stride_oh
        inv = 1.0 / tl.where(row_ok, l_i, 1.0)[:, None]  # padding rows: no 0/0
    _store_piece(dst, row_ok, acc_lo0, acc_hi0, az_lo0, az_hi0, inv, 0, HALF, GH)
    if TWO:
        _store_piece(dst, row_ok, acc_lo1, acc_hi1, az_lo1, az_hi1, inv, 1, HALF, GH)


def int4_attn_constexprs(layout: Int4PageLayout) -> dict:
    """Layout-derived compile-time arguments of ``_attn_int4_fwd`` (also compile_sm80.py)."""
    if layout.row_bytes // layout.piece_bytes > 2:
        raise ValueError(
            f"int4 attention: group size {layout.group_size} splits a nibble half of head_size "
            f"{layout.head_size} into more than 2 pieces (needs group size >= head_size / 4)"
        )
    return dict(QGROUP=layout.group_size, **layout.kernel_constexprs())


launch_attn_int4 = DirectLauncher(_attn_int4_fwd)


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
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    workspace: AttentionWorkspace | None = None,
    num_splits: int | None = None,
    v_format: str = "int8",
) -> None:
    """``paged_attention`` over ``int4`` pages: same arguments and semantics (k_scale / v_scale must
    be None). query / output are in the model's basis; the rotation is internal.

    Host side: q~ = query @ H (fp32 [tokens, q_heads, D] temporary), the kernel (+ split merge)
    writes out~ to a second fp32 temporary, then output = out~ @ H for the rows of the batch only
    (rows past query_start_loc[-1], CUDA-graph padding, keep what they held). Only torch ops and
    kernel launches, shapes from Python ints: no host sync, CUDA-graph safe.
    """
    num_tokens, num_q_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    layout = Int4PageLayout(block_size, num_kv_heads, head_size, kv_dtype)
    check_v_format(kv_dtype, v_format)
    if k_scale is not None or v_scale is not None:
        raise ValueError("int4 has no static scales: k_scale / v_scale must be None")
    _check_shapes(query, output, kv_cache, num_kv_heads)
    if num_tokens == 0 or num_seqs == 0:
        return
    group = num_q_heads // num_kv_heads
    plan = _plan_launch(
        query, num_seqs, group, max_query_len, max_seq_len, num_kv_heads, workspace, num_splits,
        sliding_window=sliding_window,
    )  # fmt: skip
    cfg = plan.cfg
    use_split = plan.splits > 1
    q_rot = rotate(query)  # fp32, contiguous
    o_rot = torch.empty_like(q_rot)
    ws = plan.workspace
    ws_acc, ws_m, ws_l = (ws.acc, ws.m, ws.l) if use_split else (o_rot, o_rot, o_rot)
    dummy_window = int(sliding_window) if sliding_window else 0
    launch_attn_int4(
        (plan.num_q_blocks, num_kv_heads, plan.splits),
        q_rot,
        o_rot,
        kv_cache.view(torch.uint8),
        kv_cache.view(torch.float16),
        block_table,
        query_start_loc,
        seq_lens,
        ws_acc,
        ws_m,
        ws_l,
        q_rot.stride(0),
        q_rot.stride(1),
        o_rot.stride(0),
        o_rot.stride(1),
        kv_cache.stride(0),
        block_table.stride(0),
        num_seqs,
        float(softmax_scale),
        float(soft_cap) if soft_cap else 1.0,
        dummy_window,
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=plan.block_q,
        TILE_N=cfg.tile_n,
        USE_WINDOW=bool(sliding_window),
        USE_SOFTCAP=bool(soft_cap),
        SPLIT=use_split,
        DOT_F32=query.device.type != "cuda",
        **int4_attn_constexprs(layout),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if use_split:
        _launch_merge(o_rot, ws, query_start_loc, num_seqs, plan.splits)
    # Un-rotate; rows past the batch were never written (torch.empty garbage): keep output's.
    rows = torch.arange(num_tokens, device=query.device) < query_start_loc[num_seqs]
    out = rotate(o_rot).to(output.dtype)
    output.copy_(torch.where(rows[:, None, None], out, output))
