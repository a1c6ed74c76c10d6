"""benchmarks/kernels.py's ``int8_fa2`` prefill impl (context gather + FlashAttention-2) on CPU, with
FlashAttention-2 replaced by the shim's torch stand-in: the benchmark must time the same calls,
with the same arguments, as the backend makes, or its row measures something else."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from int8kv_kernels.reference import gather_kv_context_ref
from int8kv_shim.flash_prefill import attention_ref

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("kernels_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DEV", "cpu")
    return module


@pytest.mark.parametrize("impl", ["int8_fa2", "int8_static_fa2"])
def test_fa2_prefill_impl_attends_over_gathered_context_and_new_tokens(bench, impl, monkeypatch):
    calls = []

    def flash_attn_varlen_func(q, k, v, *, out, cu_seqlens_q, max_seqlen_q, cu_seqlens_k,
                               max_seqlen_k, softmax_scale, causal, fa_version):  # fmt: skip
        assert causal and fa_version == 2
        calls.append((k.clone(), v.clone(), cu_seqlens_k.clone()))
        attention_ref(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, None, None)  # fmt: skip

    stub = types.ModuleType("vllm.vllm_flash_attn")
    stub.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", stub)

    torch.manual_seed(0)
    nq, nkv, d, ctx, q_len = 4, 2, 64, 48, 16
    cache = bench.Cache(impl, 4, nkv, d)
    bt = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    q = torch.randn(q_len, nq, d, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    qsl = torch.tensor([0, q_len], dtype=torch.int32)
    seq_lens = torch.tensor([ctx], dtype=torch.int32)
    bench.attention_fn(impl, cache, q, out, qsl, seq_lens, bt, q_len, ctx)()

    (k, v, cu_k), = calls  # fmt: skip
    assert cu_k.tolist() == [0, ctx] and k.shape == (ctx, nkv, d)
    # the first ctx - q_len keys come from the pages, dequantized as the reference does
    new = k[ctx - q_len :], v[ctx - q_len :]
    k_ref, v_ref = gather_kv_context_ref(
        cache.raw, *new, kv_dtype=bench.kv_dtype(impl), block_size=bench.BLOCK, block_table=bt,
        cu_seqlens_q=qsl, cu_seqlens_k=cu_k, k_scale=cache.sk, v_scale=cache.sv,
    )  # fmt: skip
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert out.abs().sum() > 0 and out.isfinite().all()


def test_decode_config_applies_to_decode_launches_only_and_is_undone(bench):
    import int8kv_kernels.attention as A

    orig = A._choose_config
    query = torch.zeros(4, 12, 128)  # GQA group 4 over 3 kv heads
    with bench.decode_config("64,2,4,1"):
        decode = A._plan_launch(query, 4, 4, 1, 8192, 3, None, 2).cfg
        prefill = A._plan_launch(query, 1, 4, 64, 8192, 3, None, None).cfg
    assert (decode.tile_n, decode.num_warps, decode.num_stages, decode.chunks) == (64, 2, 4, 1)
    assert prefill == orig(4, 128, 64) and not prefill.split
    assert A._choose_config is orig
    with bench.decode_config(None):
        assert A._choose_config is orig


def test_decode_matrix_defaults_and_a_single_point(bench) -> None:
    full = bench.decode_matrix(bench.parse_args([]))
    assert full == (bench.SHAPES, [1, 8, 32, 128], [1024, 4096, 8192, 32768])
    quick = bench.decode_matrix(bench.parse_args(["--quick"]))
    assert quick == (bench.SHAPES[:1], [8, 32], [1024, 8192])
    argv = ["--shapes", "2", "--batches", "1024", "--ctxs", "1024", "--decode-only"]
    args = bench.parse_args(argv)
    assert bench.decode_matrix(args) == ([(9, 3, 64)], [1024], [1024]) and args.decode_only
