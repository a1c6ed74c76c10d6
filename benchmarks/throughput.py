"""Generation throughput of vLLM on a fixed KV budget, BF16 vs quantized KV caches.

For each configuration (own process, own engine, CUDA graphs + torch.compile ON as vLLM ships them)
and each context length: ``LLM.generate`` on random-token prompts (seeded) with ``--output-len``
output tokens each (``ignore_eos``), enough prompts to fill the KV cache ``--fill`` times over as
vLLM sized it. ``gen_tok_s`` = output tokens / wall time of that ``generate`` call (prefill
included, as in vLLM's own throughput benchmark); an untimed warm-up ``generate`` on a few prompts
of the same length comes first so lazy kernel compilation/autotuning is not timed.
``--repeats N`` times N such generates per context on fresh prompts and reports the median run;
host-bound rows (1K context on the H200 host) move by over 1.5x between runs, so compare those
only as medians of runs in alternating order (``--rows-from-log ... --pool`` pools separate calls)
or, better, ``--paired``: both configurations' engines resident at once (separate processes, each
with its own ``--gpu-memory-utilization``, at most 0.45), their timed runs taken in turn A B, B A,
A B ..., so a drift of the host's speed reaches both; ``throughput_details.json`` then holds each
turn pair's B/A ratio (``paired``). ``--step-timing`` records, per timed run, where the engine's
steps spend their host time by phase (``benchmarks/step_timing.py``, as ``serve_bench.py
--step-timing``; ``report.throughput_steps_table`` prints it).

The KV budget is fixed through one ``--gpu-memory-utilization`` for every configuration, so a
cache format that needs fewer bytes per token gets more tokens (``kv_cache_tokens``, vLLM's own
number: blocks x block size, what it logs as "GPU KV cache size"). ``max_model_len`` is fixed too
(``--max-model-len``, default the model's ``max_position_embeddings``); a context length longer
than the model allows is skipped and the reason recorded. A prompt of context ``ctx`` has
``min(ctx, max_model_len - output_len)`` tokens, so with SmolLM2 (8192 positions) the 8K rows use
7936-token prompts (the ``prompt_len`` in the details file).

Configurations: ``auto_fa2`` (BF16, FlashAttention-2 forced: vLLM's Ampere default; the bundle has
no FA3), ``auto_triton`` (BF16, Triton backend), ``int8_per_token_head`` (upstream, Triton) and our
dtypes (``int8`` ...; no backend argument: the shim's plugin selects ours, with INT8KV_SHIM=1 set
only in those processes).

Writes ``--out`` (benchmarks/results/throughput.json, ``common.validate_throughput``'s schema) and
``throughput_details.json``; ``--append`` merges into existing files (rows replaced by
(dtype, ctx)), so a run can be split over several device calls with ``--configs``/``--ctx``.
Plot with ``python -m benchmarks.plot_throughput`` (needs matplotlib; runs on any machine).

GPU host: ``bash benchmarks/run_gpu_e2e.sh throughput [extra args]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import common, step_timing

DEFAULT_CONFIGS = "auto_fa2,auto_triton,int8_per_token_head,int8"
DEFAULT_CTX = "1024,8192,32768"
WARMUP_PROMPTS = 8
# --profile: enough sequences and steps to see prefill and decode kernels, a small trace
PROFILE_PROMPTS = 16
PROFILE_TOKENS = 64
# How a worker logs each row ("[int8] ctx 8192: {...} in 23.2s"); rows_from_log() parses it back.
ROW_LOG_RE = re.compile(r"^\[([\w.-]+)\] ctx (\d+): (\{.*\}) in [\d.]+s\s*$")
# --paired: what two resident engines may take of the GPU together (two CUDA contexts and the
# non-torch memory vLLM does not count stay outside)
PAIRED_MAX_UTILIZATION = 0.9
PAIR_STOPPED = -2  # the rc of a --paired worker stopped (or never started) because the other failed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("SMOLLM2_DIR"), help="HF model folder")
    p.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma list of row labels")
    p.add_argument("--ctx", default=DEFAULT_CTX, help="comma list of context lengths (tokens)")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument(
        "--kv-cache-memory-gib",
        type=float,
        default=0,
        help="KV memory per configuration (vLLM's kv_cache_memory_bytes; an int4 tail pool comes "
        "out of it); 0 = what --gpu-memory-utilization leaves. A small one makes the cache, not "
        "max_num_seqs, bound the batch of a small model",
    )
    p.add_argument("--max-model-len", type=int, default=0, help="0 = max_position_embeddings")
    p.add_argument("--fill", type=float, default=1.0, help="prompts = fill x cache / seq len")
    p.add_argument("--num-prompts", type=int, default=0, help="fixed count instead of --fill")
    p.add_argument("--max-num-seqs", type=int, default=0, help="0 = vLLM's default")
    p.add_argument(
        "--max-cudagraph-capture-size",
        type=int,
        default=0,
        help="largest batch vLLM captures in a CUDA graph; 0 = vLLM's default, min(2 x "
        "max_num_seqs, 512): int8 holds twice the sequences, so its decode batches pass 512 and "
        "run eagerly where BF16's stay in graphs",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1200, help="seconds per configuration")
    p.add_argument(
        "--profile",
        action="store_true",
        help="after each context's timed run, profile a short untimed one (vLLM's torch profiler: "
        f"{PROFILE_PROMPTS} prompts, {PROFILE_TOKENS} output tokens) and keep its per-kernel CUDA "
        "time table next to the results (profile_LABEL_CTX.txt, also in $OUT/logs)",
    )
    p.add_argument(
        "--profile-prompts",
        type=int,
        default=PROFILE_PROMPTS,
        help="prompts of the profiled run (at least max_num_seqs to profile the timed run's "
        "full batches, e.g. 1100 at 1K context)",
    )
    p.add_argument(
        "--step-stats",
        action="store_true",
        help="turn vLLM's stats on and record the timed run's engine steps, tokens per step and "
        "ms per step, and the requests it ran at once and the KV cache's use, sampled "
        "(throughput_details.json): whether a configuration is slower per step or takes more "
        "steps, and whether its cache or its max_num_seqs bound its batch",
    )
    p.add_argument(
        "--step-timing",
        action="store_true",
        help="time each engine's steps' host work by phase (benchmarks/step_timing.py: the "
        "scheduler, the model runner's phases, each layer's attention and its parts) and record "
        "each timed run's sums under its 'step_timing' (throughput_details.json): where a "
        "configuration's time a step goes on the host. The timer's own calls cost a little host "
        "time in every configuration alike",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs per context in the same engine, each on its own seeded prompts: the row "
        "is the median run (the slower middle one of an even count); every run is in "
        "throughput_details.json (its runs: gen_tok_s, ms per step, host_probe_ms). On the H200 "
        "host one int8 workload ran at 29.3 and at 48.8 ms per step in two runs on the same "
        "host: one run per configuration does not give a ratio",
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="two --configs, both engines resident at once (each its own process and "
        "--gpu-memory-utilization, so at most 0.45 each), their timed runs taken in turn A B, B A, "
        "A B ...: host-speed drift, which moved 1K rows 1.6x within one session, then hits both "
        "alike; throughput_details.json's 'paired' holds each turn pair's B/A ratio",
    )
    p.add_argument("--shim-everywhere", action="store_true", help="INT8KV_SHIM=1 for baselines too")
    p.add_argument("--append", action="store_true", help="merge into an existing --out")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "throughput.json"))
    p.add_argument("--workdir", default=None)
    p.add_argument(
        "--rows-from-log",
        nargs="+",
        metavar="LOG",
        help="recover rows from worker logs (throughput_LABEL.log) of a run stopped before it "
        "wrote its JSON, into --out (with --append: merged into it); runs nothing",
    )
    p.add_argument(
        "--gpu",
        default="unknown",
        help="with --rows-from-log into a new file: the GPU the logs came from (their env.log)",
    )
    p.add_argument(
        "--pool",
        action="store_true",
        help="with --rows-from-log: rows of one (dtype, ctx) from several logs (repeated runs of "
        "one workload) become their median run instead of the last one read",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--label", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--turns", help=argparse.SUPPRESS)  # --paired: the worker's Turns folder
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.paired and not args.worker:
        n = len(common.parse_list(args.configs))
        if n != 2:
            p.error(f"--paired takes two --configs, got {n}")
        if args.profile:
            p.error("--paired with --profile: a profile would run during the other's timed run")
        if 2 * args.gpu_memory_utilization > PAIRED_MAX_UTILIZATION:
            p.error(
                f"--paired keeps both engines on the GPU: 2 x --gpu-memory-utilization "
                f"{args.gpu_memory_utilization} > {PAIRED_MAX_UTILIZATION}; pass "
                f"--gpu-memory-utilization {PAIRED_MAX_UTILIZATION / 2}"
            )
    return args


def model_max_len(model_dir: str) -> int:
    """``max_position_embeddings`` from the model's config.json (what vLLM caps max_model_len to)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg["max_position_embeddings"])


def plan_ctx(
    ctxs: list[int], max_model_len: int, output_len: int
) -> tuple[list[tuple[int, int]], list[dict[str, Any]]]:
    """[(ctx, prompt_len)] to run, and the skipped ones with why.

    A context longer than the model's max_model_len is skipped rather than run with RoPE positions
    the model never saw (vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set).
    """
    plan, skipped = [], []
    for ctx in ctxs:
        if ctx > max_model_len:
            skipped.append({"ctx": ctx, "reason": f"longer than max_model_len {max_model_len}"})
        elif ctx <= output_len:
            skipped.append({"ctx": ctx, "reason": f"not longer than output_len {output_len}"})
        else:
            plan.append((ctx, min(ctx, max_model_len - output_len)))
    return plan, skipped


def num_prompts_for(kv_tokens: int, prompt_len: int, output_len: int, fill: float) -> int:
    """Prompts whose full sequences take ``fill`` times the KV cache (at least 1)."""
    return max(1, math.ceil(fill * kv_tokens / (prompt_len + output_len)))


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of uniformly random token ids in [1000, vocab) (skips specials), seeded."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(1000, vocab, size=(n, length), dtype=np.int64).tolist()


def worker(args: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(args.result).with_suffix(".spec.json").read_text())
    kwargs: dict[str, Any] = dict(
        model=args.model,
        **common.llm_kwargs_for(args.label),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=False,  # random prompts never hit; keep hashing out of the timing
        seed=args.seed,
    )
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.kv_cache_memory_gib:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_memory_gib * 2**30)
    if args.step_stats:
        kwargs["disable_log_stats"] = False
    if args.max_cudagraph_capture_size:
        kwargs["compilation_config"] = {
            "max_cudagraph_capture_size": args.max_cudagraph_capture_size
        }
    profile_dir = Path(args.result).with_name(f"profile_{args.label}")
    if args.profile:
        kwargs["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": str(profile_dir),
            "torch_profiler_with_stack": False,
        }
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    start_s = time.monotonic() - t0
    kv_tokens, blocks, block_size = common.kv_cache_tokens(llm)
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    sched = llm.llm_engine.vllm_config.scheduler_config
    print(f"[{args.label}] engine up in {start_s:.0f}s, {kv_tokens} KV tokens", flush=True)

    rows, extra = [], []
    timing = os.environ.get(step_timing.STEP_TIMING_DIR) if args.step_timing else None
    timing_dir = Path(timing) if timing else None
    turns = Turns(Path(args.turns) if args.turns else None, args.label)
    sp = SamplingParams(
        max_tokens=args.output_len, ignore_eos=True, temperature=0.0, detokenize=False
    )
    for _, prompt_len in spec["plan"]:
        warm = random_prompts(WARMUP_PROMPTS, prompt_len, vocab, args.seed + 1)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in warm], sp, use_tqdm=False)
    turns.ready()
    turn = 0
    for ctx, prompt_len in spec["plan"]:
        n = args.num_prompts or num_prompts_for(kv_tokens, prompt_len, args.output_len, args.fill)
        timed: list[dict[str, Any]] = []
        for i in range(args.repeats):
            turns.wait_go(turn)
            # the first run's prompts are those of a single-run invocation
            seed = args.seed + ctx + 7919 * i
            prompts = [TokensPrompt(prompt_token_ids=p)
                       for p in random_prompts(n, prompt_len, vocab, seed)]  # fmt: skip
            timed.append(timed_run(llm, prompts, sp, args.step_stats, timing_dir))
            turns.done(turn)
            turn += 1
        run = lower_median(timed)
        wall, out_tokens = run["wall_s"], run["output_tokens"]
        rows.append(
            {
                "dtype": args.label,
                "ctx": ctx,
                "num_prompts": n,
                "output_len": args.output_len,
                "gen_tok_s": run["gen_tok_s"],
                "kv_cache_tokens": kv_tokens,
            }
        )
        extra.append(
            {
                "dtype": args.label,
                "ctx": ctx,
                "prompt_len": prompt_len,
                "wall_s": wall,
                "output_tokens": out_tokens,
                "total_tok_s": round((out_tokens + n * prompt_len) / wall, 1),
                "num_gpu_blocks": blocks,
                "block_size": block_size,
                "max_num_seqs": sched.max_num_seqs,
                "max_num_batched_tokens": sched.max_num_batched_tokens,
                "max_cudagraph_capture_size": (
                    llm.llm_engine.vllm_config.compilation_config.max_cudagraph_capture_size
                ),
                "engine_start_s": round(start_s, 1),
                **{k: run[k] for k in (*STEP_KEYS, *BATCH_KEYS) if k in run},
                "host_probe_ms": run["host_probe_ms"],
                "runs": timed,
                "llm_kwargs": common.llm_kwargs_for(args.label),
                "shim": os.environ.get(common.SHIM_ENV, ""),
            }
        )
        print(f"[{args.label}] ctx {ctx}: {json.dumps(rows[-1])} in {wall:.1f}s", flush=True)
        # After every context, so a configuration stopped by --timeout keeps what it measured.
        Path(args.result).write_text(json.dumps({"rows": rows, "extra": extra}))
        if args.profile:
            profile(llm, prompts[: args.profile_prompts], args, ctx, profile_dir)
    turns.wait_go(turn)  # the exit gate: an engine shutting down would disturb the other's run
    return 0


class Turns:
    """How ``--paired``'s two resident engines take turns: empty files in one folder.

    A worker touches ``ready_LABEL`` once its engine is up and warmed up (its GPU memory settled,
    so the other engine may start and size its own cache). Before its K-th timed run it waits for
    ``go_LABEL_K`` (prompts are made inside the turn too: the other engine is host-bound, and a
    busy neighbour is what pairing removes); after it, it touches ``done_LABEL_K``. One more ``go``
    after the last run lets it exit. Without a folder (one configuration at a time) every step
    is a no-op.
    """

    POLL_S = 0.02

    def __init__(self, folder: Path | None, label: str) -> None:
        self.folder, self.label = folder, label
        self._driver = os.getppid()

    def path(self, kind: str, turn: int | None = None) -> Path:
        assert self.folder is not None
        return self.folder / (f"{kind}_{self.label}" + ("" if turn is None else f"_{turn}"))

    def ready(self) -> None:
        if self.folder is not None:
            self.path("ready").touch()

    def done(self, turn: int) -> None:
        if self.folder is not None:
            self.path("done", turn).touch()

    def wait_go(self, turn: int) -> None:
        if self.folder is None:
            return
        go = self.path("go", turn)
        while not go.exists():
            if os.getppid() != self._driver:  # an orphan would hold its GPU memory for good
                raise SystemExit(f"[{self.label}] the --paired driver is gone; exiting")
            time.sleep(self.POLL_S)


def run_paired(
    children: list[tuple[str, list[str], dict[str, str], Path]],
    folder: Path,
    n_turns: int,
    timeout_s: float,
) -> tuple[list[tuple[int, float, str]], list[list[str]]]:
    """``--paired``: start two workers (label, argv, env, log) one after the other, each once the
    previous one is ready, then hand out their timed runs in turn A B, B A, A B ... (so neither
    is always first after the other). Returns each child's (rc, seconds, log tail), as
    ``common.run_child``, and the order each turn ran in. A worker that exits early or a
    ``timeout_s`` (for the whole pair) stops both."""
    shutil.rmtree(folder, ignore_errors=True)  # a reused --workdir must not hand out old turns
    folder.mkdir(parents=True)
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    procs: list[Any] = []
    turns = [Turns(folder, label) for label, *_ in children]

    def wait_for(path: Path) -> bool:
        while not path.exists():
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                return False
            time.sleep(Turns.POLL_S)
        return True

    order: list[list[str]] = []
    ok = True
    for (_, argv, env, log), t in zip(children, turns, strict=True):
        procs.append(common.start_child(argv, env, log))
        ok = wait_for(t.path("ready"))
        if not ok:
            break
    for k in range(n_turns if ok else 0):
        ran = []
        for t in turns if k % 2 == 0 else turns[::-1]:
            t.path("go", k).touch()
            ok = wait_for(t.path("done", k))
            if not ok:
                break
            ran.append(t.label)
        order += [ran] if ran else []
        if not ok:
            break
    results = []
    for (*_, log), t, proc in zip(children, turns, procs, strict=False):  # procs: those started
        note = ""
        if ok:
            t.path("go", n_turns).touch()
            try:
                rc = proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                rc = common.kill_child(proc)
        elif proc.poll() is not None:
            rc = proc.returncode
        elif time.monotonic() > deadline:
            rc = common.kill_child(proc)  # -9: reported as a timeout
        else:
            common.kill_child(proc)
            rc, note = PAIR_STOPPED, "\nerror: stopped because the other engine of the pair failed"
        results.append((rc, time.monotonic() - t0, common.log_tail(log) + note))
    # a worker that never started (the first one failed before it was ready)
    results += [
        (PAIR_STOPPED, 0.0, "error: not started: the pair stopped first (failed or timed out)")
    ] * (len(children) - len(procs))
    return results, order


def lower_median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run by gen_tok_s; of an even count the slower middle one (no invented mean)."""
    return sorted(runs, key=lambda r: r["gen_tok_s"])[(len(runs) - 1) // 2]


def host_probe_ms(rounds: int = 5) -> float:
    """Median ms of a fixed pure-Python loop: the host's speed right now. A run with a slow probe
    ran on a slow (shared) host, which a host-bound configuration feels and a GPU-bound one may not."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sum(i * i for i in range(200_000))
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 2)


def timed_run(
    llm: Any, prompts: list[Any], sp: Any, with_steps: bool, timing_dir: Path | None = None
) -> dict[str, Any]:
    """One timed ``LLM.generate``: gen_tok_s, wall, output tokens, the host probe taken just
    before it, (``with_steps``) its engine steps and (``timing_dir``, where the engine's step
    timers write) the step timers' sums over it, read outside the timed wall."""
    timing_before = step_timing.settled_snapshots(timing_dir) if timing_dir is not None else None
    probe = host_probe_ms()
    steps0 = iteration_tokens(llm) if with_steps else None
    batch = BatchSampler(llm if with_steps else None)
    t0 = time.monotonic()
    with batch:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.monotonic() - t0
    steps1 = iteration_tokens(llm) if with_steps else None
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    run = {
        "gen_tok_s": round(out_tokens / wall, 1),
        "wall_s": round(wall, 2),
        "output_tokens": out_tokens,
        "host_probe_ms": probe,
        **step_stats(steps0, steps1, wall),
        **batch.stats(),
    }
    if timing_dir is not None:
        after = step_timing.settled_snapshots(timing_dir)
        run["step_timing"] = step_timing.difference(timing_before, after)
        if not run["step_timing"]["engine_steps"]:
            # the engine core's timer wrote nothing: say so rather than leave an empty record
            print(f"throughput: step timing: no engine step timed in {timing_dir} (the timer's "
                  "sitecustomize not on the engine core's path?)", file=sys.stderr, flush=True)  # fmt: skip
    return run


def iteration_tokens(llm: Any) -> tuple[int, float]:
    """(engine steps, tokens scheduled) so far: vLLM's ``vllm:iteration_tokens_total`` histogram,
    one observation per step (needs ``disable_log_stats=False``)."""
    hists = [m for m in llm.get_metrics() if m.name == "vllm:iteration_tokens_total"]
    return sum(h.count for h in hists), sum(h.sum for h in hists)


RUNNING_GAUGE, KV_USAGE_GAUGE = "vllm:num_requests_running", "vllm:kv_cache_usage_perc"


class BatchSampler:
    """Inside ``with``: vLLM's gauges of the requests running and of the KV cache's use, read
    every ``interval`` s from a thread (a gauge holds only its latest step's value). ``stats``:
    the most requests running at once, their mean over the samples (wall-clock samples, the
    run's ramp-up and tail included), and the cache's highest use; so a row says whether its
    batch was bound by its cache (use near 1) or by ``max_num_seqs`` (running at it). A read
    that fails stops the sampling and is named in ``stats`` (``batch_sample_error``). Without
    an engine (``llm`` None) it samples nothing."""

    def __init__(self, llm: Any, interval: float = 0.25) -> None:
        self.llm, self.interval = llm, interval
        self.running: list[float] = []
        self.usage: list[float] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        metrics = self.llm.get_metrics()
        running = [m.value for m in metrics if m.name == RUNNING_GAUGE]
        usage = [m.value for m in metrics if m.name == KV_USAGE_GAUGE]
        if running:  # one gauge per engine (data parallelism): the engines' sum
            self.running.append(sum(running))
        if usage:
            self.usage.append(max(usage))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception as e:  # a diagnostic: the timed run goes on, the row says so
                self.error = f"{type(e).__name__}: {e}"
                return

    def __enter__(self) -> BatchSampler:
        if self.llm is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.running:
            out["max_running"] = int(max(self.running))
            out["mean_running"] = round(statistics.fmean(self.running), 1)
        if self.usage:
            out["max_kv_cache_usage"] = round(max(self.usage), 3)
        if self.error:
            out["batch_sample_error"] = self.error
        return out


STEP_KEYS = ("engine_steps", "tokens_per_step", "ms_per_step")
BATCH_KEYS = ("max_running", "mean_running", "max_kv_cache_usage", "batch_sample_error")


def step_stats(
    before: tuple[int, float] | None, after: tuple[int, float] | None, wall_s: float
) -> dict[str, Any]:
    """Steps of a timed run from two :func:`iteration_tokens` readings ({} without them)."""
    if before is None or after is None or after[0] <= before[0]:
        return {}
    steps, tokens = after[0] - before[0], after[1] - before[1]
    return {
        "engine_steps": steps,
        "tokens_per_step": round(tokens / steps, 1),
        "ms_per_step": round(1e3 * wall_s / steps, 2),
    }


def profile(
    llm: Any, prompts: list[Any], args: argparse.Namespace, ctx: int, profile_dir: Path
) -> None:
    """One short profiled generate; keeps vLLM's per-kernel table (profiler_out_0.txt)."""
    from vllm import SamplingParams

    short = SamplingParams(max_tokens=min(PROFILE_TOKENS, args.output_len), ignore_eos=True,
                           temperature=0.0, detokenize=False)  # fmt: skip
    llm.start_profile()
    t0 = time.monotonic()
    llm.generate(prompts, short, use_tqdm=False)
    wall = time.monotonic() - t0
    llm.stop_profile()
    table = profile_dir / "profiler_out_0.txt"
    if not table.exists():
        print(f"[{args.label}] ctx {ctx}: no profiler table in {profile_dir}", flush=True)
        return
    name = f"profile_{args.label}_{ctx}.txt"
    targets = [Path(args.result).with_name(name)]
    if os.environ.get("OUT"):
        targets.append(Path(os.environ["OUT"]) / "logs" / name)
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        # The wall time, next to the table's CUDA total, tells a GPU-bound run from a host-bound one.
        target.write_text(
            f"profiled generate: {len(prompts)} prompts, {short.max_tokens} output tokens each, "
            f"{wall:.2f} s wall (profiler overhead included)\n\n{table.read_text()}"
        )
    print(f"[{args.label}] ctx {ctx}: kernel profile in {targets[-1]}", flush=True)


def rows_from_log(path: Path) -> list[dict[str, Any]]:
    """The rows a worker printed to its log (``ROW_LOG_RE`` lines): how the rows of a run whose
    driver was stopped before writing its JSON are recovered (``--rows-from-log``)."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        m = ROW_LOG_RE.match(line)
        if m:
            row = json.loads(m.group(3))
            if row["dtype"] != m.group(1) or row["ctx"] != int(m.group(2)):
                raise ValueError(f"{path}: row {row} does not match its log line")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no throughput rows in this log")
    return rows


def paired_ratios(
    labels: list[str], extra: list[dict[str, Any]], order: list[list[str]], ctxs: list[int]
) -> list[dict[str, Any]]:
    """Per context of a ``--paired`` call (``ctxs`` in the order they ran): the B/A gen tok/s
    ratio of each turn pair (the K-th timed runs of both, taken back to back, in the order its
    ``order`` entry gives) and their median (of an even count, the lower middle one: B is not
    flattered). Contexts a worker did not finish have no entry."""
    a, b = labels
    found = {(r["dtype"], r["ctx"]): r["runs"] for r in extra if "runs" in r}
    out = []
    turn = 0  # the turns run context by context, each context's repeats in a row
    for ctx in ctxs:
        if (a, ctx) not in found or (b, ctx) not in found:
            continue
        runs_a, runs_b = found[(a, ctx)], found[(b, ctx)]
        ratios = [
            round(rb["gen_tok_s"] / ra["gen_tok_s"], 4)
            for ra, rb in zip(runs_a, runs_b, strict=True)
        ]
        out.append(
            {"a": a, "b": b, "ctx": ctx, "ratios": ratios,
             "median_ratio": statistics.median_low(ratios),
             "order": order[turn : turn + len(ratios)]}
        )  # fmt: skip
        turn += len(ratios)
        print(f"throughput: paired {b}/{a} ctx {ctx}: per turn {ratios} -> "
              f"{out[-1]['median_ratio']}", flush=True)  # fmt: skip
    return out


def worker_argv(args: argparse.Namespace, label: str, result: Path) -> list[str]:
    """The command line of the worker process that runs ``label``."""
    return [
        *common.module_command("benchmarks.throughput"),
        "--worker",
        "--label",
        label,
        "--result",
        str(result),
        "--model",
        args.model,
        "--output-len",
        str(args.output_len),
        "--fill",
        str(args.fill),
        "--num-prompts",
        str(args.num_prompts),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-cudagraph-capture-size",
        str(args.max_cudagraph_capture_size),
        "--seed",
        str(args.seed),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--kv-cache-memory-gib",
        str(args.kv_cache_memory_gib),
        *(["--profile", "--profile-prompts", str(args.profile_prompts)] if args.profile else []),
        *(["--step-stats"] if args.step_stats else []),
        *(["--step-timing"] if args.step_timing else []),
        "--repeats",
        str(args.repeats),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.rows_from_log:
        return recover(args)
    if not args.model or not Path(args.model).is_dir():
        print("throughput: no model folder (--model or $SMOLLM2_DIR)", file=sys.stderr)
        return 2
    max_len = args.max_model_len or model_max_len(args.model)
    plan, skipped = plan_ctx(
        [int(c) for c in common.parse_list(args.ctx)], max_len, args.output_len
    )
    labels = common.parse_list(args.configs)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="int8kv-throughput-"))
    workdir.mkdir(parents=True, exist_ok=True)
    logdir = Path(os.environ["OUT"]) / "logs" if os.environ.get("OUT") else workdir
    print(f"throughput: configs {labels}, (ctx, prompt_len) {plan}, skipped {skipped}", flush=True)

    children = []
    for label in labels:
        result = workdir / f"{label}.json"
        result.with_suffix(".spec.json").write_text(
            json.dumps({"plan": plan, "max_model_len": max_len})
        )
        env = common.with_repo_on_path(common.child_env(label, args.shim_everywhere))
        if args.step_timing:
            env |= step_timing.child_env(workdir / "steps" / label, env)
        children.append(
            (label, worker_argv(args, label, result), env, logdir / f"throughput_{label}.log")
        )
    if args.paired:
        outcomes, order = run_paired(
            [(label, [*argv, "--turns", str(workdir / "turns")], env, log)
             for label, argv, env, log in children],
            workdir / "turns", len(plan) * args.repeats, 2 * args.timeout,
        )  # fmt: skip
    else:
        order = []
        outcomes = [
            common.run_child(argv, env, args.timeout, log) for _, argv, env, log in children
        ]

    rows: list[dict[str, Any]] = []
    extra: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    for (label, _, env, _), (rc, secs, tail) in zip(children, outcomes, strict=True):
        result = workdir / f"{label}.json"
        run: dict[str, Any] = {"rc": rc, "wall_s": round(secs, 1), "shim": env.get("INT8KV_SHIM")}
        if result.exists():  # also after a timeout: the contexts it finished
            got = json.loads(result.read_text())
            rows += got["rows"]
            extra += got["extra"]
            run["ctx_done"] = [r["ctx"] for r in got["rows"]]
        if rc != 0:
            run["error"] = "timeout" if rc == -9 else common.error_summary(tail)
        runs[label] = run
        print(f"throughput: {label}: rc={rc} in {secs:.0f}s {run.get('error', '')}", flush=True)

    out = Path(args.out)
    details_path = out.with_name(out.stem + "_details.json")
    doc: dict[str, Any] = {
        "gpu": common.gpu_name(),
        "command": common.command_line(),
        "model": args.model_name,
        "rows": rows,
    }
    details: dict[str, Any] = {
        "settings": {
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "kv_cache_memory_gib": args.kv_cache_memory_gib or None,
            "max_model_len": max_len,
            "output_len": args.output_len,
            "fill": args.fill,
            "num_prompts": args.num_prompts or None,
            "max_num_seqs": args.max_num_seqs or "vLLM default",
            "max_cudagraph_capture_size": args.max_cudagraph_capture_size or "vLLM default",
            "seed": args.seed,
            "prompts": "uniform random token ids in [1000, vocab)",
            "gen_tok_s": "output tokens / wall time of LLM.generate (prefill included)",
            "step_timing": args.step_timing,
        },
        "skipped": skipped,
        "runs": runs,
        "rows": extra,
    }
    if args.paired:
        details["paired"] = paired_ratios(labels, extra, order, [ctx for ctx, _ in plan])
    if args.append and out.exists():
        old = json.loads(out.read_text())
        doc["rows"] = common.merge_rows(old.get("rows", []), rows, ("dtype", "ctx"))
        doc["command"] = old.get("command", "") + " ; " + doc["command"]
        if details_path.exists():
            old_d = json.loads(details_path.read_text())
            details["rows"] = common.merge_rows(old_d.get("rows", []), extra, ("dtype", "ctx"))
            details["runs"] = {**old_d.get("runs", {}), **runs}
            skipped_ctx = {s["ctx"] for s in skipped}
            details["skipped"] = skipped + [
                s for s in old_d.get("skipped", []) if s["ctx"] not in skipped_ctx
            ]
            if "paired" in old_d:
                details["paired"] = common.merge_rows(
                    old_d["paired"], details.get("paired", []), ("a", "b", "ctx")
                )
    common.validate_throughput(doc)
    for path in common.write_json(doc, out) + common.write_json(details, details_path):
        print(f"throughput: wrote {path}")
    try:
        from benchmarks import plot_throughput

        png = plot_throughput.plot(out, out.with_suffix(".png"))
        print(f"throughput: wrote {png}")
    except Exception as e:  # e.g. no matplotlib on the GPU host: plot elsewhere from the JSON
        print(
            f"throughput: no plot ({e}); run python -m benchmarks.plot_throughput where matplotlib is"
        )
    print(f"{'dtype':<22}{'ctx':>7}{'prompts':>9}{'gen tok/s':>12}{'kv tokens':>12}")
    for r in doc["rows"]:
        print(
            f"{r['dtype']:<22}{r['ctx']:>7}{r['num_prompts']:>9}{r['gen_tok_s']:>12.0f}"
            f"{r['kv_cache_tokens']:>12}"
        )
    return 0 if all(r["rc"] == 0 for r in runs.values()) else 1


def recover(args: argparse.Namespace) -> int:
    """``--rows-from-log``: merge the rows that worker logs hold into ``--out`` (``--append``)."""
    out = Path(args.out)
    doc = json.loads(out.read_text()) if args.append and out.exists() else None
    rows = [r for log in args.rows_from_log for r in rows_from_log(Path(log))]
    logs = " ".join(os.path.relpath(Path(log).resolve(), common.REPO) for log in args.rows_from_log)
    if args.pool:
        rows = pool_rows(rows)
    if doc is None:
        doc = {"gpu": args.gpu, "command": "", "model": args.model_name, "rows": []}
    doc["rows"] = common.merge_rows(doc["rows"], rows, ("dtype", "ctx"))
    doc["command"] = (doc["command"] + " ; " if doc["command"] else "") + (
        f"python -m benchmarks.throughput --rows-from-log {logs}"
        + (f" --gpu {shlex.quote(args.gpu)}" if args.gpu != "unknown" else "")
        + " --pool" * args.pool
        + " --append" * args.append
    )
    common.validate_throughput(doc)
    common.write_json(doc, out)
    print(f"throughput: merged {len(rows)} rows from {logs} into {out}")
    return 0


def pool_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of one (dtype, ctx), from separate runs of the same workload, as one: the median run
    (:func:`lower_median`). Runs of different workloads (prompt count, output length, cache size)
    are refused rather than pooled."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["dtype"], row["ctx"]), []).append(row)
    pooled = []
    for (dtype, ctx), group in groups.items():
        workload = {(r["num_prompts"], r["output_len"], r["kv_cache_tokens"]) for r in group}
        if len(workload) > 1:
            raise ValueError(f"{dtype} at ctx {ctx}: runs of different workloads {workload}")
        pooled.append(lower_median(group))
        runs = ", ".join(f"{r['gen_tok_s']:.0f}" for r in group)
        print(f"throughput: {dtype} ctx {ctx}: runs {runs} gen tok/s -> {pooled[-1]['gen_tok_s']}")
    return pooled


if __name__ == "__main__":
    sys.exit(main())
