"""Paged attention over int4 pages + tails == fp64 reference attention over the dequantized pages
and the tails' rows (reference_int4.int4_kv_slots), within the bf16 bound of kvbatch."""

from __future__ import annotations

import pytest
import torch
from kvbatch import assert_close_bf16, make_batch

from int8kv_kernels import (
    Int4PageLayout,
    make_workspace,
    paged_attention,
    paged_attention_int4,
    write_kv_cache,
)
from int8kv_kernels.reference import attention_ref
from int8kv_kernels.reference_int4 import paged_attention_int4_ref

B = 64


def random_int4_cache(nkv: int, d: int, num_blocks: int, device: str) -> torch.Tensor:
    """Random codes and (scale, zero) pairs that dequantize to about [-2.5, 2.5], like
    unit-variance activations, with every channel's and token's scale different."""
    lay = Int4PageLayout(B, nkv, d)
    cache = torch.randint(-128, 128, (num_blocks, lay.page_bytes), dtype=torch.int8, device=device)
    for lo, hi in ((lay.k_sz, lay.v_sz), (lay.v_sz, lay.page_bytes)):
        sz = cache[:, lo:hi].view(torch.float16)
        n = sz.shape[1] // 2
        scale = (torch.rand(num_blocks, n, device=device) + 0.5) * (5.0 / 15)
        zero = scale * (-7.5 + (torch.rand(num_blocks, n, device=device) - 0.5))
        if lo == lay.k_sz:  # [H][2][D]: scale row, zero row
            view = sz.view(num_blocks, nkv, 2, d)
            view[:, :, 0] = scale.view(num_blocks, nkv, d).half()
            view[:, :, 1] = zero.view(num_blocks, nkv, d).half()
        else:  # [H][NG][2][B]
            view = sz.view(num_blocks, -1, 2, B)
            view[:, :, 0] = scale.view(num_blocks, -1, B).half()
            view[:, :, 1] = zero.view(num_blocks, -1, B).half()
    return cache


def random_tail(num_slots: int, nkv: int, d: int, device: str, dtype=torch.bfloat16):
    """Tail rows of unit variance; rows past each sequence's tokens hold NaN, which must never be
    read (a pool slot's stale rows can be anything)."""
    tail = torch.randn(num_slots, 2, nkv, B, d, device=device).to(dtype)
    return tail


def _poison_unused_tail_rows(tail, seq_lens, slots, held=()):
    for r, (n, s) in enumerate(zip(seq_lens, slots, strict=False)):
        if s >= 0 and r not in held:
            tail[s, :, :, n % B :] = float("nan")


def tail_pages(b, seq_lens, slots, num_slots, held=(), device="cpu"):
    """tail_page as the write leaves it: a partial last page's block; for a complete last page,
    its block when the sequence's index is in ``held`` (the step completed it), else -1."""
    tail_page = torch.full((num_slots,), -1, dtype=torch.int32)
    for r, (n, s) in enumerate(zip(seq_lens, slots, strict=False)):
        if s >= 0 and n and (n % B or r in held):
            tail_page[s] = int(b.block_table[r, (n - 1) // B])
    return tail_page.to(device)


def run_int4(b, cache, tail, slots, nkv, out=None, tail_page=None, **kw):
    if out is None:
        out = torch.empty_like(b.query)
    out.fill_(float("nan"))
    # the sink keywords are paged_attention_int4's only (the dispatcher does not take them yet)
    attend = paged_attention_int4 if "sink" in kw else paged_attention
    attend(
        b.query, cache, out, kv_dtype="int4", block_size=B, num_kv_heads=nkv,
        query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, block_table=b.block_table,
        max_query_len=b.max_query_len, max_seq_len=b.max_seq_len,
        softmax_scale=b.query.shape[-1] ** -0.5, tail=tail, slot_of_seq=slots,
        tail_page=_no_held_page(tail) if tail_page is None else tail_page, **kw,
    )  # fmt: skip
    return out


def _no_held_page(tail):
    return torch.full((tail.shape[0],), -1, dtype=torch.int32, device=tail.device)


def reference_int4(b, cache, tail, slots, tail_page=None, **kw):
    tail_page = _no_held_page(tail) if tail_page is None else tail_page
    kw = {n: x for n, x in kw.items() if n not in ("num_splits", "workspace")}
    ref = paged_attention_int4_ref(
        b.query, cache, block_size=B, query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
        block_table=b.block_table, softmax_scale=b.query.shape[-1] ** -0.5, tail=tail,
        tail_page=tail_page, slot_of_seq=slots, **kw,
    )  # fmt: skip
    return ref[: int(b.query_start_loc[-1])]


def check(q_lens, seq_lens, nq, nkv, d, device, slots=None, q_std=1.0, pad_tokens=0, held=(),
          **kw):  # fmt: skip
    """``held``: the sequences (indices) whose complete last page their tail still holds."""
    b = make_batch(q_lens, seq_lens, nq, d, B, device, q_std=q_std, pad_tokens=pad_tokens)
    if slots is None:
        slots = list(range(len(seq_lens)))
    num_slots = max([*slots, 0]) + 1
    cache = random_int4_cache(nkv, d, b.num_blocks, device)
    tail = random_tail(num_slots, nkv, d, device)
    _poison_unused_tail_rows(tail, seq_lens, slots, held)
    tail_page = tail_pages(b, seq_lens, slots, num_slots, held, device)
    slot_t = torch.tensor(slots + [0] * 3, dtype=torch.int32, device=device)  # + padding rows
    out = run_int4(b, cache, tail, slot_t, nkv, tail_page=tail_page, **kw)
    assert_close_bf16(out, reference_int4(b, cache, tail, slot_t, tail_page=tail_page, **kw))
    return out


# (name, q_lens, seq_lens, nq, nkv, head_size, extra kwargs). num_splits forces the split-KV
# decode path (the CPU heuristic would not split sequences this short).
CASES = [
    ("decode_no_tail_multiple_of_64", [1, 1], [128, 64], 8, 2, 64, {}),
    ("decode_tail_only_shorter_than_64", [1, 1], [37, 1], 8, 2, 64, {}),
    ("decode_pages_and_tail_split", [1, 1, 1], [200, 129, 70], 8, 2, 64, {"num_splits": 2}),
    ("decode_split_4_gqa8_d128", [1, 1], [300, 65], 8, 1, 128, {"num_splits": 4}),
    ("decode_d256_two_v_groups", [1, 1], [130, 40], 4, 2, 256, {"num_splits": 2}),
    # decode steps take two pages: odd page counts, a split starting mid-pair
    ("decode_odd_pages_splits", [1, 1, 1], [330, 192, 127], 8, 2, 128, {"num_splits": 3}),
    ("decode_speculative_tokens_16_rows", [3, 2, 4], [333, 190, 64], 8, 2, 64,
     {"num_splits": 2}),
    ("decode_window_odd_pages_d256", [1, 1], [460, 250], 4, 1, 256,
     {"sliding_window": 150, "num_splits": 2}),
    ("prefill_ends_mid_page", [150], [150], 4, 2, 64, {}),
    ("prefill_multiple_of_64", [128, 20], [128, 20], 4, 4, 64, {}),
    ("chunked_prefill_on_context", [70, 1], [200, 90], 8, 2, 128, {}),
    ("mixed_d256", [1, 9, 1], [100, 70, 64], 4, 2, 256, {}),
    ("sliding_window_decode_crosses_pages", [1, 1], [200, 50], 4, 1, 64,
     {"sliding_window": 70, "num_splits": 2}),
    ("sliding_window_prefill", [100, 1], [180, 129], 4, 2, 64, {"sliding_window": 50}),
    ("soft_cap", [1, 30], [150, 90], 4, 1, 128, {"soft_cap": 3.0}),
    # a short continuation on the decode configuration (2 tokens x 4 heads <= 16 rows) at head
    # size 256, one kv head, with a window: Gemma 3's shape
    ("decode_config_continuation_d256_window", [1, 2], [700, 640], 4, 1, 256,
     {"sliding_window": 512, "num_splits": 4}),
    # a last page the step completed, still read from the tail (held); beside it sequences whose
    # complete last page is read from the cache (a full prefix-cache hit)
    ("decode_completes_page_tail_holds_it", [1, 1, 1], [128, 64, 192], 8, 2, 64,
     {"held": (0, 1)}),
    ("decode_completes_page_splits", [1, 1, 1], [256, 128, 320], 8, 2, 128,
     {"held": (0, 1, 2), "num_splits": 3}),
    ("decode_completes_page_window_d256", [1, 1], [448, 64], 4, 1, 256,
     {"held": (0, 1), "sliding_window": 100, "num_splits": 2}),
    ("decode_config_continuation_completes_page", [3, 2], [192, 130], 8, 2, 64,
     {"held": (0,), "num_splits": 2}),
    ("chunk16_completes_page", [16, 16, 16], [64, 192, 80], 4, 2, 64, {"held": (0, 1)}),
    ("prefill_multiple_of_64_tail_holds_last", [128, 20], [128, 20], 4, 4, 64, {"held": (0,)}),
    ("mixed_completes_page_d256_window", [1, 9, 40], [128, 192, 640], 4, 2, 256,
     {"held": (0, 1, 2), "sliding_window": 100}),
    # the prefill configuration with its keys split (a short continuation over a long context):
    # split boundaries between the sink, the pages and a two-page tail
    ("continuation_split", [40, 1], [450, 200], 8, 2, 64, {"num_splits": 4}),
    ("continuation_split_window_d256", [20], [520], 4, 1, 256,
     {"sliding_window": 200, "num_splits": 3}),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_int4_attention_matches_reference(case, device):
    _, q_lens, seq_lens, nq, nkv, d, kw = case
    check(q_lens, seq_lens, nq, nkv, d, device, q_std=2.0 if "soft_cap" in kw else 1.0, **kw)


def test_int4_slot_minus_one_reads_no_tail(device):
    # padding rows / dummy runs: their partial pages are not read; a query that sees no key at
    # all (seq_len < 64, no slot) gets 0; the first sequence's slot is the last of the pool, so a
    # -1 read as an index would be out of bounds
    out = check([1, 1, 3, 1], [100, 30, 150, 64], 4, 1, 64, device, slots=[1, -1, -1, -1])
    assert (out[1] == 0).all()
    check([1, 1], [100, 30], 4, 1, 64, device, slots=[-1, 0], num_splits=2)


def test_int4_tail_holding_another_block_is_not_read(device):
    # a complete last page whose slot holds another block (its previous page, or a block of
    # nobody's) is read from the cache: every row of those slots is NaN, so reading one shows
    nq, nkv, d = 4, 2, 64
    seq_lens = [128, 192, 64]
    b = make_batch([1, 16, 1], seq_lens, nq, d, B, device)
    cache = random_int4_cache(nkv, d, b.num_blocks, device)
    tail = random_tail(3, nkv, d, device)
    tail.fill_(float("nan"))
    tail_page = torch.tensor([int(b.block_table[0, 0]), b.num_blocks + 5, -1], dtype=torch.int32,
                             device=device)  # fmt: skip
    slots = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    for kw in ({}, {"num_splits": 2}):
        out = run_int4(b, cache, tail, slots, nkv, tail_page=tail_page, **kw)
        assert not out.isnan().any()
        assert_close_bf16(out, reference_int4(b, cache, tail, slots, tail_page=tail_page, **kw))


def test_int4_workspace_padding_tokens_and_empty_sequences(device):
    # CUDA-graph-style batch: preallocated workspace, a sequence without new tokens, query rows
    # past the batch, which must stay untouched (still NaN)
    nq, d = 4, 64
    ws = make_workspace(8, nq, d, max_splits=4, device=device)
    out = check([1, 0, 1], [300, 5, 260], nq, 1, d, device, pad_tokens=2, workspace=ws,
                num_splits=4)  # fmt: skip
    assert out[-2:].isnan().all()


def test_int4_fp16_queries(device):
    b = make_batch([1, 5], [100, 70], 4, 64, B, device, dtype=torch.float16)
    cache = random_int4_cache(2, 64, b.num_blocks, device)
    tail = random_tail(3, 2, 64, device, dtype=torch.float16)
    slots = torch.tensor([0, 2], dtype=torch.int32, device=device)
    out = run_int4(b, cache, tail, slots, 2)
    assert_close_bf16(out, reference_int4(b, cache, tail, slots))


def test_int4_attention_needs_a_tail_and_refuses_static_scales(device):
    b = make_batch([1], [10], 4, 64, B, device)
    cache = random_int4_cache(1, 64, b.num_blocks, device)
    with pytest.raises(ValueError, match="tail, tail_page and slot_of_seq"):
        paged_attention(b.query, cache, torch.empty_like(b.query), kv_dtype="int4", block_size=B,
                        num_kv_heads=1, query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
                        block_table=b.block_table, max_query_len=1, max_seq_len=10,
                        softmax_scale=0.1)  # fmt: skip
    with pytest.raises(ValueError, match="static scales"):
        run_int4(b, cache, random_tail(1, 1, 64, device), torch.zeros(1, dtype=torch.int32), 1,
                 k_scale=torch.ones(1))  # fmt: skip


def test_int4_through_the_write_stays_within_the_quantization_error(device):
    """End to end: K/V written through the int4 write kernel (pages + tail), attention against
    exact attention on the BF16 K/V. 4-bit K per channel of a page, V per token: the output error
    stays below 0.15 of the output's RMS for unit-variance K/V (measured about 0.08)."""
    nq, nkv, d = 8, 2, 64
    seq_lens = [150, 64, 30]
    b = make_batch([1, 1, 1], seq_lens, nq, d, B, device)
    cache = torch.zeros(b.num_blocks, Int4PageLayout(B, nkv, d).page_bytes, dtype=torch.int8,
                        device=device)  # fmt: skip
    tail = torch.zeros(4, 2, nkv, B, d, dtype=torch.bfloat16, device=device)
    tail_page = torch.full((4,), -1, dtype=torch.int32, device=device)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    k_slots = torch.zeros(b.num_blocks, B, nkv, d, dtype=torch.bfloat16, device=device)
    v_slots = torch.zeros_like(k_slots)
    total = sum(seq_lens)
    key = torch.randn(total, nkv, d, device=device).to(torch.bfloat16)
    value = torch.randn(total, nkv, d, device=device).to(torch.bfloat16)
    qsl = torch.tensor([0, 150, 214, 244], dtype=torch.int32, device=device)
    write_kv_cache(key, value, cache, None, kv_dtype="int4", tail=tail, tail_page=tail_page,
                   block_size=B, query_start_loc=qsl, seq_lens=b.seq_lens,
                   block_table=b.block_table, slot_of_seq=slots,
                   slot_is_new=torch.ones(3, dtype=torch.int32, device=device), num_seqs=3,
                   max_query_len=150)  # fmt: skip
    for s, n in enumerate(seq_lens):
        pos = torch.arange(n, device=device)
        idx = b.block_table[s, pos // B].long() * B + pos % B
        k_slots.view(-1, nkv, d)[idx] = key[int(qsl[s]) : int(qsl[s]) + n]
        v_slots.view(-1, nkv, d)[idx] = value[int(qsl[s]) : int(qsl[s]) + n]
    out = run_int4(b, cache, tail, slots, nkv, tail_page=tail_page).float()
    exact = attention_ref(b.query, k_slots, v_slots, query_start_loc=b.query_start_loc,
                          seq_lens=b.seq_lens, block_table=b.block_table,
                          softmax_scale=d**-0.5)  # fmt: skip
    err = (out - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()
    assert err < 0.15, float(err)
    # the 64-token sequence's page, completed by this step, and the 30-token sequence live in
    # their tails: exact up to the output's bf16 rounding
    assert int(tail_page[0]) == int(b.block_table[1, 0])
    assert_close_bf16(out[1:3], exact[1:3])


def sink_pool(q_lens, seq_lens, sinks, nkv, d, device, held=(), sliding_window=None):
    """A sink per row that names one (unit-variance rows, unrelated to the cache's page 0, so
    reading either in place of the other shows) and sink_of_seq, whose padding entries name a
    real sink. A sink attention must not read (page 0 partial or the tail's, or behind every
    query's window) is NaN: reading its V turns the row's output NaN."""
    sink = torch.randn(max([*sinks, 0]) + 1, 2, nkv, B, d).to(torch.bfloat16)
    for r, (q, n, s) in enumerate(zip(q_lens, seq_lens, sinks, strict=True)):
        full = n // B * B - (B if r in held and n % B == 0 else 0)
        hidden = sliding_window is not None and n - q - sliding_window + 1 >= B
        if s >= 0 and (full <= 0 or hidden):
            sink[s] = float("nan")
    sink_of_seq = torch.tensor(sinks + [0] * 3, dtype=torch.int32)
    return sink.to(device), sink_of_seq.to(device)


def check_sink(q_lens, seq_lens, nq, nkv, d, device, sinks, held=(), **kw):
    """``check`` with a sink per row (``sinks``: its index, -1 none)."""
    sink, sink_of_seq = sink_pool(q_lens, seq_lens, sinks, nkv, d, device, held,
                                  kw.get("sliding_window"))  # fmt: skip
    return check(q_lens, seq_lens, nq, nkv, d, device, held=held, sink=sink,
                 sink_of_seq=sink_of_seq, **kw)  # fmt: skip


# (name, q_lens, seq_lens, nq, nkv, head_size, sinks, extra kwargs)
SINK_CASES = [
    # rows with and without a sink in one batch; a sink whose page 0 is still the tail's (a
    # 64-token row that completed it, held; a 40-token row); a 64-token prefix-cache row (page 0
    # full in the cache, the slot holds nothing): its sink is read
    ("decode_mixed", [1, 1, 1, 1, 1], [200, 130, 64, 40, 64], 8, 2, 64, [0, -1, 1, 2, 3],
     {"held": (2,)}),
    ("decode_gqa8_split_d128", [1, 1, 1], [300, 65, 128], 8, 1, 128, [1, 0, -1],
     {"num_splits": 3}),
    ("decode_split_d256", [1, 1], [330, 192], 4, 2, 256, [0, 1], {"num_splits": 4}),
    # the decode configuration's 16-row variant: speculative tokens, a 4-token row finishing page 0
    ("decode_16_rows", [3, 2, 4], [333, 190, 64], 8, 2, 64, [0, 1, 2], {"num_splits": 2}),
    # prefix-cache style: a continuation whose page 0 is full in the cache; a fresh prompt whose
    # first query block sees only part of page 0
    ("continuation_d128", [70, 1], [200, 90], 8, 2, 128, [0, 1], {}),
    ("prefill_fresh", [150, 20], [150, 20], 4, 2, 64, [1, 0], {}),
    # windows: page 0 behind the window (sink NaN), partly inside it, wholly inside
    ("window_decode_split", [1, 1, 1], [460, 150, 100], 4, 1, 64, [0, 1, 2],
     {"sliding_window": 120, "num_splits": 2}),
    ("window_prefill", [100, 1], [180, 129], 4, 2, 64, [0, 1], {"sliding_window": 50}),
    ("window_decode_config_continuation_d256", [1, 2], [700, 640], 4, 1, 256, [0, 1],
     {"sliding_window": 650, "num_splits": 4}),
    ("soft_cap", [1, 30], [150, 90], 4, 1, 128, [0, 1], {"soft_cap": 3.0}),
]  # fmt: skip


@pytest.mark.parametrize("case", SINK_CASES, ids=[c[0] for c in SINK_CASES])
def test_int4_sink_matches_reference(case, device):
    _, q_lens, seq_lens, nq, nkv, d, sinks, kw = case
    check_sink(q_lens, seq_lens, nq, nkv, d, device, sinks,
               q_std=2.0 if "soft_cap" in kw else 1.0, **kw)  # fmt: skip


@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "kw"),
    [([1, 1], [300, 130], {"num_splits": 3}), ([70, 1], [200, 90], {}),
     ([1, 40], [460, 150], {"sliding_window": 120, "soft_cap": 5.0})],
)  # fmt: skip
def test_int4_sink_absent_or_unused_is_bit_identical(q_lens, seq_lens, kw, device):
    """With no sink, or with every sink_of_seq entry -1: the same bits as without the arguments."""
    nq, nkv, d = 4, 2, 64
    b = make_batch(q_lens, seq_lens, nq, d, B, device)
    cache = random_int4_cache(nkv, d, b.num_blocks, device)
    tail = random_tail(len(q_lens), nkv, d, device)
    _poison_unused_tail_rows(tail, seq_lens, list(range(len(q_lens))))
    slots = torch.arange(len(q_lens) + 3, dtype=torch.int32, device=device) % len(q_lens)
    tail_page = tail_pages(b, seq_lens, list(range(len(q_lens))), len(q_lens), device=device)
    plain = run_int4(b, cache, tail, slots, nkv, tail_page=tail_page, **kw).clone()
    sink = torch.full((2, 2, nkv, B, d), float("nan"), dtype=torch.bfloat16, device=device)
    none = torch.full((len(q_lens) + 3,), -1, dtype=torch.int32, device=device)
    unused = run_int4(b, cache, tail, slots, nkv, tail_page=tail_page, sink=sink,
                      sink_of_seq=none, **kw)  # fmt: skip
    assert torch.equal(plain, unused)
    assert not plain.isnan().any()
    # and the sinks are read where named: the same batch with them differs
    sink.normal_()
    used = run_int4(b, cache, tail, slots, nkv, tail_page=tail_page, sink=sink,
                    sink_of_seq=torch.zeros_like(none), **kw)  # fmt: skip
    assert not torch.equal(plain, used)


def test_int4_sink_arguments_are_checked(device):
    b = make_batch([1], [100], 4, 64, B, device)
    cache = random_int4_cache(1, 64, b.num_blocks, device)
    tail, slots = random_tail(1, 1, 64, device), torch.zeros(1, dtype=torch.int32, device=device)
    sink = torch.zeros(1, 2, 1, B, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="sink and sink_of_seq together"):
        run_int4(b, cache, tail, slots, 1, sink=sink)
    with pytest.raises(ValueError, match="sink must be"):
        run_int4(b, cache, tail, slots, 1, sink=sink[:, :, :, :32], sink_of_seq=slots)
    with pytest.raises(ValueError, match="entries for 1 rows"):
        run_int4(b, cache, tail, slots, 1, sink=sink, sink_of_seq=slots[:0])


GPU_CASES = [
    ("decode_b8_8k_plus_13", [1] * 8, [8192 + 13] * 8, 32, 8, 128, {}),
    ("decode_d256_window", [1] * 4, [4096 + 5, 100, 3000, 64], 4, 1, 256,
     {"sliding_window": 512, "soft_cap": 30.0}),
    ("decode_d64_g3", [1] * 4, [2048, 1000, 3000, 5], 9, 3, 64, {}),
    ("prefill_2k_on_8k", [2048], [8192 + 7], 32, 8, 128, {}),
    ("mixed", [1, 300, 1, 77, 513], [5000, 300, 900, 1077, 2000], 32, 8, 128, {}),
    # the step a Gemma 3 int4 engine died on (illegal memory access, 2026-12-02): decodes at 8K
    # and a 2-token continuation completing page 127, on a full and on a sliding-window layer
    ("gemma3_step_full_layer", [1, 1, 1, 2], [8193, 8193, 8192, 8192], 4, 1, 256, {}),
    ("gemma3_step_window_layer", [1, 1, 1, 2], [8193, 8193, 8192, 8192], 4, 1, 256,
     {"sliding_window": 512}),
    # The full-layer case above faulted on the H200 (2026-12-02) in the decode configuration's
    # 16-row variant (queries of 2+ tokens, at most 16 rows: short continuations, speculative
    # tokens) while Triton compiled its dots to Hopper's wgmma (4 warps; it runs on 2 on sm90+
    # since, mma.sync as on sm80). The same variant at head sizes 128 and 64:
    ("decode_16_rows_d128", [2, 3, 1, 4], [8192, 4100, 8193, 300], 32, 8, 128, {}),
    ("decode_16_rows_d64", [2, 5, 1], [8192, 4100, 300], 9, 3, 64, {}),
    # complete last pages the step left in the tail: decode (split), a 16-token chunk, a 2-token
    # continuation, Gemma 3's head size with and without a window
    ("decode_b8_8k_tail_holds_last_page", [1] * 8, [8192] * 8, 32, 8, 128,
     {"held": tuple(range(8))}),
    ("chunk16_mixed_tail_holds_last_page", [1, 16, 16, 2], [4096, 4096, 8192, 640], 32, 8, 128,
     {"held": (0, 1, 2, 3)}),
    ("gemma3_step_window_layer_tail_holds_last_page", [1, 1, 1, 2], [8193, 8192, 8192, 8192], 4,
     1, 256, {"sliding_window": 512, "held": (1, 3)}),
    ("gemma3_step_full_layer_tail_holds_last_page", [1, 1, 1, 2], [8193, 8192, 8192, 8192], 4,
     1, 256, {"held": (1, 3)}),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_int4_attention_matches_reference_gpu(case):
    _, q_lens, seq_lens, nq, nkv, d, kw = case
    check(q_lens, seq_lens, nq, nkv, d, "cuda", **kw)


# Real sizes with a sink page: decode at 8K (split by the heuristic; rows without a sink, a
# 64-token row whose tail holds page 0), a continuation batch (chunks on a full page 0, a fresh
# prompt, a 2-token continuation), Gemma 3's head size with a window (page 0 behind it for the
# long rows, inside it for the short)
GPU_SINK_CASES = [
    ("decode_b8_8k", [1] * 8, [8192 + 13] * 6 + [64, 3000], 32, 8, 128,
     [0, 1, -1, 2, 3, -1, 4, 5], {"held": (6,)}),
    ("continuation_mixed", [1, 300, 16, 2, 513], [5000, 300, 4096, 640, 2000], 32, 8, 128,
     [0, 1, 2, 3, -1], {}),
    ("gemma3_window_d256", [1, 1, 2, 1], [8193, 300, 8192, 500], 4, 1, 256, [0, 1, 2, 3],
     {"sliding_window": 512}),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_SINK_CASES, ids=[c[0] for c in GPU_SINK_CASES])
def test_int4_sink_matches_reference_gpu(case):
    _, q_lens, seq_lens, nq, nkv, d, sinks, kw = case
    check_sink(q_lens, seq_lens, nq, nkv, d, "cuda", sinks, **kw)
