"""benchmarks/tune_decode.py swaps ``attention._choose_config`` for a fixed config: the stand-in
must keep working when _choose_config's signature changes (it once took the new cc_major argument
as its tile size, and every swept config failed to compile on the GPU)."""

from __future__ import annotations

import pytest
import torch

import int8kv_kernels.attention as A
from benchmarks import tune_decode


@pytest.mark.parametrize("config", tune_decode.CONFIGS)
def testfixed_config_reaches_the_launch_plan(config, monkeypatch):
    tile_n, warps, stages, chunks = config
    monkeypatch.setattr(A, "_choose_config", tune_decode.fixed_config(*config))
    query = torch.zeros(4, 12, 128)  # 4 decode tokens, GQA group 4 over 3 kv heads
    plan = A._plan_launch(query, 4, 4, 1, 8192, 3, None, 2)
    assert (plan.cfg.tile_n, plan.cfg.num_warps, plan.cfg.num_stages) == (tile_n, warps, stages)
    assert (plan.cfg.chunks, plan.cfg.block_m, plan.splits) == (chunks, 16, 2)


def _row(config, batch, ctx, frac, splits=8, dtype="int8"):
    tile, warps, stages, chunks = config
    return dict(dtype=dtype, batch=batch, ctx=ctx, tile=tile, warps=warps, stages=stages,
                chunks=chunks, splits=splits, us=1.0, frac=frac)  # fmt: skip


def test_best_config_ranks_on_the_target_shapes_at_each_configs_best_split():
    a, b, c = (128, 4, 5, 1), (64, 2, 4, 1), (32, 1, 4, 1)
    rows = [
        # a: 0.6 and 0.7 at its best splits (the 0.1 rows are worse split counts)
        _row(a, 8, 8192, 0.6), _row(a, 8, 8192, 0.1, splits=16), _row(a, 32, 8192, 0.7),
        _row(a, 32, 8192, 0.1, splits=2),
        # b: 0.5 and 0.9, geometric mean 0.67 > a's 0.65, though its worst shape is worse
        _row(b, 8, 8192, 0.5), _row(b, 32, 8192, 0.9),
        # c: best of all on one target shape, but it never ran on the other
        _row(c, 8, 8192, 0.99),
        # off-target shape and int8_static rows do not count
        _row(a, 8, 1024, 0.99), _row(c, 32, 8192, 0.99, dtype="int8_static"),
    ]  # fmt: skip
    assert tune_decode.best_config(rows) == b
    with pytest.raises(ValueError, match="no int8 config"):
        tune_decode.best_config([_row(c, 8, 8192, 0.99)])
