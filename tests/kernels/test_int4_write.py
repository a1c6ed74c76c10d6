"""int4: catalogue bytes, page layout, and the tail-aware cache write == torch reference bit for bit.

Every write test starts from a cache and a tail pool full of random bytes, so a byte the kernel
writes where the reference does not (or the other way round) fails the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from int8kv_kernels import Int4PageLayout, get_page_bytes, write_kv_cache
from int8kv_kernels.cache_write_int4 import tail_pool_shapes, write_sink_int4
from int8kv_kernels.catalogue import TAIL_DTYPES, get_dtype
from int8kv_kernels.reference_int4 import (
    dequantize_cache_int4,
    page_views,
    quantize_page,
    write_kv_cache_int4_ref,
    write_sink_int4_ref,
)

B = 64  # tokens per int4 page


@pytest.mark.parametrize(("d", "per_token", "ratio"), [(64, 72, 3.56), (128, 140, 3.66),
                                                       (256, 280, 3.66)])  # fmt: skip
def test_int4_bytes_per_token_and_capacity(d, per_token, ratio):
    cat = get_dtype("int4")
    # K and V codes D/2 each, K's per-channel (scale, zero) over 64 tokens, V's per group of 128
    assert per_token == d + 4 * d // 64 + 4 * (d // min(d, 128))
    assert cat.bytes_per_token_head(d) == per_token
    assert round(cat.capacity_vs_bf16(d), 2) == ratio
    assert cat.page_tokens == 64 and cat.tail and TAIL_DTYPES == ("int4",)


@pytest.mark.parametrize("nkv", [1, 3, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_int4_layout_matches_catalogue_and_aligns(nkv, d):
    lay = Int4PageLayout(B, nkv, d)
    assert (
        lay.page_bytes
        == get_dtype("int4").page_bytes(B, nkv, d)
        == get_page_bytes("int4", B, nkv, d)
    )
    assert (lay.k_data, lay.v_data, lay.k_sz) == (0, nkv * B * d // 2, nkv * B * d)
    assert lay.v_sz == lay.k_sz + 4 * nkv * d
    assert lay.page_bytes == lay.v_sz + 4 * nkv * B * lay.num_groups
    assert lay.num_groups == (2 if d == 256 else 1)
    # 16-byte rows and regions, in this page and the next
    for off in (lay.row_bytes, lay.v_data, lay.k_sz, lay.v_sz, lay.page_bytes, 4 * d):
        assert off % 16 == 0


def test_int4_layout_refuses_other_block_sizes_and_head_sizes():
    with pytest.raises(ValueError, match="pages hold 64 tokens"):
        Int4PageLayout(16, 2, 128)
    with pytest.raises(ValueError, match="power of two"):
        Int4PageLayout(B, 2, 96)
    with pytest.raises(ValueError, match="V group size"):
        Int4PageLayout(B, 2, 512)


def random_pool(
    nkv: int,
    d: int,
    num_blocks: int,
    num_slots: int,
    dtype: torch.dtype,
    device: str,
    pages: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cache, tail, tail_page) of random bytes, every slot's page entries -1: ``pages`` tail
    pages a slot (``tail_page`` [slots] for one, [slots, pages] for more)."""
    nbytes = get_page_bytes("int4", B, nkv, d)
    cache = torch.randint(-128, 128, (num_blocks, nbytes), dtype=torch.int8, device=device)
    shape, held = tail_pool_shapes(num_slots, nkv, d, pages, B)
    tail = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device=device).view(dtype)
    return cache, tail, torch.full(held, -1, dtype=torch.int32, device=device)


@dataclass
class Pool:
    """A cache and a tail pool of random bytes, the sequences' block tables, and every token's K/V
    so far (the ground truth the pages are checked against)."""

    nkv: int
    d: int
    num_blocks: int = 16
    num_slots: int = 4
    dtype: torch.dtype = torch.bfloat16
    # the kernels' device: the GPU where there is one (without the interpreter, Triton launches
    # nothing on CPU tensors), else the CPU under TRITON_INTERPRET=1
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    cache: torch.Tensor = field(init=False)
    tail: torch.Tensor = field(init=False)
    tail_page: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.cache, self.tail, self.tail_page = random_pool(
            self.nkv, self.d, self.num_blocks, self.num_slots, self.dtype, self.device
        )


def _write(pool: Pool, key, value, q_lens, seq_lens, table, slots, new, pad_rows: int = 0):
    """One step through the kernel and through the reference (on copies, on the pool's device);
    asserts they agree bit for bit on the cache, the tail and tail_page, and leaves the kernel's
    result in ``pool``. ``table``: a list of rows or a tensor."""
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)

    def i32(x):
        return torch.as_tensor(x, dtype=torch.int32).to(pool.device)

    kw = dict(
        block_size=B, query_start_loc=i32(qsl), seq_lens=i32(seq_lens), block_table=i32(table),
        # rows past the batch (CUDA-graph padding) hold garbage the kernels must not read
        slot_of_seq=i32(slots + [3] * pad_rows), slot_is_new=i32(new + [1] * pad_rows),
        num_seqs=len(q_lens), max_query_len=max(q_lens),
    )  # fmt: skip
    key, value = key.to(pool.device), value.to(pool.device)
    want = (pool.cache.clone(), pool.tail.clone(), pool.tail_page.clone())
    write_kv_cache_int4_ref(key, value, *want, **kw)
    write_kv_cache(key, value, pool.cache, None, kv_dtype="int4", tail=pool.tail,
                   tail_page=pool.tail_page, **kw)  # fmt: skip
    assert torch.equal(pool.cache, want[0]), "int4 pages differ from the reference"
    assert torch.equal(pool.tail.view(torch.int16), want[1].view(torch.int16)), "tails differ"
    assert torch.equal(pool.tail_page, want[2]), (pool.tail_page, want[2])


def _page_bytes_of(pool: Pool, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """The regions a page holding these 64 tokens' K/V must have."""
    return list(quantize_page(Int4PageLayout(B, pool.nkv, pool.d), k, v))


def _assert_page(pool: Pool, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
    views = page_views(pool.cache, Int4PageLayout(B, pool.nkv, pool.d))
    for got, want in zip((x[block] for x in views), _page_bytes_of(pool, k, v), strict=True):
        assert torch.equal(_bits(got).cpu(), _bits(want).cpu())


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.uint8)


def _kv(n: int, pool: Pool, scale: float = 1.0):
    k = (torch.randn(n, pool.nkv, pool.d) * scale).to(pool.dtype)
    v = (torch.randn(n, pool.nkv, pool.d) * scale).to(pool.dtype)
    return k.to(pool.device), v.to(pool.device)


def test_decode_fills_a_page_token_by_token_until_it_flushes():
    pool = Pool(nkv=2, d=64)
    k_all, v_all = _kv(66, pool)
    table = [[5, 9, 2]]
    for t in range(66):  # token t at position t; slot 1, new at the first step only
        _write(pool, k_all[t : t + 1], v_all[t : t + 1], [1], [t + 1], table, [1], [int(t == 0)])
        if t < 63:  # still partial: every token so far in the tail, the page's block recorded
            assert int(pool.tail_page[1]) == 5
            assert torch.equal(pool.tail[1, 0, :, : t + 1], k_all[: t + 1].transpose(0, 1))
            assert torch.equal(pool.tail[1, 1, :, : t + 1], v_all[: t + 1].transpose(0, 1))
        elif t == 63:  # the 64th token: the page is quantized and still held by the tail
            assert int(pool.tail_page[1]) == 5
            _assert_page(pool, 5, k_all[:64], v_all[:64])
            assert torch.equal(pool.tail[1, 0], k_all[:64].transpose(0, 1))
            assert torch.equal(pool.tail[1, 1], v_all[:64].transpose(0, 1))
        else:  # the next token starts page 9: the tail holds it, page 5 is read from the cache
            assert int(pool.tail_page[1]) == 9
    assert torch.equal(pool.tail[1, 0, :, :2], k_all[64:66].transpose(0, 1))
    _assert_page(pool, 5, k_all[:64], v_all[:64])


@pytest.mark.parametrize("end", [128, 192])
def test_a_chunk_ending_on_a_page_boundary_leaves_its_last_page_in_the_tail(end):
    # chunk 1 ends mid page 1; chunk 2 completes page 1 from the tail and new tokens (and, to 192,
    # page 2 from new tokens only), ending on a page boundary: the last page is quantized and
    # stays in the tail; the next step's token starts the next page
    pool = Pool(nkv=2, d=64)
    k, v = _kv(end + 1, pool)
    table = [[1, 6, 8, 10]]
    _write(pool, k[:100], v[:100], [100], [100], table, [3], [1])
    _write(pool, k[100:end], v[100:end], [end - 100], [end], table, [3], [0])
    last = end // B - 1
    assert int(pool.tail_page[3]) == table[0][last]
    assert torch.equal(pool.tail[3, 0], k[end - B : end].transpose(0, 1))
    assert torch.equal(pool.tail[3, 1], v[end - B : end].transpose(0, 1))
    for p in range(end // B):
        _assert_page(pool, table[0][p], k[p * B : (p + 1) * B], v[p * B : (p + 1) * B])
    _write(pool, k[end:], v[end:], [1], [end + 1], table, [3], [0])
    assert int(pool.tail_page[3]) == table[0][last + 1]
    assert torch.equal(pool.tail[3, 0, :, :1], k[end:].transpose(0, 1))
    _assert_page(pool, table[0][last], k[end - B : end], v[end - B : end])


def test_16_token_chunks_keep_every_last_page_in_the_tail():
    # the accuracy harness's way of scoring: 16 tokens a step; after each, the sequence's last
    # page (partial, or completed by that chunk) is the tail's
    pool = Pool(nkv=2, d=64)
    k, v = _kv(176, pool)
    table = [[3, 7, 2]]
    for end in range(16, 177, 16):
        _write(pool, k[end - 16 : end], v[end - 16 : end], [16], [end], table, [0],
               [int(end == 16)])  # fmt: skip
        p0 = (end - 1) // B * B
        assert int(pool.tail_page[0]) == table[0][p0 // B]
        assert torch.equal(pool.tail[0, 0, :, : end - p0], k[p0:end].transpose(0, 1))
        assert torch.equal(pool.tail[0, 1, :, : end - p0], v[p0:end].transpose(0, 1))
    _assert_page(pool, 3, k[:64], v[:64])
    _assert_page(pool, 7, k[64:128], v[64:128])


@pytest.mark.parametrize(("nkv", "d", "dtype"), [(2, 64, torch.bfloat16), (1, 128, torch.float16),
                                                 (2, 256, torch.bfloat16)])  # fmt: skip
def test_prefill_spanning_pages_ends_mid_page(nkv, d, dtype):
    pool = Pool(nkv=nkv, d=d, dtype=dtype)
    k, v = _kv(150 + 3, pool, scale=3.0)
    # a second sequence in the batch, decoding, and two padding rows past it
    _write(pool, k, v, [150, 3], [150, 3], [[7, 3, 11, 0], [4, 0, 0, 0]], [2, 0], [1, 1],
           pad_rows=2)  # fmt: skip
    _assert_page(pool, 7, k[:64], v[:64])
    _assert_page(pool, 3, k[64:128], v[64:128])
    assert torch.equal(pool.tail[2, 0, :, :22], k[128:150].transpose(0, 1))
    assert torch.equal(pool.tail[2, 1, :, :22], v[128:150].transpose(0, 1))
    assert pool.tail_page.tolist()[:3] == [4, -1, 11]


def test_chunked_prefill_continuation_starts_mid_page_and_completes_it():
    pool = Pool(nkv=2, d=64)
    k, v = _kv(200, pool)
    table = [[1, 6, 8, 10]]
    _write(pool, k[:100], v[:100], [100], [100], table, [3], [1])  # page 1 partial: 36 tokens
    assert int(pool.tail_page[3]) == 6
    # the next chunk completes page 1 from the tail's 36 rows and 28 new tokens, writes page 2
    # straight from key/value, and leaves 8 tokens of page 3 in the tail (over page 1's rows)
    _write(pool, k[100:], v[100:], [100], [200], table, [3], [0])
    _assert_page(pool, 1, k[:64], v[:64])
    _assert_page(pool, 6, k[64:128], v[64:128])
    _assert_page(pool, 8, k[128:192], v[128:192])
    assert int(pool.tail_page[3]) == 10
    assert torch.equal(pool.tail[3, 0, :, :8], k[192:200].transpose(0, 1))


@pytest.mark.parametrize("case", ["slot_is_new", "tail_of_another_page", "no_slot"])
def test_a_full_page_whose_tail_rows_are_not_its_own_is_left_untouched(case):
    # A prefix-cache hit on a full page: vLLM recomputes its last token (ctx 63, one new token,
    # seq_len 64); the slot's rows are not that page's, so the page keeps the bytes it holds.
    pool = Pool(nkv=2, d=64)
    k, v = _kv(64, pool)
    _write(pool, k, v, [64], [64], [[4, 0]], [0], [1])  # the page, written whole
    assert int(pool.tail_page[0]) == 4  # and held by its writer's slot
    before = pool.cache.clone()
    slot, new = {"slot_is_new": (2, 1), "tail_of_another_page": (2, 0), "no_slot": (-1, 0)}[case]
    pool.tail_page[2] = 4 if case == "slot_is_new" else 9
    k2, v2 = _kv(1, pool, scale=5.0)
    _write(pool, k2, v2, [1], [64], [[4, 0]], [slot], [new])
    assert torch.equal(pool.cache, before)
    if slot >= 0:  # the last page is full and was not written: the slot holds nothing
        assert int(pool.tail_page[slot]) == -1


def test_slot_minus_one_rows_write_nothing():
    pool = Pool(nkv=2, d=64)
    tail, tail_page, cache = pool.tail.clone(), pool.tail_page.clone(), pool.cache.clone()
    k, v = _kv(70 + 5 + 1, pool)
    # slot-less rows (a dummy run over a block table that still holds live requests' pages): not
    # the full page a prefill completes, nor the partial pages' tokens, nor a decode row's
    _write(pool, k, v, [70, 5, 1], [70, 5, 30], [[2, 3], [5, 6], [7, 8]], [-1, -1, -1],
           [0, 1, 0])  # fmt: skip
    assert torch.equal(pool.tail.view(torch.int16), tail.view(torch.int16))
    assert torch.equal(pool.tail_page, tail_page)
    assert torch.equal(pool.cache, cache)
    # the same prefill with a slot writes its full page
    _write(pool, k[:70], v[:70], [70], [70], [[2, 3]], [0], [1])
    _assert_page(pool, 2, k[:64], v[:64])


def test_sequences_without_new_tokens_and_mixed_batches():
    pool = Pool(nkv=3, d=64, num_slots=6)
    k, v = _kv(64 + 1 + 130, pool)
    pool.tail_page[5] = 12  # seq 1 decodes at position 40 of its page 12: rows 0..39 are its own
    _write(pool, k, v, [64, 0, 1, 130], [64, 41, 41, 130], [[1, 0, 0], [12, 0, 0], [12, 0, 0], [3, 4, 5]],
           [0, 4, 5, 1], [1, 0, 0, 1])  # fmt: skip
    _assert_page(pool, 1, k[:64], v[:64])
    # seq 0's page 1, complete and written this step, stays in its tail
    assert pool.tail_page.tolist() == [1, 5, -1, -1, -1, 12]


def test_nan_flags_only_its_k_channel_and_v_token():
    pool = Pool(nkv=1, d=64)
    k, v = _kv(64, pool)
    k[10, 0, 3] = float("nan")
    v[20, 0, 40] = float("inf")
    _write(pool, k, v, [64], [64], [[0]], [0], [1])
    kk, vv = dequantize_cache_int4(pool.cache, block_size=B, num_kv_heads=1, head_size=64)
    assert kk[0, :, 0, 3].isnan().all() and not kk[0, :, 0, :3].isnan().any()
    assert vv[0, 20, 0].isnan().all() and not vv[0, 19, 0].isnan().any()


def test_constant_and_huge_values_stay_finite():
    pool = Pool(nkv=1, d=64)
    k = torch.full((64, 1, 64), 2.5, dtype=torch.bfloat16)
    v = (torch.randn(64, 1, 64) * 1e6).to(torch.bfloat16)  # beyond fp16's range: saturates
    _write(pool, k, v, [64], [64], [[0]], [0], [1])
    kk, vv = dequantize_cache_int4(pool.cache, block_size=B, num_kv_heads=1, head_size=64)
    # a constant channel: scale 0, dequantizes to its zero exactly
    assert torch.equal(kk[0].cpu(), k.float())
    assert vv[0].isfinite().all()  # (the other pages hold random bytes)


def test_int4_write_rejects_bad_tails_and_static_scales():
    pool = Pool(nkv=2, d=64)
    k, v = _kv(1, pool)
    kw = dict(block_size=B, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
              seq_lens=torch.tensor([1], dtype=torch.int32),
              block_table=torch.zeros(1, 1, dtype=torch.int32),
              slot_of_seq=torch.zeros(1, dtype=torch.int32),
              slot_is_new=torch.zeros(1, dtype=torch.int32), num_seqs=1, max_query_len=1)  # fmt: skip
    with pytest.raises(ValueError, match="tail must be"):
        write_kv_cache(k, v, pool.cache, None, kv_dtype="int4", tail=pool.tail[:, :, :1],
                       tail_page=pool.tail_page, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="static scales"):
        write_kv_cache(k, v, pool.cache, None, kv_dtype="int4", tail=pool.tail,
                       tail_page=pool.tail_page, k_scale=torch.ones(2), **kw)  # fmt: skip
    with pytest.raises(ValueError, match="pages hold 64 tokens"):
        write_kv_cache(k, v, pool.cache, None, kv_dtype="int4", tail=pool.tail,
                       tail_page=pool.tail_page, **{**kw, "block_size": 16})  # fmt: skip


# (q_len, seq_len, sink) rows of one step: decode rows before and past position 64, a prefill
# chunk crossing 64, a chunk entirely past it, a whole prompt under 64, rows without a sink, a
# row without new tokens; then two padding rows (past num_seqs: tokens, a sink, but no request)
SINK_ROWS = [(1, 5, 0), (1, 64, 1), (1, 65, 2), (50, 80, 3), (20, 90, 4), (40, 40, 5),
             (1, 10, -1), (70, 70, -1), (0, 30, 7), (3, 40, 6), (4, 4, 6)]  # fmt: skip


@pytest.mark.parametrize(("nkv", "d", "dtype"), [(3, 64, torch.bfloat16), (2, 128, torch.float16),
                                                 (1, 256, torch.bfloat16)])  # fmt: skip
def test_sink_write_matches_reference_bit_for_bit(nkv, d, dtype):
    dev = Pool(nkv=1, d=64).device
    q_lens, seq_lens, sinks = (list(x) for x in zip(*SINK_ROWS, strict=True))
    num_seqs = len(q_lens) - 2
    n = sum(q_lens[:num_seqs])
    key = torch.randn(n + 7, nkv, d).to(torch.bfloat16).to(dev)  # + the padding rows' tokens
    value = torch.randn_like(key)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    # random bits everywhere: a byte written where the reference writes none (or not written where
    # it writes one) differs
    sink = torch.randint(-(2**15), 2**15, (8, 2, nkv, B, d), dtype=torch.int16).view(dtype)
    sink = sink.to(dev)
    kw = dict(query_start_loc=qsl.to(dev), seq_lens=torch.tensor(seq_lens, dtype=torch.int32,
              device=dev), num_seqs=num_seqs)  # fmt: skip
    sink_of_seq = torch.tensor(sinks, dtype=torch.int32, device=dev)
    want = sink.clone()
    write_sink_int4_ref(key, value, want, sink_of_seq, **kw)
    before = sink.clone()
    write_sink_int4(key, value, sink, sink_of_seq, **kw)
    assert torch.equal(sink.view(torch.int16), want.view(torch.int16))
    # what the reference wrote, by hand: row 3 (ctx 30, 50 tokens) fills positions 30..63 of
    # sink 3 from its first 34 tokens; row 4 (ctx 70) and the rows past num_seqs write nothing
    t0 = int(qsl[3])
    for kv, x in enumerate((key, value)):
        assert torch.equal(
            sink[3, kv, :, 30:].cpu(), x[t0 : t0 + 34].transpose(0, 1).to(dtype).cpu()
        )
    assert torch.equal(sink[3, :, :, :30].view(torch.int16), before[3, :, :, :30].view(torch.int16))
    for untouched in (4, 6, 7):
        assert torch.equal(sink[untouched].view(torch.int16), before[untouched].view(torch.int16))
    assert torch.equal(sink[1, 0, :, 63].cpu(), key[int(qsl[1])].to(dtype).cpu())
    assert torch.equal(sink[2].view(torch.int16), before[2].view(torch.int16))  # position 64


def test_sink_write_refuses_bad_shapes():
    k = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    kw = dict(query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
              seq_lens=torch.tensor([1], dtype=torch.int32), num_seqs=1)  # fmt: skip
    ok = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="sink must be"):
        write_sink_int4(k, k, torch.zeros(1, 2, 1, B, 64, dtype=torch.bfloat16), ok, **kw)
    with pytest.raises(ValueError, match="sink_of_seq must be int32"):
        write_sink_int4(k, k, torch.zeros(1, 2, 2, B, 64, dtype=torch.bfloat16), ok.long(), **kw)
    with pytest.raises(ValueError, match="entries for 1 rows"):
        write_sink_int4(k, k, torch.zeros(1, 2, 2, B, 64, dtype=torch.bfloat16), ok[:0], **kw)


@pytest.mark.gpu
def test_int4_write_real_size_gpu():
    # decode rows reach 30 pages (64 * 30 tokens): a table of 30 columns, 32 * 30 distinct pages
    pool = Pool(nkv=8, d=128, num_blocks=1000, num_slots=40, device="cuda")
    q_lens = [1] * 30 + [1000, 333]
    seq_lens = [64 * (i + 1) - (i % 3) for i in range(30)] + [1000, 800]
    table = torch.randperm(1000)[: 32 * 30].view(32, 30)
    n = sum(q_lens)
    k = torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pool.tail_page[:30] = table[:30, 0].int().cuda()  # decode rows' own (garbage) tails
    _write(pool, k, v, q_lens, seq_lens, table, list(range(32)), [0] * 30 + [1, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 512])
def test_int4_write_gemma3_step_gpu(window):
    # the write of the step a Gemma 3 int4 engine died on: decodes at 8K, a 2-token continuation
    # completing page 127 from its tail, new prompts of 8192 and 8187 tokens; a sliding layer's
    # table holds vLLM's null block 0 below the window
    _write_gemma3_step(window, "cuda")


def test_int4_write_gemma3_step_shape_small(device):
    # the same structure at 1/8 of the length (CPU-sized)
    _write_gemma3_step(64, device, scale=8)


def _write_gemma3_step(window: int | None, device: str, scale: int = 1) -> None:
    pool = Pool(nkv=1, d=256, num_blocks=800, num_slots=32, device=device)
    n8k = 8192 // scale
    q_lens = [1, 1, 1, 2, n8k, n8k - 5]
    seq_lens = [n8k + 1, n8k + 1, n8k, n8k, n8k, n8k - 5]
    cols = 8448 // scale // B + 1
    table = (torch.randperm(799)[: 6 * cols] + 1).view(6, cols)
    for r in range(4):  # rows with cached tokens: their tail holds their current page
        if window:
            table[r, : (seq_lens[r] - q_lens[r] - window + 1) // B] = 0
        pool.tail_page[[5, 7, 9, 11][r]] = int(table[r, (seq_lens[r] - q_lens[r]) // B])
    k, v = _kv(sum(q_lens), pool)
    _write(pool, k, v, q_lens, seq_lens, table, [5, 7, 9, 11, 2, 3], [0, 0, 0, 0, 1, 1])


@pytest.mark.gpu
def test_sink_write_real_size_gpu():
    # 64 rows: decodes before and past page 0, prompts of up to 2000 tokens, a third without sink
    q_lens = [1] * 40 + [2000, 70, 33, 500] * 6
    seq_lens = [30 + 3 * i for i in range(40)] + [2000, 100, 40, 900] * 6
    sinks = [i if i % 3 else -1 for i in range(64)]
    n = sum(q_lens)
    key = torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    qsl = torch.zeros(65, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    sink = torch.randint(-(2**15), 2**15, (64, 2, 8, B, 128), dtype=torch.int16, device="cuda")
    sink = sink.view(torch.bfloat16)
    kw = dict(query_start_loc=qsl.cuda(), seq_lens=torch.tensor(seq_lens, dtype=torch.int32,
              device="cuda"), num_seqs=64)  # fmt: skip
    sink_of_seq = torch.tensor(sinks, dtype=torch.int32, device="cuda")
    want = sink.clone()
    write_sink_int4_ref(key, value, want, sink_of_seq, **kw)
    write_sink_int4(key, value, sink, sink_of_seq, **kw)
    assert torch.equal(sink.view(torch.int16), want.view(torch.int16))
