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

Nibble halves: byte i of a row holds dims i (low nibble) and i + D/2 (high). A tile is loaded
once as bytes [NGH, GH, TILE_N] (GH = min(G, D/2) elements of a group in one half, NGH = pieces
per half) and split with ``& 15`` / ``>> 4`` into the two halves' code tiles; every piece is a
batch entry of a 3D ``tl.dot`` with its own group's scale. D = 128, G = 64: one piece per half,
each its own group; D = 256: two pieces per half; D = 64: the two halves share group 0.

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
    _load_pages,
    _plan_launch,
)
from .e4m3 import check_v_format
from .hadamard import rotate
from .page_layout import Int4PageLayout


@triton.jit
def _codes_to_dot(b, DOT_F32: tl.constexpr):
    """uint8 tile -> (low-nibble codes, high-nibble codes) as dot operands (exact 0..15)."""
    lo = b & 15
    hi = b >> 4
    if DOT_F32:
        return lo.to(tl.float32), hi.to(tl.float32)
    return lo.to(tl.float16), hi.to(tl.float16)


@triton.jit
def _load_sz(cache16_ptr, sz_row, g, key_ok, SZ: tl.constexpr):
    """fp32 (scale, zero) [NGH, TILE_N] of groups ``g`` [NGH] for keys with fp16 index ``sz_row``
    (index of the key's group 0 scale in its page's region); 0 for keys past the end."""
    ptr = cache16_ptr + SZ // 2 + sz_row[None, :] + g[:, None] * 2
    sc = tl.load(ptr, mask=key_ok[None, :], other=0.0).to(tl.float32)
    z = tl.load(ptr + 1, mask=key_ok[None, :], other=0.0).to(tl.float32)
    return sc, z


@triton.jit
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
    GH: tl.constexpr,  # min(G, HEAD_SIZE // 2)
    NGH: tl.constexpr,  # (HEAD_SIZE // 2) // GH
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
    offs_j = tl.arange(0, NGH)
    # Dims of the low-half pieces: piece j covers [j*GH, (j+1)*GH); the high half adds HALF.
    dl = offs_j[:, None] * GH + tl.arange(0, GH)[None, :]  # [NGH, GH]
    g_lo = (offs_j * GH) // QGROUP  # quantization group of each piece, [NGH]
    g_hi = (HALF + offs_j * GH) // QGROUP
    q_idx = qb * BLOCK_Q + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    token = (q_start + q_idx).to(tl.int64)
    q_row = q_ptr + token * stride_qt + head * stride_qh
    q_ptrs = q_row[None, :, None] + dl[:, None, :]  # [NGH, BLOCK_M, GH]
    q_lo = tl.load(q_ptrs, mask=row_ok[None, :, None], other=0.0)
    q_hi = tl.load(q_ptrs + HALF, mask=row_ok[None, :, None], other=0.0)
    score_scale = softmax_scale
    if not DOT_F32:
        # fp16 dots against exact fp16 codes: scale q so its largest element is <= 2^14 (inside
        # fp16 range, 11 significant bits); 1/c folds into the score scale.
        q_max = tl.maximum(
            tl.maximum(tl.max(tl.max(tl.max(tl.abs(q_lo), axis=2), axis=1), axis=0),
                       tl.max(tl.max(tl.max(tl.abs(q_hi), axis=2), axis=1), axis=0)),
            1.0e-30,
        )  # fmt: skip
        c = tl.exp2(14.0 - tl.ceil(tl.log2(q_max)))
        q_lo = (q_lo * c).to(tl.float16)
        q_hi = (q_hi * c).to(tl.float16)
        score_scale = score_scale / c
    # Per-row, per-piece query sums for the zero-point term, from the same (rounded) q the dots see.
    qs_lo = tl.sum(q_lo.to(tl.float32), axis=2)  # [NGH, BLOCK_M]
    qs_hi = tl.sum(q_hi.to(tl.float32), axis=2)
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
    acc_lo = tl.zeros([NGH, BLOCK_M, GH], tl.float32)  # sum_j p s c over the low-half pieces
    acc_hi = tl.zeros([NGH, BLOCK_M, GH], tl.float32)
    az_lo = tl.zeros([NGH, BLOCK_M], tl.float32)  # sum_j p z of each piece's group
    az_hi = tl.zeros([NGH, BLOCK_M], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    for start in range(key_lo, key_hi, TILE_N):
        key = start + offs_n
        key_ok = key < key_hi
        page = _load_pages(bt_row, key, key_hi, BLOCK_SIZE)
        row = kvh * BLOCK_SIZE + key % BLOCK_SIZE  # (head, slot) row inside a page region
        base = page * stride_block + row * HALF  # byte offset of each key's data row
        sz_row = page * (stride_block // 2) + row * (NG * 2)  # fp16 index of its group 0 scale

        kb = tl.load(
            cache_ptr + K_DATA + base[None, None, :] + dl[:, :, None],
            mask=key_ok[None, None, :],
            other=0,
        )  # [NGH, GH, TILE_N]
        k_lo, k_hi = _codes_to_dot(kb, DOT_F32)
        ks_lo, kz_lo = _load_sz(cache16_ptr, sz_row, g_lo, key_ok, K_SZ)
        ks_hi, kz_hi = _load_sz(cache16_ptr, sz_row, g_hi, key_ok, K_SZ)
        s3 = tl.dot(q_lo, k_lo) * ks_lo[:, None, :] + tl.dot(q_hi, k_hi) * ks_hi[:, None, :]
        s3 += qs_lo[:, :, None] * kz_lo[:, None, :] + qs_hi[:, :, None] * kz_hi[:, None, :]
        s = tl.sum(s3, axis=0) * score_scale  # [BLOCK_M, TILE_N]
        if USE_SOFTCAP:
            s = soft_cap * (2.0 * tl.sigmoid(s * (2.0 / soft_cap)) - 1.0) * _LOG2E
        visible = key_ok[None, :] & (key[None, :] <= pos[:, None])
        if USE_WINDOW:
            visible = visible & (pos[:, None] - key[None, :] < window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        vb = tl.load(
            cache_ptr + V_DATA + base[None, :, None] + dl[:, None, :],
            mask=key_ok[None, :, None],
            other=0,
        )  # [NGH, TILE_N, GH]
        v_lo, v_hi = _codes_to_dot(vb, DOT_F32)
        vs_lo, vz_lo = _load_sz(cache16_ptr, sz_row, g_lo, key_ok, V_SZ)
        vs_hi, vz_hi = _load_sz(cache16_ptr, sz_row, g_hi, key_ok, V_SZ)
        p3 = p[None, :, :]
        acc_lo = acc_lo * alpha[None, :, None] + tl.dot(
            (p3 * vs_lo[:, None, :]).to(v_lo.dtype), v_lo
        )
        acc_hi = acc_hi * alpha[None, :, None] + tl.dot(
            (p3 * vs_hi[:, None, :]).to(v_hi.dtype), v_hi
        )
        az_lo = az_lo * alpha[None, :] + tl.sum(p3 * vz_lo[:, None, :], axis=2)
        az_hi = az_hi * alpha[None, :] + tl.sum(p3 * vz_hi[:, None, :], axis=2)

    o_lo = acc_lo + az_lo[:, :, None]  # [NGH, BLOCK_M, GH], rotated basis, not yet / l
    o_hi = acc_hi + az_hi[:, :, None]
    mask3 = row_ok[None, :, None]
    if SPLIT:
        ws = (token * NUM_Q_HEADS + head) * num_splits + split
        tl.store(ws_m_ptr + ws, m_i, mask=row_ok)
        tl.store(ws_l_ptr + ws, l_i, mask=row_ok)
        ws_ptrs = ws_acc_ptr + ws[None, :, None] * HEAD_SIZE + dl[:, None, :]
        tl.store(ws_ptrs, o_lo, mask=mask3)
        tl.store(ws_ptrs + HALF, o_hi, mask=mask3)
    else:
        inv = 1.0 / tl.where(row_ok, l_i, 1.0)[None, :, None]  # padding rows: no 0/0
        o_row = out_ptr + token * stride_ot + head * stride_oh
        o_ptrs = o_row[None, :, None] + dl[:, None, :]
        tl.store(o_ptrs, o_lo * inv, mask=mask3)
        tl.store(o_ptrs + HALF, o_hi * inv, mask=mask3)


def int4_attn_constexprs(layout: Int4PageLayout) -> dict:
    """Layout-derived compile-time arguments of ``_attn_int4_fwd`` (also compile_sm80.py)."""
    gh = min(layout.group_size, layout.head_size // 2)
    return dict(
        HEAD_SIZE=layout.head_size,
        QGROUP=layout.group_size,
        GH=gh,
        NGH=layout.head_size // 2 // gh,
        BLOCK_SIZE=layout.block_size,
        K_DATA=layout.k_data,
        V_DATA=layout.v_data,
        K_SZ=layout.k_sz,
        V_SZ=layout.v_sz,
    )


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
        query, num_seqs, group, max_query_len, max_seq_len, num_kv_heads, workspace, num_splits
    )
    cfg = plan.cfg
    use_split = plan.splits > 1
    q_rot = rotate(query)  # fp32, contiguous
    o_rot = torch.empty_like(q_rot)
    ws = plan.workspace
    ws_acc, ws_m, ws_l = (ws.acc, ws.m, ws.l) if use_split else (o_rot, o_rot, o_rot)
    dummy_window = int(sliding_window) if sliding_window else 0
    _attn_int4_fwd[(plan.num_q_blocks, num_kv_heads, plan.splits)](
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
