"""CPU tests of ``benchmarks/serve_bench.py``: the plan, vLLM's log and result formats, the merge,
the command lines, the random Llama, and whole runs against a stand-in ``vllm`` (``fake_vllm.py``:
a tiny HTTP server for ``serve``, a result writer or the real client for ``bench serve``)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import serve_bench as sb
from benchmarks import server_metrics as sm

HERE = Path(__file__).resolve().parent
FAKE_VLLM = shlex.join([sys.executable, str(HERE / "fake_vllm.py")])
VLLM_DIR = Path(importlib.util.find_spec("vllm").origin).parent  # found, not imported
# the shim's start-up line (int8kv_shim/kernel_warmup.py) that serve_bench reads
KERNEL_WARMUP_FORMAT = "compiled our kernels' serving variants at start-up (%d launches, %.1f s)"


# --------------------------------------------------------------------------------------------
# the plan


def test_arguments_and_defaults() -> None:
    args = sb.parse_args([])
    assert args.dtypes == ["auto_fa2", "int8_per_token_head", "int8", "int4"]
    assert args.input_lens == [8192, 32768] and args.output_len == 256
    assert args.concurrency == [1, 8, 32, 128]
    assert args.vllm[1:] == ["-m", "vllm.entrypoints.cli.main"]
    args = sb.parse_args(["--input-lens", "8k, 7936", "--dtypes", "int8,,int4", "--vllm", "vllm"])
    assert args.input_lens == [8192, 7936] and args.dtypes == ["int8", "int4"]
    assert args.vllm == ["vllm"]
    assert sb.parse_args(["--serve-args=--enforce-eager --max-num-seqs 64"]).serve_args == [
        "--enforce-eager",
        "--max-num-seqs",
        "64",
    ]
    for bad in (["--concurrency", "0,8"], ["--input-lens", "8M"], ["--dtypes", ","]):
        with pytest.raises(SystemExit):
            sb.parse_args(bad)


def test_models_map_to_folders(tmp_path: Path) -> None:
    env = {"SMOLLM2_DIR": "/m/smol", "GEMMA3_DIR": "/m/gemma"}
    specs = sb.model_specs("smollm2,gemma3,llama3-8b-shape,mine=/x/y", tmp_path, env)
    assert [(s.name, str(s.path), s.build_llama) for s in specs] == [
        ("smollm2", "/m/smol", False),
        ("gemma3", "/m/gemma", False),
        ("llama3-8b-shape", str(tmp_path / "models" / "llama3-8b-shape"), True),
        ("mine", "/x/y", False),
    ]
    with pytest.raises(ValueError, match="GEMMA3_DIR"):
        sb.model_specs("gemma3", tmp_path, {})
    with pytest.raises(ValueError, match="unknown model"):
        sb.model_specs("llama70b", tmp_path, env)


def test_input_lengths_fit_the_context() -> None:
    # SmolLM2 (8192): "8K" becomes 7936 and "32K" collapses into it
    assert sb.effective_input_lens([8192, 32768], 256, 8192) == [7936]
    assert sb.effective_input_lens([8192, 32768], 256, 32768) == [8192, 32512]  # Gemma 3
    assert sb.effective_input_lens([32768, 8192], 256, 40960) == [8192, 32768]  # Llama shape
    assert sb.effective_input_lens([1024], 256, 8192) == [1024]
    with pytest.raises(ValueError):
        sb.effective_input_lens([8192], 256, 256)
    # max_model_len of a server: its longest input + output, never above the context
    for context in (8192, 32768, 40960):
        lens = sb.effective_input_lens([8192, 32768], 256, context)
        assert max(lens) + 256 <= context


def test_num_prompts_rule_and_seeds() -> None:
    assert [sb.num_prompts_for(c, 4, 8) for c in (1, 2, 8, 32, 128)] == [8, 8, 32, 128, 512]
    assert sb.num_prompts_for(1, 4, 20) == 20
    points = sb.plan_points([8192, 32768], [32, 1, 8], 4, 8)
    assert points == [
        (8192, 1, 8),
        (8192, 8, 32),
        (8192, 32, 128),
        (32768, 1, 8),
        (32768, 8, 32),
        (32768, 32, 128),
    ]
    seeds = [sb.point_seed(0, n, c) for n, c, _ in points]
    assert len(set(seeds)) == len(seeds)  # no point re-sends another's prompts
    assert sb.point_seed(0, 8192, 8) != sb.point_seed(1, 8192, 8)


# --------------------------------------------------------------------------------------------
# what vLLM writes


def test_kv_cache_line_parser() -> None:
    source = (VLLM_DIR / "v1" / "core" / "kv_cache_utils.py").read_text()
    # the format the parser reads: vLLM formats the count with thousands separators
    assert 'logger.info_once("GPU KV cache size: %s tokens", f"{num_tokens:,}")' in source
    line = f"GPU KV cache size: {1234567:,} tokens"  # as the logger fills its %s
    log = (
        "(EngineCore pid=42) INFO 05-12 10:00:00 [kv_cache_utils.py:2146] " + line + "\n"
        "(EngineCore pid=42) INFO 05-12 10:00:00 [kv_cache_utils.py:2148] Maximum concurrency "
        "for 8,192 tokens per request: 150.70x\n"
    )
    assert sb.kv_cache_tokens_from_log(log) == 1234567
    assert sb.kv_cache_tokens_from_log("GPU KV cache size: 999 tokens") == 999
    assert sb.kv_cache_tokens_from_log("GPU KV cache size: 1,000 tokens\n" + line) == 1234567
    assert sb.kv_cache_tokens_from_log("INFO nothing here") is None


def test_engine_error_is_the_engine_cores_last_exception_line() -> None:
    # as a server whose engine core died at start-up logged it (2026-12-02, a Triton launcher
    # build that found no C compiler), trimmed: the API server names no cause of its own
    log = (
        "(EngineCore pid=4389) ERROR 12-02 21:12:24 [core.py:1231] Traceback (most recent call "
        "last):\n"
        "(EngineCore pid=4389) ERROR 12-02 21:12:24 [core.py:1231]     available_gpu_memory = "
        "self.model_executor.determine_available_memory()\n"
        "(EngineCore pid=4389) ERROR 12-02 21:12:24 [core.py:1231] FileNotFoundError: [Errno 2] "
        "No such file or directory: '128,32'\n"
        "(EngineCore pid=4389) Process EngineCore:\n"
        "(EngineCore pid=4389) FileNotFoundError: [Errno 2] No such file or directory: '128,32'\n"
        "(APIServer pid=4324) RuntimeError: Engine core initialization failed. See root cause "
        "above. Failed core proc(s): {}\n"
    )
    cause = "FileNotFoundError: [Errno 2] No such file or directory: '128,32'"
    assert sb.engine_error_from_log(log) == cause
    dotted = "(EngineCore pid=7) torch.AcceleratorError: CUDA error: an illegal memory access\n"
    assert (
        sb.engine_error_from_log(dotted)
        == "torch.AcceleratorError: CUDA error: an illegal memory access"
    )
    assert sb.engine_error_from_log("(APIServer pid=1) RuntimeError: Engine core failed") is None
    assert sb.engine_error_from_log("(EngineCore pid=1) INFO all well") is None


def test_jit_compile_parser() -> None:
    source = (VLLM_DIR / "triton_utils" / "jit_monitor.py").read_text()
    # the two messages of vLLM's JIT monitor: once per kernel name, and every compile when verbose
    assert '"Triton kernel JIT compilation during inference: %s. "' in source
    assert '"Triton %sJIT compilation during inference: %s (key=%s)."' in source
    log = (
        "(EngineCore pid=2515) WARNING 12-01 22:18:12 [jit_monitor.py:106] Triton kernel JIT "
        "compilation during inference: _gather_kv_kernel. This causes a latency spike; consider "
        "extending warmup to cover this shape/config.\n"
        "INFO 12-01 22:18:13 [loggers.py:273] Engine 000: Avg prompt throughput: 5.0 tokens/s\n"
        "(EngineCore pid=2515) WARNING 12-01 22:19:22 [jit_monitor.py:99] Triton kernel JIT "
        "compilation during inference: _attn_fwd (key=[('*bf16', 'D')])."
        "\n(EngineCore pid=2515) WARNING 12-01 22:19:23 [jit_monitor.py:99] Triton "
        "autotune/warmup candidate JIT compilation during inference: _attn_fwd (key=None).\n"
    )
    assert sb.jit_compiles_from_log(log) == ["_gather_kv_kernel", "_attn_fwd", "_attn_fwd"]
    assert sb.jit_compiles_from_log("INFO Kernel JIT monitor activated") == []


def test_startup_phases_parser() -> None:
    log = (
        "INFO [default_loader.py:431] Loading weights took 0.41 seconds\n"
        "INFO [gpu_model_runner.py:5256] Model loading took 0.27 GiB memory and 1.234567 seconds\n"
        "INFO [monitor.py:20] torch.compile took 38.20 s in total\n"
        "INFO [gpu_model_runner.py:6657] Graph capturing finished in 12 secs, took 0.50 GiB\n"
        "INFO [core.py:345] init engine (profile, create kv cache, warmup model) took 61.50 s "
        "(compilation: 38.20 s)\n"
    )
    assert sb.startup_phases_from_log(log) == {
        "load_weights_s": 0.41,
        "model_loading_s": 1.234567,
        "torch_compile_s": 38.2,
        "graph_capture_s": 12.0,
        "init_engine_s": 61.5,
    }
    sources = {
        "model_executor/model_loader/default_loader.py": '"Loading weights took %.2f seconds"',
        "v1/worker/gpu_model_runner.py": '"Graph capturing finished in %.0f secs, took %.2f GiB"',
        "compilation/monitor.py": '"torch.compile took %.2f s in total"',
        "v1/engine/core.py": '"init engine (profile, create kv cache, warmup model) took "',
    }
    for rel, text in sources.items():
        assert text in (VLLM_DIR / rel).read_text(), rel


def test_startup_phases_sum_the_shims_kernel_compiles() -> None:
    """One line per group of layers (a sliding and a full group on Gemma 3), in the format the
    shim logs."""
    line = "INFO [kernel_warmup.py:131] int8kv-shim: " + KERNEL_WARMUP_FORMAT
    log = line % (14, 48.9) + "\n" + line % (14, 66.6) + "\n"
    assert sb.startup_phases_from_log(log) == {"kernel_warmup_s": 115.5}
    assert sb.startup_phases_from_log("no such line\n") == {}
    shim = Path(sb.__file__).parents[1] / "int8kv_shim" / "kernel_warmup.py"
    assert KERNEL_WARMUP_FORMAT in shim.read_text()


def _bench_result(**over: object) -> dict:
    """A ``vllm bench serve --save-result`` JSON (no --save-detailed) with its real field names."""
    doc = {
        "date": "20250101-120000",
        "endpoint_type": "vllm",
        "backend": "vllm",
        "label": None,
        "model_id": "/models/smollm2",
        "tokenizer_id": "/models/smollm2",
        "num_prompts": 32,
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": 8,
        "duration": 12.5,
        "completed": 32,
        "failed": 0,
        "total_input_tokens": 32 * 7936,
        "total_output_tokens": 32 * 256,
        "request_throughput": 2.56,
        "request_goodput": None,
        "output_throughput": 655.36,
        "total_token_throughput": 20971.5,
        "max_output_tokens_per_s": 800.0,
        "max_concurrent_requests": 8,
        "rtfx": 0.0,
        "mean_ttft_ms": 41.0,
        "median_ttft_ms": 40.1234,
        "std_ttft_ms": 3.0,
        "p50_ttft_ms": 40.1234,
        "p99_ttft_ms": 55.5,
        "mean_tpot_ms": 3.1,
        "median_tpot_ms": 3.04567,
        "std_tpot_ms": 0.1,
        "p50_tpot_ms": 3.04567,
        "p99_tpot_ms": 3.5,
        "mean_itl_ms": 3.1,
        "median_itl_ms": 3.0,
        "std_itl_ms": 0.5,
        "p50_itl_ms": 3.0,
        "p99_itl_ms": 7.25,
    }
    return doc | over


def test_result_json_becomes_a_row() -> None:
    serve_py = (VLLM_DIR / "benchmarks" / "serve.py").read_text()
    for text in (
        'result[f"median_{metric_attribute_name}_ms"]',
        'result[f"p{p_word}_{metric_attribute_name}_ms"]',
        'result[f"mean_{metric_attribute_name}_ms"]',
        'result[f"std_{metric_attribute_name}_ms"]',
        '"output_throughput": metrics.output_throughput',
        '"completed": metrics.completed',
        '"failed": metrics.failed',
        'result_json["num_prompts"] = args.num_prompts',
        'result_json["max_concurrency"] = args.max_concurrency',
    ):
        assert text in serve_py, text
    kw = dict(
        model="smollm2",
        dtype="int8",
        input_len=7936,
        output_len=256,
        concurrency=8,
        kv_cache_tokens=1234567,
        engine_start_s=63.44,
    )
    row = sb.result_to_row(_bench_result(), **kw)
    assert list(row) == sb.ROW_KEYS
    assert row == {
        "model": "smollm2",
        "dtype": "int8",
        "input_len": 7936,
        "output_len": 256,
        "concurrency": 8,
        "num_prompts": 32,
        "ttft_ms_p50": 40.123,
        "ttft_ms_p99": 55.5,
        "tpot_ms_p50": 3.046,
        "tpot_ms_p99": 3.5,
        "itl_ms_p50": 3.0,
        "itl_ms_p99": 7.25,
        "itl_ms_mean": 3.1,
        "itl_ms_std": 0.5,
        "output_tok_s": 655.4,
        "kv_cache_tokens": 1234567,
        "engine_start_s": 63.4,
        "jit_compiles": 0,
    }
    assert sb.result_to_row(_bench_result(), **kw, jit_compiles=2)["jit_compiles"] == 2
    with pytest.raises(ValueError, match="failed"):
        sb.result_to_row(_bench_result(completed=31, failed=1), **kw)
    with pytest.raises(ValueError, match="concurrency"):
        sb.result_to_row(_bench_result(max_concurrency=32), **kw)
    with pytest.raises(ValueError, match="nan"):
        sb.result_to_row(_bench_result(p99_itl_ms=float("nan")), **kw)
    with pytest.raises(KeyError):  # run without --metric-percentiles 50,99
        sb.result_to_row({k: v for k, v in _bench_result().items() if k != "p99_tpot_ms"}, **kw)


# --------------------------------------------------------------------------------------------
# vLLM's /metrics


def test_metric_names_are_vllms() -> None:
    source = (VLLM_DIR / "v1" / "metrics" / "loggers.py").read_text()
    for name in [*sm.HISTOGRAMS.values(), *sm.COUNTERS.values(), sm.STEP_TOKENS]:
        assert f'name="{name}",' in source, name
    # every one of them per engine, with these labels (summed over by the figures)
    assert 'labelnames = ["model_name", "engine"]' in source and sm.LABELS == (
        "model_name",
        "engine",
    )
    # the intervals the module docstring describes
    stats = (VLLM_DIR / "v1" / "metrics" / "stats.py").read_text()
    for text in (
        "queued_time = req_stats.scheduled_ts - req_stats.queued_ts",
        "prefill_time = req_stats.first_token_ts - req_stats.scheduled_ts",
        "decode_time = req_stats.last_token_ts - req_stats.first_token_ts",
        "inference_time = req_stats.last_token_ts - req_stats.scheduled_ts",
        "first_token_latency = self._time_since(req_stats.arrival_time)",
    ):
        assert text in stats, text


# Two scrapes of one server in the text format vLLM's /metrics answers (prometheus_client 0.26:
# counters as NAME_total with a NAME_created gauge, histograms as _bucket/_count/_sum, labels in
# name order), trimmed to a few families and buckets, two engines: after a warm-up of 2 requests
# on engine 0, and after 8 more, 4 on each engine.
SCRAPE_BEFORE = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 11152.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/models/smollm2"} 0.0
vllm:num_requests_running{engine="1",model_name="/models/smollm2"} 0.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="/models/smollm2"} 1.0
vllm:num_preemptions_total{engine="1",model_name="/models/smollm2"} 0.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="/models/smollm2"} 1.7964210339492064e+09
vllm:num_preemptions_created{engine="1",model_name="/models/smollm2"} 1.7964210339492071e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="/models/smollm2"} 16384.0
vllm:prompt_tokens_total{engine="1",model_name="/models/smollm2"} 0.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="/models/smollm2"} 16384.0
vllm:prefix_cache_queries_total{engine="1",model_name="/models/smollm2"} 0.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="/models/smollm2"} 0.0
vllm:prefix_cache_hits_total{engine="1",model_name="/models/smollm2"} 0.0
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="/models/smollm2"} 2.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="/models/smollm2"} 2.0
vllm:request_queue_time_seconds_count{engine="0",model_name="/models/smollm2"} 2.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="/models/smollm2"} 0.5
vllm:request_queue_time_seconds_bucket{engine="1",le="0.3",model_name="/models/smollm2"} 0.0
vllm:request_queue_time_seconds_bucket{engine="1",le="+Inf",model_name="/models/smollm2"} 0.0
vllm:request_queue_time_seconds_count{engine="1",model_name="/models/smollm2"} 0.0
vllm:request_queue_time_seconds_sum{engine="1",model_name="/models/smollm2"} 0.0
# HELP vllm:request_queue_time_seconds_created Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds_created gauge
vllm:request_queue_time_seconds_created{engine="0",model_name="/models/smollm2"} 1.79642103e+09
# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase for request.
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="/models/smollm2"} 2.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="/models/smollm2"} 2.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="/models/smollm2"} 0.25
vllm:request_prefill_time_seconds_bucket{engine="1",le="+Inf",model_name="/models/smollm2"} 0.0
vllm:request_prefill_time_seconds_count{engine="1",model_name="/models/smollm2"} 0.0
vllm:request_prefill_time_seconds_sum{engine="1",model_name="/models/smollm2"} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="/models/smollm2"} 2.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="/models/smollm2"} 2.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="/models/smollm2"} 0.875
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="/models/smollm2"} 0.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="/models/smollm2"} 0.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="/models/smollm2"} 0.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="/models/smollm2"} 2.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="/models/smollm2"} 2.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="/models/smollm2"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="+Inf",model_name="/models/smollm2"} 0.0
vllm:e2e_request_latency_seconds_count{engine="1",model_name="/models/smollm2"} 0.0
vllm:e2e_request_latency_seconds_sum{engine="1",model_name="/models/smollm2"} 0.0
# HELP vllm:request_decode_time_seconds Histogram of time spent in DECODE phase for request.
# TYPE vllm:request_decode_time_seconds histogram
vllm:request_decode_time_seconds_bucket{engine="0",le="+Inf",model_name="/models/smollm2"} 2.0
vllm:request_decode_time_seconds_count{engine="0",model_name="/models/smollm2"} 2.0
vllm:request_decode_time_seconds_sum{engine="0",model_name="/models/smollm2"} 1.0
# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 2.0
"""


def _after(text: str) -> str:
    """SCRAPE_BEFORE with the 8 timed requests added (engine 0: 4 more, engine 1: its first 4)."""
    changes = {
        # name{engine}: (before, after)
        'vllm:num_preemptions_total{engine="0"': ("1.0", "3.0"),
        'vllm:num_preemptions_total{engine="1"': ("0.0", "1.0"),
        'vllm:prompt_tokens_total{engine="0"': ("16384.0", "48128.0"),
        'vllm:prompt_tokens_total{engine="1"': ("0.0", "31744.0"),
        'vllm:prefix_cache_queries_total{engine="0"': ("16384.0", "48128.0"),
        'vllm:prefix_cache_queries_total{engine="1"': ("0.0", "31744.0"),
        'vllm:prefix_cache_hits_total{engine="0"': ("0.0", "1024.0"),
        'vllm:prefix_cache_hits_total{engine="1"': ("0.0", "512.0"),
        'vllm:request_queue_time_seconds_bucket{engine="0",le="0.3"': ("2.0", "2.0"),
        'vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf"': ("2.0", "6.0"),
        'vllm:request_queue_time_seconds_count{engine="0"': ("2.0", "6.0"),
        'vllm:request_queue_time_seconds_sum{engine="0"': ("0.5", "3.5"),
        'vllm:request_queue_time_seconds_bucket{engine="1",le="+Inf"': ("0.0", "4.0"),
        'vllm:request_queue_time_seconds_count{engine="1"': ("0.0", "4.0"),
        'vllm:request_queue_time_seconds_sum{engine="1"': ("0.0", "2.0"),
        'vllm:request_prefill_time_seconds_count{engine="0"': ("2.0", "6.0"),
        'vllm:request_prefill_time_seconds_sum{engine="0"': ("0.25", "2.25"),
        'vllm:request_prefill_time_seconds_count{engine="1"': ("0.0", "4.0"),
        'vllm:request_prefill_time_seconds_sum{engine="1"': ("0.0", "1.75"),
        'vllm:time_to_first_token_seconds_count{engine="0"': ("2.0", "6.0"),
        'vllm:time_to_first_token_seconds_sum{engine="0"': ("0.875", "6.875"),
        'vllm:time_to_first_token_seconds_count{engine="1"': ("0.0", "4.0"),
        'vllm:time_to_first_token_seconds_sum{engine="1"': ("0.0", "3.5"),
        'vllm:e2e_request_latency_seconds_count{engine="0"': ("2.0", "6.0"),
        'vllm:e2e_request_latency_seconds_sum{engine="0"': ("2.0", "13.0"),
        'vllm:e2e_request_latency_seconds_count{engine="1"': ("0.0", "4.0"),
        'vllm:e2e_request_latency_seconds_sum{engine="1"': ("0.0", "6.5"),
        'vllm:request_decode_time_seconds_count{engine="0"': ("2.0", "2.0"),
        'http_requests_total{handler="/v1/completions"': ("2.0", "10.0"),
    }
    lines = text.splitlines()
    for head, (was, now) in changes.items():
        (i,) = [k for k, line in enumerate(lines) if line.startswith(head)]
        assert lines[i].endswith(f" {was}"), lines[i]
        lines[i] = lines[i][: -len(was)] + now
    return "\n".join(lines) + "\n"


def test_figures_from_two_scrapes() -> None:
    before, after = sm.parse(SCRAPE_BEFORE), sm.parse(_after(SCRAPE_BEFORE))
    # summed over engines; buckets and _created stamps left out
    assert before["vllm:request_queue_time_seconds_count"] == 2.0
    assert after["vllm:request_queue_time_seconds_sum"] == 5.5
    assert after["vllm:num_preemptions_total"] == 4.0
    assert not [k for k in after if k.endswith(("_bucket", "_created"))]
    figures = sm.point_figures(before, after)
    assert figures == {
        "requests": 8,
        "queue_ms_mean": 625.0,  # (3.0 + 2.0) s / 8
        "prefill_ms_mean": 468.75,  # (2.0 + 1.75) s / 8
        "ttft_ms_mean_server": 1187.5,  # (6.0 + 3.5) s / 8
        "e2e_ms_mean_server": 2187.5,  # (11.0 + 6.5) s / 8
        "ttft_frontend_ms_mean": 93.75,  # 1187.5 - 625 - 468.75
        "prompt_tokens": 63488,  # 8 x 7936
        "preemptions": 3,
        "prefix_cache_queries": 63488,
        "prefix_cache_hits": 1536,
        "prefix_cache_hit_rate": 0.0242,
    }  # decode: its count did not move in this trimmed pair; the rest: not in these scrapes
    # a scrape without vLLM's metrics (another server on the port) gives no figures
    assert sm.point_figures(sm.parse("# TYPE up gauge\nup 1.0\n"), sm.parse("up 1.0\n")) == {}
    with pytest.raises(ValueError):
        sm.parse("<html>not the text format</html>\n")


# vLLM's own Prometheus logger (vllm/v1/metrics/loggers.py) fed what a server's output handler
# feeds it: a warm-up of 2 requests on engine 0, a scrape, then 4 requests on each of 2 engines
# (one output step each) and a second scrape, as its registry renders them for /metrics
CAPTURE = r"""
import json
from types import SimpleNamespace as NS
from prometheus_client import generate_latest
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.prometheus import get_prometheus_registry
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

model = NS(served_model_name="/models/smollm2", max_model_len=8192, is_diffusion=False)
config = NS(
    observability_config=NS(show_hidden_metrics=False, kv_cache_metrics=False),
    model_config=model, speculative_config=None, kv_transfer_config=None, lora_config=None,
)
logger = PrometheusStatLogger(config, engine_indexes=[0, 1])

def step(engine, n, prompt, queued, prefill, decode, frontend, preempted, hits):
    sched = SchedulerStats()
    sched.prefix_cache_stats.queries, sched.prefix_cache_stats.hits = n * prompt, hits
    it = IterationStats()
    it.num_preempted_reqs = preempted
    it.prompt_token_stats.computed = it.prompt_token_stats.total = n * prompt
    it.num_generation_tokens = n * 256
    ttft = queued + prefill + frontend
    for _ in range(n):
        it.time_to_first_tokens_iter.append(ttft)
        it.inter_token_latencies_iter += [decode / 255] * 255
        it.finished_requests.append(FinishedRequestStats(
            FinishReason.LENGTH, e2e_latency=ttft + decode, num_prompt_tokens=prompt,
            num_generation_tokens=256, queued_time=queued, prefill_time=prefill,
            inference_time=prefill + decode, decode_time=decode,
            mean_time_per_output_token=decode / 255,
        ))
    logger.record(sched, it, engine_idx=engine)

step(0, 2, 8192, 0.0, 0.0625, 0.25, 0.0078125, 0, 0)
before = generate_latest(get_prometheus_registry()).decode()
step(0, 4, 7936, 0.5, 0.25, 1.0, 0.0625, 2, 1024)
step(1, 4, 7936, 0.25, 0.125, 1.5, 0.0625, 1, 512)
after = generate_latest(get_prometheus_registry()).decode()
print("CAPTURED" + json.dumps({"before": before, "after": after}))
"""


def test_figures_from_vllms_own_logger() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CAPTURE],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"},
    )
    assert "CAPTURED" in out.stdout, out.stderr[-3000:]
    scrapes = json.loads(out.stdout.split("CAPTURED", 1)[1])
    assert (
        'vllm:request_queue_time_seconds_sum{engine="1",model_name="/models/smollm2"}'
        in (scrapes["after"])
    )
    figures = sm.point_figures(sm.parse(scrapes["before"]), sm.parse(scrapes["after"]))
    tpot = round(10 / 255 / 8 * 1000, 3)  # (4 x 1.0 + 4 x 1.5) s over 255 gaps each, 8 requests
    assert figures == {
        "requests": 8,  # not the warm-up's 2
        "queue_ms_mean": 375.0,  # (4 x 0.5 + 4 x 0.25) s / 8
        "prefill_ms_mean": 187.5,
        "decode_ms_mean": 1250.0,
        "inference_ms_mean": 1437.5,
        "ttft_ms_mean_server": 625.0,
        "e2e_ms_mean_server": 1875.0,
        "tpot_ms_mean_server": tpot,
        "itl_ms_mean_server": tpot,  # every gap of a request the same here
        "ttft_frontend_ms_mean": 62.5,
        "prompt_tokens": 63488,
        "generation_tokens": 2048,
        "preemptions": 3,
        "prefix_cache_queries": 63488,
        "prefix_cache_hits": 1536,
        "prefix_cache_hit_rate": 0.0242,
        "output_steps": 2,
        "output_step_tokens_mean": 32768.0,  # 4 x (7936 + 256) per step
    }


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failed_scrape_keeps_the_point(capsys: pytest.CaptureFixture) -> None:
    base_url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(OSError):
        sm.scrape(base_url, timeout_s=2)
    ran = []
    result, figures, error = sb.between_scrapes(base_url, "p", 4, lambda: ran.append(1) or "done")
    assert (result, figures, ran) == ("done", None, [1])
    assert error.startswith("/metrics before the point: URLError(")
    assert capsys.readouterr().out.count("WARNING: no server metrics") == 1


# --------------------------------------------------------------------------------------------
# the results file


def _row(model: str, dtype: str, n: int, c: int, tpot: float = 1.0) -> dict:
    return {k: 0 for k in sb.ROW_KEYS} | {
        "model": model,
        "dtype": dtype,
        "input_len": n,
        "output_len": 256,
        "concurrency": c,
        "tpot_ms_p50": tpot,
    }


def test_merge_replaces_same_point_keeps_others_refuses_other_gpu(tmp_path: Path) -> None:
    prev = {
        "gpu": "NVIDIA H200",
        "command": "python -m benchmarks.serve_bench --models smollm2",
        "rows": [_row("smollm2", "int8", 7936, 8, 5.0), _row("smollm2", "int8", 7936, 32, 6.0)],
    }
    new = [_row("smollm2", "int8", 7936, 8, 4.0), _row("gemma3", "int8", 8192, 8, 7.0)]
    doc = sb.merged_doc(
        prev, "NVIDIA H200", "python -m benchmarks.serve_bench --models gemma3", new
    )
    got = {(r["model"], r["concurrency"]): r["tpot_ms_p50"] for r in doc["rows"]}
    assert got == {("smollm2", 8): 4.0, ("smollm2", 32): 6.0, ("gemma3", 8): 7.0}
    assert doc["command"].count("serve_bench") == 2
    assert sb.merged_doc(None, "g", "cmd", new) == {"gpu": "g", "command": "cmd", "rows": new}
    # starts add up over the calls of one file
    start = {"dtype": "int8", "engine_start_s": 90.0}
    first = sb.merged_doc(None, "g", "cmd", new, [start])
    assert first["engine_starts"] == [start]
    assert sb.merged_doc(first, "g", "cmd2", new, [start])["engine_starts"] == [start, start]

    path = tmp_path / "serving.json"
    assert sb.load_previous(path, "NVIDIA H200") is None
    path.write_text(json.dumps(prev))
    assert sb.load_previous(path, "NVIDIA H200")["rows"] == prev["rows"]
    with pytest.raises(SystemExit, match="NVIDIA H200"):
        sb.load_previous(path, "NVIDIA A100-SXM4-80GB")


# --------------------------------------------------------------------------------------------
# command lines


def _server(dtype: str, shim_everywhere: bool = True, port: int = 0) -> sb.Server:
    return sb.Server(
        ["vllm"],
        "/models/smollm2",
        dtype,
        port=port,
        env=sb.vllm_serve_dtype_env(dtype, shim_everywhere),
        max_model_len=8192,
        gpu_memory_utilization=0.9,
        extra_args=["--max-num-seqs", "256"],
        log_path=Path("/tmp/unused.log"),
        startup_timeout_s=60,
    )


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_server_command_per_dtype() -> None:
    for dtype, kv, backend, fa in (
        ("auto_fa2", "auto", None, {"backend": "FLASH_ATTN", "flash_attn_version": 2}),
        ("int8_per_token_head", "int8_per_token_head", "TRITON_ATTN", None),
        ("int8", "int8", None, None),
        ("int4", "int4", None, None),
    ):
        s = _server(dtype)
        assert s.argv[:3] == ["vllm", "serve", "/models/smollm2"], s.argv
        assert _flag(s.argv, "--host") == "127.0.0.1" and _flag(s.argv, "--port") == str(s.port)
        assert s.base_url == f"http://127.0.0.1:{s.port}"
        assert _flag(s.argv, "--kv-cache-dtype") == kv
        assert _flag(s.argv, "--attention-backend") == backend
        ac = _flag(s.argv, "--attention-config")
        assert (json.loads(ac) if ac else None) == fa
        assert _flag(s.argv, "--max-model-len") == "8192"
        assert _flag(s.argv, "--gpu-memory-utilization") == "0.9"
        assert s.argv[-2:] == ["--max-num-seqs", "256"]
        assert "--enforce-eager" not in s.argv  # vLLM's default CUDA graphs and compile
        assert s.env["INT8KV_SHIM"] == "1"
    # as the offline benchmarks run upstream rows: without the shim
    assert "INT8KV_SHIM" not in _server("auto_fa2", shim_everywhere=False).env
    assert _server("int8", shim_everywhere=False).env["INT8KV_SHIM"] == "1"
    s = _server("int8", port=18123)
    assert (s.port, _flag(s.argv, "--port"), s.base_url) == (
        18123,
        "18123",
        "http://127.0.0.1:18123",
    )


def test_attention_config_is_what_vllm_parses() -> None:
    """``--attention-config`` of auto_fa2 through the parser vLLM's CLI uses for that flag
    (vllm/engine/arg_utils.py: TypeAdapter(cls).validate_json), in a fresh interpreter."""
    value = _flag(_server("auto_fa2").argv, "--attention-config")
    code = (
        "import sys; from pydantic import TypeAdapter; "
        "from vllm.config.attention import AttentionConfig; "
        "c = TypeAdapter(AttentionConfig).validate_json(sys.argv[1]); "
        "print('PARSED', c.backend.name, c.flash_attn_version)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, value], capture_output=True, text=True, timeout=300
    )
    assert "PARSED FLASH_ATTN 2" in out.stdout, out.stderr[-3000:]


def test_bench_command() -> None:
    argv = sb.bench_argv(
        ["vllm"], "http://127.0.0.1:9", "/m", 7936, 256, 8, 32, 11, Path("/r"), "p.json", ["--x"]
    )
    assert argv[:3] == ["vllm", "bench", "serve"]
    want = {
        "--backend": "vllm",
        "--base-url": "http://127.0.0.1:9",
        "--model": "/m",
        "--dataset-name": "random",
        "--random-input-len": "7936",
        "--random-output-len": "256",
        "--max-concurrency": "8",
        "--num-prompts": "32",
        "--seed": "11",
        "--metric-percentiles": "50,99",
        "--result-dir": "/r",
        "--result-filename": "p.json",
    }
    assert {k: _flag(argv, k) for k in want} == want
    assert {"--ignore-eos", "--save-result"} <= set(argv) and argv[-1] == "--x"


# --------------------------------------------------------------------------------------------
# the random Llama


def _tokenizer_dir(path: Path, vocab: int = 300) -> Path:
    """A word-level tokenizer folder (t0 ... tN) with a config.json, as SmolLM2's folder has."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t1", eos_token="t2").save_pretrained(
        str(path)
    )
    cfg = {"vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2, "model_type": "llama"}
    (path / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 4096}))
    return path


def test_llama_shape_config() -> None:
    cfg = sb.llama_shape_config(49152, 2, 1, 2)
    shape = {k: cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")}
    assert shape == {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    assert (cfg["hidden_size"], cfg["intermediate_size"]) == (4096, 14336)
    assert (cfg["num_hidden_layers"], cfg["max_position_embeddings"]) == (2, 40960)
    assert cfg["vocab_size"] == 49152 and not cfg["tie_word_embeddings"]
    w = sb.llama_weight_shapes(cfg)
    assert w["model.layers.1.self_attn.q_proj.weight"] == (4096, 4096)
    assert w["model.layers.1.self_attn.k_proj.weight"] == (1024, 4096)
    assert w["model.layers.0.mlp.down_proj.weight"] == (4096, 14336)
    assert "model.layers.2.mlp.up_proj.weight" not in w
    params = sum(int.__mul__(*s) if len(s) == 2 else s[0] for s in w.values())
    assert 0.83e9 < params < 0.85e9  # 2 x 218M per layer + 2 x 201M embeddings: 1.7 GB BF16


def test_random_llama_folder_loads_in_transformers(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    tok = _tokenizer_dir(tmp_path / "smol")
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4)
    small |= dict(num_key_value_heads=2, head_dim=16)
    out = sb.make_random_llama(tmp_path / "llama", tok, 2, seed=3, **small)
    cfg = AutoConfig.from_pretrained(str(out))
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.dtype == torch.bfloat16
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.num_hidden_layers) == (300, 40960, 2)
    assert AutoTokenizer.from_pretrained(str(out))("t5 t6")["input_ids"][-2:] == [5, 6]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        k = f.get_tensor("model.layers.1.self_attn.k_proj.weight")
        norm = f.get_tensor("model.norm.weight")
    assert names == set(sb.llama_weight_shapes(sb.llama_shape_config(300, 2, 1, 2, **small)))
    assert tuple(k.shape) == (32, 64) and k.dtype == torch.bfloat16
    assert abs(float(k.float().std()) - 0.02) < 0.004 and bool((norm == 1).all())
    model, info = LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # made once: a second call keeps the folder, another seed remakes it
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    sb.make_random_llama(tmp_path / "llama", tok, 2, seed=3, **small)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    sb.make_random_llama(tmp_path / "llama", tok, 2, seed=4, **small)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not torch.equal(f.get_tensor("model.layers.1.self_attn.k_proj.weight"), k)
    assert not (tmp_path / "llama.partial").exists()


# --------------------------------------------------------------------------------------------
# whole runs against the stand-in vllm


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    model = _tokenizer_dir(tmp_path / "model")
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.delenv("INT8KV_SHIM", raising=False)
    return {"model": model, "record": record, "out": tmp_path / "serving.json", "tmp": tmp_path}


def _argv(fake: dict, *extra: str) -> list[str]:
    return [
        "--vllm",
        FAKE_VLLM,
        "--models",
        f"fake={fake['model']}",
        "--output-len",
        "16",
        "--prompts-per-concurrency",
        "1",
        "--min-prompts",
        "2",
        "--out",
        str(fake["out"]),
        "--logdir",
        str(fake["tmp"] / "logs"),
        "--workdir",
        str(fake["tmp"] / "work"),
        "--no-plot",
        *extra,
    ]


def _records(fake: dict) -> list[dict]:
    if not fake["record"].exists():
        return []
    return [json.loads(x) for x in fake["record"].read_text().splitlines()]


def _assert_all_gone(records: list[dict]) -> None:
    for r in records:
        if r["argv"][0] == "serve":
            with pytest.raises(ProcessLookupError):
                os.kill(r["pid"], 0)


def test_run_against_fake_server(fake: dict) -> None:
    rc = sb.main(
        _argv(
            fake,
            *("--dtypes", "auto_fa2,int8", "--input-lens", "1K,8K", "--concurrency", "4,1"),
        )
    )
    assert rc == 0
    doc = json.loads(fake["out"].read_text())
    assert set(doc) - {"date", "git_commit"} == {"gpu", "command", "rows", "engine_starts"}
    assert doc["command"].startswith("python -m benchmarks.serve_bench --vllm ")
    # one start per server, in start order, with the phases of its log
    assert [(s["dtype"], s["host_state"]) for s in doc["engine_starts"]] == [
        ("auto_fa2", "this call's first server"),
        ("int8", "this call's server 2, after the ones above"),
    ]
    assert doc["engine_starts"][0]["init_engine_s"] == 12.34
    rows = doc["rows"]
    assert [(r["dtype"], r["input_len"], r["concurrency"], r["num_prompts"]) for r in rows] == [
        (d, n, c, max(c, 2)) for d in ("auto_fa2", "int8") for n in (1024, 4080) for c in (1, 4)
    ]  # 8K cut to the fake model's 4096 positions - 16 output tokens
    for r in rows:
        assert list(r) == [*sb.ROW_KEYS, "server_metrics", "process_cpu"]
        # the fake server's tree: itself and its idle child titled as vLLM's engine core
        cpu = r["process_cpu"]
        assert list(cpu) == ["api_server", "engine_core", "bench_client"], cpu
        assert all(
            list(f) == ["cpu_s", "busy", "busy_run", "main_thread_cpu_s", "main_thread_busy_run"]
            for role, f in cpu.items() if role != "bench_client"
        ), cpu  # fmt: skip
        # the fake client, a Python process of its own, spends some CPU (vLLM's: more)
        assert list(cpu["bench_client"]) == ["cpu_s", "busy", "busy_run"]
        assert cpu["bench_client"]["cpu_s"] > 0, cpu
        assert all(f["busy"] >= 0 and f["busy_run"] >= 0 for f in cpu.values()), cpu
        # busy_run: over the fake bench's own duration, 2 s
        assert all(abs(f["busy_run"] - f["cpu_s"] / 2) < 0.004 for f in cpu.values()), cpu
        assert cpu["engine_core"]["cpu_s"] < 0.1  # it sleeps
        assert r["kv_cache_tokens"] == 1234567 and r["engine_start_s"] > 0
        assert r["model"] == "fake" and r["output_len"] == 16
        assert r["tpot_ms_p50"] == round(2 * (1 + r["concurrency"] / 100), 3)
        # the fake server's /metrics (fake_vllm.METRICS) over this point's requests alone: not
        # the warm-up's 2 at the same length, nor the points before
        n, prompts = r["input_len"], r["num_prompts"]
        prefill = n / 16384 * 1000
        assert r["server_metrics"] == {
            "requests": prompts,
            "queue_ms_mean": 125.0,
            "prefill_ms_mean": round(prefill, 3),
            "decode_ms_mean": 15.625,
            "inference_ms_mean": round(prefill + 15.625, 3),
            "ttft_ms_mean_server": round(125 + prefill + 15.625, 3),
            "e2e_ms_mean_server": round(125 + prefill + 2 * 15.625, 3),
            "tpot_ms_mean_server": 0.977,
            "itl_ms_mean_server": 0.977,
            "ttft_frontend_ms_mean": 15.625,
            "prompt_tokens": prompts * n,
            "generation_tokens": prompts * 16,
            "preemptions": prompts,
            "prefix_cache_queries": prompts * n,
            "prefix_cache_hits": prompts * (n // 4),
            "prefix_cache_hit_rate": 0.25,
            "output_steps": prompts,
            "output_step_tokens_mean": float(n + 16),
        }, r

    recs = _records(fake)
    serves = [r for r in recs if r["argv"][0] == "serve"]
    benches = [r["argv"] for r in recs if r["argv"][:2] == ["bench", "serve"]]
    assert len(serves) == 2 and len(benches) == 8
    assert all(s["shim"] == "1" for s in serves)  # INT8KV_SHIM=1 for every server
    assert all(r["shim"] is None for r in recs if r["argv"][0] == "bench")  # a plain client
    fa2, int8 = serves[0]["argv"], serves[1]["argv"]
    assert json.loads(_flag(fa2, "--attention-config")) == {
        "backend": "FLASH_ATTN",
        "flash_attn_version": 2,
    }
    assert _flag(int8, "--kv-cache-dtype") == "int8" and "--attention-config" not in int8
    assert _flag(fa2, "--max-model-len") == "4096" and _flag(fa2, "--host") == "127.0.0.1"
    port = _flag(fa2, "--port")
    assert {_flag(b, "--base-url") for b in benches[:4]} == {f"http://127.0.0.1:{port}"}
    seeds = [_flag(b, "--seed") for b in benches]
    assert len(set(seeds[:4])) == 4 and seeds[:4] == seeds[4:]  # per point; same per dtype
    _assert_all_gone(recs)

    runs = json.loads((fake["tmp"] / "logs" / "serve_bench_runs.json").read_text())
    first = runs["servers"][0]
    assert first["startup_phases"] == {"model_loading_s": 1.5, "init_engine_s": 12.34}
    assert set(first["warmup_s"]) == {"1024", "4080"}
    assert all(Path(p["result"]).exists() for s in runs["servers"] for p in s["points"])
    assert not str(first["points"][0]["result"]).startswith(str(sb.common.REPO))


def test_point_without_metrics_keeps_its_row(
    fake: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("FAKE_NO_METRICS", "1")  # the fake server's /metrics answers 404
    argv = _argv(fake, "--dtypes", "int8", "--input-lens", "1K", "--concurrency", "1,2")
    assert sb.main([*argv, "--warmup-prompts", "0"]) == 0
    rows = json.loads(fake["out"].read_text())["rows"]
    keys = [*sb.ROW_KEYS, "process_cpu"]  # no server_metrics
    assert [(r["concurrency"], list(r)) for r in rows] == [(1, keys), (2, keys)]
    runs = json.loads((fake["tmp"] / "logs" / "serve_bench_runs.json").read_text())
    errors = [p["server_metrics_error"] for p in runs["servers"][0]["points"]]
    assert errors == ["/metrics before the point: <HTTPError 404: 'Not Found'>"] * 2
    assert capsys.readouterr().out.count("WARNING: no server metrics") == 2  # one per point


def test_time_budget_stops_new_points_and_keeps_rows(
    fake: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_BENCH_S", "1.5")
    t0 = time.monotonic()
    rc = sb.main(
        _argv(
            fake,
            *("--dtypes", "int8,int4", "--input-lens", "1K", "--concurrency", "1,2,4,8,16,32"),
            *("--time-budget-s", "6", "--warmup-prompts", "0"),
        )
    )
    assert rc == 1
    # the budget, then a server stop; all 12 points and two server starts take over 22 s
    assert time.monotonic() - t0 < 15
    rows = json.loads(fake["out"].read_text())["rows"]
    assert 1 <= len(rows) < 12
    assert {r["dtype"] for r in rows} == {"int8"}  # no second server after the budget
    recs = _records(fake)
    assert len([r for r in recs if r["argv"][0] == "serve"]) == 1
    _assert_all_gone(recs)


def test_no_round_starts_that_the_budget_would_cut_short(
    fake: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A round cut short pairs nothing: a round starts only if the budget's rest covers the time
    the round before it took (with ROUND_MARGIN to spare), so every server ends with the same
    rounds."""
    monkeypatch.setenv("FAKE_BENCH_S", "2")
    rc = sb.main(
        _argv(
            fake,
            *("--dtypes", "auto_fa2,int8", "--input-lens", "1K", "--concurrency", "1"),
            *("--interleave", "--rounds", "4", "--time-budget-s", "14", "--warmup-prompts", "0"),
        )
    )
    assert rc == 1  # the budget was hit
    assert "of 4 not started: the one before took" in capsys.readouterr().out
    rows = json.loads(fake["out"].read_text())["rows"]
    rounds = [[x["round"] for x in r["rounds"]] for r in rows]
    assert len(rows) == 2 and rounds[0] == rounds[1] and 1 <= len(rounds[0]) < 4, rounds
    _assert_all_gone(_records(fake))


def test_no_server_starts_that_the_budget_cannot_see_healthy() -> None:
    """A server killed by the budget while it starts measures nothing: none starts unless the
    budget's rest covers the longest start so far."""
    budget = sb.Budget(100.0, start=time.monotonic() - 70.0)  # about 30 s left
    assert budget.fits(20.0) and not budget.hit
    assert not budget.fits(40.0) and budget.hit and budget.exhausted()
    assert sb.Budget(0.0).fits(1e9)  # no budget
    run = sb.Run(args=None, gpu="x", command="x", previous=None)  # type: ignore[arg-type]
    assert run.longest_start_s() == 0.0
    run.servers += [{"engine_start_s": 136.1}, {"error": "not healthy"}, {"engine_start_s": 78.0}]
    assert run.longest_start_s() == 136.1


def test_append_merges_and_refuses_another_gpu(fake: dict) -> None:
    base = ("--input-lens", "1K", "--concurrency", "1", "--warmup-prompts", "0")
    assert sb.main(_argv(fake, "--dtypes", "int8", *base)) == 0
    assert sb.main(_argv(fake, "--dtypes", "int4", "--append", *base)) == 0
    doc = json.loads(fake["out"].read_text())
    assert sorted(r["dtype"] for r in doc["rows"]) == ["int4", "int8"]
    assert sb.main(_argv(fake, "--dtypes", "int4", "--append", *base)) == 0  # replaces its row
    assert len(json.loads(fake["out"].read_text())["rows"]) == 2
    assert sb.main(_argv(fake, "--dtypes", "int8", *base)) == 0  # no --append: a fresh file
    assert len(json.loads(fake["out"].read_text())["rows"]) == 1

    doc["gpu"] = "NVIDIA H200"  # this machine has none: gpu_name() says "unknown"
    fake["out"].write_text(json.dumps(doc))
    n_before = len(_records(fake))
    with pytest.raises(SystemExit, match="NVIDIA H200"):
        sb.main(_argv(fake, "--dtypes", "int8", "--append", *base))
    assert len(_records(fake)) == n_before  # refused before starting anything


def test_interleaved_rounds_run_every_point_on_every_server_in_turn(fake: dict) -> None:
    """--interleave: both servers up before the first point, each with half the memory; each
    point on both in turn, the second round in the other order and with new prompts; a row per
    point with both rounds and their median."""
    rc = sb.main(
        _argv(
            fake,
            *("--dtypes", "auto_fa2,int8", "--input-lens", "1K", "--concurrency", "4,1"),
            *("--rounds", "2", "--interleave", "--gpu-memory-utilization", "0.8"),
        )
    )
    assert rc == 0
    recs = _records(fake)
    kinds = [r["argv"][0] for r in recs]
    assert kinds[:2] == ["serve", "serve"] and "serve" not in kinds[2:]
    serves = [r["argv"] for r in recs if r["argv"][0] == "serve"]
    assert [_flag(a, "--kv-cache-dtype") for a in serves] == ["auto", "int8"]
    assert {_flag(a, "--gpu-memory-utilization") for a in serves} == {"0.4"}
    ports = [_flag(a, "--port") for a in serves]
    dtype_at = {
        f"http://127.0.0.1:{port}": d for port, d in zip(ports, ("fa2", "int8"), strict=True)
    }
    benches = [r["argv"] for r in recs if r["argv"][:2] == ["bench", "serve"]]
    order = [(dtype_at[_flag(b, "--base-url")], _flag(b, "--max-concurrency")) for b in benches]
    assert order == [
        ("fa2", "1"), ("int8", "1"), ("fa2", "4"), ("int8", "4"),  # round 0
        ("int8", "1"), ("fa2", "1"), ("int8", "4"), ("fa2", "4"),  # round 1: the other order
    ]  # fmt: skip
    seeds = [_flag(b, "--seed") for b in benches]
    assert seeds[0] == seeds[1] and seeds[4] == seeds[5] and seeds[0] != seeds[4]
    assert len({_flag(b, "--result-filename") for b in benches}) == 8
    _assert_all_gone(recs)

    rows = json.loads(fake["out"].read_text())["rows"]
    assert sorted((r["dtype"], r["concurrency"]) for r in rows) == [
        ("auto_fa2", 1), ("auto_fa2", 4), ("int8", 1), ("int8", 4),
    ]  # fmt: skip
    for r in rows:
        assert r["servers_at_once"] == 2 and [x["round"] for x in r["rounds"]] == [0, 1]
        first = 0 if r["dtype"] == "auto_fa2" else 1
        assert [x["position"] for x in r["rounds"]] == [first, 1 - first]
        assert r["tpot_ms_p50"] == round(2 * (1 + r["concurrency"] / 100), 3)
        assert all(x["server_metrics"]["requests"] == r["num_prompts"] for x in r["rounds"])
        assert all(
            set(x["process_cpu"]) == {"api_server", "engine_core", "bench_client"}
            for x in r["rounds"]
        )
        assert "server_metrics" not in r and "process_cpu" not in r


def test_start_together_starts_every_server_at_once_with_the_cache_size_given(
    fake: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """--start-together: the servers' starts overlap (each takes FAKE_START_S), every server gets
    the same --kv-cache-memory-bytes, and the points run as with servers started in turn."""
    monkeypatch.setenv("FAKE_START_S", "3")
    rc = sb.main(
        _argv(
            fake,
            *("--dtypes", "auto_fa2,int8,int4", "--input-lens", "1K", "--concurrency", "1"),
            *("--interleave", "--start-together", "--kv-cache-memory-gib", "1.5"),
            *("--warmup-prompts", "0"),
        )
    )
    assert rc == 0
    # every server spawned before the first one served, each its own start time
    said = [
        line.split(": ", 2)[2]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("serve_bench: fake_") and ("starting" in line or "healthy" in line)
    ]
    assert [w.split()[0] for w in said] == ["starting"] * 3 + ["healthy"] * 3, said
    serves = [r["argv"] for r in _records(fake) if r["argv"][0] == "serve"]
    assert [_flag(a, "--kv-cache-dtype") for a in serves] and len(serves) == 3
    assert {_flag(a, "--kv-cache-memory-bytes") for a in serves} == {str(3 * 2**29)}
    rows = json.loads(fake["out"].read_text())["rows"]
    assert sorted(r["dtype"] for r in rows) == ["auto_fa2", "int4", "int8"]
    runs = json.loads((fake["tmp"] / "logs" / "serve_bench_runs.json").read_text())
    assert all(s["engine_start_s"] >= 3 for s in runs["servers"])
    _assert_all_gone(_records(fake))
    # only with --interleave and the cache's size given
    for extra in (["--interleave"], ["--kv-cache-memory-gib", "2"]):
        with pytest.raises(SystemExit):
            sb.parse_args(["--dtypes", "auto_fa2,int8", "--start-together", *extra])


@pytest.mark.parametrize("interleave", [False, True])
def test_profile_first_runs_the_profiled_point_before_the_timed_ones(
    fake: dict, interleave: bool
) -> None:
    rc = sb.main(
        _argv(
            fake,
            *("--dtypes", "auto_fa2,int8", "--input-lens", "1K", "--concurrency", "1,4"),
            *("--profile-concurrency", "4", "--profile-first", "--warmup-prompts", "0"),
            *(["--interleave"] if interleave else []),
        )
    )
    assert rc == 0
    benches = [r["argv"] for r in _records(fake) if r["argv"][:2] == ["bench", "serve"]]
    profiled = ["--profile" in b for b in benches]
    if interleave:  # both servers' profiled points, then the timed points on each in turn
        assert profiled == [True, True, False, False, False, False]
    else:  # each server: its profiled point, then its timed points
        assert profiled == [True, False, False, True, False, False]
    assert len(json.loads(fake["out"].read_text())["rows"]) == 4
    assert len(json.loads((fake["tmp"] / "serving_profile.json").read_text())["rows"]) == 2


def test_profile_dtypes_profiles_only_those_servers(fake: dict) -> None:
    rc = sb.main(
        _argv(
            fake,
            *("--dtypes", "auto_fa2,int8", "--input-lens", "1K", "--concurrency", "4"),
            *("--profile-concurrency", "4", "--profile-dtypes", "int8", "--interleave"),
            *("--profile-first", "--warmup-prompts", "0"),
        )
    )
    assert rc == 0
    recs = _records(fake)
    serves = [r["argv"] for r in recs if r["argv"][0] == "serve"]
    assert all("--profiler-config" in " ".join(a) for a in serves), serves
    dtype_at = {
        f"http://127.0.0.1:{_flag(a, '--port')}": _flag(a, "--kv-cache-dtype") for a in serves
    }
    benches = [r["argv"] for r in recs if r["argv"][:2] == ["bench", "serve"]]
    profiled = [dtype_at[_flag(b, "--base-url")] for b in benches if "--profile" in b]
    assert profiled == ["int8"]
    rows = json.loads((fake["tmp"] / "serving_profile.json").read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["int8"]
    with pytest.raises(SystemExit):
        sb.parse_args(["--dtypes", "auto_fa2,int8", "--profile-dtypes", "int4"])


def test_rounds_row_takes_the_median_of_each_figure() -> None:
    one = _row("m", "int8", 1024, 4, tpot=3.0) | {"jit_compiles": 0}
    assert sb.rounds_row([one]) == one  # one round, no rounds: the row as it is
    rounds = [
        one | {"tpot_ms_p50": t, "output_tok_s": 10.0 * t, "round": i, "position": i % 2,
               "jit_compiles": i, "step_timing": {"engine_steps": i},
               "process_cpu": {"api_server": {"cpu_s": i, "busy": 0.5}}}
        for i, t in enumerate((3.0, 9.0, 4.0))
    ]  # fmt: skip
    row = sb.rounds_row(rounds)
    assert row["tpot_ms_p50"] == 4.0 and row["output_tok_s"] == 40.0
    assert row["jit_compiles"] == 3 and "step_timing" not in row and "round" not in row
    assert "process_cpu" not in row
    assert [x["process_cpu"]["api_server"]["cpu_s"] for x in row["rounds"]] == [0, 1, 2]
    assert [x["tpot_ms_p50"] for x in row["rounds"]] == [3.0, 9.0, 4.0]
    assert [x["step_timing"] for x in row["rounds"]] == [{"engine_steps": i} for i in range(3)]
    assert {k: row[k] for k in sb.ROW_KEY} == {k: one[k] for k in sb.ROW_KEY}


def test_interleave_and_rounds_arguments() -> None:
    assert sb.parse_args([]).rounds == 1 and not sb.parse_args([]).interleave
    for bad in (
        ["--rounds", "0"],
        ["--interleave", "--dtypes", "int8"],
        ["--interleave", "--dtypes", "auto_fa2,int8", "--port", "8000"],
    ):
        with pytest.raises(SystemExit):
            sb.parse_args(bad)


def test_taken_port_is_refused(fake: dict) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = sb.main(_argv(fake, "--dtypes", "int8", "--input-lens", "1K", "--port", str(port)))
        assert rc == 2
        # the check inside the launcher too (a port taken between planning and starting)
        with pytest.raises(RuntimeError, match="taken"), _server("int8", port=port):
            pass
    assert not [r for r in _records(fake) if r["argv"][0] == "serve"]


def test_server_that_dies_is_reported(fake: dict) -> None:
    script = (
        "import sys; print('boom: CUDA error'); "
        "print('(EngineCore pid=9) ValueError: no room for the KV cache'); sys.exit(3)"
    )
    dying = shlex.join([sys.executable, "-c", script])
    argv = _argv(fake, "--dtypes", "int8", "--input-lens", "1K", "--startup-timeout-s", "60")
    argv[argv.index("--vllm") + 1] = dying
    assert sb.main(argv) == 1
    assert not fake["out"].exists()  # nothing measured: no results file
    runs = json.loads((fake["tmp"] / "logs" / "serve_bench_runs.json").read_text())
    assert "exited with 3" in runs["servers"][0]["error"]
    assert "boom" in runs["servers"][0]["server_log_tail"]
    assert runs["servers"][0]["engine_error"] == "ValueError: no room for the KV cache"


def test_real_vllm_bench_serve_against_fake_server(
    fake: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The installed ``vllm bench serve`` takes every flag we pass and writes the fields we read."""
    monkeypatch.setenv("FAKE_VLLM_REAL_BENCH", "1")
    argv = _argv(fake, "--dtypes", "int8", "--input-lens", "64", "--concurrency", "2")
    assert sb.main([*argv, "--warmup-prompts", "1", "--point-timeout-s", "400"]) == 0, (
        fake["tmp"] / "logs" / "bench" / "fake_int8_in64_c2.log"
    ).read_text()[-3000:]
    (row,) = json.loads(fake["out"].read_text())["rows"]
    assert (row["input_len"], row["concurrency"], row["num_prompts"]) == (64, 2, 2)
    assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"]
    assert 0 < row["tpot_ms_p50"] <= row["tpot_ms_p99"] and row["output_tok_s"] > 0
    raw = json.loads((fake["tmp"] / "logs" / "raw" / "fake_int8_in64_c2.json").read_text())
    assert raw["total_output_tokens"] == 2 * 16 and raw["max_concurrency"] == 2
    # the real client sends the point's prompts and nothing else (no test request, no warm-up
    # of its own, by default), so the server's figures cover exactly the point's requests
    figures = row["server_metrics"]
    assert (figures["requests"], figures["generation_tokens"]) == (2, 2 * 16)


def test_dry_run_prints_every_command(fake: dict, capsys: pytest.CaptureFixture) -> None:
    argv = _argv(fake, "--dtypes", "auto_fa2,int8", "--input-lens", "1K,2K")
    assert sb.main([*argv, "--concurrency", "1,8", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    serves = [ln for ln in lines if " serve /" in ln and " bench serve " not in ln]
    assert len(serves) == 2 and all(ln.startswith("INT8KV_SHIM=1 ") for ln in serves)
    assert len([ln for ln in lines if " bench serve " in ln]) == 2 * 2 * 2
    assert len([ln for ln in lines if ln.startswith("# warm-up")]) == 2 * 2
    assert not _records(fake) and not fake["out"].exists()  # nothing ran
    # on a machine without the models: their variables stand in for the folders
    assert sb.main(["--models", "smollm2,llama3-8b-shape", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert " serve '$SMOLLM2_DIR' " in out
    assert "--max-model-len 8192" in out and "--max-model-len 33024" in out  # 7936+256, 32K+256
    assert re.search(r"# make llama3-8b-shape \(2 layers\)", out)


def test_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    doc = {
        "gpu": "NVIDIA H200",
        "command": "x",
        "rows": [
            _row(m, d, n, c, tpot=c * (0.5 if d == "int8" else 1.0))
            for m in ("smollm2", "gemma3")
            for d in ("auto_fa2", "int8")
            for n in (8192,)
            for c in (1, 8, 32)
        ],
    }
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the GPU host may lack it
    sb.save_plot(doc, tmp_path / "serving.png")
    assert "no plot" in capsys.readouterr().out and not (tmp_path / "serving.png").exists()
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    png = sb.plot(doc, tmp_path / "serving.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        sb.plot({"rows": []}, tmp_path / "empty.png")


def test_profiled_point_is_summarised_and_not_a_row(fake: dict) -> None:
    rc = sb.main(
        _argv(
            fake,
            *("--dtypes", "int8", "--input-lens", "1K", "--concurrency", "1,4"),
            *("--profile-concurrency", "4", "--profile-prompts", "3"),
        )
    )
    assert rc == 0
    rows = json.loads(fake["out"].read_text())["rows"]
    assert [(r["concurrency"], r["num_prompts"]) for r in rows] == [(1, 2), (4, 4)]
    recs = _records(fake)
    server = next(r["argv"] for r in recs if r["argv"][0] == "serve")
    trace_dir = fake["tmp"] / "logs" / "profile" / "fake_int8"
    config = json.loads(_flag(server, "--profiler-config"))
    assert config["profiler"] == "torch" and config["torch_profiler_dir"] == str(trace_dir)
    assert config["torch_profiler_with_stack"] is False and config["ignore_frontend"] is True
    benches = [r["argv"] for r in recs if r["argv"][:2] == ["bench", "serve"]]
    assert ["--profile" in b for b in benches] == [False, False, True]
    profiled, timed = benches[2], benches[1]
    assert _flag(profiled, "--num-prompts") == "3" and _flag(profiled, "--max-concurrency") == "4"
    assert int(_flag(profiled, "--seed")) == int(_flag(timed, "--seed")) + 1
    runs = json.loads((fake["tmp"] / "logs" / "serve_bench_runs.json").read_text())
    (profile,) = runs["servers"][0]["profiles"]
    assert profile["rc"] == 0 and "error" not in profile
    assert not any(Path(t).exists() for t in profile["traces"])  # summarised, then removed
    (summary,) = json.loads(Path(profile["summary"]).read_text()).values()
    assert summary["kernel_us_by_category"]["ours"] == 30
    assert summary["by_step_kind"]["eager"]["gpu_us_mean_total"] == 50
    # and a row of serving_profile.json, beside serving.json
    doc = json.loads((fake["tmp"] / "serving_profile.json").read_text())
    assert doc["gpu"] and doc["command"].startswith("python -m benchmarks.serve_bench")
    (row,) = doc["rows"]
    assert (row["model"], row["dtype"], row["input_len"], row["concurrency"]) == (
        "fake",
        "int8",
        1024,
        4,
    )
    assert row["num_prompts"] == 3 and row["kernel_us_by_category"]["ours"] == 30
    assert row["server_metrics"]["requests"] == 3  # the profiled point's, not the timed ones'
    assert row["server_metrics"]["prompt_tokens"] == 3 * 1024
    assert "top_host_ops" in row and "attention_ops_opened" in row
    assert row["top_kernels"][0]["name"] == "_attn_fwd"
    _assert_all_gone(recs)


def test_step_timing_adds_each_points_engine_steps_to_its_row(fake: dict) -> None:
    """The fake server steps its engine once per output token (``fake_vllm.ENGINE``): each row's
    ``step_timing`` counts its own point's steps, not the warm-up's or the point before."""
    rc = sb.main(
        _argv(
            fake,
            *("--dtypes", "int8", "--input-lens", "1K", "--concurrency", "1,4", "--step-timing"),
        )
    )
    assert rc == 0
    rows = json.loads(fake["out"].read_text())["rows"]
    assert [(r["concurrency"], r["num_prompts"]) for r in rows] == [(1, 2), (4, 4)]
    for r in rows:
        steps = r["step_timing"]
        assert steps["engine_steps"] == 16 * r["num_prompts"]  # 16 output tokens a prompt
        assert steps["phases"]["engine_step"]["us_per_call"] >= 500  # each step sleeps 0.5 ms
        assert steps["sync_debug"] is False
    server = next(r for r in _records(fake) if r["argv"][0] == "serve")
    assert server["pid"] > 0


def test_shim_lines() -> None:
    log = "INFO a\n(EngineCore) INFO [x.py:1] int8kv-shim: first step with prefills: 1 on FA2\nb\n"
    assert sb.shim_lines(log) == ["(EngineCore) INFO [x.py:1] int8kv-shim: first step with "
                                  "prefills: 1 on FA2"]  # fmt: skip
    assert sb.shim_lines("int8kv-shim: x\n" * 50, limit=3) == ["int8kv-shim: x"] * 3


def test_engine_starts_place_each_start_after_the_first() -> None:
    def server(dtype: str, **healthy: object) -> dict:
        return {"model": "gemma3", "dtype": dtype, "max_model_len": 8448, **healthy}

    up = {
        "engine_start_s": 200.2,
        "kv_cache_tokens": 10,
        "startup_phases": {"kernel_warmup_s": 24.5},
    }
    servers = [server("int8", **up), server("int4"), server("auto_fa2", **up)]  # int4 never came up
    together = sb.engine_starts(servers, "fresh host", together=True)
    assert [(s["dtype"], s["host_state"]) for s in together] == [
        ("int8", "fresh host"),
        ("auto_fa2", "started with this call's first server, 2 of 3"),
    ]
    assert together[0] == {
        "model": "gemma3", "dtype": "int8", "host_state": "fresh host", "engine_start_s": 200.2,
        "kernel_warmup_s": 24.5, "kv_cache_tokens": 10, "max_model_len": 8448,
    }  # fmt: skip
    after = sb.engine_starts(servers, "", together=False)
    assert [s["host_state"] for s in after] == [
        "this call's first server",
        "this call's server 2, after the ones above",
    ]
