"""Shared builders for the kernel tests: random INT8 caches, varlen batches, tolerances (int4's
pages and tails: test_int4_attention.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from int8kv_kernels import (
    PageLayout,
    get_page_bytes,
    paged_attention,
    write_kv_cache,
)
from int8kv_kernels.reference import attention_ref, dequantize_cache


def static_scales(
    nkv: int, head_size: int, device: str, typical: float = 2.0 / 127, octaves: int = 3
) -> torch.Tensor:
    """``int8_static`` scales fp32 [nkv, head_size]: one per (kv-head, channel), channels
    2^-octaves to 2^octaves times ``typical`` (times 0.5..1.5), so a kernel taking one scale per
    head, or another head's or channel's, is off by up to 2^(2 octaves) on some channel."""
    jitter = torch.rand(nkv, head_size) + 0.5
    octave = torch.randint(-octaves, octaves + 1, (nkv, head_size)).float()
    return (typical * jitter * 2.0**octave).float().to(device)


def make_cache(
    kv_dtype: str,
    block_size: int,
    nkv: int,
    head_size: int,
    num_blocks: int,
    device: str,
    v_format: str = "int8",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A cache full of random int8 data and (int8) random fp16 scales; static scales for int8_static
    (per kv-head and channel, channels of very different magnitudes: ``static_scales``).

    Scales are chosen so dequantized K/V have roughly unit magnitude, like real activations.
    ``v_format="e4m3"``: V bytes are random E4M3 codes (every code but the NaNs 0x7f/0xff, which
    no writer produces) and v_scale ~ 2/448.
    """
    layout = PageLayout(kv_dtype, block_size, nkv, head_size)
    cache = torch.randint(
        -127, 128, (num_blocks, layout.page_bytes), dtype=torch.int8, device=device
    )
    if layout.has_scales:
        scales = cache[:, layout.k_scale :].view(torch.float16)
        scales.copy_((torch.rand(scales.shape, device=device) + 0.5) * (2.0 / 127))
        return cache, None, None
    # K's scales fold into the query before its 16-bit split (attention.py), whose grid then
    # follows the largest q * s_k of a row: K's channels 16x apart keep that grid's error within
    # the bf16 tolerance of the outlier-query test; V's scales multiply the output exactly.
    k_scale = static_scales(nkv, head_size, device, octaves=2)
    v_scale = static_scales(nkv, head_size, device)
    if v_format == "e4m3":
        v = cache[:, layout.v_data : layout.k_scale]
        v[v == 127] = 126  # 0x7f -> 0x7e (448)
        v[v == -1] = -2  # 0xff -> 0xfe (-448)
        v_scale = static_scales(nkv, head_size, device, 2.0 / 448)
    return cache, k_scale, v_scale


def random_slots(n: int, num_blocks: int, block_size: int, device: str, pad_every: int = 0):
    """``n`` distinct cache slots at random; every ``pad_every``-th is -1 (a padding token)."""
    slots = torch.randperm(num_blocks * block_size)[:n]
    if pad_every:
        slots[::pad_every] = -1
    return slots.to(device)


@dataclass
class Batch:
    query: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_blocks: int


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    nq: int,
    head_size: int,
    block_size: int,
    device: str,
    dtype: torch.dtype = torch.bfloat16,
    q_std: float = 1.0,
    pad_tokens: int = 0,
) -> Batch:
    """Varlen batch with a shuffled block table (blocks of all sequences interleaved at random).

    ``pad_tokens`` adds query rows past the last sequence (vLLM pads batches for CUDA graphs).
    """
    assert all(0 <= q <= s for q, s in zip(q_lens, seq_lens, strict=True))
    nblk = [-(-s // block_size) for s in seq_lens]
    width = max(nblk) + 2  # spare columns hold garbage: kernels must never read past seq_len
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks)
    table = torch.randint(0, num_blocks, (len(seq_lens), width), dtype=torch.int32)
    used = 0
    for i, n in enumerate(nblk):
        table[i, :n] = perm[used : used + n].int()
        used += n
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    num_tokens = int(qsl[-1]) + pad_tokens
    query = torch.randn(num_tokens, nq, head_size, device=device) * q_std
    return Batch(
        query=query.to(dtype),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_blocks=num_blocks,
    )


def write_random_kv(b: Batch, seq_lens: list[int], kv_dtype: str, nkv: int, d: int, bs: int,
                    device: str, k_channel_scale: torch.Tensor | None = None,
                    v_channel_scale: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Write unit-variance K/V of every position of ``b``'s sequences through the write kernel
    (dynamic-scale dtypes), each channel times ``k_channel_scale`` / ``v_channel_scale`` [d] if
    given; returns (cache, bf16 K slots, bf16 V slots) for an exact reference."""
    pages = get_page_bytes(kv_dtype, bs, nkv, d)
    cache = torch.zeros(b.num_blocks, pages, dtype=torch.int8, device=device)
    k_slots = torch.zeros(b.num_blocks, bs, nkv, d, dtype=torch.bfloat16, device=device)
    v_slots = torch.zeros_like(k_slots)
    for s, n in enumerate(seq_lens):
        pos = torch.arange(n, device=device)
        slots = b.block_table[s, pos // bs].long() * bs + pos % bs
        key = torch.randn(n, nkv, d, device=device, dtype=torch.bfloat16)
        value = torch.randn(n, nkv, d, device=device, dtype=torch.bfloat16)
        if k_channel_scale is not None:
            key = (key.float() * k_channel_scale).to(torch.bfloat16)
        if v_channel_scale is not None:
            value = (value.float() * v_channel_scale).to(torch.bfloat16)
        write_kv_cache(key, value, cache, slots, kv_dtype=kv_dtype, block_size=bs)
        k_slots.view(-1, nkv, d)[slots] = key
        v_slots.view(-1, nkv, d)[slots] = value
    return cache, k_slots, v_slots


# The GPU variants of the attention tests (int8, int8_static / E4M3) at real sizes:
# (name, q_lens, seq_lens, q_heads, kv_heads, head_size, block_size, extra kwargs)
GPU_CASES = [
    ("decode_b8_4k", [1] * 8, [4096, 4000, 3000, 4096, 17, 1, 2048, 4095], 32, 8, 128, 16, {}),
    ("decode_d256", [1] * 4, [2048, 100, 3000, 5], 16, 2, 256, 16, {}),
    ("decode_d64_g3", [1] * 4, [2048, 1000, 3000, 5], 9, 3, 64, 16, {}),
    ("prefill_2k_on_8k", [2048], [8192], 32, 8, 128, 16, {}),
    ("mixed", [1, 300, 1, 77, 513], [5000, 300, 900, 1077, 2000], 32, 8, 128, 32, {}),
    ("window_softcap", [1, 200, 1], [3000, 800, 50], 16, 4, 128, 16,
     {"sliding_window": 512, "soft_cap": 30.0}),
]  # fmt: skip


def run_attention(
    b: Batch,
    cache: torch.Tensor,
    *,
    kv_dtype: str,
    block_size: int,
    nkv: int,
    k_scale=None,
    v_scale=None,
    out: torch.Tensor | None = None,
    **kw,
) -> torch.Tensor:
    """Run the kernel on a NaN-poisoned output so any unwritten element fails the comparison."""
    if out is None:
        out = torch.empty_like(b.query)
    out.fill_(float("nan"))
    paged_attention(
        b.query,
        cache,
        out,
        kv_dtype=kv_dtype,
        block_size=block_size,
        num_kv_heads=nkv,
        query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens,
        block_table=b.block_table,
        max_query_len=b.max_query_len,
        max_seq_len=b.max_seq_len,
        softmax_scale=b.query.shape[-1] ** -0.5,
        k_scale=k_scale,
        v_scale=v_scale,
        **kw,
    )
    return out


def reference(
    b: Batch, cache, *, kv_dtype, block_size, nkv, k_scale=None, v_scale=None, v_format="int8",
    num_splits=None, **kw
) -> torch.Tensor:  # fmt: skip
    """The dequantized cache's exact attention (``num_splits``, the kernel's launch choice, has no
    say in it)."""
    head_size = b.query.shape[-1]
    k, v = dequantize_cache(
        cache, kv_dtype=kv_dtype, block_size=block_size, num_kv_heads=nkv, head_size=head_size,
        k_scale=k_scale, v_scale=v_scale, v_format=v_format,
    )  # fmt: skip
    ref = attention_ref(
        b.query, k, v, query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
        block_table=b.block_table, softmax_scale=head_size**-0.5, **kw,
    )  # fmt: skip
    return ref[: int(b.query_start_loc[-1])]  # rows past the batch (padding) have no reference


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within bf16 tolerance: one output rounding (<= 2^-8 relative, the interpreter truncates:
    2^-7) plus P rounded to bf16 before the PV dot on the GPU (~2^-9 relative per term)."""
    n = ref.shape[0]
    got = out[:n].float()
    assert not got.isnan().any(), "unwritten (NaN-poisoned) output elements"
    err = (got - ref).abs()
    tol = 4e-3 + 2.0**-7 * ref.abs()
    bad = err > tol
    assert not bad.any(), f"{int(bad.sum())} elements off, max err {err.max().item():.4g}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit as 16-bit floats, NaN where NaN (any NaN payload)."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int16),
                                                            b[~nan].view(torch.int16)))  # fmt: skip


def assert_layers_replay(launcher, step, num_layers: int, monkeypatch) -> None:
    """``step()`` runs one launch per layer through ``launcher`` and returns each layer's
    (K, V): its first call compiles and records, its second replays every launch (as many
    replays as layers), and a plain ``kernel[grid]`` launch gives the same bits."""
    step()  # compiles, records
    before = launcher.replays
    outs = step()  # every launch a replay
    assert launcher.replays - before == num_layers
    monkeypatch.setattr(launcher, "direct", False)
    for (k, v), (k2, v2) in zip(outs, step(), strict=True):
        assert same_bits(k, k2) and same_bits(v, v2)


def force_chunked_decode(monkeypatch, chunks: int = 4) -> None:
    """Make the decode launches use the split-K-inside-the-program loop (``chunks`` > 1, off by
    default); prefill launches keep their config."""
    import int8kv_kernels.attention as attention

    choose = attention._choose_config

    def chunked(*args, **kwargs):
        cfg = choose(*args, **kwargs)
        return dataclasses.replace(cfg, chunks=chunks) if cfg.split else cfg

    monkeypatch.setattr(attention, "_choose_config", chunked)
