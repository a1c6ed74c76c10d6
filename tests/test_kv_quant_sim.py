"""benchmarks/kv_quant_sim.py: the simulated formats are the references' (no model needed)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from int8kv_kernels.reference import quantize_int8

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location(
        "kv_quant_sim", REPO / "benchmarks" / "kv_quant_sim.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["kv_quant_sim"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


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
