"""CPU tests of ``benchmarks/process_cpu.py``: the ``/proc`` reader on real processes (this one
and children that burn CPU, one titled as vLLM titles its engine core), on a made-up ``/proc``
(parsing, processes gone mid-read, what is outside the tree), and the per-point figures."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import process_cpu as pc

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# a server stand-in: two children that burn CPU for a while, one titled as vLLM titles its engine
# core, then all three wait for the stdin they share to close
BURNER = """
import sys, time
{title}
t = time.monotonic()
while time.monotonic() - t < 0.4:
    pass
sys.stdin.read()
"""
TITLE = "import setproctitle; setproctitle.setproctitle('VLLM::EngineCore')"
CODES = [BURNER.format(title=""), BURNER.format(title=TITLE)]
TREE = f"""
import subprocess, sys
kids = [subprocess.Popen([sys.executable, "-c", code]) for code in {CODES!r}]
sys.stdin.read()
for kid in kids:
    kid.wait()
"""


def _burn(seconds: float) -> None:
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass


@linux
def test_this_process_is_the_api_server_and_its_cpu_counts() -> None:
    before = pc.snapshot(os.getpid())
    t0 = time.monotonic()
    _burn(0.2)
    after = pc.snapshot(os.getpid())
    wall = time.monotonic() - t0
    mine = [(role, s) for (pid, _), (role, s, _) in after.items() if pid == os.getpid()]
    assert len(mine) == 1 and mine[0][0] == "api_server"
    figures = pc.point_cpu(before, after, wall_s=wall, run_s=wall)
    assert figures["api_server"]["cpu_s"] >= 0.15 and figures["api_server"]["busy"] > 0.5
    # this thread is the main one: it burnt the time
    assert figures["api_server"]["main_thread_cpu_s"] >= 0.15
    assert figures["api_server"]["main_thread_busy_run"] > 0.5
    assert pc.cpu_seconds(os.getpid())["api_server"] >= mine[0][1]


@linux
def test_children_that_burn_cpu_by_role() -> None:
    """Under a root process of its own (as ``vllm serve`` is to serve_bench), a plain child
    counts as ``other`` and one titled ``VLLM::EngineCore`` as ``engine_core``: what each burns
    between two snapshots shows up, the root's own idle wait does not."""
    root = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE)
    try:
        before = pc.snapshot(root.pid)
        t0 = time.monotonic()
        deadline = t0 + 30
        while time.monotonic() < deadline:
            now = pc.cpu_seconds(root.pid)
            if now.get("other", 0) >= 0.35 and now.get("engine_core", 0) >= 0.35:
                break
            time.sleep(0.05)
        after = pc.snapshot(root.pid)
        wall = time.monotonic() - t0
    finally:
        root.communicate(timeout=30)
    assert len(after) == 3 and root.pid in {pid for pid, _ in after}
    figures = pc.point_cpu(before, after, wall)
    assert list(figures) == ["api_server", "engine_core", "other"]
    assert figures["other"]["cpu_s"] > 0.1 and figures["engine_core"]["cpu_s"] > 0.1
    assert figures["api_server"]["cpu_s"] < figures["other"]["cpu_s"]
    assert pc.snapshot(root.pid) == {}  # gone: nothing to read


def test_point_figures_from_two_snapshots() -> None:
    before = {
        (1, 10): ("api_server", 5.0, 4.0),
        (2, 11): ("engine_core", 3.0, 2.0),
        (3, 12): ("other", 1.0, 1.0),  # ends before the second snapshot: its last part is lost
        (5, 13): ("other", 2.0, 2.0),
    }
    after = {
        (1, 10): ("api_server", 6.5, 4.9),
        (2, 11): ("engine_core", 5.0, 3.5),
        (3, 99): ("other", 0.5, 0.5),  # pid 3 again, a new process: all of it is in the point
        (4, 20): ("other", 0.25, None),  # started in between; its main thread unread
        (5, 13): ("other", 2.0, 2.0),
    }
    # each role's main thread: the busiest of its processes' (none where one was unread)
    assert pc.point_cpu(before, after, wall_s=2.0, run_s=1.5) == {
        "api_server": {"cpu_s": 1.5, "busy": 0.75, "busy_run": 1.0, "main_thread_cpu_s": 0.9,
                       "main_thread_busy_run": 0.6},
        "engine_core": {"cpu_s": 2.0, "busy": 1.0, "busy_run": 1.333, "main_thread_cpu_s": 1.5,
                        "main_thread_busy_run": 1.0},
        "other": {"cpu_s": 0.75, "busy": 0.375, "busy_run": 0.5},
    }  # fmt: skip
    two_api_servers = {**after, (6, 21): ("api_server", 1.2, 1.2)}
    assert pc.point_cpu(before, two_api_servers, 2.0, 1.5)["api_server"]["main_thread_cpu_s"] == 1.2
    figures = pc.point_cpu(before, after, wall_s=3.0)
    # no run_s: no busy_run
    assert figures["api_server"] == {"cpu_s": 1.5, "busy": 0.5, "main_thread_cpu_s": 0.9}
    assert pc.busy_line(figures) == "api_server 0.50, engine_core 0.67, other 0.25"
    assert pc.busy_line(pc.point_cpu(before, after, 2.0, 1.5)).startswith(
        "api_server 0.75/1.00 (main thread 0.60), engine_core"
    )
    assert pc.by_role(after) == {"api_server": 6.5, "engine_core": 5.0, "other": 2.75}
    # no figures rather than wrong ones
    assert pc.point_cpu({}, after, 2.0) == {} and pc.point_cpu(before, {}, 2.0) == {}
    assert pc.point_cpu(before, after, 0.0) == {}


def _stat(pid: int, comm: str, ppid: int, utime: int, stime: int, start: int) -> str:
    # fields 3 on: state ppid pgrp sid tty_nr tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime priority nice num_threads itrealvalue starttime vsize ...
    rest = ["S", ppid, pid, pid, 0, -1, 0, 0, 0, 0, 0, utime, stime, 7777, 7777, 20, 0, 1, 0,
            start, 0]  # fmt: skip
    return f"{pid} ({comm}) " + " ".join(map(str, rest)) + "\n"


def _process(root: Path, pid: int, comm: str, ppid: int, ticks: int, cmdline: str | None) -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "stat").write_text(_stat(pid, comm, ppid, ticks, ticks, 1000 + pid))
    if cmdline is not None:
        (d / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode() + b"\0")
        (d / "comm").write_text(comm[:15] + "\n")


@linux
def test_made_up_proc_tree_skips_what_is_gone_and_what_is_outside(tmp_path: Path) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    _process(tmp_path, 100, "python3", 1, tick, "python3 -m vllm.entrypoints.cli.main serve m")
    # comm with a space and parentheses: parsed from its last ')'
    _process(tmp_path, 101, "VLLM::EngineCor", 100, 2 * tick, "VLLM::EngineCore")
    _process(tmp_path, 102, "odd) (name", 101, 3 * tick, "python3 -c x")  # a grandchild
    _process(tmp_path, 103, "python3", 100, 4 * tick, None)  # gone after its stat was read
    (tmp_path / "104").mkdir()  # gone after the listing: no stat
    _process(tmp_path, 105, "bash", 1, 5 * tick, "bash")  # not in the tree
    _process(tmp_path, 106, "VLLM::APIServer", 100, 6 * tick, "VLLM::APIServer_1")
    (tmp_path / "self").mkdir()
    # the engine core's main thread, read from its task of the same id
    (tmp_path / "101" / "task" / "101").mkdir(parents=True)
    (tmp_path / "101" / "task" / "101" / "stat").write_text(
        _stat(101, "VLLM::EngineCor", 100, tick // 2, tick // 2, 1101)
    )
    snap = pc.snapshot(100, tmp_path)
    assert snap == {
        (100, 1100): ("api_server", 2.0, None),
        (101, 1101): ("engine_core", 4.0, 1.0),
        (102, 1102): ("other", 6.0, None),
        (106, 1106): ("api_server", 12.0, None),
    }
    assert pc.cpu_seconds(100, tmp_path) == {"api_server": 14.0, "engine_core": 4.0, "other": 6.0}
    assert pc.snapshot(101, tmp_path) == {
        (101, 1101): ("api_server", 4.0, 1.0),  # the root is the API server, whatever its title
        (102, 1102): ("other", 6.0, None),
    }
    assert pc.snapshot(104, tmp_path) == {} and pc.snapshot(999, tmp_path) == {}


def test_no_proc_gives_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert pc.snapshot(os.getpid(), tmp_path / "missing") == {}
    assert pc.cpu_seconds(os.getpid(), tmp_path / "missing") == {}
    (tmp_path / "not_a_folder").write_text("")
    assert pc.snapshot(os.getpid(), tmp_path / "not_a_folder") == {}
    monkeypatch.setattr(sys, "platform", "darwin")
    assert pc.snapshot(os.getpid()) == {} and pc.cpu_seconds(os.getpid()) == {}


def test_the_client_is_a_waited_for_child_and_its_cpu_counts() -> None:
    before = pc.waited_children_cpu_s()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    after = pc.waited_children_cpu_s()
    if before is None:  # no getrusage here
        assert after is None and pc.client_cpu(before, after, 1.0) == {}
        return
    figures = pc.client_cpu(before, after, wall_s=1.0, run_s=0.5)
    assert figures["cpu_s"] >= 0.25 and figures["busy_run"] == pytest.approx(
        2 * figures["busy"], abs=0.002
    )
    # no figures rather than wrong ones
    assert pc.client_cpu(None, after, 1.0) == {} and pc.client_cpu(before, after, 0.0) == {}
    assert pc.client_cpu(2.0, 1.0, 1.0) == {"cpu_s": 0.0, "busy": 0.0}
