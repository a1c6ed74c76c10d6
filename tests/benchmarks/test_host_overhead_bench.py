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


SINK_STORES = """
import torch
import benchmarks.host_overhead as H

launches = H.Launches(binder=False)
launches.install()
for batch in ("decode", "mixed", "gather"):
    builder, impls, caches = H.make_layers("int4", torch.device("cpu"))
    step = H.make_step(batch, H.BLOCK_SIZES["int4"], torch.device("cpu"))
    H.assign_rows(builder, step)
    launches.kernels.clear()
    H.run_step(builder, impls, caches, step)
    print(batch, launches.kernels["_store_sink_kernel"], launches.kernels["_store_tail_kernel"])
# a decode step as it would be captured into a CUDA graph: the sink store is launched
from int8kv_shim import attention_impl

builder, impls, caches = H.make_layers("int4", torch.device("cpu"))
step = H.make_step("decode", H.BLOCK_SIZES["int4"], torch.device("cpu"))
H.assign_rows(builder, step)
attention_impl._capturing = lambda t: True
launches.kernels.clear()
H.run_step(builder, impls, caches, step)
print("captured", launches.kernels["_store_sink_kernel"], launches.kernels["_store_tail_kernel"])
"""


def test_int4_stores_sinks_only_in_a_step_that_computes_a_first_page(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for name in ("INT8KV_INT4_SINK_PAGE", "INT8KV_INT4_TAIL_PAGES"):  # the defaults: sink pages on
        monkeypatch.delenv(name, raising=False)
    run = subprocess.run([sys.executable, "-c", SINK_STORES], cwd=REPO, check=True, timeout=600,
                         capture_output=True, text=True)  # fmt: skip
    batches = ("decode", "mixed", "gather", "captured")
    counts = {w[0]: w[1:] for w in map(str.split, run.stdout.splitlines()) if w and w[0] in batches}
    # the tail store in every layer of every step (30 layers); the sink store only where the
    # mixed batch's first chunk computes its first page, none in a step of decodes or of a
    # chunk whose first page is cached, unless the step is being captured into a graph
    assert counts == {"decode": ["0", "30"], "mixed": ["30", "30"], "gather": ["0", "30"],
                      "captured": ["30", "30"]}  # fmt: skip
