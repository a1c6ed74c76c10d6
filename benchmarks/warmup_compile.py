"""Time the start-up compile of our kernels' serving variants (``int8kv_shim/kernel_warmup.py``)
one at a time against ``INT8KV_COMPILE_THREADS`` at a time.

Each row is a fresh process with an empty Triton cache that warms one model's attention layers
(one per layer shape: Gemma 3 has a sliding-window and a global one) as a server's metadata
builder does before CUDA-graph capture, timed from the first compile to the last launch's end:

    python -m benchmarks.warmup_compile --models gemma3,smollm2 --dtypes int4,int8 \\
        --threads 1,16 --out benchmarks/results/warmup_compile.json

Needs a GPU. ``--sm80-compile-only`` needs none: Triton's driver then answers as an sm80 GPU's, and
each launch of the warm-up only compiles (what a launch inside ``compile_in_parallel`` does), so a
row times the compile pass alone, for the Ampere target, on this machine's CPUs.
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
from pathlib import Path
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


def _compile_only_for_sm80() -> None:
    """Every DirectLauncher launch only compiles, for an sm80 target, without a GPU: Triton's
    driver answers as an sm80 device's, and a launch calls ``JITFunction.run(..., warmup=True)``
    as inside ``compile_in_parallel``, with the GPU's ``DOT_F32=False`` (the wrappers pick the
    interpreter's variant for CPU tensors)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from int8kv_kernels.launch import DirectLauncher

    class Sm80Driver:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 80, 32)

    driver.set_active(Sm80Driver())

    def compile_only(self: DirectLauncher, grid: Any, *args: Any, **kwargs: Any) -> None:
        if "DOT_F32" in kwargs:
            kwargs["DOT_F32"] = False
        self.fn.run(*args, grid=tuple(grid), warmup=True, **kwargs)

    DirectLauncher.__call__ = compile_only  # type: ignore[method-assign]
    DirectLauncher.record = (  # type: ignore[method-assign]
        lambda self, swap, grid, *args, **kwargs: compile_only(self, grid, *args, **kwargs)
    )


def _binaries() -> int:
    """The binaries our kernels hold in this process (Triton's own caches)."""
    from int8kv_kernels.launch import kernel_launchers

    return sum(len(c[0]) for v in kernel_launchers() for c in v.fn.device_caches.values())


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Warm one model's layers on the GPU as a server's start-up does, or with ``sm80`` in
    ``spec`` only compile them for sm80; seconds and launches."""
    from types import SimpleNamespace

    import torch

    from int8kv_shim import kernel_warmup
    from int8kv_shim.environment_variables import compile_threads

    if spec.get("sm80"):
        _compile_only_for_sm80()

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
        )
        for h, hk, d, window in MODELS[spec["model"]]
    ]
    block_size = BLOCK_SIZE[spec["dtype"]]
    if spec.get("sm80"):  # the warm-up's compile pass, as warm_up_layers runs it
        start = time.perf_counter()
        launches = kernel_warmup.compile_variants(
            impls, block_size=block_size, model_dtype=torch.bfloat16, device=torch.device("cpu"),
            threads=compile_threads(),
        )  # fmt: skip
        seconds = round(time.perf_counter() - start, 2)
        # what Triton holds built: a compile that failed in the pool is missing here
        return {"warmup_s": seconds, "launches": launches, "binaries": _binaries()}
    device = torch.device("cuda")
    torch.zeros(1, device=device)  # the CUDA context is not part of the warm-up's time
    start = time.perf_counter()
    launches = kernel_warmup.warm_up_layers(
        impls, block_size=block_size, model_dtype=torch.bfloat16, device=device
    )
    return {"warmup_s": round(time.perf_counter() - start, 2), "launches": launches}


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it ("unknown" elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def run_row(
    model: str, dtype: str, threads: int, timeout_s: float, sm80: bool = False
) -> dict[str, Any]:
    spec = {"model": model, "dtype": dtype} | ({"sm80": True} if sm80 else {})
    with tempfile.TemporaryDirectory(prefix="int8kv-triton-cache-") as cache:
        env = {k: v for k, v in with_repo_on_path(os.environ).items() if k != "TRITON_INTERPRET"}
        env |= {
            "TRITON_CACHE_DIR": cache,
            "INT8KV_COMPILE_THREADS": str(threads),
        }
        t0 = time.monotonic()
        proc = subprocess.run(
            module_command("benchmarks.warmup_compile", "--child", json.dumps(spec)),
            env=env, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
    row: dict[str, Any] = {"model": model, "dtype": dtype, "threads": threads}
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
    p.add_argument(
        "--sm80-compile-only",
        action="store_true",
        help="no GPU: time only the compiles, for an sm80 target, on this machine's CPUs",
    )
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
        "gpu": "none (sm80 compiles only)" if args.sm80_compile_only else gpu_name(),
        "command": command_line(),
        **({"target": "sm80, compiles only"} if args.sm80_compile_only else {}),
        "cpu": cpu_model(),
        "cpus": len(os.sched_getaffinity(0)),
        "rows": [],
    }
    for model in models:
        for dtype in dtypes:
            for t in threads:
                row = run_row(model, dtype, t, args.timeout_s, args.sm80_compile_only)
                print(json.dumps(row), flush=True)
                doc["rows"].append(row)
                write_json(doc, args.out)  # after every row: a cut run keeps what it timed
    return 0 if all("error" not in r for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
