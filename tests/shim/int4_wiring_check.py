"""Runs in its own process: our int4 builder + impl driven like vLLM's model runner drives them.

``main()``: recording stand-ins for the write, attention and context-gather kernels, so what is
checked is the wiring: the slot buffers the builder puts in the metadata, the write inside
forward() before any attention (FlashAttention's first chunks included), the tail and the slots
each attention launch and the gather get (sliced like the decode-first split), do_kv_cache_update
doing nothing, a KV-sharing layer reading its target's tail, int8 beside it unchanged. Prints
"wiring ok".

``main("kernels")``: the real int4 kernels (the tail-pool format) through the same glue over two
steps (a history step, then a decode + first chunk + two continuations), against attention over
the unquantized K/V: exact within rounding for the sequences whose keys all sit in the tail (one
of them a page this step completed, which the tail keeps), within 4-bit error for the one with a
page before its last. Prints "kernels ok". ``kernels flash``: the same with the prefills on
FlashAttention's torch stand-in and the continuations' context through the real int4 gather.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from builder_inputs import common_metadata, fake_vllm_config
from vllm.config import set_current_vllm_config
from vllm.forward_context import ForwardContext, override_forward_context

from int8kv_shim import attention_impl, flash_prefill, sink_pages, tail_slots
from int8kv_shim.attention_impl import Int8KVAttentionImpl, Int8KVAttentionMetadataBuilder
from int8kv_shim.backend import Int8KVAttentionBackend
from int8kv_shim.sink_pages import sink_key

NQ, NKV, D, BS, SLOTS = 4, 2, 64, 64, 4


def main() -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    config = _config()

    def write(key, value, kv_cache, slot_mapping, **kw):  # noqa: ANN001, ANN202
        calls.append(("write", {"tokens": key.shape[0], **kw}))

    def attend(query, kv_cache, output, **kw):  # noqa: ANN001, ANN202
        calls.append(("paged", {"tokens": query.shape[0], **kw}))
        output.fill_(1)

    def flash(q, k, v, out, *args):  # noqa: ANN001, ANN202
        calls.append(("flash", {"tokens": q.shape[0], "keys": k.shape[0]}))
        out.fill_(2)

    def gather(kv_cache, new_k, new_v, **kw):  # noqa: ANN001, ANN202
        calls.append(("gather", {"tokens": new_k.shape[0], **kw}))
        shape = (kw["num_k_tokens"], *new_k.shape[1:])
        return new_k.new_zeros(shape), new_v.new_zeros(shape)

    attention_impl.write_kv_cache = write
    attention_impl.paged_attention = attend
    attention_impl.gather_kv_context = gather
    with set_current_vllm_config(config):
        impl = Int8KVAttentionImpl(NQ, D, D**-0.5, NKV, None, None, "int4", None, "decoder", None)
        shared = Int8KVAttentionImpl(NQ, D, D**-0.5, NKV, None, None, "int4", None, "decoder",
                                     "layer.0")  # fmt: skip
    slots = tail_slots.manager()
    assert impl.tail.shape == (SLOTS, 2, NKV, BS, D) and shared.tail is None
    spec = SimpleNamespace(block_size=BS, int8kv_dtype="int4")
    builder = Int8KVAttentionMetadataBuilder(spec, ["layer.0"], config, torch.device("cpu"))
    assert builder.slots is slots and builder.max_context_tokens > 0  # int4 gathers contexts

    # rows: a decode, a first chunk, a continuation (decodes first, as vLLM orders them); the
    # requests of earlier steps keep their slots: c had slot 0, d slot 1, p is new
    slots.assign(["c", "d"])
    slots.assign(["d", "p", "c"])
    assert slots.slot_of_seq.tolist() == [1, 2, 0, -1] and slots.slot_is_new.tolist()[:3] == [
        0,
        1,
        0,
    ]
    q_lens, seq_lens = [1, 9, 5], [70, 9, 100]
    common = common_metadata(q_lens, seq_lens, torch.arange(6, dtype=torch.int32).view(3, 2))
    for mode in ("ours", "flash"):
        calls.clear()
        builder.flash_prefill = mode == "flash"
        builder.min_continuation_tokens = 2
        impl._flash_attention = flash if mode == "flash" else None
        md = builder.build(0, common)
        # views of the persistent buffers (what a FULL CUDA graph replays)
        assert md.slot_of_seq.data_ptr() == slots.slot_of_seq.data_ptr()
        assert md.slot_is_new.data_ptr() == slots.slot_is_new.data_ptr()
        assert md.slot_of_seq.tolist() == [1, 2, 0]
        q = torch.zeros(17, NQ, D, dtype=torch.bfloat16)  # 2 padded rows
        k = torch.zeros(17, NKV, D, dtype=torch.bfloat16)
        out = torch.zeros_like(q)
        impl.do_kv_cache_update(SimpleNamespace(layer_name="layer.0"), k, k, None, md.slot_mapping)
        assert calls == [], "int4 writes in forward(), with the step's metadata"
        impl.forward(None, q, k, k, torch.zeros(8, 1, dtype=torch.int8), md, out)
        kinds = [c[0] for c in calls]
        # the write first, over the whole batch; then the decode launch; then the prefills
        w = calls[0][1]
        assert kinds[0] == "write" and w["kv_dtype"] == "int4" and w["tail"] is impl.tail
        assert w["tail_page"] is impl.tail_page and w["slot_of_seq"] is md.slot_of_seq
        assert w["slot_is_new"] is md.slot_is_new and w["num_seqs"] == 3
        assert w["max_query_len"] == 9 and w["block_size"] == BS
        assert w["block_table"] is md.block_table and w["seq_lens"] is md.seq_lens
        paged = [c[1] for c in calls if c[0] == "paged"]
        assert all(p["tail"] is impl.tail and p["tail_page"] is impl.tail_page for p in paged)
        assert paged[0]["tokens"] == 1 and paged[0]["slot_of_seq"].tolist() == [1]
        if mode == "ours":
            assert kinds == ["write", "paged", "paged"], kinds
            assert paged[1]["tokens"] == 14 and paged[1]["slot_of_seq"].tolist() == [2, 0]
        else:
            # the first chunk (p) and the continuation (c) on FlashAttention, c's 95 tokens of
            # context gathered from the pages, its tail and its sink (p's slot and c's passed)
            assert kinds == ["write", "paged", "gather", "flash"], kinds
            g = calls[2][1]
            assert g["kv_dtype"] == "int4" and g["tail"] is impl.tail
            assert g["tail_page"] is impl.tail_page and g["slot_of_seq"].tolist() == [2, 0]
            assert g["num_k_tokens"] == 9 + 100 and g["cu_seqlens_k"].tolist() == [0, 9, 109]
            assert ("sink" in g) == (impl.sink is not None)
            assert calls[3][1] == {"tokens": 14, "keys": 109}
        # graph capture: the same buffers, every sequence on our kernels
        cap = builder.build_for_cudagraph_capture(common)
        assert cap.slot_of_seq.data_ptr() == slots.slot_of_seq.data_ptr() and cap.split is None

    # a layer reading layer.0's cache writes nothing and reads layer.0's tail
    calls.clear()
    builder.flash_prefill = False
    md = builder.build(0, common)
    context = ForwardContext(
        no_compile_layers={"layer.0": SimpleNamespace(impl=impl)}, attn_metadata={},
        slot_mapping={},
    )  # fmt: skip
    with override_forward_context(context):
        shared.forward(None, q, k, k, torch.zeros(8, 1, dtype=torch.int8), md, out)
    assert [c[0] for c in calls] == ["paged", "paged"]
    assert all(c[1]["tail"] is impl.tail and c[1]["tail_page"] is impl.tail_page for c in calls)

    # int8 beside it: no slots in its metadata, no tail keywords to its kernels
    calls.clear()
    int8 = Int8KVAttentionImpl(NQ, D, D**-0.5, NKV, None, None, "int8", None, "decoder", None)
    int8._flash_attention = None
    spec8 = SimpleNamespace(block_size=16, int8kv_dtype="int8")
    builder8 = Int8KVAttentionMetadataBuilder(spec8, ["layer.1"], config, torch.device("cpu"))
    md8 = builder8.build(0, common)
    assert md8.slot_of_seq is None and md8.slot_is_new is None and builder8.slots is None
    cache8 = torch.zeros(Int8KVAttentionBackend.get_kv_cache_shape(8, 16, NKV, D, "int8"),
                         dtype=torch.int8)  # fmt: skip
    int8.do_kv_cache_update(SimpleNamespace(layer_name="layer.1"), k, k, cache8, md8.slot_mapping)
    int8.forward(None, q, k, k, cache8, md8, out)
    assert [c[0] for c in calls] == ["write", "paged", "paged"]
    assert all("tail" not in c[1] and "slot_of_seq" not in c[1] for c in calls)
    assert "num_seqs" not in calls[0][1]  # int8's write: the slot mapping only
    print("wiring ok")


def _config() -> SimpleNamespace:
    return fake_vllm_config(
        NQ, NKV, D, max_model_len=512,
        scheduler_config=SimpleNamespace(max_num_seqs=SLOTS),
        device_config=SimpleNamespace(device="cpu"),
    )  # fmt: skip


def kernels(flash: bool = False) -> None:
    """``flash``: the prefills of step 2 (s1's first chunk, s2's and s3's continuations) on
    ``flash_prefill.attention_ref`` (FlashAttention's stand-in), the continuations' context
    gathered by the real int4 gather: the same bounds hold (their new tokens exact, their
    context read as our kernels read it)."""
    from int8kv_kernels.reference import attention_ref

    torch.manual_seed(0)
    config = _config()
    with set_current_vllm_config(config):
        impl = Int8KVAttentionImpl(NQ, D, D**-0.5, NKV, None, None, "int4", None, "decoder", None)
    impl._flash_attention = flash_prefill.attention_ref if flash else None
    slots = tail_slots.manager()
    spec = SimpleNamespace(block_size=BS, int8kv_dtype="int4")
    builder = Int8KVAttentionMetadataBuilder(spec, ["layer.0"], config, torch.device("cpu"))
    builder.flash_prefill = flash
    builder.min_continuation_tokens = 2
    # s0: 39 cached + 1 decode (all in the tail); s1: a 9-token first chunk (tail); s2: 65 cached
    # + 5 new (page 0 full and quantized, 6 tokens in the tail); s3: 50 cached + 14 new, completing
    # page 0 (quantized, and still read from the tail)
    q_lens, seq_lens = [1, 9, 5, 14], [40, 9, 70, 64]
    num_blocks = 8
    block_table = torch.tensor([[1, 0], [2, 0], [3, 4], [5, 0]], dtype=torch.int32)
    kv_cache = torch.zeros(Int8KVAttentionBackend.get_kv_cache_shape(num_blocks, BS, NKV, D, "int4"),
                           dtype=torch.int8)  # fmt: skip
    k = [torch.randn(n, NKV, D, dtype=torch.bfloat16) for n in seq_lens]
    v = [torch.randn(n, NKV, D, dtype=torch.bfloat16) for n in seq_lens]
    # With INT8KV_INT4_SINK_PAGE=1 the layer keeps sink pages: s2 and s3 have prompts of a page or
    # more (s0's 40 and s1's 9 tokens are shorter: no sink); fed as the runner hooks feed them.
    sinks = sink_pages.manager()
    prompts = [list(range(1000 * s, 1000 * s + n)) for s, n in enumerate(seq_lens)]
    # step 1: the history of s0 and s2 (new slots), through the impl like any step
    slots.assign(["s0", "s2", "s3"])
    if sinks is not None:
        for s in (0, 2, 3):
            sinks.add(f"s{s}", sink_key(prompts[s]), 0)
            sinks.computed(f"s{s}", 0, seq_lens[s] - q_lens[s])
        sinks.assign(["s0", "s2", "s3"])
    old = [0, 2, 3]
    hist = [seq_lens[s] - q_lens[s] for s in old]
    md = builder.build(0, common_metadata(hist, hist, block_table[old].contiguous()))
    hk = torch.cat([k[s][:n] for s, n in zip(old, hist, strict=True)])
    hv = torch.cat([v[s][:n] for s, n in zip(old, hist, strict=True)])
    scratch = torch.zeros(hk.shape[0], NQ, D, dtype=torch.bfloat16)
    impl.forward(None, scratch.clone(), hk, hv, kv_cache, md, scratch)
    # step 2: s0 and s2 continue on their slots, s1 is new; decodes first
    slots.assign(["s0", "s1", "s2", "s3"])
    if sinks is not None:
        sinks.add("s1", sink_key(prompts[1]), 0)
        for s in range(4):
            sinks.computed(f"s{s}", seq_lens[s] - q_lens[s], q_lens[s])
        sinks.assign(["s0", "s1", "s2", "s3"])
        # s2 reads the sink its first step wrote; s3 writes and reads its own, page 0 completing
        assert sinks.sink_of_seq.tolist()[:4] == [-1, -1, 0, 1], sinks.sink_of_seq.tolist()
        assert sinks.sink_store_of_seq.tolist()[:4] == [-1, -1, -1, 1]
    common = common_metadata(q_lens, seq_lens, block_table)
    md = builder.build(0, common)
    if flash:
        assert md.split is not None and md.split.flash.context_tokens == 65 + 50, md.split
    new_k = torch.cat([k[s][-q_lens[s] :] for s in range(4)])
    new_v = torch.cat([v[s][-q_lens[s] :] for s in range(4)])
    query = torch.randn(new_k.shape[0], NQ, D, dtype=torch.bfloat16)
    output = torch.full_like(query, float("nan"))
    impl.forward(None, query, new_k, new_v, kv_cache, md, output)

    exact_k = torch.zeros(num_blocks, BS, NKV, D)
    exact_v = torch.zeros_like(exact_k)
    for s, n in enumerate(seq_lens):
        pos = torch.arange(n)
        rows = block_table[s, pos // BS].long() * BS + pos % BS
        exact_k.view(-1, NKV, D)[rows], exact_v.view(-1, NKV, D)[rows] = k[s].float(), v[s].float()
    ref = attention_ref(query, exact_k, exact_v, query_start_loc=common.query_start_loc,
                        seq_lens=common.seq_lens, block_table=block_table,
                        softmax_scale=D**-0.5)  # fmt: skip
    diff = (output.float() - ref).abs()
    # s0, s1 and s3: every key in the tail, in the model's dtype
    tail_only = torch.cat([diff[:10], diff[15:]])
    tail_ref = torch.cat([ref[:10], ref[15:]])
    assert (tail_only <= 4e-3 + 2.0**-7 * tail_ref.abs()).all(), tail_only.max()
    held = impl.tail_page.view(SLOTS, -1)  # [slots, tail pages]
    assert int(held[slots.slot_of("s3"), 0]) == 5  # s3's page 0, quantized and kept
    if held.shape[1] == 2:
        # INT8KV_INT4_TAIL_PAGES=2: s2's page 0 (block 3), which its first step completed, stays
        # in half 0 beside page 1 (block 4) in half 1, and is read from there: every sequence
        # within rounding (its sink, with sink pages on, written but not read)
        assert held[slots.slot_of("s2")].tolist() == [3, 4], held.tolist()
        assert held[slots.slot_of("s3")].tolist() == [5, -1], held.tolist()
        assert tuple(impl.tail.shape) == (SLOTS, 2, NKV, 2 * BS, D)
        assert (diff <= 4e-3 + 2.0**-7 * ref.abs()).all(), diff.max()
        if sinks is not None:
            assert torch.equal(impl.sink[0, 0].transpose(0, 1), k[2][:BS])
            assert tuple(impl.sink.shape) == (SLOTS, 2, NKV, BS, D)
            _check_a_step_without_sink_stores(builder, sinks, seq_lens)
        print(f"kernels with two tail pages ok (sink pages {sinks is not None})")
        return
    if sinks is not None:
        # s2's page 0 from its sink, exact: every sequence within rounding
        assert torch.equal(impl.sink[0, 0].transpose(0, 1), k[2][:BS])
        assert torch.equal(impl.sink[0, 1].transpose(0, 1), v[2][:BS])
        assert (diff <= 4e-3 + 2.0**-7 * ref.abs()).all(), diff.max()
        _check_a_step_without_sink_stores(builder, sinks, seq_lens)
        print(f"kernels with sink pages ok (max abs error {diff.max().item():.2e})")
        return
    assert diff[10:15].max() < 0.15, diff[10:15].max()  # s2 reads one 4-bit page
    assert diff[10:15].max() > 1e-4, "page 0 of s2 was read unquantized?"
    print(f"kernels ok (max abs error {diff.max().item():.2e})")


def _check_a_step_without_sink_stores(
    builder: Int8KVAttentionMetadataBuilder, sinks: sink_pages.SinkPages, seq_lens: list[int]
) -> None:
    """The next step, one token each: s2 and s3 read their sinks and none writes one, so the
    step's metadata says no row stores (an eager forward then launches no sink store), while a
    capture's says one may (the graph replays for later batches, whose rows may write theirs)."""
    for s, n in enumerate(seq_lens):
        sinks.computed(f"s{s}", n, 1)
    sinks.assign(["s0", "s1", "s2", "s3"])
    assert not sinks.stores and sinks.sink_of_seq.tolist()[:4] == [-1, -1, 0, 1]
    common = common_metadata(
        [1] * 4, [n + 1 for n in seq_lens], torch.zeros(4, 2, dtype=torch.int32)
    )
    md = builder.build(0, common)
    assert not md.sink_stores and md.sink_of_seq.tolist() == [-1, -1, 0, 1]
    assert md.sink_store_of_seq.data_ptr() == sinks.sink_store_of_seq.data_ptr()
    assert builder.build_for_cudagraph_capture(common).sink_stores
    # a new request in s0's row, its first page to come: the eager metadata asks for the launch
    sinks.add("s4", sink_key(list(range(4000, 4100))), 0)
    sinks.computed("s4", 0, 1)
    sinks.assign(["s4", "s1", "s2", "s3"])
    assert sinks.stores
    common = common_metadata([1] * 4, [1, *(n + 1 for n in seq_lens[1:])],
                             torch.zeros(4, 2, dtype=torch.int32))  # fmt: skip
    md = builder.build(0, common)
    assert md.sink_stores and md.sink_store_of_seq.tolist() == [2, -1, -1, -1]


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["kernels"]:
        kernels(flash=sys.argv[2:] == ["flash"])
    else:
        main()
