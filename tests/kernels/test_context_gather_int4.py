"""gather_kv_context with ``int4``: each context key read where the int4 attention reads it (its
sequence's tail or sink in the model's dtype, else its int4 page), bit for bit against
reference_int4.gather_kv_context_int4_ref, on caches and tails the write kernel filled over two
steps (a chunk, then a continuation)."""

from __future__ import annotations

import pytest
import torch
from kvbatch import assert_layers_replay, same_bits
from test_int4_tail_pages import B, Pool2, _i32, _kv, _write

from int8kv_kernels import gather_kv_context
from int8kv_kernels.reference_int4 import gather_kv_context_int4_ref, write_sink_int4_ref

# Per sequence: (tokens of the first chunk, new tokens of the continuation gathered). After the
# continuation's write: 0 reads keys 0..383 from int4 pages (its context all of them), 1 and 2
# read every context key from their tails (a partial page and the page before it; a page the
# continuation completed and the one before), 3 is a first chunk (no context), 4 has a context
# of one partial page, 5 reads keys 0..127 from pages and 128..199 from its tail. 6 is a prefix-
# cache hit on 2's two pages (no first chunk of its own, a new slot): it reads them in int4 where 2
# reads them exact.
STEPS = [(150, 300), (100, 20), (64, 64), (0, 10), (30, 40), (200, 30), (128, 10)]
HIT = 6
TABLES = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 0, 0, 0, 0], [13, 14, 15, 0, 0, 0, 0, 0],
          [16, 0, 0, 0, 0, 0, 0, 0], [17, 18, 0, 0, 0, 0, 0, 0], [19, 20, 21, 22, 0, 0, 0, 0],
          [13, 14, 23, 0, 0, 0, 0, 0]]  # fmt: skip


def _two_steps(pool: Pool2, sinks: list[int] | None):
    """Write every sequence's first chunk (slot r, new), then its continuation; returns the
    continuation's (new K, new V, gather keywords) and each sequence's K/V of all its tokens."""
    n = len(STEPS)
    kv = [_kv(a + b, pool) for a, b in STEPS]
    slots = list(range(n))
    first = [r for r in range(n) if STEPS[r][0] and r != HIT]
    pick = lambda rows, part: torch.cat([kv[r][part][: STEPS[r][0]] for r in rows])  # noqa: E731
    _write(pool, pick(first, 0), pick(first, 1), [STEPS[r][0] for r in first],
           [STEPS[r][0] for r in first], [TABLES[r] for r in first], [slots[r] for r in first],
           [1] * len(first))  # fmt: skip
    q_lens = [b for _, b in STEPS]
    seq_lens = [a + b for a, b in STEPS]
    new_k = torch.cat([kv[r][0][STEPS[r][0] :] for r in range(n)])
    new_v = torch.cat([kv[r][1][STEPS[r][0] :] for r in range(n)])
    _write(pool, new_k, new_v, q_lens, seq_lens, TABLES, slots,
           [int(r not in first) for r in range(n)])  # fmt: skip
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    kw = dict(block_size=B, block_table=_i32(pool, TABLES), cu_seqlens_q=_i32(pool, cu_q),
              cu_seqlens_k=_i32(pool, cu_k), tail=pool.tail, tail_page=pool.tail_page,
              slot_of_seq=_i32(pool, slots))  # fmt: skip
    if sinks is not None:
        sink = torch.full((n, 2, pool.nkv, B, pool.d), float("nan"), dtype=pool.dtype,
                          device=pool.device)  # fmt: skip
        for r, s in enumerate(sinks):  # each sequence's first page, as write_sink_int4 keeps it
            if s >= 0:
                write_sink_int4_ref(kv[r][0], kv[r][1], sink, _i32(pool, [s]),
                                    query_start_loc=_i32(pool, [0, seq_lens[r]]),
                                    seq_lens=_i32(pool, [seq_lens[r]]), num_seqs=1)  # fmt: skip
        kw.update(sink=sink, sink_of_seq=_i32(pool, sinks))
    return new_k, new_v, kw, kv


@pytest.mark.parametrize(
    ("nkv", "d", "pages", "sinks"),
    [(2, 64, 2, None), (2, 64, 1, None), (2, 64, 2, [0, 1, -1, 3, 4, 5, 6]),
     (1, 256, 2, [2, -1, 0, -1, 1, -1, 3])],
)  # fmt: skip
def test_int4_gather_matches_reference_bit_for_bit(nkv, d, pages, sinks):
    pool = Pool2(nkv=nkv, d=d, num_blocks=24, num_slots=len(STEPS), pages=pages)
    new_k, new_v, kw, kv = _two_steps(pool, sinks)
    num_k = int(kw["cu_seqlens_k"][-1])
    k, v = gather_kv_context(pool.cache, new_k, new_v, kv_dtype="int4",
                             max_seqlen_k=max(a + b for a, b in STEPS), num_k_tokens=num_k,
                             **kw)  # fmt: skip
    k_ref, v_ref = gather_kv_context_int4_ref(pool.cache, new_k, new_v, **kw)
    assert k.shape == k_ref.shape == (num_k, nkv, d)
    assert same_bits(k, k_ref) and same_bits(v, v_ref)

    # What the reference says, checked against the tokens themselves (so it is not vacuous):
    # a run per sequence of its context then its new tokens; context from a tail or a sink is
    # exact, from an int4 page close but not equal.
    # With one page a slot, only sequence 3 (no context) reads nothing from int4 pages.
    exact = {1, 2, 3, 4} if pages == 2 else {3}
    starts = kw["cu_seqlens_k"].tolist()
    for r, (ctx, _) in enumerate(STEPS):
        run_k, run_v = k[starts[r] : starts[r + 1]], v[starts[r] : starts[r + 1]]
        if r != HIT:
            assert torch.equal(run_k, kv[r][0]) == (r in exact), r
        assert torch.equal(run_v[ctx:], kv[r][1][ctx:])
    if pages == 2:  # sequence 5: its pages in int4, its tail exact
        run_k = k[starts[5] : starts[5] + 200]
        assert torch.equal(run_k[128:], kv[5][0][128:200])
        assert not torch.equal(run_k[64:128], kv[5][0][64:128])
    # the hit reads 2's two pages in int4; 2 reads both exact with two pages a slot, and with one
    # only its complete last page (page 0 is int4 for both)
    hit_k, own_k = k[starts[HIT] : starts[HIT] + 128], k[starts[2] : starts[2] + 128]
    assert not torch.equal(hit_k, own_k) and torch.equal(hit_k[:B], own_k[:B]) == (pages == 1)
    with_sink = sinks is not None and sinks[0] >= 0
    run = k[: STEPS[0][0]].float()
    truth = kv[0][0][: STEPS[0][0]].float()
    assert torch.equal(run[:B], truth[:B]) == with_sink  # keys 0..63 from the sink
    err = (run[B:] - truth[B:]).pow(2).mean().sqrt() / truth.pow(2).mean().sqrt()
    assert 0.02 < err < 0.3, float(err)  # 4-bit codes over a page: about a tenth of the RMS


def test_int4_gather_refuses_what_it_cannot_read():
    pool = Pool2(nkv=1, d=64, num_blocks=2, num_slots=1)
    new = torch.zeros(2, 1, 64, dtype=torch.bfloat16, device=pool.device)
    cu = _i32(pool, [0, 2])
    kw = dict(block_size=B, block_table=_i32(pool, [[0]]), cu_seqlens_q=cu, cu_seqlens_k=cu,
              max_seqlen_k=2, num_k_tokens=2)  # fmt: skip
    with pytest.raises(ValueError, match="tail, tail_page and slot_of_seq"):
        gather_kv_context(pool.cache, new, new, kv_dtype="int4", **kw)
    tails = dict(tail=pool.tail, tail_page=pool.tail_page, slot_of_seq=_i32(pool, [0]))
    ones = torch.ones(1, 64, device=pool.device)
    with pytest.raises(ValueError, match="no static scales"):
        gather_kv_context(pool.cache, new, new, kv_dtype="int4", k_scale=ones, v_scale=ones,
                          **tails, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="together, or neither"):
        gather_kv_context(pool.cache, new, new, kv_dtype="int4", sink=pool.tail[:1, :, :, :B],
                          **tails, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="slot_of_seq must be int32"):
        gather_kv_context(pool.cache, new, new, kv_dtype="int4", **kw,
                          **{**tails, "slot_of_seq": _i32(pool, [0]).long()})  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("sinks", [None, [0, 1, -1, 3, 4, 5, 6]])
def test_int4_gather_layers_replay_with_their_own_pools_gpu(sinks, monkeypatch):
    """Layers of one step: each its own cache, tail pool and sink pool, the same batch. From the
    second layer on the gather is a replay of the first layer's launch; every layer's K/V equal
    the reference's bit for bit, and a plain ``kernel[grid]`` launch's."""
    import int8kv_kernels.context_gather as context_gather

    layers = []
    for _ in range(3):
        pool = Pool2(nkv=8, d=128, num_blocks=24, num_slots=len(STEPS), device="cuda")
        new_k, new_v, kw, _ = _two_steps(pool, sinks)
        layers.append((pool, new_k, new_v, kw))
    # one batch: the layers' metadata tensors are the first layer's
    shared = {n: layers[0][3][n] for n in ("block_table", "cu_seqlens_q", "cu_seqlens_k",
                                           "slot_of_seq", "sink_of_seq") if n in layers[0][3]}  # fmt: skip
    launcher = context_gather.launch_gather_int4
    num_k = int(shared["cu_seqlens_k"][-1])

    def step():
        outs = []
        for pool, new_k, new_v, kw in layers:
            kw = {**kw, **shared}
            outs.append(gather_kv_context(pool.cache, new_k, new_v, kv_dtype="int4",
                                          max_seqlen_k=450, num_k_tokens=num_k, **kw))  # fmt: skip
            ref = gather_kv_context_int4_ref(pool.cache, new_k, new_v, **kw)
            assert same_bits(outs[-1][0], ref[0]) and same_bits(outs[-1][1], ref[1])
        return outs

    assert_layers_replay(launcher, step, len(layers), monkeypatch)
