"""The builder's ``update_block_table``: vLLM's V1 model runner builds once for the KV-cache groups
of one spec (Gemma 3's sliding-window groups) and hands each group that build with its own block
table and slot mapping. The result must be what a build with that group's tensors gives."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
from builder_inputs import common_metadata, fake_vllm_config  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from int8kv_shim.attention_impl import Int8KVAttentionMetadataBuilder  # noqa: E402

NQ, NKV, D, BS = 8, 2, 64, 16


def _builder(window: int | None = None) -> Int8KVAttentionMetadataBuilder:
    spec = SimpleNamespace(block_size=BS, int8kv_dtype="int8", sliding_window=window)
    config = fake_vllm_config(NQ, NKV, D, max_model_len=256)
    builder = Int8KVAttentionMetadataBuilder(spec, ["layer"], config, torch.device("cpu"))
    builder.flash_prefill = True  # FlashAttention-2's route, as on a GPU
    builder.min_continuation_tokens = 2  # tiny shapes: let short continuations in
    return builder


def _batch(q_lens: list[int], seq_lens: list[int], seed: int) -> CommonAttentionMetadata:
    """The batch with random pages and slots (another seed: another KV-cache group's)."""
    g = torch.Generator().manual_seed(seed)
    blocks = max(-(-s // BS) for s in seq_lens)
    block_table = torch.randint(1, 500, (len(seq_lens), blocks), generator=g).int()
    slot_mapping = torch.randint(0, 8000, (sum(q_lens),), generator=g)
    return common_metadata(q_lens, seq_lens, block_table, slot_mapping)


def _same(a: Any, b: Any, where: str = "metadata") -> None:
    """Field by field: tensors equal in value and shape, the rest equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            if f.name == "workspace":  # scratch (uninitialised): the builder's one buffer
                assert getattr(a, f.name) is getattr(b, f.name), where
                continue
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    else:
        assert a == b, where


@pytest.mark.parametrize(
    ("q_lens", "seq_lens"),
    [
        # decodes first (V1's order): a decode, a first chunk, a continuation over 65 tokens
        ([1, 9, 5], [40, 9, 70]),
        # a decode between two prefills: FlashAttention's sequences are not consecutive rows
        ([9, 1, 5], [9, 40, 70]),
        # decodes only (the CUDA-graph steps' eager twin)
        ([1, 1, 1], [40, 17, 70]),
    ],
)
@pytest.mark.parametrize("window", [None, 32])
def test_update_block_table_gives_what_a_build_with_that_table_gives(
    q_lens: list[int], seq_lens: list[int], window: int | None
) -> None:
    builder = _builder(window)
    first = _batch(q_lens, seq_lens, seed=0)
    other = _batch(q_lens, seq_lens, seed=1)  # another group: its own pages and slots
    second = dataclasses.replace(
        first, block_table_tensor=other.block_table_tensor, slot_mapping=other.slot_mapping
    )
    built = builder.build(0, first)
    if q_lens != [1, 1, 1]:
        assert built.split is not None  # the case under test: subsets hold block-table rows
    updated = builder.update_block_table(built, second.block_table_tensor, second.slot_mapping)
    _same(updated, builder.build(0, second))
    # the build it came from still holds the first group's tables
    _same(built, builder.build(0, first))


def test_the_builder_tells_vllm_it_updates_block_tables() -> None:
    assert Int8KVAttentionMetadataBuilder.supports_update_block_table is True
