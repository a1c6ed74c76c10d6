"""Where a ``vllm serve`` engine's steps spend their host time, at full host speed.

The torch profiler slows the host about twofold, and a gap that lives on the host (or in the
host's waits for the GPU) can vanish under it. This times the engine's per-step methods with
``time.perf_counter`` instead: wrapt post-import hooks wrap, in whichever process imports them
(the engine core holds the scheduler and, at TP=1, the model runner), the methods of
:data:`SITES` and sum each one's calls and wall time (for the model runner's ``execute_model``
also by the kind of step, :func:`step_kind`, and so for the engine step around it and for each
layer's attention and cache update, ours and FlashAttention-2's, which run on the host in eager
steps, and for the parts of an attention call: FlashAttention-2's varlen call, our kernels'
launches, ``int4``'s write), and dates each new request as the API server hands it to the engine
core and the engine core's input thread and then its scheduler take it (:data:`REQUEST_AGE`),
and in the API server its tokenising of each prompt and its processing of the engine's outputs.
A daemon thread writes each process's running sums to
``$SERVE_BENCH_STEP_TIMING_DIR/steps_<pid>.json`` twice a second (only once a site has been
called), so ``serve_bench.py --step-timing`` takes the difference across each timed point,
summed over the processes.

With ``SERVE_BENCH_SYNC_DEBUG=1`` it also turns on ``torch.cuda.set_sync_debug_mode("warn")`` after
the first :data:`WARMUP_STEPS` engine steps and counts every synchronizing CUDA call by the Python
line that made it (the first call's stack kept): a host read of a device value on the step's path
stops asynchronous scheduling from overlapping the host's work with the GPU's.

Loaded by ``benchmarks/step_timing_site/sitecustomize.py`` in every Python process of such a
server (and of ``throughput.py --step-timing``'s engines, whose engine core is forked: a forked
child starts its own writer and sums); does nothing without ``SERVE_BENCH_STEP_TIMING_DIR``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

STEP_TIMING_DIR = "SERVE_BENCH_STEP_TIMING_DIR"
SYNC_DEBUG = "SERVE_BENCH_SYNC_DEBUG"
# the folder whose sitecustomize installs the timer; it and the repository lead a child's path
# (the repository found here, not through benchmarks.common: this module loads in every
# process of a timed engine, and common imports numpy)
SITE = Path(__file__).resolve().parent / "step_timing_site"
REPO = Path(__file__).resolve().parents[1]

ENGINE_STEP = "engine_step"
RENDER = "render"
# (module, class, method, phase): the V1 engine core's step (with or without the batch queue of
# asynchronous scheduling), the scheduler, and both model runners' per-step methods
SITES: tuple[tuple[str, str | None, str, str], ...] = (
    ("vllm.v1.engine.core", "EngineCore", "step", ENGINE_STEP),
    ("vllm.v1.engine.core", "EngineCore", "step_with_batch_queue", ENGINE_STEP),
    # a new request in the engine core: its preparation in the input thread (block hashes), and
    # its hand-over to the scheduler between two steps (each also dated, REQUEST_AGE)
    ("vllm.v1.engine.core", "EngineCore", "preprocess_add_request", "preprocess_add_request"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "add_request", "add_request"),
    # in the API server: its turning of each batch of engine outputs into the requests' outputs
    # (detokenizing, per-request queues), on the event loop that also takes new requests
    ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs", "process_outputs"),
    # in the API server, before the engine core: a request's rendering, which stamps its arrival
    # and then tokenises its prompt (so a call's time is the request's age once tokenised), and
    # its sending to the engine core (dated, REQUEST_AGE)
    ("vllm.renderers.base", "BaseRenderer", "render_cmpl_async", RENDER),
    ("vllm.renderers.base", "BaseRenderer", "render_chat_async", RENDER),
    ("vllm.v1.engine.core_client", "AsyncMPClient", "add_request_async", "send_request"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "update_from_output"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", "execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens", "sample_tokens"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states", "update_states"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_may_reorder_batch", "reorder_batch"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs", "prepare_inputs"),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        "_build_attention_metadata",
        "build_attention_metadata",
    ),
    ("vllm.v1.worker.gpu_model_runner", "AsyncGPUModelRunnerOutput", "get_output", "get_output"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model", "execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens", "sample_tokens"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_inputs", "prepare_inputs"),
    (
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner",
        "prepare_attn",
        "build_attention_metadata",
    ),
    # each layer's attention and cache update on the host (eager steps only: a CUDA graph
    # replays them without a call), ours and FlashAttention-2's
    ("int8kv_shim.attention_impl", "Int8KVAttentionImpl", "forward", "attention_forward"),
    ("int8kv_shim.attention_impl", "Int8KVAttentionImpl", "do_kv_cache_update", "kv_cache_update"),
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl", "forward", "attention_forward"),
    (
        "vllm.v1.attention.backends.flash_attn",
        "FlashAttentionImpl",
        "do_kv_cache_update",
        "kv_cache_update",
    ),
    # inside a layer's attention: FlashAttention-2's varlen call (a module function, class None:
    # the name vLLM's backend and our prefill path both import), our kernels' launches, and int4's
    # page and tail write, so that an attention call's host time splits into what it runs
    ("vllm.vllm_flash_attn", None, "flash_attn_varlen_func", "fa2_call"),
    ("int8kv_shim.attention_impl", "Int8KVAttentionImpl", "_paged", "attention_ours"),
    ("int8kv_shim.attention_impl", "Int8KVAttentionImpl", "_write_with_tail", "int4_write"),
)
# Phases also summed by the kind of step they ran, as ``<phase>.<kind>`` (see :func:`step_kind`):
# a step that carries a prompt chunk runs eagerly, outside CUDA graphs, and its host work is not
# a decode step's.
BY_STEP_KIND = frozenset({"execute_model"})
# Phases called inside execute_model (once a layer), summed by the kind of the step that runs them
PER_LAYER = frozenset({"attention_forward", "kv_cache_update"})
# Per-layer phases that run inside attention_forward (its parts, not more time beside it)
ATTENTION_PARTS = frozenset({"fa2_call", "attention_ours", "int4_write"})
# Phases whose call also dates the request it is handed, as ``<name>``: its age, the seconds since
# the API server stamped its arrival (before tokenising it; one host, one clock). Sent by the API
# server, reaching the engine core's input thread, then vLLM's scheduler, which stamps it queued:
# of TTFT, the part before the engine core's queue, where the server's metrics see none of it.
REQUEST_AGE = {
    "send_request": "request_age_at_handover",
    "preprocess_add_request": "request_age_at_engine_core",
    "add_request": "request_age_at_scheduler",
}
# A request's age at each point it passes before the engine core's queue, in that order: RENDER's
# own time (arrival to tokenised), then each REQUEST_AGE
REQUEST_MILESTONES = (RENDER, *REQUEST_AGE.values())
# V2's model runner marks no step in a torch profiler trace (V1's "gpu_model_runner: forward"
# range, with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1): this range around its execute_model lets
# benchmarks/profile_summary.py sum a profiled point by kind of step
STEP_RANGE = "step_timing: execute_model"
STEP_RANGE_SITES = frozenset(
    {("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model")}
)
DECODE_STEP, PROMPT_STEP = "decode", "prompt"
WARMUP_STEPS = 64  # engine steps before sync debugging starts (start-up's own syncs are deliberate)
DUMP_EVERY_S = 0.5
SYNC_MESSAGE = "called a synchronizing CUDA operation"


class StepTimer:
    """Calls and seconds per phase, and synchronizing CUDA calls by the line that made them."""

    def __init__(self, sync_debug: bool = False, warmup_steps: int = WARMUP_STEPS) -> None:
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.syncs: dict[str, int] = {}
        self.sync_stacks: dict[str, list[str]] = {}
        self.sync_debug = sync_debug
        self.warmup_steps = warmup_steps
        self._sync_debug_on = False
        self._lock = threading.Lock()
        self.step_kind: str | None = None  # of the execute_model running now, for PER_LAYER
        self.last_step_kind: str | None = None  # of the last one in this engine step

    def timed(
        self, phase: str, step_range: bool = False, asynchronous: bool = False
    ) -> Callable[..., Any]:
        """A wrapt wrapper that adds each call's wall time to ``phase`` (and, for a phase of
        :data:`BY_STEP_KIND`, :data:`PER_LAYER` or :data:`ATTENTION_PARTS`, to
        ``<phase>.<kind>`` too, the kind of the step it runs in; for the engine step, the kind
        of the model step it ran); with
        ``step_range``, each call is also a :data:`STEP_RANGE` range for a torch profiler (a few
        µs a call when none records). ``asynchronous``: the method is a coroutine function, timed
        until its coroutine returns (an API server method; no step kind, no range)."""
        if asynchronous:
            return self._timed_coroutine(phase)
        by_kind = phase in BY_STEP_KIND
        per_layer = phase in PER_LAYER | ATTENTION_PARTS
        engine_step = phase == ENGINE_STEP
        age = REQUEST_AGE.get(phase)
        scope: Callable[[str], Any] = contextlib.nullcontext
        if step_range:
            from torch.profiler import record_function

            scope = record_function

        def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
            kind = self.step_kind if per_layer else None
            if by_kind:
                kind = step_kind(kwargs["scheduler_output"] if "scheduler_output" in kwargs
                                 else args[0] if args else None)  # fmt: skip
                self.step_kind = self.last_step_kind = kind
            elif engine_step:
                self.last_step_kind = None
            if age is not None:
                self.add_age(age, _handed_request(args, kwargs))
            start = time.perf_counter()
            try:
                with scope(STEP_RANGE):
                    return wrapped(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                if by_kind:
                    self.step_kind = None
                elif engine_step:  # the kind of the model step it ran, if it ran one
                    kind = self.last_step_kind
                self.add(phase, seconds)
                if kind is not None:
                    self.add(f"{phase}.{kind}", seconds)

        return wrapper

    def _timed_coroutine(self, phase: str) -> Callable[..., Any]:
        age = REQUEST_AGE.get(phase)

        async def wrapper(
            wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
        ) -> Any:
            if age is not None:
                self.add_age(age, _handed_request(args, kwargs))
            start = time.perf_counter()
            try:
                return await wrapped(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - start)

        return wrapper

    def add_age(self, name: str, request: Any) -> None:
        """Add the seconds since ``request``'s arrival to ``name`` (nothing without a float
        ``arrival_time``)."""
        arrival = getattr(request, "arrival_time", None)
        if isinstance(arrival, float):
            self.add(name, time.time() - arrival)

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.calls[phase] = self.calls.get(phase, 0) + 1
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
            steps = self.calls.get(ENGINE_STEP, 0)
        if self.sync_debug and not self._sync_debug_on and steps >= self.warmup_steps:
            self._turn_on_sync_debug()

    def _turn_on_sync_debug(self) -> None:
        self._sync_debug_on = True
        import torch

        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")
        shown = warnings.showwarning

        def count_syncs(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
            if SYNC_MESSAGE not in str(message):
                return shown(message, category, filename, lineno, file, line)
            where = f"{filename}:{lineno}"
            # the stack only once a line: formatting it costs more than many a step's work
            stack = None if where in self.sync_stacks else traceback.format_stack(limit=12)[:-1]
            self.sync(where, stack)
            return None

        warnings.showwarning = count_syncs
        torch.cuda.set_sync_debug_mode("warn")

    def sync(self, where: str, stack: list[str] | None) -> None:
        with self._lock:
            self.syncs[where] = self.syncs.get(where, 0) + 1
            if stack is not None:
                self.sync_stacks.setdefault(where, [s.strip() for s in stack])

    def restart_in_child(self) -> None:
        """In a process forked from a timed one: its own sums from zero (not its parent's), and
        a fresh lock (another thread of the parent may have held it at the fork)."""
        self._lock = threading.Lock()
        self.calls, self.seconds, self.syncs, self.sync_stacks = {}, {}, {}, {}
        self.step_kind = self.last_step_kind = None

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "time": time.time(),
                "pid": os.getpid(),
                "calls": dict(self.calls),
                "seconds": dict(self.seconds),
                "sync_debug": self._sync_debug_on,
                "syncs": dict(self.syncs),
                "sync_stacks": {k: list(v) for k, v in self.sync_stacks.items()},
            }


def _handed_request(args: tuple, kwargs: dict) -> Any:
    """The request a :data:`REQUEST_AGE` site's method is handed: its ``request`` argument, by
    name or first by position."""
    return kwargs["request"] if "request" in kwargs else args[0]


def step_kind(scheduler_output: Any) -> str | None:
    """:data:`DECODE_STEP` when every request a step schedules brings one token,
    :data:`PROMPT_STEP` when one brings more (a prompt chunk; also a speculative-decode
    verification, which these benchmarks do not run); None for an empty step or an argument
    that is not vLLM's ``SchedulerOutput``."""
    tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    per_request = getattr(scheduler_output, "num_scheduled_tokens", None)
    if not isinstance(tokens, int) or not isinstance(per_request, Mapping) or tokens <= 0:
        return None
    return DECODE_STEP if tokens <= len(per_request) else PROMPT_STEP


def write_snapshot(timer: StepTimer, directory: Path) -> Path | None:
    """The running sums into ``steps_<pid>.json`` (atomically); nothing before a first call."""
    snap = timer.snapshot()
    if not snap["calls"]:
        return None
    path = directory / f"steps_{snap['pid']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(snap))
    tmp.replace(path)
    return path


def install(timer: StepTimer, directory: Path, dump_every_s: float = DUMP_EVERY_S) -> None:
    """Wrap every site of :data:`SITES` when (or if already) its module is imported, and start
    the thread that writes the sums."""
    import wrapt

    directory.mkdir(parents=True, exist_ok=True)

    by_module: dict[str, list[tuple[str | None, str, str]]] = {}
    for module_name, cls_name, method, phase in SITES:
        by_module.setdefault(module_name, []).append((cls_name, method, phase))

    def hook(module_name: str, sites: list[tuple[str | None, str, str]]) -> Callable[[Any], None]:
        def apply(module: Any) -> None:
            for cls_name, method, phase in sites:
                if cls_name is None:  # a module function, wrapped where the module holds it
                    if callable(getattr(module, method, None)):
                        wrapt.wrap_function_wrapper(module, method, timer.timed(phase))
                    continue
                cls = getattr(module, cls_name, None)
                if cls is not None and method in vars(cls):
                    ranged = (module_name, cls_name, method) in STEP_RANGE_SITES
                    asynchronous = inspect.iscoroutinefunction(vars(cls)[method])
                    wrapper = timer.timed(phase, ranged, asynchronous)
                    wrapt.wrap_function_wrapper(cls, method, wrapper)

        return apply

    for module_name, sites in by_module.items():
        wrapt.register_post_import_hook(hook(module_name, sites), module_name)

    def dump_forever() -> None:
        written = None
        while True:
            time.sleep(dump_every_s)
            calls = dict(timer.calls)
            if calls == written:  # an idle engine: the file already holds these sums
                continue
            try:
                write_snapshot(timer, directory)
                written = calls
            except OSError:
                pass

    def start_writer() -> None:
        threading.Thread(target=dump_forever, name="step-timing", daemon=True).start()

    def in_forked_child() -> None:
        # An offline LLM's engine core is forked (vLLM's default start method outside its CLI):
        # a fork keeps the wrapped methods but not the writer thread, and copies the sums.
        timer.restart_in_child()
        start_writer()

    start_writer()
    os.register_at_fork(after_in_child=in_forked_child)


def install_from_env(environ: Mapping[str, str] | None = None) -> StepTimer | None:
    env = os.environ if environ is None else environ
    directory = env.get(STEP_TIMING_DIR)
    if not directory:
        return None
    timer = StepTimer(sync_debug=env.get(SYNC_DEBUG, "") == "1")
    install(timer, Path(directory))
    return timer


def child_env(directory: Path, env: Mapping[str, str], sync_debug: bool = False) -> dict[str, str]:
    """What a process that starts an engine (a server, an ``LLM``) needs for step timing: our
    ``sitecustomize`` and the repository ahead of its PYTHONPATH, and where its processes write
    their sums (emptied: a file of an earlier engine there would count as this one's)."""
    shutil.rmtree(directory, ignore_errors=True)
    path = [str(SITE), str(REPO), env.get("PYTHONPATH", "")]
    out = {"PYTHONPATH": os.pathsep.join(p for p in path if p), STEP_TIMING_DIR: str(directory)}
    if sync_debug:
        out[SYNC_DEBUG] = "1"
    return out


# seconds for every process's timer to write its latest sums (each writes every DUMP_EVERY_S)
SETTLE_S = 3 * DUMP_EVERY_S


def settled_snapshots(directory: Path) -> list[dict[str, Any]]:
    """``read_snapshots`` once every process has written its latest sums (``SETTLE_S`` later):
    what a benchmark reads just before and just after what it times."""
    time.sleep(SETTLE_S)
    return read_snapshots(directory)


def read_snapshots(directory: Path) -> list[dict[str, Any]]:
    """Every process's latest sums (those that ran a step)."""
    out = []
    for path in sorted(directory.glob("steps_*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def difference(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase over an interval (``after`` less ``before``, summed over processes): calls, mean
    µs a call and ms per engine step; and the synchronizing calls made in it, by line."""
    calls: dict[str, int] = {}
    seconds: dict[str, float] = {}
    syncs: dict[str, int] = {}
    stacks: dict[str, list[str]] = {}
    sync_debug = False
    old = {s["pid"]: s for s in before}
    for snap in after:
        prev = old.get(snap["pid"], {})
        sync_debug |= bool(snap.get("sync_debug"))
        for phase, n in snap["calls"].items():
            d = n - prev.get("calls", {}).get(phase, 0)
            if d:
                calls[phase] = calls.get(phase, 0) + d
                seconds[phase] = (
                    seconds.get(phase, 0.0)
                    + snap["seconds"][phase]
                    - prev.get("seconds", {}).get(phase, 0.0)
                )
        for where, n in snap.get("syncs", {}).items():
            d = n - prev.get("syncs", {}).get(where, 0)
            if d:
                syncs[where] = syncs.get(where, 0) + d
                stacks[where] = snap["sync_stacks"].get(where, [])
    steps = calls.get(ENGINE_STEP, 0)
    phases = {
        phase: {
            "calls": n,
            "us_per_call": round(seconds[phase] / n * 1e6, 1),
            "ms_per_step": round(seconds[phase] / steps * 1e3, 3) if steps else None,
        }
        for phase, n in sorted(calls.items())
    }
    out: dict[str, Any] = {"engine_steps": steps, "phases": phases, "sync_debug": sync_debug}
    if sync_debug:
        out["syncs"] = dict(sorted(syncs.items(), key=lambda kv: -kv[1]))
        out["sync_stacks"] = stacks
    return out
