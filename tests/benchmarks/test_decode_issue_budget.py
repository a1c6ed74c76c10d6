"""benchmarks/decode_issue_budget.py finds the int8 and int4 decode loops in the sm80 PTX and
counts them."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_issue_budget_counts_the_tile_loop(tmp_path):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compiles, like compile_sm80.py
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    out = tmp_path / "budget.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.decode_issue_budget", "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {(row["kv_dtype"], row["q_heads"], row["kv_heads"], row["head_dim"]): row
            for row in json.loads(out.read_text())["rows"]}  # fmt: skip
    # every model shape of benchmarks/kernels.py, both int8 dtypes and int4
    shapes = {(32, 8, 128), (28, 4, 128), (9, 3, 64), (4, 1, 256), (16, 8, 256)}
    for kv_dtype in ("int8", "int8_static", "int4"):
        assert {key[1:] for key in rows if key[0] == kv_dtype} == shapes, kv_dtype
    for (kv_dtype, *_), row in rows.items():
        # the loop holds the tile's MMAs and conversions, not just a prologue or an epilogue
        assert row["loop_share"]["tensor-core MMA and operand loads"] > 0.02
        codes = "int4" if kv_dtype == "int4" else "int8"
        assert row["loop_share"][f"{codes} -> fp16 conversion and casts"] > 0.1
        assert abs(sum(row["loop_share"].values()) - 1) < 0.01
    # an int4 decode step is two 64-token pages of the program's kv-head: K and V codes (two per
    # byte), K's fp16 (scale, zero) per channel and V's per token and 128-channel group
    for (kv_dtype, _, _, d), row in rows.items():
        if kv_dtype == "int4":
            assert row["config"]["tile_n"] == 128
            assert row["tile_bytes"] == 2 * (64 * d + 4 * d + 4 * 64 * -(-d // 128)), d
    # resident programs per SM: the most that the SM's registers (allocated per warp in units of
    # 256), shared memory (+1 KiB per block) and threads allow
    limits = {"sm80": (65536, 164 * 1024, 2048), "sm86": (65536, 100 * 1024, 1536),
              "sm90": (65536, 228 * 1024, 2048)}  # fmt: skip
    for row in rows.values():
        warps = row["config"]["num_warps"]
        regs = -(-row["registers"] * 32 // 256) * 256 * warps
        smem = row["shared_bytes"] + 1024
        for gpu, n in row["programs_per_sm"].items():
            r, s, t = limits[gpu[gpu.index("(") + 1 : -1]]
            assert n * regs <= r and n * smem <= s and n * 32 * warps <= t, gpu
            assert (n + 1) * regs > r or (n + 1) * smem > s or (n + 1) * 32 * warps > t, gpu
    # dynamic scales cost instructions that static scales do not
    for kv_dtype, *shape in rows:
        if kv_dtype == "int8":
            static = rows[("int8_static", *shape)]["loop_instructions_per_thread"]
            assert rows[("int8", *shape)]["loop_instructions_per_thread"] > static, shape
    # half the bytes per key at D=64, much the same per-key work: more instructions per byte
    assert (rows[("int8", 9, 3, 64)]["warp_instructions_per_kib"]
            > 1.3 * rows[("int8", 32, 8, 128)]["warp_instructions_per_kib"])  # fmt: skip
    # a KiB of int4 holds twice int8's elements, each unpacked from a nibble: more conversion
    # work per KiB streamed
    for shape in shapes:
        conv = {kv: rows[(kv, *shape)]["warp_instructions_per_kib"]
                * rows[(kv, *shape)]["loop_share"][f"{kv} -> fp16 conversion and casts"]
                for kv in ("int8", "int4")}  # fmt: skip
        assert conv["int4"] > 2 * conv["int8"], (shape, conv)
