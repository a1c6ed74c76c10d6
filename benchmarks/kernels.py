"""Official kernel benchmark: decode, prefill and cache write, ours vs vLLM's kernels.

    python -m benchmarks.kernels --out benchmarks/results/kernels.json [--quick] [--impls ...]

One decode point off the matrix (here SmolLM2's heads with 1024 sequences at 1K context):

    python -m benchmarks.kernels --shapes 2 --batches 1024 --ctxs 1024 --decode-only
        --impls bf16_fa2 int8 --out /tmp/smol_b1024.json

Impls: ``bf16_fa2`` (FlashAttention-2 paged, vllm.vllm_flash_attn, fa_version=2), ``bf16`` (vLLM's
Triton unified_attention, BF16 cache), ``upstream_int8_pth`` (the same kernel with vLLM's
int8_per_token_head cache), and ours: ``int8``, ``int8_static``, ``int4``; for prefill also
``int8_fa2`` / ``int8_static_fa2`` / ``int4_sink_tail2_fa2``, the context gather +
FlashAttention-2 the shim runs there; on
request (``--impls int4_tail2``, not in the default list) ``int4`` with a tail of two pages, each
sequence's page before the newest read from the tail too, and ``int4_sink_tail2``, ``int4`` as it
ships: also a sink page, each sequence's first 64 keys read in BF16 instead of from int4 page 0
(the ``gbs`` of both counts int4's bytes; its write rows time ``int4_tail2``'s write, the sink
page being written once a sequence, when its first page fills). vLLM is
imported only for its three impls; an impl that cannot be imported is skipped (listed under "skipped" in the JSON).

Timing: each op is captured in a CUDA graph (as vLLM runs decode) and the replay is timed with
triton.testing.do_bench(return_mode="median"); when one op's data would fit in L2, the graph runs
the op over several copies of the cache in turn and the time is divided. ``gbs`` counts the KV
bytes the kernel must read plus Q and the output; peak_bw_gbs is a device-to-device copy (bytes
read + written) measured in the same run. Also writes a PNG of speedup vs bf16_fa2 over context
next to the JSON, and a copy of both under $OUT when that is set.

The JSON is rewritten after every row, so a run stopped by a device call's time limit keeps what
it timed; ``--append`` adds to an existing file, a row replacing an earlier one of the same
measurement. A run's stdout (its copy bandwidth, then one JSON row per line) goes back into a
file with ``--from-log LOG --log-command CMD`` (``--decode-only`` / ``--write-only``: only those
rows). ``--write-only`` times the cache writes alone (every impl of each shape in one run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable

import torch
from triton.testing import do_bench

try:
    import int8kv_kernels as K
except ImportError:  # not installed: use the source tree through a temporary alias
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "int8kv_kernels",
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels", "__init__.py"),
    )
    K = importlib.util.module_from_spec(_spec)
    sys.modules["int8kv_kernels"] = K
    _spec.loader.exec_module(K)

from benchmarks import common  # noqa: E402
from int8kv_kernels.cache_write_int4 import tail_pool_shapes  # noqa: E402
from int8kv_kernels.catalogue import CATALOGUE, KERNEL_DTYPES, TAIL_DTYPES  # noqa: E402

DEV = "cuda"
BLOCK = 16
L2_BYTES = 60 << 20
SHAPES = common.MODEL_SHAPES
# vLLM's kernels, then ours: every dtype of the catalogue that has kernels
IMPLS = ["bf16_fa2", "bf16", "upstream_int8_pth", *KERNEL_DTYPES]
# Prefill only: what the shim runs in vLLM for a continuation of more than 256 new tokens
# (int8kv_shim/flash_prefill.py): gather_kv_context dequantizes the context into BF16 (int4's also
# copies its tail and sink pages), then FlashAttention-2 attends. The plain impl names time our
# Triton kernel on the same shape.
VIA_FA2 = {"int8_fa2": "int8", "int8_static_fa2": "int8_static",
           "int4_sink_tail2_fa2": "int4_sink_tail2"}  # fmt: skip
# Prefill only: our kernel with every key of a query block in one program (num_splits=1), as every
# prefill launch ran before short continuations split their keys across programs (b686a4c).
UNSPLIT = {"int8_unsplit": "int8", "int4_sink_tail2_unsplit": "int4_sink_tail2"}
# int4 with a tail of two pages (INT8KV_INT4_TAIL_PAGES=2): every sequence's newest page and the
# one before it read from the tail pool (only with --impls int4_tail2); int4_sink_tail2, int4's
# default, also reads each sequence's first page from its sink page (INT8KV_INT4_SINK_PAGE=1)
TAIL_PAGES = {"int4_tail2": 2, "int4_sink_tail2": 2, "int4_sink_tail2_unsplit": 2}
SINK_IMPLS = {"int4_sink_tail2", "int4_sink_tail2_unsplit"}


def our_impl(impl: str) -> str:
    """The impl of our kernels whose cache a prefill-only variant reads."""
    return VIA_FA2.get(impl, UNSPLIT.get(impl, impl))


def kv_dtype(impl: str) -> str:
    impl = our_impl(impl)
    return "int4" if impl in TAIL_PAGES else impl


def has_tail(impl: str) -> bool:
    return kv_dtype(impl) in TAIL_DTYPES


def block_size(impl: str) -> int:
    """Tokens per page: int4's is fixed by its format (64), every other cache takes BLOCK."""
    entry = CATALOGUE.get(kv_dtype(impl))
    return entry.page_tokens if entry is not None and entry.page_tokens else BLOCK


# Prefill rows: one sequence of PREFILL_CTX keys whose last PREFILL_Q_LEN (or --prefill-q-lens)
# are the new tokens. A few new tokens over a long context is the last piece of a chunked prompt
# (an 8192-token prompt beside 31 decodes under an 8192-token step budget leaves 31), which
# flash_prefill.MIN_CONTINUATION_TOKENS keeps on our kernels instead of int8_fa2.
PREFILL_CTX, PREFILL_Q_LEN = 8192, 2048

# int4 decode rows time sequences of ctx + TAIL_TOKENS keys, so every sequence has a partial
# last page in the tail pool, as in serving (a context that is a multiple of 64 would read none)
TAIL_TOKENS = 13


def graph_ms(fn: Callable[[], None], reps: int = 1) -> float:
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    torch.cuda.synchronize()
    return do_bench(g.replay, warmup=25, rep=100, return_mode="median") / reps


def copy_bw_gbs() -> float:
    n = 2 << 30
    x = torch.empty(n, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return 2 * n / ms / 1e6


def kv_bytes_per_token(impl: str, nkv: int, d: int) -> int:
    if impl in ("bf16_fa2", "bf16"):
        return nkv * 2 * d * 2
    if impl == "upstream_int8_pth":
        return nkv * 2 * (d + 4)
    bs = block_size(impl)
    return K.get_page_bytes(kv_dtype(impl), bs, nkv, d) // bs


class Cache:
    """One impl's paged cache for a batch, filled with realistic quantized data."""

    def __init__(self, impl: str, num_blocks: int, nkv: int, d: int, num_slots: int = 0):
        self.impl, self.nkv, self.d = impl, nkv, d
        if impl in ("bf16_fa2", "bf16"):
            self.k = torch.randn(num_blocks, BLOCK, nkv, d, device=DEV, dtype=torch.bfloat16)
            self.v = torch.randn_like(self.k)
        elif impl == "upstream_int8_pth":
            raw = torch.randint(-127, 128, (num_blocks, 2, BLOCK, nkv, d + 4), dtype=torch.int8,
                                device=DEV)  # fmt: skip
            self.k, self.v = raw[:, 0, :, :, :d], raw[:, 1, :, :, :d]
            self.ks = raw[:, 0, :, :, d:].view(torch.float32).squeeze(-1)
            self.vs = raw[:, 1, :, :, d:].view(torch.float32).squeeze(-1)
            self.ks.uniform_(0.005, 0.02)
            self.vs.uniform_(0.005, 0.02)
        elif has_tail(impl):
            lay = K.Int4PageLayout(block_size(impl), nkv, d)
            self.raw = torch.randint(-128, 128, (num_blocks, lay.page_bytes), dtype=torch.int8,
                                     device=DEV)  # fmt: skip
            self.raw[:, lay.k_sz :].view(torch.float16).uniform_(0.005, 0.02)  # scales, zeros
            self.sk = self.sv = None  # no static scales
            # the pool of unfinished pages: one slot per sequence, its own pages' tokens
            self.pages = TAIL_PAGES.get(our_impl(impl), 1)
            slots = max(num_slots, 1)
            shape, held = tail_pool_shapes(slots, nkv, d, self.pages, lay.block_size)
            self.tail = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
            self.tail_page = torch.full(held, -1, dtype=torch.int32, device=DEV)
            # the sink pool: one sink page per sequence, K and V of its first page
            self.sink = self.sink_of_seq = None
            if our_impl(impl) in SINK_IMPLS:
                sink_shape = (slots, 2, nkv, lay.block_size, d)
                self.sink = torch.randn(sink_shape, device=DEV, dtype=torch.bfloat16)
                self.sink_of_seq = torch.arange(slots, dtype=torch.int32, device=DEV)
        else:
            lay = K.PageLayout(kv_dtype(impl), BLOCK, nkv, d)
            self.raw = torch.randint(-127, 128, (num_blocks, lay.page_bytes), dtype=torch.int8,
                                     device=DEV)  # fmt: skip
            if lay.has_scales:
                self.raw[:, lay.k_scale :].view(torch.float16).uniform_(0.005, 0.02)
            self.sk = torch.full((nkv, d), 0.01, device=DEV)  # per (kv-head, channel)
            self.sv = torch.full((nkv, d), 0.01, device=DEV)


def attention_fn(
    impl: str, cache: Cache, q, out, qsl, seq_lens, bt, max_q: int, max_s: int, window: int = 0
):
    d = q.shape[-1]
    scale = d**-0.5
    # vLLM's convention for a window of w keys (position - j < w): FlashAttention's (w - 1, 0)
    fa_window = (window - 1, 0) if window else (-1, -1)
    if impl == "bf16_fa2":
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        return lambda: flash_attn_varlen_func(
            q, cache.k, cache.v, out=out, cu_seqlens_q=qsl, max_seqlen_q=max_q, seqused_k=seq_lens,
            max_seqlen_k=max_s, softmax_scale=scale, causal=True, block_table=bt, fa_version=2,
            window_size=list(fa_window),
        )  # fmt: skip
    if impl in ("bf16", "upstream_int8_pth"):
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
        from vllm.v1.kv_cache_interface import KVQuantMode

        nq = q.shape[1]
        num_seqs = seq_lens.shape[0]
        segs = 16  # vLLM's NUM_PAR_SOFTMAX_SEGMENTS; 3D path for batches up to 128 // nkv
        thr = max(1, 128 // cache.nkv)
        so = torch.empty(max(thr, num_seqs), nq, segs, d, device=DEV, dtype=torch.float32)
        sm = torch.empty(max(thr, num_seqs), nq, segs, device=DEV, dtype=torch.float32)
        se = torch.empty_like(sm)
        quant = impl == "upstream_int8_pth"
        return lambda: unified_attention(
            q=q, k=cache.k, v=cache.v, out=out, cu_seqlens_q=qsl, max_seqlen_q=max_q,
            seqused_k=seq_lens, max_seqlen_k=max_s, softmax_scale=scale, causal=True,
            window_size=fa_window, block_table=bt, softcap=0, q_descale=None, k_descale=None,
            v_descale=None, seq_threshold_3D=thr, num_par_softmax_segments=segs,
            softmax_segm_output=so, softmax_segm_max=sm, softmax_segm_expsum=se,
            kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD if quant else KVQuantMode.NONE,
            k_scale_cache=cache.ks if quant else None, v_scale_cache=cache.vs if quant else None,
        )  # fmt: skip
    tail = {}
    if has_tail(impl):
        slots = torch.arange(seq_lens.shape[0], dtype=torch.int32, device=DEV)
        tail = dict(tail=cache.tail, slot_of_seq=slots, tail_page=cache.tail_page)
        if cache.pages == 2:  # each slot holds its sequence's newest page and the one before
            cache.tail_page[: seq_lens.shape[0]].copy_(tail_halves(bt, seq_lens, block_size(impl)))
        if cache.sink is not None:
            tail |= dict(sink=cache.sink, sink_of_seq=cache.sink_of_seq)
    if impl in VIA_FA2:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        new_k = torch.randn(q.shape[0], cache.nkv, d, device=DEV, dtype=q.dtype)
        new_v = torch.randn_like(new_k)
        cu_k = torch.zeros(seq_lens.shape[0] + 1, device=DEV, dtype=torch.int32)
        cu_k[1:] = seq_lens.cumsum(0)
        total = int(cu_k[-1])

        def via_fa2() -> None:
            k, v = K.gather_kv_context(
                cache.raw, new_k, new_v, kv_dtype=kv_dtype(impl), block_size=block_size(impl),
                block_table=bt, cu_seqlens_q=qsl, cu_seqlens_k=cu_k, max_seqlen_k=max_s,
                num_k_tokens=total, k_scale=cache.sk, v_scale=cache.sv, **tail,
            )  # fmt: skip
            flash_attn_varlen_func(
                q, k, v, out=out, cu_seqlens_q=qsl, max_seqlen_q=max_q, cu_seqlens_k=cu_k,
                max_seqlen_k=max_s, softmax_scale=scale, causal=True, fa_version=2,
            )  # fmt: skip

        return via_fa2
    ws = K.make_workspace(q.shape[0], q.shape[1], d, device=DEV)
    return lambda: K.paged_attention(
        q, cache.raw, out, kv_dtype=kv_dtype(impl), block_size=block_size(impl), num_kv_heads=cache.nkv,
        query_start_loc=qsl, seq_lens=seq_lens, block_table=bt, max_query_len=max_q,
        max_seq_len=max_s, softmax_scale=scale, k_scale=cache.sk, v_scale=cache.sv, workspace=ws,
        sliding_window=window or None, num_splits=1 if impl in UNSPLIT else None, **tail,
    )  # fmt: skip


def tail_halves(bt: torch.Tensor, seq_lens: torch.Tensor, bs: int) -> torch.Tensor:
    """A two-page tail's entries [seqs, 2] as the write leaves them for sequences decoding on
    their own slots: the newest page's block in half last % 2, the page before's in the other
    (-1 while there is none)."""
    rows = torch.arange(bt.shape[0], device=bt.device)
    last = (seq_lens.to(bt.device).long() - 1) // bs
    newest = bt[rows, last]
    before = torch.where(last > 0, bt[rows, (last - 1).clamp(min=0)], -1)
    even = (last % 2 == 0)[:, None]
    return torch.where(even, torch.stack([newest, before], 1), torch.stack([before, newest], 1))


def attention_launches(
    impl, nq, nkv, d, batch, ctx, q_len, window=0, copies: int | None = None
) -> tuple[list[Callable[[], None]], int, int]:
    """(one launch per copy of the cache, the K/V bytes a launch must read, its query and output
    bytes) of ``batch`` sequences of ``ctx`` keys (and an ``impl`` with a tail: TAIL_TOKENS more
    in it) with ``q_len`` queries each. Without ``copies``, enough copies that together they
    spill out of L2."""
    bs = block_size(impl)
    tail = TAIL_TOKENS if has_tail(impl) else 0
    seq_len = ctx + tail
    blocks_per_seq = -(-seq_len // bs)
    must_kv = batch * seq_len * kv_bytes_per_token(impl, nkv, d)
    if copies is None:
        copies = max(1, min(8, -(-2 * L2_BYTES // must_kv)))
    caches = [Cache(impl, batch * blocks_per_seq + 1, nkv, d, batch) for _ in range(copies)]
    bt = torch.randperm(batch * blocks_per_seq, device=DEV).int().view(batch, blocks_per_seq)
    q = torch.randn(batch * q_len, nq, d, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    qsl = torch.arange(0, batch * q_len + 1, q_len, device=DEV, dtype=torch.int32)
    sl = torch.full((batch,), seq_len, device=DEV, dtype=torch.int32)
    fns = [attention_fn(impl, c, q, out, qsl, sl, bt, q_len, seq_len, window) for c in caches]
    return fns, must_kv, 2 * q.numel() * q.element_size()


def bench_attention(impl, kernel, nq, nkv, d, batch, ctx, q_len, window=0) -> dict:
    tail = TAIL_TOKENS if has_tail(impl) else 0
    fns, must_kv, q_bytes = attention_launches(impl, nq, nkv, d, batch, ctx, q_len, window)
    copies = len(fns)

    def run():
        for f in fns:
            f()

    ms = graph_ms(run) / copies
    # a sliding window must read only its keys (one page more where it starts mid-page)
    read_kv = must_kv if not window else batch * min(ctx, window) * kv_bytes_per_token(impl, nkv, d)
    moved = read_kv + q_bytes
    row = dict(kernel=kernel, impl=impl, q_heads=nq, kv_heads=nkv, head_dim=d, batch=batch,
               ctx=ctx, ms=ms, gbs=moved / ms / 1e6)  # fmt: skip
    if window:
        row["window"] = window
    if kernel == "prefill":
        row["q_len"] = q_len
    if tail:
        row["tail_tokens"] = tail  # keys per sequence past ctx, read from the tail pool
    return row


def bench_write(impl, nq, nkv, d, tokens=256, consecutive=False) -> dict:
    """Cache write of ``tokens`` new tokens: random slots (a decode step, one token per sequence)
    or runs of consecutive slots filling whole pages (a prefill chunk)."""
    num_blocks = 4096
    key = torch.randn(tokens, nkv, d, device=DEV, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    if consecutive:
        pages = torch.randperm(num_blocks, device=DEV)[: -(-tokens // BLOCK)]
        slots = (pages[:, None] * BLOCK + torch.arange(BLOCK, device=DEV)).flatten()[:tokens]
    else:
        slots = torch.randperm(num_blocks * BLOCK, device=DEV)[:tokens]
    c = Cache(impl, num_blocks, nkv, d, tokens)
    if has_tail(impl):
        fn = int4_write_fn(c, key, value, consecutive)
    elif impl in ("bf16_fa2", "bf16"):
        from vllm import _custom_ops as ops

        one = torch.ones((), device=DEV)
        fn = lambda: ops.reshape_and_cache_flash(key, value, c.k, c.v, slots, "auto", one, one)  # noqa: E731
    elif impl == "upstream_int8_pth":
        from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
            triton_reshape_and_cache_flash_per_token_head_quant as w,
        )

        fn = lambda: w(key, value, c.k, c.v, c.ks, c.vs, slots)  # noqa: E731
    else:
        fn = lambda: K.write_kv_cache(key, value, c.raw, slots, kv_dtype=impl, block_size=BLOCK,  # noqa: E731
                                      k_scale=c.sk, v_scale=c.sv)  # fmt: skip
    ms = graph_ms(fn, reps=20)
    moved = 2 * key.numel() * 2 + tokens * kv_bytes_per_token(impl, nkv, d)
    return dict(kernel="write", impl=impl, q_heads=nq, kv_heads=nkv, head_dim=d, batch=tokens,
                ctx=0, ms=ms, gbs=moved / ms / 1e6,
                slots="consecutive" if consecutive else "random")  # fmt: skip


def int4_write_fn(
    c: Cache, key: torch.Tensor, value: torch.Tensor, consecutive: bool,
    seq_lens: list[int] | None = None,
):  # fmt: skip
    """A step's int4 write: ``consecutive``, one sequence's prefill chunk from position 0 (every
    page quantized straight from key/value, the last one's rest into the tail); otherwise one
    token for each of as many sequences at random positions (their tails' rows, and a page
    flushed from the tail whenever a token completes it: 1 in 64 on average). The time includes a
    copy of ``tokens`` int32 that restores the slots' pages before each write. ``seq_lens``: the
    decode positions (tests)."""
    tokens, bs = key.shape[0], c.tail.shape[3] // c.pages
    if consecutive:
        q_lens, seq_lens = [tokens], [tokens]
    else:
        q_lens = [1] * tokens
        if seq_lens is None:
            seq_lens = torch.randint(1, 16 * bs, (tokens,)).tolist()
    n = len(q_lens)
    width = max(-(-s // bs) for s in seq_lens)
    table = torch.randperm(c.raw.shape[0], device=DEV)[: n * width].int().view(n, width)
    qsl = torch.zeros(n + 1, dtype=torch.int32, device=DEV)
    qsl[1:] = torch.tensor(q_lens, device=DEV).cumsum(0)
    slots = torch.arange(n, dtype=torch.int32, device=DEV)
    # each slot holds its sequence's last page (and, with two pages, the one before it); reset
    # before every write, so that every replay flushes the same pages whatever the previous one
    # left (the copy is timed too)
    if c.pages == 2:
        holder = tail_halves(table, torch.tensor(seq_lens, device=DEV), bs).int()
    else:
        holder = table[torch.arange(n, device=DEV), (torch.tensor(seq_lens, device=DEV) - 1) // bs]
    kw = dict(tail=c.tail, tail_page=c.tail_page, block_size=bs, query_start_loc=qsl,
              seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV), block_table=table,
              slot_of_seq=slots, slot_is_new=torch.zeros_like(slots), num_seqs=n,
              max_query_len=max(q_lens))  # fmt: skip

    def write() -> None:
        c.tail_page[:n].copy_(holder)
        K.write_kv_cache(key, value, c.raw, None, kv_dtype=kv_dtype(c.impl), **kw)

    return write


def plot(result: dict, path: str) -> None:
    """Decode speedup over bf16_fa2 against context, a panel per model shape: colour = impl,
    line style and marker = batch, the dashed line at the 1.6x decode target."""
    rows = [r for r in result["rows"] if r["kernel"] == "decode"]
    base = {(r["q_heads"], r["batch"], r["ctx"]): r["ms"] for r in rows if r["impl"] == "bf16_fa2"}
    if not base:  # every point of the plot is a ratio to it: an empty plot otherwise
        raise ValueError("no bf16_fa2 decode rows to plot against")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    shapes = sorted({(r["q_heads"], r["kv_heads"], r["head_dim"]) for r in rows})
    impls = [i for i in IMPLS[1:] if any(r["impl"] == i for r in rows)]
    batches = sorted({r["batch"] for r in rows})
    colour = {impl: f"C{i}" for i, impl in enumerate(impls)}
    styles = [("o", ":"), ("s", "-."), ("^", "--"), ("D", "-")]
    style = {b: styles[i % len(styles)] for i, b in enumerate(batches)}
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4.2), squeeze=False)
    for ax, (nq, nkv, d) in zip(axes[0], shapes, strict=True):
        for impl in impls:
            for batch in batches:
                pts = sorted((r["ctx"], base[(nq, batch, r["ctx"])] / r["ms"]) for r in rows
                             if r["impl"] == impl and r["q_heads"] == nq and r["batch"] == batch
                             and (nq, batch, r["ctx"]) in base)  # fmt: skip
                if pts:
                    marker, ls = style[batch]
                    ax.plot(*zip(*pts, strict=True), color=colour[impl], marker=marker, ls=ls,
                            ms=4)  # fmt: skip
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.6, color="k", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context")
        ax.set_ylabel("speedup vs bf16_fa2")
        ax.set_title(f"decode q={nq} kv={nkv} d={d}")
    handles = [Line2D([], [], color=colour[i], lw=2, label=i) for i in impls] + [
        Line2D([], [], color="gray", marker=style[b][0], ls=style[b][1], label=f"batch {b}")
        for b in batches
    ]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)


@contextlib.contextmanager
def decode_config(spec: str | None):
    """Inside: our attention's decode launches (one query token per sequence) use the config
    ``spec`` = "T,W,S,C"; other launches keep _choose_config's. No-op for None."""
    if spec is None:
        yield
        return
    import int8kv_kernels.attention as A
    from benchmarks.tune_decode import fixed_config

    fixed, orig = fixed_config(*map(int, spec.split(","))), A._choose_config

    def choose(group, head_size, max_query_len, *rest, **kw):
        if max_query_len == 1:
            return fixed(group)
        return orig(group, head_size, max_query_len, *rest, **kw)

    A._choose_config = choose
    try:
        yield
    finally:
        A._choose_config = orig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/kernels.json")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (one model shape)")
    ap.add_argument("--impls", nargs="*", default=IMPLS)
    # The full matrix does not fit one 10-minute device call: run it in parts (e.g. one model
    # shape per call) and merge them into one file with --append.
    ap.add_argument("--shapes", type=int, nargs="*", help="indices into SHAPES (default: all)")
    ap.add_argument("--append", action="store_true", help="add rows to an existing --out file")
    ap.add_argument(
        "--decode-config",
        help="T,W,S,C: time int8/int8_static decode with this (tile, warps, stages, chunks) "
        "instead of _choose_config's (e.g. the output of tune_decode.py --best)",
    )
    # A decode point outside the matrix, e.g. an end-to-end run's regime: SmolLM2's heads with
    # vLLM's 1024 sequences at 1K (--shapes 2 --batches 1024 --ctxs 1024 --decode-only).
    ap.add_argument("--batches", type=int, nargs="*", help="decode batch sizes (default: matrix)")
    ap.add_argument("--ctxs", type=int, nargs="*", help="decode contexts (default: matrix)")
    ap.add_argument(
        "--window",
        type=int,
        default=0,
        help="decode rows also on a sliding-window layer of this many keys (Gemma 3: 512), whose "
        "time must stay flat as the context grows",
    )
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--decode-only", action="store_true", help="no prefill and write rows")
    only.add_argument("--write-only", action="store_true", help="cache-write rows only")
    only.add_argument("--prefill-only", action="store_true", help="prefill rows only")
    ap.add_argument(
        "--prefill-q-lens",
        type=int,
        nargs="*",
        default=[PREFILL_Q_LEN],
        help=f"new tokens of the prefill rows over a {PREFILL_CTX}-key sequence (e.g. 31 63 256: "
        "chunked-prefill continuations around flash_prefill.MIN_CONTINUATION_TOKENS)",
    )
    ap.add_argument(
        "--from-log",
        metavar="LOG",
        help="runs nothing: the rows a run printed (its stdout, e.g. one killed before it wrote "
        "--out), into --out; with --decode-only / --write-only / --prefill-only only those rows",
    )
    ap.add_argument("--log-command", help="with --from-log: the command that printed LOG")
    return ap.parse_args(argv)


def row_key(row: dict) -> tuple:
    """What a row measures; a later row with the same key replaces it (--append)."""
    shape = (row["q_heads"], row["kv_heads"], row["head_dim"], row["batch"], row["ctx"])
    # prefill rows from before --prefill-q-lens carry no q_len: they timed PREFILL_Q_LEN
    q_len = row.get("q_len", PREFILL_Q_LEN) if row["kernel"] == "prefill" else None
    return (row["kernel"], row["impl"], *shape, row.get("slots"), row.get("window"), q_len)


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    keys = {row_key(r) for r in new}
    return [r for r in old if row_key(r) not in keys] + new


def parse_log(text: str) -> tuple[str, float, list[dict]]:
    """(gpu, copy GB/s, rows) of a run's stdout: "GPU: copy N GB/s", then one JSON row a line.
    Lines before the copy line (run_gpu_e2e.sh's staging output) are skipped."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        gpu, sep, bw = line.rpartition(": copy ")
        if sep and bw.endswith(" GB/s"):
            rows = [json.loads(x) for x in lines[i + 1 :] if x.startswith("{")]
            return gpu, float(bw.removesuffix(" GB/s")), rows
    raise SystemExit("--from-log: no '<gpu>: copy <N> GB/s' line (not a kernels.py log)")


def merge_previous(args: argparse.Namespace, result: dict) -> None:
    """--append: start from --out's rows, so this run's rows add to or replace them."""
    if not (args.append and os.path.exists(args.out)):
        return
    with open(args.out) as f:
        previous = json.load(f)
    if previous["gpu"] != result["gpu"]:
        raise SystemExit(f"--append: {args.out} was measured on {previous['gpu']}")
    # Impl ratios come from one part each; the fraction of bandwidth uses the highest copy
    # bandwidth any part measured, so no part's fraction is overstated.
    result["rows"] = previous["rows"]
    result["skipped"] = previous.get("skipped", [])
    result["command"] = f"{previous['command']} ; {result['command']}"
    result["peak_bw_gbs"] = max(previous["peak_bw_gbs"], result["peak_bw_gbs"])


def save(result: dict, out: str, with_plot: bool = False) -> None:
    """Write the JSON (and the plot), with a copy of each under $OUT when that is set."""
    common.write_json(result, out)
    if not with_plot:
        return
    png = os.path.splitext(out)[0] + ".png"
    try:
        plot(result, png)
    except (ImportError, KeyError, ValueError) as e:
        print("no plot:", e)
        return
    common.copy_to_out(png)


def kernel_kinds(args: argparse.Namespace) -> set[str]:
    """Which kernels a run times (or --from-log takes): --decode-only / --write-only, or all."""
    if args.decode_only:
        return {"decode"}
    if args.write_only:
        return {"write"}
    if args.prefill_only:
        return {"prefill"}
    return {"decode", "prefill", "write"}


def decode_matrix(args: argparse.Namespace) -> tuple[list, list[int], list[int]]:
    """(shapes, batches, contexts) of the decode rows."""
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.shapes is not None:
        shapes = [SHAPES[i] for i in args.shapes]
    batches = args.batches or ([8, 32] if args.quick else [1, 8, 32, 128])
    ctxs = args.ctxs or ([1024, 8192] if args.quick else [1024, 4096, 8192, 32768])
    return shapes, batches, ctxs


def main() -> None:
    args = parse_args()
    if args.from_log:
        if not args.log_command:
            raise SystemExit("--from-log needs --log-command (the command that printed the log)")
        with open(args.from_log) as f:
            gpu, bw, rows = parse_log(f.read())
        rows = [r for r in rows if r["kernel"] in kernel_kinds(args)]
        log = os.path.relpath(os.path.abspath(args.from_log))
        result = {"gpu": gpu, "command": f"{args.log_command} (rows from {log})",
                  "peak_bw_gbs": bw, "rows": [], "skipped": []}  # fmt: skip
        merge_previous(args, result)
        result["rows"] = merge_rows(result["rows"], rows)
        save(result, args.out, with_plot=True)
        return
    torch.manual_seed(0)
    shapes, batches, ctxs = decode_matrix(args)
    result = {"gpu": torch.cuda.get_device_name(), "command": common.command_line(),
              "peak_bw_gbs": copy_bw_gbs(), "rows": [], "skipped": []}  # fmt: skip
    # this run's own copy bandwidth: the line --from-log reads back
    print(f"{result['gpu']}: copy {result['peak_bw_gbs']:.0f} GB/s", flush=True)
    merge_previous(args, result)

    def attempt(impl, f, *a):
        try:
            with decode_config(args.decode_config if impl in K.INT8_DTYPES else None):
                row = f(impl, *a)
        except (ImportError, RuntimeError, AttributeError, TypeError) as e:
            msg = f"{impl} {a}: {type(e).__name__}: {str(e)[:200]}"
            print("skip", msg, flush=True)
            result["skipped"].append(msg)
            return
        finally:
            torch.cuda.empty_cache()
        result["rows"] = merge_rows(result["rows"], [row])
        print(json.dumps(row), flush=True)
        save(result, args.out)  # a run killed by a device-call limit keeps the rows it timed

    kinds = kernel_kinds(args)
    for nq, nkv, d in shapes:
        if "decode" in kinds:
            for batch in batches:
                for ctx in ctxs:
                    for impl in args.impls:
                        attempt(impl, bench_attention, "decode", nq, nkv, d, batch, ctx, 1)
                    for impl in args.impls if args.window else ():
                        attempt(impl, bench_attention, "decode", nq, nkv, d, batch, ctx, 1,
                                args.window)  # fmt: skip
        if "prefill" in kinds:
            prefill_impls = args.impls + [
                i for i, base in (VIA_FA2 | UNSPLIT).items() if base in args.impls
            ]
            for q_len in args.prefill_q_lens:
                for impl in prefill_impls:
                    attempt(impl, bench_attention, "prefill", nq, nkv, d, 1, PREFILL_CTX, q_len)
        if "write" in kinds:
            for impl in args.impls:
                attempt(impl, bench_write, nq, nkv, d)
                attempt(impl, bench_write, nq, nkv, d, 16384, True)
    save(result, args.out, with_plot=True)


if __name__ == "__main__":
    main()
