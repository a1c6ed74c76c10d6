"""benchmarks/host_overhead.py: every launch the attention path makes is stubbed (a kernel that ran
would fail here, without the interpreter), layers after the first replay, and no step reads a
device value on the host (the meta-device check)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_host_overhead_times_a_step_without_syncs(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "h.json"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.host_overhead", "--steps", "3", "--dtypes", "int8",
         "--batches", "decode,gather", "--check-syncs", "--out", str(out)],
        cwd=REPO, check=True, timeout=600,
    )  # fmt: skip
    rows = {row["batch"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"decode", "gather"}
    for row in rows.values():
        assert row["sync"] is None
        assert 0 < row["build_us"] < row["step_us"]
        # 30 layers: the first records its launches, the other 29 replay them
        assert row["replays_per_step"] > 0 and row["replays_per_step"] % 29 == 0
    # a decode step's builder dispatches no torch op; a prefill chunk's does
    assert rows["decode"]["build_ops"] == 0 < rows["gather"]["build_ops"]
