"""Runs our backend's metadata builder + impl the way vLLM's model runner does, on CPU tensors.

Run as a script in its own process (the test sets TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES=""):
the kernels execute in Triton's interpreter, vLLM's classes are the real ones, and the result is
compared with the torch reference over the dequantized cache. Prints "glue ok" on success.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from int8kv_kernels.reference import attention_ref, dequantize_cache
from int8kv_shim.attention_impl import Int8KVAttentionImpl, Int8KVAttentionMetadataBuilder
from int8kv_shim.backend import Int8KVAttentionBackend


def main() -> None:
    torch.manual_seed(0)
    nq, nkv, d, bs = 8, 2, 64, 16
    q_lens, seq_lens = [1, 9, 5], [40, 9, 70]  # a decode, a prefill, a chunked-prefill continuation
    blocks_per_seq = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks - 1).tolist()  # block 0 of the pool stays unused
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for s, n in enumerate(blocks_per_seq):
        block_table[s, :n] = torch.tensor([1 + perm.pop() for _ in range(n)])

    shape = Int8KVAttentionBackend.get_kv_cache_shape(num_blocks, bs, nkv, d, "int8")
    kv_cache = torch.randint(-128, 128, shape, dtype=torch.int8)

    impl = Int8KVAttentionImpl(nq, d, d**-0.5, nkv, None, None, "int8", None, "decoder", None)
    # Every token's K/V goes through the impl's cache update (what vLLM calls before attention).
    for s, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len)
        slots = block_table[s, pos // bs].long() * bs + pos % bs
        k = torch.randn(seq_len, nkv, d, dtype=torch.bfloat16)
        v = torch.randn(seq_len, nkv, d, dtype=torch.bfloat16)
        impl.do_kv_cache_update(None, k, v, kv_cache, slots)

    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    num_tokens = int(qsl[-1])
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(seq_lens),
        num_actual_tokens=num_tokens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
    )
    model_config = SimpleNamespace(
        get_num_kv_heads=lambda parallel: nkv,
        get_num_attention_heads=lambda parallel: nq,
        get_head_size=lambda: d,
        max_model_len=256,
    )
    vllm_config = SimpleNamespace(model_config=model_config, parallel_config=None)
    spec = SimpleNamespace(block_size=bs)
    builder = Int8KVAttentionMetadataBuilder(spec, ["layer"], vllm_config, torch.device("cpu"))
    metadata = builder.build(0, common)

    query = torch.randn(num_tokens + 2, nq, d, dtype=torch.bfloat16)  # 2 padded rows, as vLLM pads
    output = torch.full_like(query, float("nan"))
    impl.forward(None, query, None, None, kv_cache, metadata, output)

    k_slots, v_slots = dequantize_cache(kv_cache, kv_dtype="int8", block_size=bs,
                                        num_kv_heads=nkv, head_size=d)  # fmt: skip
    ref = attention_ref(query[:num_tokens], k_slots, v_slots, query_start_loc=qsl,
                        seq_lens=common.seq_lens, block_table=block_table,
                        softmax_scale=d**-0.5)  # fmt: skip
    # bf16 output: one rounding, which the interpreter does by truncation (2^-7 relative).
    diff = (output[:num_tokens].float() - ref).abs()
    assert (diff <= 4e-3 + 2.0**-7 * ref.abs()).all(), f"max abs error {diff.max().item()}"
    err = diff.max().item()
    assert torch.isnan(output[num_tokens:]).all(), "padded rows must stay untouched"
    # The profiling run: no metadata, output zeroed, nothing else touched.
    impl.forward(None, query, None, None, kv_cache, None, output)
    assert not output.any()
    print(f"glue ok (max abs error {err:.2e})")


if __name__ == "__main__":
    main()
