"""Time the start-up compile of our kernels' serving variants (``int8kv_shim/kernel_warmup.py``)
one at a time against ``INT8KV_COMPILE_THREADS`` at a time.

Each row is a fresh process with an empty Triton cache that warms one model's attention layers
(one per layer shape: Gemma 3 has a sliding-window and a global one) as a server's metadata
builder does before CUDA-graph capture, timed from the first compile to the last launch's end:

    python -m benchmarks.warmup_compile --models gemma3,smollm2 --dtypes int4,int8 \\
        --threads 1,16 --out benchmarks/results/warmup_compile.json

Needs a GPU. Rows alternate thread counts within a model and dtype, so a host that changes speed
during the run shows in both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    command_line,
    gpu_name,
    module_command,
    parse_list,
    with_repo_on_path,
    write_json,
)

# model: its attention layer shapes (q heads, kv heads, head size, sliding window), config.json's
MODELS: dict[str, list[tuple[int, int, int, int | None]]] = {
    "gemma3": [(4, 1, 256, 512), (4, 1, 256, None)],
    "smollm2": [(9, 3, 64, None)],
    "llama3-8b-shape": [(32, 8, 128, None)],
}
# the page size the shim serves each dtype with (int4's is fixed; int8 keeps vLLM's default)
BLOCK_SIZE = {"int4": 64, "int8": 16}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Warm one model's layers on the GPU as a server's start-up does; seconds and launches."""
    from types import SimpleNamespace

    import torch

    from int8kv_shim import kernel_warmup

    impls = [
        SimpleNamespace(
            kv_cache_dtype=spec["dtype"],
            num_heads=h,
            num_kv_heads=hk,
            head_size=d,
            sliding_window=window,
            logits_soft_cap=None,
            v_format="int8",
            flash_prefill=True,
            scale=d**-0.5,
            k_scale=None,
            v_scale=None,
        )  # fmt: skip
        for h, hk, d, window in MODELS[spec["model"]]
    ]
    device = torch.device("cuda")
    torch.zeros(1, device=device)  # the CUDA context is not part of the warm-up's time
    start = time.perf_counter()
    launches = kernel_warmup.warm_up_layers(
        impls, block_size=BLOCK_SIZE[spec["dtype"]], model_dtype=torch.bfloat16, device=device
    )
    return {"warmup_s": round(time.perf_counter() - start, 2), "launches": launches}


def run_row(model: str, dtype: str, threads: int, timeout_s: float) -> dict[str, Any]:
    spec = {"model": model, "dtype": dtype}
    with tempfile.TemporaryDirectory(prefix="int8kv-triton-cache-") as cache:
        env = with_repo_on_path(os.environ) | {
            "TRITON_CACHE_DIR": cache,
            "INT8KV_COMPILE_THREADS": str(threads),
        }
        t0 = time.monotonic()
        proc = subprocess.run(
            module_command("benchmarks.warmup_compile", "--child", json.dumps(spec)),
            env=env, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
    row: dict[str, Any] = {**spec, "threads": threads}
    if proc.returncode != 0:
        return row | {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:500]}
    return (
        row
        | json.loads(proc.stdout.splitlines()[-1])
        | {"process_s": round(time.monotonic() - t0, 1)}
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gemma3")
    p.add_argument("--dtypes", default="int4,int8")
    p.add_argument("--threads", default="1,16", help="INT8KV_COMPILE_THREADS of each row")
    p.add_argument("--timeout-s", type=float, default=400)
    p.add_argument("--out", default=str(RESULTS_DIR / "warmup_compile.json"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    models, dtypes = parse_list(args.models), parse_list(args.dtypes)
    threads = [int(t) for t in parse_list(args.threads)]
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(dtypes) - set(BLOCK_SIZE))
    if unknown:
        p.error(f"unknown model or dtype: {', '.join(unknown)}")
    doc: dict[str, Any] = {
        "gpu": gpu_name(),
        "command": command_line(),
        "cpus": len(os.sched_getaffinity(0)),
        "rows": [],
    }
    for model in models:
        for dtype in dtypes:
            for t in threads:
                row = run_row(model, dtype, t, args.timeout_s)
                print(json.dumps(row), flush=True)
                doc["rows"].append(row)
                write_json(doc, args.out)  # after every row: a cut run keeps what it timed
    return 0 if all("error" not in r for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
