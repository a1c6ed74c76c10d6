"""Subprocess side of test_kernel_warmup.py: which compiled variants serving batches need, and
which the start-up warm-up compiles, as Triton's own binder decides them for an sm80 target.

Run without TRITON_INTERPRET (the kernels must be real JITFunctions) and without a GPU: every
DirectLauncher launch is replaced by Triton's binder on the launch's arguments, whose
specialization (argument types, 16-byte alignment and value classes, constexprs) plus options
is what Triton compiles one binary per. Prints one JSON line:
``{"warmup": [...], "serving": {"name of the batch": [...]}}`` (keys as strings).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import create_function_from_signature

from int8kv_kernels import (
    choose_num_splits,
    gather_kv_context,
    make_workspace,
    paged_attention,
    write_kv_cache,
    write_sink_int4,
)
from int8kv_kernels.cache_write_int4 import tail_pool_shapes
from int8kv_kernels.catalogue import INT4_DTYPES, STATIC_DTYPE
from int8kv_kernels.launch import DirectLauncher
from int8kv_kernels.page_layout import get_page_bytes
from int8kv_shim import kernel_warmup
from int8kv_shim.sink_pages import SinkPages
from int8kv_shim.tail_slots import TailSlots

_BACKEND = CUDABackend(GPUTarget("cuda", 80, 32))
_binders: dict[int, object] = {}
_seen: set[str] = set()


def _bind(self: DirectLauncher, args: tuple, kwargs: dict) -> None:
    fn = self.fn
    binder = _binders.get(id(fn))
    if binder is None:
        binder = _binders[id(fn)] = create_function_from_signature(
            fn.signature, fn.params, _BACKEND
        )
    _, specialization, options = binder(*args, **kwargs)
    _seen.add(repr((fn.__name__, tuple(specialization), tuple(sorted(options.items())))))


def _call(self: DirectLauncher, grid, *args, **kwargs) -> None:
    _bind(self, args, kwargs)


def _record(self: DirectLauncher, swap, grid, *args, **kwargs) -> None:
    _bind(self, args, kwargs)


DirectLauncher.__call__ = _call  # type: ignore[method-assign]
DirectLauncher.record = _record  # type: ignore[method-assign]


def _take() -> list[str]:
    out = sorted(_seen)
    _seen.clear()
    return out


def serving_batches(shape: dict) -> dict[str, list[str]]:
    """Launches as the impl makes them for decode, mixed and continuation batches: the sequences
    after the decodes are slices of the batch's metadata, starting at any row, and take the
    decodes' split count (short continuations run on the decode configuration, split)."""
    h, hk, d, b = shape["heads"], shape["kv_heads"], shape["head_size"], shape["block_size"]
    dtype = shape["kv_dtype"]
    kw = dict(
        kv_dtype=dtype, block_size=b, num_kv_heads=hk, softmax_scale=0.125,
        sliding_window=shape["window"], soft_cap=None, **scales(shape),
    )  # fmt: skip
    max_blocks = 8192 // b
    num_blocks = 4096
    kv_cache = torch.zeros(num_blocks, get_page_bytes(dtype, b, hk, d), dtype=torch.int8)
    workspace = make_workspace(256, h, d)
    tail = Int4Tail(shape) if dtype in INT4_DTYPES else None
    out: dict[str, list[str]] = {}
    for num_seqs in (1, 3, 16, 33, 200):
        lens = torch.randint(100, 8000, (num_seqs,), dtype=torch.int32)
        table = torch.randint(1, num_blocks, (num_seqs, max_blocks), dtype=torch.int32)
        q = torch.zeros(num_seqs, h, d, dtype=torch.bfloat16)
        qsl = torch.arange(num_seqs + 1, dtype=torch.int32)
        splits = choose_num_splits(num_seqs, hk, 8192, 132, sliding_window=shape["window"])
        if tail is not None:  # K/V: a view with the query's row stride, as vLLM's of its qkv
            tail.write(q[:, :hk], kv_cache, qsl, lens, table, num_seqs, 1)
        paged_attention(q, kv_cache, torch.empty_like(q), query_start_loc=qsl, seq_lens=lens,
                        block_table=table, max_query_len=1, max_seq_len=8192,
                        workspace=workspace, num_splits=splits,
                        **tail_kw(tail, 0, num_seqs), **kw)  # fmt: skip
        out[f"decode of {num_seqs}"] = _take()
    for nd, q_lens in ((0, [64, 200]), (1, [3]), (2, [40, 7]), (3, [700]), (5, [2, 4]),
                       (6, [1000, 9, 63])):  # fmt: skip
        n = nd + len(q_lens)
        lens = torch.randint(2000, 8000, (n,), dtype=torch.int32)
        table = torch.randint(1, num_blocks, (n, max_blocks), dtype=torch.int32)
        qsl = torch.tensor([0, *torch.tensor([1] * nd + q_lens).cumsum(0).tolist()],
                           dtype=torch.int32)  # fmt: skip
        q = torch.zeros(int(qsl[-1]), h, d, dtype=torch.bfloat16)
        o = torch.empty_like(q)
        # the builder's: the decodes' count in a mixed batch, every sequence's otherwise
        splits = choose_num_splits(nd or n, hk, 8192, 132, sliding_window=shape["window"])
        if tail is not None:
            tail.write(q[:, :hk], kv_cache, qsl, lens, table, n, max(q_lens))
        if nd:
            paged_attention(q[:nd], kv_cache, o[:nd], query_start_loc=qsl[: nd + 1],
                            seq_lens=lens[:nd], block_table=table[:nd], max_query_len=1,
                            max_seq_len=8000, workspace=workspace, num_splits=splits,
                            **tail_kw(tail, 0, nd), **kw)  # fmt: skip
        paged_attention(q[nd:], kv_cache, o[nd:], query_start_loc=qsl[nd:] - nd,
                        seq_lens=lens[nd:], block_table=table[nd:], max_query_len=max(q_lens),
                        max_seq_len=8000, workspace=workspace, num_splits=splits,
                        **tail_kw(tail, nd, n), **kw)  # fmt: skip
        if shape["gather"]:
            ctx = (lens[nd:] - torch.tensor(q_lens, dtype=torch.int32)).clamp(min=0)
            cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
            cu_k = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
            cu_k[1:] = (ctx + torch.tensor(q_lens, dtype=torch.int32)).cumsum(0)
            new = torch.zeros(int(cu_q[-1]), hk, d, dtype=torch.bfloat16)
            gather_kv_context(kv_cache, new, new, kv_dtype=dtype, block_size=b,
                              block_table=table[nd:], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                              max_seqlen_k=int((cu_k[1:] - cu_k[:-1]).max()),
                              num_k_tokens=int(cu_k[-1]), **scales(shape),
                              **tail_kw(tail, nd, n))  # fmt: skip
        name = f"{nd} decodes, then queries of {q_lens}"
        out[f"mixed: {name}" if nd else f"continuations: {name}"] = _take()
    if tail is None:  # int4 writes with the step's metadata, above
        for n in (1, 7, 256, 513, 8192):
            kv = torch.zeros(n, hk, d, dtype=torch.bfloat16)
            slots = torch.randint(0, num_blocks * b, (n,), dtype=torch.int64)
            write_kv_cache(kv, kv, kv_cache, slots, kv_dtype=dtype, block_size=b,
                           **scales(shape))  # fmt: skip
            out[f"write of {n} tokens"] = _take()
    return out


class Int4Tail:
    """An engine's tail pool and slot buffers as the impl and tail_slots.py make them: a pool of
    max_num_seqs slots (250 here: slot_is_new, the second row of one (2, slots) buffer, then
    starts off a 16-byte boundary) and [rows] views of its persistent slot buffers; with
    ``shape["sink"]`` (INT8KV_INT4_SINK_PAGE) the sink pool and sink_pages.py's row buffers too."""

    def __init__(self, shape: dict, num_slots: int = 250) -> None:
        hk, d, b = shape["kv_heads"], shape["head_size"], shape["block_size"]
        pages = shape.get("tail_pages", 1)  # INT8KV_INT4_TAIL_PAGES, set for the warm-up too
        self.slots = TailSlots(num_slots, "cpu")
        tail, held = tail_pool_shapes(num_slots, hk, d, pages, b)
        self.tail = torch.zeros(tail, dtype=torch.bfloat16)
        self.tail_page = torch.full(held, -1, dtype=torch.int32)
        self.dtype, self.block_size = shape["kv_dtype"], b
        self.sinks = SinkPages(num_slots, num_slots, "cpu") if shape.get("sink") else None
        self.sink = (
            torch.zeros(num_slots, 2, hk, b, d, dtype=torch.bfloat16) if self.sinks else None
        )

    def write(self, kv, kv_cache, qsl, lens, table, num_seqs: int, max_query_len: int) -> None:
        write_kv_cache(kv, kv, kv_cache, torch.zeros(kv.shape[0], dtype=torch.int64),
                       kv_dtype=self.dtype, block_size=self.block_size, tail=self.tail,
                       tail_page=self.tail_page, query_start_loc=qsl, seq_lens=lens,
                       block_table=table, slot_of_seq=self.slots.slot_of_seq[:num_seqs],
                       slot_is_new=self.slots.slot_is_new[:num_seqs], num_seqs=num_seqs,
                       max_query_len=max_query_len)  # fmt: skip
        if self.sinks is not None:
            write_sink_int4(kv, kv, self.sink, self.sinks.sink_store_of_seq[:num_seqs],
                            query_start_loc=qsl, seq_lens=lens, num_seqs=num_seqs)  # fmt: skip


def tail_kw(tail: Int4Tail | None, start: int, end: int) -> dict:
    if tail is None:
        return {}
    kw = {"tail": tail.tail, "slot_of_seq": tail.slots.slot_of_seq[start:end],
          "tail_page": tail.tail_page}  # fmt: skip
    if tail.sinks is not None:
        kw |= {"sink": tail.sink, "sink_of_seq": tail.sinks.sink_of_seq[start:end]}
    return kw


def scales(shape: dict) -> dict:
    if shape["kv_dtype"] != STATIC_DTYPE:
        return {}
    ones = torch.ones(shape["kv_heads"], shape["head_size"], dtype=torch.float32)
    return {"k_scale": ones, "v_scale": ones, "v_format": shape["v_format"]}


def warm_up(shape: dict) -> list[str]:
    impl = SimpleNamespace(
        kv_cache_dtype=shape["kv_dtype"], num_heads=shape["heads"], num_kv_heads=shape["kv_heads"],
        head_size=shape["head_size"], sliding_window=shape["window"], logits_soft_cap=None,
        v_format=shape["v_format"], flash_prefill=shape["gather"], scale=0.125, k_scale=None,
        v_scale=None,
    )  # fmt: skip
    kernel_warmup.warm_up_layer(
        impl, block_size=shape["block_size"], model_dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )  # fmt: skip
    return _take()


def main() -> None:
    shape = json.loads(sys.argv[1])
    torch.manual_seed(0)
    warm = warm_up(shape)
    print(json.dumps({"warmup": warm, "serving": serving_batches(shape)}))


if __name__ == "__main__":
    main()
