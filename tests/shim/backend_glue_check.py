"""Runs our backend's metadata builder + impl the way vLLM's model runner does, on CPU tensors
(``int8`` / ``int8_static``; ``int4``, with its tail pool, in int4_wiring_check.py).

Run as a script in its own process (the test sets TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES=""):
the kernels execute in Triton's interpreter, vLLM's classes are the real ones, and the result is
compared with the torch reference over the dequantized cache. Prints "glue ok" on success.
"""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import torch
from builder_inputs import common_metadata, fake_vllm_config

from int8kv_kernels.reference import attention_ref, dequantize_cache
from int8kv_shim import attention_impl, flash_prefill
from int8kv_shim.attention_impl import Int8KVAttentionImpl, Int8KVAttentionMetadataBuilder
from int8kv_shim.backend import Int8KVAttentionBackend


def main(kv_dtype: str = "int8", mode: str = "") -> None:
    """``mode="flash"``: the FlashAttention split on, with ``flash_prefill.attention_ref`` standing
    in for FlashAttention-2 (no GPU here), continuations of any length allowed: the prefill without
    context must then match attention over its unquantized K/V, the continuation attention over its
    dequantized context plus its unquantized new K/V (the gather kernel ran), the decode attention
    over the dequantized cache."""
    torch.manual_seed(0)
    nq, nkv, d, bs = 8, 2, 64, 16
    q_lens, seq_lens = [1, 9, 5], [40, 9, 70]  # a decode, a prefill, a chunked-prefill continuation
    blocks_per_seq = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks - 1).tolist()  # block 0 of the pool stays unused
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for s, n in enumerate(blocks_per_seq):
        block_table[s, :n] = torch.tensor([1 + perm.pop() for _ in range(n)])

    shape = Int8KVAttentionBackend.get_kv_cache_shape(num_blocks, bs, nkv, d, kv_dtype)
    kv_cache = torch.randint(-128, 128, shape, dtype=torch.int8)

    impl = Int8KVAttentionImpl(nq, d, d**-0.5, nkv, None, None, kv_dtype, None, "decoder", None)
    static = {}
    if kv_dtype == "int8_static":  # N(0, 1) K/V: absmax about 4; V as E4M3 codes
        static = {"k_scale": torch.full((nkv, d), 4 / 127), "v_scale": torch.full((nkv, d), 4 / 448),
                  "v_format": "e4m3"}  # fmt: skip
        impl.set_static_scales(**static)
    # Every token's K/V goes through the impl's cache update (what vLLM calls before attention);
    # the unquantized values also go into plain slots, and the new tokens' into the batch's K/V.
    exact_k = torch.zeros(num_blocks, bs, nkv, d)
    exact_v = torch.zeros_like(exact_k)
    new_k, new_v = [], []
    for s, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len)
        slots = block_table[s, pos // bs].long() * bs + pos % bs
        k = torch.randn(seq_len, nkv, d, dtype=torch.bfloat16)
        v = torch.randn(seq_len, nkv, d, dtype=torch.bfloat16)
        impl.do_kv_cache_update(None, k, v, kv_cache, slots)
        exact_k.view(-1, nkv, d)[slots], exact_v.view(-1, nkv, d)[slots] = k.float(), v.float()
        new_k.append(k[-q_lens[s] :])
        new_v.append(v[-q_lens[s] :])

    common = common_metadata(q_lens, seq_lens, block_table)
    qsl, num_tokens = common.query_start_loc, common.num_actual_tokens
    if mode.startswith("v2"):
        # vLLM's model runner V2 (the default for Llama-family models) passes no computed-token
        # counts, only CPU sequence lengths (computed + scheduled)
        common = dataclasses.replace(
            common,
            _num_computed_tokens_cpu=None,
            seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
        )
    vllm_config = fake_vllm_config(nq, nkv, d, max_model_len=256)
    spec = SimpleNamespace(block_size=bs, int8kv_dtype=kv_dtype)
    builder = Int8KVAttentionMetadataBuilder(spec, ["layer"], vllm_config, torch.device("cpu"))
    # "v2_spec": the same under speculative decoding, where V2's lengths are upper bounds: only
    # the fresh prefill may go to FlashAttention, the continuation stays on our kernels
    builder.speculative = mode == "v2_spec"
    flash = mode in ("flash", "v2", "v2_spec")
    if mode in ("flash", "v2", "v2_spec", "broken"):
        builder.flash_prefill = True
        builder.min_continuation_tokens = 2  # tiny shapes: let the 5-token continuation in
        impl._flash_attention = flash_prefill.attention_ref if flash else _broken_flash_attention
    metadata = builder.build(0, common)
    assert (metadata.split is not None) == bool(mode)
    if mode == "v2_spec":  # sequence 1 (no context) on FlashAttention, sequence 2 on our kernels
        assert metadata.split.flash.token_index.tolist() == list(range(1, 10))
        assert metadata.split.flash.context_tokens == 0
        assert metadata.split.rest.token_index.tolist() == list(range(10, 15))
    elif (
        flash
    ):  # sequences 1 (9 new tokens, no context) and 2 (65 cached + 5 new) on FlashAttention
        assert metadata.split.flash.token_index.tolist() == list(range(1, 15))
        assert metadata.split.flash.key_start_loc.tolist() == [0, 9, 79]
        assert metadata.split.flash.context_tokens == 65
        # the decode (sequence 0) runs as its own launch: nothing else is left for our kernels
        assert metadata.split.rest is None
    assert (metadata.num_decodes, metadata.num_decode_tokens) == (1, 1)
    assert metadata.prefill_rows.query_start_loc.tolist() == [0, 9, 14]

    query = torch.randn(num_tokens + 2, nq, d, dtype=torch.bfloat16)  # 2 padded rows, as vLLM pads
    pad = torch.zeros(2, nkv, d, dtype=torch.bfloat16)
    key, value = torch.cat([*new_k, pad]), torch.cat([*new_v, pad])
    output = torch.full_like(query, float("nan"))
    launches = []  # (query tokens, max_query_len) of each launch of our kernels

    def recording(q: torch.Tensor, *args: object, **kwargs: object) -> None:
        launches.append((q.shape[0], kwargs["max_query_len"]))
        paged_attention(q, *args, **kwargs)

    paged_attention = attention_impl.paged_attention
    attention_impl.paged_attention = recording
    impl.forward(None, query, key, value, kv_cache, metadata, output)
    attention_impl.paged_attention = paged_attention
    # The decode (first, as vLLM's model runner orders batches for us) is a launch of its own on
    # the decode configuration; the longer queries follow unless FlashAttention took them all.
    assert launches[0] == (1, 1), launches
    rest = {"v2_spec": [(5, 5)]}.get(mode, [] if flash else [(14, 9)])
    assert launches[1:] == rest, launches
    # a FlashAttention that raises: logged, this process falls back to our kernels for every row
    assert flash_prefill.enabled() == (mode != "broken")

    k_slots, v_slots = dequantize_cache(kv_cache, kv_dtype=kv_dtype, block_size=bs,
                                        num_kv_heads=nkv, head_size=d, **static)  # fmt: skip
    ref = attention_ref(query[:num_tokens], k_slots, v_slots, query_start_loc=qsl,
                        seq_lens=common.seq_lens, block_table=block_table,
                        softmax_scale=d**-0.5)  # fmt: skip
    if flash:
        # FlashAttention's keys: the cache's dequantized values for context tokens, the exact
        # (unquantized) values for the new tokens of sequences 1 and 2.
        mixed_k, mixed_v = k_slots.contiguous().clone(), v_slots.contiguous().clone()
        for s, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
            if s in (1, 2):
                pos = torch.arange(seq_len - q_len, seq_len)
                slots = block_table[s, pos // bs].long() * bs + pos % bs
                mixed_k.view(-1, nkv, d)[slots] = exact_k.view(-1, nkv, d)[slots]
                mixed_v.view(-1, nkv, d)[slots] = exact_v.view(-1, nkv, d)[slots]
        mixed = attention_ref(query[:num_tokens], mixed_k, mixed_v, query_start_loc=qsl,
                              seq_lens=common.seq_lens, block_table=block_table,
                              softmax_scale=d**-0.5)  # fmt: skip
        # the flash rows attended over unquantized new K/V: closer to `mixed` than to `ref`
        flash_rows = (slice(1, 10),) if mode == "v2_spec" else (slice(1, 10), slice(10, 15))
        for rows in flash_rows:
            assert (output[rows].float() - mixed[rows]).abs().max() < 4e-3 + 2.0**-7
            assert (output[rows].float() - ref[rows]).abs().max() > 1e-3, "quantized new K/V?"
            ref[rows] = mixed[rows]
    # bf16 output: one rounding, which the interpreter does by truncation (2^-7 relative).
    diff = (output[:num_tokens].float() - ref).abs()
    assert (diff <= 4e-3 + 2.0**-7 * ref.abs()).all(), f"max abs error {diff.max().item()}"
    err = diff.max().item()
    assert torch.isnan(output[num_tokens:]).all(), "padded rows must stay untouched"
    # CUDA-graph capture: one launch of our kernels for every sequence, whatever the batch holds
    capture = builder.build_for_cudagraph_capture(
        dataclasses.replace(common, seq_lens=common.seq_lens.clone())  # it fills seq_lens with 1
    )
    assert capture.split is None and capture.prefill_rows is None and capture.decode_rows is None
    assert capture.num_decodes == 0
    assert capture.num_splits == builder._decode_splits(len(seq_lens))
    # The profiling run: no metadata, output zeroed, nothing else touched.
    impl.forward(None, query, None, None, kv_cache, None, output)
    assert not output.any()
    print(f"glue ok ({kv_dtype}{' ' + mode if mode else ''}, max abs error {err:.2e})")


def _broken_flash_attention(*args: object) -> None:
    raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")


if __name__ == "__main__":
    main(*sys.argv[1:])
