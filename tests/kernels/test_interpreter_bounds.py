"""The interpreter's bounds checks (interpreter_bounds.py, installed by tests/conftest.py) catch
an out-of-bounds load and store of a kernel of ours, and pass one that stays inside."""

from __future__ import annotations

import os

import interpreter_bounds
import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="checks the Triton interpreter"
)


@triton.jit
def _copy(src, dst, n, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


@pytest.fixture(autouse=True)
def _check_this_module(monkeypatch: pytest.MonkeyPatch) -> None:
    # only the kernels of int8kv_kernels are checked: this module's counts as one of them
    monkeypatch.setattr(interpreter_bounds, "CHECKED_MODULES", ("int8kv_kernels", __name__))


def _launch(n: int) -> None:
    src, dst = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    _copy[(1,)](src, dst, n, N=16)
    assert dst[: min(n, 8)].tolist() == src[: min(n, 8)].tolist()


def test_a_launch_inside_its_tensors_passes() -> None:
    _launch(8)


def test_one_element_past_the_end_is_caught() -> None:
    with pytest.raises(Exception, match="outside every tensor of the launch"):
        _launch(9)
