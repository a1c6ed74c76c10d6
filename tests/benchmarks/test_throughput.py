"""CPU tests of ``benchmarks/throughput.py`` (and its plot): the context plan, step statistics,
``main`` with the engine processes faked, rows from worker logs, and ``--paired``'s turn-taking
between two real (fake) worker processes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import common, step_timing, throughput


def test_throughput_ctx_plan_skips_beyond_model() -> None:
    plan, skipped = throughput.plan_ctx([1024, 8192, 32768], 8192, 256)
    assert plan == [(1024, 1024), (8192, 7936)]
    assert [s["ctx"] for s in skipped] == [32768]
    assert throughput.num_prompts_for(10_000, 744, 256, 1.0) == 10
    assert throughput.num_prompts_for(10, 744, 256, 1.0) == 1
    a = throughput.random_prompts(3, 5, 2000, 0)
    assert a == throughput.random_prompts(3, 5, 2000, 0)
    assert all(1000 <= t < 2000 for p in a for t in p)


def test_step_stats_from_vllms_iteration_histogram() -> None:
    from vllm.v1.metrics.reader import Counter, Histogram

    class _LLM:
        def __init__(self, count: int, total: float) -> None:
            self.metrics = [
                Counter(name="vllm:num_preemptions", labels={}, value=3),
                Histogram(name="vllm:iteration_tokens_total", labels={"engine": "0"},
                          count=count, sum=total, buckets={}),
            ]  # fmt: skip

        def get_metrics(self):
            return self.metrics

    before = throughput.iteration_tokens(_LLM(10, 500.0))
    after = throughput.iteration_tokens(_LLM(110, 103_000.0))
    assert (before, after) == ((10, 500.0), (110, 103_000.0))
    assert throughput.step_stats(before, after, 2.0) == {
        "engine_steps": 100, "tokens_per_step": 1025.0, "ms_per_step": 20.0,
    }  # fmt: skip
    assert throughput.step_stats(None, None, 2.0) == {}  # --step-stats off
    assert throughput.step_stats(before, before, 2.0) == {}  # no step seen


def test_batch_sampler_reads_vllms_running_and_cache_gauges() -> None:
    import time

    from vllm.v1.metrics.reader import Counter, Gauge

    class _LLM:
        """Each read moves on to the next step's gauges (two engines' running requests)."""

        def __init__(self, steps: list[tuple[int, int, float]]) -> None:
            self.steps, self.reads = steps, 0

        def get_metrics(self):
            a, b, usage = self.steps[min(self.reads, len(self.steps) - 1)]
            self.reads += 1
            return [
                Counter(name="vllm:num_preemptions", labels={}, value=3),
                Gauge(name="vllm:num_requests_running", labels={"engine": "0"}, value=a),
                Gauge(name="vllm:num_requests_running", labels={"engine": "1"}, value=b),
                Gauge(name="vllm:kv_cache_usage_perc", labels={"engine": "0"}, value=usage),
                Gauge(name="vllm:kv_cache_usage_perc", labels={"engine": "1"}, value=usage / 2),
            ]

    sampler = throughput.BatchSampler(_LLM([(40, 4, 0.5), (100, 21, 0.98), (60, 0, 0.7)]))
    for _ in range(3):
        sampler.sample()
    assert sampler.stats() == {"max_running": 121, "mean_running": 75.0,
                               "max_kv_cache_usage": 0.98}  # fmt: skip
    # inside `with`, a thread samples until the block ends
    llm = _LLM([(8, 0, 0.1)])
    with throughput.BatchSampler(llm, interval=0.01) as sampler:
        time.sleep(0.2)
    reads = llm.reads
    time.sleep(0.05)
    assert reads > 0 and llm.reads == reads  # stopped with the block
    assert sampler.stats() == {"max_running": 8, "mean_running": 8.0, "max_kv_cache_usage": 0.1}
    # --step-stats off: no engine to read, nothing recorded
    with throughput.BatchSampler(None) as sampler:
        pass
    assert sampler.stats() == {}

    class _Broken:
        def get_metrics(self):
            raise RuntimeError("registry gone")

    with throughput.BatchSampler(_Broken(), interval=0.01) as sampler:
        time.sleep(0.1)
    assert sampler.stats() == {"batch_sample_error": "RuntimeError: registry gone"}


def test_timed_run_records_the_batch_it_ran() -> None:
    """A timed generate with --step-stats carries the sampler's fields beside the step counts."""
    import time
    from types import SimpleNamespace

    from vllm.v1.metrics.reader import Gauge, Histogram

    class _LLM:
        def __init__(self) -> None:
            self.steps = 0

        def get_metrics(self):
            return [
                Histogram(name="vllm:iteration_tokens_total", labels={"engine": "0"},
                          count=self.steps, sum=100.0 * self.steps, buckets={}),
                Gauge(name="vllm:num_requests_running", labels={"engine": "0"}, value=12),
                Gauge(name="vllm:kv_cache_usage_perc", labels={"engine": "0"}, value=0.9),
            ]  # fmt: skip

        def generate(self, prompts, sp, use_tqdm=False):
            time.sleep(0.6)  # a few of the sampler's 0.25 s reads
            self.steps += 10
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1, 2, 3])])] * 4

    run = throughput.timed_run(_LLM(), [None] * 4, None, with_steps=True)
    assert run["engine_steps"] == 10 and run["output_tokens"] == 12
    assert (run["max_running"], run["mean_running"], run["max_kv_cache_usage"]) == (12, 12.0, 0.9)
    run = throughput.timed_run(_LLM(), [None] * 4, None, with_steps=False)
    assert not set(run) & {"engine_steps", *throughput.BATCH_KEYS}


def test_timed_run_records_the_step_timers_sums_over_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a step-timing folder the run carries step_timing.difference of the engine processes'
    sums read before and after it (each process's file replaced as its timer writes)."""
    from types import SimpleNamespace

    monkeypatch.setattr(step_timing, "SETTLE_S", 0.0)

    def snapshot(pid: int, steps: int, seconds: float) -> None:
        sums = {"calls": {"engine_step": steps, "execute_model": steps},
                "seconds": {"engine_step": seconds, "execute_model": seconds / 2}}  # fmt: skip
        (tmp_path / f"steps_{pid}.json").write_text(json.dumps({"pid": pid, **sums}))

    class _LLM:
        def generate(self, prompts, sp, use_tqdm=False):
            snapshot(7, 30, 0.9)  # 20 steps of 30 ms in the run
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1])])] * len(prompts)

    snapshot(7, 10, 0.3)
    run = throughput.timed_run(_LLM(), [None] * 2, None, with_steps=False, timing_dir=tmp_path)
    phases = run["step_timing"]["phases"]
    assert run["step_timing"]["engine_steps"] == 20
    assert phases["engine_step"]["ms_per_step"] == pytest.approx(30.0)
    assert phases["execute_model"]["ms_per_step"] == pytest.approx(15.0)
    assert "step_timing" not in throughput.timed_run(_LLM(), [None], None, with_steps=False)


def test_step_timing_that_timed_no_engine_step_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from types import SimpleNamespace

    monkeypatch.setattr(step_timing, "SETTLE_S", 0.0)

    class _LLM:
        def generate(self, prompts, sp, use_tqdm=False):
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1])])]

    run = throughput.timed_run(_LLM(), [None], None, with_steps=False, timing_dir=tmp_path)
    assert run["step_timing"]["engine_steps"] == 0
    assert "no engine step timed" in capsys.readouterr().err


def test_step_timing_reaches_each_worker_with_its_own_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, throughput_model: list[str]
) -> None:
    """--step-timing: each worker gets the flag, the timer's site first on its path and a
    folder of its own; without it, neither."""
    seen: dict[str, tuple[list[str], dict[str, str]]] = {}

    def fake_child(argv, env, timeout_s, log_path):
        argv = list(argv)
        seen[argv[argv.index("--label") + 1]] = (argv, dict(env))
        return 1, 0.1, "stopped"

    monkeypatch.setattr(throughput.common, "run_child", fake_child)
    base = [*throughput_model, "--out", str(tmp_path / "t.json"), "--configs", "int8,int4"]
    throughput.main([*base, "--step-timing"])
    folders = set()
    for argv, env in seen.values():
        assert "--step-timing" in argv
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(step_timing.SITE)
        folders.add(env[step_timing.STEP_TIMING_DIR])
    assert len(folders) == 2
    seen.clear()
    throughput.main(base)
    for argv, env in seen.values():
        assert "--step-timing" not in argv and step_timing.STEP_TIMING_DIR not in env


def test_plot_throughput(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks import plot_throughput as plot

    rows = [
        {
            "dtype": d,
            "ctx": c,
            "num_prompts": 1,
            "output_len": 256,
            "gen_tok_s": 1000.0 * (i + 1),
            "kv_cache_tokens": 10_000 * (i + 1),
        }
        for i, d in enumerate(["auto_fa2", "int8"])
        for c in (1024, 8192)
    ]
    src = tmp_path / "t.json"
    src.write_text(json.dumps({"gpu": "g", "command": "c", "model": "m", "rows": rows}))
    png = plot.plot(src, tmp_path / "t.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.fixture
def throughput_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A fake model folder for throughput.main (no GPU name, no $OUT): its base arguments."""
    monkeypatch.delenv("OUT", raising=False)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    monkeypatch.setattr(throughput.common, "gpu_name", lambda: "FakeGPU")
    return ["--model", str(tmp_path), "--workdir", str(tmp_path / "w")]


def test_throughput_main_append_merges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, throughput_model: list[str]
) -> None:
    speed = {"auto_fa2": 100.0, "int8": 150.0, "auto_triton": 90.0}

    def fake_child(argv, env, timeout_s, log_path):
        argv = list(argv)
        label = argv[argv.index("--label") + 1]
        result = Path(argv[argv.index("--result") + 1])
        spec = json.loads(result.with_suffix(".spec.json").read_text())
        rows = [
            {
                "dtype": label,
                "ctx": c,
                "num_prompts": 2,
                "output_len": 256,
                "gen_tok_s": speed[label] * (2 if c == 1024 else 1),
                "kv_cache_tokens": 10_000,
            }
            for c, _ in spec["plan"]
        ]
        extra = [{"dtype": label, "ctx": c, "prompt_len": p} for c, p in spec["plan"]]
        result.write_text(json.dumps({"rows": rows, "extra": extra}))
        return 0, 0.1, "ok"

    monkeypatch.setattr(throughput.common, "run_child", fake_child)
    out = tmp_path / "res" / "throughput.json"
    base = [*throughput_model, "--out", str(out)]
    assert throughput.main([*base, "--configs", "auto_fa2,int8", "--ctx", "1024,8192,32768"]) == 0
    assert (
        throughput.main([*base, "--configs", "auto_triton,int8", "--ctx", "8192", "--append"]) == 0
    )
    doc = json.loads(out.read_text())
    common.validate_throughput(doc)
    keys = sorted((r["dtype"], r["ctx"]) for r in doc["rows"])
    assert keys == [
        ("auto_fa2", 1024),
        ("auto_fa2", 8192),
        ("auto_triton", 8192),
        ("int8", 1024),
        ("int8", 8192),
    ]
    details = json.loads((out.parent / "throughput_details.json").read_text())
    assert [s["ctx"] for s in details["skipped"]] == [32768]
    assert {r["prompt_len"] for r in details["rows"] if r["ctx"] == 8192} == {7936}
    assert set(details["runs"]) == {"auto_fa2", "int8", "auto_triton"}
    assert " ; " in doc["command"]


def test_throughput_keeps_rows_of_a_timed_out_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, throughput_model: list[str]
) -> None:
    """A worker killed by --timeout after its first context still contributes that row."""

    seen_argv = []

    def fake_child(argv, env, timeout_s, log_path):
        argv = list(argv)
        seen_argv.append(argv)
        label = argv[argv.index("--label") + 1]
        result = Path(argv[argv.index("--result") + 1])
        row = {"dtype": label, "ctx": 1024, "num_prompts": 2, "output_len": 256}
        row |= {"gen_tok_s": 5.0, "kv_cache_tokens": 10}
        result.write_text(json.dumps({"rows": [row], "extra": [{"dtype": label, "ctx": 1024}]}))
        return -9, timeout_s, "killed"

    monkeypatch.setattr(throughput.common, "run_child", fake_child)
    out = tmp_path / "throughput.json"
    argv = [*throughput_model, "--out", str(out), "--max-cudagraph-capture-size", "1024"]
    profile = ["--profile", "--profile-prompts", "1100"]
    assert throughput.main([*argv, "--configs", "int8", "--ctx", "1024,8192", *profile]) == 1
    # the worker is asked to profile too, with as many prompts, and gets the capture size
    worker = throughput.parse_args(seen_argv[0][3:])  # after `python -m benchmarks.throughput`
    assert worker.profile and worker.profile_prompts == 1100
    assert worker.max_cudagraph_capture_size == 1024
    assert [(r["dtype"], r["ctx"]) for r in json.loads(out.read_text())["rows"]] == [("int8", 1024)]
    details = json.loads((tmp_path / "throughput_details.json").read_text())
    assert details["settings"]["max_cudagraph_capture_size"] == 1024
    run = details["runs"]["int8"]
    assert run["error"] == "timeout" and run["ctx_done"] == [1024]


def test_throughput_rows_from_worker_logs(tmp_path: Path) -> None:
    row = {"dtype": "auto_fa2", "ctx": 8192, "num_prompts": 234, "output_len": 256}
    row |= {"gen_tok_s": 6611.6, "kv_cache_tokens": 1916736}
    log = tmp_path / "throughput_auto_fa2.log"
    log.write_text(
        "(EngineCore pid=1) INFO noise ctx 8192: {not a row}\n"
        f"[auto_fa2] ctx 8192: {json.dumps(row)} in 9.1s\n"
    )
    assert throughput.rows_from_log(log) == [row]
    out = tmp_path / "throughput.json"
    out.write_text(json.dumps({"gpu": "G", "command": "python x", "model": "m", "rows": []}))
    assert throughput.main(["--rows-from-log", str(log), "--append", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["rows"] == [row] and doc["gpu"] == "G"
    assert doc["command"].startswith("python x ; python -m benchmarks.throughput --rows-from-log")
    (tmp_path / "empty.log").write_text("no rows here\n")
    with pytest.raises(ValueError, match="no throughput rows"):
        throughput.rows_from_log(tmp_path / "empty.log")
    mislabeled = tmp_path / "bad.log"
    mislabeled.write_text(f"[int8] ctx 8192: {json.dumps(row)} in 1.0s\n")
    with pytest.raises(ValueError, match="does not match"):
        throughput.rows_from_log(mislabeled)


def _fake_llm(on_generate: Any) -> type:
    """A stand-in for ``vllm.LLM`` in throughput.worker: the config it reads, and a generate
    that calls ``on_generate(prompts)`` and returns ``max_tokens`` tokens per prompt."""
    import types

    class _LLM:
        made: list[dict] = []

        def __init__(self, **kwargs) -> None:
            _LLM.made.append(kwargs)
            cfg = types.SimpleNamespace(
                cache_config=types.SimpleNamespace(num_gpu_blocks=100, block_size=16),
                model_config=types.SimpleNamespace(get_vocab_size=lambda: 5000),
                scheduler_config=types.SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=64),
                compilation_config=types.SimpleNamespace(max_cudagraph_capture_size=16),
            )
            self.llm_engine = types.SimpleNamespace(vllm_config=cfg)

        def generate(self, prompts, sp, use_tqdm=False):
            on_generate(prompts)
            out = types.SimpleNamespace(token_ids=[0] * sp.max_tokens)
            return [types.SimpleNamespace(outputs=[out]) for _ in prompts]

    return _LLM


def test_throughput_worker_repeats_report_the_median_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time
    import types

    import vllm

    walls = iter([4.0, 1.0, 2.0])  # three timed runs: 4, 1 and 2 s for the same output tokens
    clock = [0.0]
    seen_prompts = []

    def on_generate(prompts) -> None:
        if len(prompts) > throughput.WARMUP_PROMPTS:  # a timed run
            seen_prompts.append(prompts[0]["prompt_token_ids"])
            clock[0] += next(walls)

    monkeypatch.setattr(vllm, "LLM", _fake_llm(on_generate))
    fake_time = types.SimpleNamespace(monotonic=lambda: clock[0], perf_counter=time.perf_counter)
    monkeypatch.setattr(throughput, "time", fake_time)
    result = tmp_path / "int8.json"
    spec = {"plan": [[512, 500]], "max_model_len": 600}
    result.with_suffix(".spec.json").write_text(json.dumps(spec))
    args = throughput.parse_args(
        ["--worker", "--label", "int8", "--result", str(result), "--model", str(tmp_path),
         "--num-prompts", "10", "--output-len", "20", "--repeats", "3"]
    )  # fmt: skip
    assert throughput.worker(args) == 0
    got = json.loads(result.read_text())
    # 200 output tokens in 4, 1 and 2 s: the median run is the 2 s one
    assert got["rows"][0]["gen_tok_s"] == 100.0
    runs = got["extra"][0]["runs"]
    assert [r["gen_tok_s"] for r in runs] == [50.0, 200.0, 100.0]
    assert got["extra"][0]["wall_s"] == 2.0 and all(r["host_probe_ms"] > 0 for r in runs)
    assert len({tuple(p) for p in seen_prompts}) == 3  # each run on its own prompts
    assert throughput.lower_median([{"gen_tok_s": 3.0}, {"gen_tok_s": 1.0}]) == {"gen_tok_s": 1.0}


def test_throughput_refuses_zero_repeats(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        throughput.parse_args(["--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err


def test_throughput_pools_repeated_runs_from_logs(tmp_path: Path) -> None:
    row = {"dtype": "int8", "ctx": 1024, "num_prompts": 9, "output_len": 256}
    row |= {"kv_cache_tokens": 1000}
    logs = []
    for i, speed in enumerate((200.0, 300.0, 100.0)):
        logs.append(tmp_path / f"run{i}.log")
        logs[-1].write_text(f"[int8] ctx 1024: {json.dumps(row | {'gen_tok_s': speed})} in 1s\n")
    out = tmp_path / "t.json"

    def rows(*argv: str) -> list[dict]:
        assert throughput.main(["--rows-from-log", *argv, "--out", str(out)]) == 0
        return json.loads(out.read_text())["rows"]

    assert rows(*map(str, logs), "--pool") == [row | {"gen_tok_s": 200.0}]  # the median run
    assert " --pool" in json.loads(out.read_text())["command"]
    assert rows(*map(str, logs)) == [row | {"gen_tok_s": 100.0}]  # no --pool: the last log read
    assert rows(str(logs[0]), str(logs[1]), "--pool")[0]["gen_tok_s"] == 200.0  # the slower of 2
    logs[1].write_text(
        f"[int8] ctx 1024: {json.dumps(row | {'gen_tok_s': 1.0, 'num_prompts': 8})} in 1s\n"
    )
    with pytest.raises(ValueError, match="different workloads"):
        rows(*map(str, logs), "--pool")


# --paired: two resident engines taking turns. The fake workers below are real processes that
# follow the worker's protocol (throughput.Turns); each run is a sleep logged with its times.
_FAKE_PAIRED_WORKER = """
import sys, time
from pathlib import Path
from benchmarks import throughput as tp
label, folder, n, events = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
fail, start_s = sys.argv[5], float(sys.argv[6])

def log(what, k=-1):
    with open(events, "a") as f:
        f.write(f"{time.monotonic()} {label} {what} {k}\\n")

log("started")
if fail == "before_ready":
    sys.exit(3)
turns = tp.Turns(folder, label)
time.sleep(start_s)  # the engine starting
log("ready")
turns.ready()
for k in range(n):
    turns.wait_go(k)
    log("start", k)
    time.sleep(0.05)
    log("end", k)
    turns.done(k)
    if fail == "after_first_run":
        sys.exit(4)
turns.wait_go(n)
log("exit")
"""


def _paired_children(tmp_path: Path, n: int, fail_b: str = "", start_a: float = 0.2) -> list:
    script = tmp_path / "fake_worker.py"
    script.write_text(_FAKE_PAIRED_WORKER)
    events = tmp_path / "events.txt"
    return [
        (label, [sys.executable, str(script), label, str(tmp_path / "turns"), str(n),
                 str(events), fail, str(start)], common.with_repo_on_path(os.environ),
         tmp_path / f"{label}.log")
        for label, fail, start in (("a", "", start_a), ("b", fail_b, 0.2))
    ]  # fmt: skip


def _events(tmp_path: Path) -> list[tuple[float, str, str, int]]:
    lines = (tmp_path / "events.txt").read_text().split("\n")
    rows = [ln.split() for ln in lines if ln]
    return sorted((float(t), who, what, int(k)) for t, who, what, k in rows)


def test_paired_workers_take_turns_and_never_overlap(tmp_path: Path) -> None:
    results, order = throughput.run_paired(_paired_children(tmp_path, 3), tmp_path / "turns", 3, 60)
    assert [rc for rc, _, _ in results] == [0, 0], results
    assert order == [["a", "b"], ["b", "a"], ["a", "b"]]
    events = _events(tmp_path)
    # b's engine starts only once a's is ready (a's memory settled before b sizes its cache)
    assert events.index((*[e for e in events if e[1:3] == ("b", "started")][0],)) > events.index(
        [e for e in events if e[1:3] == ("a", "ready")][0]
    )
    runs = [(who, what, k) for _, who, what, k in events if what in ("start", "end")]
    # every run ends before the next one starts, in the order handed out
    assert runs == [
        (who, step, k) for k, pair in enumerate(order) for who in pair for step in ("start", "end")
    ]
    # neither leaves before both finished their runs (the exit gate)
    last_end = max(t for t, _, what, _ in events if what == "end")
    assert all(t > last_end for t, _, what, _ in events if what == "exit")


@pytest.mark.parametrize("fail_b", ["before_ready", "after_first_run"])
def test_paired_failure_stops_the_other_worker(tmp_path: Path, fail_b: str) -> None:
    import time

    t0 = time.monotonic()
    results, order = throughput.run_paired(
        _paired_children(tmp_path, 3, fail_b), tmp_path / "turns", 3, 60
    )
    assert time.monotonic() - t0 < 30  # not the 60 s deadline
    (rc_a, _, tail_a), (rc_b, _, _) = results
    assert rc_b == (3 if fail_b == "before_ready" else 4)
    assert rc_a == throughput.PAIR_STOPPED and "other engine of the pair failed" in tail_a
    assert order == ([] if fail_b == "before_ready" else [["a", "b"]])
    assert common.error_summary(tail_a).startswith("error: stopped")


def test_paired_first_failure_never_starts_the_second(tmp_path: Path) -> None:
    children = _paired_children(tmp_path, 2)
    children[0][1][-2] = "before_ready"  # a fails
    results, order = throughput.run_paired(children, tmp_path / "turns", 2, 60)
    assert results[0][0] == 3 and results[1][0] == throughput.PAIR_STOPPED
    assert "not started" in results[1][2] and order == []
    assert {who for _, who, _, _ in _events(tmp_path)} == {"a"}


def test_paired_timeout_kills_both(tmp_path: Path) -> None:
    # the deadline passes during the turns: both killed, -9, which main reports as "timeout"
    results, order = throughput.run_paired(
        _paired_children(tmp_path, 10_000), tmp_path / "turns", 10_000, 3
    )
    assert [rc for rc, _, _ in results] == [-9, -9] and order
    # ... or while the first engine is still starting: the second never starts
    children = _paired_children(tmp_path, 1, start_a=30)
    results, order = throughput.run_paired(children, tmp_path / "turns", 1, 2)
    assert results[0][0] == -9 and results[1][0] == throughput.PAIR_STOPPED and order == []
    assert "not started" in results[1][2]


def test_turns_exit_when_the_driver_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    turns = throughput.Turns(tmp_path, "int8")
    monkeypatch.setattr(throughput.os, "getppid", lambda: -1)
    with pytest.raises(SystemExit, match="driver is gone"):
        turns.wait_go(0)
    quiet = throughput.Turns(None, "int8")  # one configuration at a time: no files, no waiting
    quiet.ready(), quiet.wait_go(5), quiet.done(5)
    assert list(tmp_path.iterdir()) == []


def test_paired_worker_runs_only_inside_its_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's side: warm-ups (every context) before ``ready``; each timed run, prompts
    included, between its ``go`` and its ``done``; then it waits at the exit gate."""
    import time
    import types

    import vllm

    seen: list[tuple] = []

    def made_prompts(n, length, vocab, seed):
        seen.append(("prompts", n))
        return [[1] * length for _ in range(n)]

    monkeypatch.setattr(vllm, "LLM", _fake_llm(lambda ps: seen.append(("generate", len(ps)))))
    monkeypatch.setattr(throughput, "random_prompts", made_prompts)
    # the driver's side, as events: every go is given at once
    monkeypatch.setattr(throughput.Turns, "ready", lambda self: seen.append(("ready",)))
    monkeypatch.setattr(throughput.Turns, "wait_go", lambda self, k: seen.append(("go", k)))
    monkeypatch.setattr(throughput.Turns, "done", lambda self, k: seen.append(("done", k)))
    clock = iter(range(1000))  # every timed run takes 1 s
    fake_time = types.SimpleNamespace(monotonic=lambda: float(next(clock)), sleep=time.sleep,
                                      perf_counter=time.perf_counter)  # fmt: skip
    monkeypatch.setattr(throughput, "time", fake_time)
    result = tmp_path / "int8.json"
    spec = {"plan": [[512, 500], [300, 280]], "max_model_len": 600}
    result.with_suffix(".spec.json").write_text(json.dumps(spec))
    args = throughput.parse_args(
        ["--worker", "--label", "int8", "--result", str(result), "--model", str(tmp_path),
         "--num-prompts", "10", "--output-len", "20", "--repeats", "2",
         "--turns", str(tmp_path / "turns")]
    )  # fmt: skip
    assert throughput.worker(args) == 0
    warm = [("prompts", throughput.WARMUP_PROMPTS), ("generate", throughput.WARMUP_PROMPTS)]
    timed = [[("go", k), ("prompts", 10), ("generate", 10), ("done", k)] for k in range(4)]
    assert seen == [*warm, *warm, ("ready",), *sum(timed, []), ("go", 4)]  # the exit gate last
    assert len(json.loads(result.read_text())["rows"]) == 2


def test_throughput_main_paired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, throughput_model: list[str]
) -> None:
    """--paired hands both workers to run_paired (with --turns, the pair's doubled timeout) and
    keeps each turn pair's ratio, per context with its own turns' order; the rows stay each
    configuration's median run."""
    calls = []
    fa2, int8 = ["auto_fa2", "int8"], ["int8", "auto_fa2"]
    order = [fa2, int8, fa2, int8, fa2, int8]  # 3 repeats x 2 contexts

    def fake_paired(children, folder, n_turns, timeout_s):
        calls.append((children, folder, n_turns, timeout_s))
        for speed, (label, argv, env, _) in zip((100.0, 120.0), children, strict=True):
            assert argv[argv.index("--turns") + 1] == str(folder)
            assert ("INT8KV_SHIM" in env) == (label == "int8")
            result = Path(argv[argv.index("--result") + 1])
            rows, extra = [], []
            for ctx, slower in ((1024, 1.0), (2048, 2.0)):
                # host drift, both alike; at 2048 int8's last run meets a slower host alone
                drift = (1.0, 2.0, 0.5 / (slower if label == "int8" else 1.0))
                runs = [{"gen_tok_s": speed * f} for f in drift]
                row = {"dtype": label, "ctx": ctx, "num_prompts": 2, "output_len": 256}
                rows.append(row | {"gen_tok_s": speed, "kv_cache_tokens": 10})
                extra.append({"dtype": label, "ctx": ctx, "runs": runs})
            result.write_text(json.dumps({"rows": rows, "extra": extra}))
        return [(0, 1.0, "ok"), (0, 1.0, "ok")], order

    monkeypatch.setattr(throughput, "run_paired", fake_paired)
    out = tmp_path / "throughput.json"
    argv = [
        *throughput_model,
        "--out",
        str(out),
        "--configs",
        "auto_fa2,int8",
        "--ctx",
        "1024,2048",
    ]
    argv += ["--paired", "--repeats", "3", "--gpu-memory-utilization", "0.45", "--timeout", "50"]
    assert throughput.main(argv) == 0
    (children, folder, n_turns, timeout_s) = calls[0]
    assert [c[0] for c in children] == ["auto_fa2", "int8"]
    assert (n_turns, timeout_s, folder) == (6, 100, tmp_path / "w" / "turns")
    details = json.loads((tmp_path / "throughput_details.json").read_text())
    first, second = details["paired"]
    assert (first["a"], first["b"], first["ctx"], second["ctx"]) == ("auto_fa2", "int8", 1024, 2048)
    assert first["ratios"] == [1.2, 1.2, 1.2] and first["median_ratio"] == 1.2
    assert second["ratios"] == [1.2, 1.2, 0.6] and second["median_ratio"] == 1.2
    assert first["order"] == order[:3] and second["order"] == order[3:]
    # a later --append call keeps these entries
    monkeypatch.setattr(throughput.common, "run_child", lambda *a: (1, 0.0, "RuntimeError: x"))
    again = [*throughput_model, "--out", str(out), "--configs", "int8", "--ctx", "1024", "--append"]
    assert throughput.main(again) == 1
    assert json.loads((tmp_path / "throughput_details.json").read_text())["paired"] == [
        first,
        second,
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--configs", "auto_fa2,int8,auto_triton"], "--paired takes two --configs, got 3"),
        (["--configs", "auto_fa2,int8", "--profile"], "a profile would run during the other's"),
        (["--configs", "auto_fa2,int8"], "pass --gpu-memory-utilization 0.45"),  # default 0.5
    ],
)
def test_throughput_paired_refusals(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--paired", *extra]
    if "--profile" in extra:
        args += ["--gpu-memory-utilization", "0.4"]
    with pytest.raises(SystemExit):
        throughput.parse_args(args)
    assert message in capsys.readouterr().err


def test_throughput_worker_sizes_the_kv_memory_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    import vllm

    llm = _fake_llm(lambda prompts: time.sleep(0.02))
    monkeypatch.setattr(vllm, "LLM", llm)
    result = tmp_path / "int4.json"
    spec = {"plan": [[512, 500]], "max_model_len": 600}
    result.with_suffix(".spec.json").write_text(json.dumps(spec))
    base = ["--worker", "--label", "int4", "--result", str(result), "--model", str(tmp_path),
            "--num-prompts", "4", "--output-len", "20"]  # fmt: skip
    assert throughput.worker(throughput.parse_args(base)) == 0
    assert throughput.worker(throughput.parse_args([*base, "--kv-cache-memory-gib", "1.5"])) == 0
    assert "kv_cache_memory_bytes" not in llm.made[0]
    assert llm.made[1]["kv_cache_memory_bytes"] == 3 * 2**29
    # the driver hands it to each configuration's worker
    args = throughput.parse_args(["--kv-cache-memory-gib", "1.5"])
    command = throughput.worker_argv(args, "int4", result)
    assert command[command.index("--kv-cache-memory-gib") + 1] == "1.5"
