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
slot, valid only when the slot is not new this step and the slot's ``tail_page`` entry for that
page is the page's block. The last page of a sequence stays in the tail, and ``tail_page`` names its
block; a complete last page too when this step quantized it (it began this step, or its earlier
rows were the slot's), so a sequence whose last token completed a page still reads that page
exactly until its next token starts a new one. A complete last page the write left (a full
prefix-cache hit) sets the entry to -1. Attention reads the pages from the cache but the last one,
which it reads from the tail when ``tail_page`` names that page's block or the page is partial
(``int4_kv_slots``).

A tail of one page (``tail`` [slots, 2, H, 64, D], ``tail_page`` [slots]) holds the newest page in
rows 0..63. A tail of two pages (``tail`` [slots, 2, H, 128, D], ``tail_page`` [slots, 2]) holds
the page before it too: page pg lives in half pg % 2 (position p in row p % 128) and
``tail_page[slot, pg % 2]`` names its block. The write keeps the page before the newest the same
way it keeps a complete newest page (quantized this step, or its earlier rows were the slot's),
and also when the step did not touch it and its half still names it; else its entry is -1 (a
new slot: a prefix-cache hit, a resumed request), as is the other half while the sequence has one
page. Attention reads that page from its half too when the entry names its block, so a query reads
its last 65..128 keys exact.

The sink (``write_sink_int4_ref``, ``paged_attention_int4_ref``): a sequence given one keeps its
first page (keys 0..63, the attention-sink tokens) in the model's dtype for good, beside the int4
page 0 the write still quantizes; attention reads those keys from the sink whenever it would read
them from int4 page 0 (page 0 full and not the tail's).
"""

from __future__ import annotations

import torch

from .cache_write_int4 import FP16_MAX, INT4_LEVELS  # the write kernel's constants
from .page_layout import Int4PageLayout
from .reference import attention_ref, context_runs


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


def tail_pages_of(tail: torch.Tensor, block_size: int) -> int:
    """Pages a tail pool holds per slot (1 or 2): [slots, 2, H, 64 * pages, D]."""
    return tail.shape[3] // block_size


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
    pages = tail_pages_of(tail, b)
    held = tail_page.view(tail_page.shape[0], -1)  # [slots, pages]: the block each half holds
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
                h = pg % pages
                if new[r] or int(held[slot, h]) != block:
                    continue  # a full page from the prefix cache: leave it as it is
                rows = tail[slot, :, :, h * b : h * b + old].transpose(1, 2)  # [2, old, H, D]
                k = torch.cat([rows[0], key[q0 : q0 + b - old]])
                v = torch.cat([rows[1], value[q0 : q0 + b - old]])
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
        for pg in range(last - pages + 1, last + 1):  # the newest page last
            h = pg % pages
            if pg < 0:  # a sequence of one page: the other half holds nothing of it
                held[slot, h] = -1
                continue
            p0 = pg * b
            block = int(block_table[r, pg])
            if p0 + b <= seq_len:
                untouched_own = p0 + b <= ctx and not new[r] and int(held[slot, h]) == block
                if (r, pg) not in flushed and not untouched_own:
                    held[slot, h] = -1  # a prefix-cache page: read from the cache
                    continue
            lo = max(ctx, p0)
            t0 = q0 + lo - ctx
            n = min(seq_len, p0 + b) - lo
            if n > 0:
                dst = slice(h * b + lo - p0, h * b + lo - p0 + n)
                tail[slot, 0, :, dst] = key[t0 : t0 + n].transpose(0, 1).to(tail.dtype)
                tail[slot, 1, :, dst] = value[t0 : t0 + n].transpose(0, 1).to(tail.dtype)
            held[slot, h] = block


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


def tail_start(
    seq_len: int, slot: int, table_row: list[int], held: list[int], block_size: int, pages: int
) -> int:
    """The first key a sequence reads from its tail (a page start; ``seq_len`` when none): its
    partial last page; a complete last page whose block its slot's entry names; with a tail of two
    pages, the page before that when its half names its block. ``held``: the slot's entries."""
    b = block_size
    start = (seq_len // b) * b
    if slot < 0:
        return start
    pg = start // b - 1  # the page before start
    if start == seq_len and start > 0 and held[pg % pages] == table_row[pg]:
        start -= b  # a complete newest page the step left in the tail
        pg -= 1
    if pages == 2 and 0 < start < seq_len and held[pg % 2] == table_row[pg]:
        start -= b
    return start


def int4_kv_slots(
    kv_cache: torch.Tensor,
    tail: torch.Tensor,
    *,
    block_size: int,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_of_seq: torch.Tensor,
    tail_page: torch.Tensor,
    sink: torch.Tensor | None = None,
    sink_of_seq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every key as the int4 kernels read it, as fp32 K/V slots [pages, B, H, D] for
    ``reference.attention_ref`` (metadata on any device, read on the CPU): the cache's pages
    dequantized, then, for every page a sequence reads from its tail (``tail_start``), a copy of
    its own holding the tail's rows (exact), which its row of the returned block table names
    instead of the cache's block (a block other rows share keeps its int4 values for them);
    likewise, for a row r with sink_of_seq[r] = s >= 0 whose page 0 is a full page read from the
    cache (not the tail's), a copy of page 0 holding sink[s]. Also the readable key count of each
    sequence: its partial page's rows are none of them when its slot is -1. Returns (k, v,
    block_table, readable)."""
    nkv, d = tail.shape[2], tail.shape[4]
    b = block_size
    pages = tail_pages_of(tail, b)
    k, v = dequantize_cache_int4(kv_cache, block_size=b, num_kv_heads=nkv, head_size=d)
    k_rows, v_rows, total = [k], [v], k.shape[0]
    cpu_table = block_table.cpu()
    table = cpu_table.clone()
    readable = []
    slots = slot_of_seq.tolist()  # may be longer than the batch (padding rows)
    sinks = None if sink is None else sink_of_seq.tolist()
    held = tail_page.view(tail_page.shape[0], -1).tolist()

    def own_copy(r: int, pg: int, kp: torch.Tensor, vp: torch.Tensor) -> None:
        nonlocal total
        k_rows.append(kp[None].to(k.device))
        v_rows.append(vp[None].to(v.device))
        table[r, pg] = total
        total += 1

    for r, seq_len in enumerate(seq_lens.tolist()):
        slot = slots[r]
        readable.append(seq_len if slot >= 0 else (seq_len // b) * b)
        row = cpu_table[r].tolist()
        start = tail_start(seq_len, slot, row, held[slot] if slot >= 0 else [], b, pages)
        for p0 in range(start, seq_len, b) if slot >= 0 else ():
            n = min(seq_len - p0, b)
            rows = tail[slot, :, :, p0 % (pages * b) : p0 % (pages * b) + n].transpose(1, 2)
            kp, vp = k[row[p0 // b]].clone(), v[row[p0 // b]].clone()
            kp[:n], vp[:n] = rows[0].float().to(k.device), rows[1].float().to(k.device)
            own_copy(r, p0 // b, kp, vp)
        if sinks is not None and sinks[r] >= 0 and start > 0:  # page 0 full, not the tail's
            own_copy(r, 0, sink[sinks[r], 0].transpose(0, 1).float(),
                     sink[sinks[r], 1].transpose(0, 1).float())  # fmt: skip
    readable_t = torch.tensor(readable, dtype=torch.int32)
    return torch.cat(k_rows), torch.cat(v_rows), table, readable_t


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
    kernel reads (``int4_kv_slots``: the pages, the tails, the sinks). Returns fp32
    [num_tokens, num_q_heads, head_size] (rows past the batch: 0)."""
    k, v, table, readable = int4_kv_slots(
        kv_cache, tail, block_size=block_size, seq_lens=seq_lens, block_table=block_table,
        slot_of_seq=slot_of_seq, tail_page=tail_page, sink=sink, sink_of_seq=sink_of_seq,
    )  # fmt: skip
    return attention_ref(
        query, k.to(query.device), v.to(query.device), query_start_loc=query_start_loc,
        seq_lens=seq_lens, block_table=table.to(block_table.device), softmax_scale=softmax_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, readable=readable,
    )  # fmt: skip


def gather_kv_context_int4_ref(
    kv_cache: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    *,
    block_size: int,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    tail: torch.Tensor,
    tail_page: torch.Tensor,
    slot_of_seq: torch.Tensor,
    sink: torch.Tensor | None = None,
    sink_of_seq: torch.Tensor | None = None,
    kv_dtype: str = "int4",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``gather_kv_context`` with ``int4``: per sequence (its length cu_seqlens_k's
    run, its ctx = that minus its new tokens), its first ctx keys as the int4 attention reads them
    (``int4_kv_slots``, fp32; keys it cannot read, a slot-less sequence's partial page, are 0)
    rounded once to the new K/V's dtype, then its new K/V rows."""
    del kv_dtype
    ck = cu_seqlens_k.tolist()
    lens = torch.tensor([ck[s + 1] - ck[s] for s in range(len(ck) - 1)], dtype=torch.int32)
    k_slots, v_slots, table, readable = int4_kv_slots(
        kv_cache, tail, block_size=block_size, seq_lens=lens, block_table=block_table,
        slot_of_seq=slot_of_seq, tail_page=tail_page, sink=sink, sink_of_seq=sink_of_seq,
    )  # fmt: skip
    return context_runs(
        k_slots, v_slots, new_key, new_value, block_size=block_size, block_table=table,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, readable=readable,
    )  # fmt: skip
