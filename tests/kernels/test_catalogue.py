"""The dtype lists every module reads are derived from the catalogue's entries, and say what the
kernels do: a field set wrongly would route a dtype to a path that cannot serve it."""

from __future__ import annotations

import pytest

from int8kv_kernels import cache_write, cache_write_int4, catalogue, reference, reference_int4
from int8kv_kernels.e4m3 import E4M3_MAX, check_v_format


def test_derived_lists() -> None:
    assert catalogue.KERNEL_DTYPES == ("int8", "int8_static", "int4")
    assert catalogue.EXPERIMENTAL_DTYPES == ("int4",)
    assert catalogue.INT8_DTYPES == ("int8", "int8_static")
    assert catalogue.INT4_DTYPES == ("int4",)
    # every format's continuations gather their context for FlashAttention (int4's from its
    # pages, tail and sink)
    assert catalogue.FLASH_CONTEXT_DTYPES == ("int8", "int8_static", "int4")
    assert catalogue.TAIL_DTYPES == ("int4",)
    assert [n for n, d in catalogue.CATALOGUE.items() if d.page_tokens] == ["int4"]
    assert catalogue.STATIC_DTYPE == "int8_static"
    assert catalogue.V_FORMATS == ("int8", "e4m3")
    assert catalogue.dtypes_storing_v_as("e4m3") == ("int8_static",)
    assert catalogue.dtypes_storing_v_as("int8") == catalogue.DTYPE_NAMES


def test_the_references_use_the_kernels_constants() -> None:
    assert reference.QMAX is cache_write.QMAX and cache_write.QMAX == 127.0
    assert (reference.SCALE_MIN, reference.SCALE_MAX) == (2.0**-24, 65504.0)
    assert reference_int4.INT4_LEVELS is cache_write_int4.INT4_LEVELS
    assert cache_write_int4.INT4_LEVELS == 15.0 and reference_int4.FP16_MAX == 65504.0
    assert E4M3_MAX == 448.0 == catalogue.V_FORMAT_CATALOGUE["e4m3"].qmax


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "no_such_dtype"])
def test_e4m3_v_is_for_the_static_dtype_only(kv_dtype: str) -> None:
    with pytest.raises(
        ValueError, match=f"v_format 'e4m3' needs kv dtype 'int8_static', not '{kv_dtype}'"
    ):
        check_v_format(kv_dtype, "e4m3")
    assert check_v_format("int8_static", "e4m3") is True
    assert check_v_format(kv_dtype, "int8") is False
    with pytest.raises(ValueError, match="v_format must be one of"):
        check_v_format("int8_static", "fp4")


def test_int8_groups_only_heads_above_128() -> None:
    # one scale per (token, kv-head) up to head size 128, one per 64 channels above; int4's V
    # groups apply at every head size
    int8 = catalogue.CATALOGUE["int8"]
    assert [int8.group_for(d) for d in (32, 64, 96, 128, 192, 256)] == [32, 64, 96, 128, 64, 64]
    int4 = catalogue.CATALOGUE["int4"]
    assert [int4.group_for(d) for d in (64, 128, 256)] == [64, 128, 128]
    static = catalogue.CATALOGUE["int8_static"]
    assert static.group_for(256) == 256


def test_the_tail_pool_takes_its_share_of_the_cache_memory() -> None:
    int4, int8 = catalogue.CATALOGUE["int4"], catalogue.CATALOGUE["int8"]
    # a slot: one 64-token page of K and V in BF16, and its block id
    assert int4.tail_slot_bytes(8, 128) == 2 * 8 * 64 * 128 * 2 + 4
    assert int8.tail_slot_bytes(8, 128) == 0
    gib = 2**30
    per_token = 32 * 8 * int4.bytes_per_token_head(128)  # 32 layers of 8 kv-heads of 128
    assert int4.tokens_with_tail(4 * gib, 32, 8, 128, 0) == 4 * gib // per_token
    # 256 slots of 32 layers: 2 GiB of BF16 pages, half of a 4 GiB cache
    pool = 32 * 256 * int4.tail_slot_bytes(8, 128)
    assert pool == 2 * gib + 32 * 256 * 4
    assert int4.tokens_with_tail(4 * gib, 32, 8, 128, 256) == (4 * gib - pool) // per_token
    assert int4.tokens_with_tail(pool // 2, 32, 8, 128, 256) == 0
    # a slot of three pages (two tail pages and a sink page): 128 of them, 3 GiB of pool
    three = int4.tokens_with_tail(4 * gib, 32, 8, 128, 128, pages_per_slot=3)
    assert three == (4 * gib - 3 * pool // 2) // per_token
    assert three == int4.tokens_with_tail(4 * gib, 32, 8, 128, 384)
    # without a tail the slots cost nothing
    assert int8.tokens_with_tail(gib, 2, 4, 64, 1024) == gib // (
        2 * 4 * int8.bytes_per_token_head(64)
    )
