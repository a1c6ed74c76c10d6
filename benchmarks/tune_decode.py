# ruff: noqa: B023, E501
"""Decode launch-config sweep for the INT8 attention kernel (one GPU call, no vLLM needed).

Prints, per decode shape and config (tile, warps, stages, splits), the time and the fraction of the
measured copy bandwidth counting the bytes the kernel must read. Used to pick _choose_config.

    python -m benchmarks.tune_decode                    # sweep; $OUT/tune_decode.json if $OUT is set
    python -m benchmarks.tune_decode --shape 9,3,64     # the same for SmolLM2's heads
    python -m benchmarks.tune_decode --best FILE.json   # T,W,S,C: best int8 config of a sweep
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys

import torch
import triton

import int8kv_kernels.attention as A
from benchmarks.tune_kernels import L2_BYTES, copy_bw, decode_setup, graph_time
from int8kv_kernels import INT8_DTYPES, make_workspace, paged_attention

# (tile, warps, stages, chunks). Stage 7 gives three K/V buffers (ptxas/TTGIR, kernels/README.md).
CONFIGS = [
    (128, 4, 5, 1),
    (128, 4, 7, 1),
    # 4 stages keep one K/V buffer (41 KB at D=128): two programs per SM fit sm86's 100 KB,
    # where the 5-stage default's 73 KB allows one
    (128, 4, 4, 1),
    (64, 4, 5, 1),
    (64, 4, 4, 1),
    (64, 2, 5, 1),
    (64, 2, 7, 1),
    (128, 4, 5, 4),
    # One- and two-warp programs: no cross-warp reduction or P relayout per tile at all (a 16-row
    # decode tile's softmax and PV stay inside one warp), many programs per SM for bytes in flight.
    (32, 1, 4, 1),
    (64, 1, 4, 1),
    (64, 2, 4, 1),
    # 256-key tiles: at head_dim 64 a 128-key tile is only 16 KiB of K/V
    (256, 4, 5, 1),
    (256, 8, 5, 1),
]
# Split counts tried per shape: the heuristic's and these multiples of it (small programs need
# more of them to fill the GPU: 4-5 of a 64-token, 2-warp program fit an SM where 2 of the
# 128-token, 4-warp one do; half as many splits halves the merge and doubles each program's
# tiles, which is what a short pipeline at batch 8 might want).
SPLIT_FACTORS = (0.5, 1, 2, 4, 8)
SHAPES = [(8, 8192), (32, 8192), (8, 1024), (128, 1024), (1, 32768)]
# Shapes the decode target is judged on (ctx >= 8K, batch >= 8): best_config ranks on these.
TARGET_SHAPES = {(8, 8192), (32, 8192)}


def _fixed_config(tile_n: int, warps: int, stages: int, chunks: int):
    """A stand-in for ``attention._choose_config`` that always returns this decode config.

    Takes whatever arguments _choose_config takes (only the GQA group, the first, matters here):
    a fixed signature broke silently once _choose_config gained an argument (every config then
    failed to compile, with the new argument taken as the tile size).
    """

    def choose(group: int, *_args, **_kwargs) -> A.LaunchConfig:
        return A.LaunchConfig(
            max(16, triton.next_power_of_2(group)), tile_n, warps, stages, True, chunks
        )

    return choose


def best_config(rows: list[dict], dtype: str = "int8") -> tuple[int, int, int, int]:
    """The (tile, warps, stages, chunks) with the highest geometric-mean bandwidth fraction over
    TARGET_SHAPES, each shape at that config's best split count; a config must have run on all."""
    best: dict[tuple, dict[tuple, float]] = {}
    for r in rows:
        if r["dtype"] != dtype or (r["batch"], r["ctx"]) not in TARGET_SHAPES:
            continue
        per_shape = best.setdefault((r["tile"], r["warps"], r["stages"], r["chunks"]), {})
        shape = (r["batch"], r["ctx"])
        per_shape[shape] = max(per_shape.get(shape, 0.0), r["frac"])
    complete = {c: v for c, v in best.items() if len(v) == len(TARGET_SHAPES)}
    if not complete:
        raise ValueError(f"no {dtype} config ran on every shape of {sorted(TARGET_SHAPES)}")
    return max(complete, key=lambda c: math.prod(complete[c].values()))


def main() -> None:
    if sys.argv[1:2] == ["--best"]:  # print best_config of a saved sweep: T,W,S,C
        with open(sys.argv[2]) as f:
            print(",".join(map(str, best_config(json.load(f)["rows"]))))
        return
    torch.manual_seed(0)
    bw = copy_bw()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        f"GPU {torch.cuda.get_device_name()} sms={sms} copy {bw:.0f} GB/s arch_override={os.environ.get('TRITON_OVERRIDE_ARCH')}",
        flush=True,
    )
    # --shape Q,KV,D: another model's heads (default: the first of common.MODEL_SHAPES)
    nq, nkv, d = 32, 8, 128
    if sys.argv[1:2] == ["--shape"]:
        nq, nkv, d = map(int, sys.argv[2].split(","))
    ws = make_workspace(128, nq, d, device="cuda")
    orig = A._choose_config
    log = []
    for batch, ctx in SHAPES:
        kv_bytes = batch * ctx * nkv * (2 * d + 4)
        copies = max(1, min(8, -(-2 * L2_BYTES // kv_bytes)))
        caches, bt, q, out, qsl, sl = decode_setup(batch, ctx, nq, nkv, d, copies=copies)
        must = kv_bytes + 2 * q.numel() * 2
        heur = A.choose_num_splits(batch, nkv, ctx, sms)
        line = []
        for kv_dtype in INT8_DTYPES:
            scales = torch.full((nkv,), 0.01, device="cuda")
            for tn, w, st, ch in CONFIGS if kv_dtype == "int8" else CONFIGS[:2] + CONFIGS[-1:]:
                for ns in sorted({min(32, max(1, int(heur * f))) for f in SPLIT_FACTORS}):
                    A._choose_config = _fixed_config(tn, w, st, ch)

                    def run(ns=ns):
                        for c in caches:
                            paged_attention(
                                q,
                                c,
                                out,
                                kv_dtype=kv_dtype,
                                block_size=16,
                                num_kv_heads=nkv,
                                query_start_loc=qsl,
                                seq_lens=sl,
                                block_table=bt,
                                max_query_len=1,
                                max_seq_len=ctx,
                                softmax_scale=d**-0.5,
                                workspace=ws,
                                num_splits=ns,
                                k_scale=scales,
                                v_scale=scales,
                            )

                    try:
                        ms = graph_time(run) / copies
                    except Exception as e:  # noqa: BLE001
                        print("fail", kv_dtype, tn, w, st, ch, ns, repr(e)[:150], flush=True)
                        continue
                    b = must if kv_dtype == "int8" else must - batch * ctx * nkv * 4
                    frac = b / ms / 1e6 / bw
                    log.append(
                        dict(
                            dtype=kv_dtype,
                            batch=batch,
                            ctx=ctx,
                            tile=tn,
                            warps=w,
                            stages=st,
                            chunks=ch,
                            splits=ns,
                            us=ms * 1e3,
                            frac=frac,
                        )
                    )
                    line.append((frac, kv_dtype, tn, w, st, ch, ns, ms * 1e3))
        A._choose_config = orig
        line.sort(reverse=True)
        print(f"b={batch} ctx={ctx} heur_splits={heur}", flush=True)
        for frac, kv_dtype, tn, w, st, ch, ns, us in line[:6]:
            print(
                f"   {kv_dtype:11s} tile={tn:3d} w={w} st={st} ch={ch} splits={ns:2d} {us:9.1f}us {frac * 100:5.1f}%bw",
                flush=True,
            )
        caches = None  # free before the next shape
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "tune_decode.json"), "w") as f:
            command = shlex.join(["python", "-m", "benchmarks.tune_decode", *sys.argv[1:]])
            json.dump(dict(gpu=torch.cuda.get_device_name(), command=command, copy_gbs=bw,
                           shape=[nq, nkv, d], rows=log), f)  # fmt: skip


if __name__ == "__main__":
    main()
