"""Plain-torch reference for ``int4``: the specification the int4 kernels are tested against.

Quantization (fp32 arithmetic, IEEE, in this order) of a group of values x, 4-bit asymmetric:

    lo = clamp(min x, -65504, 65504), hi = clamp(max x, -65504, 65504)
    scale16 = fp16((hi - lo) / 15), zero16 = fp16(lo)
    code = round_half_even(clamp((x - zero16) / scale16, 0, 15)) if scale16 > 0 else 0

so an element dequantizes to exactly code * scale16 + zero16. A constant group has scale 0 and
dequantizes to zero16; values beyond fp16 range saturate. A group with any NaN/Inf is flagged:
scale = zero = NaN, codes 0, so attention over it is NaN rather than plausible numbers.

* K: the groups are the channels of a page: the 64 values of channel c of one kv-head over the
  page's 64 tokens share one (scale, zero).
* V: the groups are G = min(head_size, 128) consecutive channels of one (token, kv-head); a token
  whose V has any NaN/Inf flags all its groups.
* Packing: byte i of a (token, head) = code[i] | code[i + D/2] << 4 (page_layout.py).

The tail (``write_kv_cache_int4_ref``): a page is quantized when it is complete, from its tokens'
K/V in the model's dtype -- the new ones from key/value, the older ones from the sequence's tail
slot, valid only when the slot is not new this step and ``tail_page[slot]`` is that page's block.
The last page of a sequence stays in the tail, and ``tail_page[slot]`` names its block; a complete
last page too when this step quantized it (it began this step, or its earlier rows were the
slot's), so a sequence whose last token completed a page still reads that page exactly until its
next token starts a new one. A complete last page the write left (a full prefix-cache hit) sets
``tail_page[slot] = -1``. Attention reads the pages from the cache but the last one, which it reads
from the tail when ``tail_page[slot]`` is that page's block or the page is partial
(``int4_kv_slots``).

The sink (``write_sink_int4_ref``, ``paged_attention_int4_ref``): a sequence given one keeps its
first page (keys 0..63, the attention-sink tokens) in the model's dtype for good, beside the int4
page 0 the write still quantizes; attention reads those keys from the sink whenever it would read
them from int4 page 0 (page 0 full and not the tail's).
"""

from __future__ import annotations

import torch

from .cache_write_int4 import FP16_MAX, INT4_LEVELS  # the write kernel's constants
from .page_layout import Int4PageLayout
from .reference import attention_ref


def quantize_int4(x: torch.Tensor, group_size: int):
    """Quantize over the last dim in groups of ``group_size`` (the spec above); a row (the whole
    last dim) with any NaN/Inf flags all its groups.

    Returns (codes uint8 [..., D] in 0..15, scale fp16 [..., D/G], zero fp16 [..., D/G]).
    """
    r = x.float()
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
    """fp32 code * scale + zero per group of the last dim."""
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


def page_views(kv_cache: torch.Tensor, layout: Int4PageLayout):
    """Views of every page's regions: K / V codes uint8 [nb, H, B, D/2] (V's is the transpose of
    its key-major storage), K (scale, zero) fp16 [nb, H, 2, D], V (scale, zero) fp16
    [nb, H, NG, 2, B]; writes through them land where page_layout.py says."""
    nb = kv_cache.shape[0]
    h, b, d, ng = layout.num_kv_heads, layout.block_size, layout.head_size, layout.num_groups
    u8 = kv_cache.view(torch.uint8)
    kd = u8[:, layout.k_data : layout.v_data].view(nb, h, b, layout.row_bytes)
    vd = u8[:, layout.v_data : layout.k_sz].view(nb, h, layout.row_bytes, b).transpose(2, 3)
    ksz = kv_cache[:, layout.k_sz : layout.v_sz].view(torch.float16).view(nb, h, 2, d)
    vsz = kv_cache[:, layout.v_sz : layout.page_bytes].view(torch.float16).view(nb, h, ng, 2, b)
    return kd, vd, ksz, vsz


def quantize_page(layout: Int4PageLayout, k: torch.Tensor, v: torch.Tensor):
    """One complete page's K and V [B, H, D] (any float dtype) -> the regions of its page:
    (K codes [H, B, D/2], V codes [H, B, D/2], K sz [H, 2, D], V sz [H, NG, 2, B])."""
    kc, ks, kz = quantize_int4(
        k.float().permute(1, 2, 0), layout.block_size
    )  # [H, D, B], [H, D, 1]
    vc, vs, vz = quantize_int4(
        v.float().transpose(0, 1), layout.group_size
    )  # [H, B, D], [H, B, NG]
    k_codes = pack_int4(kc.transpose(1, 2))
    v_codes = pack_int4(vc)
    k_sz = torch.stack([ks[..., 0], kz[..., 0]], dim=1)
    v_sz = torch.stack([vs, vz], dim=-1).permute(0, 2, 3, 1)  # [H, NG, 2, B]
    return k_codes, v_codes, k_sz, v_sz


def write_kv_cache_int4_ref(
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
    max_query_len: int | None = None,
    kv_dtype: str = "int4",
) -> None:
    """Reference for ``write_kv_cache_int4``: in place on kv_cache, tail and tail_page."""
    del max_query_len  # only sizes the kernel's launch
    layout = Int4PageLayout(block_size, key.shape[1], key.shape[2], kv_dtype)
    kd, vd, ksz, vsz = page_views(kv_cache, layout)
    b = block_size
    qsl = query_start_loc.tolist()
    lens, slots, new = seq_lens.tolist(), slot_of_seq.tolist(), slot_is_new.tolist()
    # every complete page first (reading the tail as it was), then the tails
    flushed = set()  # (row, page) pairs quantized this step
    for r in range(num_seqs):
        q0, q1, seq_len, slot = qsl[r], qsl[r + 1], lens[r], slots[r]
        ctx = seq_len - (q1 - q0)
        if q1 <= q0 or slot < 0:  # no request: nothing written
            continue
        for pg in range(ctx // b, (seq_len - 1) // b + 1):
            p0 = pg * b
            if p0 + b > seq_len:
                continue
            block = int(block_table[r, pg])
            old = max(0, ctx - p0)  # rows of the page written by earlier steps
            if old:
                if new[r] or int(tail_page[slot]) != block:
                    continue  # a full page from the prefix cache: leave it as it is
                k = torch.cat([tail[slot, 0, :, :old].transpose(0, 1), key[q0 : q0 + b - old]])
                v = torch.cat([tail[slot, 1, :, :old].transpose(0, 1), value[q0 : q0 + b - old]])
            else:
                t0 = q0 + p0 - ctx
                k, v = key[t0 : t0 + b], value[t0 : t0 + b]
            kd[block], vd[block], ksz[block], vsz[block] = quantize_page(layout, k, v)
            flushed.add((r, pg))
    for r in range(num_seqs):
        q0, q1, seq_len, slot = qsl[r], qsl[r + 1], lens[r], slots[r]
        if q1 <= q0 or slot < 0:
            continue
        ctx = seq_len - (q1 - q0)
        last = (seq_len - 1) // b
        if seq_len % b == 0 and (r, last) not in flushed:
            tail_page[slot] = -1  # a prefix-cache page: read from the cache
            continue
        p0 = last * b
        lo = max(ctx, p0)
        t0 = q0 + lo - ctx
        n = seq_len - lo
        tail[slot, 0, :, lo - p0 : lo - p0 + n] = key[t0 : t0 + n].transpose(0, 1).to(tail.dtype)
        tail[slot, 1, :, lo - p0 : lo - p0 + n] = value[t0 : t0 + n].transpose(0, 1).to(tail.dtype)
        tail_page[slot] = int(block_table[r, last])


def write_sink_int4_ref(
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
    """Reference for ``write_sink_int4``, in place on ``sink``: for each row r < num_seqs with
    s = sink_of_seq[r] >= 0, its new token at position p < block_size goes to sink[s, 0, :, p]
    (K) and sink[s, 1, :, p] (V), converted to sink's dtype; nothing else is written."""
    del kv_dtype
    qsl, lens, sinks = query_start_loc.tolist(), seq_lens.tolist(), sink_of_seq.tolist()
    for r in range(num_seqs):
        q0, q1, s = qsl[r], qsl[r + 1], sinks[r]
        ctx = lens[r] - (q1 - q0)
        if s < 0 or q1 <= q0 or ctx >= block_size:
            continue
        n = min(lens[r], block_size) - ctx
        sink[s, 0, :, ctx : ctx + n] = key[q0 : q0 + n].transpose(0, 1).to(sink.dtype)
        sink[s, 1, :, ctx : ctx + n] = value[q0 : q0 + n].transpose(0, 1).to(sink.dtype)


def dequantize_cache_int4(
    kv_cache: torch.Tensor, *, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 K, V of every slot of every page: [num_blocks, block_size, num_kv_heads, head_size]."""
    layout = Int4PageLayout(block_size, num_kv_heads, head_size)
    kd, vd, ksz, vsz = page_views(kv_cache, layout)
    kc = unpack_int4(kd).float()  # [nb, H, B, D]
    k = kc * ksz[:, :, None, 0].float() + ksz[:, :, None, 1].float()
    scale = vsz[:, :, :, 0].float().permute(0, 1, 3, 2)  # [nb, H, B, NG]
    zero = vsz[:, :, :, 1].float().permute(0, 1, 3, 2)
    v = dequantize_int4(unpack_int4(vd), scale, zero)
    return k.transpose(1, 2), v.transpose(1, 2)


def int4_kv_slots(
    kv_cache: torch.Tensor,
    tail: torch.Tensor,
    *,
    block_size: int,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_of_seq: torch.Tensor,
    tail_page: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What attention reads, as fp32 K/V slots [num_blocks, B, H, D] for ``reference.attention_ref``
    plus the readable key count of each sequence: its pages dequantized, but its last page's rows
    from ``tail[slot_of_seq[r]]`` (exact) when that page is partial or is the block
    ``tail_page[slot]`` names; a partial page's rows are none of them when the slot is -1.

    Each sequence's last page read from the tail must be a block of its own (as vLLM allocates
    them: a block another sequence shares is complete and held by no tail this step)."""
    nkv, d = tail.shape[2], tail.shape[4]
    k, v = dequantize_cache_int4(kv_cache, block_size=block_size, num_kv_heads=nkv, head_size=d)
    readable = []
    slots = slot_of_seq.tolist()  # may be longer than the batch (padding rows)
    holders = tail_page.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        slot = slots[r]
        full, n = (seq_len // block_size) * block_size, seq_len % block_size
        readable.append(seq_len if slot >= 0 else full)
        if not n and slot >= 0 and seq_len:
            block = int(block_table[r, full // block_size - 1])
            if holders[slot] == block:  # a page completed by the last step: still in the tail
                k[block] = tail[slot, 0].transpose(0, 1).float()
                v[block] = tail[slot, 1].transpose(0, 1).float()
        if n and slot >= 0:
            block = int(block_table[r, full // block_size])
            k[block, :n] = tail[slot, 0, :, :n].transpose(0, 1).float()
            v[block, :n] = tail[slot, 1, :, :n].transpose(0, 1).float()
    return k, v, torch.tensor(readable, dtype=torch.int32)


def paged_attention_int4_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    block_size: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    tail: torch.Tensor,
    tail_page: torch.Tensor,
    slot_of_seq: torch.Tensor,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sink: torch.Tensor | None = None,
    sink_of_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for ``paged_attention_int4``: ``reference.attention_ref`` (fp64) over what the
    kernel reads (``int4_kv_slots``), and, for a row r with sink_of_seq[r] = s >= 0 whose page 0
    is a full page read from the cache (not the tail's), keys 0..63 from sink[s] instead (the
    row's own copy of page 0: a block other rows share keeps its int4 values for them). Returns
    fp32 [num_tokens, num_q_heads, head_size] (rows past the batch: 0)."""
    k, v, readable = int4_kv_slots(
        kv_cache, tail, block_size=block_size, seq_lens=seq_lens.cpu(),
        block_table=block_table.cpu(), slot_of_seq=slot_of_seq.cpu(), tail_page=tail_page.cpu(),
    )  # fmt: skip
    table = block_table.clone()
    if sink is not None:
        sinks, slots, holders = sink_of_seq.tolist(), slot_of_seq.tolist(), tail_page.tolist()
        k_rows, v_rows = [k], [v]
        for r, seq_len in enumerate(seq_lens.tolist()):
            full = (seq_len // block_size) * block_size
            held = (
                full == seq_len
                and full
                and slots[r] >= 0
                and holders[slots[r]] == int(block_table[r, full // block_size - 1])
            )
            if sinks[r] < 0 or full - (block_size if held else 0) <= 0:
                continue  # no sink, or page 0 is partial or the tail's
            table[r, 0] = sum(x.shape[0] for x in k_rows)
            k_rows.append(sink[sinks[r], 0].transpose(0, 1)[None].float().to(k.device))
            v_rows.append(sink[sinks[r], 1].transpose(0, 1)[None].float().to(v.device))
        k, v = torch.cat(k_rows), torch.cat(v_rows)
    return attention_ref(
        query, k.to(query.device), v.to(query.device), query_start_loc=query_start_loc,
        seq_lens=seq_lens, block_table=table, softmax_scale=softmax_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, readable=readable,
    )  # fmt: skip
