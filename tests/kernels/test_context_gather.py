"""gather_kv_context (dequantize-gather of chunked-prefill contexts) against its torch reference,
bit for bit: dequantization is deterministic (one fp32 product, one rounding to the output dtype)."""

from __future__ import annotations

import pytest
import torch
from kvbatch import assert_layers_replay, make_cache, same_bits

from int8kv_kernels import gather_kv_context
from int8kv_kernels.reference import gather_kv_context_ref

# (kv_dtype, v_format, nkv, head_size, block_size, out dtype)
CASES = [
    ("int8", "int8", 2, 64, 16, torch.bfloat16),
    ("int8", "int8", 1, 128, 32, torch.float16),
    ("int8", "int8", 2, 256, 16, torch.bfloat16),  # four scale groups per vector
    ("int8_static", "int8", 2, 128, 16, torch.bfloat16),
    ("int8_static", "e4m3", 3, 64, 32, torch.float16),
    ("int8_static", "e4m3", 2, 64, 16, torch.bfloat16),
]
# Contexts of different lengths incl. 0 (a fresh prefill in the same batch), one ending exactly on
# a page boundary, one longer than the kernel's row block; new-token counts incl. 1.
CONTEXTS = [37, 0, 64, 5, 70]
Q_LENS = [3, 4, 1, 6, 2]


def _batch(block_size: int, nkv: int, d: int, dtype: torch.dtype, device: str):
    blocks = [-(-c // block_size) for c in CONTEXTS]
    num_blocks = sum(blocks) + 2
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()  # block 0 unused; scattered order
    table = torch.zeros(len(CONTEXTS), max(blocks) + 1, dtype=torch.int32)
    for s, n in enumerate(blocks):
        table[s, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    cu_q = torch.tensor([0, *torch.tensor(Q_LENS).cumsum(0).tolist()], dtype=torch.int32)
    k_lens = torch.tensor(Q_LENS) + torch.tensor(CONTEXTS)
    cu_k = torch.tensor([0, *k_lens.cumsum(0).tolist()], dtype=torch.int32)
    n_new = int(cu_q[-1])
    new_k = torch.randn(n_new, nkv, d, dtype=dtype, device=device)
    new_v = torch.randn(n_new, nkv, d, dtype=dtype, device=device)
    return num_blocks, table.to(device), cu_q.to(device), cu_k.to(device), new_k, new_v


@pytest.mark.parametrize(("kv_dtype", "v_format", "nkv", "d", "bs", "dtype"), CASES)
def test_gather_matches_reference_bit_for_bit(kv_dtype, v_format, nkv, d, bs, dtype, device):
    torch.manual_seed(0)
    num_blocks, table, cu_q, cu_k, new_k, new_v = _batch(bs, nkv, d, dtype, device)
    cache, k_scale, v_scale = make_cache(kv_dtype, bs, nkv, d, num_blocks, device, v_format)
    kw = dict(kv_dtype=kv_dtype, block_size=bs, block_table=table, cu_seqlens_q=cu_q,
              cu_seqlens_k=cu_k, k_scale=k_scale, v_scale=v_scale, v_format=v_format)  # fmt: skip
    k, v = gather_kv_context(cache, new_k, new_v, max_seqlen_k=int((cu_k[1:] - cu_k[:-1]).max()),
                             num_k_tokens=int(cu_k[-1]), **kw)  # fmt: skip
    k_ref, v_ref = gather_kv_context_ref(cache, new_k, new_v, **kw)
    assert k.dtype == dtype and k.shape == k_ref.shape == (sum(CONTEXTS) + sum(Q_LENS), nkv, d)
    assert same_bits(k, k_ref) and same_bits(v, v_ref)
    # The reference itself is not vacuous: new rows are the inputs, context rows are not zero.
    assert torch.equal(k_ref[37:40], new_k[0:3]) and k_ref[:37].abs().amin(-1).gt(0).any()


def test_gather_rounds_to_nearest_even_and_keeps_flagged_tokens_nan(device):
    # int8 * fp16 scale is exact in fp32 but not in bf16: rounding, not truncation, must win.
    torch.manual_seed(1)
    bs, nkv, d = 16, 1, 64
    num_blocks, table, cu_q, cu_k, new_k, new_v = _batch(bs, nkv, d, torch.bfloat16, device)
    cache, _, _ = make_cache("int8", bs, nkv, d, num_blocks, device)
    from int8kv_kernels import PageLayout

    lay = PageLayout("int8", bs, nkv, d)
    scales = cache[:, lay.k_scale : lay.v_scale].view(torch.float16)
    scales[int(table[0, 0]), 3] = float("nan")  # token 3 of sequence 0 flagged (non-finite K)
    kw = dict(kv_dtype="int8", block_size=bs, block_table=table, cu_seqlens_q=cu_q,
              cu_seqlens_k=cu_k)  # fmt: skip
    k, _ = gather_kv_context(cache, new_k, new_v, max_seqlen_k=80, num_k_tokens=int(cu_k[-1]), **kw)
    k_ref, _ = gather_kv_context_ref(cache, new_k, new_v, **kw)
    assert k[3].isnan().all() and same_bits(k, k_ref)
    truncated = (k_ref.float().view(torch.int32) >> 16 << 16).view(torch.float32)
    assert not torch.equal(k_ref.float(), truncated)  # some value needed rounding (not vacuous)


def test_gather_refuses_missing_static_scales(device):
    new = torch.zeros(2, 1, 64, dtype=torch.bfloat16, device=device)
    cu = torch.tensor([0, 2], dtype=torch.int32, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    cache = torch.zeros(1, 4096, dtype=torch.int8, device=device)
    kw = dict(block_size=16, block_table=table, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_k=2,
              num_k_tokens=2)  # fmt: skip
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        gather_kv_context(cache, new, new, kv_dtype="int8_static", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "int8_static"])
def test_layers_replay_the_gather_with_their_own_tensors_gpu(kv_dtype, monkeypatch):
    """Layers of one step: the same batch metadata, each layer with its own cache, new K/V and
    static scales. From the second layer on the gather is a replay of the first layer's launch;
    every layer's K/V equal the reference's bit for bit, and a plain ``kernel[grid]`` launch's."""
    import int8kv_kernels.context_gather as context_gather

    torch.manual_seed(2)
    bs, nkv, d = 16, 2, 64
    num_blocks, table, cu_q, cu_k, new_k, new_v = _batch(bs, nkv, d, torch.bfloat16, "cuda")
    layers = [(*make_cache(kv_dtype, bs, nkv, d, num_blocks, "cuda"), torch.randn_like(new_k),
               torch.randn_like(new_v)) for _ in range(3)]  # fmt: skip
    launcher = context_gather.launch_gather

    def step():
        outs = []
        for cache, k_scale, v_scale, k_new, v_new in layers:
            kw = dict(kv_dtype=kv_dtype, block_size=bs, block_table=table, cu_seqlens_q=cu_q,
                      cu_seqlens_k=cu_k, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
            outs.append(gather_kv_context(cache, k_new, v_new, max_seqlen_k=80,
                                          num_k_tokens=int(cu_k[-1]), **kw))  # fmt: skip
            ref = gather_kv_context_ref(cache, k_new, v_new, **kw)
            assert same_bits(outs[-1][0], ref[0]) and same_bits(outs[-1][1], ref[1])
        return outs

    assert_layers_replay(launcher, step, len(layers), monkeypatch)
