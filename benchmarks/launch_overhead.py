"""Host time per call of the kernel wrappers (write_kv_cache, paged_attention) at vLLM's shapes.

The GPU work is made tiny (16-token contexts) so the host side, Python + Triton launch, is what is
timed; a trivial Triton kernel's launch is timed alongside as the floor. Each is timed through
kernels/launch.py's DirectLauncher (what the wrappers use) and through Triton's ``kernel[grid]``.
Also writes a cProfile of the host path through ``kernel[grid]``. Run on a GPU:

    python3 benchmarks/launch_overhead.py --out launch_overhead.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shlex
import sys
import time

import torch
import triton
import triton.language as tl

from int8kv_kernels.attention import launch_attn, make_workspace, paged_attention
from int8kv_kernels.cache_write import launch_write, write_kv_cache
from int8kv_kernels.launch import DirectLauncher
from int8kv_kernels.page_layout import get_page_bytes


@triton.jit
def _noop(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


launch_noop = DirectLauncher(_noop)


def host_us(fn, iters: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="launch_overhead.json")
    ap.add_argument("--batch", type=int, default=1024)
    args = ap.parse_args()
    dev = "cuda"
    nq, nkv, d, bs, ctx, b = 9, 3, 64, 16, 16, args.batch
    pages = get_page_bytes("int8", bs, nkv, d)
    nblocks = b * (ctx // bs) + 8
    cache = torch.zeros(nblocks, pages, dtype=torch.int8, device=dev)
    k = torch.randn(b, nkv, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    slots = torch.arange(b, device=dev, dtype=torch.int64) * bs + (ctx - 1)
    q = torch.randn(b, nq, d, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
    seq_lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
    bt = torch.arange(b, device=dev, dtype=torch.int32)[:, None]
    ws = make_workspace(b, nq, d, device=dev)
    x = torch.zeros(1024, device=dev)

    def noop():
        launch_noop((1,), x, 1024, BLOCK=1024)

    def write():
        write_kv_cache(k, v, cache, slots, kv_dtype="int8", block_size=bs)

    def attn():
        paged_attention(
            q, cache, out, kv_dtype="int8", block_size=bs, num_kv_heads=nkv,
            query_start_loc=qsl, seq_lens=seq_lens, block_table=bt, max_query_len=1,
            max_seq_len=ctx, softmax_scale=0.125, workspace=ws,
        )  # fmt: skip

    res = {
        "command": shlex.join(["python3", *sys.argv]),
        "gpu": torch.cuda.get_device_name(),
        "triton": triton.__version__,
        "batch": b,
    }
    calls = (("noop", noop), ("write_kv_cache", write), ("paged_attention", attn))
    launchers = (launch_noop, launch_write, launch_attn)
    # "_host_us": Triton's own launch path (kernel[grid](...)); "_direct_host_us": DirectLauncher's.
    for direct, suffix in ((False, "_host_us"), (True, "_direct_host_us")):
        for launcher in launchers:
            launcher.direct = direct
        for name, fn in calls:
            res[name + suffix] = host_us(fn)
            print(f"{name}{suffix}: {res[name + suffix]:.1f}", flush=True)
    for launcher in launchers:
        launcher.direct = False  # the profile shows where kernel[grid]'s time goes
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        attn()
        write()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    res["cprofile"] = s.getvalue()
    print(s.getvalue())
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
