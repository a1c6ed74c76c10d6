"""``int4``'s cache tokens against BF16's in the same KV memory, its tail pool's share included.

Computed, not measured: from the catalogue's bytes per token and tail-slot bytes
(``kernels/catalogue.py``), for model shapes, KV memory sizes and ``max_num_seqs``. The pool holds
``max_num_seqs`` pages of 64 tokens in BF16 in every layer, whatever the context, and vLLM sizes
the cache from what the model left, pool included: where the KV memory is large beside it (the
H200 of the measured capacity rows) ``int4`` keeps its 3.5x and more; on a 24 GB card serving an
8B model, a few GiB of KV memory, vLLM's default ``max_num_seqs`` (256 below 70 GB of GPU memory)
gives much of it to the pool. A slot holds one BF16 page a layer, or, with a second tail page
(``INT8KV_INT4_TAIL_PAGES=2``) or a sink page (``INT8KV_INT4_SINK_PAGE=1``), two or three: every
count is computed here, named by ``SLOT_PAGES``, whatever this process's environment says.

"KV memory" is what a BF16 engine gets for its cache: ``GPU KV cache size`` (tokens) times
``bytes per token`` in vLLM's start-up log, or ``--kv-cache-memory-bytes``.

    python -m benchmarks.tail_pool_capacity [--out benchmarks/results/tail_pool_capacity.json]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from benchmarks.common import RESULTS_DIR, command_line, write_json
from int8kv_kernels.catalogue import get_dtype
from int8kv_shim.tail_pool_memory import SlidingWindow, capped_max_num_seqs

GIB = 2**30
# name: (layers, kv heads, head size) of each model's attention (their config.json)
MODELS = {
    "Llama-3-8B": (32, 8, 128),
    "Qwen2.5-7B": (28, 4, 128),
    "SmolLM2-135M": (30, 3, 64),
    "Gemma 3 270M": (18, 1, 256),
}
# the longest sequence each serves by default (max_position_embeddings), which the shim's default
# max_num_seqs lets the cache hold as many of as it can
MAX_MODEL_LEN = {
    "Llama-3-8B": 8192,
    "Qwen2.5-7B": 32768,
    "SmolLM2-135M": 8192,
    "Gemma 3 270M": 32768,
}
# layers on a sliding window, which hold only its tokens of a sequence (their config.json)
WINDOWS = {"Gemma 3 270M": SlidingWindow(layers=15, tokens=512)}
KV_GIB = (4, 8, 16, 32, 64)
MAX_NUM_SEQS = (16, 64, 256, 1024)
# BF16 pages a tail slot holds in every layer (int8kv_shim/tail_pool_memory.pages_per_slot)
SLOT_PAGES = {
    1: "tail page",
    2: "tail + sink page, or two tail pages",
    3: "two tail pages + sink page",
}
# vLLM 0.24.0's default max_num_seqs on GPUs under 70 GB, which the shim lowers for int4
VLLM_DEFAULT_SEQS = 256


def bf16_tokens(kv_bytes: int, layers: int, num_kv_heads: int, head_size: int) -> int:
    """Tokens of a BF16 cache (K and V, 2 bytes an element) in ``kv_bytes``."""
    return kv_bytes // (layers * num_kv_heads * 2 * 2 * head_size)


def rows(
    models: dict[str, tuple[int, int, int]] = MODELS,
    kv_gib: Sequence[int] = KV_GIB,
    max_num_seqs: Sequence[int] = MAX_NUM_SEQS,
    slot_pages: Sequence[int] = tuple(SLOT_PAGES),
) -> list[dict[str, Any]]:
    """One row per (model, KV memory, BF16 pages a slot, max_num_seqs): both caches' tokens and
    their ratio."""
    int4 = get_dtype("int4")
    out = []
    for model, (layers, nkv, d) in models.items():
        for gib in kv_gib:
            ref = bf16_tokens(gib * GIB, layers, nkv, d)
            for pages in slot_pages:
                for seqs in max_num_seqs:
                    tokens = int4.tokens_with_tail(
                        gib * GIB, layers, nkv, d, seqs, pages_per_slot=pages
                    )
                    pool = int4.tail_pool_bytes(layers, nkv, d, seqs, pages_per_slot=pages)
                    out.append({
                        "model": model, "layers": layers, "kv_heads": nkv, "head_size": d,
                        "kv_gib": gib, "pages_per_slot": pages, "max_num_seqs": seqs,
                        "tail_pool_gib": round(pool / GIB, 3),
                        "bf16_tokens": ref, "int4_tokens": tokens,
                        "int4_vs_bf16": round(tokens / ref, 2),
                    })  # fmt: skip
    return out


def default_rows(
    models: dict[str, tuple[int, int, int]] = MODELS,
    kv_gib: Sequence[int] = KV_GIB,
    vllm_default: int = VLLM_DEFAULT_SEQS,
    slot_pages: Sequence[int] = tuple(SLOT_PAGES),
) -> list[dict[str, Any]]:
    """What the shim's default max_num_seqs (vLLM's ``vllm_default`` lowered until the pool fits
    its share, but not below the model's :data:`MAX_MODEL_LEN`-token sequences the cache holds,
    ``int8kv_shim/tail_pool_memory.py``) leaves int4 with each count of BF16 pages a slot, where
    its estimate of the KV memory is right."""
    int4 = get_dtype("int4")
    out = []
    for model, (layers, nkv, d) in models.items():
        for pages in slot_pages:
            for gib in kv_gib:
                seqs = capped_max_num_seqs(
                    "int4", vllm_default, gib * GIB, layers, nkv, d, 2, pages=pages,
                    max_model_len=MAX_MODEL_LEN.get(model), window=WINDOWS.get(model),
                )  # fmt: skip
                seqs = vllm_default if seqs is None else seqs
                tokens = int4.tokens_with_tail(
                    gib * GIB, layers, nkv, d, seqs, pages_per_slot=pages
                )
                out.append({
                    "model": model, "kv_gib": gib, "pages_per_slot": pages,
                    "max_model_len": MAX_MODEL_LEN.get(model),
                    "vllm_default": vllm_default, "max_num_seqs": seqs,
                    "int4_vs_bf16": round(tokens / bf16_tokens(gib * GIB, layers, nkv, d), 2),
                })  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS_DIR / "tail_pool_capacity.json"))
    args = p.parse_args(argv)
    doc = {
        "what": "int4 cache tokens against BF16's in the same KV memory, the tail pool "
        "(max_num_seqs slots per layer of 1, 2 or 3 BF16 pages of 64 tokens) taken out of it; "
        "computed from kernels/catalogue.py's byte counts, not measured",
        "gpu": None,
        "command": command_line(),
        "slot_pages": {str(k): v for k, v in SLOT_PAGES.items()},
        "rows": rows(),
        "shim_defaults": default_rows(),
    }
    for path in write_json(doc, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
