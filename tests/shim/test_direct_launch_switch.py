"""INT8KV_DIRECT_LAUNCH=0 reaches the kernels: the attention impl turns direct launches off."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
from int8kv_kernels import launch  # noqa: E402
from int8kv_shim.attention_impl import Int8KVAttentionImpl  # noqa: E402


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("0", False)])
def test_impl_applies_the_direct_launch_switch(monkeypatch, value, enabled) -> None:
    monkeypatch.setattr(launch, "_ENABLED", True)  # restored after the test
    if value is None:
        monkeypatch.delenv("INT8KV_DIRECT_LAUNCH", raising=False)
    else:
        monkeypatch.setenv("INT8KV_DIRECT_LAUNCH", value)
    Int8KVAttentionImpl(8, 64, 0.125, 2, None, None, "int8", None, "decoder", None)
    assert launch._ENABLED is enabled
