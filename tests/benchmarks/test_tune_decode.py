"""benchmarks/tune_decode.py swaps ``attention._choose_config`` for a fixed config: the stand-in
must keep working when _choose_config's signature changes (it once took the new cc_major argument
as its tile size, and every swept config failed to compile on the GPU)."""

from __future__ import annotations

import json

import pytest
import torch

import int8kv_kernels.attention as A
from benchmarks import tune_decode


@pytest.mark.parametrize("config", tune_decode.CONFIGS)
def test_fixed_config_reaches_the_launch_plan(config, monkeypatch):
    tile_n, warps, stages, chunks = config
    monkeypatch.setattr(A, "_choose_config", tune_decode._fixed_config(*config))
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


def test_int4_prefetch_ab_times_every_loop_and_int8_at_every_point(tmp_path, monkeypatch):
    import int8kv_kernels.attention_int4 as A4
    from benchmarks import kernels as KB

    seen = []

    def fake_bench(impl, kernel, nq, nkv, d, batch, ctx, q_len):
        seen.append((impl, A4.DECODE_PREFETCH, nq, nkv, d, batch, ctx))
        return dict(kernel=kernel, impl=impl, q_heads=nq, kv_heads=nkv, head_dim=d, batch=batch,
                    ctx=ctx, ms=0.1, gbs=500.0)  # fmt: skip

    monkeypatch.setattr(KB, "bench_attention", fake_bench)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_a: "fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.delenv("OUT", raising=False)
    out = tmp_path / "ab.json"
    tune_decode.int4_prefetch_ab(1000.0, str(out))
    assert A4.DECODE_PREFETCH == 0  # restored
    points = [(s, b, c) for s in tune_decode.AB_SHAPES for b in tune_decode.AB_BATCHES
              for c in tune_decode.AB_CTXS]  # fmt: skip
    assert len(points) == 18
    expected = []
    for s, b, c in points:
        loops = (0, 1, 2) if c in tune_decode.AB_CTXS_PF2 else (0, 1)
        expected += [("int4", pf, *s, b, c) for pf in loops] + [("int8", 0, *s, b, c)]
    assert seen == expected
    # the page-id prefetching loop at the two longer contexts of every shape and batch
    assert sum(pf == 2 for _, pf, *_ in seen) == 12
    doc = json.loads(out.read_text())
    assert doc["gpu"] == "fake GPU" and doc["date"] and "git_commit" in doc and doc["command"]
    assert [r["prefetch"] for r in doc["rows"][:3]] == [0, 1, None]  # ctx 1024: no 2
    assert [r["prefetch"] for r in doc["rows"][3:7]] == [0, 1, 2, None]
    assert doc["rows"][0]["frac"] == 0.5
