"""Launch every FlashAttention-2 kernel variant the serving runs use once, so that a GPU without
machine code for them compiles their PTX before anything is timed.

    python -m benchmarks.fa2_precompile [--models smollm2,gemma3,llama3-8b-shape] [--jobs 16] [--dry-run]

vLLM 0.24.0's FlashAttention-2 library carries sm_80 machine code and sm_80 PTX only
(``benchmarks/results/fa2_cuda_archs.json``). On the H200 that stands in for Ampere the driver
compiles the PTX of each kernel the first time it is launched, into its compute cache
(``~/.nv/ComputeCache``; ``CUDA_CACHE_MAXSIZE`` must be above its 256 MiB default in every process
that uses it, or the cache evicts what was compiled: ``run_gpu_e2e.sh`` sets 4 GiB): a BF16
FlashAttention-2 server's first start on a fresh host once took 388 s, 161 s of it in CUDA-graph
capture. Ampere GPUs run the shipped sm_80 code and need none of this. Each variant's log goes to
``$OUT/logs`` (``/tmp`` without ``$OUT``).

Each variant (head shape, window, launch kind) runs in a process of its own, ``--jobs`` at a time:
the driver compiles on the launching thread, so separate processes compile in parallel. The kinds:
``dense`` (varlen prefill over contiguous K/V: the shim's prefills and context gathers),
``paged_prefill`` (vLLM's FlashAttention-2 backend over the paged BF16 cache) and ``decodeN``
(paged decode of N sequences at three context lengths, so every split count FlashAttention-2's
heuristic picks, and its combine kernels, are compiled).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from pathlib import Path

from benchmarks import common

# (query heads, kv heads, head size, sliding window or 0) of each model serve_bench runs
SHAPES = {
    "smollm2": [(9, 3, 64, 0)],
    "gemma3": [(4, 1, 256, 0), (4, 1, 256, 512)],
    # serve_bench's random-weight model of Llama-3-8B's attention
    "llama3-8b-shape": [(32, 8, 128, 0)],
}
KINDS = ["dense", "paged_prefill", "decode1", "decode8", "decode32", "decode128"]
BLOCK = 16  # vLLM's FlashAttention-2 block size
CACHE_BYTES = 4 << 30  # CUDA_CACHE_MAXSIZE's largest value


def variants(models: list[str]) -> list[tuple[int, int, int, int, str]]:
    """(query heads, kv heads, head size, window, kind) for every variant of ``models``."""
    for m in models:
        if m not in SHAPES:
            raise SystemExit(f"fa2_precompile: unknown model {m!r} (known: {', '.join(SHAPES)})")
    return [(*shape, kind) for m in models for shape in SHAPES[m] for kind in KINDS]


def one_variant(nq: int, nkv: int, d: int, window: int, kind: str) -> None:
    """Launch the calls of one variant (in this process) and wait for them."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("fa2_precompile: needs a CUDA GPU")
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    dev, dt = "cuda", torch.bfloat16
    ws = [window - 1, 0] if window else [-1, -1]

    def starts(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                            device=dev)  # fmt: skip

    def dense(lens_q: list[int], lens_k: list[int]) -> None:
        q = torch.randn(sum(lens_q), nq, d, device=dev, dtype=dt)
        k = torch.randn(sum(lens_k), nkv, d, device=dev, dtype=dt)
        flash_attn_varlen_func(q, k, torch.randn_like(k), max(lens_q), starts(lens_q),
                               max(lens_k), cu_seqlens_k=starts(lens_k), causal=True,
                               window_size=ws, fa_version=2)  # fmt: skip

    def paged(lens_q: list[int], lens_k: list[int]) -> None:
        pages = [-(-n // BLOCK) for n in lens_k]
        cache = torch.randn(sum(pages), BLOCK, nkv, d, device=dev, dtype=dt)
        table = torch.zeros(len(lens_k), max(pages), dtype=torch.int32, device=dev)
        first = 0
        for i, n in enumerate(pages):
            table[i, :n] = torch.arange(first, first + n, device=dev)
            first += n
        q = torch.randn(sum(lens_q), nq, d, device=dev, dtype=dt)
        seqused = torch.tensor(lens_k, dtype=torch.int32, device=dev)
        flash_attn_varlen_func(q, cache, torch.randn_like(cache), max(lens_q), starts(lens_q),
                               max(lens_k), seqused_k=seqused, causal=True, window_size=ws,
                               block_table=table, fa_version=2)  # fmt: skip

    if kind == "dense":
        dense([4096, 2048], [4096, 2048])
        dense([2048, 1024], [8192, 3072])  # continuations over a gathered context
        dense([7, 300], [4000, 300])
    elif kind == "paged_prefill":
        paged([8192], [8192])
        paged([2048, 512], [8192, 2048])
        paged([1, 1, 2048], [8192, 8000, 2048])  # decodes beside a prefill chunk
    elif kind.startswith("decode"):
        seqs = int(kind.removeprefix("decode"))
        for ctx in (8192, 1024, 300):
            paged([1] * seqs, [ctx] * seqs)
    else:
        raise SystemExit(f"fa2_precompile: unknown kind {kind!r}")
    torch.cuda.synchronize()


def _child(v: tuple[int, int, int, int, str]) -> list[str]:
    return common.module_command("benchmarks.fa2_precompile", "--one", *map(str, v))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--jobs", type=int, default=16, help="variants compiled at once")
    p.add_argument("--timeout-s", type=float, default=600, help="per variant")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--one", nargs=5, metavar=("NQ", "NKV", "D", "WINDOW", "KIND"),
                   help=argparse.SUPPRESS)  # fmt: skip
    args = p.parse_args(argv)
    if args.one:
        nq, nkv, d, window, kind = args.one
        one_variant(int(nq), int(nkv), int(d), int(window), kind)
        return 0
    todo = variants([m.strip() for m in args.models.split(",") if m.strip()])
    if args.dry_run:
        for v in todo:
            print(" ".join(_child(v)))
        return 0
    env = common.with_repo_on_path(dict(os.environ))
    # the driver's default cache (256 MiB) would evict what the variants compile
    env.setdefault("CUDA_CACHE_MAXSIZE", str(CACHE_BYTES))
    logdir = Path(os.environ["OUT"]) / "logs" if os.environ.get("OUT") else Path("/tmp")
    logdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def run(v: tuple[int, int, int, int, str]) -> tuple[int, float, str]:
        log = logdir / f"fa2_precompile_{'_'.join(map(str, v))}.log"
        return common.run_child(_child(v), env, args.timeout_s, log)

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for v, (rc, seconds, tail) in zip(todo, pool.map(run, todo), strict=True):
            nq, nkv, d, window, kind = v
            what = f"{nq}/{nkv}/{d}{f' window {window}' if window else ''} {kind}"
            status = "ok" if rc == 0 else f"rc={rc} {common.error_summary(tail)}"
            print(f"fa2_precompile: {what}: {status} ({seconds:.0f} s)", flush=True)
            failed += rc != 0
    print(f"fa2_precompile: {len(todo)} variants in {time.monotonic() - t0:.0f} s, "
          f"{failed} failed", flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
