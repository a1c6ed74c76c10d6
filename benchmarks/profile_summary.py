"""What a torch profiler trace of a vLLM engine spent its GPU and host time on.

Reads the Chrome-trace JSON (``.json`` or ``.json.gz``) that vLLM's torch profiler writes
(``vllm serve --profiler-config '{"profiler": "torch", ...}'`` and ``vllm bench serve
--profile``) and sums:

* the GPU kernels by category: ``ours`` (int8kv-shim's Triton kernels), ``flash_attention``
  (FlashAttention-2), ``gemm`` and ``other``, and the top kernels by total time;
* how busy the GPU was: the union of the kernels' intervals against the span from the first
  kernel to the last (idle time there is the host's, or a wait);
* the host time of the operators vLLM calls (``cpu_op`` events, top ones by total time), the
  attention op among them, and the CUDA graph replays (``cudaGraphLaunch``);
* inside each of vLLM's attention ops (:data:`OPENED_OPS`, run on the host in eager steps), what
  its host time goes to, per call: the operators and CUDA calls it makes directly, and the rest
  (``self``: the backend's Python, Triton's launcher among it);
* where the trace has vLLM's step annotation (``gpu_model_runner: forward``, V1 model runner with
  ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``), or else the range ``serve_bench.py --step-timing`` puts
  around the V2 model runner's ``execute_model`` (``step_timing: execute_model``: it holds the
  step's input preparation too; the host's ranges only, not the profiler's copy of each on the
  GPU's timeline), per kind of step: ``graph`` (one whole-step CUDA graph
  replay: vLLM captures uniform decode batches) or ``eager`` (prompt chunks and mixed batches, at
  most piecewise graphs), the count, the host time of the range and the mean GPU time of each
  category; a kernel belongs to the step whose range holds the host call that launched it
  (matched by the trace's ``correlation`` ids).

Two traces of the same load (``auto`` on FlashAttention-2 against ``int8``) then say which kernels,
or the host, make it slower.

    python -m benchmarks.profile_summary TRACE.json.gz [--out summary.json]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

STEP_ANNOTATION = "gpu_model_runner: forward"
# V2's model runner has no step range: serve_bench --step-timing marks its execute_model
STEP_ANNOTATION_V2 = "step_timing: execute_model"
GRAPH_LAUNCH = "cudaGraphLaunch"
# a record_function range on the host; the profiler also draws each one on the GPU's timeline
# ("gpu_user_annotation", same name, from its first kernel to its last), which is no step
HOST_RANGE = "user_annotation"
# the attention layer's custom ops, whose host time is opened up into what they call
OPENED_OPS = ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update")
# host-side events that can nest inside an op (torch ops and CUDA runtime and driver calls)
HOST_CALLS = ("cpu_op", "cuda_runtime", "cuda_driver")

CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "ours",
        re.compile(
            r"^_(attn_fwd|attn_int4_fwd|write_kv_kernel|gather_kv_kernel|flush_pages_kernel"
            r"|store_tail_kernel)|^merge_splits"
        ),
    ),
    ("flash_attention", re.compile(r"flash", re.IGNORECASE)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul", re.IGNORECASE)),
)


NAMES = (*(name for name, _ in CATEGORIES), "other")


def category(kernel_name: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(kernel_name):
            return name
    return "other"


def load_trace(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, Mapping) else doc
    return [e for e in events if isinstance(e, Mapping) and e.get("ph") == "X"]


def _correlation(event: Mapping[str, Any]) -> int | None:
    value = (event.get("args") or {}).get("correlation")
    return int(value) if value is not None else None


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _ranked(totals: Mapping[str, list[float]], top: int, with_category: bool) -> list[dict]:
    rows = []
    for name, (count, total) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
        row: dict[str, Any] = {"name": name[:160], "count": int(count), "total_us": round(total, 1)}
        if with_category:
            row["category"] = category(name)
        rows.append(row)
    return rows


def _direct_children(events: Sequence[Mapping[str, Any]]) -> dict[int, list[int]]:
    """Index of each event of :data:`OPENED_OPS` -> indices of the host calls it makes directly
    (nested in it on the same thread, not inside another call of it)."""
    threads: dict[tuple[Any, Any], list[int]] = defaultdict(list)
    for i, e in enumerate(events):
        if e.get("cat") in HOST_CALLS:
            threads[e.get("pid"), e.get("tid")].append(i)
    children: dict[int, list[int]] = {}
    for idx in threads.values():
        idx.sort(key=lambda i: (float(events[i]["ts"]), -float(events[i].get("dur", 0.0))))
        stack: list[int] = []  # open calls, outermost first
        for i in idx:
            ts = float(events[i]["ts"])
            while stack and ts >= _end(events[stack[-1]]):
                stack.pop()
            if stack and stack[-1] in children:
                children[stack[-1]].append(i)
            if events[i].get("name") in OPENED_OPS:
                children[i] = []
            stack.append(i)
    return children


def _end(e: Mapping[str, Any]) -> float:
    return float(e["ts"]) + float(e.get("dur", 0.0))


def opened_ops(events: Sequence[Mapping[str, Any]], top: int = 12) -> dict[str, Any]:
    """Per op of :data:`OPENED_OPS`: calls, host µs a call, of it ``self_us`` (not in any call it
    makes: Python), and the calls it makes directly, top ones by time, as count and µs a call."""
    out: dict[str, Any] = {}
    by_op: dict[str, list[tuple[int, list[int]]]] = defaultdict(list)
    for i, kids in _direct_children(events).items():
        by_op[str(events[i]["name"])].append((i, kids))
    for name, calls in by_op.items():
        n = len(calls)
        total = sum(float(events[i].get("dur", 0.0)) for i, _ in calls)
        inner: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for _, kids in calls:
            for k in kids:
                inner[str(events[k].get("name", ""))][0] += 1
                inner[str(events[k].get("name", ""))][1] += float(events[k].get("dur", 0.0))
        in_calls = sum(t for _, t in inner.values())
        out[name] = {
            "calls": n,
            "us_per_call": round(total / n, 1),
            "self_us_per_call": round((total - in_calls) / n, 1),
            "calls_made": [
                {"name": k[:160], "per_call": round(c / n, 2), "us_per_call": round(t / n, 1)}
                for k, (c, t) in sorted(inner.items(), key=lambda kv: -kv[1][1])[:top]
            ],
        }
    return out


def summarize(events: Sequence[Mapping[str, Any]], top: int = 25) -> dict[str, Any]:
    """The summary of one trace's complete ("X") events (see the module docstring)."""
    ranges: dict[str, list[tuple[float, float]]] = {STEP_ANNOTATION: [], STEP_ANNOTATION_V2: []}
    launches: dict[int, tuple[float, str]] = {}  # correlation -> (host ts, runtime call)
    kernels: list[Mapping[str, Any]] = []
    host_ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        cat = e.get("cat", "")
        if cat == "kernel":
            kernels.append(e)
        elif cat in ("cuda_runtime", "cuda_driver"):
            corr = _correlation(e)
            if corr is not None:
                launches[corr] = (float(e["ts"]), str(e.get("name", "")))
        elif cat == HOST_RANGE and e.get("name") in ranges:
            ts = float(e["ts"])
            ranges[str(e["name"])].append((ts, ts + float(e.get("dur", 0.0))))
        elif cat == "cpu_op":
            host_ops[str(e.get("name", ""))][0] += 1
            host_ops[str(e.get("name", ""))][1] += float(e.get("dur", 0.0))
    steps = sorted(ranges[STEP_ANNOTATION] or ranges[STEP_ANNOTATION_V2])
    starts = [s for s, _ in steps]

    def step_of(ts: float) -> int | None:
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 and ts <= steps[i][1] else None

    graph_launches = [0] * len(steps)
    for ts, name in launches.values():
        if name == GRAPH_LAUNCH:
            i = step_of(ts)
            if i is not None:
                graph_launches[i] += 1
    per_step: list[dict[str, float]] = [defaultdict(float) for _ in steps]
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_category: dict[str, float] = defaultdict(float)
    for k in kernels:
        dur = float(k.get("dur", 0.0))
        name = str(k.get("name", ""))
        totals[name][0] += 1
        totals[name][1] += dur
        by_category[category(name)] += dur
        launch = launches.get(_correlation(k) or -1)
        i = step_of(launch[0]) if launch else None
        if i is not None:
            per_step[i][category(name)] += dur
    kinds: dict[str, Any] = {}
    for kind in ("eager", "graph"):
        # one replay = a whole-step graph; piecewise steps replay one graph per layer segment
        idx = [i for i in range(len(steps)) if (graph_launches[i] == 1) == (kind == "graph")]
        if not idx:
            continue
        host = [steps[i][1] - steps[i][0] for i in idx]
        gpu = {c: round(sum(per_step[i].get(c, 0.0) for i in idx) / len(idx), 1) for c in NAMES}
        kinds[kind] = {
            "steps": len(idx),
            "host_forward_us_p50": round(statistics.median(host), 1),
            "host_forward_us_mean": round(statistics.fmean(host), 1),
            "gpu_us_mean": gpu,
            "gpu_us_mean_total": round(sum(gpu.values()), 1),
        }
    span = (
        max(float(k["ts"]) + float(k.get("dur", 0.0)) for k in kernels)
        - min(float(k["ts"]) for k in kernels)
        if kernels
        else 0.0
    )
    busy = busy_us((float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0.0))) for k in kernels)
    attention_ops = {n: v for n, v in host_ops.items() if "attention" in n.lower()}
    return {
        "kernels": len(kernels),
        "kernel_us_total": round(sum(by_category.values()), 1),
        "kernel_us_by_category": {c: round(by_category.get(c, 0.0), 1) for c in NAMES},
        "gpu_span_us": round(span, 1),
        "gpu_busy_us": round(busy, 1),
        "gpu_busy_fraction": round(busy / span, 4) if span else None,
        "graph_replays": sum(1 for _, n in launches.values() if n == GRAPH_LAUNCH),
        "host_attention_ops": _ranked(attention_ops, top, with_category=False),
        "attention_ops_opened": opened_ops(events),
        "top_host_ops": _ranked(host_ops, top, with_category=False),
        "top_kernels": _ranked(totals, top, with_category=True),
        "steps": len(steps),
        "by_step_kind": kinds,
    }


def summarize_files(paths: Sequence[Path], top: int = 25) -> dict[str, Any]:
    """One summary per trace file (the engine's worker writes one; vLLM's front end another,
    which has no GPU kernels)."""
    return {str(p): summarize(load_trace(p), top) for p in paths}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    doc = summarize_files(args.traces, args.top)
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
