"""Serving numbers taken with vLLM's own tools: ``vllm bench serve`` against ``vllm serve``.

For each model and dtype (row label of ``benchmarks/common.CONFIGS``) this script

1. starts ``vllm serve MODEL`` on 127.0.0.1 at a free port (refusing a port that is taken), with
   ``INT8KV_SHIM=1`` in its environment, vLLM's default CUDA graphs and torch.compile,
   ``--kv-cache-dtype`` from the label (``auto_fa2`` forces FlashAttention-2 with
   ``--attention-config``: the GPU bundle has no FA3, Hopper's default; ``int8_per_token_head`` is
   upstream's, on vLLM's Triton backend), ``--max-model-len`` = the longest input + output (at most
   the model's ``max_position_embeddings``) and ``--gpu-memory-utilization``;
2. waits for ``/health`` (bounded) and records ``engine_start_s`` (process start to healthy) and
   ``kv_cache_tokens`` (the server log's ``GPU KV cache size: N tokens``);
3. per input length, sends a few warm-up requests (own random token ids, so no timed prompt is a
   prefix-cache hit) and then runs, per concurrency, ``vllm bench serve --backend vllm
   --dataset-name random --random-input-len L --random-output-len 256 --ignore-eos
   --temperature 0 --max-concurrency C --num-prompts N --save-result ...``; every point has its own
   ``--seed`` (a function of L and C, the same for every dtype), so no point re-sends the prompts of
   an earlier one into the prefix cache;
4. stops the server (SIGTERM to its process group, SIGKILL after a bound) and waits until the group
   is gone before the next one starts.

Input lengths: ``8K`` and ``32K`` where the model allows; a length with ``L + output_len`` above the
model's context is cut to ``context - output_len`` (SmolLM2's 8192: 7936, and its 32K is dropped as
the same point), and the row records the real ``input_len``. ``num_prompts`` per point is
``max(--prompts-per-concurrency * C, --min-prompts)``.

Writes ``--out`` (``benchmarks/results/serving.json``: ``gpu``, ``command``, ``rows`` of ``model``,
``dtype``, ``input_len``, ``output_len``, ``concurrency``, ``num_prompts``, ``ttft_ms_p50``,
``ttft_ms_p99``, ``tpot_ms_p50``, ``tpot_ms_p99``, ``itl_ms_p50``, ``itl_ms_p99``,
``itl_ms_mean``, ``itl_ms_std``, ``output_tok_s``, ``kv_cache_tokens``, ``engine_start_s``,
``jit_compiles``: the Triton compiles the server logged during the point, from
``--jit-monitor-verbose``, and ``server_metrics``;
``engine_starts``: each server's start, its time to healthy split by the phases of its log, the
shim's kernel compiles among them, and ``--host-state``, what the host had done before) after
EVERY point, so a run cut off keeps what it measured, and a plot beside it (``serving.png``:
median TPOT against concurrency, one panel per model and input length, one line per dtype; needs
matplotlib, ``--plot-only`` redraws it from the JSON).

``server_metrics`` says where the point's requests spent their time by the server's own Prometheus
metrics: ``/metrics`` is scraped right before and right after the timed ``vllm bench serve`` (so
the warm-up is not in it), and the difference gives the mean queue, prefill, decode and TTFT ms of
the requests in between, their count, preemptions, tokens and prefix-cache hit rate
(``benchmarks/server_metrics.py`` names each figure and its vLLM metric). A failed scrape costs a
warning and the field, never the row; ``serve_bench_runs.json`` keeps why
(``server_metrics_error``).

``process_cpu`` says whether the server's processes ran out of CPU during the point: each role's
CPU seconds across the timed ``vllm bench serve`` (``benchmarks/process_cpu.py``, from ``/proc``;
no field off Linux), ``{"api_server" | "engine_core" | "other": {"cpu_s", "busy", "busy_run",
"main_thread_cpu_s", "main_thread_busy_run"}}`` with ``busy`` the seconds over the command's wall
time (its start-up included), ``busy_run`` over vLLM's ``duration`` (first request sent to last
answer), and the same for the role's busiest main thread (the API server's event loop, the engine
core's busy loop); ``"bench_client"``: the same (no main thread) for ``vllm bench serve`` itself,
one Python process whose clock gives TTFT and TPOT.

``--append`` merges into an existing file (a row replaces one of the same model, dtype, input_len
and concurrency) and refuses a file measured on another GPU, so one model per call works.
Raw ``vllm bench serve`` results, server and client logs and ``serve_bench_runs.json`` (commands,
start-up phases from the server log, errors, the exception an engine core died of) go to
``--logdir`` (``$OUT/serve_bench`` on a device run), never into the repository.

Models (``--models``): ``smollm2`` ($SMOLLM2_DIR), ``gemma3`` ($GEMMA3_DIR), ``llama3-8b-shape``: a
random-weight Llama with Llama-3-8B's attention and MLP shape (32 q / 8 kv heads of 128, hidden
4096, intermediate 14336, ``--llama-layers`` layers, 40960 positions) and SmolLM2's tokenizer, made
on first use under ``--workdir``; or ``NAME=FOLDER``.

``--profile-concurrency C``: after the timed points of each input length (before them with
``--profile-first``), one more point at ``C`` under the server's torch profiler
(``--profiler-config``, ``vllm bench serve --profile``; on ``--profile-dtypes``' servers only,
though every server is started with the profiler configured), not a row;
``benchmarks/profile_summary.py`` sums its trace into a row of ``serving_profile.json`` (beside
``--out``) with the point's ``server_metrics``, and the raw trace is deleted unless
``--keep-traces``.

``--step-timing``: each server's engine also times its steps' host work by phase at full host
speed (``benchmarks/step_timing.py``: the scheduler, the model runner's input preparation,
metadata builds, forward and sampling, the wait for the sampled tokens), and each row gains
``step_timing``, the difference across its point: calls, µs a call and ms per engine step of each
phase, the model runner's ``execute_model`` also apart for decode steps and for steps that carry a
prompt chunk (``execute_model.decode``, ``execute_model.prompt``), and each layer's attention
and cache update on the host, ours or FlashAttention-2's, by the kind of step they ran in
(``attention_forward.prompt``, ``kv_cache_update.prompt``, ...) with the parts of an attention
call (``fa2_call``: FlashAttention-2's varlen call; ``attention_ours``: our kernels' launches;
``int4_write``), and each new request's age, since
the API server stamped its arrival, when the engine core's input thread and then its scheduler
took it (``request_age_at_engine_core``, ``request_age_at_scheduler``), and the API server's
processing of the engine's outputs (``process_outputs``). ``--sync-debug`` (implies it)
also counts, by Python line, every synchronizing CUDA call the engine makes after its first steps
(``torch.cuda.set_sync_debug_mode``).

``--rounds R``: every point R times, each round with new prompts (the seeds of ``--seed`` + r); a
row then holds each round's figures, server metrics, step timing and process CPU under ``rounds``
and, as its figures, their medians. ``--interleave``: every dtype's server of a model starts (one
after another) and stays up, each with an equal share of ``--gpu-memory-utilization`` (the rows'
``servers_at_once``; so their ``kv_cache_tokens`` are a share too), and each point runs on one
server after the other, round r starting with the r-th: servers started minutes apart on a host
whose speed drifts (FlashAttention-2's own median TPOT on Gemma 3 at 32 requests has moved by more
than half from one H100 run to another) are then compared point by point (``python -m
benchmarks.report`` pairs each round with the baseline's same round).

``--time-budget-s``: no new point (or server) starts after it, nor a server whose start the rest
of the budget would not cover (the longest start of the run so far), and no child runs past it.
``--dry-run`` prints every command without running anything.

GPU host, from the repository root: ``python -m benchmarks.serve_bench --models smollm2
--dtypes auto_fa2,int8_per_token_head,int8 --input-lens 8K --concurrency 1,8,32 --append``.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from benchmarks import common, process_cpu, profile_summary, server_metrics, soak, step_timing

DEFAULT_OUT = common.RESULTS_DIR / "serving.json"
DEFAULT_WORKDIR = Path("/tmp/int8kv-serve-bench")
DTYPE_ORDER = ["auto_fa2", "int8_per_token_head", "int8", "int4"]
ROW_KEYS = [
    "model",
    "dtype",
    "input_len",
    "output_len",
    "concurrency",
    "num_prompts",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    # the median step: a step without a prefill chunk in it, where TPOT averages over those with
    "itl_ms_p50",
    "itl_ms_p99",
    # with the median: whether the gaps split between short decode steps and long prompt steps
    # (a median that moves one way while the time per output token moves the other)
    "itl_ms_mean",
    "itl_ms_std",
    "output_tok_s",
    "kv_cache_tokens",
    "engine_start_s",
    # Triton compiles the server logged while the point ran: each one stalls every request in
    # flight, so a point with any measures start-up cost, not steady serving
    "jit_compiles",
]
ROW_KEY = ("model", "dtype", "input_len", "concurrency")
LLAMA_SHAPE = "llama3-8b-shape"
LLAMA_CONTEXT = 40960  # Llama-3.1's 131072 is more than any point here needs
# What the models' config.json say; only a --dry-run without the folders falls back on these.
KNOWN_CONTEXT = {"smollm2": 8192, "gemma3": 32768, LLAMA_SHAPE: LLAMA_CONTEXT}
MODEL_ENV = {"smollm2": "SMOLLM2_DIR", "gemma3": "GEMMA3_DIR"}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
# vllm/v1/core/kv_cache_utils.py: logger.info_once("GPU KV cache size: %s tokens", f"{n:,}")
KV_CACHE_RE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
# Where a slow engine start spends its time (messages of vLLM 0.24.0's model runner, compiler
# monitor and engine core); kept in the run details, not in the rows.
STARTUP_PHASES = {
    "load_weights_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "model_loading_s": re.compile(
        r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) seconds"
    ),
    "torch_compile_s": re.compile(r"torch\.compile took ([\d.]+) s in total"),
    "graph_capture_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "init_engine_s": re.compile(
        r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"
    ),
}
# int8kv_shim/kernel_warmup.py, once per group of layers that share a metadata builder (Gemma 3's
# sliding and full layers are two): the shim's Triton kernels compiled before CUDA graphs. Summed.
KERNEL_WARMUP_RE = re.compile(
    r"compiled our kernels' serving variants at start-up \(\d+ launches, ([\d.]+) s\)"
)
# vllm/triton_utils/jit_monitor.py, after the engine's warm-up: "Triton kernel JIT compilation
# during inference: NAME." once per kernel name, or with ``--jit-monitor-verbose`` (which the
# servers here get) every compile as "... inference: NAME (key=...)."
JIT_RE = re.compile(
    r"Triton (?:kernel |autotune/warmup candidate )JIT compilation during inference: (\w+)"
)
WARMUP_OUTPUT_TOKENS = 16
STOP_GRACE_S = 30.0  # the engine core's own shutdown, after the API server has exited
# the worker writes its trace after /stop_profile has returned: hundreds of MB of JSON at 8K
PROFILE_WRITE_TIMEOUT_S = 180.0
# vLLM records a request's metrics just after its last output is on its way: how long the scrape
# after a point may wait for the server to count all of the point's requests
METRICS_SETTLE_S = 2.0
T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# arguments and the plan (pure)


def parse_len(text: str) -> int:
    """``"8K"`` -> 8192, ``"32k"`` -> 32768, ``"7936"`` -> 7936."""
    t = text.strip()
    n = int(t[:-1]) * 1024 if t[-1:] in ("k", "K") else int(t)
    if n < 1:
        raise ValueError(f"input length must be positive, got {text!r}")
    return n


def parse_ints(text: str) -> list[int]:
    out = [int(t) for t in common.parse_list(text)]
    if not out or min(out) < 1:
        raise ValueError(f"need positive integers, got {text!r}")
    return out


def effective_input_lens(requested: Iterable[int], output_len: int, context: int) -> list[int]:
    """Input lengths that fit ``context`` with ``output_len`` generated: each cut to
    ``context - output_len`` where longer, duplicates merged, ascending."""
    room = context - output_len
    if room < 1:
        raise ValueError(f"context {context} leaves no room for {output_len} output tokens")
    return sorted({min(n, room) for n in requested})


def num_prompts_for(concurrency: int, per_concurrency: int, min_prompts: int) -> int:
    """Prompts of one point: enough waves at ``concurrency`` for a stable median, at least
    ``min_prompts`` (concurrency 1 is otherwise a handful of requests)."""
    return max(per_concurrency * concurrency, min_prompts)


def point_seed(base: int, input_len: int, concurrency: int) -> int:
    """The random dataset's seed of a point: distinct across the points of one server (the same
    prompts twice would be prefix-cache hits), equal across dtypes (same prompts for each)."""
    return base * 1_000_003 + input_len * 1000 + concurrency


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: Path
    build_llama: bool = False  # made by this script on first use


def model_specs(
    text: str, workdir: Path, env: Mapping[str, str], dry_run: bool = False
) -> list[ModelSpec]:
    """``--models``: known names, or ``NAME=FOLDER`` (a dry run names an unset variable)."""
    specs = []
    for item in common.parse_list(text):
        if "=" in item:
            name, path = item.split("=", 1)
            specs.append(ModelSpec(name.strip(), Path(path.strip())))
        elif item == LLAMA_SHAPE:
            specs.append(ModelSpec(item, workdir / "models" / LLAMA_SHAPE, build_llama=True))
        elif item in MODEL_ENV:
            folder = env.get(MODEL_ENV[item]) or (f"${MODEL_ENV[item]}" if dry_run else "")
            if not folder:
                raise ValueError(f"model {item}: ${MODEL_ENV[item]} is not set")
            specs.append(ModelSpec(item, Path(folder)))
        else:
            known = ", ".join([*MODEL_ENV, LLAMA_SHAPE])
            raise ValueError(f"unknown model {item!r} (known: {known}, or NAME=FOLDER)")
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"a model is named twice in {text!r}")
    return specs


def read_config(folder: Path) -> dict[str, Any]:
    """A model folder's config.json, its text part for multimodal-style configs."""
    cfg = json.loads((folder / "config.json").read_text())
    return cfg.get("text_config", cfg) if "max_position_embeddings" not in cfg else cfg


def model_context(spec: ModelSpec, dry_run: bool = False) -> int:
    """``max_position_embeddings`` of a model (the Llama shape's before it is made)."""
    if spec.build_llama:
        return LLAMA_CONTEXT
    if (spec.path / "config.json").exists():
        return int(read_config(spec.path)["max_position_embeddings"])
    if dry_run and spec.name in KNOWN_CONTEXT:
        return KNOWN_CONTEXT[spec.name]
    raise FileNotFoundError(f"model {spec.name}: no config.json in {spec.path}")


# --------------------------------------------------------------------------------------------
# the random-weight Llama-3-8B-shaped model


def llama_shape_config(
    vocab_size: int,
    num_layers: int,
    bos_token_id: int | None,
    eos_token_id: int | list[int] | None,
    **shape: Any,
) -> dict[str, Any]:
    """``LlamaConfig`` arguments of Llama-3-8B's shape (keyword overrides shrink it for tests)."""
    cfg: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": LLAMA_CONTEXT,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    return cfg | shape


def llama_weight_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama tensor names and (out, in) shapes of a config."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def make_random_llama(
    out_dir: Path, tokenizer_dir: Path, num_layers: int, seed: int = 0, **shape: Any
) -> Path:
    """Write a random-weight Llama (``llama_shape_config``) with ``tokenizer_dir``'s tokenizer to
    ``out_dir``, unless one of the same config is already there: BF16 safetensors, normal weights
    of std 0.02 from a seeded generator, norms at 1. Built beside ``out_dir`` and renamed into
    place, so a run killed halfway leaves no half model behind."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    src = read_config(tokenizer_dir)
    cfg_kw = llama_shape_config(
        int(src["vocab_size"]),
        num_layers,
        src.get("bos_token_id"),
        src.get("eos_token_id"),
        **shape,
    )
    marker = out_dir / "int8kv_random_llama.json"
    want = {"config": cfg_kw, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    LlamaConfig(**cfg_kw, dtype="bfloat16", architectures=["LlamaForCausalLM"]).save_pretrained(
        str(tmp)
    )
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shp in llama_weight_shapes(cfg_kw).items():
        if len(shp) == 1:
            tensors[name] = torch.ones(shp, dtype=torch.bfloat16)
        else:
            w = torch.randn(shp, generator=gen, dtype=torch.float32).mul_(0.02)
            tensors[name] = w.to(torch.bfloat16)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copyfile(tokenizer_dir / f, tmp / f)
    marker_tmp = tmp / marker.name
    marker_tmp.write_text(json.dumps(want, indent=1))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


# --------------------------------------------------------------------------------------------
# commands


def vllm_serve_dtype_env(dtype: str, shim_everywhere: bool) -> dict[str, str]:
    """The server's environment: the shim on for every row unless ``shim_everywhere`` is off
    (then only where the label needs it, as the offline benchmarks run)."""
    return common.child_env(dtype, shim_everywhere=shim_everywhere)


def bench_argv(
    vllm_cmd: Sequence[str],
    base_url: str,
    model: str,
    input_len: int,
    output_len: int,
    concurrency: int,
    num_prompts: int,
    seed: int,
    result_dir: Path,
    result_filename: str,
    extra: Sequence[str] = (),
) -> list[str]:
    """One ``vllm bench serve`` point (flags as in vllm/benchmarks/serve.py and datasets.py)."""
    return [
        *vllm_cmd,
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--model",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--ignore-eos",
        # greedy: the server's default sampling (generation_config) would add a sort over the
        # vocabulary per token on the GPU bundle's PyTorch sampler, the same for every dtype
        "--temperature",
        "0",
        "--max-concurrency",
        str(concurrency),
        "--num-prompts",
        str(num_prompts),
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_filename,
        *extra,
    ]


class Server(soak.VllmServer):
    """``benchmarks/soak.py``'s launcher with this script's executable, port and environment:
    refuses a port that is taken, and its stop waits for the whole process group (the engine core
    exits after the API server; the next engine's memory profile must not see its memory)."""

    def __init__(
        self,
        vllm_cmd: Sequence[str],
        model: str,
        dtype: str,
        *,
        port: int,
        env: Mapping[str, str],
        **kw: Any,
    ) -> None:
        super().__init__(model, dtype, **kw)
        if port:
            self.argv[self.argv.index("--port") + 1] = str(port)
            self.port, self.base_url = port, f"http://127.0.0.1:{port}"
        # soak's argv starts with [python, -m, vllm.entrypoints.cli.main]
        self.argv = [*vllm_cmd, *self.argv[3:]]
        self.env = dict(env)

    def spawn(self) -> None:
        if not port_is_free(self.port):
            raise RuntimeError(f"port {self.port} on 127.0.0.1 is taken: not starting vllm serve")
        LIVE.add(self)
        super().spawn()

    def stop(self) -> None:
        super().stop()
        if self.proc is not None:  # its own session: the group id is its pid
            wait_group_gone(self.proc.pid, STOP_GRACE_S)
        LIVE.discard(self)


LIVE: set[Server] = set()


@atexit.register
def _stop_live_servers() -> None:
    for server in list(LIVE):
        server.stop()


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until no process of group ``pgid`` is left, SIGKILL it after ``timeout_s``; whether
    it went by itself."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # a reused group id of someone else: ours is gone
            return True
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    return False


# --------------------------------------------------------------------------------------------
# parsing what vLLM wrote


def kv_cache_tokens_from_log(text: str) -> int | None:
    """``GPU KV cache size: 1,234,567 tokens`` -> 1234567 (the last such line), or None."""
    found = KV_CACHE_RE.findall(text)
    return int(found[-1].replace(",", "")) if found else None


# The exception a vLLM engine core died of, as its traceback's last line ("(EngineCore pid=N)
# ERROR ... [core.py:1231] FileNotFoundError: ..."); the API server only says "Engine core
# initialization failed. See root cause above".
ENGINE_ERROR_RE = re.compile(
    r"^\(EngineCore[^)]*\)(?: ERROR [^\]]*\])? +((?:[\w.]+\.)?\w*(?:Error|Exception)\b: .*)$",
    re.MULTILINE,
)


def shim_lines(text: str, limit: int = 40) -> list[str]:
    """The server log's int8kv-shim lines (which prefill route ran, warnings), first ``limit``."""
    return [line.strip() for line in text.splitlines() if "int8kv-shim:" in line][:limit]


def engine_error_from_log(text: str) -> str | None:
    """The last exception line an engine core process logged (its root cause), or None."""
    found = ENGINE_ERROR_RE.findall(text)
    return found[-1].strip() if found else None


def startup_phases_from_log(text: str) -> dict[str, float]:
    """Seconds of each of :data:`STARTUP_PHASES` (its last line in ``text``) and
    ``kernel_warmup_s``, the shim's kernel compiles at start-up (every group's line, summed)."""
    out = {}
    for key, rx in STARTUP_PHASES.items():
        found = rx.findall(text)
        if found:
            out[key] = float(found[-1])
    if warmups := KERNEL_WARMUP_RE.findall(text):
        out["kernel_warmup_s"] = round(sum(map(float, warmups)), 2)
    return out


def jit_compiles_from_log(text: str) -> list[str]:
    """The kernel names of the Triton compiles vLLM's JIT monitor logged in ``text``, in order."""
    return JIT_RE.findall(text)


def result_to_row(
    result: Mapping[str, Any],
    *,
    model: str,
    dtype: str,
    input_len: int,
    output_len: int,
    concurrency: int,
    kv_cache_tokens: int | None,
    engine_start_s: float,
    jit_compiles: int = 0,
) -> dict[str, Any]:
    """A serving.json row from one ``vllm bench serve --save-result`` JSON (its field names:
    vllm/benchmarks/serve.py, ``median_*_ms`` and ``p{50,99}_*_ms`` with ``--metric-percentiles
    50,99``). Refuses a point where any request failed: its percentiles would cover only the rest."""
    completed, failed = int(result["completed"]), int(result.get("failed", 0))
    if failed or completed != int(result["num_prompts"]):
        raise ValueError(f"{failed} of {result['num_prompts']} requests failed")
    if int(result.get("max_concurrency") or 0) != concurrency:
        raise ValueError(f"result is for concurrency {result.get('max_concurrency')}")

    def ms(key: str) -> float:
        v = float(result[key])
        if not math.isfinite(v):
            raise ValueError(f"{key} is {v}")
        return round(v, 3)

    row = {
        "model": model,
        "dtype": dtype,
        "input_len": input_len,
        "output_len": output_len,
        "concurrency": concurrency,
        "num_prompts": completed,
        "ttft_ms_p50": ms("median_ttft_ms"),
        "ttft_ms_p99": ms("p99_ttft_ms"),
        "tpot_ms_p50": ms("median_tpot_ms"),
        "tpot_ms_p99": ms("p99_tpot_ms"),
        "itl_ms_p50": ms("median_itl_ms"),
        "itl_ms_p99": ms("p99_itl_ms"),
        "itl_ms_mean": ms("mean_itl_ms"),
        "itl_ms_std": ms("std_itl_ms"),
        "output_tok_s": round(float(result["output_throughput"]), 1),
        "kv_cache_tokens": kv_cache_tokens,
        "engine_start_s": round(engine_start_s, 1),
        "jit_compiles": jit_compiles,
    }
    return row


# --------------------------------------------------------------------------------------------
# results file


def load_previous(path: Path, gpu: str) -> dict[str, Any] | None:
    """``--append``: the existing document, or None; refuses one measured on another GPU."""
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    if doc.get("gpu") != gpu:
        raise SystemExit(f"--append: {path} was measured on {doc.get('gpu')}, this is {gpu}")
    return doc


def merged_doc(
    previous: Mapping[str, Any] | None,
    gpu: str,
    command: str,
    rows: Sequence[Mapping[str, Any]],
    starts: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """serving.json: this run's rows over the previous file's (same model/dtype/input/conc), and
    its ``engine_starts`` after the previous file's (every start is a measurement of its own)."""
    if previous is None:
        doc = {"gpu": gpu, "command": command, "rows": [dict(r) for r in rows]}
    else:
        merged = common.merge_rows(previous["rows"], rows, ROW_KEY)
        doc = {"gpu": gpu, "command": f"{previous['command']} ; {command}", "rows": merged}
    all_starts = [*(previous or {}).get("engine_starts", ()), *map(dict, starts)]
    if all_starts:
        doc["engine_starts"] = all_starts
    return doc


def engine_starts(
    servers: Sequence[Mapping[str, Any]], host_state: str, together: bool
) -> list[dict[str, Any]]:
    """The ``engine_starts`` of a run's servers that came up (``report.serving_starts_table``):
    time to healthy, the phases read from the server's log, KV tokens. ``host_state`` describes
    the host at the first start (``--host-state``); each later one is placed after it."""
    out = []
    for server in servers:
        if "engine_start_s" not in server:
            continue  # never healthy: its error is in the run details
        if not out:
            state = host_state or "this call's first server"
        elif together:
            state = f"started with this call's first server, {len(out) + 1} of {len(servers)}"
        else:
            state = f"this call's server {len(out) + 1}, after the ones above"
        out.append({
            "model": server["model"], "dtype": server["dtype"], "host_state": state,
            "engine_start_s": server["engine_start_s"], **server.get("startup_phases", {}),
            "kv_cache_tokens": server["kv_cache_tokens"], "max_model_len": server["max_model_len"],
        })  # fmt: skip
    return out


def plot(doc: Mapping[str, Any], png: Path) -> Path:
    """Median TPOT against concurrency: a panel per (model, input_len), a line per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    panels = sorted({(r["model"], r["input_len"]) for r in rows})
    if not panels:
        raise ValueError("no rows to plot")
    dtypes = sorted({r["dtype"] for r in rows}, key=lambda d: (DTYPE_ORDER + [d]).index(d))
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False, constrained_layout=True
    )
    for ax, (model, input_len) in zip(axes.flat, panels, strict=False):
        mine = [r for r in rows if (r["model"], r["input_len"]) == (model, input_len)]
        for dtype in dtypes:
            pts = sorted((r["concurrency"], r["tpot_ms_p50"]) for r in mine if r["dtype"] == dtype)
            if pts:
                color = f"C{(DTYPE_ORDER + [dtype]).index(dtype)}"
                ax.plot(*zip(*pts, strict=True), marker="o", label=dtype, color=color)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["concurrency"] for r in mine})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        outs = "/".join(str(o) for o in sorted({r["output_len"] for r in mine}))
        ax.set_title(f"{model}, input {input_len}, output {outs}", fontsize=9)
        ax.set_xlabel("concurrency (vllm bench serve --max-concurrency)")
        ax.set_ylabel("median TPOT (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"vllm serve + vllm bench serve, {doc.get('gpu', '?')}", fontsize=10)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def save_plot(doc: Mapping[str, Any], png: Path) -> None:
    try:
        plot(doc, png)
    except ImportError as e:  # the GPU host may lack matplotlib: --plot-only elsewhere
        print(f"serve_bench: no plot ({e}); redraw with --plot-only", flush=True)
        return
    except ValueError as e:
        print(f"serve_bench: no plot ({e})", flush=True)
        return
    common.copy_to_out(png)
    print(f"serve_bench: wrote {png}", flush=True)


# --------------------------------------------------------------------------------------------
# warm-up


def warm_up(
    base_url: str,
    model: str,
    input_len: int,
    vocab_size: int,
    prompts: int,
    seed: int,
    timeout_s: float,
) -> float:
    """``prompts`` concurrent completions of ``input_len`` random token ids (none of them a timed
    prompt, which are vLLM's arange-like random-dataset sequences), so the first timed point does
    not pay for first-use compiles at this length. Seconds taken; raises on any failure."""
    rng = np.random.default_rng(seed)
    # clear of the low and high ids where tokenizers keep their special tokens
    lo, hi = min(1000, vocab_size // 4), max(vocab_size - 1000, vocab_size // 2)
    ids = [rng.integers(lo, hi, size=input_len).tolist() for _ in range(prompts)]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, no proxy

    def one(prompt: list[int]) -> None:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": WARMUP_OUTPUT_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        req = urllib.request.Request(
            f"{base_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with opener.open(req, timeout=timeout_s) as r:
            if r.status != 200:
                raise RuntimeError(f"warm-up request answered {r.status}")
            json.loads(r.read())

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=prompts) as pool:
        for fut in [pool.submit(one, prompt) for prompt in ids]:
            fut.result(timeout=timeout_s)
    return time.monotonic() - t0


# --------------------------------------------------------------------------------------------
# the run


@dataclass
class Budget:
    seconds: float  # 0: none
    start: float = field(default_factory=time.monotonic)
    hit: bool = False

    def left(self) -> float:
        if self.seconds <= 0:
            return math.inf
        return self.seconds - (time.monotonic() - self.start)

    def cap(self, timeout_s: float) -> float:
        """A child's timeout, shortened so it ends within the budget."""
        return max(1.0, min(timeout_s, self.left()))

    def exhausted(self) -> bool:
        if self.left() <= 0:
            self.hit = True
        return self.hit

    def fits(self, seconds: float) -> bool:
        """Whether ``seconds`` of work still ends within the budget; if not, the budget counts
        as hit (a server killed while it starts would have measured nothing)."""
        if self.left() <= seconds:
            self.hit = True
        return not self.hit


@dataclass
class Run:
    """Everything one invocation measured and did; saved after every point."""

    args: argparse.Namespace
    gpu: str
    command: str
    previous: dict[str, Any] | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    servers: list[dict[str, Any]] = field(default_factory=list)
    failures: int = 0
    profiles: list[dict[str, Any]] = field(default_factory=list)  # rows of profile_path()
    # --rounds: every round's row of each point (ROW_KEY), which its row in ``rows`` sums up
    round_rows: dict[tuple, list[dict[str, Any]]] = field(default_factory=dict)
    previous_profiles: dict[str, Any] | None = None  # --append: the profile file as it was

    def longest_start_s(self) -> float:
        """The longest time to healthy of this run's servers so far (0 before the first)."""
        return max((s.get("engine_start_s", 0.0) for s in self.servers), default=0.0)

    def save(self) -> None:
        # a run that measured nothing leaves an existing file alone, --append or not
        if self.rows:
            starts = engine_starts(self.servers, self.args.host_state, self.args.start_together)
            doc = merged_doc(self.previous, self.gpu, self.command, self.rows, starts)
            common.write_json(doc, self.args.out)
        if self.profiles:
            doc = merged_doc(self.previous_profiles, self.gpu, self.command, self.profiles)
            common.write_json(doc, profile_path(self.args.out))
        details = {
            "gpu": self.gpu,
            "command": self.command,
            "out": str(self.args.out),
            "servers": self.servers,
        }
        path = Path(self.args.logdir) / "serve_bench_runs.json"  # beside the raw results
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(details, indent=1) + "\n")


def plan_points(
    input_lens: Sequence[int], concurrencies: Sequence[int], per_conc: int, min_prompts: int
) -> list[tuple[int, int, int]]:
    """(input_len, concurrency, num_prompts) of one server, in the order they run."""
    return [
        (n, c, num_prompts_for(c, per_conc, min_prompts))
        for n in input_lens
        for c in sorted(concurrencies)
    ]


def profile_dir(args: argparse.Namespace, spec: ModelSpec, dtype: str) -> Path:
    return Path(args.logdir) / "profile" / f"{spec.name}_{dtype}"


def profiler_args(trace_dir: Path) -> list[str]:
    """``vllm serve`` flags for its torch profiler: CUDA kernels and host operators, no Python
    stacks (they multiply the trace), the engine's worker only (``ignore_frontend``)."""
    config = {
        "profiler": "torch",
        "torch_profiler_dir": str(trace_dir),
        "torch_profiler_with_stack": False,
        "ignore_frontend": True,
        # its key_averages table of a long trace takes minutes; the summary does the sums
        "torch_profiler_dump_cuda_time_total": False,
    }
    return ["--profiler-config", json.dumps(config, separators=(",", ":"))]


def make_server(
    args: argparse.Namespace,
    spec: ModelSpec,
    dtype: str,
    max_len: int,
    startup_timeout_s: float,
    gpu_memory_utilization: float | None = None,
) -> Server:
    env = vllm_serve_dtype_env(dtype, not args.shim_only_where_needed)
    extra = ["--jit-monitor-verbose", *args.serve_args]
    if args.kv_cache_memory_gib:
        extra += ["--kv-cache-memory-bytes", str(int(args.kv_cache_memory_gib * 2**30))]
    if args.profile_concurrency:
        extra += profiler_args(profile_dir(args, spec, dtype))
        # vLLM's step ranges in the trace (V1 model runner); no cost when not profiling
        env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    if timing_on(args):
        env |= step_timing_env(args, env, step_timing_dir(args, spec, dtype))
    return Server(
        args.vllm,
        str(spec.path),
        dtype,
        port=args.port,
        env=env,
        max_model_len=max_len,
        gpu_memory_utilization=gpu_memory_utilization or args.gpu_memory_utilization,
        extra_args=extra,
        log_path=Path(args.logdir) / f"server_{spec.name}_{dtype}.log",
        startup_timeout_s=startup_timeout_s,
        seed=args.seed,
    )


def timing_on(args: argparse.Namespace) -> bool:
    return bool(args.step_timing or args.sync_debug)


def step_timing_dir(args: argparse.Namespace, spec: ModelSpec, dtype: str) -> Path:
    return Path(args.logdir) / "steps" / f"{spec.name}_{dtype}"


def step_timing_env(
    args: argparse.Namespace, env: Mapping[str, str], directory: Path
) -> dict[str, str]:
    """What a server needs for ``--step-timing`` (``step_timing.child_env``)."""
    return step_timing.child_env(directory, env, sync_debug=args.sync_debug)


def point_name(
    spec: ModelSpec, dtype: str, input_len: int, concurrency: int, round_: int | None = None
) -> str:
    """A point's name in logs and raw file names (``_r<round>`` where a run has rounds)."""
    name = f"{spec.name}_{dtype}_in{input_len}_c{concurrency}"
    return name if round_ is None else f"{name}_r{round_}"


def point_argv(
    args: argparse.Namespace,
    server: Server,
    spec: ModelSpec,
    dtype: str,
    input_len: int,
    concurrency: int,
    num_prompts: int,
    profiled: bool = False,
    round_: int = 0,
) -> tuple[list[str], Path]:
    """The ``vllm bench serve`` command of one point and where it saves its result (a profiled
    point: ``--profile``, its own seed and file; round r of ``--rounds``: the seeds of
    ``--seed`` + r, so no round re-sends an earlier round's prompts into the prefix cache)."""
    name = point_name(spec, dtype, input_len, concurrency, _round_tag(args, round_))
    name += "_profiled" if profiled else ""
    result = Path(args.logdir) / "raw" / f"{name}.json"
    extra = [*args.bench_args, *(["--profile"] if profiled else [])]
    argv = bench_argv(
        args.vllm,
        server.base_url,
        str(spec.path),
        input_len,
        args.output_len,
        concurrency,
        num_prompts,
        point_seed(args.seed + round_, input_len, concurrency) + (1 if profiled else 0),
        result.parent,
        result.name,
        extra,
    )
    return argv, result


@dataclass
class LiveServer:
    """One ``vllm serve`` of the run: its model and dtype, the server, and its entry in
    ``run.servers``."""

    spec: ModelSpec
    dtype: str
    server: Server
    info: dict[str, Any]

    @property
    def tag(self) -> str:
        return f"{self.spec.name}_{self.dtype}"


def run_server(
    run: Run,
    spec: ModelSpec,
    dtype: str,
    input_lens: Sequence[int],
    budget: Budget,
    vocab_size: int,
) -> None:
    """One ``vllm serve`` and all its points; appends to ``run`` and saves after each point."""
    live = new_server(run, spec, dtype, max(input_lens) + run.args.output_len, budget)
    try:
        with live.server:
            server_started(live)
            run_points(run, [live], input_lens, budget, vocab_size)
    except RuntimeError as e:
        server_failed(run, live, e)
    server_stopped(run, live)


def run_interleaved(
    run: Run, spec: ModelSpec, input_lens: Sequence[int], budget: Budget, vocab_size: int
) -> None:
    """``--interleave``: every dtype's server of one model up at once, each with its share of
    ``--gpu-memory-utilization``, and each point run on one after the other, the order rotated
    every round, so that a host that drifts between servers started minutes apart weighs on
    every dtype alike. Servers start one after another (each engine's memory profile sees the
    ones before it as used memory), or with ``--start-together`` all at once (:func:`start_together`)."""
    args = run.args
    share = args.gpu_memory_utilization / len(args.dtypes)
    max_len = max(input_lens) + args.output_len
    started: list[LiveServer] = []

    def may_start(what: str) -> bool:
        if budget.exhausted() or not budget.fits(run.longest_start_s()):
            print(f"serve_bench: {what}: not started, time budget", flush=True)
            return False
        return True

    try:
        with contextlib.ExitStack() as stack:
            if args.start_together:
                if may_start(f"{spec.name}'s servers"):
                    lives = [new_server(run, spec, d, max_len, budget, share) for d in args.dtypes]
                    started = start_together(run, lives, stack)
            else:
                for dtype in args.dtypes:
                    if not may_start(f"{spec.name}_{dtype}"):
                        break
                    live = new_server(run, spec, dtype, max_len, budget, share)
                    try:
                        stack.enter_context(live.server)
                    except RuntimeError as e:
                        server_not_started(run, live, e)
                        continue
                    server_started(live)
                    started.append(live)
            run_points(run, started, input_lens, budget, vocab_size)
    finally:
        for live in started:
            server_stopped(run, live)


# A round starts only if the time budget's rest covers this many times the round before it
ROUND_MARGIN = 1.25


def start_together(
    run: Run, lives: Sequence[LiveServer], stack: contextlib.ExitStack
) -> list[LiveServer]:
    """``--start-together``: every server of ``lives`` spawned at once, then each polled until it
    serves (its start time its own); those that came up, in ``lives``' order, each stopped when
    ``stack`` closes."""
    pending = []
    for live in lives:
        try:
            live.server.spawn()
        except RuntimeError as e:
            server_not_started(run, live, e)
            continue
        stack.push(live.server)  # its __exit__ stops it
        pending.append(live)
    up: list[LiveServer] = []
    while pending:
        for live in list(pending):
            try:
                if not live.server.healthy():
                    continue
                up.append(live)
            except RuntimeError as e:  # exited, or not healthy in time
                live.server.stop()
                server_not_started(run, live, e)
            pending.remove(live)
        if pending:
            time.sleep(2.0)
    started = [live for live in lives if live in up]
    for live in started:
        server_started(live)
    return started


def run_points(
    run: Run,
    servers: Sequence[LiveServer],
    input_lens: Sequence[int],
    budget: Budget,
    vocab_size: int,
) -> None:
    """Per input length: every server's warm-up (and profiled point, with ``--profile-first``),
    then ``--rounds`` rounds of every concurrency, each point on every server in turn (round r
    starts with the r-th server), then the profiled points. Stops when the budget is spent, and
    starts no round that the budget's rest would not cover, with :data:`ROUND_MARGIN` to spare,
    if it took as long as the one before (a round cut short pairs nothing); a server that exits
    is left out from then on."""
    args = run.args
    gone: set[str] = set()
    for input_len in input_lens:
        for live in servers:
            if live.dtype in gone:
                continue
            if not warm_server(run, live, input_len, budget, vocab_size):
                return
            if args.profile_first:
                profile_server(run, live, input_len, budget)
        points = plan_points(
            [input_len], args.concurrency, args.prompts_per_concurrency, args.min_prompts
        )
        round_s = 0.0
        for r in range(args.rounds):
            if r and not budget.fits(ROUND_MARGIN * round_s):
                print(
                    f"serve_bench: round {r + 1} of {args.rounds} not started: the one before "
                    f"took {round_s:.0f} s, {max(budget.left(), 0):.0f} s of the time budget left",
                    flush=True,
                )
                return
            round_start = time.monotonic()
            k = r % max(len(servers), 1)
            for n, c, prompts in points:
                for position, live in enumerate([*servers[k:], *servers[:k]]):
                    if budget.exhausted():
                        print("serve_bench: time budget spent: no new points", flush=True)
                        return
                    if live.dtype in gone:
                        continue
                    if not point_may_run(run, live):
                        gone.add(live.dtype)
                        continue
                    point_done(run, live, run_point(
                        run, live, n, c, prompts, budget, r, position
                    ))  # fmt: skip
            round_s = time.monotonic() - round_start
        if not args.profile_first:
            for live in servers:
                profile_server(run, live, input_len, budget)


def new_server(
    run: Run,
    spec: ModelSpec,
    dtype: str,
    max_len: int,
    budget: Budget,
    gpu_memory_utilization: float | None = None,
) -> LiveServer:
    """A server not yet started, and its entry in ``run.servers``."""
    args = run.args
    server = make_server(
        args, spec, dtype, max_len, budget.cap(args.startup_timeout_s), gpu_memory_utilization
    )
    info: dict[str, Any] = {
        "model": spec.name,
        "model_path": str(spec.path),
        "dtype": dtype,
        "server_command": shlex.join(server.argv),
        "shim": server.env.get(common.SHIM_ENV) == "1",
        "server_log": str(server.log_path),
        "max_model_len": max_len,
        "points": [],
    }
    if gpu_memory_utilization is not None:
        info["servers_at_once"] = len(args.dtypes)
    run.servers.append(info)
    live = LiveServer(spec, dtype, server, info)
    print(f"serve_bench: {live.tag}: starting {shlex.join(server.argv)}", flush=True)
    return live


def server_started(live: LiveServer) -> None:
    server, info = live.server, live.info
    log = server.tail(10**9)
    info |= {
        "engine_start_s": round(server.start_s, 1),
        "kv_cache_tokens": kv_cache_tokens_from_log(log),
        "startup_phases": startup_phases_from_log(log),
    }
    print(
        f"serve_bench: {live.tag}: healthy after {server.start_s:.0f}s, "
        f"KV cache {info['kv_cache_tokens']} tokens {info['startup_phases']}",
        flush=True,
    )


def server_failed(run: Run, live: LiveServer, e: Exception) -> None:
    live.info["error"] = str(e)[-1500:]
    run.failures += 1
    cause = engine_error_from_log(live.server.tail(10**9))
    if cause:
        live.info["engine_error"] = cause
    print(f"serve_bench: {live.tag}: {cause or str(e)[-600:]}", file=sys.stderr, flush=True)


def server_not_started(run: Run, live: LiveServer, e: Exception) -> None:
    """A server that did not come up: :func:`server_failed`, then :func:`server_stopped`."""
    server_failed(run, live, e)
    server_stopped(run, live)


def server_stopped(run: Run, live: LiveServer) -> None:
    live.info["shim_log"] = shim_lines(live.server.tail(10**9))
    live.info["server_log_tail"] = live.server.tail(1500)
    run.save()


def warm_server(
    run: Run, live: LiveServer, input_len: int, budget: Budget, vocab_size: int
) -> bool:
    """``--warmup-prompts`` requests at ``input_len``; False when the budget is spent (a failed
    warm-up is reported and the points still run, only less warm)."""
    args = run.args
    if args.warmup_prompts <= 0:
        return True
    if budget.exhausted():
        return False
    try:
        secs = warm_up(
            live.server.base_url,
            str(live.spec.path),
            input_len,
            vocab_size,
            args.warmup_prompts,
            point_seed(args.seed, input_len, 0) + 7,
            budget.cap(args.point_timeout_s),
        )
        live.info.setdefault("warmup_s", {})[str(input_len)] = round(secs, 1)
        print(f"serve_bench: {live.tag}: warm-up at {input_len} took {secs:.1f}s", flush=True)
    except Exception as e:
        live.info.setdefault("warmup_error", {})[str(input_len)] = repr(e)[-500:]
        print(f"serve_bench: {live.tag}: warm-up at {input_len} failed: {e!r}", flush=True)
    return True


def point_may_run(run: Run, live: LiveServer) -> bool:
    """Whether a timed point may start on ``live``: False (noted) once its server has exited."""
    if not live.server.alive():
        live.info["error"] = "vllm serve exited during the points"
        run.failures += 1
        return False
    return True


def point_done(run: Run, live: LiveServer, point: dict[str, Any]) -> None:
    live.info["points"].append(point)
    if "error" in point:
        run.failures += 1
    run.save()


def profiled(args: argparse.Namespace, dtype: str) -> bool:
    """Whether ``dtype``'s server gets a profiled point (``--profile-concurrency``,
    ``--profile-dtypes``)."""
    return bool(args.profile_concurrency) and dtype in (args.profile_dtypes or args.dtypes)


def profile_server(run: Run, live: LiveServer, input_len: int, budget: Budget) -> None:
    """The profiled point of ``--profile-concurrency`` at ``input_len``, if asked and possible."""
    if profiled(run.args, live.dtype) and not budget.exhausted() and live.server.alive():
        profile = run_profiled_point(run, live, input_len, budget)
        live.info.setdefault("profiles", []).append(profile)
        if "error" in profile:
            run.failures += 1
        run.save()


def profile_path(out: Path) -> Path:
    """Where the profiled points' summaries go: ``serving_profile.json`` beside ``serving.json``."""
    return out.with_name(f"{out.stem}_profile.json")


def wait_for_traces(trace_dir: Path, before: set[Path], timeout_s: float) -> list[Path]:
    """The trace files the profiler wrote after ``before`` was taken, once their sizes stop
    changing (the engine writes them after ``/stop_profile`` returns)."""
    deadline = time.monotonic() + timeout_s
    sizes: dict[Path, int] = {}
    stable = 0
    while time.monotonic() < deadline:
        new = sorted(set(trace_dir.glob("*.json*")) - before) if trace_dir.is_dir() else []
        now = {path: path.stat().st_size for path in new}
        stable = stable + 1 if now and now == sizes else 0
        if stable >= 2:
            return new
        sizes = now
        time.sleep(2.0)
    return sorted(sizes)


def between_scrapes(
    base_url: str, name: str, requests: int, body: Callable[[], T]
) -> tuple[T, dict[str, Any] | None, str | None]:
    """``body()`` between two scrapes of ``base_url/metrics`` (a ``vllm serve``): what it
    returned, the figures of the requests in between (``server_metrics.point_figures``; None when
    a scrape failed or found none of vLLM's metrics) and why there are none. The scrape after is
    repeated until the server has counted ``requests`` finished requests, for at most
    ``METRICS_SETTLE_S``. A failed scrape costs one warning, never the point."""
    error = None
    try:
        before = server_metrics.scrape(base_url)
    except Exception as e:  # extra evidence: the point runs without it
        before, error = None, f"/metrics before the point: {e!r}"[:500]
    result = body()
    figures = None
    if before is not None:
        deadline = time.monotonic() + METRICS_SETTLE_S
        try:
            while True:
                figures = server_metrics.point_figures(before, server_metrics.scrape(base_url))
                if figures.get("requests", 0) >= requests or time.monotonic() >= deadline:
                    break
                time.sleep(0.2)
        except Exception as e:
            figures, error = None, f"/metrics after the point: {e!r}"[:500]
        if figures is not None and "requests" not in figures:
            figures, error = None, "/metrics has none of vLLM's request metrics"
    if error:
        print(f"serve_bench: {name}: WARNING: no server metrics ({error})", flush=True)
    return result, figures, error


def run_bench(
    args: argparse.Namespace, argv: Sequence[str], name: str, budget: Budget
) -> tuple[int, float, str]:
    """One ``vllm bench serve`` child, its log under ``--logdir``/bench: (rc, seconds, tail)."""
    env = dict(os.environ)
    env.pop(common.SHIM_ENV, None)  # the client is plain vLLM
    log = Path(args.logdir) / "bench" / f"{name}.log"
    return common.run_child(list(argv), env, budget.cap(args.point_timeout_s), log)


def bench_with_cpu(
    args: argparse.Namespace, argv: Sequence[str], name: str, budget: Budget, server_pid: int
) -> tuple[tuple[int, float, str], tuple[Any, ...]]:
    """:func:`run_bench` between two reads of the CPU time of the server's processes and of
    this process's waited-for children, the client among them (``benchmarks/process_cpu.py``),
    taken right around the command, so the ``/metrics`` scrapes around it are outside: (rc,
    seconds, tail) and (the server's snapshots before and after, the children's CPU seconds
    before and after)."""
    before, client_before = process_cpu.snapshot(server_pid), process_cpu.waited_children_cpu_s()
    done = run_bench(args, argv, name, budget)
    after, client_after = process_cpu.snapshot(server_pid), process_cpu.waited_children_cpu_s()
    return done, (before, after, client_before, client_after)


def profiled_prompts(args: argparse.Namespace) -> int:
    """Prompts of the profiled point: ``--profile-prompts``, else as many as a timed point."""
    c = args.profile_concurrency
    return args.profile_prompts or num_prompts_for(
        c, args.prompts_per_concurrency, args.min_prompts
    )


def run_profiled_point(
    run: Run, live: LiveServer, input_len: int, budget: Budget
) -> dict[str, Any]:
    """One more point at ``--profile-concurrency`` under the server's torch profiler (not a
    row: the profiler slows what it records), its traces summarised by
    ``benchmarks/profile_summary.py`` into ``PROFILE_DIR.summary.json``."""
    args = run.args
    server, spec, dtype = live.server, live.spec, live.dtype
    c, prompts = args.profile_concurrency, profiled_prompts(args)
    trace_dir = profile_dir(args, spec, dtype)
    before = set(trace_dir.glob("*.json*")) if trace_dir.is_dir() else set()
    argv, _ = point_argv(args, server, spec, dtype, input_len, c, prompts, profiled=True)
    name = point_name(spec, dtype, input_len, c) + "_profiled"
    (rc, secs, tail), figures, metrics_error = between_scrapes(
        server.base_url, name, prompts, lambda: run_bench(args, argv, name, budget)
    )
    profile: dict[str, Any] = {
        "input_len": input_len,
        "concurrency": c,
        "num_prompts": prompts,
        "command": shlex.join(argv),
        "rc": rc,
        "wall_s": round(secs, 1),
    }
    if metrics_error:
        profile["server_metrics_error"] = metrics_error
    if rc != 0:
        profile["error"] = "timeout" if rc == -9 else common.error_summary(tail)
        return profile
    traces = wait_for_traces(trace_dir, before, budget.cap(PROFILE_WRITE_TIMEOUT_S))
    if not traces:
        profile["error"] = f"no trace written under {trace_dir}"
        return profile
    for attempt in range(3):
        try:
            summary = profile_summary.summarize_files(traces)
            break
        except (EOFError, OSError, ValueError) as e:  # a trace still being written
            if attempt == 2:
                profile["error"] = f"trace unreadable: {e!r}"[:500]
                return profile
            time.sleep(10.0)
    path = trace_dir.parent / f"{name}.summary.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    profile |= {"traces": [str(t) for t in traces], "summary": str(path)}
    # the engine worker's trace (the one with the GPU kernels) becomes a row of the profile file
    worker = max(summary.values(), key=lambda doc: doc["kernels"])
    keep = dict(worker)
    if figures:
        keep["server_metrics"] = figures
    run.profiles = common.merge_rows(
        run.profiles,
        [{"model": spec.name, "dtype": dtype, "input_len": input_len, "concurrency": c,
          "num_prompts": prompts, **keep}],
        ROW_KEY,
    )  # fmt: skip
    if not args.keep_traces:
        for t in traces:
            t.unlink()
    for doc in summary.values():
        print(
            f"serve_bench: {name}: GPU kernels {doc['kernel_us_by_category']} us, busy "
            f"{doc['gpu_busy_fraction']} of {doc['gpu_span_us'] / 1e6:.2f} s, {doc['steps']} steps",
            flush=True,
        )
    return profile


def run_point(
    run: Run,
    live: LiveServer,
    input_len: int,
    concurrency: int,
    num_prompts: int,
    budget: Budget,
    round_: int = 0,
    position: int = 0,
) -> dict[str, Any]:
    """One timed point (round ``round_`` of ``--rounds``, the ``position``-th server of its
    round's order); its row goes into ``run.rows`` (over its rounds: :func:`rounds_row`)."""
    args = run.args
    server, info, spec, dtype = live.server, live.info, live.spec, live.dtype
    name = point_name(spec, dtype, input_len, concurrency, _round_tag(args, round_))
    argv, result_path = point_argv(
        args, server, spec, dtype, input_len, concurrency, num_prompts, round_=round_
    )
    result_path.unlink(missing_ok=True)
    seed = point_seed(args.seed + round_, input_len, concurrency)
    log_before = len(server.tail(10**9))
    timing_dir = step_timing_dir(args, spec, dtype) if timing_on(args) else None
    if timing_dir is not None:
        steps_before = step_timing.settled_snapshots(timing_dir)
    pid = server.proc.pid if server.proc is not None else 0
    ((rc, secs, tail), cpu), figures, metrics_error = between_scrapes(
        server.base_url, name, num_prompts, lambda: bench_with_cpu(args, argv, name, budget, pid)
    )
    steps = None
    if timing_dir is not None:
        steps = step_timing.difference(steps_before, step_timing.settled_snapshots(timing_dir))
    compiles = jit_compiles_from_log(server.tail(10**9)[log_before:])
    point: dict[str, Any] = {
        "input_len": input_len,
        "concurrency": concurrency,
        "num_prompts": num_prompts,
        "seed": seed,
        "command": shlex.join(argv),
        "rc": rc,
        "wall_s": round(secs, 1),
        "result": str(result_path),
        "jit_compiles": compiles,
    }
    if args.rounds > 1:
        point |= {"round": round_, "position": position}
    if metrics_error:
        point["server_metrics_error"] = metrics_error
    msg = f"serve_bench: {name}: rc={rc} in {secs:.0f}s"
    if compiles:
        msg += f" ({len(compiles)} Triton compiles during the point: {', '.join(compiles)})"
    if rc != 0 or not result_path.exists():
        point["error"] = "timeout" if rc == -9 else common.error_summary(tail)
        print(f"{msg}: {point['error']}", flush=True)
        return point
    try:
        result = json.loads(result_path.read_text())
        row = result_to_row(
            result,
            model=spec.name,
            dtype=dtype,
            input_len=input_len,
            output_len=args.output_len,
            concurrency=concurrency,
            kv_cache_tokens=info.get("kv_cache_tokens"),
            engine_start_s=float(info.get("engine_start_s", 0.0)),
            jit_compiles=len(compiles),
        )
    except (ValueError, KeyError, TypeError) as e:
        point["error"] = f"{type(e).__name__}: {e}"
        print(f"{msg}: {point['error']}", flush=True)
        return point
    point |= {"mean_input_tokens": result["total_input_tokens"] / max(result["completed"], 1)}
    if figures:
        row["server_metrics"] = figures
        msg += (
            f" (server means: queue {figures.get('queue_ms_mean')} ms, prefill "
            f"{figures.get('prefill_ms_mean')} ms, TTFT {figures.get('ttft_ms_mean_server')} ms,"
            f" {figures.get('preemptions')} preemptions)"
        )
    if steps is not None:
        row["step_timing"] = steps
        msg += f" (host per engine step: {step_timing_line(steps)})"
    run_s = result.get("duration")  # vLLM's: first request sent to last answer
    run_s = run_s if isinstance(run_s, int | float) else None
    server_before, server_after, client_before, client_after = cpu
    busy = process_cpu.point_cpu(server_before, server_after, secs, run_s)
    if busy and (client := process_cpu.client_cpu(client_before, client_after, secs, run_s)):
        busy[process_cpu.CLIENT_ROLE] = client
    if busy:
        row["process_cpu"] = busy
        msg += f" (CPU busy over the command/requests: {process_cpu.busy_line(busy)})"
    if "servers_at_once" in info:
        row["servers_at_once"] = info["servers_at_once"]
    if args.rounds > 1:
        row |= {"round": round_, "position": position}
    per_round = run.round_rows.setdefault(tuple(row[k] for k in ROW_KEY), [])
    per_round.append(row)
    run.rows = common.merge_rows(run.rows, [rounds_row(per_round)], ROW_KEY)
    print(
        f"{msg}: TTFT p50 {row['ttft_ms_p50']} ms, TPOT p50 {row['tpot_ms_p50']} ms, "
        f"{row['output_tok_s']} tok/s",
        flush=True,
    )
    return point


# what differs from round to round of a point: kept per round, the figures (a row's measured
# ones, from TTFT to output tok/s) also as their median
ROUND_FIGURES = tuple(ROW_KEYS[ROW_KEYS.index("ttft_ms_p50") : ROW_KEYS.index("output_tok_s") + 1])
ROUND_FIELDS = (*ROUND_FIGURES, "jit_compiles", "server_metrics", "step_timing", "process_cpu",
                "round", "position")  # fmt: skip


def _round_tag(args: argparse.Namespace, round_: int) -> int | None:
    return round_ if args.rounds > 1 else None


def rounds_row(per_round: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The row of a point measured in rounds (rows with ``round``): each of
    :data:`ROUND_FIGURES` the median over the rounds, ``jit_compiles`` their sum, and ``rounds``,
    each round's own figures, server metrics, step timing, process CPU and ``position`` (0: its
    server ran the point first in that round). A row without ``round`` is the point's only one,
    as it is."""
    last = per_round[-1]
    if "round" not in last:
        return dict(last)
    row = {k: v for k, v in last.items() if k not in ROUND_FIELDS}
    for key in ROUND_FIGURES:
        row[key] = round(statistics.median(r[key] for r in per_round), 3)
    row["jit_compiles"] = sum(r["jit_compiles"] for r in per_round)
    row["rounds"] = [{k: r[k] for k in ROUND_FIELDS if k in r} for r in per_round]
    return row


def step_timing_line(steps: Mapping[str, Any]) -> str:
    """The phases' ms per engine step, and the synchronizing calls counted, in one line."""
    parts = [
        f"{phase} {p['ms_per_step']} ms"
        for phase, p in steps["phases"].items()
        if p.get("ms_per_step") is not None
    ]
    line = f"{steps['engine_steps']} steps, " + ", ".join(parts)
    if steps.get("sync_debug"):
        syncs = steps.get("syncs", {})
        line += f"; {sum(syncs.values())} synchronizing CUDA calls at {len(syncs)} lines"
    return line


# --------------------------------------------------------------------------------------------
# main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve_bench", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--models", default=f"smollm2,gemma3,{LLAMA_SHAPE}")
    p.add_argument("--dtypes", default=",".join(DTYPE_ORDER), help="row labels (common.CONFIGS)")
    p.add_argument("--input-lens", default="8K,32K", help="e.g. 8K,32K or 7936")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--prompts-per-concurrency", type=int, default=4)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--warmup-prompts", type=int, default=2, help="per input length; 0: none")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--llama-layers", type=int, default=2, help=f"layers of {LLAMA_SHAPE}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--time-budget-s", type=float, default=540, help="0: none")
    p.add_argument("--startup-timeout-s", type=float, default=420)
    p.add_argument("--point-timeout-s", type=float, default=300)
    p.add_argument(
        "--vllm",
        default=shlex.join([sys.executable, "-m", "vllm.entrypoints.cli.main"]),
        help="the vllm command (for serve and bench serve)",
    )
    p.add_argument(
        "--profile-concurrency",
        type=int,
        default=0,
        help="after the timed points of each input length, one more point at this concurrency "
        "under the server's torch profiler, summarised (benchmarks/profile_summary.py); 0: none",
    )
    p.add_argument("--profile-prompts", type=int, default=0, help="default: as a timed point")
    p.add_argument(
        "--profile-dtypes",
        default="",
        help="profile only these dtypes' servers (every server still runs with the profiler "
        "configured, so that they stay alike); default: all",
    )
    p.add_argument(
        "--profile-first",
        action="store_true",
        help="run the profiled point right after the warm-up, before the timed points (where "
        "the time budget could cut it off)",
    )
    p.add_argument(
        "--step-timing",
        action="store_true",
        help="time the engine's per-step host work by phase (benchmarks/step_timing.py) and add "
        "each point's to its row",
    )
    p.add_argument(
        "--sync-debug",
        action="store_true",
        help="--step-timing, and count the engine's synchronizing CUDA calls by Python line",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every point this many times (new prompts each round); a row holds each "
        "round's figures and their median",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="start every dtype's server of a model at once (each with its share of "
        "--gpu-memory-utilization) and run each point on one after the other, the order "
        "rotated every round",
    )
    p.add_argument(
        "--kv-cache-memory-gib",
        type=float,
        default=0.0,
        help="every server's KV cache, in GiB (vLLM's --kv-cache-memory-bytes: the same memory "
        "for every dtype, and no memory profile sizing it); 0: vLLM sizes it from "
        "--gpu-memory-utilization",
    )
    p.add_argument(
        "--start-together",
        action="store_true",
        help="with --interleave and --kv-cache-memory-gib: start every server at once instead "
        "of one after another (vLLM's memory profile assumes no other process changes its "
        "memory meanwhile, so only with the cache's size given)",
    )
    p.add_argument(
        "--host-state",
        default="",
        help="the host at this call's first server start, for the result's engine_starts (e.g. "
        '"freshly staged, after a FlashAttention-2 pre-compile")',
    )
    p.add_argument("--keep-traces", action="store_true", help="keep the raw profiler traces")
    p.add_argument("--serve-args", default="", help='more `vllm serve` flags, e.g. "--x=1 --y"')
    p.add_argument("--bench-args", default="", help="more `vllm bench serve` flags")
    p.add_argument(
        "--shim-only-where-needed",
        action="store_true",
        help="upstream rows without INT8KV_SHIM=1 (as the offline benchmarks run them)",
    )
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--append", action="store_true", help="merge into an existing --out")
    p.add_argument("--workdir", default=str(DEFAULT_WORKDIR), help="the random model lives here")
    p.add_argument("--logdir", default=None, help="default: $OUT/serve_bench or WORKDIR/runs")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--plot-only", action="store_true", help="redraw the plot from --out")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    given = sys.argv[1:] if argv is None else list(argv)
    args.command = shlex.join(["python", "-m", "benchmarks.serve_bench", *given])
    try:
        args.dtypes = common.parse_list(args.dtypes)
        args.input_lens = [parse_len(t) for t in common.parse_list(args.input_lens)]
        args.concurrency = parse_ints(args.concurrency)
        args.profile_dtypes = common.parse_list(args.profile_dtypes)
        if not set(args.profile_dtypes) <= set(args.dtypes):
            raise ValueError("--profile-dtypes must be among --dtypes")
        if not args.dtypes or not args.input_lens:
            raise ValueError("need at least one dtype and one input length")
        if min(args.output_len, args.prompts_per_concurrency, args.min_prompts) < 1:
            raise ValueError("--output-len, --prompts-per-concurrency, --min-prompts must be >= 1")
        if args.warmup_prompts < 0 or not 1 <= args.llama_layers <= 32:
            raise ValueError("--warmup-prompts >= 0 and 1 <= --llama-layers <= 32")
        if args.rounds < 1:
            raise ValueError("--rounds must be >= 1")
        if args.interleave and (len(args.dtypes) < 2 or args.port):
            raise ValueError("--interleave runs two or more dtypes' servers at once, each on "
                             "a free port: give two dtypes or more and no --port")  # fmt: skip
        if args.kv_cache_memory_gib < 0:
            raise ValueError("--kv-cache-memory-gib must be >= 0")
        if args.start_together and not (args.interleave and args.kv_cache_memory_gib):
            raise ValueError("--start-together needs --interleave and --kv-cache-memory-gib: "
                             "vLLM sizes a cache from a memory profile that other servers "
                             "starting at the same time would distort")  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    args.vllm = shlex.split(args.vllm)
    args.serve_args = shlex.split(args.serve_args)
    args.bench_args = shlex.split(args.bench_args)
    if args.logdir is None:
        out = os.environ.get("OUT")
        args.logdir = str(Path(out) / "serve_bench" if out else Path(args.workdir) / "runs")
    args.out = Path(args.out)
    return args


def dry_run(args: argparse.Namespace, specs: Sequence[ModelSpec]) -> int:
    for spec in specs:
        context = model_context(spec, dry_run=True)
        lens = effective_input_lens(args.input_lens, args.output_len, context)
        if spec.build_llama:
            print(f"# make {LLAMA_SHAPE} ({args.llama_layers} layers) in {spec.path}")
        share = args.gpu_memory_utilization / len(args.dtypes) if args.interleave else None
        if args.interleave:
            print(f"# the servers below up at once; each point on each in turn, {args.rounds} "
                  "round(s), the order rotated every round")  # fmt: skip
        for dtype in args.dtypes:
            server = make_server(args, spec, dtype, max(lens) + args.output_len, 0, share)
            shim = f"{common.SHIM_ENV}=1 " if server.env.get(common.SHIM_ENV) == "1" else ""
            print(f"{shim}{shlex.join(server.argv)}")
            for n, c, prompts in plan_points(
                lens, args.concurrency, args.prompts_per_concurrency, args.min_prompts
            ):
                if c == min(args.concurrency) and args.warmup_prompts:
                    print(f"# warm-up: {args.warmup_prompts} requests of {n} random token ids")
                for r in range(args.rounds):
                    argv = point_argv(args, server, spec, dtype, n, c, prompts, round_=r)[0]
                    print(shlex.join(argv))
            if profiled(args, dtype):
                c, prompts = args.profile_concurrency, profiled_prompts(args)
                for n in lens:
                    argv = point_argv(args, server, spec, dtype, n, c, prompts, profiled=True)[0]
                    print(f"# profiled: {shlex.join(argv)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        save_plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return 0
    try:
        specs = model_specs(args.models, Path(args.workdir), os.environ, args.dry_run)
    except ValueError as e:
        print(f"serve_bench: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(args, specs)
    if args.port and not port_is_free(args.port):
        print(f"serve_bench: port {args.port} on 127.0.0.1 is taken", file=sys.stderr)
        return 2
    gpu = common.gpu_name()
    previous = load_previous(args.out, gpu) if args.append else None
    run = Run(args, gpu, args.command, previous)
    if args.append:
        run.previous_profiles = load_previous(profile_path(args.out), gpu)
    budget = Budget(args.time_budget_s)
    # SIGTERM (a device call's timeout) must still take the server down: exit through finally
    old_handler = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for spec in specs:
            if budget.exhausted():
                break
            try:
                prepare_model(spec, args)
                context = model_context(spec)
                lens = effective_input_lens(args.input_lens, args.output_len, context)
                vocab = int(read_config(spec.path)["vocab_size"])
            except Exception as e:  # this model is skipped, the others still run
                print(f"serve_bench: {spec.name}: {e!r}", file=sys.stderr, flush=True)
                run.servers.append({"model": spec.name, "error": str(e)})
                run.failures += 1
                continue
            if args.interleave:
                run_interleaved(run, spec, lens, budget, vocab)
                continue
            for dtype in args.dtypes:
                if budget.exhausted():
                    break
                if not budget.fits(run.longest_start_s()):
                    print(
                        f"serve_bench: {spec.name}_{dtype}: not started, {budget.left():.0f} s "
                        f"of the time budget left and a start so far took up to "
                        f"{run.longest_start_s():.0f} s",
                        flush=True,
                    )
                    break
                run_server(run, spec, dtype, lens, budget, vocab)
    finally:
        _stop_live_servers()
        run.save()
        signal.signal(signal.SIGTERM, old_handler)
    if run.rows:
        print(f"serve_bench: wrote {args.out} ({len(run.rows)} rows this run)", flush=True)
    if not args.no_plot:
        save_plot(merged_doc(previous, gpu, run.command, run.rows), args.out.with_suffix(".png"))
    if budget.hit:
        print("serve_bench: TIME BUDGET HIT: some points were not run", flush=True)
    return 1 if run.failures or budget.hit else 0


def prepare_model(spec: ModelSpec, args: argparse.Namespace) -> None:
    """Make the random Llama on first use (from SmolLM2's tokenizer and vocabulary)."""
    if not spec.build_llama:
        return
    tok = os.environ.get(MODEL_ENV["smollm2"])
    if not tok:
        raise ValueError(f"{LLAMA_SHAPE} takes SmolLM2's tokenizer: ${MODEL_ENV['smollm2']} unset")
    t0 = time.monotonic()
    make_random_llama(spec.path, Path(tok), args.llama_layers, seed=args.seed)
    print(f"serve_bench: {LLAMA_SHAPE} ready in {spec.path} ({time.monotonic() - t0:.0f}s)")


if __name__ == "__main__":
    sys.exit(main())
