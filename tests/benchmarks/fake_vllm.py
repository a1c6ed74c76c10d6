"""Stand-in for the ``vllm`` command in the CPU tests of ``benchmarks/serve_bench.py``.

``fake_vllm.py serve MODEL --host H --port P ...``: logs what vLLM logs at start-up (the KV cache
line among them), then serves on H:P ``/health``, ``/v1/completions`` (streamed as vLLM streams it,
or one JSON answer), ``/metrics`` (vLLM 0.24.0's request histograms and counters, by its metric
names and labels, each completion observed with figures that follow from its prompt length P and
``max_tokens`` M: ``METRICS``; a 404 with ``FAKE_NO_METRICS=1``) and nothing else (``/tokenize``
is a 404, which ``vllm bench serve`` skips); with ``--profiler-config``, also ``/start_profile``
and ``/stop_profile``, the stop writing a small gzipped trace (two kernels in one step) into its
``torch_profiler_dir`` half a second later.

``fake_vllm.py bench serve ...``: with ``FAKE_VLLM_REAL_BENCH=1``, the real ``vllm bench serve``
(installed vLLM) with the same arguments; otherwise it writes a ``--save-result`` JSON with the
fields vLLM writes, after sending ``--num-prompts`` completions of ``--random-input-len`` token ids
and ``--random-output-len`` tokens to ``--base-url`` and ``FAKE_BENCH_S`` seconds (with
``--profile``, between a POST of ``/start_profile`` and one of ``/stop_profile``).

``serve`` also starts an idle child process titled as vLLM titles its engine core
(``VLLM::EngineCore``, by ``setproctitle``), which ends once the server is gone: the process tree
whose CPU time ``serve_bench.py`` reads (``benchmarks/process_cpu.py``).

Every call appends ``{"argv", "pid", "shim"}`` to the JSON-lines file ``$FAKE_VLLM_RECORD``.

Under ``serve_bench.py --step-timing`` (``SERVE_BENCH_STEP_TIMING_DIR`` set, its
``sitecustomize`` loaded), ``serve`` also defines a ``vllm.v1.engine.core.EngineCore`` whose
``step`` it calls once per output token of each completion, as an engine steps.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

KV_TOKENS = "1,234,567"
TRACE_DIR: str | None = None  # the server's torch_profiler_dir, when it has --profiler-config
TRACE = {
    "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "gpu_model_runner: forward", "ts": 0,
         "dur": 100},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1, "dur": 1,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2, "dur": 1,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "_attn_fwd", "ts": 10, "dur": 30,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 40, "dur": 20,
         "args": {"correlation": 2}},
    ]
}  # fmt: skip


REGISTRY = CollectorRegistry()
LABELS = ["model_name", "engine"]
# what one completion of P prompt tokens and M output tokens adds (seconds are binary fractions,
# so the means a test expects are exact); names and labels as vllm/v1/metrics/loggers.py's
SECONDS = {
    "vllm:request_queue_time_seconds": lambda p, m: 0.125,
    "vllm:request_prefill_time_seconds": lambda p, m: p / 16384,
    "vllm:request_decode_time_seconds": lambda p, m: m / 1024,
    "vllm:request_inference_time_seconds": lambda p, m: p / 16384 + m / 1024,
    "vllm:time_to_first_token_seconds": lambda p, m: 0.125 + p / 16384 + 1 / 64,
    "vllm:e2e_request_latency_seconds": lambda p, m: 0.125 + p / 16384 + 1 / 64 + m / 1024,
    "vllm:request_time_per_output_token_seconds": lambda p, m: 1 / 1024,
}
COUNTS = {
    "vllm:prompt_tokens": lambda p, m: p,
    "vllm:generation_tokens": lambda p, m: m,
    "vllm:num_preemptions": lambda p, m: 1,
    "vllm:prefix_cache_queries": lambda p, m: p,
    "vllm:prefix_cache_hits": lambda p, m: p // 4,
}
METRICS: dict[str, Histogram | Counter] = {
    name: Histogram(name, name, LABELS, registry=REGISTRY, buckets=[0.5, 1.0])
    for name in [*SECONDS, "vllm:inter_token_latency_seconds", "vllm:iteration_tokens_total"]
} | {name: Counter(name, name, LABELS, registry=REGISTRY) for name in COUNTS}
MODEL_NAME = ""  # the served model's name label: its path, as vllm serve names it by default


def observe(p: int, m: int) -> None:
    """One finished completion in the metrics (one engine step with output per request)."""
    for name, f in SECONDS.items():
        METRICS[name].labels(MODEL_NAME, "0").observe(f(p, m))
    for _ in range(m - 1):
        METRICS["vllm:inter_token_latency_seconds"].labels(MODEL_NAME, "0").observe(1 / 1024)
    METRICS["vllm:iteration_tokens_total"].labels(MODEL_NAME, "0").observe(p + m)
    for name, f in COUNTS.items():
        METRICS[name].labels(MODEL_NAME, "0").inc(f(p, m))


def write_trace() -> None:
    time.sleep(0.5)  # as vLLM's worker does, after the stop request has been answered
    os.makedirs(TRACE_DIR, exist_ok=True)
    path = os.path.join(TRACE_DIR, f"fake_worker.{time.time_ns()}.pt.trace.json.gz")
    with gzip.open(path + ".tmp", "wt") as f:
        json.dump(TRACE, f)
    os.replace(path + ".tmp", path)


def record(argv: list[str]) -> None:
    path = os.environ.get("FAKE_VLLM_RECORD")
    if path:
        entry = {"argv": argv, "pid": os.getpid(), "shim": os.environ.get("INT8KV_SHIM")}
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the stream ends when the connection closes

    def log_message(self, fmt: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/metrics" and os.environ.get("FAKE_NO_METRICS") != "1":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.end_headers()
            self.wfile.write(generate_latest(REGISTRY))
            return
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path in ("/start_profile", "/stop_profile") and TRACE_DIR:
            self.send_response(200)
            self.end_headers()
            if self.path == "/stop_profile":
                threading.Thread(target=write_trace).start()
            return
        if self.path != "/v1/completions":
            self.send_response(404)
            self.end_headers()
            return
        n = int(body["max_tokens"])
        prompt = body["prompt"]
        usage = {
            "prompt_tokens": len(prompt) if isinstance(prompt, list) else len(prompt.split()),
            "completion_tokens": n,
        }
        # before the answer: vLLM records a request's metrics as its last output goes out
        observe(usage["prompt_tokens"], n)
        if ENGINE is not None:
            for _ in range(n):
                ENGINE.step()
        self.send_response(200)
        if not body.get("stream"):
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            choice = {"index": 0, "text": " t5" * n, "finish_reason": "length"}
            self.wfile.write(json.dumps({"choices": [choice], "usage": usage}).encode())
            return
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(n):
            time.sleep(0.001)
            chunk = {"choices": [{"index": 0, "text": " t5", "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


ENGINE = None


def engine_for_step_timing() -> object | None:
    """An object shaped like vLLM's engine core, announced to wrapt's import hooks (the step
    timer's) as the module it stands in for, when the step timer is asked for."""
    if not os.environ.get("SERVE_BENCH_STEP_TIMING_DIR"):
        return None
    import types

    import wrapt

    module = types.ModuleType("vllm.v1.engine.core")

    class EngineCore:
        def step(self) -> None:
            time.sleep(0.0005)

    module.EngineCore = EngineCore  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    wrapt.importer.notify_module_loaded(module)
    return EngineCore()


ENGINE_CORE_CHILD = """
import os, time, setproctitle
setproctitle.setproctitle("VLLM::EngineCore")
parent = os.getppid()
while os.getppid() == parent:
    time.sleep(0.2)
"""


CHILDREN: list[subprocess.Popen] = []


def serve(argv: list[str]) -> None:
    CHILDREN.append(subprocess.Popen([sys.executable, "-c", ENGINE_CORE_CHILD]))
    print("(EngineCore pid=1) INFO 01-01 00:00:00 [gpu_model_runner.py:5256] Model loading took "
          "0.27 GiB memory and 1.500000 seconds", flush=True)  # fmt: skip
    time.sleep(float(os.environ.get("FAKE_START_S", "0")))
    print(f"(EngineCore pid=1) INFO 01-01 00:00:01 [kv_cache_utils.py:2146] GPU KV cache size: "
          f"{KV_TOKENS} tokens", flush=True)  # fmt: skip
    print("(EngineCore pid=1) INFO 01-01 00:00:02 [core.py:345] init engine (profile, create kv "
          "cache, warmup model) took 12.34 s", flush=True)  # fmt: skip
    global TRACE_DIR, MODEL_NAME, ENGINE
    MODEL_NAME = argv[1]
    ENGINE = engine_for_step_timing()
    if flag(argv, "--profiler-config"):
        TRACE_DIR = json.loads(flag(argv, "--profiler-config"))["torch_profiler_dir"]
    host, port = flag(argv, "--host", "127.0.0.1"), int(flag(argv, "--port", "8000"))
    ThreadingHTTPServer((host, port), Handler).serve_forever()


def bench(argv: list[str]) -> None:
    if os.environ.get("FAKE_VLLM_REAL_BENCH") == "1":
        os.execv(sys.executable, [sys.executable, "-m", "vllm.entrypoints.cli.main", *argv])

    def post(path: str, body: dict | None = None) -> None:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(flag(argv, "--base-url") + path, data=data)
        urllib.request.urlopen(request, timeout=10).read()

    n, c = int(flag(argv, "--num-prompts")), int(flag(argv, "--max-concurrency"))
    inp, out = int(flag(argv, "--random-input-len")), int(flag(argv, "--random-output-len"))
    if "--profile" in argv:
        post("/start_profile")
    for _ in range(n):
        post("/v1/completions", {"prompt": [7] * inp, "max_tokens": out})
    time.sleep(float(os.environ.get("FAKE_BENCH_S", "0")))
    if "--profile" in argv:
        post("/stop_profile")
    base = 1.0 + c / 100  # latencies grow with concurrency
    result = {
        "date": "20250101-000000",
        "backend": "vllm",
        "model_id": flag(argv, "--model"),
        "num_prompts": n,
        "max_concurrency": c,
        "duration": 2.0,
        "completed": n,
        "failed": 0,
        "total_input_tokens": n * inp,
        "total_output_tokens": n * out,
        "output_throughput": n * out / 2.0,
        "median_ttft_ms": 10 * base,
        "p50_ttft_ms": 10 * base,
        "p99_ttft_ms": 20 * base,
        "median_tpot_ms": 2 * base,
        "p50_tpot_ms": 2 * base,
        "p99_tpot_ms": 3 * base,
        "mean_itl_ms": 2.5 * base,
        "std_itl_ms": base,
        "median_itl_ms": 2 * base,
        "p50_itl_ms": 2 * base,
        "p99_itl_ms": 4 * base,
    }
    os.makedirs(flag(argv, "--result-dir"), exist_ok=True)
    path = os.path.join(flag(argv, "--result-dir"), flag(argv, "--result-filename"))
    with open(path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    args = sys.argv[1:]
    record(args)
    if args[:1] == ["serve"]:
        serve(args)
    elif args[:2] == ["bench", "serve"]:
        bench(args)
    else:
        sys.exit(f"fake vllm: unknown command {args}")
