"""Host time per call of the kernel wrappers (write_kv_cache, paged_attention) at vLLM's shapes.

SmolLM2's heads (9/3, D=64) and 1024 one-token decodes over 16-token contexts: the GPU work is tiny,
so what is timed is the host side, our wrapper's Python plus the launch. A trivial two-argument
Triton kernel is timed alongside as the floor of a launch. On a GPU each call is timed through
Triton's ``kernel[grid]`` ("_host_us"), through kernels/launch.py's DirectLauncher with the
wrappers' replay caches emptied before every call ("_direct_host_us": a call no earlier one
recorded), and as a replay of the previous call's launch ("_replay_host_us": what every layer but
the first of a step takes, the wrappers' default), as the median of ``--rounds`` rounds in which
the paths alternate ("_spread_us": max - min), and a cProfile of the ``kernel[grid]`` path is
kept; also
whether a small host-to-device copy waits for queued GPU work ("h2d_*_wait_ms"):

    python3 -m benchmarks.launch_overhead --out launch_overhead.json

``--stub-launches`` (no GPU needed) replaces every launch with a no-op on CPU tensors, leaving our
wrappers' own Python ("_wrapper_us"), and times Triton's binder (the specialization of every
argument, which the direct path still runs) on the arguments each launch received, built for an
sm80 target ("_binder_us"):

    python3 -m benchmarks.launch_overhead --stub-launches --out launch_overhead_wrappers.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

import int8kv_kernels.attention as attention
import int8kv_kernels.cache_write as cache_write
from int8kv_kernels.launch import DirectLauncher, clear_replays
from int8kv_kernels.page_layout import get_page_bytes


@triton.jit
def _noop(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


launch_noop = DirectLauncher(_noop)


def host_us(fn: Callable[[], None], iters: int = 300) -> float:
    """Mean host time of ``fn``: the GPU work is tiny, so the launch queue never fills."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(20):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / iters * 1e6


def make_calls(dev: str, batch: int) -> dict[str, Callable[[], None]]:
    """The three timed calls: name -> a no-argument function."""
    nq, nkv, d, bs, ctx = 9, 3, 64, 16, 16
    pages = get_page_bytes("int8", bs, nkv, d)
    cache = torch.zeros(batch * (ctx // bs) + 8, pages, dtype=torch.int8, device=dev)
    k = torch.randn(batch, nkv, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    slots = torch.arange(batch, device=dev, dtype=torch.int64) * bs + (ctx - 1)
    q = torch.randn(batch, nq, d, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    bt = torch.arange(batch, device=dev, dtype=torch.int32)[:, None]
    ws = attention.make_workspace(batch, nq, d, device=dev)
    x = torch.zeros(1024, device=dev)

    def noop() -> None:
        launch_noop((1,), x, 1024, BLOCK=1024)

    def write() -> None:
        cache_write.write_kv_cache(k, v, cache, slots, kv_dtype="int8", block_size=bs)

    def attn() -> None:
        attention.paged_attention(
            q, cache, out, kv_dtype="int8", block_size=bs, num_kv_heads=nkv,
            query_start_loc=qsl, seq_lens=seq_lens, block_table=bt, max_query_len=1,
            max_seq_len=ctx, softmax_scale=0.125, workspace=ws,
        )  # fmt: skip

    return {"noop": noop, "write_kv_cache": write, "paged_attention": attn}


def h2d_wait_ms(sleep_cycles: int = 400_000_000) -> dict[str, float]:
    """Host time of a small host-to-device copy (``non_blocking=True``) made while a ~0.2 s kernel
    is queued, from pageable memory (what the split's copies use) and from pinned memory. A copy
    that waits for the queue takes ~the sleep."""
    dev = torch.device("cuda")
    host = torch.arange(1024)
    pinned = host.pin_memory()
    out = {}
    for name, copy in (
        ("h2d_pageable_wait_ms", lambda: host.to(dev, non_blocking=True)),
        ("h2d_pinned_wait_ms", lambda: pinned.to(dev, non_blocking=True)),
    ):
        copy()  # warm
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        copy()
        out[name] = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        print(f"{name}: {out[name]:.2f}", flush=True)
    return out


class _Stub:
    """A launcher that launches nothing: ``record`` (DirectLauncher's) returns no replay, so every
    call runs the whole wrapper."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn

    def __call__(self, grid, *args, **kwargs) -> None:
        self.fn(grid, *args, **kwargs)

    def record(self, swap, grid, *args, **kwargs) -> None:
        self.fn(grid, *args, **kwargs)


def stub_launches() -> dict[str, Callable[[], None]]:
    """Every launch the timed calls make becomes a no-op (the wrappers look them up per call).

    Returns, per call name, a function running Triton's binder (built for an sm80 target, no GPU
    needed) on the arguments that call's launch received last."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    backend = CUDABackend(GPUTarget("cuda", 80, 32))
    binders = {}
    for name, launcher in (("noop", launch_noop), ("write_kv_cache", cache_write.launch_write),
                           ("paged_attention", attention.launch_attn)):  # fmt: skip
        fn = launcher.fn
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        received: list = []

        def stub(grid, *args, _received=received, **kwargs) -> None:
            _received[:] = [args, kwargs]

        binders[name] = (binder, received)
        if name == "noop":
            globals()["launch_noop"] = _Stub(stub)
        elif name == "write_kv_cache":
            cache_write.launch_write = _Stub(stub)
        else:
            attention.launch_attn = _Stub(stub)
    attention.launch_merge = _Stub(lambda *args, **kwargs: None)

    def bind(name: str) -> Callable[[], None]:
        binder, received = binders[name]
        return lambda: binder(*received[0], **received[1])

    return {name: bind(name) for name in binders}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="launch_overhead.json")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5, help="GPU: medians over this many rounds")
    ap.add_argument("--stub-launches", action="store_true", help="CPU: our wrappers' Python only")
    args = ap.parse_args()
    res = {"command": shlex.join(["python3", "-m", "benchmarks.launch_overhead", *sys.argv[1:]]),
           "batch": args.batch}  # fmt: skip
    if args.stub_launches:
        binders = stub_launches()
        calls = make_calls("cpu", args.batch)
        res |= {"gpu": None, "cpu": platform.processor() or platform.machine()}
        for name, fn in calls.items():
            res[name + "_wrapper_us"] = host_us(fn, iters=3000)  # also leaves the launch's args
            res[name + "_binder_us"] = host_us(binders[name], iters=3000)
            print(f"{name}: wrapper {res[name + '_wrapper_us']:.1f}, binder "
                  f"{res[name + '_binder_us']:.1f}", flush=True)  # fmt: skip
    else:
        calls = make_calls("cuda", args.batch)
        res |= {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__}
        launchers = (launch_noop, cache_write.launch_write, attention.launch_attn)

        def unrecorded(fn: Callable[[], None]) -> Callable[[], None]:
            def call() -> None:
                clear_replays()
                fn()

            return call

        # (direct launches, replays, suffix); the 2-argument kernel has no wrapper to replay
        paths = ((False, False, "_host_us"), (True, False, "_direct_host_us"),
                 (True, True, "_replay_host_us"))  # fmt: skip
        if not attention.launch_attn.direct:  # another Triton release: no direct launches
            paths = paths[:1]
        # Rounds alternate the paths, so a drift of the host (clocks, other load) shows up as
        # spread in every column rather than as a difference between them.
        samples: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for direct, replay, suffix in paths:
                for launcher in launchers:
                    launcher.direct = direct
                for name, fn in calls.items():
                    if replay and name == "noop":
                        continue
                    timed = fn if replay or name == "noop" else unrecorded(fn)
                    samples.setdefault(name + suffix, []).append(host_us(timed))
        for key, values in samples.items():
            res[key] = statistics.median(values)
            res[key.replace("_us", "_spread_us")] = max(values) - min(values)
            print(f"{key}: {res[key]:.1f} (spread {max(values) - min(values):.1f})", flush=True)
        res |= h2d_wait_ms()
        for launcher in launchers:
            launcher.direct = False  # the profile shows where kernel[grid]'s time goes
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            calls["paged_attention"]()
            calls["write_kv_cache"]()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        res["cprofile"] = text.getvalue()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
