"""benchmarks/launch_overhead.py --stub-launches: every launch the wrappers make must be stubbed
(a launcher renamed or added without it would run the kernel here, or fail), and the JSON holds
the three calls' wrapper and binder times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_stub_launches_times_the_wrappers_only(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a kernel that ran would now fail
    out = tmp_path / "w.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.launch_overhead",
            "--stub-launches",
            "--batch",
            "8",
            "--out",
            str(out),
        ],
        cwd=REPO,
        check=True,
        timeout=300,
    )
    result = json.loads(out.read_text())
    for name in ("noop", "write_kv_cache", "paged_attention"):
        assert 0 < result[f"{name}_wrapper_us"] < 1000
        assert 0 < result[f"{name}_binder_us"] < 1000
    # the attention kernel has about twice the write's arguments, ten times the empty kernel's
    assert result["noop_binder_us"] < result["paged_attention_binder_us"]
    assert result["gpu"] is None and "--stub-launches" in result["command"]
