"""CPU time of a ``vllm serve`` process tree by role, read from ``/proc`` (Linux).

Why: most of a serving point's TTFT is spent outside the engine core, and vLLM stamps a
request's arrival in the API server before it tokenizes the prompt. The API server is one Python
process whose event loop also turns every engine step's output into a streamed message for each
request, so an engine that steps faster gives it more to do per second; whether it runs out of
CPU is told by its CPU seconds over a point against the point's wall time. The engine core (a
child process, titled ``VLLM::EngineCore`` by vLLM) is read apart, so its own busy loop is not
mistaken for the API server's.

:func:`snapshot` reads every process of the tree once (``utime`` + ``stime`` of
``/proc/PID/stat``, the process's threads together, not its waited-for children's, and of
``/proc/PID/task/PID/stat``, its main thread's); :func:`point_cpu` turns two snapshots into each
role's CPU seconds in between and their fraction of the wall time; :func:`client_cpu` does the
same for the benchmark's client, a child the caller waits for (``getrusage``). A process that ends
between two snapshots loses what it spent since the first (``/proc`` keeps nothing of it); one
that starts in between counts from its start. Nothing here raises: off Linux, or where ``/proc``
cannot be read, a snapshot is ``{}`` and so is a point.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

PROC = Path("/proc")
# roles, in the order a row lists them: the launched process itself (plus any API server
# process vLLM starts with --api-server-count > 1), the engine core(s), and every other
# descendant (multiprocessing's resource tracker, tensor-parallel workers, ...); then the
# benchmark's client, which is not the server's (client_cpu)
ROLES = ("api_server", "engine_core", "other")
CLIENT_ROLE = "bench_client"
# vLLM's set_process_title: "VLLM::EngineCore" (or EngineCore_DP<r>) in the command line;
# the 15-byte comm keeps "VLLM::EngineCor", so the match is on that prefix
ENGINE_CORE_TITLE = "EngineCor"
API_SERVER_TITLE = "APIServer"  # "VLLM::APIServer_<i>" of a multi-API-server vllm serve

# (pid, start time in clock ticks: tells a reused pid apart) -> (role, CPU seconds so far, of
# them its main thread's, None where unreadable): a process's threads together can be busier
# than one core while its main thread, which runs its event loop or busy loop, is not saturated,
# and the other way round
Snapshot = dict[tuple[int, int], tuple[str, float, float | None]]


def _stat(proc_root: Path, pid: int) -> tuple[int, int, int]:
    """(parent pid, utime + stime in clock ticks, start time in clock ticks) of ``pid``.

    The fields after the command name, which may hold spaces and parentheses, are counted from
    its last ``)``: the state is field 3, the parent 4, utime and stime 14 and 15, the start 22.
    """
    fields = _stat_fields(proc_root / str(pid) / "stat")
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])


def _stat_fields(path: Path) -> list[str]:
    """A ``stat`` file's fields from the state on (field 3 of ``proc(5)`` is index 0)."""
    text = path.read_text()
    return text[text.rindex(")") + 2 :].split()


def _main_thread_ticks(proc_root: Path, pid: int) -> int | None:
    """utime + stime of ``pid``'s main thread (its task of the same id), None if unreadable."""
    try:
        fields = _stat_fields(proc_root / str(pid) / "task" / str(pid) / "stat")
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def _role(proc_root: Path, pid: int, root_pid: int) -> str:
    """``pid``'s role by its title (command line, else comm); raises OSError when it is gone."""
    if pid == root_pid:
        return "api_server"
    cmdline = (proc_root / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ")
    title = cmdline.decode(errors="replace") + " " + (proc_root / str(pid) / "comm").read_text()
    if ENGINE_CORE_TITLE in title:
        return "engine_core"
    if API_SERVER_TITLE in title:
        return "api_server"
    return "other"


def snapshot(root_pid: int, proc_root: Path = PROC) -> Snapshot:
    """Each process of the tree under ``root_pid`` (itself included) with its role and CPU
    seconds so far; ``{}`` off Linux, where ``proc_root`` cannot be read or ``root_pid`` is gone.

    ``root_pid`` is the API server: the process ``serve_bench.py`` starts is ``python -m
    vllm.entrypoints.cli.main serve`` itself, no shell in between. Children are found by every
    process's parent pid (one pass over ``proc_root``), which needs no kernel option, unlike
    ``/proc/PID/task/TID/children``. A process that is gone before it is read is skipped.
    """
    if not sys.platform.startswith("linux"):
        return {}
    try:
        tick = os.sysconf("SC_CLK_TCK")
        pids = [int(p.name) for p in proc_root.iterdir() if p.name.isdigit()]
    except (OSError, ValueError):
        return {}
    stats: dict[int, tuple[int, int, int]] = {}
    for pid in pids:
        try:
            stats[pid] = _stat(proc_root, pid)
        except (OSError, ValueError, IndexError):  # gone since the listing
            continue
    if root_pid not in stats:
        return {}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out: Snapshot = {}
    todo, seen = [root_pid], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(children.get(pid, ()))
        try:
            role = _role(proc_root, pid, root_pid)
        except OSError:  # gone since its stat was read
            continue
        _, ticks, start = stats[pid]
        main = _main_thread_ticks(proc_root, pid)
        out[(pid, start)] = (role, ticks / tick, None if main is None else main / tick)
    return out


def by_role(snap: Snapshot) -> dict[str, float]:
    """A snapshot's CPU seconds so far summed by role (only the roles it has)."""
    out: dict[str, float] = {}
    for role, seconds, _ in snap.values():
        out[role] = out.get(role, 0.0) + seconds
    return {role: out[role] for role in ROLES if role in out}


def cpu_seconds(root_pid: int, proc_root: Path = PROC) -> dict[str, float]:
    """Role -> CPU seconds so far of the tree under ``root_pid``; ``{}`` where unreadable."""
    return by_role(snapshot(root_pid, proc_root))


def point_cpu(
    before: Snapshot, after: Snapshot, wall_s: float, run_s: float | None = None
) -> dict[str, dict[str, float]]:
    """Each role's CPU seconds between two snapshots (``cpu_s``, 2 decimals) and their fraction
    of ``wall_s`` (``busy``, 3 decimals; above 1 where a role's threads or processes ran at
    once), and with ``run_s`` also of that (``busy_run``): the same seconds over a shorter span
    that holds the work, as ``vllm bench serve``'s own ``duration`` (first request sent to last
    answer) does inside the command's wall time, which also holds its start-up.

    Also the busiest main thread of the role's processes: its seconds (``main_thread_cpu_s``)
    and, with ``run_s``, their fraction of it (``main_thread_busy_run``; 1.0 is a saturated
    thread), where every process of the role had its main thread read.

    A process counts what it spent after ``before`` (all it spent, if it started after); the
    role is its role in ``after``. ``{}`` when either snapshot is empty or ``wall_s`` is not
    positive: no figure rather than a wrong one.
    """
    if not before or not after or wall_s <= 0:
        return {}
    spent: dict[str, float] = {}
    main: dict[str, float | None] = {}
    for key, (role, seconds, main_s) in after.items():
        was, was_main = before[key][1:] if key in before else (0.0, 0.0)
        spent[role] = spent.get(role, 0.0) + max(seconds - was, 0.0)
        if main_s is None or was_main is None or main.get(role, 0.0) is None:
            main[role] = None
        else:
            main[role] = max(main.get(role, 0.0) or 0.0, main_s - was_main, 0.0)
    out: dict[str, dict[str, float]] = {}
    for role in ROLES:
        if role not in spent:
            continue
        figures = role_figures(spent[role], wall_s, run_s)
        if (thread := main[role]) is not None:
            figures["main_thread_cpu_s"] = round(thread, 2)
            if run_s and run_s > 0:
                figures["main_thread_busy_run"] = round(thread / run_s, 3)
        out[role] = figures
    return out


def role_figures(seconds: float, wall_s: float, run_s: float | None = None) -> dict[str, float]:
    """``cpu_s`` (2 decimals), ``busy`` = over ``wall_s`` and, with ``run_s``, ``busy_run`` (3
    decimals) of ``seconds`` of CPU time."""
    figures = {"cpu_s": round(seconds, 2), "busy": round(seconds / wall_s, 3)}
    if run_s and run_s > 0:
        figures["busy_run"] = round(seconds / run_s, 3)
    return figures


def waited_children_cpu_s() -> float | None:
    """CPU seconds so far of this process's ended and waited-for children (``getrusage``), None
    where the platform has no such count: read around a child the caller waits for (``vllm bench
    serve``, the client whose clock gives TTFT and TPOT), it is that child's CPU time."""
    try:
        import resource
    except ImportError:
        return None
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def client_cpu(
    before_s: float | None, after_s: float | None, wall_s: float, run_s: float | None = None
) -> dict[str, float]:
    """:func:`role_figures` of the client's CPU seconds between two
    :func:`waited_children_cpu_s` (``{}`` without both or a positive ``wall_s``). One Python
    process reads every streamed token of the point, so when it is busy all the time the
    latencies it measures hold its own waits."""
    if before_s is None or after_s is None or wall_s <= 0:
        return {}
    return role_figures(max(after_s - before_s, 0.0), wall_s, run_s)


def busy_line(figures: Mapping[str, Mapping[str, float]]) -> str:
    """A point's :func:`point_cpu` in a few words: each role's ``busy`` (and ``busy_run``, and
    its main thread's)."""
    parts = []
    for role, f in figures.items():
        part = f"{role} {f['busy']:.2f}"
        if "busy_run" in f:
            part += f"/{f['busy_run']:.2f}"
        if "main_thread_busy_run" in f:
            part += f" (main thread {f['main_thread_busy_run']:.2f})"
        parts.append(part)
    return ", ".join(parts)
