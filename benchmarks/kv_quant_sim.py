"""Perplexity with simulated KV-cache quantization (Hugging Face model, our torch references).

Answers design questions of the ``int4`` format that do not need vLLM or a GPU: how much
the Hadamard rotation, KVarN-style variance normalization, BF16 "sink" tokens and the group size
change ΔPPL. Every K and V vector (after RoPE, per token and kv-head) is quantized and dequantized
with the same torch references the kernels are tested against (``int8kv_kernels.reference`` and
``reference_int4``) before attention, i.e. every token is read back from the cache, as with
``INT8KV_PREFILL=triton``. Attention itself is PyTorch's SDPA, so this measures the storage
format, not our kernels' arithmetic: ``benchmarks/accuracy.py`` is the measurement through vLLM.

Variance normalization here is an *oracle*: per (layer, kv-head, channel) root-mean-square of the
rotated vectors over the very window being scored, divided out before quantization and multiplied
back after (the factors would fold into q for K and into the output for V). A calibration-free
implementation could only do worse, so if the oracle does not lower ΔPPL measurably, the real
thing is not worth building.

KIVI-style rows (``int4_k_per_channel_b<B>``; Liu et al. 2024, "KIVI") quantize K per *channel*
rather than per token: one fp16 (scale, zero) per (page of B consecutive tokens, kv-head, channel)
over those B tokens' values of the channel, asymmetric 4-bit; V stays as in ``int4``. Statistics
are those of each full page of the sequence (the last, partial page over the tokens it has), so a
token is quantized with statistics of tokens after it in its page: a real cache would keep the most
recent, partial page in higher precision (KIVI's full-precision residual) and quantize it once
full. That residual is at most B BF16 tokens per sequence, negligible per token at long context,
and is not counted in the bytes.

Sink rows (``..._sinks<N>``) keep the first N tokens of every window in BF16, K and V (KVarN's
"sink" tokens; with N = the page size, the first page). Like the residual they are a fixed count
per sequence and are not counted in the bytes.

Tail rows (``int4_tail_v_g<G>...``) simulate the rebuilt ``int4`` (the format of the int4
contract): K per (64-token page, kv-head, channel), V per (token, kv-head, group of G channels),
both asymmetric 4-bit without rotation (``g<G>`` = 32, 64, 128 or ``gD``: one group of the whole
head), and each sequence's newest, unfinished page in BF16. A query at position i reads the keys
and values of its own page (i // 64) unquantized, except at the page's last position
(i % 64 == 63: in decode the page is full by then, and the write quantizes it before attention
reads it), and those of every earlier page quantized, which is what decode does; a prefill chunk
reading the pages back (``INT8KV_PREFILL=triton``) does the same for keys before the chunk. Their
sink rows keep the first page in BF16 (``_sinks64``) or per-token int8 (``_sinks64_int8``) for
every query. The tail (at most 64 BF16 tokens per sequence and kv-head) and the sink page are a
fixed count per sequence and are not counted in the bytes; ``int4_no_tail_v_g<G>`` is the same
format with every token read back quantized, ``int4_tail_full_v_g<G>`` the same with the own page
read unquantized at its last position too (the tail keeps a page its step completed, as ``int4``
does since 2026-12-04), ``int4_tail_full_v_g<G>_sinks64`` that one with its first page in BF16
(``INT8KV_INT4_SINK_PAGE=1``). ``tail_attention`` also takes fewer queries than keys (the last
positions', as a decode step with a KV cache: ``benchmarks/kv_quant_greedy.py``).
Rows ending ``_pages<N>`` keep a longer tail, not built: a query reads its own page and the N - 1
pages before it in BF16 (each full one also quantized into the cache when it filled, as now, but
its BF16 copy kept until N pages later: a tail pool of N pages per sequence and kv-head).

Tail rows with ``_varnorm`` normalize each K page tile (64 tokens x D channels of one kv-head)
before its 4-bit quantization, Sinkhorn-style as KVarN does: ``VARNORM_ITERS`` times, divide every
token (row) by its root-mean-square over the channels, then every channel (column) by its
root-mean-square over the tokens. The normalized tile is quantized per channel as in the plain
row; the per-channel factors fold into the channel's fp16 (scale, zero) (stored folded, so they
cost nothing), the per-token factors cannot and are one more fp16 per (token, kv-head): 2 bytes,
counted in the bytes column. A token that is large in every channel (as attention sinks' keys are)
no longer sets every channel's range in its page. V is unchanged: its groups are per token, so a
per-token factor is already absorbed by its scale.

Tail rows with ``_first_page_k_per_token_g<G>`` quantize K's first page (the window's first 64
tokens) per token in groups of G channels (``gD``: the whole head), as V is, instead of per
channel: the sink token no longer sets the other keys' ranges there, and the page's per-token
(scale, zero) pairs take the bytes of its per-channel ones (at most, with G = 64), so the bytes
column does not change.

Static rows (``int8_static``, ``int8_static_channel``) are the ``int8_static`` cache: int8 codes
with no per-token scale, K and V each multiplied back by a fixed fp32 scale per (layer, kv-head)
(``int8_static``, the format of per-head calibration files) or per (layer, kv-head, channel)
(``int8_static_channel``), quantized by ``reference.quantize_int8_static``. The scales are
calibrated as ``int8kv calibrate`` does it: absmax of |K| and |V| as attention receives them
(after RoPE, what the cache is written) over the package's calibration text
(``int8kv_shim/static/calibration_data/``, windows planned by ``int8kv_shim.static.cli``, each led
by the BOS), never over the scored corpus; scale = absmax / 127. Their bytes are K and V's int8
codes only: the scales live outside the pages.

Every window starts with the model's BOS when its tokenizer adds one (Gemma 3: ``<bos>``; without
it a chunk cut from the corpus scores about twice the perplexity), as in ``benchmarks/accuracy.py``;
SmolLM2's tokenizer adds none. Sliding-window layers (Gemma 3) get their sliding mask: the
attention function is registered with transformers' SDPA mask builder under its own name.

    python -m benchmarks.kv_quant_sim --model /path/to/SmolLM2-135M-Instruct   # CPU is fine
    python -m benchmarks.kv_quant_sim --model /path/to/gemma3-270m --model-name "Gemma 3 270M" \
        --windows 5 --variants bf16,int8,int4 --out benchmarks/results/kv_quant_sim_gemma3.json

Writes ``--out`` (default ``benchmarks/results/kv_quant_sim.json``) through ``common.write_json``:
``{"gpu", "model", "corpus", "tokens", "window", "bos", "device", "command", "seconds", "rows":
[{"variant", "ppl", "delta_pct", "delta_se_pct", "kv_bytes_per_token_head",
"capacity_vs_bf16", "top1_agreement", "kl_mean"}]}`` plus its date and commit (K + V bytes;
ΔPPL vs the first variant, the unquantized ``bf16``; its standard error from the per-window
differences). ``top1_agreement`` and ``kl_mean`` compare every scored position's next-token
distribution with ``bf16``'s on the same window: the fraction whose argmax is the same, and the
mean KL(P_bf16 || Q) in nats over the full vocabulary (greedy decoding diverges at the first
position whose argmax differs, so top-1 agreement is the simulator's proxy for greedy agreement).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from benchmarks import common
from int8kv_kernels.reference import quantize_int8, quantize_int8_static
from int8kv_kernels.reference_int4 import dequantize_int4, quantize_int4
from int8kv_shim.static import cli as calibrate_cli
from int8kv_shim.static.file import K_QMAX, MIN_STAT

SINK_TOKENS = 4
# Sinkhorn rounds of the K tile normalization: rows' and columns' RMS are near 1 after a few
VARNORM_ITERS = 4
# the rebuilt int4's page: the catalogue's page_tokens, and the BF16 tail's length
TAIL_PAGE = 64


def hadamard(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized D x D Sylvester-Hadamard matrix (symmetric, orthogonal): the rotation the
    earlier int4 format applied, kept here for its simulated rows."""
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * d**-0.5


@dataclass(frozen=True)
class Variant:
    name: str
    bits: int  # 16: unquantized
    k_bits: int | None = None  # K's bits when they differ from V's (``bits``)
    # K-only experiments (V stays as ``bits``/``group``): "mean" subtracts the per (kv-head,
    # channel) mean over the window before quantizing (an oracle; softmax is invariant to a
    # vector subtracted from every key, so nothing is added back), "clip" shrinks each group's
    # range to CLIP of its min..max around its middle, "sym" stores symmetric codes (one fp16
    # scale, no zero point) in groups of half the size: the same bytes as asymmetric ``group``,
    # "channel" quantizes per channel over pages of ``k_page`` tokens (KIVI-style, see above).
    k_mode: str = ""
    k_page: int = 0
    k_rotate: bool | None = None  # K's rotation when it differs from V's (``rotate``)
    group: int = 64  # 0: one group of the whole head
    rotate: bool = True
    var_norm: bool = False
    sinks: int = 0
    sink_bits: int = 16  # the sinks' storage: 16 (BF16, unquantized) or 8 (per-token int8)
    tail: bool = False  # the query's own, unfinished page of TAIL_PAGE tokens read unquantized
    tail_full: bool = False  # ... and its own page at its last position too (reads_tail)
    tail_pages: int = 1  # pages of the tail: the query's own and the tail_pages - 1 before it
    group8: int = 0  # 8-bit: channels per fp16 scale (0: the whole head, as int8)
    k_varnorm: bool = False  # K page tiles normalized per token and channel (see above)
    # K's first page per token instead of per channel, in groups of this many channels (0: the
    # whole head; None: per channel like every page), see above
    first_page_k_group: int | None = None
    # 8-bit with calibrated static scales: "head" one per (layer, kv-head), "channel" one per
    # (layer, kv-head, channel); no per-token scale
    static: str = ""

    def for_k(self) -> Variant:
        """The variant K is stored with."""
        return replace(
            self,
            bits=self.bits if self.k_bits is None else self.k_bits,
            rotate=self.rotate if self.k_rotate is None else self.k_rotate,
            k_bits=None,
            k_rotate=None,
        )

    def bytes_per_token_head(self, d: int) -> float:
        """Bytes of one (token, kv-head) K + V pair in the page (scales included)."""
        if self.static:  # int8 codes only: the static scales are not in the pages
            return 2.0 * d
        if self.k_mode == "channel":  # nibbles + fp16 (scale, zero) per channel per page of tokens
            k = d / 2 + 4.0 * d / self.k_page + (2.0 if self.k_varnorm else 0.0)
        else:
            k = _bytes(self.for_k().bits, self.group, d, self.group8)
        return k + _bytes(self.bits, self.group, d, self.group8)


def _group(group: int, d: int) -> int:
    return d if group == 0 else min(group, d)


def _bytes(bits: int, group: int, d: int, group8: int = 0) -> float:
    if bits == 16:
        return 2.0 * d
    if bits == 8:
        return d + 2.0 * (d // _group(group8, d))  # int8 data + an fp16 scale per group
    return d / 2 + 4.0 * (d // _group(group, d))  # nibbles + fp16 (scale, zero) per group


def _tail_variant(
    group: int,
    sinks: int = 0,
    sink_bits: int = 16,
    k_varnorm: bool = False,
    first_page_k_group: int | None = None,
    tail_full: bool = False,
    tail_pages: int = 1,
) -> Variant:
    """The rebuilt int4: K per (64-token page, channel), V per (token, ``group``), no rotation,
    BF16 tail; ``sinks`` first tokens kept in ``sink_bits``; ``k_varnorm``: K tiles normalized;
    ``first_page_k_group``: K's first page per token, in groups of that many channels;
    ``tail_full``: the tail keeps the page its step completed (``reads_tail``'s ``full_page``);
    ``tail_pages``: the tail's pages, the query's own and those before it (``reads_tail``)."""
    name = f"int4_tail{'_full' if tail_full else ''}_v_g{group or 'D'}"
    if sinks:
        name += f"_sinks{sinks}" + ("" if sink_bits == 16 else f"_int{sink_bits}")
    if k_varnorm:
        name += "_varnorm"
    if first_page_k_group is not None:
        name += f"_first_page_k_per_token_g{first_page_k_group or 'D'}"
    if tail_pages != 1:
        name += f"_pages{tail_pages}"
    return Variant(
        name,
        4,
        k_mode="channel",
        k_page=TAIL_PAGE,
        group=group,
        rotate=False,
        sinks=sinks,
        sink_bits=sink_bits,
        tail=True,
        k_varnorm=k_varnorm,
        first_page_k_group=first_page_k_group,
        tail_full=tail_full,
        tail_pages=tail_pages,
    )


TAIL_GROUPS = (32, 64, 128, 0)


VARIANTS = [
    Variant("bf16", 16),
    Variant("int8", 8),
    # int8 with a scale per group of channels instead of per token and head
    *(Variant(f"int8_g{g}", 8, group8=g) for g in (128, 64, 32)),
    # int8 with calibrated static scales per (layer, kv-head), then per (layer, kv-head, channel)
    Variant("int8_static", 8, static="head"),
    Variant("int8_static_channel", 8, static="channel"),
    Variant("int4", 4),
    Variant("int4_no_rotation", 4, rotate=False),
    Variant("int4_var_norm_oracle", 4, var_norm=True),
    Variant(f"int4_sinks{SINK_TOKENS}", 4, sinks=SINK_TOKENS),
    Variant("int4_group32", 4, group=32),
    Variant("k8_v4", 4, k_bits=8),
    Variant("k4_v8", 8, k_bits=4),
    Variant("int4_k_mean_oracle", 4, k_mode="mean"),
    Variant("int4_k_clip", 4, k_mode="clip"),
    Variant("int4_k_sym_half_groups", 4, k_mode="sym"),
    *(
        Variant(f"int4_k_per_channel_b{b}{suffix}", 4, k_mode="channel", k_page=b, k_rotate=rot)
        for b in (16, 32, 64)
        for suffix, rot in (("", True), ("_no_rotation", False))
    ),
    # the candidate K format with its first page (the sink tokens) in BF16
    Variant(
        "int4_k_per_channel_b64_no_rotation_sinks64",
        4,
        k_mode="channel",
        k_page=64,
        k_rotate=False,
        sinks=64,
    ),
    # the rebuilt int4 (K per 64-token page and channel, V per token and G channels, no
    # rotation) with every token quantized, then with the BF16 tail, its sink pages on top
    *(replace(_tail_variant(g), name=f"int4_no_tail_v_g{g or 'D'}", tail=False) for g in (128, 0)),
    *(_tail_variant(g) for g in TAIL_GROUPS),
    *(_tail_variant(g, tail_full=True) for g in (128, 0)),
    *(_tail_variant(g, TAIL_PAGE, bits) for g in TAIL_GROUPS for bits in (16, 8)),
    *(_tail_variant(g, k_varnorm=True) for g in TAIL_GROUPS),
    *(_tail_variant(g, first_page_k_group=fg) for g in TAIL_GROUPS for fg in (0, 64)),
    # today's int4 (the catalogue's V groups: the whole head up to 128 channels, 128 above) with
    # its BF16 sink page (INT8KV_INT4_SINK_PAGE=1)
    *(_tail_variant(g, TAIL_PAGE, tail_full=True) for g in (128, 0)),
    # ... and a longer tail: the last two or four pages in BF16, with and without the sink page
    *(
        _tail_variant(g, sinks, tail_full=True, tail_pages=n)
        for g in (128, 0)
        for n in (2, 4)
        for sinks in (0, TAIL_PAGE)
    ),
]
CLIP = 0.85


def fake_quant(
    x: torch.Tensor, v: Variant, k_mode: str = "", static_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """x [batch, kv_heads, tokens, D] -> the values attention would read back from the cache
    (``static_scale`` [kv_heads, D] fp32: the static variants' calibrated scale)."""
    if v.bits == 16:
        return x
    xf = x.float()
    if k_mode == "mean":
        xf = xf - xf.mean(dim=-2, keepdim=True)
    if v.static:
        if static_scale is None:
            raise ValueError(f"{v.name} needs its calibrated static scale")
        # the reference takes [..., kv_heads, D]
        q = quantize_int8_static(xf.transpose(1, 2), static_scale)
        out = (q.float() * static_scale.float()).transpose(1, 2)
    elif v.bits == 8:
        g = _group(v.group8, x.shape[-1])
        q, scale = quantize_int8(xf.unflatten(-1, (-1, g)))
        out = (q.float() * scale.float()[..., None]).flatten(-2)
    else:
        d = x.shape[-1]
        h = hadamard(d, x.device) if v.rotate else torch.eye(d, device=x.device)
        r = xf @ h
        norm = None
        if v.var_norm:  # oracle: per (kv-head, channel) RMS over this window's tokens
            norm = r.pow(2).mean(dim=-2, keepdim=True).sqrt().clamp_min(1e-6)
            r = r / norm
        group = _group(v.group, d)
        if k_mode == "sym":
            r = _symmetric_int4(r, group // 2)
        elif k_mode == "channel":
            first = r[..., : v.k_page, :]
            r = _per_channel_int4(r, v.k_page, v.k_varnorm)
            if v.first_page_k_group is not None:
                codes, scale, zero = quantize_int4(first, _group(v.first_page_k_group, d))
                r[..., : v.k_page, :] = dequantize_int4(codes, scale, zero)
        else:
            if k_mode == "clip":
                r = _clip_groups(r, group)
            codes, scale, zero = quantize_int4(r, group)
            r = dequantize_int4(codes, scale, zero)
        if norm is not None:
            r = r * norm
        out = r @ h.T
    if v.sinks:
        sink = x.float()[..., : v.sinks, :]
        if v.sink_bits == 8:
            q, scale = quantize_int8(sink)
            sink = q.float() * scale.float()[..., None]
        out[..., : v.sinks, :] = sink
    return out.to(x.dtype)


def reads_tail(
    tokens: int,
    device: torch.device | str = "cpu",
    full_page: bool = False,
    queries: int | None = None,
    pages: int = 1,
) -> torch.Tensor:
    """[query, key] True where the query reads the key from the BF16 tail: keys of the query's
    own page, unless the query is that page's last token (the page is full and quantized) and
    not ``full_page`` (the tail keeps the page its step completed), and those of the ``pages`` - 1
    pages before it (a longer tail). The queries are the last ``queries`` of the ``tokens``
    positions (all of them by default; 1 for a decode step)."""
    first = tokens - (tokens if queries is None else queries)
    query_pos = torch.arange(first, tokens, device=device)[:, None]
    i, j = query_pos // TAIL_PAGE, torch.arange(tokens, device=device)[None, :] // TAIL_PAGE
    last = (query_pos % TAIL_PAGE == TAIL_PAGE - 1) & (not full_page)
    return ((i == j) & ~last) | ((j < i) & (j > i - pages))


def tail_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_q: torch.Tensor,
    value_q: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    full_page: bool = False,
    pages: int = 1,
) -> torch.Tensor:
    """Attention of queries [batch, heads, q, D] over keys [batch, kv_heads, t, D] (q <= t: the
    queries are the last q positions, as a decode step or a prefill after a KV cache's earlier
    tokens) in which each (query, key) pair reads the key and value unquantized (``key``,
    ``value``) where ``reads_tail`` says so (with ``full_page`` and ``pages``) and quantized (``key_q``, ``value_q``) elsewhere;
    ``attention_mask`` is transformers' boolean SDPA mask [.., q, t] (True: attend) or None for
    plain causal. Returns [batch, q, heads, D].

    Both versions of every key go into one SDPA call, each masked where the pair reads the other:
    one softmax over exactly the keys the query reads, with SDPA's arithmetic as the other rows."""
    q, t = query.shape[-2], key.shape[-2]
    if q > t:
        raise ValueError(f"{q} queries over {t} keys: the queries must be the last keys' positions")
    if attention_mask is None:
        allowed = torch.ones(q, t, dtype=torch.bool, device=query.device).tril(t - q)
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        raise ValueError(f"expected a boolean SDPA mask, got {attention_mask.dtype}")
    tail = reads_tail(t, query.device, full_page, queries=q, pages=pages)
    mask = torch.cat([allowed & ~tail, allowed & tail], dim=-1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        torch.cat([key_q, key], dim=-2),
        torch.cat([value_q, value], dim=-2),
        attn_mask=mask,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous()


def _clip_groups(r: torch.Tensor, group: int) -> torch.Tensor:
    """Clamp each group to CLIP of its min..max range, around the range's middle."""
    g = r.unflatten(-1, (r.shape[-1] // group, group))
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    mid, half = (hi + lo) / 2, (hi - lo) / 2 * CLIP
    return torch.minimum(torch.maximum(g, mid - half), mid + half).flatten(-2)


def varnorm_factors(tile: torch.Tensor, iters: int = VARNORM_ITERS):
    """Sinkhorn-style factors of tiles [..., tokens, D]: (row [..., tokens, 1], col [..., 1, D]),
    fp16 values (as they would be stored) such that ``tile / (row * col)`` has rows and columns
    of root-mean-square near 1. Each round divides the rows by their RMS over the channels, then
    the columns by theirs over the tokens: Sinkhorn-Knopp on the squared tile, which converges
    (the std about the mean does not settle on both axes when the channels have offsets, as K's
    do). An all-zero row or column keeps its factor; factors stay within fp16's normal range, so
    none rounds to zero when stored."""

    def rms(y: torch.Tensor, dim: int) -> torch.Tensor:
        s = y.pow(2).mean(dim=dim, keepdim=True).sqrt()
        return torch.where(s > 0, s, 1.0)

    x = tile.float()
    row = torch.ones_like(x[..., :1])
    col = torch.ones_like(x[..., :1, :])
    for _ in range(iters):
        row = (row * rms(x / (row * col), -1)).clamp(2.0**-14, 2.0**15)
        col = (col * rms(x / (row * col), -2)).clamp(2.0**-14, 2.0**15)
    return row.to(torch.float16).float(), col.to(torch.float16).float()


def varnorm_int4(pages: torch.Tensor, quantize: bool = True) -> torch.Tensor:
    """K page tiles [..., tokens, D] normalized (``varnorm_factors``), quantized 4-bit per channel
    over the tile's tokens, dequantized with the column factors folded into the fp16 (scale, zero)
    and the row factors multiplied back: what attention would read. ``quantize=False`` skips the
    4-bit step, leaving only the normalization and its inverse."""
    row, col = varnorm_factors(pages)
    n = pages.float() / (row * col)
    if not quantize:
        return n * col * row
    codes, scale, zero = quantize_int4(n.transpose(-1, -2).contiguous(), n.shape[-2])
    c = col.transpose(-1, -2)  # [..., D, 1]: one per channel, as the (scale, zero) groups
    scale, zero = (scale.float() * c).to(torch.float16), (zero.float() * c).to(torch.float16)
    return dequantize_int4(codes, scale, zero).transpose(-1, -2) * row


def _per_channel_int4(r: torch.Tensor, page: int, varnorm: bool = False) -> torch.Tensor:
    """Asymmetric 4-bit per (page of ``page`` consecutive tokens, channel), dequantized.

    r [..., tokens, D]: the reference's groups run along the last dim, so each page is transposed
    to [..., D, page] and quantized with one group per channel; a last, partial page is one group
    of the tokens it has. ``varnorm``: each page tile normalized first (``varnorm_int4``).
    """
    t = r.shape[-2]
    full = t - t % page
    parts = []
    for chunk, size in ((r[..., :full, :], page), (r[..., full:, :], t - full)):
        if chunk.shape[-2] == 0:
            continue
        pages = chunk.unflatten(-2, (chunk.shape[-2] // size, size))
        if varnorm:
            parts.append(varnorm_int4(pages).flatten(-3, -2))
            continue
        pages = pages.transpose(-1, -2)
        codes, scale, zero = quantize_int4(pages.contiguous(), size)
        parts.append(dequantize_int4(codes, scale, zero).transpose(-1, -2).flatten(-3, -2))
    return torch.cat(parts, dim=-2)


def _symmetric_int4(r: torch.Tensor, group: int) -> torch.Tensor:
    """Symmetric 4-bit (codes -7..7, fp16 scale = absmax / 7) per group, dequantized."""
    g = r.unflatten(-1, (r.shape[-1] // group, group))
    scale = (g.abs().amax(-1, keepdim=True) / 7).to(torch.float16).float().clamp_min(2.0**-24)
    return (torch.round(g / scale).clamp(-7, 7) * scale).flatten(-2)


@dataclass
class StaticCalibration:
    """Per layer, absmax of |K| and |V| per (kv-head, channel) [H, D] as attention receives them,
    recorded while ``recording`` (what ``int8kv calibrate``'s recorder keeps per kv-head is the
    max of these over the channels), and the static scales made from them."""

    recording: bool = False
    k_max: dict[int, torch.Tensor] = field(default_factory=dict)
    v_max: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: int = 0
    _scales: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def record(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Fold in key/value [batch, kv_heads, tokens, D] of attention layer ``layer``."""
        for stats, x in ((self.k_max, key), (self.v_max, value)):
            m = x.float().abs().amax(dim=(0, 2))
            stats[layer] = m if layer not in stats else torch.maximum(stats[layer], m)
        self._scales.clear()

    def scales(self, layer: int, per: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_scale, v_scale) fp32 [H, D] of ``layer``: per "head" (the absmax over the head's
        channels, the same for each) or per "channel"; stat / 127 as ``int8kv calibrate`` writes
        it (statistics floored at its MIN_STAT, the division in double, stored as fp32)."""
        key = (layer, per)
        if key not in self._scales:
            if layer not in self.k_max:
                raise ValueError(f"no calibration statistics for layer {layer}")
            out = []
            for stats in (self.k_max, self.v_max):
                stat = stats[layer].double()
                if per == "head":
                    stat = stat.amax(dim=-1, keepdim=True).expand_as(stat)
                out.append((stat.clamp_min(MIN_STAT) / K_QMAX).float())
            self._scales[key] = (out[0], out[1])
        return self._scales[key]


def calibration_windows(model_dir: str, seq_len: int, num_tokens: int) -> list[torch.Tensor]:
    """The sequences ``int8kv calibrate`` runs by default: windows of its shipped text, each led
    by the model's BOS where its tokenizer adds one, round-robin across documents."""
    bos = common.tokenizer_bos(model_dir)
    documents = [common.load_corpus_ids(model_dir, t) for t in calibrate_cli.default_texts()]
    prefix = [] if bos is None else [bos]
    plan = calibrate_cli.plan_sequences(documents, prefix, seq_len, num_tokens)
    return [torch.tensor(s, dtype=torch.long) for s in plan]


def calibrate(
    model: torch.nn.Module,
    variant_ref: list[Variant],
    static: StaticCalibration,
    windows: list[torch.Tensor],
) -> None:
    """Record ``static``'s statistics over ``windows`` with K/V unquantized (the calibration run's
    cache is dynamic int8, but its recorder sees K/V before they are quantized)."""
    previous = variant_ref[0]
    variant_ref[0] = Variant("bf16", 16)
    static.recording = True
    try:
        with torch.inference_mode():
            for w in windows:
                model(w[None])
                static.tokens += w.numel()
    finally:
        static.recording = False
        variant_ref[0] = previous


def install(variant_ref: list[Variant], static: StaticCalibration | None = None) -> str:
    """Register an attention function that quantizes K/V with ``variant_ref[0]`` first (static
    variants with ``static``'s scales; while ``static.recording``, it records K/V first)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def attention(module, query, key, value, attention_mask, **kwargs):
        v = variant_ref[0]
        k_scale = v_scale = None
        if static is not None and static.recording:
            static.record(module.layer_idx, key, value)
        if v.static:
            if static is None:
                raise ValueError(f"{v.name} needs a StaticCalibration")
            k_scale, v_scale = static.scales(module.layer_idx, v.static)
        key_q = fake_quant(key, v.for_k(), v.k_mode, k_scale)
        value_q = fake_quant(value, v, static_scale=v_scale)
        if not v.tail:
            return sdpa_attention_forward(module, query, key_q, value_q, attention_mask, **kwargs)
        if kwargs.get("softcap") is not None or kwargs.get("dropout", 0.0):
            raise ValueError("the tail simulation has no soft cap or dropout")
        out = tail_attention(
            query,
            key,
            value,
            key_q,
            value_q,
            attention_mask,
            kwargs.get("scaling"),
            v.tail_full,
            v.tail_pages,
        )
        return out, None

    AttentionInterface.register("int8kv_sim", attention)
    # transformers builds no mask at all for an attention name it has no mask function for, and
    # SDPA then falls back to plain causal attention: sliding-window layers would see every key.
    ALL_MASK_ATTENTION_FUNCTIONS.register("int8kv_sim", sdpa_mask)
    return "int8kv_sim"


def window_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits [tokens - 1, vocab] predicting ``ids[1:]`` (in the model's dtype)."""
    with torch.inference_mode():
        return model(ids[None]).logits[0, :-1]


def window_nll(
    model: torch.nn.Module, ids: torch.Tensor, chunk: int = 256, logits: torch.Tensor | None = None
) -> tuple[float, int]:
    """Summed negative log-likelihood of ``ids[1:]`` and how many tokens that is (``logits``:
    ``window_logits``' when already computed).

    The cross-entropy is taken in ``chunk`` positions at a time: Gemma 3's 262K-entry vocabulary
    makes a window's fp32 logits 2 GB."""
    if logits is None:
        logits = window_logits(model, ids)
    targets = ids[1:]
    total = 0.0
    for i in range(0, targets.numel(), chunk):
        part = logits[i : i + chunk].float()
        ce = torch.nn.functional.cross_entropy(part, targets[i : i + chunk], reduction="sum")
        total += ce.item()
    return total, ids.numel() - 1


def next_token_agreement(
    ref: torch.Tensor, logits: torch.Tensor, chunk: int = 256
) -> tuple[int, float]:
    """Over positions [positions, vocab]: how many have the same argmax in both, and the summed
    KL(P_ref || Q) in nats, P and Q the full softmaxes of ``ref`` and ``logits``."""
    same, kl = 0, 0.0
    for i in range(0, ref.shape[0], chunk):
        p = torch.log_softmax(ref[i : i + chunk].float(), dim=-1)
        q = torch.log_softmax(logits[i : i + chunk].float(), dim=-1)
        same += int((p.argmax(-1) == q.argmax(-1)).sum())
        kl += float(torch.nn.functional.kl_div(q, p, log_target=True, reduction="sum"))
    return same, kl


def load_windows(
    model_dir: str, corpus: str, window: int, max_windows: int
) -> tuple[list[torch.Tensor], int | None]:
    """The windows to score (each led by the model's BOS when its tokenizer adds one) and that
    BOS id (None when it adds none)."""
    ids = common.load_corpus_ids(model_dir, corpus)
    bos = common.tokenizer_bos(model_dir)
    windows = common.make_windows(ids, window, max_windows, bos)
    return [torch.tensor(w, dtype=torch.long) for w in windows], bos


def pick_variants(names: str) -> list[Variant]:
    """``"bf16,int4"`` -> those variants in that order; the first must be the unquantized one,
    since every ΔPPL is taken against it."""
    by_name = {v.name: v for v in VARIANTS}
    picked = common.parse_list(names)
    unknown = [n for n in picked if n not in by_name]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {', '.join(by_name)}")
    if not picked or by_name[picked[0]].bits != 16:
        raise ValueError("the first variant must be bf16: every ΔPPL is taken against it")
    return [by_name[n] for n in picked]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face folder")
    p.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    p.add_argument("--corpus", default=str(common.DEFAULT_CORPUS))
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--windows", type=int, default=10)
    p.add_argument(
        "--variants",
        default=",".join(v.name for v in VARIANTS),
        help="comma-separated variant names, bf16 first (default: all of them)",
    )
    p.add_argument(
        "--calibration-tokens",
        type=int,
        default=calibrate_cli.DEFAULT_NUM_TOKENS,
        help="tokens of the shipped calibration text the static variants' scales are taken over "
        f"(default {calibrate_cli.DEFAULT_NUM_TOKENS}, as `int8kv calibrate`)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "kv_quant_sim.json"))
    args = p.parse_args(argv)
    try:
        variants = pick_variants(args.variants)
    except ValueError as e:
        p.error(str(e))

    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    current = [variants[0]]
    static = StaticCalibration()
    impl = install(current, static)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16, attn_implementation=impl
    ).to(args.device)
    calibration = None
    if any(v.static for v in variants):
        seq_len = min(calibrate_cli.DEFAULT_SEQ_LEN, args.window)
        cal = calibration_windows(args.model, seq_len, args.calibration_tokens)
        calibrate(model, current, static, [w.to(args.device) for w in cal])
        calibration = {
            "texts": [t.name for t in calibrate_cli.default_texts()],
            "tokens": static.tokens,
            "seq_len": seq_len,
            "statistic": "absmax",
        }
    windows, bos = load_windows(args.model, args.corpus, args.window, args.windows)
    windows = [w.to(args.device) for w in windows]
    n = len(windows)
    d = model.config.head_dim

    tokens = sum(w.numel() - 1 for w in windows)  # scored: every token but each window's first
    per_window: dict[str, list[float]] = {v.name: [] for v in variants}
    same = dict.fromkeys(per_window, 0)
    kl = dict.fromkeys(per_window, 0.0)
    start = time.time()
    # window by window, so that only one window's bf16 logits are kept to compare with
    for w in tqdm(windows, desc="windows", file=sys.stderr):
        ref = None
        for v in variants:
            current[0] = v
            logits = window_logits(model, w)
            total, count = window_nll(model, w, logits=logits)
            per_window[v.name].append(total / count)
            if ref is None:
                ref = logits
            matches, divergence = next_token_agreement(ref, logits)
            same[v.name] += matches
            kl[v.name] += divergence
    base = per_window[variants[0].name]
    rows = []
    for v in variants:
        nll = per_window[v.name]
        ppl = math.exp(sum(nll) / n)
        # per-window ΔPPL (%) and its standard error across windows
        deltas = [100 * (math.exp(a - b) - 1) for a, b in zip(nll, base, strict=True)]
        mean = sum(deltas) / n
        se = (sum((x - mean) ** 2 for x in deltas) / (n - 1) / n) ** 0.5 if n > 1 else None
        rows.append(
            {
                "variant": v.name,
                "ppl": round(ppl, 4),
                "delta_pct": round(100 * (ppl / math.exp(sum(base) / n) - 1), 3),
                "delta_se_pct": None if se is None else round(se, 3),
                "kv_bytes_per_token_head": v.bytes_per_token_head(d),
                "capacity_vs_bf16": round(4 * d / v.bytes_per_token_head(d), 2),
                "top1_agreement": round(same[v.name] / tokens, 4),
                "kl_mean": round(kl[v.name] / tokens, 5),
            }
        )
        print(
            f"{v.name:32s} ppl {ppl:8.4f}  Δ {rows[-1]['delta_pct']:+7.3f}% ± {se or 0:.3f}"
            f"  top-1 {rows[-1]['top1_agreement']:.4f}  KL {rows[-1]['kl_mean']:.5f}"
        )
    on_gpu = args.device.startswith("cuda")
    result = {
        "gpu": torch.cuda.get_device_name() if on_gpu else None,
        "model": args.model_name,
        "corpus": Path(args.corpus).name,
        "tokens": tokens,
        "window": args.window,
        "bos": bos,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "command": common.command_line(),
        "seconds": round(time.time() - start, 1),
        "rows": rows,
    }
    if calibration is not None:
        result["static_calibration"] = calibration
    for path in common.write_json(result, args.out):
        print(f"kv_quant_sim: wrote {path}")


if __name__ == "__main__":
    main()
