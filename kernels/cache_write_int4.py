"""Cache write for ``int4``: rotate new K/V (fp32 torch matmul), then one Triton kernel quantizes
each (token, kv-head, group) to 4-bit codes with an fp16 scale and zero and packs two codes a byte.

The contract is spelled out in reference_int4.py; the kernel does exactly its arithmetic (IEEE
division, round half even) so the page bytes match the reference bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cache_write import FP16_MAX, _rint, _store_key_major
from .catalogue import get_dtype
from .e4m3 import check_v_format
from .hadamard import rotate
from .launch import DirectLauncher
from .page_layout import Int4PageLayout

# Codes 0..15; reference_int4.py (the kernels' specification) imports this and FP16_MAX.
INT4_LEVELS = get_dtype("int4").qmax

_LEVELS = tl.constexpr(INT4_LEVELS)
_FP16_MAX = tl.constexpr(FP16_MAX)


@triton.jit
def _codes(x, mn, mx):
    """Codes (int32, 0..15), fp16 scale and fp16 zero of x [H, NGH, GH] for group min/max [H, NGH]
    (fp32, finite): the reference_int4 arithmetic step for step."""
    lo = tl.minimum(tl.maximum(mn, -_FP16_MAX), _FP16_MAX)
    hi = tl.minimum(tl.maximum(mx, -_FP16_MAX), _FP16_MAX)
    scale = tl.div_rn(hi - lo, _LEVELS).to(tl.float16)
    zero = lo.to(tl.float16)
    s = scale.to(tl.float32)[:, :, None]
    pos = s > 0.0
    y = tl.div_rn(x - zero.to(tl.float32)[:, :, None], tl.where(pos, s, 1.0))
    y = tl.where(pos, y, 0.0)
    # y is never NaN here (finite x, positive divisor), so minimum/maximum agree on every target.
    q = _rint(tl.minimum(tl.maximum(y, 0.0), _LEVELS)).to(tl.int32)
    return q, scale, zero


@triton.jit
def _quantize_store_int4(
    x_row,  # [TILE_T] pointers to this kv-head's rotated fp32 row (HEAD_SIZE contiguous) per token
    cache_ptr,  # uint8 view of the cache
    cache16_ptr,  # fp16 view of the same storage
    page_off,  # [TILE_T] byte offset of each token's page (int64)
    slot_in_block,  # [TILE_T]
    valid,  # [TILE_T] token inside the batch and not padding
    head,
    DATA_OFF: tl.constexpr,
    SZ_OFF: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GH: tl.constexpr,  # elements of one group inside one nibble half: min(GROUP, HEAD_SIZE // 2)
    NGH: tl.constexpr,  # group pieces per nibble half: (HEAD_SIZE // 2) // GH
    BLOCK_SIZE: tl.constexpr,
    TILE_T: tl.constexpr,
    KEY_MAJOR: tl.constexpr,  # V: byte i of slot t at (h*D/2 + i)*B + t (page_layout.py)
):
    HALF: tl.constexpr = HEAD_SIZE // 2
    NG: tl.constexpr = HEAD_SIZE // GROUP
    offs_j = tl.arange(0, NGH)
    d = offs_j[None, :, None] * GH + tl.arange(0, GH)[None, None, :]  # [1, NGH, GH], low half
    ptr = x_row[:, None, None] + d
    x_lo = tl.load(ptr, mask=valid[:, None, None], other=0.0)  # dims [0, D/2): low nibbles
    x_hi = tl.load(ptr + HALF, mask=valid[:, None, None], other=0.0)  # [D/2, D): high nibbles
    # A row with any NaN/Inf is flagged (scale = zero = NaN, codes 0), see reference_int4.py.
    # Comparisons, not tl.max, because NaN propagation differs between the GPU and the interpreter.
    fin_lo = tl.min(tl.min((tl.abs(x_lo) < float("inf")).to(tl.int32), axis=2), axis=1)
    fin_hi = tl.min(tl.min((tl.abs(x_hi) < float("inf")).to(tl.int32), axis=2), axis=1)
    row_ok = (fin_lo + fin_hi) == 2  # [TILE_T]
    x_lo = tl.where(row_ok[:, None, None], x_lo, 0.0)
    x_hi = tl.where(row_ok[:, None, None], x_hi, 0.0)
    mn_lo = tl.min(x_lo, axis=2)
    mx_lo = tl.max(x_lo, axis=2)
    mn_hi = tl.min(x_hi, axis=2)
    mx_hi = tl.max(x_hi, axis=2)
    if GROUP > HALF:  # one group spans both halves (GROUP == HEAD_SIZE, NGH == 1)
        mn_lo = tl.minimum(mn_lo, mn_hi)
        mx_lo = tl.maximum(mx_lo, mx_hi)
        mn_hi = mn_lo
        mx_hi = mx_lo
    q_lo, sc_lo, z_lo = _codes(x_lo, mn_lo, mx_lo)
    q_hi, sc_hi, z_hi = _codes(x_hi, mn_hi, mx_hi)

    row = head * BLOCK_SIZE + slot_in_block  # (head, slot) row inside the page region
    packed = (q_lo | (q_hi << 4)).to(tl.uint8)
    page = cache_ptr + page_off + DATA_OFF
    if KEY_MAJOR:  # a token's V is D/2 single bytes B apart
        _store_key_major(page, head, slot_in_block, valid, tl.reshape(packed, [TILE_T, HALF]),
                         HALF, BLOCK_SIZE, TILE_T)  # fmt: skip
    else:
        tl.store(page[:, None, None] + row[:, None, None] * HALF + d, packed,
                 mask=valid[:, None, None])  # fmt: skip
    # fp16 (scale, zero) of group g at fp16 index ((row * NG) + g) * 2 of the region.
    sz = cache16_ptr + page_off[:, None] // 2 + SZ_OFF // 2 + row[:, None] * (NG * 2)
    nan = float("nan")
    ok = row_ok[:, None]
    g_lo = (offs_j * GH) // GROUP
    tl.store(sz + g_lo[None, :] * 2, tl.where(ok, sc_lo, nan), mask=valid[:, None])
    tl.store(sz + g_lo[None, :] * 2 + 1, tl.where(ok, z_lo, nan), mask=valid[:, None])
    if GROUP <= HALF:  # the high half has groups of its own
        g_hi = (HALF + offs_j * GH) // GROUP
        tl.store(sz + g_hi[None, :] * 2, tl.where(ok, sc_hi, nan), mask=valid[:, None])
        tl.store(sz + g_hi[None, :] * 2 + 1, tl.where(ok, z_hi, nan), mask=valid[:, None])


# Tokens of the batch per program (one kv-head each), as the int8 write: what lets the key-major
# V store put consecutive slots on neighbouring threads.
_TILE_T = 16


@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv_int4_kernel(
    k_rot_ptr,
    v_rot_ptr,
    cache_ptr,
    cache16_ptr,
    slot_ptr,
    num_tokens,
    stride_block,  # bytes between pages (>= page_bytes when vLLM pads pages)
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GH: tl.constexpr,
    NGH: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_T: tl.constexpr,
    K_DATA: tl.constexpr,
    V_DATA: tl.constexpr,
    K_SZ: tl.constexpr,
    V_SZ: tl.constexpr,
):
    # One program per (tile of TILE_T consecutive tokens of the batch, kv-head): the grid depends
    # on the shapes only (CUDA-graph safe). The tile's tokens may sit on any pages, in any order.
    head = tl.program_id(1)
    t = tl.program_id(0).to(tl.int64) * TILE_T + tl.arange(0, TILE_T)
    in_batch = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=in_batch, other=-1).to(tl.int64)
    valid = in_batch & (slot >= 0)  # negative slot: padding token
    page_off = (slot // BLOCK_SIZE) * stride_block
    off = slot % BLOCK_SIZE
    x_off = (t * NUM_KV_HEADS + head) * HEAD_SIZE  # rows of the contiguous [n, H, D] rotations
    _quantize_store_int4(
        k_rot_ptr + x_off, cache_ptr, cache16_ptr, page_off, off, valid, head, K_DATA, K_SZ,
        HEAD_SIZE, GROUP, GH, NGH, BLOCK_SIZE, TILE_T, False,
    )  # fmt: skip
    _quantize_store_int4(
        v_rot_ptr + x_off, cache_ptr, cache16_ptr, page_off, off, valid, head, V_DATA, V_SZ,
        HEAD_SIZE, GROUP, GH, NGH, BLOCK_SIZE, TILE_T, True,
    )  # fmt: skip


def int4_write_constexprs(layout: Int4PageLayout) -> dict:
    """Compile-time arguments of ``_write_kv_int4_kernel`` for ``layout`` (also compile_sm80.py)."""
    return dict(
        NUM_KV_HEADS=layout.num_kv_heads,
        GROUP=layout.group_size,
        TILE_T=_TILE_T,
        **layout.kernel_constexprs(),
    )


launch_write_int4 = DirectLauncher(_write_kv_int4_kernel)


def write_kv_cache_int4(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_dtype: str = "int4",
    block_size: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    v_format: str = "int8",
) -> None:
    """``write_kv_cache`` for ``int4`` (same arguments; the scales must be None: none are static).

    key, value: [num_tokens, num_kv_heads, head_size] bf16/fp16, any strides. Only the first
    min(len(key), len(value), len(slot_mapping)) tokens are written; negative slots are skipped.
    No host sync and no data-dependent allocation: safe inside CUDA-graph capture (the rotation
    allocates two fp32 [tokens, heads, head_size] temporaries of a shape-determined size).
    """
    _, num_kv_heads, head_size = key.shape
    layout = Int4PageLayout(block_size, num_kv_heads, head_size, kv_dtype)
    check_v_format(kv_dtype, v_format)
    if k_scale is not None or v_scale is not None:
        raise ValueError("int4 has no static scales: k_scale / v_scale must be None")
    if kv_cache.dtype != torch.int8 or kv_cache.stride(1) != 1 or kv_cache.stride(0) % 2:
        raise ValueError("kv_cache must be int8 [num_blocks, page_bytes] with an even block stride")
    num_tokens = min(key.shape[0], value.shape[0], slot_mapping.shape[0])
    if num_tokens == 0:
        return
    k_rot = rotate(key[:num_tokens])  # fp32, contiguous [n, H, D]
    v_rot = rotate(value[:num_tokens])
    launch_write_int4(
        (-(-num_tokens // _TILE_T), num_kv_heads),
        k_rot,
        v_rot,
        kv_cache.view(torch.uint8),
        kv_cache.view(torch.float16),
        slot_mapping,
        num_tokens,
        kv_cache.stride(0),
        **int4_write_constexprs(layout),
        num_warps=4,
    )
