"""int4 with a tail of two pages (``INT8KV_INT4_TAIL_PAGES=2``): the sequence's newest page and the
one before it in the model's dtype, page pg in half pg % 2 of its slot (reference_int4.py).

The write is checked against the reference bit for bit (cache, tail, tail_page from random bytes);
attention against the reference within kvbatch's bf16 bound, with data where reading a page in
int4 instead of exact is far outside that bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from kvbatch import assert_close_bf16, make_batch
from test_int4_attention import random_int4_cache
from test_int4_write import random_pool

from int8kv_kernels import attention_plan, paged_attention_int4, write_kv_cache
from int8kv_kernels.launch import clear_replays
from int8kv_kernels.page_layout import Int4PageLayout
from int8kv_kernels.reference import attention_ref
from int8kv_kernels.reference_int4 import (
    page_views,
    paged_attention_int4_ref,
    quantize_page,
    tail_start,
    write_kv_cache_int4_ref,
)

B = 64


@dataclass
class Pool2:
    """A cache and a two-page tail pool of random bytes; ``pages`` 1 gives today's one-page pool."""

    nkv: int
    d: int
    num_blocks: int = 16
    num_slots: int = 4
    pages: int = 2
    dtype: torch.dtype = torch.bfloat16
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    cache: torch.Tensor = field(init=False)
    tail: torch.Tensor = field(init=False)
    tail_page: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.cache, self.tail, self.tail_page = random_pool(
            self.nkv, self.d, self.num_blocks, self.num_slots, self.dtype, self.device, self.pages
        )


def _i32(pool, x):
    return torch.as_tensor(x, dtype=torch.int32).to(pool.device)


def _args(pool, q_lens, seq_lens, table, slots, new, pad_rows=0):
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return dict(
        block_size=B, query_start_loc=_i32(pool, qsl), seq_lens=_i32(pool, seq_lens),
        block_table=_i32(pool, table), slot_of_seq=_i32(pool, slots + [3] * pad_rows),
        slot_is_new=_i32(pool, new + [1] * pad_rows), num_seqs=len(q_lens),
        max_query_len=max(q_lens),
    )  # fmt: skip


def _ref_write(pool, key, value, q_lens, seq_lens, table, slots, new):
    kw = _args(pool, q_lens, seq_lens, table, slots, new)
    write_kv_cache_int4_ref(key, value, pool.cache, pool.tail, pool.tail_page, **kw)


def _write(pool, key, value, q_lens, seq_lens, table, slots, new, pad_rows=0):
    """One step through the kernel and the reference; they must agree bit for bit on the cache,
    the tail and tail_page (the kernel's result stays in ``pool``)."""
    kw = _args(pool, q_lens, seq_lens, table, slots, new, pad_rows)
    key, value = key.to(pool.device), value.to(pool.device)
    want = (pool.cache.clone(), pool.tail.clone(), pool.tail_page.clone())
    write_kv_cache_int4_ref(key, value, *want, **kw)
    write_kv_cache(key, value, pool.cache, None, kv_dtype="int4", tail=pool.tail,
                   tail_page=pool.tail_page, **kw)  # fmt: skip
    assert torch.equal(pool.cache, want[0]), "int4 pages differ from the reference"
    assert torch.equal(pool.tail.view(torch.int16), want[1].view(torch.int16)), "tails differ"
    assert torch.equal(pool.tail_page, want[2]), (pool.tail_page, want[2])


def _kv(n, pool, scale=1.0):
    k = (torch.randn(n, pool.nkv, pool.d) * scale).to(pool.dtype)
    v = (torch.randn(n, pool.nkv, pool.d) * scale).to(pool.dtype)
    return k.to(pool.device), v.to(pool.device)


def _assert_page(pool, block, k, v):
    views = page_views(pool.cache, Int4PageLayout(B, pool.nkv, pool.d))
    want = quantize_page(Int4PageLayout(B, pool.nkv, pool.d), k, v)
    for got, w in zip((x[block] for x in views), want, strict=True):
        assert torch.equal(got.contiguous().cpu().view(torch.uint8),
                           w.contiguous().cpu().view(torch.uint8))  # fmt: skip


def _assert_half(pool, slot, pg, k, v):
    """Half pg % 2 of the slot holds page pg's rows k, v (the page's first len(k) positions)."""
    h = (pg % 2) * B
    n = k.shape[0]
    assert torch.equal(pool.tail[slot, 0, :, h : h + n], k.transpose(0, 1))
    assert torch.equal(pool.tail[slot, 1, :, h : h + n], v.transpose(0, 1))


# --------------------------------------------------------------------------------------------------
# The reference (the specification), checked by hand


def test_reference_decode_keeps_the_page_before_the_newest():
    pool = Pool2(nkv=2, d=64)
    k, v = _kv(200, pool)
    table = [[5, 9, 2, 7]]
    for t in range(200):  # one token a step, slot 1, new at the first step only
        _ref_write(pool, k[t : t + 1], v[t : t + 1], [1], [t + 1], table, [1], [int(t == 0)])
        last = t // B
        held = pool.tail_page[1].tolist()
        assert held[last % 2] == table[0][last]
        # the page before the newest: its half names it from the step that started the newest
        assert held[(last + 1) % 2] == (table[0][last - 1] if last else -1)
        p0 = last * B
        _assert_half(pool, 1, last, k[p0 : t + 1], v[p0 : t + 1])
        if last:
            _assert_half(pool, 1, last - 1, k[p0 - B : p0], v[p0 - B : p0])
    for pg in range(3):  # every complete page is quantized all the same
        _assert_page(pool, table[0][pg], k[pg * B : (pg + 1) * B], v[pg * B : (pg + 1) * B])


def test_reference_new_slot_holds_no_page_before_its_first_step():
    # a prefix-cache hit of two pages (ctx 128), a fresh slot: the page before the newest is in
    # the cache, not the slot (whose halves name old blocks of someone else's)
    pool = Pool2(nkv=1, d=64)
    k, v = _kv(10, pool)
    pool.tail_page[0] = torch.tensor([7, 3], dtype=torch.int32)
    _ref_write(pool, k, v, [10], [138], [[4, 3, 7]], [0], [1])
    assert pool.tail_page[0].tolist() == [7, -1]
    # the same step on the slot's own sequence: page 1 (block 3) untouched and still named
    pool.tail_page[0] = torch.tensor([7, 3], dtype=torch.int32)
    _ref_write(pool, k, v, [10], [138], [[4, 3, 7]], [0], [0])
    assert pool.tail_page[0].tolist() == [7, 3]


def test_reference_chunk_over_three_pages_keeps_its_last_two():
    pool = Pool2(nkv=2, d=64)
    k, v = _kv(300, pool)
    table = [[1, 6, 8, 10, 11]]
    _ref_write(pool, k[:100], v[:100], [100], [100], table, [2], [1])
    assert pool.tail_page[2].tolist() == [1, 6]  # page 0 (complete), page 1 (36 rows)
    # pages 1 (from the tail's 36 rows), 2, 3 complete, page 4 partial: pages 3 and 4 kept
    _ref_write(pool, k[100:270], v[100:270], [170], [270], table, [2], [0])
    assert pool.tail_page[2].tolist() == [11, 10]
    _assert_half(pool, 2, 3, k[192:256], v[192:256])
    _assert_half(pool, 2, 4, k[256:270], v[256:270])
    for pg in range(4):
        _assert_page(pool, table[0][pg], k[pg * B : (pg + 1) * B], v[pg * B : (pg + 1) * B])


def test_reference_tail_start():
    # (seq_len, slot's entries) -> the first key read from the tail; table: blocks 10, 11, 12
    row = [10, 11, 12]
    assert tail_start(130, 0, row, [-1, -1], B, 2) == 128  # nothing named: the partial page
    assert tail_start(130, 0, row, [12, 11], B, 2) == 64  # page 1 named by half 1
    assert tail_start(128, 0, row, [10, 11], B, 2) == 0  # a held complete page 1 and page 0
    assert tail_start(128, 0, row, [-1, 11], B, 2) == 64
    assert tail_start(128, 0, row, [10, -1], B, 2) == 128  # page 1 not held: nothing
    assert tail_start(128, -1, row, [10, 11], B, 2) == 128  # no slot
    assert tail_start(30, 0, row, [10, -1], B, 2) == 0
    assert tail_start(128, 0, row, [11], B, 1) == 64  # one page: the newest only
    assert tail_start(130, 0, row, [12], B, 1) == 128


# --------------------------------------------------------------------------------------------------
# The write kernels == the reference, bit for bit


@pytest.mark.parametrize(("nkv", "d", "dtype"), [(2, 64, torch.bfloat16), (1, 256, torch.float16)])
def test_write_decode_across_two_page_boundaries(nkv, d, dtype):
    pool = Pool2(nkv=nkv, d=d, dtype=dtype)
    k, v = _kv(135, pool)
    table = [[5, 9, 2, 7]]
    for t in range(135):
        _write(pool, k[t : t + 1], v[t : t + 1], [1], [t + 1], table, [1], [int(t == 0)])
    assert pool.tail_page[1].tolist() == [2, 9]
    _assert_half(pool, 1, 1, k[64:128], v[64:128])
    _assert_half(pool, 1, 2, k[128:135], v[128:135])


def test_write_chunks_spanning_pages_and_16_token_chunks():
    pool = Pool2(nkv=2, d=64)
    k, v = _kv(400, pool)
    table = [[1, 6, 8, 10, 11, 12, 13]]
    _write(pool, k[:100], v[:100], [100], [100], table, [2], [1])
    _write(pool, k[100:270], v[100:270], [170], [270], table, [2], [0])  # pages 1..3, 4 partial
    for end in range(286, 399, 16):  # 16 tokens a step, over the ends of pages 4 and 5, to 398
        _write(pool, k[end - 16 : end], v[end - 16 : end], [16], [end], table, [2], [0])
    assert pool.tail_page[2].tolist() == [13, 12]
    _assert_half(pool, 2, 5, k[320:384], v[320:384])
    _assert_half(pool, 2, 6, k[384:398], v[384:398])
    for pg in range(6):
        _assert_page(pool, table[0][pg], k[pg * B : (pg + 1) * B], v[pg * B : (pg + 1) * B])


@pytest.mark.parametrize("new", [0, 1])
def test_write_new_slot_invalidates_both_halves(new):
    # the slot's halves name this row's blocks (as a stale slot of a finished request may, blocks
    # being reused): only a slot that is not new keeps them
    pool = Pool2(nkv=2, d=64)
    k, v = _kv(130 + 1, pool)
    table = [[4, 3, 7]]
    _write(pool, k[:130], v[:130], [130], [130], table, [0], [1])
    assert pool.tail_page[0].tolist() == [7, 3]
    _write(pool, k[130:], v[130:], [1], [131], table, [0], [new])
    assert pool.tail_page[0].tolist() == ([7, -1] if new else [7, 3])


def test_write_mixed_batch_prefix_hits_padding_and_slotless_rows():
    pool = Pool2(nkv=3, d=64, num_blocks=24, num_slots=8)
    q_lens = [1, 1, 1, 150, 10, 1, 70, 2]
    seq_lens = [65, 128, 64, 150, 138, 200, 70, 192]
    table = [[1, 2, 0, 0], [3, 4, 0, 0], [5, 0, 0, 0], [6, 7, 8, 0], [9, 10, 11, 0],
             [12, 13, 14, 15], [16, 17, 0, 0], [18, 19, 20, 0]]  # fmt: skip
    slots = [0, 1, 2, 3, 4, -1, 5, 6]
    new = [0, 0, 1, 1, 1, 0, 1, 0]
    # rows 0, 1, 7 hold their pages from earlier steps (row 7's page 1 in half 1, partial page 2
    # of 62 rows in half 0); row 2 a full prefix-cache hit of page 0; row 4 a hit of two pages
    pool.tail_page[0] = torch.tensor([1, -1], dtype=torch.int32)
    pool.tail_page[1] = torch.tensor([3, 4], dtype=torch.int32)
    pool.tail_page[2] = torch.tensor([5, 5], dtype=torch.int32)
    pool.tail_page[4] = torch.tensor([11, 10], dtype=torch.int32)
    pool.tail_page[6] = torch.tensor([20, 19], dtype=torch.int32)
    k, v = _kv(sum(q_lens) + 4, pool)
    _write(pool, k, v, q_lens, seq_lens, table, slots, new, pad_rows=2)
    got = pool.tail_page.tolist()
    assert got[0] == [1, 2] and got[1] == [3, 4] and got[2] == [-1, -1]
    assert got[3] == [8, 7] and got[4] == [11, -1] and got[5] == [16, 17] and got[6] == [20, 19]
    assert got[7] == [-1, -1]  # the slot-less row's slot (7) is untouched


def test_write_two_page_tail_shape_is_checked():
    pool = Pool2(nkv=2, d=64)
    k, v = _kv(1, pool)
    kw = _args(pool, [1], [1], [[0]], [0], [1])
    with pytest.raises(ValueError, match=r"tail_page must be int32 \[4, 2\]"):
        write_kv_cache(k, v, pool.cache, None, kv_dtype="int4", tail=pool.tail,
                       tail_page=pool.tail_page[:, 0].contiguous(), **kw)  # fmt: skip
    with pytest.raises(ValueError, match="tail must be"):
        write_kv_cache(k, v, pool.cache, None, kv_dtype="int4", tail=pool.tail[:, :, :, :96],
                       tail_page=pool.tail_page, **kw)  # fmt: skip


@pytest.mark.gpu
def test_write_real_size_gpu():
    # decode rows at and past page ends (their halves naming their pages), prompts of 1000 and
    # 333 tokens on 800 cached: 32 rows, 30 pages each
    pool = Pool2(nkv=8, d=128, num_blocks=1000, num_slots=40, device="cuda")
    q_lens = [1] * 30 + [1000, 333]
    seq_lens = [64 * (i + 1) - (i % 3) + 1 for i in range(30)] + [1000, 1133]
    table = torch.randperm(1000)[: 32 * 30].view(32, 30)
    for r in range(30):
        last = (seq_lens[r] - 1) // B
        row = [int(table[r, last]), int(table[r, last - 1]) if last else -1]
        pool.tail_page[r] = torch.tensor(row if last % 2 == 0 else row[::-1], dtype=torch.int32)
    k = torch.randn(sum(q_lens), 8, 128, device="cuda", dtype=torch.bfloat16)
    _write(pool, k, torch.randn_like(k), q_lens, seq_lens, table, list(range(32)),
           [0] * 30 + [1, 0])  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Attention == the reference; the page before the newest read from its half


def two_page_entries(b, seq_lens, slots, num_slots, held=(), prev=(), device="cpu"):
    """tail_page [slots, 2] as the write leaves it: a partial last page's block in its half, a
    complete last page's when the row is in ``held``; the page before the newest in its half when
    the row is in ``prev`` (the slot's own sequence; else a new slot: -1)."""
    tail_page = torch.full((num_slots, 2), -1, dtype=torch.int32)
    for r, (n, s) in enumerate(zip(seq_lens, slots, strict=False)):
        if s < 0 or not n:
            continue
        last = (n - 1) // B
        if n % B or r in held:
            tail_page[s, last % 2] = int(b.block_table[r, last])
            if last and r in prev:
                tail_page[s, (last - 1) % 2] = int(b.block_table[r, last - 1])
    return tail_page.to(device)


def poison_unread_rows(tail, b, seq_lens, slots, tail_page):
    """NaN in every tail row a row's attention must not read (its slot's rows before
    tail_start and past its last key), so reading one shows."""
    for r, (n, s) in enumerate(zip(seq_lens, slots, strict=False)):
        if s < 0:
            continue
        start = tail_start(n, s, b.block_table[r].tolist(), tail_page[s].tolist(), B, 2)
        read = torch.zeros(2 * B, dtype=torch.bool)
        for p in range(start, n):
            read[p % (2 * B)] = True
        tail[s, :, :, ~read.to(tail.device)] = float("nan")


def run2(b, cache, tail, tail_page, slots, nkv, **kw):
    out = torch.full_like(b.query, float("nan"))
    paged_attention_int4(
        b.query, cache, out, block_size=B, num_kv_heads=nkv, query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens, block_table=b.block_table, max_query_len=b.max_query_len,
        max_seq_len=b.max_seq_len, softmax_scale=b.query.shape[-1] ** -0.5, tail=tail,
        tail_page=tail_page, slot_of_seq=slots, **kw,
    )  # fmt: skip
    return out


def ref2(b, cache, tail, tail_page, slots, **kw):
    kw = {n: x for n, x in kw.items() if n not in ("num_splits", "workspace")}
    ref = paged_attention_int4_ref(
        b.query, cache, block_size=B, query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
        block_table=b.block_table, softmax_scale=b.query.shape[-1] ** -0.5, tail=tail,
        tail_page=tail_page, slot_of_seq=slots, **kw,
    )  # fmt: skip
    return ref[: int(b.query_start_loc[-1])]


def check2(q_lens, seq_lens, nq, nkv, d, device, slots=None, held=(), prev=(), sinks=None,
           q_std=1.0, **kw):  # fmt: skip
    b = make_batch(q_lens, seq_lens, nq, d, B, device, q_std=q_std)
    slots = list(range(len(seq_lens))) if slots is None else slots
    num_slots = max([*slots, 0]) + 1
    cache = random_int4_cache(nkv, d, b.num_blocks, device)
    tail = torch.randn(num_slots, 2, nkv, 2 * B, d, device=device).to(torch.bfloat16)
    tail_page = two_page_entries(b, seq_lens, slots, num_slots, held, prev, device)
    poison_unread_rows(tail, b, seq_lens, slots, tail_page)
    slot_t = torch.tensor(slots + [0] * 3, dtype=torch.int32, device=device)  # + padding rows
    if sinks is not None:
        kw.update(sink_args(b, q_lens, seq_lens, slots, tail_page, sinks, nkv, d, device,
                            kw.get("sliding_window")))  # fmt: skip
    out = run2(b, cache, tail, tail_page, slot_t, nkv, **kw)
    assert_close_bf16(out, ref2(b, cache, tail, tail_page, slot_t, **kw))
    return out


def sink_args(b, q_lens, seq_lens, slots, tail_page, sinks, nkv, d, device, window):
    """A sink per row that names one; NaN where attention must not read it (page 0 the tail's,
    or behind every query's window)."""
    sink = torch.randn(max([*sinks, 0]) + 1, 2, nkv, B, d).to(torch.bfloat16)
    for r, (q, n, s) in enumerate(zip(q_lens, seq_lens, sinks, strict=True)):
        mine = tail_page[slots[r]].tolist() if slots[r] >= 0 else []
        start = tail_start(n, slots[r], b.block_table[r].tolist(), mine, B, 2)
        hidden = window is not None and n - q - window + 1 >= B
        if s >= 0 and (start <= 0 or hidden):
            sink[s] = float("nan")
    sink_of_seq = torch.tensor(sinks + [0] * 3, dtype=torch.int32)
    return {"sink": sink.to(device), "sink_of_seq": sink_of_seq.to(device)}


# (name, q_lens, seq_lens, nq, nkv, head_size, extra kwargs). ``prev``: rows whose slot holds the
# page before the newest; ``held``: rows whose complete last page their slot holds.
CASES2 = [
    ("decode_prev_page_held_or_not", [1, 1, 1, 1], [130, 129, 200, 70], 8, 2, 64,
     {"prev": (0, 2, 3)}),
    ("decode_completed_page_and_the_one_before", [1, 1, 1], [128, 192, 64], 8, 2, 64,
     {"held": (0, 1, 2), "prev": (0, 1, 2)}),
    # split boundaries every 64 or 128 keys: one may fall between the two tail pages
    ("decode_splits_cut_the_tail", [1, 1, 1], [200, 256, 330], 8, 2, 128,
     {"held": (1,), "prev": (0, 1, 2), "num_splits": 3}),
    ("decode_split_4_gqa8_d128", [1, 1], [300, 130], 8, 1, 128,
     {"prev": (0, 1), "num_splits": 4}),
    ("decode_d256_two_v_groups", [1, 1], [130, 40], 4, 2, 256, {"prev": (0,), "num_splits": 2}),
    ("decode_16_rows_speculative", [3, 2, 4], [333, 190, 64], 8, 2, 64,
     {"prev": (0, 1), "held": (2,), "num_splits": 2}),
    ("window_reaches_into_the_tail", [1, 1, 1], [200, 150, 128], 4, 1, 64,
     {"prev": (0, 1, 2), "held": (2,), "sliding_window": 50, "num_splits": 2}),
    ("window_decode_d256", [1, 1], [460, 250], 4, 1, 256,
     {"prev": (0, 1), "sliding_window": 150, "num_splits": 2}),
    ("chunked_prefill_spanning_pages", [70, 1, 100], [200, 90, 180], 8, 2, 128,
     {"prev": (0, 1, 2)}),
    ("chunk16_completes_page", [16, 16, 16], [128, 192, 80], 4, 2, 64,
     {"held": (0, 1), "prev": (0, 1, 2)}),
    ("prefill_fresh", [150, 20], [150, 20], 4, 2, 64, {"prev": (0,)}),
    ("sliding_window_prefill", [100, 1], [180, 129], 4, 2, 64,
     {"prev": (0, 1), "sliding_window": 50}),
    ("mixed_d256_window", [1, 9, 40], [128, 192, 640], 4, 2, 256,
     {"held": (0, 1, 2), "prev": (0, 1, 2), "sliding_window": 100}),
    ("soft_cap", [1, 30], [150, 90], 4, 1, 128, {"prev": (0, 1), "soft_cap": 3.0}),
    ("slot_minus_one", [1, 1, 3], [130, 30, 150], 4, 1, 64, {"slots": [1, -1, 0], "prev": (0, 2)}),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES2, ids=[c[0] for c in CASES2])
def test_two_page_attention_matches_reference(case, device):
    _, q_lens, seq_lens, nq, nkv, d, kw = case
    check2(q_lens, seq_lens, nq, nkv, d, device, q_std=2.0 if "soft_cap" in kw else 1.0, **kw)


# (name, q_lens, seq_lens, nq, nkv, head_size, sinks, extra kwargs)
SINK_CASES2 = [
    # page 0 the tail's (the page before the newest, or the newest), or in the cache
    ("decode_mixed", [1, 1, 1, 1, 1], [200, 130, 64, 100, 130], 8, 2, 64, [0, -1, 1, 2, 3],
     {"held": (2,), "prev": (0, 1, 3)}),
    ("decode_split_d256", [1, 1], [330, 192], 4, 2, 256, [0, 1],
     {"held": (1,), "prev": (0, 1), "num_splits": 4}),
    ("continuation_d128", [70, 1], [200, 90], 8, 2, 128, [0, 1], {"prev": (0, 1)}),
    ("window_decode_split", [1, 1, 1], [460, 150, 100], 4, 1, 64, [0, 1, 2],
     {"prev": (0, 1, 2), "sliding_window": 120, "num_splits": 2}),
]  # fmt: skip


@pytest.mark.parametrize("case", SINK_CASES2, ids=[c[0] for c in SINK_CASES2])
def test_two_page_attention_with_sink_matches_reference(case, device):
    _, q_lens, seq_lens, nq, nkv, d, sinks, kw = case
    check2(q_lens, seq_lens, nq, nkv, d, device, sinks=sinks, **kw)


def _through_the_write(device):
    """Sequence 0 decodes token by token to 130 (two page boundaries) through the two-page
    write; sequence 1 is a prefix-cache hit on its first two pages (a new slot) with two new
    tokens. Returns (batch, cache, tail, tail_page, slots, exact K/V slots)."""
    nq, nkv, d = 4, 1, 64
    b = make_batch([1, 2], [130, 130], nq, d, B, device)
    b.block_table[1, :2] = b.block_table[0, :2]  # the shared prefix pages
    pool = Pool2(nkv=nkv, d=d, num_blocks=b.num_blocks, num_slots=2, device=device)
    key = torch.randn(130, nkv, d, device=device).to(torch.bfloat16)
    value = torch.randn(130, nkv, d, device=device).to(torch.bfloat16)
    key2 = torch.randn(2, nkv, d, device=device).to(torch.bfloat16)
    value2 = torch.randn(2, nkv, d, device=device).to(torch.bfloat16)
    table = b.block_table.cpu()
    for t in range(130):
        _write(pool, key[t : t + 1], value[t : t + 1], [1], [t + 1], table[:1], [0], [int(t == 0)])
    _write(pool, key2, value2, [2], [130], table[1:], [1], [1])
    k_slots = torch.zeros(b.num_blocks, B, nkv, d, dtype=torch.bfloat16, device=device)
    v_slots = torch.zeros_like(k_slots)
    for r, (kk, vv) in enumerate(((key, value), (torch.cat([key[:128], key2]),
                                                  torch.cat([value[:128], value2])))):  # fmt: skip
        pos = torch.arange(130, device=device)
        idx = b.block_table[r, pos // B].long() * B + pos % B
        k_slots.view(-1, nkv, d)[idx] = kk
        v_slots.view(-1, nkv, d)[idx] = vv
    slots = torch.tensor([0, 1], dtype=torch.int32, device=device)
    return b, pool, slots, k_slots, v_slots


def test_decode_across_two_boundaries_reads_the_previous_page_exact(device):
    """Through the write: sequence 0 (its own slot since its first token) reads keys 64..129
    exact; sequence 1 (a new slot on the shared pages 0 and 1) reads page 1 in int4. With a
    window of 66 keys every key a query of sequence 0 sees is in the tail: the output is exact
    attention over the BF16 K/V up to bf16 rounding, while sequence 1's, reading int4 K/V, is
    off by far more (unit-variance K/V: about 0.08 of the output's RMS)."""
    b, pool, slots, k_slots, v_slots = _through_the_write(device)
    assert pool.tail_page.tolist() == [[int(b.block_table[0, 2]), int(b.block_table[0, 1])],
                                       [int(b.block_table[1, 2]), -1]]  # fmt: skip
    for kw in ({"sliding_window": 66}, {"sliding_window": 66, "num_splits": 2}, {}):
        out = run2(b, pool.cache, pool.tail, pool.tail_page, slots, 1, **kw).float()
        assert_close_bf16(out, ref2(b, pool.cache, pool.tail, pool.tail_page, slots, **kw))
        window = kw.get("sliding_window")
        exact = attention_ref(b.query, k_slots, v_slots, query_start_loc=b.query_start_loc,
                              seq_lens=b.seq_lens, block_table=b.block_table,
                              softmax_scale=64**-0.5, sliding_window=window)  # fmt: skip
        if window:
            assert_close_bf16(out[:1], exact[:1])  # sequence 0: nothing read in int4
        rms = exact[1:].pow(2).mean().sqrt()
        err = (out[1:] - exact[1:]).pow(2).mean().sqrt() / rms
        assert 0.02 < err < 0.2, float(err)  # sequence 1: page 1 (and 0) in int4


GPU_CASES2 = [
    ("decode_b8_8k_plus_13", [1] * 8, [8192 + 13] * 8, 32, 8, 128, {"prev": tuple(range(8))}),
    ("decode_b8_8k_completed_page", [1] * 8, [8192] * 8, 32, 8, 128,
     {"held": tuple(range(8)), "prev": tuple(range(0, 8, 2))}),
    ("chunk16_mixed", [1, 16, 16, 2, 300], [4096, 4096, 8192, 640, 300], 32, 8, 128,
     {"held": (0, 1, 2, 3), "prev": (0, 1, 2, 3, 4)}),
    ("gemma3_step_window_layer", [1, 1, 1, 2], [8193, 8192, 8192, 8192], 4, 1, 256,
     {"sliding_window": 512, "held": (1, 3), "prev": (0, 1, 3)}),
    ("gemma3_step_full_layer", [1, 1, 1, 2], [8193, 8192, 8192, 8192], 4, 1, 256,
     {"held": (1, 3), "prev": (0, 1, 2, 3)}),
    ("decode_16_rows_d64", [2, 5, 1], [8192, 4100, 300], 9, 3, 64, {"prev": (0, 1, 2)}),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES2, ids=[c[0] for c in GPU_CASES2])
def test_two_page_attention_matches_reference_gpu(case):
    _, q_lens, seq_lens, nq, nkv, d, kw = case
    check2(q_lens, seq_lens, nq, nkv, d, "cuda", **kw)


@pytest.mark.gpu
def test_two_page_attention_with_sink_gpu():
    check2([1, 1, 2, 1], [8193, 300, 8192, 100], 4, 1, 256, "cuda", sinks=[0, 1, 2, 3],
           prev=(0, 1, 2, 3), held=(2,), sliding_window=512)  # fmt: skip


@pytest.mark.gpu
def test_decode_across_two_boundaries_reads_the_previous_page_exact_gpu():
    test_decode_across_two_boundaries_reads_the_previous_page_exact("cuda")


@pytest.mark.parametrize(("hit_pages", "reads_as_the_miss"), [(4, False), (3, True)])
def test_a_hit_that_recomputes_the_page_before_the_newest_reads_what_the_miss_read(
    hit_pages, reads_as_the_miss
):
    # A 300-token prompt: pages 0..3 full, page 4 partial. Computed in full (the miss) it leaves
    # pages 3 and 4 in its slot. vLLM's prefix-cache hit takes the four full pages, so a request
    # with the same prompt in a new slot recomputes only page 4 and reads page 3 in 4 bits; a hit
    # one page shorter (the vLLM glue's, with two tail pages) recomputes page 3 into its slot too.
    pool = Pool2(nkv=2, d=64)
    k, v = _kv(300, pool)
    miss = [1, 2, 3, 4, 5]
    hit = miss[:hit_pages] + [9, 10, 11][: 5 - hit_pages]
    _write(pool, k, v, [300], [300], [miss], [0], [1])
    start = hit_pages * B
    _write(pool, k[start:], v[start:], [300 - start], [300], [hit], [1], [1])
    read_from_slot = [tail_start(300, s, row, pool.tail_page[s].tolist(), B, 2)
                      for s, row in enumerate((miss, hit))]  # fmt: skip
    assert read_from_slot == ([192, 192] if reads_as_the_miss else [192, 256])

    # the prompt's last query, on both rows: the same output bit for bit, or not
    nq = 4
    query = torch.randn(1, nq, pool.d).to(pool.dtype).expand(2, nq, pool.d).contiguous()
    kw = dict(block_size=B, query_start_loc=_i32(pool, [0, 1, 2]),
              seq_lens=_i32(pool, [300, 300]), block_table=_i32(pool, [miss, hit]),
              softmax_scale=pool.d**-0.5, tail=pool.tail, tail_page=pool.tail_page,
              slot_of_seq=_i32(pool, [0, 1]))  # fmt: skip
    ref = paged_attention_int4_ref(query.to(pool.device), pool.cache, **kw)
    out = torch.full_like(query, float("nan")).to(pool.device)
    paged_attention_int4(query.to(pool.device), pool.cache, out, num_kv_heads=pool.nkv,
                         max_query_len=1, max_seq_len=300, **kw)  # fmt: skip
    for got in (ref, out):
        assert torch.equal(got[0], got[1]) == reads_as_the_miss
    assert_close_bf16(out.float(), ref.float())


@pytest.mark.parametrize(("sms", "identical"), [(1, True), (132, False)])
def test_a_hits_recomputed_chunk_reads_the_misss_keys_and_only_the_split_can_differ(
    monkeypatch, sms, identical
):
    # A 1400-token prompt computed in one chunk (the miss), then in a new slot from the prefix
    # cache's 1280 tokens (21 full pages less the one a two-page tail gives back): the recomputed
    # 120 queries read the same keys from the same pages and tail rows as the miss's last 120.
    # Unsplit, every query's keys are walked in the same tiles, so the outputs are the same bits.
    # With an H100's 132 SMs the short chunk's 6 query blocks split their keys 8 ways and the long
    # one's 67 blocks 2 ways: the same sums in another order, which a prefix-cache hit therefore
    # changes for int4's (and int8's) prompts where BF16's FlashAttention-2 splits none.
    monkeypatch.setattr(attention_plan, "device_sms", lambda device: sms)
    clear_replays()  # a launch recorded under another SM count would replay its splits
    pool = Pool2(nkv=1, d=64, num_blocks=32)
    n, hit_tokens = 1400, 1280
    k, v = _kv(n, pool)
    miss = list(range(1, 23))
    hit = miss[:20] + [30, 31]
    _write(pool, k, v, [n], [n], [miss], [0], [1])
    _write(pool, k[hit_tokens:], v[hit_tokens:], [n - hit_tokens], [n], [hit], [1], [1])
    query = torch.randn(n, 3, pool.d).to(pool.dtype).to(pool.device)

    def attend(rows: slice, table: list[int], slot: int) -> torch.Tensor:
        q = query[rows].contiguous()
        out = torch.full_like(q, float("nan"))
        paged_attention_int4(q, pool.cache, out, num_kv_heads=1, block_size=B,
                             query_start_loc=_i32(pool, [0, q.shape[0]]),
                             seq_lens=_i32(pool, [n]), block_table=_i32(pool, [table]),
                             softmax_scale=pool.d**-0.5, tail=pool.tail, tail_page=pool.tail_page,
                             slot_of_seq=_i32(pool, [slot]), max_query_len=q.shape[0],
                             max_seq_len=n)  # fmt: skip
        return out

    computed = attend(slice(0, n), miss, 0)[hit_tokens:]
    recomputed = attend(slice(hit_tokens, n), hit, 1)
    assert torch.equal(computed, recomputed) == identical
    assert_close_bf16(recomputed.float(), computed.float())
