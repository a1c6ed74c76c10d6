"""Plain-torch reference for ``int4``: the specification the int4 kernels are tested against.

Write, per (token, kv-head) vector x of K (or V), D = head_size, G = group size (catalogue):

1. rotate: r = x @ H (hadamard.py; fp32).
2. flag: a vector whose r has any NaN/Inf (an input NaN/Inf, or |x| so large the rotation
   overflows fp32) stores every group as scale = zero = NaN and codes 0, so attention over that
   token is NaN rather than plausible numbers (the same "garbage in, flagged out" as ``int8``).
3. per group of G consecutive elements of r (fp32 arithmetic, IEEE, in this order):
   lo = clamp(min, -65504, 65504), hi = clamp(max, -65504, 65504)
   scale16 = fp16((hi - lo) / 15), zero16 = fp16(lo)
   code = round_half_even(clamp((r - zero16) / scale16, 0, 15)) if scale16 > 0 else 0
   so the dequantized element is exactly code * scale16 + zero16, the value both the kernels and
   this reference use. A constant group (hi == lo) has scale 0, codes 0 and dequantizes to zero16;
   ranges so small that scale16 underflows to 0 do the same. Values beyond fp16 range saturate
   (zero16 = -65504, codes clamp to 0..15): never NaN/Inf for finite inputs.
4. pack: byte i of the token's D/2 bytes = code[i] | code[i + D/2] << 4. K stores them as one
   row per (head, slot); V is key-major: byte i of slot t of head h at v_data + (h*D/2 + i)*B + t.
   The fp16 (scale, zero) pairs follow per (head, slot, group) (page_layout.py, ``Int4PageLayout``).

Attention dequantizes K and V in the rotated basis and rotates them back (K = K_rot @ H), then is
plain attention (``reference.attention_ref``); the kernels instead rotate q and un-rotate the
output, which is the same math.
"""

from __future__ import annotations

import torch

from .cache_write_int4 import FP16_MAX, INT4_LEVELS  # the write kernel's constants
from .hadamard import rotate
from .page_layout import Int4PageLayout


def quantize_int4(r: torch.Tensor, group_size: int):
    """Quantize an already rotated fp32 tensor over its last dim in groups of ``group_size``.

    Returns (codes uint8 [..., D] in 0..15, scale fp16 [..., D/G], zero fp16 [..., D/G]).
    """
    r = r.float()
    finite = r.isfinite().all(dim=-1)
    r = torch.where(finite[..., None], r, 0.0)
    g = r.unflatten(-1, (r.shape[-1] // group_size, group_size))
    lo = g.amin(dim=-1).clamp(-FP16_MAX, FP16_MAX)
    hi = g.amax(dim=-1).clamp(-FP16_MAX, FP16_MAX)
    scale = ((hi - lo) / INT4_LEVELS).to(torch.float16)
    zero = lo.to(torch.float16)
    s = scale.float()[..., None]
    pos = s > 0
    y = (g - zero.float()[..., None]) / torch.where(pos, s, 1.0)
    y = torch.where(pos, y, 0.0)
    codes = torch.round(y.clamp(0.0, INT4_LEVELS)).to(torch.uint8).flatten(-2)
    nan = torch.tensor(torch.nan, dtype=torch.float16, device=r.device)
    flag = finite[..., None]
    return codes, torch.where(flag, scale, nan), torch.where(flag, zero, nan)


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 code * scale + zero per group (still in the rotated basis)."""
    g = codes.shape[-1] // scale.shape[-1]
    c = codes.float().unflatten(-1, (scale.shape[-1], g))
    return (c * scale.float()[..., None] + zero.float()[..., None]).flatten(-2)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] codes -> [..., D/2] bytes: element i in the low nibble, i + D/2 in the high."""
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: [..., D/2] bytes -> [..., D] codes (uint8)."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def _views(kv_cache: torch.Tensor, layout: Int4PageLayout):
    """Views of every page's regions: data uint8 [nb, H, B, D/2], scale/zero fp16 [nb, H, B, NG, 2].

    K and V data are indexed alike, (page, head, slot, byte); V's view is the transpose of its
    key-major storage [nb, H, D/2, B], so writes through it land where page_layout.py says."""
    nb = kv_cache.shape[0]
    h, b = layout.num_kv_heads, layout.block_size
    u8 = kv_cache.view(torch.uint8)
    kd = u8[:, layout.k_data : layout.v_data].view(nb, h, b, layout.row_bytes)
    vd = u8[:, layout.v_data : layout.k_sz].view(nb, h, layout.row_bytes, b).transpose(2, 3)
    ng = layout.num_groups
    ksz = kv_cache[:, layout.k_sz : layout.v_sz].view(torch.float16).view(nb, h, b, ng, 2)
    vsz = kv_cache[:, layout.v_sz : layout.page_bytes].view(torch.float16).view(nb, h, b, ng, 2)
    return kd, vd, ksz, vsz


def write_kv_cache_int4_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    block_size: int,
    kv_dtype: str = "int4",
) -> None:
    """Reference for ``write_kv_cache(kv_dtype="int4")``: rotate, quantize, pack, scatter."""
    layout = Int4PageLayout(block_size, key.shape[1], key.shape[2], kv_dtype)
    n = min(key.shape[0], value.shape[0], slot_mapping.shape[0])
    key, value, slot_mapping = key[:n], value[:n], slot_mapping[:n]
    kd, vd, ksz, vsz = _views(kv_cache, layout)
    keep = slot_mapping >= 0  # negative slots are padding tokens
    slots = slot_mapping[keep].long()
    blk, off = slots // block_size, slots % block_size
    for x, data, sz in ((key, kd, ksz), (value, vd, vsz)):
        # Rotate all n tokens, as the kernel's wrapper does, and drop padding after: cuBLAS picks
        # its fp32 GEMM algorithm (reduction order) by shape, so rotating only the kept rows can
        # differ in the last bit on a GPU and flip a code at a rounding boundary.
        codes, scale, zero = quantize_int4(rotate(x)[keep], layout.group_size)
        # Advanced indices on dims 0 and 2 around a slice: the indexed view is [tokens, H, ...].
        data[blk, :, off] = pack_int4(codes)
        sz[blk, :, off] = torch.stack([scale, zero], dim=-1)


def dequantize_cache_int4(
    kv_cache: torch.Tensor,
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    rotated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 K, V of every slot, [num_blocks, block_size, num_kv_heads, head_size] each, in the
    model's basis (rotated back with H), or in the stored rotated basis with ``rotated=True``."""
    layout = Int4PageLayout(block_size, num_kv_heads, head_size)
    kd, vd, ksz, vsz = _views(kv_cache, layout)
    out = []
    for data, sz in ((kd, ksz), (vd, vsz)):
        x = dequantize_int4(unpack_int4(data), sz[..., 0], sz[..., 1])
        out.append((x if rotated else rotate(x)).transpose(1, 2))
    return out[0], out[1]
