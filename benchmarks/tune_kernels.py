# ruff: noqa: B023, E501
"""Tuning sweep for the INT8 kernels on one GPU (no vLLM needed). One call, one table.

For each decode shape: copy bandwidth, our int8 kernel under several launch configs (time, GB/s of
bytes it must read, fraction of copy bandwidth), and torch SDPA on a contiguous bf16 cache as a
rough bf16 reference. Then prefill configs and the cache write. Writes a log under $OUT if set.
"""

from __future__ import annotations

import json
import os

import torch
import triton
from triton.testing import do_bench

import int8kv_kernels.attention as A
from int8kv_kernels import PageLayout, make_workspace, paged_attention, write_kv_cache

DEV = "cuda"
L2_BYTES = 60 << 20
LOG: list[dict] = []


def graph_time(fn, reps: int = 1) -> float:
    """Median ms of one fn() call, replayed from a CUDA graph (no Python launch overhead)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return do_bench(g.replay, warmup=10, rep=40, return_mode="median") / reps


def copy_bw() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=10, rep=100, return_mode="median")
    return 2 * (2 << 30) / ms / 1e6  # GB/s, read + write


def decode_setup(batch, ctx, nq, nkv, d, bs=16, copies=1):
    lay = PageLayout("int8", bs, nkv, d)
    nblk = ctx // bs
    caches = [torch.randint(-127, 128, (batch * nblk + 1, lay.page_bytes), dtype=torch.int8,
                            device=DEV) for _ in range(copies)]  # fmt: skip
    for c in caches:
        c[:, lay.k_scale :].view(torch.float16).uniform_(0.005, 0.02)
    bt = torch.randperm(batch * nblk, device=DEV).int().view(batch, nblk)
    q = torch.randn(batch, nq, d, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    qsl = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    sl = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    return caches, bt, q, out, qsl, sl


def main() -> None:
    torch.manual_seed(0)
    bw = copy_bw()
    print(f"GPU {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s", flush=True)
    LOG.append({"copy_gbs": bw})
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    orig_choose = A._choose_config
    rows = []
    shapes = [(b, c) for c in (1024, 8192, 32768) for b in (1, 8, 32, 128)]
    configs = [
        (32, 2, 3),
        (32, 4, 3),
        (64, 4, 2),
        (64, 4, 3),
        (64, 4, 4),
        (64, 8, 3),
        (128, 4, 2),
        (128, 4, 3),
        (128, 8, 3),
    ]
    if os.environ.get("TUNE_QUICK"):
        configs = [(64, 4, 3), (128, 4, 3), (64, 2, 3), (32, 4, 3)]
    nq, nkv, d = 32, 8, 128
    ws = make_workspace(128, nq, d, device=DEV)
    for batch, ctx in shapes:
        kv_bytes = batch * ctx * nkv * (2 * d + 4)
        copies = max(1, min(8, -(-2 * L2_BYTES // kv_bytes)))
        caches, bt, q, out, qsl, sl = decode_setup(batch, ctx, nq, nkv, d, copies=copies)
        must = kv_bytes + 2 * q.numel() * 2
        best = None
        base_splits = A.choose_num_splits(batch, nkv, ctx, sms)
        split_opts = sorted({max(1, base_splits // 2), base_splits, min(32, base_splits * 2),
                             min(32, base_splits * 4)})  # fmt: skip
        for tn, w, st in configs:
            for ns in split_opts if (tn, w, st) == (64, 4, 3) else [base_splits]:
                # keyword-only: _choose_config's callers pass more arguments (cc_major, ...),
                # which a positional tn= would have taken as the tile size
                A._choose_config = lambda g, *_a, tn=tn, w=w, st=st, **_k: A.LaunchConfig(
                    max(16, triton.next_power_of_2(g)), tn, w, st, True
                )

                def run(ns=ns):
                    for c in caches:
                        paged_attention(q, c, out, kv_dtype="int8", block_size=16, num_kv_heads=nkv,
                                        query_start_loc=qsl, seq_lens=sl, block_table=bt,
                                        max_query_len=1, max_seq_len=ctx, softmax_scale=d**-0.5,
                                        workspace=ws, num_splits=ns)  # fmt: skip

                try:
                    ms = graph_time(run) / copies
                except Exception as e:  # noqa: BLE001  (a config that does not compile/fit)
                    print("fail", tn, w, st, ns, repr(e)[:200])
                    continue
                gbs = must / ms / 1e6
                LOG.append(dict(kind="decode", batch=batch, ctx=ctx, tile=tn, warps=w, stages=st,
                                splits=ns, ms=ms, gbs=gbs))  # fmt: skip
                if best is None or ms < best[0]:
                    best = (ms, gbs, tn, w, st, ns)
        A._choose_config = orig_choose
        # bf16 reference: SDPA on a contiguous cache of the same context (reads 2x the bytes)
        kb = torch.randn(batch, nkv, ctx, d, device=DEV, dtype=torch.bfloat16)
        vb = torch.randn_like(kb)
        qb = q.view(batch, nq, 1, d)
        try:
            sdpa = graph_time(lambda: torch.nn.functional.scaled_dot_product_attention(
                qb, kb, vb, enable_gqa=True))  # fmt: skip
        except Exception as e:  # noqa: BLE001
            print("sdpa fail", repr(e)[:200])
            sdpa = float("nan")

        # default heuristic config
        def run_default():
            for c in caches:
                paged_attention(q, c, out, kv_dtype="int8", block_size=16, num_kv_heads=nkv,
                                query_start_loc=qsl, seq_lens=sl, block_table=bt, max_query_len=1,
                                max_seq_len=ctx, softmax_scale=d**-0.5, workspace=ws)  # fmt: skip

        dflt = graph_time(run_default) / copies
        rows.append((batch, ctx, dflt, must / dflt / 1e6 / bw, best, sdpa))
        print(
            f"decode b={batch:4d} ctx={ctx:6d} default {dflt * 1e3:8.1f}us {must / dflt / 1e6 / bw * 100:5.1f}%bw"
            f" | best {best[0] * 1e3:8.1f}us {best[1] / bw * 100:5.1f}%bw tile={best[2]} w={best[3]}"
            f" st={best[4]} splits={best[5]} (heur {base_splits}) | sdpa-bf16 {sdpa * 1e3:8.1f}us"
            f" ratio {sdpa / dflt:4.2f}x",
            flush=True,
        )
        del caches, kb, vb
        torch.cuda.empty_cache()

    # prefill: 2K new tokens on 8K context, batch 1
    ctx, qn = 8192, 2048
    caches, bt, _, _, _, _ = decode_setup(1, ctx, nq, nkv, d)
    q = torch.randn(qn, nq, d, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    qsl = torch.tensor([0, qn], device=DEV, dtype=torch.int32)
    sl = torch.tensor([ctx], device=DEV, dtype=torch.int32)
    flops = 4 * nq * d * sum(ctx - qn + i + 1 for i in range(qn))
    for bm in (64, 128):
        for tn in (32, 64):
            for w in (4, 8):
                for st in (2, 3) if (bm, tn, w) == (128, 64, 8) else (2,):
                    A._choose_config = lambda g, *_a, bm=bm, tn=tn, w=w, st=st, **_k: (
                        A.LaunchConfig(bm, tn, w, st, False)
                    )
                    try:
                        ms = graph_time(lambda: paged_attention(
                            q, caches[0], out, kv_dtype="int8", block_size=16, num_kv_heads=nkv,
                            query_start_loc=qsl, seq_lens=sl, block_table=bt, max_query_len=qn,
                            max_seq_len=ctx, softmax_scale=d**-0.5))  # fmt: skip
                    except Exception as e:  # noqa: BLE001
                        print("prefill fail", bm, tn, w, st, repr(e)[:200])
                        continue
                    LOG.append(dict(kind="prefill", bm=bm, tile=tn, warps=w, stages=st, ms=ms))
                    print(
                        f"prefill bm={bm} tile={tn} w={w} st={st} {ms * 1e3:8.1f}us "
                        f"{flops / ms / 1e9:6.0f} TFLOP/s",
                        flush=True,
                    )
    A._choose_config = orig_choose
    kb = torch.randn(1, nkv, ctx, d, device=DEV, dtype=torch.bfloat16)
    vb = torch.randn_like(kb)
    qb = q.view(1, qn, nq, d).transpose(1, 2)
    mask = torch.ones(qn, ctx, dtype=torch.bool, device=DEV).tril(ctx - qn)
    try:
        ms = graph_time(lambda: torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, enable_gqa=True))  # fmt: skip
        print(f"prefill sdpa-bf16 (masked) {ms * 1e3:8.1f}us {flops / ms / 1e9:6.0f} TFLOP/s")
    except Exception as e:  # noqa: BLE001
        print("sdpa prefill fail", repr(e)[:200])

    # write: 256 tokens
    lay = PageLayout("int8", 16, nkv, d)
    cache = torch.zeros(4096, lay.page_bytes, dtype=torch.int8, device=DEV)
    k = torch.randn(256, nkv, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(4096 * 16, device=DEV)[:256]
    ms = graph_time(lambda: write_kv_cache(k, v, cache, slots, kv_dtype="int8", block_size=16), 20)
    kc = torch.zeros(4096 * 16, nkv, d, dtype=torch.bfloat16, device=DEV)
    vc = torch.zeros_like(kc)

    def bf16_write():
        kc.index_copy_(0, slots, k)
        vc.index_copy_(0, slots, v)

    ms2 = graph_time(bf16_write, 20)
    print(f"write 256 tok: int8 {ms * 1e3:.2f}us  bf16 index_copy x2 {ms2 * 1e3:.2f}us")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "tune.json"), "w") as f:
            json.dump(LOG, f)


if __name__ == "__main__":
    main()
