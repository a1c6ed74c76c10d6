"""Arithmetic and stores shared by the quantizing kernels (the int8 and int4 writes, attention's
query split): one definition each, so the formats round and lay out bytes the same way; and the
check of ``int8_static``'s scales every kernel reading them makes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP16_MAX = 65504.0  # largest finite fp16

# Adding then subtracting 1.5 * 2^23 rounds an fp32 of magnitude < 2^22 to the nearest integer,
# ties to even, under IEEE arithmetic. libdevice.rint would do the same on the GPU but does not
# exist in the Triton interpreter the CPU tests run in; callers clamp the values first.
_RINT_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def rint(x):
    return (x + _RINT_MAGIC) - _RINT_MAGIC


@triton.jit
def store_key_major(
    page, head, slot_in_block, valid, tile,
    COLS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_T: tl.constexpr,
):  # fmt: skip
    """Store ``tile`` [TILE_T tokens, COLS bytes] into a key-major region (byte c of slot t of
    ``head`` at ``page + (head*COLS + c)*B + t``: int8 V, int4 V's packed bytes, page_layout.py).

    Flattened [COLS, TILE_T], token fastest: a 1-D store has one order, so neighbouring threads
    take neighbouring tokens (the bytes of consecutive slots share 32-byte sectors) whatever
    Triton's tie-break between the dimensions of a 2-D store whose addresses it cannot prove
    contiguous (it changed between releases). The transpose goes through shared memory; each
    thread then stores single bytes."""
    offs_c = tl.arange(0, COLS)
    addr = (head * COLS + offs_c[:, None]) * BLOCK_SIZE + slot_in_block[None, :]
    flat: tl.constexpr = COLS * TILE_T
    mask = tl.broadcast_to(valid[None, :], (COLS, TILE_T))
    tl.store(
        tl.reshape(page[None, :] + addr, flat),
        tl.reshape(tl.trans(tile), flat),
        mask=tl.reshape(mask, flat),
    )


def check_static_scales(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, num_kv_heads: int, head_size: int
) -> None:
    """``int8_static``'s scales: fp32 [num_kv_heads, head_size], one per (kv-head, channel), on
    the kernels' side read as contiguous rows (a per-head [num_kv_heads] scale would be read past
    its end); a launch with anything else is refused before it reads memory it does not own."""
    if k_scale is None or v_scale is None:
        raise ValueError("int8_static needs k_scale and v_scale")
    expected = (num_kv_heads, head_size)
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if tuple(scale.shape) != expected or scale.dtype != torch.float32:
            raise ValueError(
                f"int8_static's {name} must be fp32 {list(expected)} (kv-heads, channels), "
                f"not {scale.dtype} {list(scale.shape)}"
            )
        if not scale.is_contiguous():
            raise ValueError(f"int8_static's {name} must be contiguous")
