"""Compile every kernel specialisation for sm80 (needs no GPU, only ptxas), and check the code;
and the int4 decode configuration for sm90, which must not become wgmma there.

    python -m benchmarks.compile_sm80

Run in a process without TRITON_INTERPRET (the interpreter replaces @triton.jit functions): the
test (tests/kernels/test_compile_sm80.py) starts it as its own process. Prints one line per
specialisation and exits non-zero on the first failure. ``decode_issue_budget.py`` compiles the
int8 and int4 decode loops with :func:`compile_one`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from int8kv_kernels import Int4PageLayout, PageLayout  # noqa: E402
from int8kv_kernels.attention import _attn_fwd, _choose_config  # noqa: E402
from int8kv_kernels.attention_int4 import _attn_int4_fwd, choose_config_int4  # noqa: E402
from int8kv_kernels.attention_plan import MAX_SHARED_BYTES, merge_splits  # noqa: E402
from int8kv_kernels.cache_write import _write_kv_kernel, write_launch  # noqa: E402
from int8kv_kernels.cache_write_int4 import (  # noqa: E402
    _flush_pages_kernel,
    _store_sink_kernel,
    _store_tail_kernel,
    int4_flush_launch,
)
from int8kv_kernels.catalogue import INT8_DTYPES, get_dtype  # noqa: E402
from int8kv_kernels.context_gather import (  # noqa: E402
    _BLOCK_T,
    _gather_int4_kernel,
    _gather_kv_kernel,
)

SM80 = GPUTarget("cuda", 80, 32)
SM90 = GPUTarget("cuda", 90, 32)
# pointer arguments of attention.py's _attn_fwd (bf16 queries; decode_issue_budget.py uses them too)
ATTN_PTRS = {"q_ptr": "*bf16", "out_ptr": "*bf16", "cache_ptr": "*i8", "cache16_ptr": "*fp16",
             "block_table_ptr": "*i32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32",
             "static_k_ptr": "*fp32", "static_v_ptr": "*fp32", "ws_acc_ptr": "*fp32",
             "ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32"}  # fmt: skip
# of attention_int4.py's _attn_int4_fwd, bf16 queries, tail and sink (compile_int4 swaps in fp16)
ATTN_INT4_PTRS = {"q_ptr": "*bf16", "out_ptr": "*bf16", "cache_ptr": "*u8",
                  "cache16_ptr": "*fp16", "tail_ptr": "*bf16", "tail_page_ptr": "*i32",
                  "block_table_ptr": "*i32",
                  "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "slot_of_seq_ptr": "*i32",
                  "sink_ptr": "*bf16", "sink_of_seq_ptr": "*i32",
                  "ws_acc_ptr": "*fp32", "ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32"}  # fmt: skip
FLOAT_ARGS = {"softmax_scale", "soft_cap"}


def compile_one(
    fn, ptrs: dict[str, str], consts: dict, num_warps: int, num_stages: int = 3,
    max_shared: int | None = MAX_SHARED_BYTES, target: GPUTarget = SM80,
):  # fmt: skip
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
        else:
            sig[name] = "fp32" if name in FLOAT_ARGS else "i32"
    cexpr = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    # As Triton specializes at launch: pointers (tensor storage) and strides (whole rows of a
    # 16-byte-aligned page layout) divisible by 16. Without it no load can become a cp.async and
    # the pipeline checks below would look at code that never runs.
    aligned = [n for n in fn.arg_names if n in ptrs or n.startswith("stride")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=cexpr, attrs=attrs)
    k = triton.compile(
        src, target=target, options={"num_warps": num_warps, "num_stages": num_stages}
    )
    ptx = k.asm["ptx"]
    if target != SM80:  # sm90 compiles (compile_int4_decode_sm90) check their own code
        return k
    assert ".target sm_80" in ptx
    assert "wgmma" not in ptx and "cp.async.bulk" not in ptx  # nothing Hopper-only
    assert "e4m3x2" not in ptx  # no FP8 conversion instruction (sm89+); the E4M3 codec is bit ops
    # launchable on every target (sm86 allows a block the least shared memory)
    shared = k.metadata.shared
    assert max_shared is None or shared <= max_shared, f"{fn.__name__}: {shared} B shared memory"
    return k


def check_pipelined(k, dynamic: bool, decode: bool, chunks: int) -> None:
    """The K/V tiles (and, on the prefill path, the per-token scales) of the loop are loaded with
    asynchronous copies, i.e. the pipeliner overlaps them with the math of the previous tile.

    Regressions this catches: a pointer expression whose alignment Triton can no longer prove, a
    load the pipeliner stops accepting -- each turns the loop back into load, wait, compute. (The
    decode path prefetches its scales by hand instead, see attention.py.)"""
    ttgir = k.asm["ttgir"]
    copies = [ln for ln in ttgir.splitlines() if "async_copy_global_to_local" in ln]
    kv_copies = [ln for ln in copies if "xi8" in ln.split("->")[-1]]
    assert len(kv_copies) >= 2, f"K/V loads are not asynchronous copies ({len(copies)} copies)"
    if dynamic and not decode and chunks == 1:
        scale_copies = [ln for ln in copies if "xf16" in ln.split("->")[-1]]
        assert scale_copies, "prefill scale loads are not asynchronous copies"


def check_v_operand(k) -> None:
    """The PV product's V operand (int8, or int4's packed bytes) is read from shared memory in
    words, not bytes: no byte-wide shared-memory load of any kind is left.

    V is stored key-major in the page (page_layout.py) so that the tile lands in shared memory with
    keys (the PV reduction dimension) contiguous. Stored D-contiguous like K, int8 V compiled to one
    ``ld.shared.b8`` per element (128 per thread and 128-key decode tile, 256 in a prefill tile)
    plus the byte permutes to assemble them, the main instruction cost of the loop; int4 V to 64 per
    decode tile (D = 128), 128 per prefill tile. (K's operand was always read in words.)"""
    loads = re.findall(r"ld\.shared(?:\.v\d)?\.[bsu]8\b", k.asm["ptx"])
    assert not loads, f"{len(loads)} byte-wide shared-memory loads: the V tile is not read in words"


def check_write_v_store(k, v_bytes: int, tile_t: int) -> None:
    """The write stores V with neighbouring tokens of its tile on neighbouring threads.

    A token's V is ``v_bytes`` single bytes B apart in the key-major page (D for int8, D/2 for
    int4); only consecutive tokens across a warp put the byte stores of consecutive slots into
    shared 32-byte sectors (cache_write.py). Stored as a 2-D [bytes, tokens] tile instead, Triton
    3.6 laid the threads out along the bytes."""
    ttgir = k.asm["ttgir"]
    flat = f"tensor<{v_bytes * tile_t}x!tt.ptr<i8>, #"
    stores = [ln for ln in ttgir.splitlines() if "tt.store" in ln and flat in ln]
    assert len(stores) == 1, f"{len(stores)} flat [D * tokens] V stores in the write"
    enc = stores[0].split(flat)[1].split(">")[0]
    layout = next(ln for ln in ttgir.splitlines() if ln.startswith(f"#{enc} = "))
    assert "sizePerThread = [1]," in layout and "threadsPerWarp = [32]," in layout, layout


def check_int4_pipelined(k) -> None:
    """As check_pipelined, for int4: the packed K/V bytes of a page are asynchronous copies, so
    the next page streams in while this one computes."""
    copies = [ln for ln in k.asm["ttgir"].splitlines() if "async_copy_global_to_local" in ln]
    targets = [ln.split("->")[-1] for ln in copies]
    assert sum("xi8" in t for t in targets) >= 2, "int4 K/V loads are not asynchronous copies"


def main_loop_lines(ptx: str) -> list[str]:
    """The PTX lines of the longest backward-branch loop in ``ptx`` (the K/V tile loop)."""
    lines = ptx.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        m = re.match(r"^(\$L__BB\d+_\d+):", line.strip())
        if m:
            labels[m.group(1)] = i
    loop = None
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and labels.get(m.group(1), i) < i:
            if loop is None or i - labels[m.group(1)] > loop[1] - loop[0]:
                loop = (labels[m.group(1)], i)
    return lines[loop[0] : loop[1] + 1]


def check_int4_decode_in_flight(k) -> None:
    """The int4 decode loop waits on its copies with some still in flight (a wait of 0 waits at
    the start of each step on copies issued at the end of the step before, with nothing between
    issue and wait), and its codes have two buffers."""
    ttgir = k.asm["ttgir"]
    waits = [int(n) for n in re.findall(r"ttg\.async_wait .*\{num = (\d+) : i32\}", ttgir)]
    assert any(waits), f"int4 decode: every asynchronous-copy wait is 0 ({waits})"
    assert re.search(r"memdesc<2x64x\d+xi8", ttgir), "int4 decode: one buffer of codes"


def main() -> int:
    n = 0
    # (kv_dtype, v_format): the E4M3 codec is integer/float bit operations, no FP8 instruction.
    for kv_dtype, v_fmt in [(d, f) for d in INT8_DTYPES for f in get_dtype(d).v_formats]:
        for dt in ("bf16", "fp16"):
            # both launch shapes: a decode step's batch and a prefill chunk
            for (nkv, d), tokens in itertools.product(((8, 128), (3, 64), (2, 256)), (1, 10**6)):
                lay = PageLayout(kv_dtype, 16, nkv, d)
                tile, warps = write_launch(tokens)
                k = compile_one(
                    _write_kv_kernel,
                    {"key_ptr": f"*{dt}", "value_ptr": f"*{dt}", "cache_ptr": "*i8",
                     "cache16_ptr": "*fp16", "slot_ptr": "*i64", "k_scale_ptr": "*fp32",
                     "v_scale_ptr": "*fp32"},
                    dict(TILE_T=tile, V_E4M3=v_fmt == "e4m3", **lay.kernel_constexprs()),
                    num_warps=warps,
                )  # fmt: skip
                n += 1
                check_write_v_store(k, d, tile)
                print("ok write", kv_dtype, v_fmt, dt, nkv, d, tile, flush=True)
    cases = [  # (kv_dtype, nq, nkv, d, block_size, max_query_len, window, softcap)
        ("int8", 32, 8, 128, 16, 1, False, False),
        ("int8", 28, 4, 128, 16, 1, False, False),
        ("int8", 9, 3, 64, 16, 1, True, True),
        ("int8", 16, 2, 256, 32, 1, False, False),
        ("int8", 32, 8, 128, 16, 2048, False, False),
        ("int8", 9, 3, 64, 32, 512, True, True),
        ("int8", 8, 8, 256, 16, 512, False, False),
        ("int8_static", 32, 8, 128, 16, 1, False, False),
        ("int8_static", 32, 8, 128, 16, 2048, True, False),
        ("int8", 32, 8, 128, 16, 1, False, False, 4),
        ("int8_static", 9, 3, 64, 16, 1, True, True, 4),
        # kv_dtype "int8_static+e4m3": V as FP8-E4M3 codes (decode, prefill, chunked decode)
        ("int8_static+e4m3", 32, 8, 128, 16, 1, False, False),
        ("int8_static+e4m3", 16, 2, 256, 32, 1, True, True),
        ("int8_static+e4m3", 32, 8, 128, 16, 2048, True, False),
        ("int8_static+e4m3", 8, 8, 256, 16, 512, False, True),
        ("int8_static+e4m3", 9, 3, 64, 16, 1, True, True, 4),
        # the prefill configuration with its keys split (short continuations over long contexts)
        ("int8", 9, 3, 64, 16, 32, True, True, 1, True),
        ("int8", 4, 1, 256, 16, 32, True, True, 1, True),
        ("int8", 32, 8, 128, 16, 32, False, False, 1, True),
    ]
    for name, nq, nkv, d, bs, mq, window, softcap, *more in cases:
        # (chunks) or (chunks, prefill_split) after the common fields
        chunks = more[0] if more else 1
        prefill_split = len(more) > 1 and more[1]
        kv_dtype, _, v_fmt = name.partition("+")
        lay = PageLayout(kv_dtype, bs, nkv, d)
        group = nq // nkv
        cfg = _choose_config(group, d, mq, v_e4m3=v_fmt == "e4m3")
        if chunks > 1:  # the split-K-inside-the-program decode loop, off by default
            cfg = dataclasses.replace(cfg, chunks=chunks)
        k = compile_one(
            _attn_fwd, ATTN_PTRS,
            dict(NUM_Q_HEADS=nq, GROUP=group, BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_m // group,
                 TILE_N=cfg.tile_n, CHUNKS=cfg.chunks, USE_WINDOW=window, USE_SOFTCAP=softcap,
                 SPLIT=cfg.split or prefill_split, DECODE=cfg.split, DOT_F32=False,
                 V_E4M3=v_fmt == "e4m3", **lay.kernel_constexprs()),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            # the in-program split-K loop is a tuning option, off by default: not held to sm86
            max_shared=None if chunks > 1 else MAX_SHARED_BYTES,
        )  # fmt: skip
        n += 1
        check_pipelined(k, dynamic=lay.has_scales, decode=cfg.split, chunks=cfg.chunks)
        if cfg.chunks == 1:
            check_v_operand(k)
        print("ok attention", name, nq, nkv, d, bs, mq, window, softcap, prefill_split, flush=True)
        if cfg.split:
            compile_one(
                merge_splits,
                {"out_ptr": "*bf16", "ws_acc_ptr": "*fp32", "ws_m_ptr": "*fp32",
                 "ws_l_ptr": "*fp32", "qsl_ptr": "*i32"},
                dict(NUM_Q_HEADS=nq, HEAD_SIZE=d, S_PAD=32),
                num_warps=4,
            )  # fmt: skip
            n += 1
    n += compile_int4()
    n += compile_gather()
    n += compile_int4_tail_pages()
    print(f"compiled {n} specialisations for sm80")
    return 0


def compile_int4() -> int:
    """int4: the page flush, the tail store and the sink store for every catalogue head size (one
    program per sequence and per page), attention decode (split and not) and prefill for each
    head size, GQA groups 1 / 3 / 4 / 8, window + soft-cap, bf16 and fp16, with and without a
    sink page."""
    n = 0
    for dt, nkv, d, per_seq in (("bf16", 8, 128, 0), ("fp16", 3, 64, 2), ("bf16", 2, 256, 2),
                                ("bf16", 1, 128, 2)):  # fmt: skip
        n += compile_int4_write(dt, nkv, d, per_seq, tail_pages=1)
        compile_one(
            _store_sink_kernel,
            {"key_ptr": f"*{dt}", "value_ptr": f"*{dt}", "sink_ptr": f"*{dt}", "qsl_ptr": "*i32",
             "seq_lens_ptr": "*i32", "sink_of_seq_ptr": "*i32"},
            dict(HEAD_SIZE=d, BLOCK_SIZE=64),
            num_warps=4,
        )  # fmt: skip
        n += 1
        print("ok write int4", dt, nkv, d, per_seq, flush=True)
    cases = [  # (dtype, nq, nkv, d, max_query_len, window, softcap, split, sink)
        ("bf16", 32, 8, 128, 1, False, False, True, False),
        ("bf16", 32, 8, 128, 1, False, False, False, False),
        ("fp16", 8, 8, 128, 1, False, False, True, False),
        ("bf16", 9, 3, 64, 1, True, True, True, False),
        ("bf16", 16, 2, 256, 1, False, False, True, False),
        ("bf16", 4, 1, 256, 1, True, True, True, False),
        # the decode configuration's 16-row variant (short continuations, speculative tokens)
        ("bf16", 4, 1, 256, 2, True, False, True, False),
        ("bf16", 32, 8, 128, 2, False, False, True, False),
        ("bf16", 32, 8, 128, 2048, False, False, False, False),
        ("bf16", 9, 3, 64, 512, True, True, False, False),
        ("fp16", 8, 8, 256, 512, False, False, False, False),
        ("bf16", 4, 1, 256, 512, True, True, False, False),
        ("bf16", 64, 8, 128, 512, True, False, False, False),
        # with a sink page (one more model-dtype page before the tail's)
        ("bf16", 32, 8, 128, 1, False, False, True, True),
        ("fp16", 9, 3, 64, 1, True, True, True, True),
        ("bf16", 4, 1, 256, 1, True, False, True, True),
        ("bf16", 4, 1, 256, 2, True, False, True, True),
        ("bf16", 32, 8, 128, 2048, False, False, False, True),
        ("bf16", 4, 1, 256, 512, True, True, False, True),
        # the prefill configuration with its keys split (short continuations over long contexts)
        ("bf16", 9, 3, 64, 512, True, True, True, True),
        ("bf16", 4, 1, 256, 512, True, True, True, True),
    ]
    n += compile_int4_attention(cases, tail_pages=1)
    return n + compile_int4_decode_sm90()


def compile_int4_attention(cases: list[tuple], tail_pages: int) -> int:
    """int4 attention, one specialisation per case (dtype, nq, nkv, d, max_query_len, window,
    softcap, split, sink) with ``tail_pages`` pages a tail slot, checked for its pipelined loads
    and V operand (decode: its copies in flight); with one page, a split case also compiles the
    split merge (the same kernel serves both tails)."""
    n = 0
    for dt, nq, nkv, d, mq, window, softcap, split, sink in cases:
        lay = Int4PageLayout(64, nkv, d)
        group = nq // nkv
        cfg = choose_config_int4(group, d, mq)
        ptrs = {**ATTN_INT4_PTRS, "q_ptr": f"*{dt}", "out_ptr": f"*{dt}", "tail_ptr": f"*{dt}",
                "sink_ptr": f"*{dt}"}  # fmt: skip
        k = compile_one(
            _attn_int4_fwd, ptrs,
            dict(NUM_Q_HEADS=nq, GROUP=group, BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_m // group,
                 USE_WINDOW=window, USE_SOFTCAP=softcap, SPLIT=split,
                 HAS_SINK=sink, DOT_F32=False, TAIL_PAGES=tail_pages, **lay.kernel_constexprs()),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        n += 1
        check_int4_pipelined(k)
        check_v_operand(k)
        if cfg.block_m <= 16:  # the decode configuration
            check_int4_decode_in_flight(k)
        pages = "" if tail_pages == 1 else f" tail pages {tail_pages}"
        print(f"ok attention int4{pages}", dt, nq, nkv, d, mq, window, softcap, split, sink,
              k.metadata.shared, flush=True)  # fmt: skip
        if tail_pages == 1 and split:
            compile_one(
                merge_splits,
                {"out_ptr": f"*{dt}", "ws_acc_ptr": "*fp32", "ws_m_ptr": "*fp32",
                 "ws_l_ptr": "*fp32", "qsl_ptr": "*i32"},
                dict(NUM_Q_HEADS=nq, HEAD_SIZE=d, S_PAD=32),
                num_warps=4,
            )  # fmt: skip
            n += 1
    return n


SM90_SHAPES = ((4, 1, 256, 2), (32, 8, 128, 4), (9, 3, 64, 2), (4, 1, 256, 1), (32, 8, 128, 1))


def compile_int4_decode_sm90(
    tail_pages: int = 1, shapes: tuple[tuple[int, int, int, int], ...] = SM90_SHAPES
) -> int:
    """The int4 decode configuration as choose_config_int4 sets it for sm90 (the H200 that stands
    in for Ampere) compiles to mma.sync, not Hopper's wgmma.

    Its dots take a register operand unpacked from the codes by inline PTX (keys on the MMA's M
    side). With four warps Triton 3.6 made the 16-row variant's dots wgmma for sm90; on the H200
    that code failed every GPU case (CUDA illegal memory access, or output rows never written),
    at head sizes 128 and 256, while the same kernel as mma.sync (two warps, or
    DISABLE_MMA_V3=1) passed them (2026-12-03). Shapes (nq, nkv, head size, max_query_len)."""
    n = 0
    for nq, nkv, d, mq in shapes:
        lay = Int4PageLayout(64, nkv, d)
        group = nq // nkv
        cfg = choose_config_int4(group, d, mq, cc_major=9)
        k = compile_one(
            _attn_int4_fwd, ATTN_INT4_PTRS,
            dict(NUM_Q_HEADS=nq, GROUP=group, BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_m // group,
                 USE_WINDOW=d == 256, USE_SOFTCAP=False, SPLIT=True, HAS_SINK=d == 256,
                 DOT_F32=False, TAIL_PAGES=tail_pages, **lay.kernel_constexprs()),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, max_shared=None, target=SM90,
        )  # fmt: skip
        ptx = k.asm["ptx"]
        assert ".target sm_90" in ptx
        assert "wgmma" not in ptx, f"int4 decode {nq}/{nkv}/{d} rows {cfg.block_m}: wgmma on sm90"
        n += 1
        print("ok attention int4 decode sm90", nq, nkv, d, mq, cfg.block_m, cfg.num_warps,
              flush=True)  # fmt: skip
    return n


def compile_int4_write(dt: str, nkv: int, d: int, per_seq: int, tail_pages: int) -> int:
    """The int4 write's two launches, the page flush then the tail store, for ``tail_pages``
    pages a tail slot."""
    lay = Int4PageLayout(64, nkv, d)
    parts = int4_flush_launch(lay)
    warps = parts.pop("num_warps")
    compile_one(
        _flush_pages_kernel,
        int4_flush_ptrs(dt),
        dict(PAGES_PER_SEQ=per_seq, TAIL_PAGES=tail_pages, **lay.kernel_constexprs(), **parts),
        num_warps=warps,
    )  # fmt: skip
    compile_one(_store_tail_kernel, int4_tail_store_ptrs(dt),
                dict(HEAD_SIZE=d, BLOCK_SIZE=64, TAIL_PAGES=tail_pages), num_warps=4)  # fmt: skip
    return 2


def int4_flush_ptrs(dt: str) -> dict[str, str]:
    """Pointer arguments of cache_write_int4.py's _flush_pages_kernel."""
    return {"key_ptr": f"*{dt}", "value_ptr": f"*{dt}", "cache_ptr": "*u8",
            "cache16_ptr": "*fp16", "tail_ptr": f"*{dt}", "tail_page_ptr": "*i32",
            "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "block_table_ptr": "*i32",
            "slot_of_seq_ptr": "*i32", "slot_is_new_ptr": "*i32"}  # fmt: skip


def int4_tail_store_ptrs(dt: str) -> dict[str, str]:
    """Pointer arguments of cache_write_int4.py's _store_tail_kernel."""
    return {"key_ptr": f"*{dt}", "value_ptr": f"*{dt}", "tail_ptr": f"*{dt}",
            "tail_page_ptr": "*i32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32",
            "block_table_ptr": "*i32", "slot_of_seq_ptr": "*i32", "slot_is_new_ptr": "*i32"}  # fmt: skip


def compile_int4_tail_pages() -> int:
    """int4 with a tail of two pages (``INT8KV_INT4_TAIL_PAGES=2``): the flush and the tail store
    at each catalogue head size, attention decode (split, the 16-row variant, window + soft-cap,
    a sink page) and prefill, and the decode configuration on sm90. Compiled after every other
    specialisation, so the one-page ones keep their order (tools comparing their code by index)."""
    n = 0
    for dt, nkv, d, per_seq in (("bf16", 8, 128, 0), ("fp16", 3, 64, 2), ("bf16", 2, 256, 2),
                                ("bf16", 1, 256, 0)):  # fmt: skip
        n += compile_int4_write(dt, nkv, d, per_seq, tail_pages=2)
        print("ok write int4 tail pages 2", dt, nkv, d, per_seq, flush=True)
    cases = [  # (dtype, nq, nkv, d, max_query_len, window, softcap, split, sink)
        ("bf16", 32, 8, 128, 1, False, False, True, False),
        ("fp16", 9, 3, 64, 1, True, True, True, False),
        ("bf16", 4, 1, 256, 1, True, False, True, True),
        ("bf16", 4, 1, 256, 2, True, False, True, True),
        ("bf16", 32, 8, 128, 2, False, False, True, False),
        ("bf16", 32, 8, 128, 2048, False, False, False, True),
        ("bf16", 4, 1, 256, 512, True, True, False, False),
    ]
    n += compile_int4_attention(cases, tail_pages=2)
    return n + compile_int4_decode_sm90(2, ((4, 1, 256, 2), (32, 8, 128, 1)))


def compile_gather() -> int:
    """The context dequantize-gather (FlashAttention continuations): int8 and int8_static (int8
    and E4M3 V), bf16 and fp16 output, each catalogue head size; int4's, with its tail and sink
    pages."""
    n = 0
    cases = [  # (kv_dtype, v_format, out dtype, nkv, head_size, block_size)
        ("int8", "int8", "bf16", 8, 128, 16),
        ("int8", "int8", "fp16", 3, 64, 32),
        ("int8", "int8", "bf16", 2, 256, 16),
        ("int8_static", "int8", "bf16", 8, 128, 16),
        ("int8_static", "e4m3", "bf16", 8, 128, 16),
        ("int8_static", "e4m3", "fp16", 2, 64, 32),
    ]
    for kv_dtype, v_fmt, out_t, nkv, d, bs in cases:
        lay = PageLayout(kv_dtype, bs, nkv, d)
        compile_one(
            _gather_kv_kernel,
            {"cache_ptr": "*i8", "cache16_ptr": "*fp16" if lay.has_scales else "*i8",
             "new_k_ptr": f"*{out_t}", "new_v_ptr": f"*{out_t}", "k_out_ptr": f"*{out_t}",
             "v_out_ptr": f"*{out_t}", "block_table_ptr": "*i32", "cu_q_ptr": "*i32",
             "cu_k_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"},
            dict(BLOCK_T=_BLOCK_T, V_E4M3=v_fmt == "e4m3", OUT_BF16=out_t == "bf16",
                 **lay.kernel_constexprs()),
            num_warps=4,
        )  # fmt: skip
        n += 1
        print("ok gather", kv_dtype, v_fmt, out_t, nkv, d, bs, flush=True)
    # int4: its pages, one or two tail pages a slot, with and without a sink page
    for out_t, nkv, d, tail_pages, sink in (
        ("bf16", 3, 64, 2, True),
        ("fp16", 8, 128, 1, False),
        ("bf16", 1, 256, 2, True),
        ("bf16", 2, 256, 1, False),
    ):
        compile_one(
            _gather_int4_kernel,
            {"cache_ptr": "*u8", "cache16_ptr": "*fp16", "tail_ptr": f"*{out_t}",
             "tail_page_ptr": "*i32", "sink_ptr": f"*{out_t}", "new_k_ptr": f"*{out_t}",
             "new_v_ptr": f"*{out_t}", "k_out_ptr": f"*{out_t}", "v_out_ptr": f"*{out_t}",
             "block_table_ptr": "*i32", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32",
             "slot_of_seq_ptr": "*i32", "sink_of_seq_ptr": "*i32"},
            dict(BLOCK_T=_BLOCK_T, TAIL_PAGES=tail_pages, HAS_SINK=sink,
                 OUT_BF16=out_t == "bf16", **Int4PageLayout(64, nkv, d).kernel_constexprs()),
            num_warps=4,
        )  # fmt: skip
        n += 1
        print("ok gather int4", out_t, nkv, d, tail_pages, sink, flush=True)
    return n


if __name__ == "__main__":
    sys.exit(main())
