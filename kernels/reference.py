"""Plain-torch reference implementations: the specification the Triton kernels are tested against.

Slow and simple on purpose. Everything is computed in fp32 (fp64 where noted) on whatever device the
inputs live on.
"""

from __future__ import annotations

import torch

# The constants are the write kernel's (cache_write.py owns them): the specification states the
# same range and clamps, and a change there must show up here rather than be copied.
from .cache_write import QMAX, SCALE_MAX, SCALE_MIN
from .e4m3 import check_v_format, e4m3_decode_ref, e4m3_encode_ref
from .page_layout import PageLayout


def quantize_int8(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 over the last dim, one scale per ``group`` channels (None: the whole
    dim): returns (q int8 [..., D], scale fp16 [..., D / group]) (``[...]`` without ``group``).

    scale = clamp(absmax / 127, 2^-24, 65504) over each group, computed in fp32 and rounded to
    fp16; the data is quantized against the *stored* fp16 scale so that q * scale is the
    dequantized value the kernels see: q = round_half_even(clamp(x * (1 / scale), -127, 127)),
    with 1 / scale rounded to fp32 once (one division per group, not per element, in the write
    kernel). A vector with any NaN or +-Inf element is flagged instead: every scale of it NaN, q
    all 0 (so attention over it is NaN, never plausible numbers); other vectors are unaffected.
    """
    xf = x.float()
    finite = xf.isfinite().all(dim=-1)
    xf = torch.where(finite[..., None], xf, 0.0)
    g = xf.shape[-1] if group is None else group
    xg = xf.unflatten(-1, (-1, g))
    absmax = xg.abs().amax(dim=-1)
    scale = (absmax / QMAX).clamp(SCALE_MIN, SCALE_MAX).to(torch.float16)
    inv = 1.0 / scale.float()
    q = torch.round((xg * inv[..., None]).clamp(-QMAX, QMAX)).to(torch.int8).flatten(-2)
    scale = torch.where(finite[..., None], scale, torch.nan)
    return q, scale.squeeze(-1) if group is None else scale


def static_scale(scale: torch.Tensor, head_size: int) -> torch.Tensor:
    """An ``int8_static`` scale as fp32 [H, D]: one per (kv-head, channel). A [H] scale (one per
    kv-head, the form of older calibration files) is the same scale for every channel."""
    s = scale.float()
    return s[:, None].expand(-1, head_size) if s.dim() == 1 else s


def quantize_int8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static symmetric int8 with one fp32 scale per (kv-head, channel) (x: [..., H, D], scale:
    [H, D] or [H] for one per kv-head, > 0).

    No per-token scale can flag a bad value: NaN stores 0, +-Inf saturates at +-127.
    """
    xf = x.float().nan_to_num(nan=0.0, posinf=torch.inf, neginf=-torch.inf)
    # as quantize_int8: x times the fp32 reciprocal of the scale
    inv = 1.0 / static_scale(scale, x.shape[-1])
    return torch.round((xf * inv).clamp(-QMAX, QMAX)).to(torch.int8)


def quantize_e4m3_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static FP8-E4M3FN with one fp32 scale per (kv-head, channel) (or per kv-head, as
    ``quantize_int8_static``): int8 tensor of the codes of x / scale (IEEE division, then round
    half even, saturating at +-448; see e4m3.py)."""
    return e4m3_encode_ref(x.float() / static_scale(scale, x.shape[-1]))


def _views(kv_cache: torch.Tensor, layout: PageLayout):
    """Named views [num_blocks, H, B, D] / [num_blocks, H, B, NG] of the regions of every page (V's
    is a transposed view: its bytes are key-major)."""
    nb = kv_cache.shape[0]
    h, b, d = layout.num_kv_heads, layout.block_size, layout.head_size
    k = kv_cache[:, layout.k_data : layout.v_data].view(nb, h, b, d)
    # V is stored key-major ([H][D][B], page_layout.py): viewed here as [H][B][D] like K
    v = kv_cache[:, layout.v_data : layout.k_scale].view(nb, h, d, b).transpose(2, 3)
    if not layout.has_scales:
        return k, v, None, None
    # stored [H][NG][B] (page_layout.py): viewed [H][B][NG]
    ng = layout.num_groups
    ks = kv_cache[:, layout.k_scale : layout.v_scale].view(torch.float16).view(nb, h, ng, b)
    vs = kv_cache[:, layout.v_scale : layout.page_bytes].view(torch.float16).view(nb, h, ng, b)
    ks, vs = ks.transpose(2, 3), vs.transpose(2, 3)
    return k, v, ks, vs


def write_kv_cache_ref(
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
) -> None:
    """Reference for ``write_kv_cache``: quantize and scatter each token into its slot, in place."""
    layout = PageLayout(kv_dtype, block_size, key.shape[1], key.shape[2])
    v_e4m3 = check_v_format(kv_dtype, v_format)
    kd, vd, ks, vs = _views(kv_cache, layout)
    keep = slot_mapping >= 0  # negative slots are padding tokens
    slots = slot_mapping[keep].long()
    blk, off = slots // block_size, slots % block_size
    key, value = key[keep], value[keep]
    if layout.has_scales:
        qk, sk = quantize_int8(key, layout.group_size)
        qv, sv = quantize_int8(value, layout.group_size)
        ks[blk, :, off] = sk
        vs[blk, :, off] = sv
    else:
        qk = quantize_int8_static(key, k_scale)
        quantize_v = quantize_e4m3_static if v_e4m3 else quantize_int8_static
        qv = quantize_v(value, v_scale)
    # Advanced indices on dims 0 and 2 around a slice: the indexed view is [tokens, H, D].
    kd[blk, :, off] = qk
    vd[blk, :, off] = qv


def dequantize_cache(
    kv_cache: torch.Tensor,
    *,
    kv_dtype: str,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    v_format: str = "int8",
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 K, V of every slot: [num_blocks, block_size, num_kv_heads, head_size] each."""
    layout = PageLayout(kv_dtype, block_size, num_kv_heads, head_size)
    v_e4m3 = check_v_format(kv_dtype, v_format)
    kd, vd, ks, vs = _views(kv_cache, layout)
    if layout.has_scales:
        # each scale times its group's channels
        k = kd.float() * ks.float().repeat_interleave(layout.group_size, dim=-1)
        v = vd.float() * vs.float().repeat_interleave(layout.group_size, dim=-1)
    else:
        # [num_blocks, H, B, D] times each (kv-head, channel)'s scale
        k = kd.float() * static_scale(k_scale, head_size)[None, :, None, :]
        v = e4m3_decode_ref(vd) if v_e4m3 else vd.float()
        v = v * static_scale(v_scale, head_size)[None, :, None, :]
    return k.transpose(1, 2), v.transpose(1, 2)


def attention_ref(
    query: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    readable: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen paged attention in fp64 over explicit K/V slots (any dtype).

    k_slots / v_slots: [num_blocks, block_size, num_kv_heads, head_size] (e.g. from
    ``dequantize_cache``). Query token i of a sequence with q_len new tokens and seq_len in total
    sits at position p = seq_len - q_len + i and sees key j iff j <= p and (no window or
    p - j < sliding_window). Scores s = softmax_scale * q.k, then s = soft_cap * tanh(s / soft_cap).
    ``readable`` [num_seqs]: keys at positions >= readable[s] are not read (int4's slot-less
    tails); a query that sees no key at all gets 0. Returns fp32 [num_tokens, num_q_heads,
    head_size].
    """
    num_tokens, nq, d = query.shape
    block_size, nkv = k_slots.shape[1], k_slots.shape[2]
    group = nq // nkv
    out = torch.zeros(num_tokens, nq, d, dtype=torch.float32, device=query.device)
    qsl = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = qsl[s], qsl[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        nblk = -(-seq_len // block_size)
        blocks = block_table[s, :nblk].long()
        k = k_slots[blocks].reshape(-1, nkv, d)[:seq_len].double()  # [L, nkv, d]
        v = v_slots[blocks].reshape(-1, nkv, d)[:seq_len].double()
        k = k.repeat_interleave(group, dim=1)  # [L, nq, d]
        v = v.repeat_interleave(group, dim=1)
        q = query[q0:q1].double()  # [q_len, nq, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        j = torch.arange(seq_len, device=q.device)[None, :]
        visible = j <= pos
        if sliding_window is not None:
            visible &= (pos - j) < sliding_window
        if readable is not None:
            visible &= j < int(readable[s])
        scores = scores.masked_fill(~visible[None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        if readable is not None:
            p = torch.where(visible.any(-1)[None, :, None], p, 0.0)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v).float()
    return out


def gather_kv_context_ref(
    kv_cache: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    *,
    kv_dtype: str,
    block_size: int,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    v_format: str = "int8",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``gather_kv_context``: per sequence, its first ctx slots dequantized
    (``dequantize_cache``, fp32) and rounded once to the new K/V's dtype, then its new K/V rows."""
    nkv, d = new_key.shape[1], new_key.shape[2]
    k_slots, v_slots = dequantize_cache(kv_cache, kv_dtype=kv_dtype, block_size=block_size,
                                        num_kv_heads=nkv, head_size=d, k_scale=k_scale,
                                        v_scale=v_scale, v_format=v_format)  # fmt: skip
    return context_runs(
        k_slots, v_slots, new_key, new_value, block_size=block_size, block_table=block_table,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
    )  # fmt: skip


def context_runs(
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    *,
    block_size: int,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    readable: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A gather's K, V from fp32 slots [pages, B, H, D]: per sequence (row s of the block table,
    ctx = its cu_seqlens_k run minus its new tokens) its first ctx keys from the slots its row
    names, zero from ``readable[s]`` on, rounded once to the new K/V's dtype, then its new rows."""
    nkv, d = new_key.shape[1], new_key.shape[2]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    keys, values = [], []
    for s in range(len(cq) - 1):
        ctx = (ck[s + 1] - ck[s]) - (cq[s + 1] - cq[s])
        blocks = block_table[s, : -(-ctx // block_size)].long()
        for out, slots, new in ((keys, k_slots, new_key), (values, v_slots, new_value)):
            rows = slots[blocks].reshape(-1, nkv, d)[:ctx]
            if readable is not None:
                seen = (torch.arange(ctx) < int(readable[s])).to(rows.device)
                rows = torch.where(seen[:, None, None], rows, 0.0)
            out.append(rows.to(new.device, new.dtype))
            out.append(new[cq[s] : cq[s + 1]])
    empty = new_key.new_empty(0, nkv, d)
    return torch.cat([empty, *keys]), torch.cat([empty, *values])
