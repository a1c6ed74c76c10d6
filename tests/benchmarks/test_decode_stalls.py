"""benchmarks/decode_stalls.py on CPU: the aggregation of a Proton PC-sampling tree (built here in
the format Proton 3.6 writes: a sampled line's node ``<file>:<line>@<kernel>`` below the kernel's
node, one ``stalled_<reason>`` value per warp state, ``num_samples`` counting CUPTI's not-issued
copy too, the root holding zeros as hints, the device table after it), the run's JSON when
profiling succeeds or fails, and the report's tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import decode_stalls as ds
from benchmarks import report

REPO = Path(__file__).resolve().parents[2]
# Proton's PCSamplingMetric value names (third_party/proton/csrc/include/Data/Metric.h)
REASONS = ["branch_resolving", "no_instruction", "short_scoreboard", "wait", "long_scoreboard",
           "tex_throttle", "barrier", "membar", "imc_miss", "mio_throttle", "math_pipe_throttle",
           "drain", "lg_throttle", "not_Selected", "misc", "dispatch_stall", "sleeping",
           "selected"]  # fmt: skip


def line_of(name: str, text: str) -> int:
    lines = (REPO / "kernels" / name).read_text().splitlines()
    return next(i for i, t in enumerate(lines, 1) if text in t)


def pc(**stalls: int) -> dict:
    """A sampled node's metrics as Proton writes them."""
    metrics = {f"stalled_{r}": stalls.get(r, 0) for r in REASONS}
    n = sum(stalls.values())
    return {"num_samples": 2 * n, "num_stalled_samples": n, **metrics}


def node(name: str, metrics: dict | None = None, *children: dict) -> dict:
    return {"frame": {"name": name, "type": "function"}, "metrics": metrics or {},
            "children": list(children)}  # fmt: skip


FWD = line_of("attention_int4.py", "def _attn_int4_fwd")
STEP = line_of("attention_plan.py", "def softmax_step")


def tree() -> list:
    kernel = {"time (ns)": 107000000, "count": 200, "device_id": "0", "device_type": "CUDA"}
    attn = node(
        "_attn_int4_fwd",
        {**kernel, **pc(long_scoreboard=5)},  # PCs with no source line
        node(f"/site/int8kv_kernels/attention_int4.py:{FWD}@_attn_int4_fwd",
             pc(long_scoreboard=60, selected=10, wait=5, barrier=1)),
        node(f"//gone/kernels/attention_plan.py:{STEP}@_attn_int4_fwd",
             pc(math_pipe_throttle=20, long_scoreboard=4)),
        node("/site/triton/language/standard.py:300@_attn_int4_fwd",
             pc(short_scoreboard=2, not_Selected=1)),
    )  # fmt: skip
    merge = node(
        "merge_splits",
        kernel,
        node(f"/site/int8kv_kernels/attention_plan.py:{STEP}@merge_splits", pc(wait=1000)),
    )
    hints = {**{k: 0 for k in pc()}, "time (ns)": 0, "count": 0}
    return [node("ROOT", hints, attn, merge), {"CUDA": {"0": {"arch": "90", "num_sms": 132}}}]


def test_only_the_matching_kernels_samples_are_counted_by_state_and_line() -> None:
    got = ds.summarize(tree(), "_attn", top_lines=2)
    assert got["kernels"] == {"merge_splits": 1000, "_attn_int4_fwd": 108}
    assert got["samples"] == 108 and got["samples_without_line"] == 5
    assert [(s["reason"], s["samples"]) for s in got["stalls"]] == [
        ("long_scoreboard", 69), ("math_pipe_throttle", 20), ("selected", 10), ("wait", 5),
        ("short_scoreboard", 2), ("barrier", 1), ("not_selected", 1),
    ]  # fmt: skip
    assert got["stalls"][0]["fraction"] == pytest.approx(69 / 108)
    first, second = got["lines"]  # top_lines=2: the third line is left out
    assert first["where"] == f"kernels/attention_int4.py:{FWD}"
    assert first["text"].startswith("def _attn_int4_fwd")
    assert (first["samples"], first["fraction"]) == (76, pytest.approx(76 / 108))
    assert first["stalls"] == [{"reason": "long_scoreboard", "samples": 60},
                               {"reason": "selected", "samples": 10},
                               {"reason": "wait", "samples": 5}]  # fmt: skip
    # a kernels file Proton named by a path not on this machine is read from the repository
    assert second["where"] == f"kernels/attention_plan.py:{STEP}"
    assert second["text"].startswith("def softmax_step")


def test_a_line_outside_the_kernels_keeps_its_path_and_no_sample_is_lost() -> None:
    got = ds.summarize(tree()[0], "_attn_int4_fwd$")  # the root alone, not the list
    last = got["lines"][-1]
    assert (last["where"], last["text"], last["samples"]) == (
        "/site/triton/language/standard.py:300", "", 3)  # fmt: skip
    assert sum(ln["samples"] for ln in got["lines"]) + got["samples_without_line"] == 108
    assert ds.summarize(tree(), "no_such_kernel")["samples"] == 0


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """main() with the GPU parts replaced: a 0.5 ms launch moving 2 GB, copy bandwidth 5000."""
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    monkeypatch.setattr(ds, "copy_bw_gbs", lambda: 5000.0)
    monkeypatch.setattr(ds, "decode_launch", lambda *a: (lambda: None, 2 * 10**9))
    monkeypatch.setattr(ds, "graph_ms", lambda fn: 0.5)
    out = tmp_path / "stalls.json"
    return out, ["--impls", "int4", "int8", "--out", str(out)]


def test_run_records_time_bandwidth_and_the_summary_of_each_impls_profile(offline, monkeypatch):
    out, argv = offline

    def profile(fn, launches, stem):
        path = Path(f"{stem}.hatchet")
        path.write_text(json.dumps(tree()))
        return path

    monkeypatch.setattr(ds, "profile", profile)
    ds.main(argv)
    doc = json.loads(out.read_text())
    assert doc["gpu"] == "GPU" and doc["peak_bw_gbs"] == 5000.0 and doc["launches"] == 200
    int4, int8 = doc["rows"]
    assert (int4["impl"], int4["tail_tokens"], int8["impl"]) == ("int4", 13, "int8")
    assert "tail_tokens" not in int8
    assert int4["us"] == 500.0 and int4["gbs"] == pytest.approx(4000.0)
    assert int4["raw"] == "stalls_int4.hatchet" and (out.parent / int4["raw"]).exists()
    assert int4["samples"] == 108 and int4["lines"][0]["samples"] == 76


def test_a_failed_profile_still_leaves_the_timing_and_the_error(offline, monkeypatch):
    out, argv = offline

    def profile(fn, launches, stem):
        raise RuntimeError("CUPTI_ERROR_NOT_SUPPORTED")

    monkeypatch.setattr(ds, "profile", profile)
    ds.main(argv)
    row = json.loads(out.read_text())["rows"][0]
    assert row["us"] == 500.0 and "CUPTI_ERROR_NOT_SUPPORTED" in row["error"]
    assert "stalls" not in row


def test_help_needs_no_gpu_and_a_run_without_one_says_so(monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit) as help_exit:
        ds.parse_args(["--help"])
    assert help_exit.value.code == 0 and "--launches" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        ds.main(["--impls", "int4"])


def test_report_shows_the_top_states_per_impl_the_rest_and_int4s_lines(tmp_path) -> None:
    def row(impl: str, counts: dict, lines: list) -> dict:
        total = sum(counts.values())
        stalls = [{"reason": r, "samples": n, "fraction": n / total} for r, n in counts.items()]
        return {"impl": impl, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "batch": 32,
                "ctx": 32768, "us": 534.6, "gbs": 2220.0, "samples": total, "stalls": stalls,
                "lines": lines}  # fmt: skip

    # ten states: the eight largest over both impls shown, the two smallest in "other"
    int4 = {f"s{i}": 10 * (10 - i) for i in range(10)}  # s0 100 ... s9 10: 550 samples
    int8 = {"s0": 50, "s9": 450, "extra": 500}
    line = {"where": "kernels/attention_int4.py:400", "text": "x = a | b", "samples": 110,
            "fraction": 0.2, "stalls": [{"reason": "s0", "samples": 88},
                                        {"reason": "s1", "samples": 22}]}  # fmt: skip
    result = {"gpu": "NVIDIA H200", "command": "python -m benchmarks.decode_stalls --out /x.json",
              "peak_bw_gbs": 4269.0, "launches": 200, "kernel": "_attn",
              "date": "2026-12-05", "git_commit": "a" * 40,
              "rows": [row("int4", int4, [line]), row("int8", int8, []),
                       {"impl": "int8_static", "error": "profile: RuntimeError"}]}  # fmt: skip
    path = tmp_path / "decode_stalls.json"
    path.write_text(json.dumps(result))
    text = report.decode_stalls_table(path)
    assert "`python -m benchmarks.decode_stalls`" in text and "commit `aaaaaaa`" in text
    table = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert table[0] == "| warp state | `int4` | `int8` |"  # the failed impl has no column
    assert table[1:4] == ["| µs per launch | 534.6 | 534.6 |", "| % of copy bandwidth | 52% | 52% |",
                          "| samples | 550 | 1000 |"]  # fmt: skip
    # by the sum of both impls' shares: extra 0.5, s9 0.468, s0 0.232, s1 0.164, ...
    states = [ln.split(" | ")[0][2:] for ln in table[4:13]]
    assert states == ["extra", "s9", "s0", "s1", "s2", "s3", "s4", "s5", "other"]
    assert table[5] == "| s9 | 1.8% | 45.0% |"
    assert table[12] == "| other | 16.4% | 0.0% |"  # int4's s6, s7, s8: 90 of 550
    assert table[-1] == (
        "| kernels/attention_int4.py:400 | `x = a \\| b` | 20.0% | s0 80%, s1 20% |"
    )
