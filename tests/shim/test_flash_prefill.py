"""The FlashAttention split (flash_prefill.py), on CPU: which sequences go to FlashAttention, and
a mixed batch through ``forward_split`` with the real gather / paged kernels (Triton interpreter)
and ``attention_ref`` standing in for FlashAttention-2."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from int8kv_shim import flash_prefill
from int8kv_shim.environment_variables import prefill_mode
from int8kv_shim.flash_prefill import (
    FlashAttentionFailed,
    computed_tokens_cpu,
    forward_split,
    make_subset,
    plan_split,
    split_batch,
)

# decode | first chunk | continuation | one-token prompt | padding request | first chunk
Q_LENS = [1, 9, 5, 1, 0, 3]
DONE = [39, 0, 65, 0, 0, 0]


def _qsl(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)


def test_first_chunks_mean_no_context_and_more_than_one_new_token() -> None:
    # no context budget (no room): continuations stay on our kernels
    flash, rest = plan_split(_qsl(Q_LENS), torch.tensor(DONE), len(Q_LENS))
    assert flash == [1, 5]
    assert rest == [0, 2, 3]  # the padding request is in neither


def test_continuations_need_enough_new_tokens_and_room_for_their_context() -> None:
    q_lens, done = [4, 1, 5, 6, 3, 7], [10, 30, 20, 0, 5, 1]
    # budget 30 tokens of context, in batch order: 10 fits, 20 fits (0 left), 5 does not, 1 does
    # not; the decode never goes, the first chunk always does
    assert plan_split(_qsl(q_lens), torch.tensor(done), 6, 30, 2) == ([0, 2, 3], [1, 4, 5])
    # too few new tokens: short continuations stay on ours whatever the budget
    assert plan_split(_qsl(q_lens), torch.tensor(done), 6, 10**6, 5) == ([2, 3, 5], [0, 1, 4])
    assert plan_split(_qsl([4, 1]), torch.tensor([10, 3]), 2, 9, 2) is None  # 10 > 9


def _plan_split_loop(q_lens, done, budget, min_new, first_seq):
    """plan_split's rule, one request at a time (the spec its tensor version must match)."""
    flash, rest = [], []
    for i in range(first_seq, len(q_lens)):
        if q_lens[i] == 0:
            continue
        on_flash = q_lens[i] > 1 and (
            done[i] == 0 or (q_lens[i] >= min_new and 0 < done[i] <= budget)
        )
        if on_flash:
            budget -= done[i]
        (flash if on_flash else rest).append(i)
    return (flash, rest) if flash else None


@settings(max_examples=200, deadline=None)
@given(
    batch=st.lists(
        st.tuples(st.sampled_from([0, 1, 1, 2, 5, 64, 70]), st.sampled_from([0, 0, 3, 20, 64])),
        min_size=1,
        max_size=12,
    ),
    budget=st.sampled_from([0, 10, 30, 100, 10**6]),
    min_new=st.sampled_from([2, 5, 64]),
    first_seq=st.integers(0, 3),
)
def test_plan_split_matches_the_per_request_rule(batch, budget, min_new, first_seq) -> None:
    q_lens, done = [q for q, _ in batch], [d for _, d in batch]
    first_seq = min(first_seq, len(batch))
    got = plan_split(
        _qsl(q_lens), torch.tensor(done, dtype=torch.int32), len(batch), budget, min_new, first_seq
    )
    assert got == _plan_split_loop(q_lens, done, budget, min_new, first_seq)


def test_sequences_before_first_seq_are_left_out() -> None:
    # the impl runs the leading decodes as their own launch: they are in neither list
    flash, rest = plan_split(_qsl(Q_LENS), torch.tensor(DONE), len(Q_LENS), first_seq=1)
    assert flash == [1, 5] and rest == [2, 3]
    assert plan_split(_qsl([1, 1, 4]), torch.tensor([7, 0, 0]), 3, first_seq=2) == ([2], [])


def test_no_split_without_a_fresh_prefill_or_without_cpu_counts() -> None:
    assert plan_split(_qsl([1, 1, 4]), torch.tensor([7, 0, 12]), 3) is None
    seq_lens = torch.tensor([8, 9], dtype=torch.int32)
    table = torch.zeros(2, 1, dtype=torch.int32)
    assert split_batch(_qsl([1, 9]), None, 2, seq_lens, table) is None


def test_computed_tokens_from_either_model_runner() -> None:
    qsl = torch.tensor([0, 1, 10, 15, 15], dtype=torch.int32)  # a padded 4th request: no tokens
    computed = torch.tensor([39, 0, 65, 0], dtype=torch.int32)
    # model runner V1: its counts, as given (exact)
    got, exact = computed_tokens_cpu(qsl, 3, computed, torch.tensor([99, 99, 99, 0]))
    assert got.tolist() == [39, 0, 65] and exact
    # model runner V2: sequence lengths (computed + scheduled) minus this step's tokens; an upper
    # bound under speculative decoding, so not marked exact
    got, exact = computed_tokens_cpu(qsl, 3, None, torch.tensor([40, 9, 70, 0], dtype=torch.int32))
    assert got.tolist() == [39, 0, 65] and not exact
    assert computed_tokens_cpu(qsl, 3, None, None) == (None, False)


def test_subsets_are_compact_varlen_batches() -> None:
    seq_lens = torch.tensor([40, 9, 70, 1, 0, 3], dtype=torch.int32)
    table = torch.arange(6 * 5, dtype=torch.int32).view(6, 5)
    split = split_batch(_qsl(Q_LENS), torch.tensor(DONE), 6, seq_lens, table)
    fresh, rest = split.flash, split.rest
    assert fresh.token_index.tolist() == [*range(1, 10), 16, 17, 18]
    assert fresh.query_start_loc.tolist() == [0, 9, 12] and fresh.max_query_len == 9
    assert fresh.seq_lens.tolist() == [9, 3]
    # first chunks only: the keys are the new tokens, nothing to gather
    assert fresh.key_start_loc is fresh.query_start_loc and fresh.context_tokens == 0
    assert fresh.max_key_len == 9 and fresh.num_key_tokens == 12
    # the rest, apart: the continuation, and the one-token queries (the decode, the one-token
    # prompt) for a launch on the decode configuration
    assert rest.token_index.tolist() == list(range(10, 15)) and rest.max_query_len == 5
    assert rest.query_start_loc.tolist() == [0, 5] and rest.seq_lens.tolist() == [70]
    assert torch.equal(rest.block_table, table[[2]])
    one = split.decodes
    assert one.token_index.tolist() == [0, 15] and one.query_start_loc.tolist() == [0, 1, 2]
    assert one.max_query_len == 1 and one.seq_lens.tolist() == [40, 1]
    assert torch.equal(one.block_table, table[[0, 3]])
    assert split.our_kernels() == (one, rest)
    only_fresh = make_subset(_qsl([4, 2]), [0, 1], seq_lens[:2], table[:2])
    assert only_fresh.token_index.tolist() == list(range(6))
    # with the continuation (65 cached + 5 new) on FlashAttention: keys = context + new tokens
    split = split_batch(_qsl(Q_LENS), torch.tensor(DONE), 6, seq_lens, table, 100, 2)
    flash = split.flash
    assert flash.token_index.tolist() == [*range(1, 15), 16, 17, 18]
    assert flash.key_start_loc.tolist() == [0, 9, 79, 82] and flash.max_key_len == 70
    assert flash.context_tokens == 65 and flash.num_key_tokens == 82
    assert split.rest is None and split.decodes.seq_lens.tolist() == [40, 1]


@pytest.mark.gpu
def test_splitting_a_batch_never_waits_for_the_gpu() -> None:
    """With a long kernel queued, the split's host work returns long before the GPU is done: none
    of its small host-to-device copies waits for the queue."""
    dev = torch.device("cuda")
    seq_lens = torch.tensor([40, 9, 70, 1, 0, 3], dtype=torch.int32, device=dev)
    table = torch.arange(6 * 5, dtype=torch.int32, device=dev).view(6, 5)
    args = (_qsl(Q_LENS), torch.tensor(DONE), 6, seq_lens, table, 100, 2)
    split_batch(*args)  # warm
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time
    t0 = time.perf_counter()
    split = split_batch(*args)
    host_s = time.perf_counter() - t0
    assert not torch.cuda.current_stream().query(), "the sleep ended early: the test is void"
    assert host_s < 0.1, f"the split waited {host_s:.3f} s for the GPU"
    torch.cuda.synchronize()
    assert split.flash.key_start_loc.tolist() == [0, 9, 79, 82]


@pytest.mark.parametrize(
    ("value", "mode"), [(None, "flash"), ("", "flash"), ("triton", "triton"), (" FLASH ", "flash")]
)
def test_prefill_mode(value: str | None, mode: str) -> None:
    env = {} if value is None else {"INT8KV_PREFILL": value}
    assert prefill_mode(env) == mode


def test_prefill_mode_refuses_unknown_values() -> None:
    with pytest.raises(ValueError, match="INT8KV_PREFILL='fa3' is not one of flash, triton"):
        prefill_mode({"INT8KV_PREFILL": "fa3"})


def test_no_flash_attention_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    flash_prefill.flash_attention.cache_clear()
    assert flash_prefill.flash_attention(128) is None


def test_torch_stand_in_is_causal_gqa_attention() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    out = torch.empty_like(q)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    flash_prefill.attention_ref(q, k, v, out, cu, cu, 3, 3, 0.5, None, None)
    # first token of each sequence sees only itself: its output is its own V (head 1 -> kv head 0)
    assert torch.allclose(out[0, 1], v[0, 0]) and torch.allclose(out[2, 3], v[2, 1])
    # window 1: every token sees only itself
    flash_prefill.attention_ref(q, k, v, out, cu, cu, 3, 3, 0.5, 1, None)
    assert torch.allclose(out[:, ::2], v) and torch.allclose(out[:, 1::2], v)


def test_torch_stand_in_aligns_the_causal_mask_bottom_right() -> None:
    # FlashAttention's convention with seqlen_k > seqlen_q: query i sits at k_len - q_len + i.
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    out = torch.empty_like(q)
    cu_q, cu_k = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    flash_prefill.attention_ref(q, k, v, out, cu_q, cu_k, 2, 5, 0.5, None, None)
    full = torch.softmax((q[1] @ k[:, 0].T) * 0.5, -1) @ v[:, 0]  # the last query sees all 5
    assert torch.allclose(out[1], full, atol=1e-6)
    # window 2: the first query (position 3) sees keys 2 and 3 only
    flash_prefill.attention_ref(q, k, v, out, cu_q, cu_k, 2, 5, 0.5, 2, None)
    part = torch.softmax((q[0] @ k[2:4, 0].T) * 0.5, -1) @ v[2:4, 0]
    assert torch.allclose(out[0], part, atol=1e-6)


# A mixed batch through forward_split: (new tokens, cached context) per sequence. Context budget 40:
# the continuations of 21 and then 16 tokens fit (19 left after the first), the one of 40 does not
# and stays on our kernels, like the decode.
MIXED = [(1, 30), (7, 0), (6, 21), (5, 40), (3, 16)]
MIXED_BUDGET = 40
FLASH_SEQS, REST_SEQS = [1, 2, 4], [0, 3]
NQ, NKV, D, BS = 4, 2, 64, 16


def _mixed_batch(kv_dtype: str, v_format: str, mixed: list[tuple[int, int]] = MIXED):
    """Random bf16 K/V of every token written through write_kv_cache, a shuffled block table, the
    batch's query and its new tokens' K/V (what vLLM hands the impl)."""
    from int8kv_kernels import PageLayout, write_kv_cache

    torch.manual_seed(0)
    q_lens = [q for q, _ in mixed]
    seq_lens = [q + c for q, c in mixed]
    nblk = [-(-s // BS) for s in seq_lens]
    num_blocks = sum(nblk) + 2
    perm = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(mixed), max(nblk) + 1, dtype=torch.int32)
    for s, n in enumerate(nblk):
        table[s, :n] = torch.tensor([perm.pop() for _ in range(n)])
    layout = PageLayout(kv_dtype, BS, NKV, D)
    cache = torch.zeros(num_blocks, layout.page_bytes, dtype=torch.int8)
    scales = {}
    if kv_dtype == "int8_static":  # N(0, 1) data: absmax about 4
        v_max = 448 if v_format == "e4m3" else 127
        scales = {"k_scale": torch.full((NKV, D), 4 / 127), "v_scale": torch.full((NKV, D), 4 / v_max),
                  "v_format": v_format}  # fmt: skip
    exact_k = torch.zeros(num_blocks * BS, NKV, D)
    exact_v = torch.zeros_like(exact_k)
    new_k, new_v = [], []
    for s, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len)
        slots = table[s, pos // BS].long() * BS + pos % BS
        k = torch.randn(seq_len, NKV, D).bfloat16()
        v = torch.randn(seq_len, NKV, D).bfloat16()
        write_kv_cache(k, v, cache, slots, kv_dtype=kv_dtype, block_size=BS, **scales)
        exact_k[slots], exact_v[slots] = k.float(), v.float()
        new_k.append(k[-q_lens[s] :])
        new_v.append(v[-q_lens[s] :])
    qsl = _qsl(q_lens)
    query = torch.randn(int(qsl[-1]), NQ, D).bfloat16()
    return dict(mixed=mixed, cache=cache, table=table, qsl=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                query=query, key=torch.cat(new_k), value=torch.cat(new_v), scales=scales,
                exact=(exact_k.view(num_blocks, BS, NKV, D), exact_v.view(num_blocks, BS, NKV, D)))  # fmt: skip


def _run_split(
    b: dict,
    kv_dtype: str,
    done_shift: int = 0,
    flash_attention=None,
    flash_seqs=FLASH_SEQS,
    views: bool = True,
) -> torch.Tensor:
    """forward_split over the batch (``done_shift`` skews the continuations' context lengths as a
    buggy split would); NaN-poisoned output, so an unwritten row fails every comparison."""
    from int8kv_kernels import gather_kv_context

    mixed = b["mixed"]
    done = torch.tensor([c + (done_shift if c and q > 1 else 0) for q, c in mixed])
    split = split_batch(b["qsl"], done, len(mixed), b["seq_lens"], b["table"], MIXED_BUDGET, 2)
    assert split is not None
    # batch-order greedy budget: which sequences went where is part of what is tested
    q_lens = [q for q, _ in mixed]
    flash_rows = [
        t for s in flash_seqs for t in range(int(b["qsl"][s]), int(b["qsl"][s]) + q_lens[s])
    ]
    assert split.flash.token_index.tolist() == flash_rows
    if not views:  # the gather / scatter path, as for subsets whose rows are not contiguous
        for subset in (split.flash, *split.our_kernels()):
            _ = subset.token_index  # made from token_range, and kept, before the range goes
            subset.token_range = None
    scales = b["scales"]

    def gather(k, v, s):
        return gather_kv_context(
            b["cache"], k, v, kv_dtype=kv_dtype, block_size=BS, block_table=s.block_table,
            cu_seqlens_q=s.query_start_loc, cu_seqlens_k=s.key_start_loc,
            max_seqlen_k=s.max_key_len, num_k_tokens=s.num_key_tokens, **scales,
        )  # fmt: skip

    def paged(q, out, s):
        launches.append(s.max_query_len)
        _paged(b, kv_dtype, q, out, s.query_start_loc, s.seq_lens, s.block_table, s.max_query_len)

    output = torch.full_like(b["query"], float("nan"))
    launches = b.setdefault("launches", [])  # max_query_len of each launch of our kernels
    forward_split(
        b["query"], b["key"], b["value"], output, split,
        flash_attention=flash_attention or flash_prefill.attention_ref, gather_context=gather,
        paged=paged, softmax_scale=D**-0.5, sliding_window=None, soft_cap=None,
    )  # fmt: skip
    return output


def _paged(b, kv_dtype, q, out, qsl, seq_lens, table, max_query_len) -> None:
    from int8kv_kernels import paged_attention

    paged_attention(
        q, b["cache"], out, kv_dtype=kv_dtype, block_size=BS, num_kv_heads=NKV,
        query_start_loc=qsl, seq_lens=seq_lens, block_table=table, max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()), softmax_scale=D**-0.5, **b["scales"],
    )  # fmt: skip


def _tol(ref: torch.Tensor) -> torch.Tensor:
    """The tolerance backend_glue_check.py uses for the fresh path: bf16 output, one rounding
    (the interpreter truncates: 2^-7 relative) plus 4e-3 absolute."""
    return 4e-3 + 2.0**-7 * ref.abs()


def _within(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool(((out.float() - ref).abs() <= _tol(ref)).all())


def _references(b: dict, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 attention over (1) the cache's dequantized values for every token, what our kernels
    compute, and (2) what each sequence should see on the split path: the same, except the new
    tokens of the flash sequences, which FlashAttention reads unquantized."""
    from int8kv_kernels.reference import attention_ref, dequantize_cache

    k_slots, v_slots = dequantize_cache(b["cache"], kv_dtype=kv_dtype, block_size=BS,
                                        num_kv_heads=NKV, head_size=D, **b["scales"])  # fmt: skip
    args = dict(query_start_loc=b["qsl"], seq_lens=b["seq_lens"], block_table=b["table"],
                softmax_scale=D**-0.5)  # fmt: skip
    quantized = attention_ref(b["query"], k_slots, v_slots, **args)
    k_slots, v_slots = k_slots.contiguous(), v_slots.contiguous()
    for s in FLASH_SEQS:
        q_len, ctx = MIXED[s]
        pos = torch.arange(ctx, ctx + q_len)
        blk, off = b["table"][s, pos // BS].long(), pos % BS
        k_slots[blk, off], v_slots[blk, off] = b["exact"][0][blk, off], b["exact"][1][blk, off]
    return quantized, attention_ref(b["query"], k_slots, v_slots, **args)


@pytest.mark.parametrize(("kv_dtype", "v_format"), [("int8", "int8"), ("int8_static", "e4m3")])
def test_mixed_batch_matches_our_kernels_on_every_row(kv_dtype: str, v_format: str) -> None:
    b = _mixed_batch(kv_dtype, v_format)
    out = _run_split(b, kv_dtype)
    assert not out.isnan().any(), "a row was not written"
    paged = torch.full_like(b["query"], float("nan"))  # every row through our kernels
    _paged(b, kv_dtype, b["query"], paged, b["qsl"], b["seq_lens"], b["table"], 7)
    quantized, split_ref = _references(b, kv_dtype)
    rows = {k: torch.tensor([t for s in seqs for t in range(int(b["qsl"][s]), int(b["qsl"][s + 1]))])
            for k, seqs in (("flash", FLASH_SEQS), ("rest", REST_SEQS))}  # fmt: skip
    # The decode and the over-budget continuation: our kernels, as with the split off.
    rest = rows["rest"]
    assert _within(out[rest], paged[rest].float())
    # Every row within the file's tolerance of what it reads: the dequantized context (gather)
    # and, on FlashAttention, the unquantized new K/V (a first chunk's rows had that already).
    assert _within(out, split_ref)
    # So the flash rows differ from our kernels by the quantization of their new tokens' K/V only:
    # no more than the two references differ, plus each side's tolerance. (Not the tolerance
    # alone: with quantized vs unquantized new K/V they differ by up to ~4x it here, first chunks
    # included, as before this change; the check above is the tight one.)
    flash = rows["flash"]
    gap = (out[flash].float() - paged[flash].float()).abs()
    bound = (split_ref[flash] - quantized[flash]).abs() + 2 * _tol(split_ref[flash])
    assert (gap <= bound).all()
    assert (gap > 1e-3).any(), "flash rows equal our kernels': FlashAttention did not run?"


@pytest.mark.parametrize("bug", ["context_minus_1", "context_plus_1", "top_left_causal"])
def test_mixed_batch_comparison_catches_context_and_alignment_bugs(bug: str) -> None:
    # The comparison above must fail for an off-by-one context length or a causal mask aligned
    # top-left (query i sees keys <= i, FlashAttention's convention only when seqlen_k == seqlen_q).
    b = _mixed_batch("int8", "int8")

    def top_left(q, k, v, out, cu_q, cu_k, max_q, max_k, *rest) -> None:
        # top-left alignment == bottom-right over each sequence's first q_len keys only
        rows = torch.cat([torch.arange(int(cu_k[s]), int(cu_k[s]) + int(cu_q[s + 1] - cu_q[s]))
                          for s in range(len(cu_q) - 1)])  # fmt: skip
        flash_prefill.attention_ref(q, k[rows], v[rows], out, cu_q, cu_q, max_q, max_q, *rest)

    shift = {"context_minus_1": -1, "context_plus_1": 1}.get(bug, 0)
    out = _run_split(b, "int8", shift, top_left if bug == "top_left_causal" else None)
    _, split_ref = _references(b, "int8")
    assert not _within(out, split_ref)
    # and the bug is in a continuation's rows, not only somewhere
    for s in (2, 4):
        r = slice(int(b["qsl"][s]), int(b["qsl"][s + 1]))
        assert not _within(out[r], split_ref[r]), f"sequence {s}"


# A decode and a continuation whose context exceeds the whole budget first, then the flash sequences: both subsets
# are contiguous runs of rows, so forward_split slices instead of gathering and scattering.
CONTIGUOUS = [(1, 30), (5, 41), (7, 0), (6, 21), (3, 16)]


@pytest.mark.parametrize("kv_dtype", ["int8", "int8_static"])
def test_contiguous_subsets_are_sliced_with_the_same_result(kv_dtype: str) -> None:
    b = _mixed_batch(kv_dtype, "int8", CONTIGUOUS)
    split = split_batch(b["qsl"], torch.tensor([c for _, c in CONTIGUOUS]), len(CONTIGUOUS),
                        b["seq_lens"], b["table"], MIXED_BUDGET, 2)  # fmt: skip
    assert split.flash.token_range == (6, 22) and split.rest.token_range == (1, 6)
    assert split.decodes.token_range == (0, 1)
    sliced = _run_split(b, kv_dtype, flash_seqs=[2, 3, 4])
    gathered = _run_split(b, kv_dtype, flash_seqs=[2, 3, 4], views=False)
    assert not sliced.isnan().any() and torch.equal(sliced, gathered)


# vLLM's model runner V2 does not put decodes first: here they sit between prefills. Budget 40:
# sequence 2's context (21) fits, sequence 4's (40) no longer does.
INTERLEAVED = [(7, 0), (1, 30), (6, 21), (1, 12), (5, 40)]


def test_decodes_after_a_prefill_get_a_decode_launch_of_their_own() -> None:
    b = _mixed_batch("int8", "int8", INTERLEAVED)
    out = _run_split(b, "int8", flash_seqs=[0, 2])
    assert not out.isnan().any(), "a row was not written"
    # the two decodes in one launch on the decode configuration, then the long continuation
    assert b["launches"] == [1, 5]
    paged = torch.full_like(b["query"], float("nan"))  # every row through our kernels
    _paged(b, "int8", b["query"], paged, b["qsl"], b["seq_lens"], b["table"], 7)
    qsl = b["qsl"].tolist()
    ours = [t for s in (1, 3, 4) for t in range(qsl[s], qsl[s + 1])]
    assert _within(out[ours], paged[ours].float())


def _split_with(b: dict, flash_attention, paged) -> None:
    split = split_batch(b["qsl"], torch.tensor([c for _, c in b["mixed"]]), len(b["mixed"]),
                        b["seq_lens"], b["table"], MIXED_BUDGET, 2)  # fmt: skip
    assert split is not None and split.our_kernels()
    forward_split(
        b["query"], b["key"], b["value"], torch.empty_like(b["query"]), split,
        flash_attention=flash_attention, gather_context=lambda k, v, s: (k, v), paged=paged,
        softmax_scale=D**-0.5, sliding_window=None, soft_cap=None,
    )  # fmt: skip


def test_only_flash_attention_errors_are_reported_as_its_failure() -> None:
    """The impl falls back to our kernels on FlashAttentionFailed alone: an error of our own
    kernels (an illegal address in a launch after FlashAttention's) is not FlashAttention's and
    must reach vLLM as it is, not reroute every later prefill and be logged under its name."""
    b = _mixed_batch("int8", "int8")

    def refusing(*args: object) -> None:
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    def ours_fault(q: torch.Tensor, out: torch.Tensor, s: object) -> None:
        raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")

    with pytest.raises(FlashAttentionFailed) as failed:
        _split_with(b, refusing, lambda q, out, s: None)
    assert "Ampere" in str(failed.value.__cause__)
    with pytest.raises(RuntimeError, match="illegal memory access") as ours:
        _split_with(b, lambda *args: None, ours_fault)
    assert not isinstance(ours.value, FlashAttentionFailed)
