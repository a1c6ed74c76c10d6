"""Instruction budget of the INT8 and INT4 decode loops: bound by memory or by instruction issue?

Compiles the decode specialisations of ``_attn_fwd`` (each int8 dtype) and of ``_attn_int4_fwd``
(int4: one 64-token page per tile) for sm80 at each model shape of benchmarks/kernels.py (no GPU
needed, like benchmarks/compile_sm80.py), counts the PTX instructions of its main loop per thread
per K/V tile, and turns them into warp-instructions per KiB of K/V streamed (the page bytes of the
program's kv-head: codes and their scales, and int4's zeros). At a GPU's full memory bandwidth that costs ``bandwidth / 1 KiB * warp_instr_per_kib`` warp-instructions per second,
against an issue capacity of ``SMs * 4 schedulers * clock`` (one warp-instruction per scheduler
per clock, the sm80/sm86/sm90 rate). A share near or above ~50% means instruction issue, not
memory, limits how close the kernel can get to the bandwidth: the latency of every instruction
then has to be hidden too.

Also records the compiled program's registers and shared memory and how many programs each GPU
keeps resident per SM (``programs_per_sm``): the warps it has to hide latency with.

PTX is not SASS (ptxas may fuse or split a little), and the GPU figures are vendor specs (boost
clock, peak bandwidth), so this is an estimate of where the bound lies, not a measurement.

    python -m benchmarks.decode_issue_budget [--out benchmarks/results/decode_issue_budget.json]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import triton  # noqa: E402

from benchmarks.common import MODEL_SHAPES, RESULTS_DIR, write_json  # noqa: E402
from benchmarks.compile_sm80 import (  # noqa: E402
    ATTN_INT4_PTRS,
    ATTN_PTRS,
    compile_one,
    main_loop_lines,
)
from int8kv_kernels import INT4_DTYPES, INT8_DTYPES, Int4PageLayout, PageLayout  # noqa: E402
from int8kv_kernels.attention import _attn_fwd, _choose_config  # noqa: E402
from int8kv_kernels.attention_int4 import _attn_int4_fwd, choose_config_int4  # noqa: E402
from int8kv_kernels.catalogue import get_dtype  # noqa: E402

# name: (SMs, boost clock GHz, peak memory bandwidth GB/s, compute capability), from the vendors'
# spec sheets.
GPUS = {
    "H200 (sm90)": (132, 1.98, 4800, "sm90"),
    "A100 80GB SXM (sm80)": (108, 1.41, 2039, "sm80"),
    "A6000 (sm86)": (84, 1.80, 768, "sm86"),
    "A40 (sm86)": (84, 1.74, 696, "sm86"),
    "RTX 3090 (sm86)": (82, 1.70, 936, "sm86"),
    "A10 (sm86)": (72, 1.70, 600, "sm86"),
}
# Per SM (CUDA C Programming Guide, "Technical Specifications per Compute Capability"): 32-bit
# registers, shared memory in bytes, resident threads. Each resident block also takes 1 KiB of
# shared memory for the system, and registers are allocated per warp in units of 256.
SM_LIMITS = {
    "sm80": (65536, 164 * 1024, 2048),
    "sm86": (65536, 100 * 1024, 1536),
    "sm90": (65536, 228 * 1024, 2048),
}


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int, arch: str) -> int:
    """Resident programs (thread blocks) per SM, the least of what registers, shared memory and
    threads allow: how many warps the SM has to hide one another's latency."""
    regs, smem, threads = SM_LIMITS[arch]
    warp_regs = -(-registers * 32 // 256) * 256
    return min(
        regs // (warp_regs * num_warps), smem // (shared_bytes + 1024), threads // (32 * num_warps)
    )


def registers_per_thread(kernel) -> int:
    """Registers per thread of a compiled kernel, from its cubin (cuobjdump ships with Triton)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    return int(re.search(r"REG:(\d+)", out).group(1))


def main_loop_ops(ptx: str) -> collections.Counter:
    """Opcode counts of the longest backward-branch loop in ``ptx`` (the K/V tile loop)."""
    ops: collections.Counter = collections.Counter()
    for line in main_loop_lines(ptx):
        tok = line.strip().split()
        if not tok or tok[0].startswith(("$", "//", "{", "}", ".")):
            continue
        op = (tok[1] if tok[0].startswith("@") else tok[0]).rstrip(";")
        ops[op] += 1
    return ops


def family(op: str, kv_dtype: str = "int8") -> str:
    """Buckets of the loop's work: what each instruction is there for."""
    if kv_dtype in INT4_DTYPES:
        # The nibble split (attention_int4._nibbles): a byte permute, a shift, the and-or (lop3) of
        # fp16's 1024 exponent and the exact fp16-pair subtraction or fma, with the constants' moves.
        if op.startswith(("prmt", "lop3", "shr.b32", "sub.f16x2", "fma.rn.f16x2", "cvt")):
            return "int4 -> fp16 conversion and casts"
    elif op.startswith(("prmt", "xor", "sub.f16x2", "add.f16x2", "cvt")):
        return "int8 -> fp16 conversion and casts"
    if op.startswith(("mma", "ldmatrix")):
        return "tensor-core MMA and operand loads"
    if op.startswith(("cp.async", "ld.global", "ld.shared", "st.shared")):
        return "memory copies and shared-memory traffic"
    if op.startswith(("bar", "shfl")):
        return "barriers and warp shuffles"
    if op.startswith("mov"):
        return "register moves"
    return "other (softmax, addressing, control)"


def compile_decode(kv_dtype: str, nq: int, nkv: int, d: int, sink: bool = False):
    """(compiled kernel, launch config, page layout) of the decode specialisation that serving
    launches for ``kv_dtype`` at this shape: split, no window, no soft-cap (``sink``: int4's
    variant that reads a sink page, not launched by serving yet)."""
    group = nq // nkv
    if kv_dtype in INT4_DTYPES:
        lay = Int4PageLayout(get_dtype(kv_dtype).page_tokens, nkv, d, kv_dtype)
        cfg = choose_config_int4(group, d, 1)
        k = compile_one(
            _attn_int4_fwd, ATTN_INT4_PTRS,
            dict(NUM_Q_HEADS=nq, GROUP=group, BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_m // group,
                 USE_WINDOW=False, USE_SOFTCAP=False, SPLIT=cfg.split, HAS_SINK=sink,
                 DOT_F32=False, TAIL_PAGES=1, **lay.kernel_constexprs()),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        return k, cfg, lay
    lay = PageLayout(kv_dtype, 16, nkv, d)
    cfg = _choose_config(group, d, 1)
    k = compile_one(
        _attn_fwd, ATTN_PTRS,
        dict(NUM_Q_HEADS=nq, GROUP=group, BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_m // group,
             TILE_N=cfg.tile_n, CHUNKS=cfg.chunks, USE_WINDOW=False, USE_SOFTCAP=False,
             SPLIT=cfg.split, DECODE=cfg.split, DOT_F32=False, V_E4M3=False,
             **lay.kernel_constexprs()),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return k, cfg, lay


def budget(kv_dtype: str, nq: int = 32, nkv: int = 8, d: int = 128, sink: bool = False) -> dict:
    k, cfg, lay = compile_decode(kv_dtype, nq, nkv, d, sink)
    ops = main_loop_ops(k.asm["ptx"])
    per_thread = sum(ops.values())
    # K/V bytes one program streams per tile: its kv-head's share of each page, scales (and int4's
    # zeros) included
    tile_bytes = cfg.tile_n * lay.page_bytes // (lay.block_size * nkv)
    per_kib = per_thread * cfg.num_warps / tile_bytes * 1024
    families: collections.Counter = collections.Counter()
    for op, n in ops.items():
        families[family(op, kv_dtype)] += n
    share = {
        gpu: round(bw * 1e9 / 1024 * per_kib / (sms * 4 * ghz * 1e9), 3)
        for gpu, (sms, ghz, bw, _) in GPUS.items()
    }
    registers, shared = registers_per_thread(k), k.metadata.shared
    resident = {
        gpu: programs_per_sm(registers, shared, cfg.num_warps, arch)
        for gpu, (*_, arch) in GPUS.items()
    }
    return {
        "kv_dtype": kv_dtype, "q_heads": nq, "kv_heads": nkv, "head_dim": d,
        "config": {"tile_n": cfg.tile_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
        "loop_instructions_per_thread": per_thread, "tile_bytes": tile_bytes,
        "warp_instructions_per_kib": round(per_kib, 1),
        "loop_share": {f: round(n / per_thread, 3) for f, n in families.most_common()},
        "issue_share_at_peak_bandwidth": share,
        "registers": registers, "shared_bytes": shared, "programs_per_sm": resident,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS_DIR / "decode_issue_budget.json"))
    args = ap.parse_args()
    rows = [budget(kv, *shape) for shape in MODEL_SHAPES for kv in (*INT8_DTYPES, *INT4_DTYPES)]
    # compiled on whatever machine runs it: no GPU measured anything ("gpu": None)
    command = "python -m benchmarks.decode_issue_budget"
    result = {"command": command, "gpus": GPUS, "gpu": None, "rows": rows}
    write_json(result, args.out)
    for r in rows:
        shape = f"{r['q_heads']}/{r['kv_heads']}, {r['head_dim']}"
        print(r["kv_dtype"], shape, r["warp_instructions_per_kib"], "registers", r["registers"],
              "programs/SM", r["programs_per_sm"])  # fmt: skip


if __name__ == "__main__":
    main()
