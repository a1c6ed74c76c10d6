"""benchmarks/decode_issue_budget.py finds the decode loop in the sm80 PTX and counts it."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_issue_budget.py"


def test_issue_budget_counts_the_tile_loop(tmp_path):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compiles, like compile_sm80.py
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    out = tmp_path / "budget.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["kv_dtype"]: row for row in json.loads(out.read_text())["rows"]}
    for row in rows.values():
        # the loop holds the tile's MMAs and conversions, not just a prologue or an epilogue
        assert row["loop_share"]["tensor-core MMA and operand loads"] > 0.02
        assert row["loop_share"]["int8 -> fp16 conversion and casts"] > 0.1
        assert abs(sum(row["loop_share"].values()) - 1) < 0.01
    # dynamic scales cost instructions that static scales do not
    assert (
        rows["int8"]["loop_instructions_per_thread"]
        > rows["int8_static"]["loop_instructions_per_thread"]
    )
