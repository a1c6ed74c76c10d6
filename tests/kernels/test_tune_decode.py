"""benchmarks/tune_decode.py swaps ``attention._choose_config`` for a fixed config: the stand-in
must keep working when _choose_config's signature changes (it once took the new cc_major argument
as its tile size, and every swept config failed to compile on the GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import tune_decode  # noqa: E402

import int8kv_kernels.attention as A  # noqa: E402


@pytest.mark.parametrize("config", tune_decode.CONFIGS)
def test_fixed_config_reaches_the_launch_plan(config, monkeypatch):
    tile_n, warps, stages, chunks = config
    monkeypatch.setattr(A, "_choose_config", tune_decode._fixed_config(*config))
    query = torch.zeros(4, 12, 128)  # 4 decode tokens, GQA group 4 over 3 kv heads
    plan = A._plan_launch(query, 4, 4, 1, 8192, 3, None, 2)
    assert (plan.cfg.tile_n, plan.cfg.num_warps, plan.cfg.num_stages) == (tile_n, warps, stages)
    assert (plan.cfg.chunks, plan.cfg.block_m, plan.splits) == (chunks, 16, 2)
