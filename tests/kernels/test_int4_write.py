"""int4: Hadamard rotation, page layout, and the cache write == torch reference bit for bit."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvbatch import random_slots

from int8kv_kernels import Int4PageLayout, get_page_bytes, write_kv_cache
from int8kv_kernels.catalogue import get_dtype
from int8kv_kernels.hadamard import hadamard, rotate
from int8kv_kernels.reference_int4 import (
    _views,
    dequantize_cache_int4,
    dequantize_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
    write_kv_cache_int4_ref,
)

# ---- Hadamard ----------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_hadamard_is_symmetric_orthogonal(d):
    h = hadamard(d)
    assert torch.equal(h, h.T)
    assert (h.abs() == h[0, 0]).all() and abs(h[0, 0].item() - d**-0.5) < 1e-8
    assert (h.double() @ h.double() - torch.eye(d, dtype=torch.float64)).abs().max() < 1e-6
    assert hadamard(d) is h  # cached


def test_rotation_round_trip_and_dot_products():
    x = torch.randn(5, 3, 128, dtype=torch.bfloat16)
    y = torch.randn(5, 3, 128)
    back = rotate(rotate(x))
    assert (back - x.float()).abs().max() < 1e-5
    dots = (rotate(x) * rotate(y)).sum(-1)
    assert torch.allclose(dots, (x.float() * y).sum(-1), atol=1e-4)
    # An outlier channel is spread over all channels: its energy per channel drops by D.
    e = torch.zeros(128)
    e[7] = 10.0
    assert torch.allclose(rotate(e).abs(), torch.full((128,), 10 / 128**0.5))


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError):
        hadamard(96)


# ---- page layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("nkv", [1, 3, 8])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_int4_layout_matches_catalogue_and_aligns(block_size, nkv, head_size):
    lay = Int4PageLayout(block_size, nkv, head_size)
    cat = get_dtype("int4")
    assert lay.page_bytes == cat.page_bytes(block_size, nkv, head_size)
    assert lay.page_bytes == get_page_bytes("int4", block_size, nkv, head_size)
    assert lay.group_size == cat.group_size and lay.num_groups == head_size // cat.group_size
    data = nkv * block_size * head_size // 2
    assert (lay.k_data, lay.v_data, lay.k_sz) == (0, data, 2 * data)
    assert lay.v_sz == lay.k_sz + 4 * nkv * block_size * lay.num_groups
    assert lay.page_bytes == lay.v_sz + 4 * nkv * block_size * lay.num_groups
    # Data rows of D/2 bytes start 16-byte aligned; (scale, zero) pairs 4-byte aligned.
    assert lay.row_bytes % 16 == 0 and lay.v_data % 16 == 0 and lay.page_bytes % 16 == 0
    assert lay.k_sz % 4 == 0 and lay.v_sz % 4 == 0


def test_int4_layout_rejects_bad_head_size():
    with pytest.raises(ValueError):
        Int4PageLayout(16, 2, 96)
    with pytest.raises(ValueError):
        Int4PageLayout(16, 2, 16)


# ---- reference quantizer -----------------------------------------------------------------------


def test_reference_quantizer_properties():
    # One group [0, 15]: scale 1, zero 0, round half to even, clamp of values outside.
    x = torch.arange(64, dtype=torch.float32) % 16
    x[16:20] = torch.tensor([0.5, 1.5, 2.5, 14.5])
    q, s, z = quantize_int4(x[None], 64)
    assert (s.item(), z.item()) == (1.0, 0.0)
    assert q[0, 16:20].tolist() == [0, 2, 2, 14]
    assert torch.equal(q[0, :16], torch.arange(16, dtype=torch.uint8))
    # Error <= scale/2 (+ the fp16 rounding of the zero, which shifts the grid a little).
    x = torch.randn(200, 256) * 3
    q, s, z = quantize_int4(x, 64)
    assert q.max() <= 15
    err = (dequantize_int4(q, s, z) - x).abs().unflatten(-1, (4, 64))
    bound = s.float()[..., None] / 2 + z.float().abs()[..., None] * 2.0**-11 + 1e-6
    assert (err <= bound).all()
    # A constant group: scale 0, codes 0, dequantizes to the fp16 zero exactly; no NaN.
    x = torch.full((1, 64), 0.3)
    q, s, z = quantize_int4(x, 64)
    assert s.item() == 0 and (q == 0).all() and z.item() == torch.tensor(0.3).half().item()
    # Packing: element i low nibble, i + D/2 high nibble.
    c = torch.randint(0, 16, (3, 128), dtype=torch.uint8)
    p = pack_int4(c)
    assert p.shape == (3, 64) and torch.equal(p & 15, c[:, :64]) and torch.equal(p >> 4, c[:, 64:])
    assert torch.equal(unpack_int4(p), c)


def test_int4_v_is_key_major_in_the_page(device):
    # Spelled out with page_layout.py's byte offsets, not _views: the write and the reference
    # must both put byte i of slot t of head h of V at v_data + (h*D/2 + i)*B + t.
    nkv, d, bs = 3, 64, 32
    lay = Int4PageLayout(bs, nkv, d)
    value = torch.randn(bs, nkv, d, device=device, dtype=torch.bfloat16)
    key = torch.randn(bs, nkv, d, device=device, dtype=torch.bfloat16)
    slots = torch.randperm(bs, device=device)  # slot of token n; a full page in shuffled order
    cache, ref = _write_both(key, value, 1, bs, slots, device)
    assert torch.equal(cache, ref)
    codes, _, _ = quantize_int4(rotate(value), lay.group_size)  # [token, head, d]
    page = cache[0].view(torch.uint8)
    for t, h, i in ((0, 0, 0), (5, 1, 3), (31, 2, 31), (17, 2, 0)):
        n = int((slots == t).nonzero())
        want = int(codes[n, h, i]) | int(codes[n, h, i + d // 2]) << 4
        assert int(page[lay.v_data + (h * d // 2 + i) * bs + t]) == want
        k_want = pack_int4(quantize_int4(rotate(key[n, h]), lay.group_size)[0])[i]
        assert int(page[lay.k_data + (h * bs + t) * d // 2 + i]) == int(k_want)


# ---- write kernel == reference -----------------------------------------------------------------


def _write_both(key, value, num_blocks, block_size, slots, device):
    nkv, d = key.shape[1], key.shape[2]
    lay = Int4PageLayout(block_size, nkv, d)
    # Random bytes everywhere: slots the kernel must not touch have to keep them.
    cache = torch.randint(-128, 128, (num_blocks, lay.page_bytes), dtype=torch.int8, device=device)
    ref = cache.clone()
    write_kv_cache(key, value, cache, slots, kv_dtype="int4", block_size=block_size)
    write_kv_cache_int4_ref(key, value, ref, slots, block_size=block_size)
    return cache, ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "nkv,head_size,block_size", [(2, 64, 16), (3, 128, 32), (1, 256, 16), (4, 256, 32)]
)
def test_write_int4_matches_reference_bitwise(dtype, nkv, head_size, block_size, device):
    n, nb = 10, 3
    key = (torch.randn(n, nkv, head_size, device=device) * 3).to(dtype)
    value = torch.randn(n, nkv, head_size, device=device).to(dtype)
    key[0] = 0  # an all-zero token: every group constant 0
    value[1, 0] = 0  # an all-zero head
    value[2, -1] = 0
    value[2, -1, 0] = 2.5  # a * e_0 rotates to the constant a / sqrt(D): constant groups
    key[3, 0, :4] = 1e4  # large values in one head
    slots = random_slots(n, nb, block_size, device, pad_every=4)
    cache, ref = _write_both(key, value, nb, block_size, slots, device)
    assert torch.equal(cache, ref)
    _, _, ksz, vsz = _views(cache, Int4PageLayout(block_size, nkv, head_size))
    s2 = int(slots[2])
    assert s2 >= 0
    sz = vsz[s2 // block_size, -1, s2 % block_size]  # the constant head: scale 0, zero a/sqrt(D)
    assert (sz[:, 0] == 0).all()
    assert (sz[:, 1] == torch.tensor(2.5 / head_size**0.5).half()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_zero_and_huge_values_stay_finite(dtype, device):
    nkv, d, bs = 2, 128, 16
    big = torch.finfo(dtype).max if dtype == torch.float16 else 1e30
    key = torch.randn(4, nkv, d, device=device).to(dtype)
    value = torch.randn(4, nkv, d, device=device).to(dtype)
    key[0] = 0
    value[0] = 0
    key[1, 0, :] = big  # rotated values far beyond fp16: zero clamps to -65504, codes saturate
    key[1, 1, 3] = -big
    value[2, 1, :5] = torch.tensor([big, -big, 1.0, 0.0, 2.0])
    key[3] = 1e-30 if dtype == torch.bfloat16 else 1e-7  # scales underflow fp16
    slots = torch.arange(4, device=device)
    cache, ref = _write_both(key, value, 1, bs, slots, device)
    assert torch.equal(cache, ref)
    k, v = dequantize_cache_int4(cache, block_size=bs, num_kv_heads=nkv, head_size=d)
    k, v = k[0, :4], v[0, :4]  # [slot, head, d] of the written slots (the rest is random bytes)
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    assert (k[0] == 0).all() and (v[0] == 0).all()  # zero vectors round-trip exactly
    # The (clamped) scales and zeros are finite fp16.
    _, _, ksz, vsz = _views(cache, Int4PageLayout(bs, nkv, d))
    assert torch.isfinite(ksz[0, :, :4]).all() and torch.isfinite(vsz[0, :, :4]).all()


def test_int4_nan_inf_rows_are_flagged(device):
    nkv, d, bs = 2, 64, 16
    key = torch.randn(3, nkv, d, device=device, dtype=torch.bfloat16)
    value = torch.randn(3, nkv, d, device=device, dtype=torch.bfloat16)
    key[0, 1, 5] = float("nan")
    value[1, 0, 0] = float("inf")
    key[2, 0, 63] = float("-inf")
    slots = torch.arange(3, device=device)
    cache, ref = _write_both(key, value, 1, bs, slots, device)
    assert torch.equal(cache, ref)
    kd, vd, ksz, vsz = _views(cache, Int4PageLayout(bs, nkv, d))
    flagged = [(kd, ksz, 0, 1), (vd, vsz, 1, 0), (kd, ksz, 2, 0)]
    for data, sz, t, h in flagged:
        assert sz[0, h, t].isnan().all() and (data[0, h, t] == 0).all()
    # Other (token, head) rows are quantized normally.
    assert torch.isfinite(ksz[0, 0, 0]).all() and torch.isfinite(vsz[0, 1, 1]).all()
    assert torch.isfinite(ksz[0, 1, 2]).all()


def test_int4_padding_slots_and_rows_past_the_mapping(device):
    nkv, d, bs, nb = 2, 64, 16, 2
    lay = Int4PageLayout(bs, nkv, d)
    key = torch.randn(9, nkv, d, device=device, dtype=torch.bfloat16)
    cache = torch.randint(-128, 128, (nb, lay.page_bytes), dtype=torch.int8, device=device)
    before = cache.clone()
    write_kv_cache(key, key, cache, torch.full((9,), -1, device=device), kv_dtype="int4",
                   block_size=bs)  # fmt: skip
    assert torch.equal(cache, before)
    # More key rows than slots (CUDA-graph padding): only mapped rows are written.
    slots = torch.tensor([3, 17], dtype=torch.int64, device=device)
    write_kv_cache(key, key, cache, slots, kv_dtype="int4", block_size=bs)
    write_kv_cache_int4_ref(key[:2], key[:2], before, slots, block_size=bs)
    assert torch.equal(cache, before)


def test_int4_non_contiguous_inputs_and_int32_slots(device):
    nkv, d, bs, n = 2, 128, 16, 7
    qkv = torch.randn(n, 3 * nkv, d, device=device, dtype=torch.bfloat16)
    key, value = qkv[:, nkv : 2 * nkv], qkv[:, 2 * nkv :]
    assert not key.is_contiguous()
    slots = random_slots(n, 2, bs, device).int()
    cache, ref = _write_both(key, value, 2, bs, slots, device)
    assert torch.equal(cache, ref)


def test_int4_rejects_static_scales_and_e4m3(device):
    nkv, d, bs = 1, 64, 16
    key = torch.randn(1, nkv, d, device=device, dtype=torch.bfloat16)
    cache = torch.zeros(1, Int4PageLayout(bs, nkv, d).page_bytes, dtype=torch.int8, device=device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError):
        write_kv_cache(key, key, cache, slots, kv_dtype="int4", block_size=bs,
                       k_scale=torch.ones(1), v_scale=torch.ones(1))  # fmt: skip
    with pytest.raises(ValueError):
        write_kv_cache(key, key, cache, slots, kv_dtype="int4", block_size=bs, v_format="e4m3")


@settings(max_examples=8, deadline=None)
@given(
    n=st.integers(1, 6),
    nkv=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([64, 128, 256]),
    scale_exp=st.integers(-20, 20),
    pad=st.integers(0, 3),
    fp16=st.booleans(),
)
def test_write_int4_random_magnitudes(n, nkv, d, scale_exp, pad, fp16):
    dtype = torch.float16 if fp16 else torch.bfloat16
    mag = 2.0**scale_exp
    if fp16:
        mag = min(mag, 1000.0)
    key = (torch.randn(n, nkv, d) * mag).to(dtype)
    value = (torch.randn(n, nkv, d) * mag).to(dtype)
    slots = random_slots(n, 2, 16, "cpu", pad_every=pad + 1 if pad else 0)
    cache, ref = _write_both(key, value, 2, 16, slots, "cpu")
    assert torch.equal(cache, ref)


@pytest.mark.gpu
def test_write_int4_real_size_gpu():
    nkv, d, bs, n, nb = 8, 128, 16, 256, 64
    key = torch.randn(n, nkv, d, device="cuda", dtype=torch.bfloat16) * 4
    value = torch.randn(n, nkv, d, device="cuda", dtype=torch.bfloat16)
    key[:3] = 0
    slots = random_slots(n, nb, bs, "cuda", pad_every=7)
    cache, ref = _write_both(key, value, nb, bs, slots, "cuda")
    _assert_equal_up_to_rotation_rounding(cache, ref, slots, nkv, d, bs)


def _assert_equal_up_to_rotation_rounding(cache, ref, slots, nkv, d, bs):
    """Bit-equal, or as close as two fp32 GEMMs allow: on a GPU the kernel's rotation and the
    reference's are separate cuBLAS calls whose algorithm (and last bit) cuBLAS may choose
    differently, and a last-bit change at a rounding boundary moves a 4-bit code by one, or a
    group's scale/zero by an fp16 ulp. So: few differing bytes, and every written value within one
    quantization step (a group's range / 15 <= its vector's range / 15) of the reference."""
    if torch.equal(cache, ref):
        return
    assert (cache != ref).float().mean() < 1e-3, "more bytes differ than rounding can explain"
    written = slots[slots >= 0].long()
    blk, off = written // bs, written % bs
    got = dequantize_cache_int4(cache, block_size=bs, num_kv_heads=nkv, head_size=d, rotated=True)
    want = dequantize_cache_int4(ref, block_size=bs, num_kv_heads=nkv, head_size=d, rotated=True)
    for a, b in zip(got, want, strict=True):
        a, b = a[blk, off], b[blk, off]  # [tokens, heads, D]
        step = (b.amax(-1, keepdim=True) - b.amin(-1, keepdim=True)) / 15
        assert ((a - b).abs() <= step * 1.01 + 1e-6).all()


def test_rounding_tolerance_of_the_gpu_comparison_accepts_one_code_and_rejects_real_errors():
    nkv, d, bs, n, nb = 2, 64, 16, 40, 4
    key = torch.randn(n, nkv, d, dtype=torch.bfloat16)
    value = torch.randn(n, nkv, d, dtype=torch.bfloat16)
    slots = torch.randperm(nb * bs)[:n]
    cache, ref = _write_both(key, value, nb, bs, slots, "cpu")
    kd = _views(cache, Int4PageLayout(bs, nkv, d))[0]
    blk, off = int(slots[0]) // bs, int(slots[0]) % bs
    byte = int(kd[blk, 0, off, 0])
    kd[blk, 0, off, 0] = byte - 1 if byte & 15 else byte + 1  # low nibble: one code step
    _assert_equal_up_to_rotation_rounding(cache, ref, slots, nkv, d, bs)
    kd[blk, 0, off, 0] = byte ^ 8  # eight code steps: a wrong value, not rounding
    with pytest.raises(AssertionError):
        _assert_equal_up_to_rotation_rounding(cache, ref, slots, nkv, d, bs)
    kd[blk, 0, off, 0] = byte
    kd[blk] ^= 1  # a whole page's K codes off by one: far more bytes than rounding touches
    with pytest.raises(AssertionError, match="more bytes differ"):
        _assert_equal_up_to_rotation_rounding(cache, ref, slots, nkv, d, bs)
