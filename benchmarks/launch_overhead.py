"""Host time per call of the kernel wrappers (write_kv_cache, paged_attention) at vLLM's shapes.

The GPU work is made tiny (16-token contexts) so the host side, Python + Triton launch, is what is
timed; a trivial Triton kernel's launch is timed alongside as the floor. Also writes a cProfile of
paged_attention's host path. Run on a GPU:

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

from int8kv_kernels.attention import make_workspace, paged_attention
from int8kv_kernels.cache_write import write_kv_cache
from int8kv_kernels.page_layout import get_page_bytes


@triton.jit
def _noop(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


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
        _noop[(1,)](x, 1024, BLOCK=1024)

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
    for name, fn in (("noop", noop), ("write_kv_cache", write), ("paged_attention", attn)):
        res[name + "_host_us"] = host_us(fn)
        print(name, round(res[name + "_host_us"], 1), "us/call", flush=True)
    # Direct launch: the CompiledKernel that Triton's run() picked, called with the same arguments.
    from triton.runtime.driver import driver

    import int8kv_kernels.attention as A

    seen = {}
    orig = A._attn_fwd.run

    def capture(*a, grid, warmup, **kw):
        k = orig(*a, grid=grid, warmup=warmup, **kw)
        binder = A._attn_fwd.device_caches[torch.cuda.current_device()][4]
        bound, _, _ = binder(*a, **kw)
        seen.update(kernel=k, grid=grid, args=tuple(bound.values()))
        return k

    A._attn_fwd.run = capture
    attn()
    A._attn_fwd.run = orig
    ck, grid, all_args = seen["kernel"], seen["grid"], seen["args"]

    def direct():
        dev = driver.active.get_current_device()
        stream = driver.active.get_current_stream(dev)
        ck.run(
            grid[0],
            grid[1],
            grid[2],
            stream,
            ck.function,
            ck.packed_metadata,
            None,
            None,
            None,
            *all_args,
        )

    out.zero_()
    direct()
    torch.cuda.synchronize()
    ref = out.clone()
    out.zero_()
    attn()
    torch.cuda.synchronize()
    res["direct_equal"] = bool(torch.equal(ref, out))
    res["attn_direct_host_us"] = host_us(direct)
    print("direct", round(res["attn_direct_host_us"], 1), "us/call, equal:", res["direct_equal"])
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
