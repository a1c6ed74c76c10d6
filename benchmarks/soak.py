"""Serving soak: ``vllm serve`` with a quantized KV cache under sustained mixed load.

One run:

1. starts ``vllm serve MODEL --kv-cache-dtype DTYPE`` on 127.0.0.1 at a free port (own process
   group, log file, killed on exit, timeout or Ctrl-C; ``INT8KV_SHIM=1`` only for our dtypes) and
   waits for ``/health`` — or, with ``--base-url``, uses a server that is already running;
2. sends ``--probes`` greedy probe prompts (temperature 0, ``--probe-tokens`` tokens, one at a time,
   non-streaming) and keeps their texts;
3. the load: ``--requests`` requests with ``--concurrency`` in flight (asyncio + aiohttp), prompts
   cut from the repository's corpus by character slices, short to about 2K tokens (capped so that
   prompt + output fit ``--max-model-len``), a quarter of them continuing one of a few long shared
   prefixes (prefix-cache hits), half streamed, some streams cancelled by closing the connection
   after a few chunks, greedy and sampled (temperature, top_p, seed), various ``max_tokens``;
4. the probes again, which must return the same texts.

A request is an error when the server answers with a non-200 status (the load only sends valid
requests, so a 4xx counts too), the connection fails (other than our own cancellations), the
request times out, the server process dies, or the answer is malformed: the body is not JSON, has
no ``choices[0].text`` string, a ``finish_reason`` other than ``stop``/``length``, or
``usage.completion_tokens`` above ``max_tokens``; a stream whose ``data:`` chunks do not parse,
carry an ``error`` object, or do not end with ``data: [DONE]``. Cancelled streams are not errors.

Writes ``--out`` (benchmarks/results/soak.json): ``requests``, ``errors``, ``probe_identical``,
``duration_s``, ``dtype`` plus details (``completed``, ``cancelled``, ``max_in_flight``,
``error_kinds``, ``error_examples``, ...). Exit status 1 when there were errors, the probes
differ or ``--time-limit`` stopped the load early; 2 for bad arguments.

Probe prompts are sent one at a time, so their batch is the same before and after the load, and
each pass uses its own ``cache_salt``: both passes then miss the prefix cache and compute exactly
the same thing, whatever the load left in the cache.

GPU host: ``bash benchmarks/run_gpu_e2e.sh soak [args]``; against a running server:
``python -m benchmarks.soak --base-url http://127.0.0.1:8000``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks import common

FINISH_REASONS = frozenset({"stop", "length"})
# English prose runs at about 4-4.5 characters per BPE token (SmolLM2: ~4.3 on the corpus); budgeting
# 3 keeps every prompt inside max_model_len, so a 400 "prompt too long" never happens by design.
CHARS_PER_TOKEN_LOW = 3
# about 2K tokens of prose: the longest prompt the load sends when max_model_len allows it
DEFAULT_MAX_PROMPT_CHARS = 8000
MAX_TOKENS_CHOICES = (1, 8, 16, 32, 64, 128, 256)
NUM_SHARED_PREFIXES = 4
ERROR_EXAMPLES = 10
PR_SET_PDEATHSIG = 1  # linux/prctl.h


# --------------------------------------------------------------------------------------------
# workload (pure, deterministic)


@dataclass(frozen=True)
class RequestSpec:
    """One request of the load."""

    index: int
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    stream: bool
    cancel_after: int | None = None  # streamed chunks to read before closing the connection
    shared_prefix: int | None = None  # which long shared prefix the prompt starts with
    seed: int | None = None

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
        }
        if self.stream:
            # the final chunk then carries usage, so streams get the max_tokens check too
            body["stream_options"] = {"include_usage": True}
        if self.seed is not None:
            body["seed"] = self.seed
        return body


def prompt_char_budget(max_model_len: int, max_tokens: int, max_prompt_chars: int) -> int:
    """Longest prompt (characters) that surely fits ``max_model_len`` with ``max_tokens`` output."""
    room = max_model_len - max_tokens - 8  # a few tokens of slack for specials / BPE merges
    if room < 16:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for {max_tokens} tokens")
    return min(max_prompt_chars, room * CHARS_PER_TOKEN_LOW)


def output_cap(max_model_len: int) -> int:
    """Largest ``max_tokens`` the load uses: at most half the model length."""
    return max(1, min(max(MAX_TOKENS_CHOICES), max_model_len // 2))


def _slice(text: str, rng: random.Random, length: int) -> str:
    start = rng.randrange(0, len(text) - length)
    return text[start : start + length]


def build_workload(
    text: str,
    n: int,
    *,
    max_model_len: int,
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
    seed: int = 0,
) -> list[RequestSpec]:
    """``n`` deterministic requests cut from ``text`` (see the module docstring for the mix)."""
    rng = random.Random(seed)
    cap = output_cap(max_model_len)
    budget = prompt_char_budget(max_model_len, cap, max_prompt_chars)
    if len(text) < 2 * budget:
        raise ValueError("corpus too short for the prompt budget")
    prefix_len = budget * 3 // 4
    prefixes = [_slice(text, rng, prefix_len) for _ in range(NUM_SHARED_PREFIXES)]
    specs = []
    for i in range(n):
        shared = rng.random() < 0.25
        if shared:
            which = rng.randrange(NUM_SHARED_PREFIXES)
            prompt = prefixes[which] + _slice(text, rng, rng.randint(20, budget - prefix_len))
        else:
            which = None
            # log-uniform from a sentence to the budget: as many short prompts as long ones
            length = int(math.exp(rng.uniform(math.log(20), math.log(budget))))
            prompt = _slice(text, rng, length)
        greedy = rng.random() < 0.4
        stream = rng.random() < 0.5
        max_tokens = min(cap, rng.choice(MAX_TOKENS_CHOICES))
        cancel = stream and max_tokens >= 8 and rng.random() < 0.3
        specs.append(
            RequestSpec(
                index=i,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0.0 if greedy else round(rng.uniform(0.3, 1.2), 2),
                top_p=1.0 if greedy or rng.random() < 0.5 else 0.9,
                stream=stream,
                cancel_after=rng.randint(1, 4) if cancel else None,
                shared_prefix=which,
                seed=None if greedy or rng.random() < 0.5 else rng.randrange(1 << 30),
            )
        )
    return specs


def build_probes(text: str, n: int, budget_chars: int) -> list[str]:
    """``n`` probe prompts from fixed places of the corpus, 200 characters up to the budget."""
    lengths = [int(200 * (budget_chars / 200) ** (i / max(n - 1, 1))) for i in range(n)]
    return [text[(i * 7919 * 13) % (len(text) - ln) :][:ln] for i, ln in enumerate(lengths)]


# --------------------------------------------------------------------------------------------
# checking answers (pure)


@dataclass
class Outcome:
    """What became of one request: ``ok``, ``cancelled`` or ``error`` (with a kind)."""

    status: str
    kind: str = ""
    detail: str = ""
    text: str = ""
    completion_tokens: int | None = None
    seconds: float = 0.0


def _error(kind: str, detail: str) -> Outcome:
    return Outcome("error", kind, detail[:300])


def check_choice_fields(
    doc: Any, max_tokens: int, need_finish: bool = True
) -> tuple[str, int | None] | Outcome:
    """(text, completion_tokens) of a non-streamed body, or the malformed Outcome."""
    if not isinstance(doc, dict):
        return _error("malformed", f"body is not a JSON object: {str(doc)[:100]}")
    if "error" in doc and "choices" not in doc:
        return _error("server_error_body", json.dumps(doc["error"])[:300])
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return _error("malformed", f"no choices[0]: {json.dumps(doc)[:200]}")
    text = choices[0].get("text")
    if not isinstance(text, str):
        return _error("malformed", f"choices[0].text is {type(text).__name__}")
    if need_finish and choices[0].get("finish_reason") not in FINISH_REASONS:
        return _error("malformed", f"finish_reason {choices[0].get('finish_reason')!r}")
    usage = doc.get("usage")
    tokens = None
    if usage is not None:
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            return _error("malformed", f"usage.completion_tokens is {tokens!r}")
        if tokens > max_tokens:
            return _error("malformed", f"completion_tokens {tokens} > max_tokens {max_tokens}")
    elif need_finish:
        return _error("malformed", "no usage")
    return text, tokens


def check_completion(body: str, max_tokens: int) -> Outcome:
    """Outcome of a non-streamed 200 answer."""
    try:
        doc = json.loads(body)
    except ValueError as e:
        return _error("malformed", f"body is not JSON ({e}): {body[:100]!r}")
    got = check_choice_fields(doc, max_tokens)
    if isinstance(got, Outcome):
        return got
    return Outcome("ok", text=got[0], completion_tokens=got[1])


@dataclass
class StreamChecker:
    """Feed an SSE stream line by line; ``chunks`` counts the parsed ``data:`` JSON chunks."""

    max_tokens: int
    chunks: int = 0
    done: bool = False
    finish_reason: str | None = None
    completion_tokens: int | None = None
    texts: list[str] = field(default_factory=list)
    problem: Outcome | None = None

    def feed(self, raw: bytes | str) -> None:
        """One line of the stream; sets ``problem`` on the first malformed thing."""
        if self.problem is not None:
            return
        line = (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw).strip()
        if not line or line.startswith(":"):  # event separator / SSE comment
            return
        if not line.startswith("data:"):
            self.problem = _error("malformed", f"not an SSE data line: {line[:100]!r}")
            return
        payload = line[len("data:") :].strip()
        if self.done:
            self.problem = _error("malformed", f"data after [DONE]: {payload[:100]!r}")
            return
        if payload == "[DONE]":
            self.done = True
            return
        try:
            doc = json.loads(payload)
        except ValueError:
            self.problem = _error("malformed", f"chunk is not JSON: {payload[:100]!r}")
            return
        if not isinstance(doc, dict):
            self.problem = _error("malformed", f"chunk is not an object: {payload[:100]!r}")
            return
        if "error" in doc:  # vLLM reports a failure inside a started stream this way
            self.problem = _error("stream_error", json.dumps(doc["error"])[:300])
            return
        self.chunks += 1
        choices = doc.get("choices")
        if choices == [] and isinstance(doc.get("usage"), dict):  # the include_usage chunk
            got = check_choice_fields(
                {"choices": [{"text": ""}], "usage": doc["usage"]}, self.max_tokens, False
            )
            if isinstance(got, Outcome):
                self.problem = got
            else:
                self.completion_tokens = got[1]
            return
        got = check_choice_fields({"choices": choices}, self.max_tokens, need_finish=False)
        if isinstance(got, Outcome):
            self.problem = got
            return
        self.texts.append(got[0])
        reason = choices[0].get("finish_reason")
        if reason is not None:
            if reason not in FINISH_REASONS:
                self.problem = _error("malformed", f"finish_reason {reason!r}")
            self.finish_reason = reason

    def outcome(self) -> Outcome:
        """Outcome of a stream read to its end."""
        if self.problem is not None:
            return self.problem
        if not self.done:
            return _error("malformed", f"stream ended without data: [DONE] ({self.chunks} chunks)")
        if self.finish_reason is None:
            return _error("malformed", "no chunk carried a finish_reason")
        return Outcome("ok", text="".join(self.texts), completion_tokens=self.completion_tokens)


# --------------------------------------------------------------------------------------------
# client


async def send(
    session: aiohttp.ClientSession, base_url: str, model: str, spec: RequestSpec, timeout_s: float
) -> Outcome:
    """Send one request and check its answer; never raises (except for task cancellation)."""
    t0 = time.monotonic()
    try:
        out = await asyncio.wait_for(_send(session, base_url, model, spec), timeout_s)
    except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
        out = _error("timeout", f"no complete answer within {timeout_s:.0f}s")
    except (aiohttp.ClientError, OSError) as e:  # refused, reset, disconnected, bad framing
        out = _error("connection", f"{type(e).__name__}: {e}")
    except ValueError as e:  # aiohttp's "Chunk too big" on an absurd SSE line
        out = _error("malformed", f"{type(e).__name__}: {e}")
    out.seconds = time.monotonic() - t0
    return out


async def _send(
    session: aiohttp.ClientSession, base_url: str, model: str, spec: RequestSpec
) -> Outcome:
    async with session.post(f"{base_url}/v1/completions", json=spec.body(model)) as resp:
        if resp.status != 200:
            body = await resp.text(errors="replace")
            kind = "http_5xx" if resp.status >= 500 else f"http_{resp.status}"
            return _error(kind, f"HTTP {resp.status}: {body[:200]}")
        if not spec.stream:
            return check_completion(await resp.text(errors="replace"), spec.max_tokens)
        checker = StreamChecker(spec.max_tokens)
        async for line in resp.content:
            checker.feed(line)
            if checker.problem is not None:
                return checker.problem
            if spec.cancel_after is not None and checker.chunks >= spec.cancel_after:
                if checker.done:  # the stream had already ended: it completed
                    break
                # Drop the connection mid-stream, as a client that goes away does: the server
                # must abort the request and carry on.
                resp.close()
                return Outcome("cancelled", text="".join(checker.texts))
        return checker.outcome()


@dataclass
class LoadReport:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    max_in_flight: int = 0
    time_limit_hit: bool = False
    server_died: bool = False
    seconds: float = 0.0
    completion_tokens: int = 0
    error_kinds: Counter[str] = field(default_factory=Counter)
    error_examples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, spec: RequestSpec | None, out: Outcome) -> None:
        if out.status == "ok":
            self.completed += 1
            self.completion_tokens += out.completion_tokens or 0
        elif out.status == "cancelled":
            self.cancelled += 1
        else:
            self.errors += 1
            self.error_kinds[out.kind] += 1
            if len(self.error_examples) < ERROR_EXAMPLES:
                ex: dict[str, Any] = {"kind": out.kind, "detail": out.detail}
                if spec is not None:
                    ex |= {"request": spec.index, "stream": spec.stream}
                    ex |= {"max_tokens": spec.max_tokens, "prompt_chars": len(spec.prompt)}
                self.error_examples.append(ex)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="soak", unit="req", mininterval=2.0)


async def run_load(
    base_url: str,
    model: str,
    specs: Sequence[RequestSpec],
    *,
    concurrency: int,
    time_limit_s: float,
    request_timeout_s: float,
    server_alive: Callable[[], bool] | None = None,
    progress: bool = True,
) -> LoadReport:
    """Send ``specs`` with ``concurrency`` workers until done, the time limit, or server death."""
    report = LoadReport()
    queue: asyncio.Queue[RequestSpec] = asyncio.Queue()
    for s in specs:
        queue.put_nowait(s)
    t0 = time.monotonic()
    deadline = t0 + time_limit_s
    stop = asyncio.Event()
    in_flight = 0
    bar = _progress(len(specs), progress)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal in_flight
        while not stop.is_set() and not queue.empty():
            if time.monotonic() >= deadline:
                report.time_limit_hit = True
                return
            spec = queue.get_nowait()
            report.requests += 1
            in_flight += 1
            report.max_in_flight = max(report.max_in_flight, in_flight)
            try:
                out = await send(session, base_url, model, spec, request_timeout_s)
            finally:
                in_flight -= 1
            report.add(spec, out)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(err=report.errors, cancel=report.cancelled, refresh=False)

    async def watch_server() -> None:
        while not stop.is_set():
            if not server_alive():
                report.server_died = True
                report.add(None, _error("server_died", "the vLLM server process exited"))
                stop.set()
                return
            await asyncio.sleep(1.0)

    # limit=0: the connector must not cap concurrency below --concurrency (its default is 100)
    connector = aiohttp.TCPConnector(limit=0)
    # no aiohttp timeout (its default is 5 min in total): --request-timeout governs
    unbounded = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=unbounded) as session:
        watcher = asyncio.create_task(watch_server()) if server_alive else None
        workers = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        # Requests still running past the limit get request_timeout_s to finish, then are dropped.
        done, pending = await asyncio.wait(workers, timeout=time_limit_s + request_timeout_s)
        for task in pending:
            task.cancel()
            report.time_limit_hit = True
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:  # a bug in the client, not a server error
                raise task.exception()  # type: ignore[misc]
        stop.set()
        if watcher is not None:
            await watcher
    if bar is not None:
        bar.close()
    report.seconds = time.monotonic() - t0
    return report


async def run_probes(
    base_url: str, model: str, prompts: Sequence[str], max_tokens: int, timeout_s: float
) -> list[str | None]:
    """Greedy texts of the probe prompts, one request at a time (None where a probe failed).

    A fresh ``cache_salt`` per pass keeps the prefix cache out of it (see the module docstring).
    """
    salt = f"soak-probe-{uuid.uuid4().hex}"
    texts: list[str | None] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        for i, prompt in enumerate(prompts):
            spec = RequestSpec(i, prompt, max_tokens, 0.0, 1.0, stream=False)
            body = spec.body(model) | {"cache_salt": salt}
            try:
                ok, raw = await asyncio.wait_for(_post_text(session, base_url, body), timeout_s)
            except (asyncio.TimeoutError, aiohttp.ClientError, OSError):
                ok, raw = False, ""
            out = check_completion(raw, max_tokens) if ok else None
            texts.append(out.text if out is not None and out.status == "ok" else None)
    return texts


async def _post_text(
    session: aiohttp.ClientSession, base_url: str, body: dict[str, Any]
) -> tuple[bool, str]:
    async with session.post(f"{base_url}/v1/completions", json=body) as resp:
        return resp.status == 200, await resp.text(errors="replace")


async def served_model(base_url: str, timeout_s: float = 30) -> str:
    """The first model id the server lists (what requests must name)."""

    async def get() -> str:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base_url}/v1/models") as resp:
                resp.raise_for_status()
                return str((await resp.json())["data"][0]["id"])

    return await asyncio.wait_for(get(), timeout_s)


@dataclass
class ClientResult:
    load: LoadReport
    probes_before: list[str | None]
    probes_after: list[str | None]
    model: str
    seconds: float

    @property
    def probe_identical(self) -> bool:
        return None not in self.probes_before and self.probes_before == self.probes_after


async def soak_client(
    base_url: str,
    specs: Sequence[RequestSpec],
    probes: Sequence[str],
    *,
    probe_tokens: int,
    concurrency: int,
    time_limit_s: float,
    request_timeout_s: float,
    server_alive: Callable[[], bool] | None = None,
    progress: bool = True,
) -> ClientResult:
    """Probes, load, probes: everything after the server is up."""
    t0 = time.monotonic()
    model = await served_model(base_url)
    before = await run_probes(base_url, model, probes, probe_tokens, request_timeout_s)
    print(f"soak: probes before the load: {sum(t is not None for t in before)}/{len(before)} ok")
    load = await run_load(
        base_url,
        model,
        specs,
        concurrency=concurrency,
        time_limit_s=time_limit_s,
        request_timeout_s=request_timeout_s,
        server_alive=server_alive,
        progress=progress,
    )
    after = await run_probes(base_url, model, probes, probe_tokens, request_timeout_s)
    return ClientResult(load, before, after, model, time.monotonic() - t0)


def result_doc(res: ClientResult, dtype: str, extra: dict[str, Any]) -> dict[str, Any]:
    """soak.json: the five headline keys first (requests, errors, probe_identical, duration_s,
    dtype), then the details."""
    load = res.load
    differing = [
        i
        for i, (a, b) in enumerate(zip(res.probes_before, res.probes_after, strict=True))
        if a is None or a != b
    ]
    return {
        "requests": load.requests,
        "errors": load.errors,
        "probe_identical": res.probe_identical,
        "duration_s": round(res.seconds, 1),
        "dtype": dtype,
        "completed": load.completed,
        "cancelled": load.cancelled,
        "max_in_flight": load.max_in_flight,
        "load_s": round(load.seconds, 1),
        "completion_tokens": load.completion_tokens,
        "time_limit_hit": load.time_limit_hit,
        "server_died": load.server_died,
        "error_kinds": dict(load.error_kinds),
        "error_examples": load.error_examples,
        "probes": len(res.probes_before),
        "probe_differences": [
            {"probe": i, "before": res.probes_before[i], "after": res.probes_after[i]}
            for i in differing
        ],
        "served_model": res.model,
        **extra,
    }


def verdict(doc: dict[str, Any]) -> int:
    """Exit status of a soak document."""
    return 0 if doc["errors"] == 0 and doc["probe_identical"] and not doc["time_limit_hit"] else 1


# --------------------------------------------------------------------------------------------
# server launcher


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dtype_args(dtype: str) -> list[str]:
    """``vllm serve`` arguments of a row label (benchmarks/common.CONFIGS)."""
    cfg = common.config_for(dtype)
    args = ["--kv-cache-dtype", cfg["kv_cache_dtype"]]
    if "attention_backend" in cfg:
        args += ["--attention-backend", cfg["attention_backend"]]
    if "attention_config" in cfg:
        args += ["--attention-config", json.dumps(cfg["attention_config"])]
    return args


def _die_with_parent() -> None:
    """In the server's process: get SIGTERM when the soak process dies, even by SIGKILL.

    The server runs in its own session (so stop() can kill its whole group), which also means a
    timeout that kills only our group would leave it holding the GPU; this closes that gap on Linux.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class VllmServer:
    """``vllm serve`` in its own process group; a context manager that always kills it."""

    def __init__(
        self,
        model: str,
        dtype: str,
        *,
        max_model_len: int,
        gpu_memory_utilization: float,
        extra_args: Sequence[str],
        log_path: Path,
        startup_timeout_s: float,
        seed: int = 0,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.env = common.child_env(dtype)
        self.argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *dtype_args(dtype),
            "--max-model-len",
            str(max_model_len),
            "--gpu-memory-utilization",
            str(gpu_memory_utilization),
            "--seed",
            str(seed),
            *extra_args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s = 0.0
        self._spawned_at = 0.0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> VllmServer:
        self.spawn()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def spawn(self) -> None:
        """Start the process (from the thread that will outlive it: its death signal follows the
        thread that spawned it); :meth:`healthy` then says when it serves."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # own session: stop() can kill the API server, engine core and workers as one group
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self._spawned_at = time.monotonic()

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now (``start_s`` set the first time); a RuntimeError
        once the process has exited or ``startup_timeout_s`` has passed since :meth:`spawn`."""
        if not self.alive():
            raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as r:
                if r.status == 200:
                    self.start_s = self.start_s or time.monotonic() - self._spawned_at
                    return True
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - self._spawned_at > self.startup_timeout_s:
            raise RuntimeError(f"vllm serve not healthy after {self.startup_timeout_s:.0f}s")
        return False

    def _wait_healthy(self) -> None:
        while not self.healthy():
            time.sleep(2.0)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # SIGTERM first so vLLM shuts its engine core down and frees the GPU; then SIGKILL.
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
                return

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


# --------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    # everything after `--` goes to `vllm serve` untouched
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("SMOLLM2_DIR"), help="model for vllm serve")
    p.add_argument("--model-name", default="SmolLM2-135M-Instruct", help="name for the JSON")
    p.add_argument("--dtype", default="int8", help="row label of benchmarks/common.CONFIGS")
    p.add_argument("--base-url", help="use this running server instead of starting one")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--time-limit", type=float, default=900, help="seconds of load at most")
    p.add_argument("--request-timeout", type=float, default=300, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds for /health")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-prompt-chars", type=int, default=DEFAULT_MAX_PROMPT_CHARS)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--probes", type=int, default=8)
    p.add_argument("--probe-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", default=str(common.DEFAULT_CORPUS))
    p.add_argument("--out", default=str(common.RESULTS_DIR / "soak.json"))
    p.add_argument("--log", default=None, help="server log (default $OUT/logs or a temp dir)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.vllm_args = extra
    if args.requests < 1 or args.concurrency < 1:
        p.error("--requests and --concurrency must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = Path(args.corpus).read_text(encoding="utf-8")
    specs = build_workload(
        text,
        args.requests,
        max_model_len=args.max_model_len,
        max_prompt_chars=args.max_prompt_chars,
        seed=args.seed,
    )
    budget = prompt_char_budget(args.max_model_len, args.probe_tokens, args.max_prompt_chars)
    probes = build_probes(text, args.probes, budget)
    streamed = sum(s.stream for s in specs)
    print(
        f"soak: {len(specs)} requests, {args.concurrency} in flight, {streamed} streamed "
        f"({sum(s.cancel_after is not None for s in specs)} to cancel), "
        f"{sum(s.shared_prefix is not None for s in specs)} on shared prefixes, "
        f"{sum(s.temperature == 0 for s in specs)} greedy, prompts up to "
        f"{max(len(s.prompt) for s in specs)} chars",
        flush=True,
    )
    extra: dict[str, Any] = {
        "model": args.model_name,
        "gpu": common.gpu_name(),
        "command": common.command_line(),
        "concurrency": args.concurrency,
        "streamed": streamed,
        "shared_prefix_requests": sum(s.shared_prefix is not None for s in specs),
        "max_prompt_chars": max(len(s.prompt) for s in specs),
        "max_model_len": args.max_model_len,
    }
    run = dict(
        specs=specs,
        probes=probes,
        probe_tokens=args.probe_tokens,
        concurrency=args.concurrency,
        time_limit_s=args.time_limit,
        request_timeout_s=args.request_timeout,
        progress=not args.no_progress,
    )
    if args.base_url:
        res = asyncio.run(soak_client(args.base_url.rstrip("/"), **run))
        extra["server"] = args.base_url
    else:
        if not args.model:
            print("soak: no model (--model or $SMOLLM2_DIR), or pass --base-url", file=sys.stderr)
            return 2
        logdir = Path(os.environ["OUT"]) / "logs" if os.environ.get("OUT") else Path("/tmp")
        log = Path(args.log) if args.log else logdir / f"soak_server_{args.dtype}.log"
        server = VllmServer(
            args.model,
            args.dtype,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            extra_args=args.vllm_args,
            log_path=log,
            startup_timeout_s=args.startup_timeout,
            seed=args.seed,
        )
        extra |= {"server_command": " ".join(server.argv[1:]), "server_log": str(log)}
        # SIGTERM (e.g. the device tool's timeout) must still take the server down with us.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        print(f"soak: starting {' '.join(server.argv[2:])} (log {log})", flush=True)
        try:
            with server:
                print(f"soak: server healthy after {server.start_s:.0f}s", flush=True)
                extra["server_start_s"] = round(server.start_s, 1)
                res = asyncio.run(soak_client(server.base_url, server_alive=server.alive, **run))
                if not server.alive() and not res.load.server_died:  # died during the probes
                    res.load.server_died = True
                    res.load.add(None, _error("server_died", "the vLLM server process exited"))
        except RuntimeError as e:
            print(f"soak: {e}", file=sys.stderr)
            doc = {
                "requests": 0,
                "errors": 1,
                "probe_identical": False,
                "duration_s": 0.0,
                "dtype": args.dtype,
                "time_limit_hit": False,
                "error_kinds": {"server_start": 1},
                "error_examples": [{"kind": "server_start", "detail": str(e)[-1500:]}],
                **extra,
            }
            common.write_json(doc, args.out)
            return 1
    doc = result_doc(res, args.dtype, extra)
    for path in common.write_json(doc, args.out):
        print(f"soak: wrote {path}")
    print(
        f"soak: {doc['requests']} requests in {doc['load_s']}s: {doc['completed']} completed, "
        f"{doc['cancelled']} cancelled, {doc['errors']} errors {doc['error_kinds']}; "
        f"max in flight {doc['max_in_flight']}; probes identical: {doc['probe_identical']}"
        + ("; TIME LIMIT HIT" if doc["time_limit_hit"] else "")
    )
    return verdict(doc)


if __name__ == "__main__":
    sys.exit(main())
