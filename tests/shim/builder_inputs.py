"""What vLLM hands our metadata builder and impls, made on the CPU for the tests and check
scripts of this folder (not a test module): the parts of a ``VllmConfig`` they read, and a
batch's ``CommonAttentionMetadata`` as vLLM's V1 model runner passes it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata


def fake_vllm_config(
    num_q_heads: int, num_kv_heads: int, head_size: int, max_model_len: int, **more: Any
) -> SimpleNamespace:
    """A model config with these heads (TP 1, BF16) and ``more`` of the config's parts."""
    model_config = SimpleNamespace(
        dtype=torch.bfloat16,
        get_num_kv_heads=lambda parallel: num_kv_heads,
        get_num_attention_heads=lambda parallel: num_q_heads,
        get_head_size=lambda: head_size,
        max_model_len=max_model_len,
    )
    return SimpleNamespace(model_config=model_config, parallel_config=None, **more)


def common_metadata(
    q_lens: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor | None = None,
) -> CommonAttentionMetadata:
    """A batch of sequences of ``seq_lens`` tokens whose last ``q_lens`` are new, with the V1
    runner's host counts of cached tokens (slot mapping all zeros unless given)."""
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(q_lens),
        num_actual_tokens=n, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=torch.zeros(n, dtype=torch.int64) if slot_mapping is None else slot_mapping,
        _num_computed_tokens_cpu=torch.tensor(seq_lens) - torch.tensor(q_lens),
    )  # fmt: skip
