"""The fresh-prefill split (fresh_prefill.py): which sequences go to FlashAttention, on CPU."""

from __future__ import annotations

import pytest
import torch

from int8kv_shim import fresh_prefill
from int8kv_shim.environment_variables import prefill_mode
from int8kv_shim.fresh_prefill import make_subset, plan_split, split_batch

# decode | fresh prefill | continuation | one-token prompt | padding request | fresh prefill
Q_LENS = [1, 9, 5, 1, 0, 3]
DONE = [39, 0, 65, 0, 0, 0]


def _qsl(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)


def test_fresh_means_no_context_and_more_than_one_new_token() -> None:
    fresh, rest = plan_split(_qsl(Q_LENS), torch.tensor(DONE), len(Q_LENS))
    assert fresh == [1, 5]
    assert rest == [0, 2, 3]  # the padding request is in neither


def test_sequences_before_first_seq_are_left_out() -> None:
    # the impl runs the leading decodes as their own launch: they are in neither list
    fresh, rest = plan_split(_qsl(Q_LENS), torch.tensor(DONE), len(Q_LENS), first_seq=1)
    assert fresh == [1, 5] and rest == [2, 3]
    assert plan_split(_qsl([1, 1, 4]), torch.tensor([7, 0, 0]), 3, first_seq=2) == ([2], [])


def test_no_split_without_a_fresh_prefill_or_without_cpu_counts() -> None:
    assert plan_split(_qsl([1, 1, 4]), torch.tensor([7, 0, 12]), 3) is None
    seq_lens = torch.tensor([8, 9], dtype=torch.int32)
    table = torch.zeros(2, 1, dtype=torch.int32)
    assert split_batch(_qsl([1, 9]), None, 2, seq_lens, table) is None


def test_subsets_are_compact_varlen_batches() -> None:
    seq_lens = torch.tensor([40, 9, 70, 1, 0, 3], dtype=torch.int32)
    table = torch.arange(6 * 5, dtype=torch.int32).view(6, 5)
    split = split_batch(_qsl(Q_LENS), torch.tensor(DONE), 6, seq_lens, table)
    fresh, rest = split.fresh, split.rest
    assert fresh.token_index.tolist() == [*range(1, 10), 16, 17, 18]
    assert fresh.query_start_loc.tolist() == [0, 9, 12] and fresh.max_query_len == 9
    assert fresh.seq_lens.tolist() == [9, 3]
    assert rest.token_index.tolist() == [0, *range(10, 15), 15]
    assert rest.query_start_loc.tolist() == [0, 1, 6, 7] and rest.max_query_len == 5
    assert rest.seq_lens.tolist() == [40, 70, 1]
    assert torch.equal(rest.block_table, table[[0, 2, 3]])
    only_fresh = make_subset(_qsl([4, 2]), [0, 1], seq_lens[:2], table[:2])
    assert only_fresh.token_index.tolist() == list(range(6))


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
    fresh_prefill.flash_attention.cache_clear()
    assert fresh_prefill.flash_attention(128) is None


def test_torch_stand_in_is_causal_gqa_attention() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    out = torch.empty_like(q)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    fresh_prefill.attention_ref(q, k, v, out, cu, 3, 0.5, None, None)
    # first token of each sequence sees only itself: its output is its own V (head 1 -> kv head 0)
    assert torch.allclose(out[0, 1], v[0, 0]) and torch.allclose(out[2, 3], v[2, 1])
    # window 1: every token sees only itself
    fresh_prefill.attention_ref(q, k, v, out, cu, 3, 0.5, 1, None)
    assert torch.allclose(out[:, ::2], v) and torch.allclose(out[:, 1::2], v)
