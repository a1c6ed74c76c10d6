"""Cache write kernel == plain-torch reference, bit for bit (data and scales)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvbatch import random_slots, static_scales

from int8kv_kernels import PageLayout, cache_write, write_kv_cache
from int8kv_kernels.cache_write import _TILE_T
from int8kv_kernels.reference import dequantize_cache, quantize_int8, write_kv_cache_ref


def _write_both(
    key, value, num_blocks, block_size, slots, kv_dtype, device, k_scale=None, v_scale=None,
    v_format="int8",
):  # fmt: skip
    nkv, d = key.shape[1], key.shape[2]
    lay = PageLayout(kv_dtype, block_size, nkv, d)
    # Random bytes everywhere: slots the kernel must not touch have to keep them.
    cache = torch.randint(-128, 128, (num_blocks, lay.page_bytes), dtype=torch.int8, device=device)
    ref = cache.clone()
    kw = dict(kv_dtype=kv_dtype, block_size=block_size, k_scale=k_scale, v_scale=v_scale,
              v_format=v_format)  # fmt: skip
    write_kv_cache(key, value, cache, slots, **kw)
    write_kv_cache_ref(key, value, ref, slots, **kw)
    return cache, ref


@pytest.fixture(params=["per_token", "tiles"])
def launch(request, monkeypatch):
    """Both launch shapes of the write (cache_write.write_launch) on the same test: one token per
    program (a decode step's batch) and tiles of 16 tokens (a prefill chunk's)."""
    small = 10**9 if request.param == "per_token" else 0
    monkeypatch.setattr(cache_write, "SMALL_BATCH_TOKENS", small)
    return request.param


def test_launch_shape_follows_the_batch_size():
    assert cache_write.write_launch(1) == cache_write.write_launch(512) == (1, 1)
    assert cache_write.write_launch(513) == (_TILE_T, 4)


@pytest.mark.parametrize("kv_dtype", ["int8", "int8_static"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nkv,head_size,block_size", [(2, 64, 16), (3, 128, 32), (2, 256, 16)])
def test_write_matches_reference_bitwise(
    kv_dtype, dtype, nkv, head_size, block_size, device, launch
):
    n, nb = 12, 4
    key = torch.randn(n, nkv, head_size, device=device) * 3
    value = torch.randn(n, nkv, head_size, device=device)
    ks = vs = None
    if kv_dtype == "int8_static":
        # a scale per (kv-head, channel), channels 64x apart, each channel's values sized to it
        ks = static_scales(nkv, head_size, device, 0.03)
        vs = static_scales(nkv, head_size, device, 0.01)
        key, value = key * (ks / 0.03), value * (vs / 0.01)
    key, value = key.to(dtype), value.to(dtype)
    key[0] = 0  # an all-zero token
    value[1, 0] = 0  # an all-zero head
    slots = random_slots(n, nb, block_size, device, pad_every=5)
    cache, ref = _write_both(key, value, nb, block_size, slots, kv_dtype, device, ks, vs)
    assert torch.equal(cache, ref)


# Channel groups of one vector 10^4 apart in magnitude (as Gemma 3's 256-channel heads have
# channels far larger than the rest): each group's error must follow its own scale.
_GROUP_MAGNITUDES = (100.0, 1.0, 0.01, 10.0)


def _write_group_magnitudes(head_size: int, device, nkv: int = 2, bs: int = 16, n: int = 8):
    """int8 pages of n tokens whose 64-channel slices differ in magnitude by _GROUP_MAGNITUDES
    (V's in the reverse order), written bit-exactly as the reference writes them."""
    mags = torch.tensor(_GROUP_MAGNITUDES[: head_size // 64], device=device).repeat_interleave(64)
    key = (torch.randn(n, nkv, head_size, device=device) * mags).to(torch.bfloat16)
    value = (torch.randn(n, nkv, head_size, device=device) * mags.flip(0)).to(torch.bfloat16)
    cache, ref = _write_both(key, value, 1, bs, torch.arange(n, device=device), "int8", device)
    assert torch.equal(cache, ref)
    return key, value, cache, PageLayout("int8", bs, nkv, head_size)


@pytest.mark.parametrize("head_size", [256])
def test_group_scales_follow_each_groups_magnitude(head_size, device, launch):
    nkv, bs, n = 2, 16, 8
    ng = head_size // 64
    key, value, cache, lay = _write_group_magnitudes(head_size, device, nkv, bs, n)
    scales = cache[0, lay.k_scale : lay.v_scale].view(torch.float16).view(nkv, ng, bs)[:, :, :n]
    want = key.float().unflatten(-1, (ng, 64)).abs().amax(-1).transpose(0, 1) / 127
    torch.testing.assert_close(scales.transpose(1, 2).float(), want, rtol=2**-10, atol=0)
    k, v = dequantize_cache(cache, kv_dtype="int8", block_size=bs, num_kv_heads=nkv,
                            head_size=head_size)  # fmt: skip
    for got, x in ((k[0, :n], key), (v[0, :n], value)):
        xg = x.float().unflatten(-1, (ng, 64))
        err = (got.unflatten(-1, (ng, 64)) - xg).abs().amax(-1)  # [n, nkv, ng]
        group_step = xg.abs().amax(-1) / 127
        head_step = x.float().abs().amax(-1, keepdim=True) / 127
        assert (err <= group_step / 2 * (1 + 1e-2)).all()
        # the smallest group's error is orders of magnitude below what one scale per head gives
        small = xg.abs().amax(-1).argmin(-1, keepdim=True)
        assert (err.gather(-1, small) < head_step / 100).all()


@pytest.mark.parametrize("head_size", [64, 128])
def test_head_sizes_up_to_128_store_one_scale_per_token_head(head_size, device, launch):
    # the groups' magnitudes as above, but one scale over the whole vector: absmax / 127
    nkv, bs, n = 2, 16, 8
    key, value, cache, lay = _write_group_magnitudes(head_size, device, nkv, bs, n)
    # the scale regions hold exactly one fp16 per (token, kv-head) slot of the page, K and V
    assert lay.v_scale - lay.k_scale == lay.page_bytes - lay.v_scale == 2 * nkv * bs
    for x, lo, hi in ((key, lay.k_scale, lay.v_scale), (value, lay.v_scale, lay.page_bytes)):
        scales = cache[0, lo:hi].view(torch.float16).view(nkv, bs)[:, :n].transpose(0, 1)
        want = x.float().abs().amax(-1) / 127
        torch.testing.assert_close(scales.float(), want, rtol=2**-10, atol=0)


def test_non_finite_element_flags_every_group_of_its_vector(device):
    nkv, d, bs = 2, 256, 16
    key = torch.randn(3, nkv, d, device=device).to(torch.bfloat16)
    value = torch.randn(3, nkv, d, device=device).to(torch.bfloat16)
    key[1, 0, 200] = float("nan")
    value[2, 1, 3] = float("inf")
    cache, ref = _write_both(key, value, 1, bs, torch.arange(3, device=device), "int8", device)
    assert torch.equal(cache, ref)
    lay = PageLayout("int8", bs, nkv, d)
    ks = cache[0, lay.k_scale : lay.v_scale].view(torch.float16).view(nkv, 4, bs).transpose(1, 2)
    vs = cache[0, lay.v_scale : lay.page_bytes].view(torch.float16).view(nkv, 4, bs).transpose(1, 2)
    assert ks[0, 1].isnan().all() and vs[1, 2].isnan().all()
    assert not ks[1, 1].isnan().any() and not vs[0, 2].isnan().any()
    assert not ks[:, [0, 2]].isnan().any() and not vs[:, :2].isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_zero_and_huge_values_stay_finite(dtype, device):
    nkv, d, bs = 2, 64, 16
    big = torch.finfo(dtype).max
    key = torch.randn(4, nkv, d, device=device).to(dtype)
    value = torch.randn(4, nkv, d, device=device).to(dtype)
    key[0] = 0
    value[0] = 0
    key[1, 0, :] = big  # absmax/127 overflows fp16 for bf16 inputs
    key[1, 1, 3] = -big
    value[2, 1, :5] = torch.tensor([big, -big, 1.0, 0.0, 2.0])
    key[3] = 1e-30 if dtype == torch.bfloat16 else 1e-7  # scale underflows fp16
    slots = torch.arange(4, device=device)
    cache, ref = _write_both(key, value, 1, bs, slots, "int8", device)
    assert torch.equal(cache, ref)
    k, v = dequantize_cache(cache, kv_dtype="int8", block_size=bs, num_kv_heads=nkv, head_size=d)
    k, v = k[0, :4], v[0, :4]  # [slot, head, d] of the written slots (the rest is random bytes)
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    assert (k[0] == 0).all() and (v[0] == 0).all()  # zero vectors round-trip exactly
    k_data = cache[0, : nkv * bs * d].view(nkv, bs, d)[:, :4]  # the 4 written slots
    v_data = cache[0, nkv * bs * d : 2 * nkv * bs * d].view(nkv, d, bs)[:, :, :4]  # key-major
    assert min(int(k_data.min()), int(v_data.min())) >= -127  # symmetric: -128 is never written
    assert (k[1, 0] > 0).all()  # saturated huge values keep their sign


@pytest.mark.parametrize("kv_dtype,v_format", [("int8", "int8"), ("int8_static", "int8"),
                                               ("int8_static", "e4m3")])  # fmt: skip
def test_token_tiles_across_pages_padding_and_scattered_slots(kv_dtype, v_format, device, launch):
    # The kernel quantizes and stores tiles of consecutive tokens of the batch together. Tile 0: a
    # run crossing from page 0 into page 1, padding, descending and scattered slots, a run inside
    # page 2; tile 1: one whole page; tile 2 (partial): a run, padding, scattered slots.
    assert _TILE_T == 16, "the slots below are laid out in tiles of 16 tokens"
    nkv, d, bs, nb = 2, 64, 16, 6
    slots = ([13, 14, 15, 16, 17, 18, -1, -1, 90, 84, 70, 71, 40, 41, 42, 43]
             + list(range(48, 64)) + [0, 1, 2, 3, -1, 95, 20, 21])  # fmt: skip
    slots = torch.tensor(slots, device=device)
    n = len(slots)
    key = (torch.randn(n, nkv, d, device=device) * 3).to(torch.bfloat16)
    value = torch.randn(n, nkv, d, device=device).to(torch.bfloat16)
    # A non-finite element changes its own (token, head) only, not its tile.
    key[2, 1, 5] = float("inf")
    value[9, 0, 7] = float("nan")
    ks = vs = None
    if kv_dtype == "int8_static":
        ks = static_scales(nkv, d, device, 0.03)
        vs = static_scales(nkv, d, device, 3.0 / 448 if v_format == "e4m3" else 0.02)
    cache, ref = _write_both(key, value, nb, bs, slots, kv_dtype, device, ks, vs, v_format)
    assert torch.equal(cache, ref)


def test_padding_slots_leave_cache_untouched(device):
    nkv, d, bs, nb = 2, 64, 16, 2
    key = torch.randn(6, nkv, d, device=device, dtype=torch.bfloat16)
    slots = torch.full((6,), -1, dtype=torch.int64, device=device)
    cache = torch.randint(-128, 128, (nb, PageLayout("int8", bs, nkv, d).page_bytes),
                          dtype=torch.int8, device=device)  # fmt: skip
    before = cache.clone()
    write_kv_cache(key, key, cache, slots, kv_dtype="int8", block_size=bs)
    assert torch.equal(cache, before)


def test_key_rows_past_the_slot_mapping_are_ignored(device):
    # CUDA-graph padding: key has more rows than slot_mapping. Only mapped rows are written, and
    # the kernel must not read slot indices past the end of the mapping.
    nkv, d, bs, nb = 2, 64, 16, 2
    key = torch.randn(9, nkv, d, device=device, dtype=torch.bfloat16)
    slots = torch.tensor([3, 17], dtype=torch.int64, device=device)
    cache = torch.zeros((nb, PageLayout("int8", bs, nkv, d).page_bytes), dtype=torch.int8,
                        device=device)  # fmt: skip
    expected = cache.clone()
    write_kv_cache(key, key, cache, slots, kv_dtype="int8", block_size=bs)
    write_kv_cache_ref(key[:2], key[:2], expected, slots, kv_dtype="int8", block_size=bs)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("kv_dtype", ["int8", "int8_static"])
def test_non_contiguous_inputs_and_int32_slots(kv_dtype, device, launch):
    nkv, d, bs, n = 2, 64, 16, 7
    # K and V as slices of one fused [n, 3 * nkv, d] qkv tensor, like vLLM's split of a qkv matmul.
    qkv = torch.randn(n, 3 * nkv, d, device=device, dtype=torch.bfloat16)
    key, value = qkv[:, nkv : 2 * nkv], qkv[:, 2 * nkv :]
    assert not key.is_contiguous()
    ks = vs = None
    if kv_dtype == "int8_static":
        ks, vs = static_scales(nkv, d, device, 0.02), static_scales(nkv, d, device, 0.03)
    slots = random_slots(n, 2, bs, device).int()
    cache, ref = _write_both(key, value, 2, bs, slots, kv_dtype, device, ks, vs)
    assert torch.equal(cache, ref)


def test_reference_quantizer_properties():
    # The reference itself: round half to even, divide by the stored fp16 scale, error <= scale/2.
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -63.5]])
    q, s = quantize_int8(x)
    assert s.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 0, -64]]
    x = torch.randn(64, 128) * 5
    q, s = quantize_int8(x)
    err = (q.float() * s.float()[:, None] - x).abs()
    assert (err <= s.float()[:, None] / 2 * (1 + 1e-3)).all()
    # per group: the same quantizer on each 64-channel slice
    qg, sg = quantize_int8(x, 64)
    assert sg.shape == (64, 2)
    for g in range(2):
        qs, ss = quantize_int8(x[:, g * 64 : (g + 1) * 64])
        assert torch.equal(qg[:, g * 64 : (g + 1) * 64], qs) and torch.equal(sg[:, g], ss)


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 9),
    nkv=st.sampled_from([1, 2, 4]),
    scale_exp=st.integers(-20, 20),
    pad=st.integers(0, 3),
    fp16=st.booleans(),
)
def test_write_random_magnitudes(n, nkv, scale_exp, pad, fp16):
    dtype = torch.float16 if fp16 else torch.bfloat16
    mag = 2.0**scale_exp
    if fp16:
        mag = min(mag, 1000.0)
    key = (torch.randn(n, nkv, 64) * mag).to(dtype)
    value = (torch.randn(n, nkv, 64) * mag).to(dtype)
    slots = random_slots(n, 2, 16, "cpu", pad_every=pad + 1 if pad else 0)
    cache, ref = _write_both(key, value, 2, 16, slots, "int8", "cpu")
    assert torch.equal(cache, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "int8_static"])
def test_write_real_size_gpu(kv_dtype, launch):
    nkv, d, bs, n, nb = 8, 128, 16, 256, 64
    key = torch.randn(n, nkv, d, device="cuda", dtype=torch.bfloat16) * 4
    value = torch.randn(n, nkv, d, device="cuda", dtype=torch.bfloat16)
    key[:3] = 0
    ks = vs = None
    if kv_dtype == "int8_static":
        ks, vs = static_scales(nkv, d, "cuda", 0.03), static_scales(nkv, d, "cuda", 0.01)
    slots = random_slots(n, nb, bs, "cuda", pad_every=7)
    cache, ref = _write_both(key, value, nb, bs, slots, kv_dtype, "cuda", ks, vs)
    assert torch.equal(cache, ref)


def test_static_write_refuses_scales_that_are_not_one_per_channel(device):
    # The kernel reads row h of [H, D] scales: a [H] (per-head) or wrongly typed scale would be
    # read past its end, so it is refused before the launch.
    nkv, d, bs = 2, 64, 16
    key = torch.randn(3, nkv, d, device=device, dtype=torch.bfloat16)
    cache = torch.zeros(1, PageLayout("int8_static", bs, nkv, d).page_bytes, dtype=torch.int8,
                        device=device)  # fmt: skip
    slots = torch.arange(3, device=device)
    good = static_scales(nkv, d, device)
    for bad, what in ((torch.full((nkv,), 0.02, device=device), r"\[2, 64\].*\[2\]"),
                      (good.double(), "float64"), (good.t().contiguous().t(), "contiguous")):  # fmt: skip
        with pytest.raises(ValueError, match=what):
            write_kv_cache(key, key, cache, slots, kv_dtype="int8_static", block_size=bs,
                           k_scale=good, v_scale=bad)  # fmt: skip
    assert not cache.any()
