"""benchmarks/kv_quant_sim.py: the simulated formats are the references' (no model needed)."""

import pytest
import torch

from benchmarks import kv_quant_sim
from int8kv_kernels.reference import quantize_int8


@pytest.fixture(scope="module")
def sim():
    return kv_quant_sim


def _kv(seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(1, 2, 40, 64)
    x[..., 5] += 12.0  # an outlier channel with an offset, as post-RoPE keys have
    return x.to(torch.bfloat16)


def test_bf16_is_untouched_and_int8_is_the_reference(sim) -> None:
    x = _kv()
    by_name = {v.name: v for v in sim.VARIANTS}
    assert sim.fake_quant(x, by_name["bf16"]) is x
    q, scale = quantize_int8(x.float())
    expected = (q.float() * scale.float()[..., None]).to(x.dtype)
    assert torch.equal(sim.fake_quant(x, by_name["int8"]), expected)


def test_int4_variants_order_as_the_math_says(sim) -> None:
    x = _kv()
    by_name = {v.name: v for v in sim.VARIANTS}

    def err(name: str, k_mode: str = "") -> float:
        return (sim.fake_quant(x, by_name[name], k_mode).float() - x.float()).pow(2).mean().item()

    assert err("int8") < err("int4") < err("int4_no_rotation")  # rotation spreads the outlier
    assert err("int4_group32") < err("int4")
    # sinks: the first tokens come back exact
    sinks = sim.fake_quant(x, by_name["int4_sinks4"])
    assert torch.equal(sinks[..., :4, :], x[..., :4, :])
    # the K mean is subtracted, not added back (softmax-invariant): the result is centred
    centred = sim.fake_quant(x, by_name["int4"], "mean").float()
    assert centred.mean(dim=-2).abs().max() < 0.1 < x.float().mean(dim=-2).abs().max()


def test_bytes_per_token_head(sim) -> None:
    by_name = {v.name: v for v in sim.VARIANTS}
    # D = 64: BF16 256 B; int8 2 x (64 + 2); int4 2 x (32 + 4); group 32: 2 x (32 + 8)
    assert by_name["bf16"].bytes_per_token_head(64) == 256
    assert by_name["int8"].bytes_per_token_head(64) == 132
    assert by_name["int4"].bytes_per_token_head(64) == 72
    assert by_name["int4_group32"].bytes_per_token_head(64) == 80
    assert by_name["k8_v4"].bytes_per_token_head(64) == 66 + 36


def _k(sim, x: torch.Tensor, name: str) -> torch.Tensor:
    """K as the variant stores it (as ``install`` calls it)."""
    v = {v.name: v for v in sim.VARIANTS}[name]
    return sim.fake_quant(x, v.for_k(), v.k_mode)


def test_k_per_channel_groups_channels_over_pages_of_tokens(sim) -> None:
    # every channel constant within each page of 16 tokens (a different constant per channel and
    # page; fp16-exact values): per-channel groups over pages of 16 are constant, so they come
    # back exactly, the last partial page (8 of 40 tokens) included. Per-token groups (mixing
    # channels) or pages of 32 (mixing two pages' constants) do not.
    torch.manual_seed(0)
    consts = torch.randint(-64, 64, (1, 2, 3, 64)).float() / 4  # [batch, heads, pages, channel]
    x = consts.repeat_interleave(16, dim=-2)[..., :40, :].to(torch.bfloat16)
    assert torch.equal(_k(sim, x, "int4_k_per_channel_b16_no_rotation"), x)
    assert not torch.equal(_k(sim, x, "int4_k_per_channel_b32_no_rotation"), x)
    assert not torch.equal(_k(sim, x, "int4_no_rotation"), x)
    # with the rotation the pages are still constant per (rotated) channel: exact up to the
    # rotation's rounding
    rotated = _k(sim, x, "int4_k_per_channel_b16").float()
    assert (rotated - x.float()).abs().max() < 0.05


def test_k_per_channel_outlier_stays_in_its_channel(sim) -> None:
    torch.manual_seed(1)
    x = torch.randn(1, 2, 40, 64)
    y = x.clone()
    y[..., 5] = 50 * y[..., 5] + 100  # a large, varying outlier channel
    x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
    others = [c for c in range(64) if c != 5]
    for name in ("int4_k_per_channel_b16_no_rotation", "int4_k_per_channel_b32_no_rotation"):
        # the other channels are quantized exactly as without the outlier
        assert torch.equal(_k(sim, y, name)[..., others], _k(sim, x, name)[..., others])
    # per-token groups share the outlier's range with the other channels of its group
    err = (_k(sim, y, "int4_no_rotation") - y).float()[..., others].pow(2).mean()
    base = (_k(sim, x, "int4_no_rotation") - x).float()[..., others].pow(2).mean()
    assert err > 10 * base


def test_k_per_channel_variants_keep_v_as_int4(sim) -> None:
    x = _kv()
    by_name = {v.name: v for v in sim.VARIANTS}
    expected = sim.fake_quant(x, by_name["int4"])
    for name in ("int4_k_per_channel_b16", "int4_k_per_channel_b64_no_rotation"):
        assert torch.equal(sim.fake_quant(x, by_name[name]), expected)  # V: k_mode not passed
        assert by_name[name].rotate  # V rotated; K's rotation is k_rotate
    assert by_name["int4_k_per_channel_b16"].for_k().rotate
    assert not by_name["int4_k_per_channel_b16_no_rotation"].for_k().rotate


def test_k_per_channel_bytes(sim) -> None:
    by_name = {v.name: v for v in sim.VARIANTS}
    # K: 32 B of nibbles + 4 B (fp16 scale, zero) x 64 channels per page of B tokens; V: int4's 36
    for b, k in ((16, 32 + 16), (32, 32 + 8), (64, 32 + 4)):
        for suffix in ("", "_no_rotation"):
            assert by_name[f"int4_k_per_channel_b{b}{suffix}"].bytes_per_token_head(64) == k + 36
