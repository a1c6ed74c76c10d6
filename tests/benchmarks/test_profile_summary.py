"""benchmarks/profile_summary.py on a hand-made trace: categories, busy time, steps."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import profile_summary as ps


def _x(name: str, cat: str, ts: float, dur: float, corr: int | None = None) -> dict:
    e = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _trace() -> list[dict]:
    # step 1 (eager, piecewise: two graph replays): our decode, FA2 prefill, a gemm
    # step 2 (graph: one replay): two kernels inside the graph
    return [
        _x(ps.STEP_ANNOTATION, "user_annotation", 0, 100),
        _x("vllm::unified_attention_with_output", "cpu_op", 10, 30),
        _x("cudaLaunchKernel", "cuda_runtime", 12, 2, corr=1),
        _x("cudaLaunchKernel", "cuda_runtime", 20, 2, corr=2),
        _x("cudaGraphLaunch", "cuda_runtime", 50, 2, corr=3),
        _x("cudaGraphLaunch", "cuda_runtime", 60, 2, corr=4),
        _x("_attn_fwd", "kernel", 100, 40, corr=1),
        _x("flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", "kernel", 140, 60, corr=2),
        _x("sm90_xmma_gemm_bf16", "kernel", 220, 30, corr=3),
        _x("elementwise_kernel", "kernel", 250, 10, corr=4),
        _x(ps.STEP_ANNOTATION, "user_annotation", 1000, 50),
        _x("cudaGraphLaunch", "cuda_runtime", 1010, 2, corr=5),
        _x("_attn_fwd", "kernel", 1100, 15, corr=5),
        _x("cutlass_gemm", "kernel", 1110, 30, corr=5),  # overlaps the one before: busy 40
        # launched outside any step
        _x("cudaLaunchKernel", "cuda_runtime", 5000, 2, corr=6),
        _x("merge_splits", "kernel", 5000, 5, corr=6),
    ]


def test_category() -> None:
    assert ps.category("_write_kv_kernel") == "ours"
    assert ps.category("merge_splits") == "ours"
    assert ps.category("_gather_kv_kernel") == "ours"
    assert ps.category("void flash::flash_fwd_splitkv_kernel<...>") == "flash_attention"
    assert ps.category("nvjet_tst_128x64") == "gemm"
    assert ps.category("triton_poi_fused_add_0") == "other"


def test_busy_us_merges_overlaps() -> None:
    assert ps.busy_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert ps.busy_us([]) == 0


def test_summarize() -> None:
    doc = ps.summarize(_trace())
    assert doc["kernels"] == 7
    assert doc["kernel_us_by_category"] == {
        "ours": 60.0,
        "flash_attention": 60.0,
        "gemm": 60.0,
        "other": 10.0,
    }
    assert doc["kernel_us_total"] == 190.0
    assert doc["gpu_span_us"] == 4905.0
    assert doc["gpu_busy_us"] == 40 + 60 + 30 + 10 + 40 + 5
    assert doc["graph_replays"] == 3
    assert doc["host_attention_ops"] == [
        {"name": "vllm::unified_attention_with_output", "count": 1, "total_us": 30.0}
    ]
    assert doc["top_kernels"][0] == {
        "name": "flash_fwd_kernel<Flash_fwd_kernel_traits<64>>",
        "count": 1,
        "total_us": 60.0,
        "category": "flash_attention",
    }
    assert doc["steps"] == 2
    eager, graph = doc["by_step_kind"]["eager"], doc["by_step_kind"]["graph"]
    assert eager["steps"] == 1 and eager["host_forward_us_p50"] == 100
    assert eager["gpu_us_mean"] == {"ours": 40, "flash_attention": 60, "gemm": 30, "other": 10}
    assert graph["steps"] == 1 and graph["host_forward_us_mean"] == 50
    assert graph["gpu_us_mean"] == {"ours": 15, "flash_attention": 0, "gemm": 30, "other": 0}
    assert graph["gpu_us_mean_total"] == 45


def test_steps_of_the_v2_runner_come_from_the_step_timing_range() -> None:
    v2 = [dict(e, name=ps.STEP_ANNOTATION_V2) if e["name"] == ps.STEP_ANNOTATION else e
          for e in _trace()]  # fmt: skip
    assert ps.summarize(v2)["by_step_kind"] == ps.summarize(_trace())["by_step_kind"]
    # with both, vLLM's own annotation (the V1 runner's forward) is the step
    both = [*_trace(), _x(ps.STEP_ANNOTATION_V2, "user_annotation", 0, 2000)]
    assert ps.summarize(both)["steps"] == 2


def test_the_gpu_timeline_copy_of_a_step_range_is_no_step() -> None:
    """The profiler draws each record_function range on the GPU's timeline too, under the same
    name: counted as a step, it doubled the steps and put host launches in the wrong range."""
    gpu_copies = [_x(ps.STEP_ANNOTATION, "gpu_user_annotation", 100, 160),
                  _x(ps.STEP_ANNOTATION, "gpu_user_annotation", 1100, 40)]  # fmt: skip
    doc = ps.summarize([*_trace(), *gpu_copies])
    assert doc["steps"] == 2
    assert doc["by_step_kind"] == ps.summarize(_trace())["by_step_kind"]


def test_attention_ops_opened_into_the_calls_they_make() -> None:
    op = "vllm::unified_attention_with_output"

    def on(tid: int, e: dict) -> dict:
        return e | {"pid": 1, "tid": tid}

    events = [
        on(7, _x(op, "cpu_op", 10, 30)),
        on(7, _x("aten::empty", "cpu_op", 11, 2)),
        on(7, _x("_vllm_fa2_C::varlen_fwd", "cpu_op", 14, 10)),
        on(7, _x("cudaLaunchKernel", "cuda_runtime", 15, 3)),  # inside varlen_fwd: not direct
        on(7, _x("cuLaunchKernelEx", "cuda_driver", 26, 2)),
        on(7, _x("aten::add", "cpu_op", 45, 5)),  # after the op
        on(8, _x("aten::mul", "cpu_op", 12, 4)),  # another thread, same time
        on(7, _x(op, "cpu_op", 100, 6)),  # a second call that makes none
    ]
    opened = ps.summarize(events)["attention_ops_opened"]
    assert list(opened) == [op]
    assert opened[op]["calls"] == 2 and opened[op]["us_per_call"] == 18.0
    assert opened[op]["self_us_per_call"] == (30 - 10 - 2 - 2 + 6) / 2
    assert opened[op]["calls_made"] == [
        {"name": "_vllm_fa2_C::varlen_fwd", "per_call": 0.5, "us_per_call": 5.0},
        {"name": "aten::empty", "per_call": 0.5, "us_per_call": 1.0},
        {"name": "cuLaunchKernelEx", "per_call": 0.5, "us_per_call": 1.0},
    ]


def test_summarize_without_steps_or_kernels() -> None:
    doc = ps.summarize([_x("aten::add", "cpu_op", 0, 3)])
    assert doc["steps"] == 0 and doc["by_step_kind"] == {}
    assert doc["gpu_busy_fraction"] is None
    assert doc["top_host_ops"] == [{"name": "aten::add", "count": 1, "total_us": 3.0}]


@pytest.mark.parametrize("gz", [True, False])
def test_main_reads_gzip_and_plain(tmp_path, gz: bool, capsys) -> None:
    path = tmp_path / ("t.pt.trace.json.gz" if gz else "t.json")
    text = json.dumps({"traceEvents": [*_trace(), {"ph": "M", "name": "process_name"}]})
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    out = tmp_path / "summary.json"
    assert ps.main([str(path), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc[str(path)]["kernels"] == 7
    assert json.loads(capsys.readouterr().out) == doc
