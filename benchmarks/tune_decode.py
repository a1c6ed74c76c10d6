# ruff: noqa: B023, E501
"""Decode launch-config sweep for the INT8 attention kernel (one GPU call, no vLLM needed).

Prints, per decode shape and config (tile, warps, stages, splits), the time and the fraction of the
measured copy bandwidth counting the bytes the kernel must read. Used to pick _choose_config.

    python -m benchmarks.tune_decode                    # sweep; $OUT/tune_decode.json if $OUT is set
    python -m benchmarks.tune_decode --shape 9,3,64     # the same for SmolLM2's heads
    python -m benchmarks.tune_decode --shape 4,1,256    # Gemma 3's heads: WIDE_CONFIGS
    python -m benchmarks.tune_decode --int4 --shape 4,1,256   # int4 (page tiles): warps, stages
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
from benchmarks.common import write_json
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
# Head size 256: a K/V buffer is tile * 512 bytes, so tiles of 128+ keys overflow sm86's 100 KB
# (the 128-key decode tile took 141-205 KB); fewer warps and deeper or shallower pipelines instead.
WIDE_CONFIGS = [
    (32, 4, 5, 1),
    (32, 4, 4, 1),
    (32, 2, 4, 1),
    (32, 2, 5, 1),
    (32, 8, 5, 1),
    (32, 1, 4, 1),
    (16, 1, 4, 1),
    (16, 2, 5, 1),
    (64, 4, 4, 1),
    (64, 4, 3, 1),
    (64, 8, 4, 1),
    (64, 2, 4, 1),
]
# int4 decode tiles are one 64-token page (its K scales fold into q per tile): (warps, stages)
INT4_CONFIGS = [(4, 3), (4, 4), (4, 6), (2, 3), (2, 4), (2, 6), (8, 3), (8, 4), (1, 4)]
# Split counts tried per shape: the heuristic's and these multiples of it (small programs need
# more of them to fill the GPU: 4-5 of a 64-token, 2-warp program fit an SM where 2 of the
# 128-token, 4-warp one do; half as many splits halves the merge and doubles each program's
# tiles, which is what a short pipeline at batch 8 might want).
SPLIT_FACTORS = (0.5, 1, 2, 4, 8)
# A single-KV-head batch at 32 splits fills a quarter of an H200 (batch 1) or 2 of its programs
# per SM (batch 8); the sweep goes past attention_plan.MAX_SPLITS to see if that cap costs time.
TUNE_MAX_SPLITS = 128
SHAPES = [(8, 8192), (32, 8192), (8, 1024), (128, 1024), (1, 32768)]
# Shapes the decode target is judged on (ctx >= 8K, batch >= 8): best_config ranks on these.
TARGET_SHAPES = {(8, 8192), (32, 8192)}


def fixed_config(tile_n: int, warps: int, stages: int, chunks: int):
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


def split_counts(heur: int) -> list[int]:
    return sorted({min(TUNE_MAX_SPLITS, max(1, int(heur * f))) for f in SPLIT_FACTORS})


def tune_int4(nq: int, nkv: int, d: int, bw: float) -> None:
    """The int4 sweep: benchmarks/kernels.py's decode row (pages plus a partial tail page per
    sequence) under each (warps, stages) of INT4_CONFIGS and split count."""
    import int8kv_kernels.attention_int4 as A4
    import int8kv_kernels.attention_plan as P
    from benchmarks import kernels as KB

    orig_cfg, orig_splits = A4.choose_config_int4, P.choose_num_splits
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    log = []
    try:
        for batch, ctx in SHAPES:
            heur = orig_splits(batch, nkv, ctx + KB.TAIL_TOKENS, sms)
            line = []
            for w, st in INT4_CONFIGS:
                # kernels.py's workspace holds attention_plan.MAX_SPLITS splits
                for ns in [s for s in split_counts(heur) if s <= P.MAX_SPLITS]:
                    base = orig_cfg(nq // nkv, d, 1)
                    A4.choose_config_int4 = lambda *_a, **_k: A.LaunchConfig(
                        base.block_m, 64, w, st, True, 1
                    )
                    P.choose_num_splits = lambda *_a, ns=ns, **_k: ns
                    try:
                        row = KB.bench_attention("int4", "decode", nq, nkv, d, batch, ctx, 1)
                    except Exception as e:  # noqa: BLE001
                        print("fail int4", w, st, ns, repr(e)[:150], flush=True)
                        continue
                    frac = row["gbs"] / bw
                    log.append(dict(dtype="int4", batch=batch, ctx=ctx, tile=64, warps=w,
                                    stages=st, chunks=1, splits=ns, us=row["ms"] * 1e3,
                                    frac=frac))  # fmt: skip
                    line.append((frac, w, st, ns, row["ms"] * 1e3))
                    torch.cuda.empty_cache()
            line.sort(reverse=True)
            print(f"b={batch} ctx={ctx} heur_splits={heur}", flush=True)
            for frac, w, st, ns, us in line[:6]:
                print(f"   int4 w={w} st={st} splits={ns:3d} {us:9.1f}us {frac * 100:5.1f}%bw",
                      flush=True)  # fmt: skip
            _save(log, nq, nkv, d, bw, "int4")  # a sweep stopped by a time limit keeps its shapes
    finally:
        A4.choose_config_int4, P.choose_num_splits = orig_cfg, orig_splits


def _save(log: list[dict], nq: int, nkv: int, d: int, bw: float, tag: str = "") -> None:
    if os.environ.get("OUT"):
        name = f"tune_decode{'_' + tag if tag else ''}_{nq}_{nkv}_{d}.json"
        command = shlex.join(["python", "-m", "benchmarks.tune_decode", *sys.argv[1:]])
        doc = dict(gpu=torch.cuda.get_device_name(), command=command, copy_gbs=bw,
                   shape=[nq, nkv, d], rows=log)  # fmt: skip
        write_json(doc, os.path.join(os.environ["OUT"], name))


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
    if "--shape" in sys.argv[1:]:
        nq, nkv, d = map(int, sys.argv[sys.argv.index("--shape") + 1].split(","))
    if "--int4" in sys.argv[1:]:
        return tune_int4(nq, nkv, d, bw)
    ws = make_workspace(128, nq, d, TUNE_MAX_SPLITS, device="cuda")
    configs = CONFIGS if d <= 128 else WIDE_CONFIGS
    orig = A._choose_config
    log = []
    for batch, ctx in SHAPES:
        kv_bytes = batch * ctx * nkv * (2 * d + 4)
        copies = max(1, min(8, -(-2 * L2_BYTES // kv_bytes)))
        caches, bt, q, out, qsl, sl = decode_setup(batch, ctx, nq, nkv, d, copies=copies)
        must = kv_bytes + 2 * q.numel() * 2
        heur = A.choose_num_splits(batch, nkv, ctx, sms)
        line = []
        # head size 256: the int8 sweep only (int8_static takes the same config)
        for kv_dtype in INT8_DTYPES if d <= 128 else ("int8",):
            scales = torch.full((nkv, d), 0.01, device="cuda")  # per (kv-head, channel)
            for tn, w, st, ch in configs if kv_dtype == "int8" else configs[:2] + configs[-1:]:
                for ns in split_counts(heur):
                    A._choose_config = fixed_config(tn, w, st, ch)

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
    _save(log, nq, nkv, d, bw)


if __name__ == "__main__":
    main()
