"""benchmarks/kernels.py's ``int8_fa2`` prefill impl (context gather + FlashAttention-2) on CPU, with
FlashAttention-2 replaced by the shim's torch stand-in: the benchmark must time the same calls,
with the same arguments, as the backend makes, or its row measures something else."""

from __future__ import annotations

import importlib
import json
import os
import sys
import types

import pytest
import torch

from int8kv_kernels.reference import gather_kv_context_ref
from int8kv_shim.flash_prefill import attention_ref


@pytest.fixture
def bench(monkeypatch):
    module = importlib.import_module("benchmarks.kernels")
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


def test_int4_fa2_prefill_impl_gathers_pages_tail_and_sink(bench, monkeypatch):
    """``int4_sink_tail2_fa2``: the int4 gather over int4_sink_tail2's cache (pages, a two-page
    tail naming the sequence's newest pages, a sink page), then FlashAttention-2."""
    from int8kv_kernels.reference_int4 import gather_kv_context_int4_ref

    calls = []

    def flash_attn_varlen_func(q, k, v, *, out, cu_seqlens_k, **kw):  # noqa: ANN001, ANN202
        calls.append((k.clone(), v.clone(), cu_seqlens_k.clone()))

    stub = types.ModuleType("vllm.vllm_flash_attn")
    stub.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", stub)
    impl = "int4_sink_tail2_fa2"
    assert bench.kv_dtype(impl) == "int4" and bench.block_size(impl) == 64
    nq, nkv, d, seq_len, q_len = 4, 2, 64, 300, 40
    cache = bench.Cache(impl, 6, nkv, d, num_slots=1)
    bt = torch.tensor([[2, 0, 3, 5, 1]], dtype=torch.int32)
    q = torch.randn(q_len, nq, d, dtype=torch.bfloat16)
    qsl = torch.tensor([0, q_len], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    bench.attention_fn(impl, cache, q, torch.zeros_like(q), qsl, seq_lens, bt, q_len, seq_len)()

    (k, v, cu_k), = calls  # fmt: skip
    assert cu_k.tolist() == [0, seq_len] and cache.tail_page.tolist() == [[1, 5]]
    new = k[seq_len - q_len :], v[seq_len - q_len :]
    k_ref, v_ref = gather_kv_context_int4_ref(
        cache.raw, *new, block_size=64, block_table=bt, cu_seqlens_q=qsl, cu_seqlens_k=cu_k,
        tail=cache.tail, tail_page=cache.tail_page, slot_of_seq=torch.zeros(1, dtype=torch.int32),
        sink=cache.sink, sink_of_seq=cache.sink_of_seq,
    )  # fmt: skip
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    # keys 0..63 from the sink, 192..299 from the tail (page 3 in the half of odd pages)
    assert torch.equal(k[:64], cache.sink[0, 0].transpose(0, 1))
    assert torch.equal(k[192:256], cache.tail[0, 0, :, 64:128].transpose(0, 1))


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


def _krow(kernel, impl, batch, ctx, ms, slots=None):
    row = dict(kernel=kernel, impl=impl, q_heads=32, kv_heads=8, head_dim=128, batch=batch,
               ctx=ctx, ms=ms, gbs=1.0)  # fmt: skip
    return row | ({"slots": slots} if slots else {})


def test_append_replaces_rows_of_the_same_measurement_and_keeps_the_rest(bench):
    old = [_krow("decode", "int8", 8, 8192, 0.064), _krow("decode", "bf16_fa2", 8, 8192, 0.092),
           _krow("write", "int8", 256, 0, 0.004, "random"),
           _krow("write", "int8", 16384, 0, 0.05, "consecutive")]  # fmt: skip
    new = [_krow("decode", "int8", 8, 8192, 0.057), _krow("write", "int8", 256, 0, 0.003, "random")]
    merged = bench.merge_rows(old, new)
    assert sorted((r["kernel"], r["impl"], r["ms"]) for r in merged) == [
        ("decode", "bf16_fa2", 0.092), ("decode", "int8", 0.057),
        ("write", "int8", 0.003), ("write", "int8", 0.05)]  # fmt: skip


def test_from_log_rebuilds_a_killed_runs_decode_rows_into_an_existing_file(
    bench, tmp_path, monkeypatch
):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(bench, "plot", lambda result, path: None)
    out = tmp_path / "kernels.json"
    earlier = [_krow("decode", "int8", 8, 8192, 0.064), _krow("prefill", "int8_fa2", 1, 8192, 0.7)]
    out.write_text(json.dumps({"gpu": "NVIDIA H200", "command": "python -m benchmarks.kernels",
                               "peak_bw_gbs": 4270.0, "rows": earlier, "skipped": []}))  # fmt: skip
    printed = [_krow("decode", "int8", 8, 8192, 0.057), _krow("decode", "bf16_fa2", 8, 8192, 0.09),
               _krow("prefill", "int8", 1, 8192, 1.06)]  # fmt: skip
    log = tmp_path / "kernels_bench.log"
    # run_gpu_e2e.sh's staging lines come first in a step's log
    log.write_text("gpu bundle: assembling 5 parts\nNVIDIA H200: copy 4245 GB/s\n"
                   + "".join(json.dumps(r) + "\n" for r in printed)
                   + "skip int4 (...): RuntimeError: x\n")  # fmt: skip
    argv = ["kernels.py", "--from-log", str(log), "--log-command", "python -m benchmarks.kernels "
            "--quick", "--decode-only", "--append", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    result = json.loads(out.read_text())
    by_key = {(r["kernel"], r["impl"]): r["ms"] for r in result["rows"]}
    # decode rows replaced or added; the earlier prefill pair kept, the log's prefill row not taken
    assert by_key == {("decode", "int8"): 0.057, ("decode", "bf16_fa2"): 0.09,
                      ("prefill", "int8_fa2"): 0.7}  # fmt: skip
    assert result["peak_bw_gbs"] == 4270.0
    assert result["command"].startswith(
        "python -m benchmarks.kernels ; python -m benchmarks.kernels"
    )
    assert f"(rows from {os.path.relpath(log)})" in result["command"]


def test_from_log_refuses_a_log_without_its_bandwidth_line_or_command(bench, tmp_path, monkeypatch):
    log = tmp_path / "kernels_bench.log"
    log.write_text('{"kernel": "decode"}\n')
    with pytest.raises(SystemExit, match="no '<gpu>: copy"):
        bench.parse_log(log.read_text())
    monkeypatch.setattr(sys, "argv", ["kernels.py", "--from-log", str(log)])
    with pytest.raises(SystemExit, match="--log-command"):
        bench.main()


def test_each_timed_row_is_saved_at_once_so_a_killed_run_keeps_it(bench, tmp_path, monkeypatch):
    out = tmp_path / "kernels.json"
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(bench, "copy_bw_gbs", lambda: 4000.0)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "GPU")
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    seen = []

    def bench_attention(impl, kernel, nq, nkv, d, batch, ctx, q_len):
        seen.append(len(json.loads(out.read_text())["rows"]) if out.exists() else 0)
        if len(seen) == 3:
            raise KeyboardInterrupt  # the device call's limit, mid-run
        return _krow(kernel, impl, batch, ctx, 0.01)

    monkeypatch.setattr(bench, "bench_attention", bench_attention)
    argv = ["kernels.py", "--quick", "--impls", "bf16_fa2", "int8", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(KeyboardInterrupt):
        bench.main()
    assert seen == [0, 1, 2] and len(json.loads(out.read_text())["rows"]) == 2


def test_prefill_rows_are_told_apart_by_their_new_tokens(bench):
    # a row from before q_len was recorded timed PREFILL_Q_LEN new tokens: a new row of that
    # length replaces it, a row of another length sits beside it
    old = [_krow("prefill", "int8", 1, 8192, 1.0), _krow("decode", "int8", 1, 8192, 0.1)]
    same = {**_krow("prefill", "int8", 1, 8192, 0.9), "q_len": bench.PREFILL_Q_LEN}
    short = {**_krow("prefill", "int8", 1, 8192, 0.2), "q_len": 31}
    merged = bench.merge_rows(old, [same, short])
    assert sorted((r["kernel"], r.get("q_len"), r["ms"]) for r in merged) == [
        ("decode", None, 0.1),
        ("prefill", 31, 0.2),
        ("prefill", bench.PREFILL_Q_LEN, 0.9),
    ]


def test_prefill_q_lens_time_each_length_for_every_prefill_impl(bench, tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(bench, "plot", lambda result, path: None)
    monkeypatch.setattr(bench, "copy_bw_gbs", lambda: 4000.0)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "GPU")
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    timed = []

    def bench_attention(impl, kernel, nq, nkv, d, batch, ctx, q_len):
        timed.append((impl, kernel, batch, ctx, q_len))
        return {**_krow(kernel, impl, batch, ctx, 1.0), "q_len": q_len}

    monkeypatch.setattr(bench, "bench_attention", bench_attention)
    out = tmp_path / "k.json"
    argv = ["kernels.py", "--quick", "--impls", "bf16_fa2", "int8", "--prefill-only",
            "--prefill-q-lens", "31", "63", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    # int8 brings its gather + FlashAttention-2 path and its unsplit launch along; one sequence
    # of PREFILL_CTX keys
    assert timed == [(impl, "prefill", 1, bench.PREFILL_CTX, q) for q in (31, 63)
                     for impl in ("bf16_fa2", "int8", "int8_fa2", "int8_unsplit")]  # fmt: skip
    assert len(json.loads(out.read_text())["rows"]) == 8


def test_unsplit_impls_launch_their_format_with_one_split(bench):
    for impl, base in bench.UNSPLIT.items():
        assert bench.kv_dtype(impl) == bench.kv_dtype(base)
        assert bench.block_size(impl) == bench.block_size(base)
        assert bench.has_tail(impl) == bench.has_tail(base)
        assert bench.TAIL_PAGES.get(impl) == bench.TAIL_PAGES.get(base)
        assert (impl in bench.SINK_IMPLS) == (base in bench.SINK_IMPLS)


@pytest.mark.parametrize(("flag", "kinds"), [
    ([], {"decode", "prefill", "write"}), (["--decode-only"], {"decode"}),
    (["--write-only"], {"write"}), (["--prefill-only"], {"prefill"})])  # fmt: skip
def test_only_flags_choose_which_kernels_are_timed(bench, tmp_path, monkeypatch, flag, kinds):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(bench, "plot", lambda result, path: None)
    monkeypatch.setattr(bench, "copy_bw_gbs", lambda: 4000.0)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "GPU")
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "bench_attention",
                        lambda impl, kernel, *a: _krow(kernel, impl, a[3], a[4], 1.0))  # fmt: skip
    monkeypatch.setattr(bench, "bench_write",
                        lambda impl, nq, nkv, d, tokens=256, consecutive=False:
                        _krow("write", impl, tokens, 0, 1.0, "random"))  # fmt: skip
    out = tmp_path / "k.json"
    argv = ["kernels.py", "--quick", "--impls", "int8", "--out", str(out), *flag]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    assert {r["kernel"] for r in rows} == kinds


def test_decode_only_and_write_only_exclude_each_other(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--decode-only", "--write-only"])


def test_append_refuses_a_file_measured_on_another_gpu(bench, tmp_path):
    out = tmp_path / "kernels.json"
    out.write_text(json.dumps({"gpu": "NVIDIA A10", "command": "x", "peak_bw_gbs": 600.0,
                               "rows": [], "skipped": []}))  # fmt: skip
    args = bench.parse_args(["--append", "--out", str(out)])
    result = {
        "gpu": "NVIDIA H200",
        "command": "y",
        "peak_bw_gbs": 4270.0,
        "rows": [],
        "skipped": [],
    }
    with pytest.raises(SystemExit, match="was measured on NVIDIA A10"):
        bench.merge_previous(args, result)


def test_int4_rows_build_a_tail_and_read_it(bench):
    """The int4 decode row reads ctx + TAIL_TOKENS keys per sequence, the last ones from the
    tail pool its Cache builds (one slot per sequence); the write row restores every slot's page
    before each write, so each timed write flushes the pages its tokens complete."""
    nq, nkv, d, batch, ctx = 4, 2, 64, 2, 128
    bs = bench.block_size("int4")
    assert bs == 64 and bench.block_size("int8") == bench.BLOCK
    seq_len = ctx + bench.TAIL_TOKENS
    cache = bench.Cache("int4", batch * 3 + 1, nkv, d, batch)
    assert cache.tail.shape == (batch, 2, nkv, 64, d)
    bt = torch.randperm(batch * 3).int().view(batch, 3)
    q = torch.randn(batch, nq, d, dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    sl = torch.full((batch,), seq_len, dtype=torch.int32)
    bench.attention_fn("int4", cache, q, out, qsl, sl, bt, 1, seq_len)()
    assert out.isfinite().all()
    cache.tail[:, :, :, : bench.TAIL_TOKENS] = float("nan")  # the tail is read: NaN comes out
    bench.attention_fn("int4", cache, q, out, qsl, sl, bt, 1, seq_len)()
    assert out.isnan().all()

    wc = bench.Cache("int4", 64, nkv, d, 8)
    key = torch.randn(8, nkv, d, dtype=torch.bfloat16)
    seq_lens = [64, 5, 128, 70, 1, 63, 200, 192]  # 64, 128, 192 complete a page
    write = bench.int4_write_fn(wc, key, torch.randn_like(key), False, seq_lens)
    for _ in range(2):  # the same pages are flushed both times: the slots' pages are restored
        wc.raw.zero_()
        write()
        flushed = (wc.raw != 0).any(dim=1).sum()
        assert int(flushed) == 3
        # every slot still holds its last page, the ones this write completed too
        assert (wc.tail_page[:8] >= 0).all(), wc.tail_page


def test_int4_tail2_rows_read_and_keep_two_pages(bench):
    """``--impls int4_tail2``: a two-page pool whose halves name each sequence's newest page and
    the one before it, so the decode row reads both from the tail; its write keeps both."""
    nq, nkv, d, batch, ctx = 4, 2, 64, 2, 128
    seq_len = ctx + bench.TAIL_TOKENS
    assert bench.kv_dtype("int4_tail2") == "int4" and bench.block_size("int4_tail2") == 64
    cache = bench.Cache("int4_tail2", batch * 3 + 1, nkv, d, batch)
    assert cache.tail.shape == (batch, 2, nkv, 128, d) and cache.tail_page.shape == (batch, 2)
    bt = torch.randperm(batch * 3).int().view(batch, 3)
    q = torch.randn(batch, nq, d, dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    sl = torch.full((batch,), seq_len, dtype=torch.int32)
    bench.attention_fn("int4_tail2", cache, q, out, qsl, sl, bt, 1, seq_len)()
    assert out.isfinite().all()
    assert cache.tail_page.tolist() == [[int(bt[r, 2]), int(bt[r, 1])] for r in range(batch)]
    cache.tail[:, :, :, 64:] = float("nan")  # page 1 (half 1) is read from the tail
    bench.attention_fn("int4_tail2", cache, q, out, qsl, sl, bt, 1, seq_len)()
    assert out.isnan().all()

    wc = bench.Cache("int4_tail2", 64, nkv, d, 8)
    key = torch.randn(8, nkv, d, dtype=torch.bfloat16)
    seq_lens = [64, 5, 128, 70, 1, 63, 200, 192]
    write = bench.int4_write_fn(wc, key, torch.randn_like(key), False, seq_lens)
    for _ in range(2):
        wc.raw.zero_()
        write()
        assert int((wc.raw != 0).any(dim=1).sum()) == 3
        # every sequence past its first page keeps the page before its newest too
        held = (wc.tail_page[:8] >= 0).sum(dim=1).tolist()
        assert held == [1, 1, 2, 2, 1, 1, 2, 2], wc.tail_page


def test_int4_sink_tail2_rows_read_each_sequences_first_page_from_its_sink(bench):
    """``--impls int4_sink_tail2``, int4 as it ships: two tail pages as ``int4_tail2``, and each
    sequence's first 64 keys read from its own sink page in BF16, int4 page 0 left unread."""
    nq, nkv, d, batch, ctx = 4, 2, 64, 2, 192
    seq_len = ctx + bench.TAIL_TOKENS  # four pages: 0 from the sink, 1 int4, 2 and 3 in the tail
    assert bench.kv_dtype("int4_sink_tail2") == "int4" and "int4_sink_tail2" in bench.SINK_IMPLS
    cache = bench.Cache("int4_sink_tail2", batch * 4 + 1, nkv, d, batch)
    assert cache.sink.shape == (batch, 2, nkv, 64, d) and cache.sink_of_seq.tolist() == [0, 1]
    bt = torch.randperm(batch * 4).int().view(batch, 4)
    q = torch.randn(batch, nq, d, dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    sl = torch.full((batch,), seq_len, dtype=torch.int32)
    attend = bench.attention_fn("int4_sink_tail2", cache, q, out, qsl, sl, bt, 1, seq_len)
    attend()
    assert out.isfinite().all()
    before = out.clone()
    first = bt[:, 0].long()
    cache.raw[first] = torch.randint(-128, 128, cache.raw[first].shape, dtype=torch.int8)
    attend()
    assert torch.equal(out, before)  # int4 page 0 is not read
    cache.sink[:, :, :, :8] = float("nan")
    attend()
    assert out.isnan().all()  # the sink page is


def test_a_run_without_bf16_fa2_decode_rows_writes_no_plot(bench, tmp_path, capsys):
    # every point of the plot is a speedup over bf16_fa2: a run without it (an int4-only run
    # on a host without vLLM) drew an empty frame before
    row = {"kernel": "decode", "impl": "int8", "q_heads": 9, "kv_heads": 3, "head_dim": 64,
           "batch": 1, "ctx": 1024, "ms": 0.01, "gbs": 1.0}  # fmt: skip
    out = tmp_path / "k.json"
    bench.save({"gpu": "g", "command": "c", "rows": [row]}, str(out), with_plot=True)
    assert out.exists() and not (tmp_path / "k.png").exists()
    assert "no plot: no bf16_fa2 decode rows" in capsys.readouterr().out
    pytest.importorskip("matplotlib")  # the plot itself (the bench extra), not the test extra
    bench.save({"gpu": "g", "command": "c", "rows": [row, {**row, "impl": "bf16_fa2"}]},
               str(out), with_plot=True)  # fmt: skip
    assert (tmp_path / "k.png").exists()
