"""benchmarks/step_timing.py: the timers, their files, the per-point difference, the sync counting,
the ``sitecustomize`` that loads them, and that every site names a method of vLLM 0.24.0."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
import types
import warnings
from pathlib import Path

import pytest

from benchmarks import common, profile_summary, step_timing
from benchmarks.serve_bench import step_timing_env, step_timing_line


def test_every_site_is_a_method_of_vllm_0_24() -> None:
    """Read from vLLM's source (importing the model runners needs a GPU): a renamed method would
    leave its phase silently untimed."""
    for module, cls_name, method, _ in step_timing.SITES:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, module
        tree = ast.parse(Path(spec.origin).read_text())
        if cls_name is None:  # a module function: defined or imported at the module's top level
            names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} | {
                a.asname or a.name
                for n in tree.body
                if isinstance(n, ast.ImportFrom)
                for a in n.names
            }
            assert method in names, f"{module}.{method}"
            continue
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        assert cls_name in classes, f"{module}.{cls_name}"
        methods = {
            n.name
            for n in classes[cls_name].body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        assert method in methods, f"{module}.{cls_name}.{method}"
    assert step_timing.STEP_RANGE_SITES <= {site[:3] for site in step_timing.SITES}


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A module shaped like vLLM's engine core and runner, timed in place of the real sites."""
    name = "fake_engine_for_step_timing"
    mod = types.ModuleType(name)

    class Engine:
        def step(self) -> str:
            time.sleep(0.002)
            return "stepped"

    def varlen(x: int) -> int:
        return x * 2

    class Layer:
        def forward(self) -> str:
            return f"attended {mod.varlen(1)}"

    class Runner:
        layers: tuple = ()

        def execute_model(self, scheduler_output: object) -> object:
            for layer in self.layers:
                layer.forward()
            # an int comes back plus one, anything else as it came
            if isinstance(scheduler_output, int):
                return scheduler_output + 1
            return scheduler_output

        def sample_tokens(self, scheduler_output: object) -> str:
            return "sampled"

    mod.Engine, mod.Runner, mod.Layer = Engine, Runner, Layer  # type: ignore[attr-defined]
    mod.varlen = varlen  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(
        step_timing,
        "SITES",
        (
            (name, "Engine", "step", step_timing.ENGINE_STEP),
            (name, "Runner", "execute_model", "execute_model"),
            (name, "Runner", "sample_tokens", "sample_tokens"),
            (name, "Layer", "forward", "attention_forward"),
            (name, None, "varlen", "fa2_call"),
            (name, "Missing", "nothing", "never"),
            (name, None, "missing_function", "never"),
        ),
    )
    return mod


def test_install_times_each_site_and_writes_the_sums(fake_engine, tmp_path: Path) -> None:
    timer = step_timing.StepTimer()
    step_timing.install(timer, tmp_path, dump_every_s=0.05)
    engine, runner = fake_engine.Engine(), fake_engine.Runner()
    before = step_timing.read_snapshots(tmp_path)
    assert before == []  # nothing is written before a first call
    for i in range(3):
        assert engine.step() == "stepped"
        assert runner.execute_model(i) == i + 1
    deadline = time.time() + 5
    while time.time() < deadline and not step_timing.read_snapshots(tmp_path):
        time.sleep(0.02)
    time.sleep(0.2)
    after = step_timing.read_snapshots(tmp_path)
    assert [s["pid"] for s in after] == [os.getpid()]
    diff = step_timing.difference(before, after)
    assert diff["engine_steps"] == 3
    assert diff["phases"]["execute_model"]["calls"] == 3
    step = diff["phases"][step_timing.ENGINE_STEP]
    assert step["us_per_call"] >= 2000  # each step slept 2 ms
    assert step["ms_per_step"] == pytest.approx(step["us_per_call"] / 1000, rel=1e-3)
    assert "never" not in diff["phases"] and not diff["sync_debug"]


def scheduled(*tokens: int) -> types.SimpleNamespace:
    """A stand-in for vLLM's SchedulerOutput: each request's scheduled tokens."""
    per_request = {f"r{i}": n for i, n in enumerate(tokens)}
    return types.SimpleNamespace(
        num_scheduled_tokens=per_request, total_num_scheduled_tokens=sum(tokens)
    )


def test_step_kind_tells_decode_steps_from_steps_with_a_prompt_chunk() -> None:
    assert step_timing.step_kind(scheduled(1, 1, 1)) == step_timing.DECODE_STEP
    assert step_timing.step_kind(scheduled(1, 31, 1)) == step_timing.PROMPT_STEP
    assert step_timing.step_kind(scheduled(8192)) == step_timing.PROMPT_STEP
    # an empty step, or anything that is not a scheduler output, has no kind
    assert step_timing.step_kind(scheduled()) is None
    assert step_timing.step_kind(3) is None
    assert step_timing.step_kind(None) is None


def test_execute_model_is_also_timed_by_step_kind(fake_engine, tmp_path: Path) -> None:
    timer = step_timing.StepTimer()
    step_timing.install(timer, tmp_path, dump_every_s=60)
    runner = fake_engine.Runner()
    for out in (scheduled(1, 1), scheduled(1, 1), scheduled(1, 7)):
        assert runner.execute_model(out) is out
    runner.execute_model(scheduler_output=scheduled(5))  # passed by keyword
    runner.execute_model(4)  # not a scheduler output: the phase only
    assert runner.sample_tokens(scheduled(1, 7)) == "sampled"  # not a phase split by kind
    calls = timer.snapshot()["calls"]
    assert calls["execute_model"] == 5
    assert calls["execute_model.decode"] == 2 and calls["execute_model.prompt"] == 2
    assert calls["sample_tokens"] == 1 and not any(k.startswith("sample_tokens.") for k in calls)


def test_each_layers_attention_is_timed_by_the_kind_of_its_step(
    fake_engine, tmp_path: Path
) -> None:
    timer = step_timing.StepTimer()
    step_timing.install(timer, tmp_path, dump_every_s=60)
    runner = fake_engine.Runner()
    runner.layers = (fake_engine.Layer(), fake_engine.Layer())
    runner.execute_model(scheduled(1, 1))
    runner.execute_model(scheduled(1, 7))
    runner.execute_model(scheduled(1, 7))
    assert fake_engine.Layer().forward() == "attended 2"  # outside a step: the phase only
    calls = timer.snapshot()["calls"]
    assert calls["attention_forward"] == 7
    assert calls["attention_forward.decode"] == 2 and calls["attention_forward.prompt"] == 4
    # a module function called inside a layer's attention: timed per call and by step kind
    assert calls["fa2_call"] == 7 and calls["fa2_call.prompt"] == 4
    assert "never" not in calls
    assert timer.step_kind is None


def test_an_engine_step_takes_the_kind_of_the_model_step_it_ran(
    fake_engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = fake_engine.Runner()

    def step(self: object, out: object | None = None) -> str:
        if out is not None:
            runner.execute_model(out)
        return "stepped"

    monkeypatch.setattr(fake_engine.Engine, "step", step)
    timer = step_timing.StepTimer()
    step_timing.install(timer, tmp_path, dump_every_s=60)
    engine = fake_engine.Engine()
    for out in (scheduled(1, 1), scheduled(8), None, scheduled(1, 1)):
        engine.step(out)
    calls = timer.snapshot()["calls"]
    assert calls[step_timing.ENGINE_STEP] == 4
    assert calls["engine_step.decode"] == 2 and calls["engine_step.prompt"] == 1


def test_a_new_request_is_dated_where_the_engine_core_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Besides the call's own time, the scheduler's add_request adds the request's age (seconds
    since the API server stamped its arrival) to its REQUEST_AGE name."""
    name = "fake_scheduler_for_step_timing"
    mod = types.ModuleType(name)

    class Scheduler:
        def add_request(self, request: object) -> str:
            return "added"

    mod.Scheduler = Scheduler  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(step_timing, "SITES", ((name, "Scheduler", "add_request", "add_request"),))
    timer = step_timing.StepTimer()
    step_timing.install(timer, tmp_path, dump_every_s=60)
    scheduler = Scheduler()
    assert scheduler.add_request(types.SimpleNamespace(arrival_time=time.time() - 0.5)) == "added"
    scheduler.add_request(request=types.SimpleNamespace(arrival_time=time.time() - 0.25))
    scheduler.add_request(types.SimpleNamespace())  # no arrival stamp: the call's time only
    snap = timer.snapshot()
    age = step_timing.REQUEST_AGE["add_request"]
    assert snap["calls"]["add_request"] == 3 and snap["calls"][age] == 2
    assert 0.75 <= snap["seconds"][age] < 5
    assert snap["seconds"]["add_request"] < 0.5  # the call itself is quick


def test_an_api_server_coroutine_is_timed_until_it_returns_and_dates_its_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A coroutine method (the API server's rendering and sending of a request) is timed until its
    coroutine returns, not until it is created, and the send dates the request it is handed."""
    import asyncio

    name = "fake_api_server_for_step_timing"
    mod = types.ModuleType(name)

    class Renderer:
        async def render_cmpl_async(self, prompts: list) -> list:
            await asyncio.sleep(0.2)
            return prompts

    class Client:
        async def add_request_async(self, request: object) -> None:
            await asyncio.sleep(0)

    mod.Renderer, mod.Client = Renderer, Client  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(step_timing, "SITES", (
        (name, "Renderer", "render_cmpl_async", step_timing.RENDER),
        (name, "Client", "add_request_async", "send_request"),
    ))  # fmt: skip
    timer = step_timing.StepTimer()
    step_timing.install(timer, tmp_path, dump_every_s=60)

    async def serve() -> list:
        rendered = await Renderer().render_cmpl_async(["p"])
        await Client().add_request_async(types.SimpleNamespace(arrival_time=time.time() - 0.5))
        return rendered

    assert asyncio.run(serve()) == ["p"]
    snap = timer.snapshot()
    assert 0.2 <= snap["seconds"][step_timing.RENDER] < 5
    age = step_timing.REQUEST_AGE["send_request"]
    assert snap["calls"]["send_request"] == 1 and 0.5 <= snap["seconds"][age] < 5
    assert step_timing.REQUEST_MILESTONES[0] == step_timing.RENDER


def test_v2_execute_model_is_a_step_range_for_the_profiler(
    fake_engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The V2 runner's execute_model (its site in STEP_RANGE_SITES) is a range in a torch
    profiler's trace, which benchmarks/profile_summary.py reads as a step; other sites are not."""
    import torch

    name = fake_engine.__name__
    monkeypatch.setattr(step_timing, "STEP_RANGE_SITES", {(name, "Runner", "execute_model")})
    step_timing.install(step_timing.StepTimer(), tmp_path, dump_every_s=60)
    runner = fake_engine.Runner()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(3):
            assert runner.execute_model(torch.ones(1) * i) is not None
        runner.sample_tokens(1)
    ranges = [e for e in prof.events() if e.name == step_timing.STEP_RANGE]
    assert len(ranges) == 3
    assert step_timing.STEP_RANGE == profile_summary.STEP_ANNOTATION_V2


def snap(pid: int, calls: dict, seconds: dict, syncs: dict | None = None) -> dict:
    return {
        "pid": pid,
        "calls": calls,
        "seconds": seconds,
        "sync_debug": syncs is not None,
        "syncs": syncs or {},
        "sync_stacks": {k: [f"stack of {k}"] for k in syncs or {}},
    }


def test_difference_is_the_interval_summed_over_processes() -> None:
    before = [snap(1, {"engine_step": 10, "schedule": 10}, {"engine_step": 0.03, "schedule": 0.01})]
    after = [
        snap(1, {"engine_step": 30, "schedule": 30}, {"engine_step": 0.09, "schedule": 0.02}),
        # a process that started in the interval counts from zero
        snap(2, {"execute_model": 20}, {"execute_model": 0.04}),
    ]
    diff = step_timing.difference(before, after)
    assert diff["engine_steps"] == 20
    assert diff["phases"]["engine_step"] == {"calls": 20, "us_per_call": 3000.0, "ms_per_step": 3.0}
    assert diff["phases"]["schedule"]["ms_per_step"] == pytest.approx(0.5)
    assert diff["phases"]["execute_model"]["ms_per_step"] == pytest.approx(2.0)


def test_difference_counts_only_the_syncs_of_the_interval() -> None:
    before = [snap(1, {"engine_step": 1}, {"engine_step": 0.001}, {"a.py:1": 4})]
    after = [snap(1, {"engine_step": 3}, {"engine_step": 0.003}, {"a.py:1": 4, "b.py:2": 5})]
    diff = step_timing.difference(before, after)
    assert diff["sync_debug"] and diff["syncs"] == {"b.py:2": 5}
    assert diff["sync_stacks"] == {"b.py:2": ["stack of b.py:2"]}
    line = step_timing_line(diff)
    assert line.startswith("2 steps, engine_step 1.0 ms") and "5 synchronizing" in line


def test_sync_debug_starts_after_the_warm_up_and_counts_by_line(monkeypatch) -> None:
    import torch

    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    timer = step_timing.StepTimer(sync_debug=True, warmup_steps=2)
    with warnings.catch_warnings():
        timer.add(step_timing.ENGINE_STEP, 0.001)
        assert modes == []  # start-up and the first steps sync on purpose
        timer.add(step_timing.ENGINE_STEP, 0.001)
        assert modes == ["warn"]
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        with pytest.warns(DeprecationWarning):  # other warnings still reach their handlers
            warnings.warn("unrelated", DeprecationWarning, stacklevel=1)
    (where, n), *_ = timer.snapshot()["syncs"].items()
    assert n == 3 and where.startswith(__file__)
    assert any("test_sync_debug_starts" in line for line in timer.sync_stacks[where])


def test_step_timing_env_leads_the_path_and_empties_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "steps" / "m_int8"
    folder.mkdir(parents=True)
    (folder / "steps_1.json").write_text("{}")
    args = types.SimpleNamespace(sync_debug=True)
    env = step_timing_env(args, {"PYTHONPATH": "/bundle/site"}, folder)
    assert env["PYTHONPATH"].split(os.pathsep) == [
        str(step_timing.SITE),
        str(common.REPO),
        "/bundle/site",
    ]
    assert env[step_timing.STEP_TIMING_DIR] == str(folder)
    assert env[step_timing.SYNC_DEBUG] == "1"
    assert not folder.exists()
    args.sync_debug = False
    assert step_timing.SYNC_DEBUG not in step_timing_env(args, {}, folder)


def test_sitecustomize_installs_and_runs_the_one_it_shadows(tmp_path: Path) -> None:
    shadowed = tmp_path / "other_site"
    shadowed.mkdir()
    (shadowed / "sitecustomize.py").write_text("print('shadowed sitecustomize ran')\n")
    steps = tmp_path / "steps"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(step_timing.SITE), str(common.REPO), str(shadowed)])
    env[step_timing.STEP_TIMING_DIR] = str(steps)
    code = "import wrapt, sys; print('hooks', len(wrapt.importer._post_import_hooks) > 0)"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "shadowed sitecustomize ran" in proc.stdout
    assert "hooks True" in proc.stdout and "not installed" not in proc.stderr
    assert steps.is_dir()


def test_a_forked_child_writes_its_own_sums(tmp_path: Path) -> None:
    """A process forked from a timed one (an offline LLM's engine core) gets a writer thread of
    its own and counts from zero: its file holds its calls only, the parent's its own."""
    code = textwrap.dedent(f"""
        import os, time
        from pathlib import Path
        from benchmarks import step_timing
        timer = step_timing.StepTimer()
        step_timing.install(timer, Path({str(tmp_path)!r}), dump_every_s=0.05)
        call = timer.timed("schedule")
        call(lambda: None, None, (), {{}})
        pid = os.fork()
        if pid == 0:
            call(lambda: None, None, (), {{}})
            call(lambda: None, None, (), {{}})
            time.sleep(0.5)
            os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.3)
        print(pid)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=common.REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    child = int(proc.stdout.split()[-1])
    calls = {s["pid"]: s["calls"] for s in step_timing.read_snapshots(tmp_path)}
    assert calls[child] == {"schedule": 2}
    assert [c for pid, c in calls.items() if pid != child] == [{"schedule": 1}]
