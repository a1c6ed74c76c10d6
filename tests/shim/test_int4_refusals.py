"""What int4's tail pool cannot honour yet is refused at start-up, one line each, in the front
end (patch P10 on EngineArgs.create_engine_config); its block size is set when the user gave none.
The check reads plain attributes of vLLM's VllmConfig, so stand-ins carry them here (a real one
needs a GPU); the engine-level refusal itself is a GPU test."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from int8kv_shim.patch import int4_config_refusal


def _config(cache_dtype: str = "int4", block_size: int = 16, user_block: bool = False,
            **overrides: Any) -> SimpleNamespace:  # fmt: skip
    parallel = SimpleNamespace(
        enable_dbo=False, decode_context_parallel_size=1, prefill_context_parallel_size=1
    )
    config = SimpleNamespace(
        cache_config=SimpleNamespace(
            cache_dtype=cache_dtype, block_size=block_size, user_specified_block_size=user_block
        ),
        speculative_config=None,
        parallel_config=parallel,
        kv_transfer_config=None,
    )
    for name, value in overrides.items():
        target = parallel if hasattr(parallel, name) else config
        setattr(target, name, value)
    return config


def test_int4_gets_64_token_blocks_when_the_user_gave_none() -> None:
    config = _config()
    assert int4_config_refusal(config) is None
    assert config.cache_config.block_size == 64


@pytest.mark.parametrize("dtype", ["int8", "int8_static", "auto", "fp8"])
def test_other_dtypes_keep_their_block_size_and_options(dtype: str) -> None:
    config = _config(dtype, speculative_config=object(), enable_dbo=True)
    assert int4_config_refusal(config) is None
    assert config.cache_config.block_size == 16


def test_int4_accepts_block_size_64_given_by_the_user() -> None:
    assert int4_config_refusal(_config(block_size=64, user_block=True)) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"block_size": 16, "user_block": True},
            "int8kv-shim: --kv-cache-dtype int4 stores pages of 64 tokens: use --block-size 64 "
            "(or leave --block-size out), not 16",
        ),
        (
            {"block_size": 128, "user_block": True},
            "int8kv-shim: --kv-cache-dtype int4 stores pages of 64 tokens: use --block-size 64 "
            "(or leave --block-size out), not 128",
        ),
        (
            {"speculative_config": object()},
            "int8kv-shim: --kv-cache-dtype int4 does not support speculative decoding yet: "
            "unverified draft tokens would be quantized into its pages; drop the speculative "
            "config or use --kv-cache-dtype int8",
        ),
        ({"enable_dbo": True}, "does not support dual-batch overlap (--enable-dbo)"),
        ({"decode_context_parallel_size": 2}, "(--decode-context-parallel-size > 1)"),
        ({"prefill_context_parallel_size": 2}, "(--prefill-context-parallel-size > 1)"),
        ({"kv_transfer_config": object()}, "does not support KV connectors (--kv-transfer-config)"),
    ],
)
def test_int4_refuses_in_one_line(overrides: dict[str, Any], message: str) -> None:
    block = {k: overrides.pop(k) for k in ("block_size", "user_block") if k in overrides}
    reason = int4_config_refusal(_config(**block, **overrides))
    assert reason is not None and message in reason and "\n" not in reason
    assert reason.startswith("int8kv-shim: --kv-cache-dtype int4 ")
