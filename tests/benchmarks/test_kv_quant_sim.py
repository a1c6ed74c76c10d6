"""benchmarks/kv_quant_sim.py: the simulated formats are the references' (no model needed)."""

import pytest
import torch
from tiny_models import WORDS, tiny_gemma3_config, tiny_model_dir

from benchmarks import kv_quant_sim
from int8kv_kernels.reference import quantize_int8
from int8kv_kernels.reference_int4 import dequantize_int4, quantize_int4


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


def _logits(config, impl: str, state: dict | None, ids: torch.Tensor):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()
    if state is not None:
        model.load_state_dict(state)
    with torch.inference_mode():
        return model(ids).logits, model.state_dict()


def test_sliding_window_layers_get_their_mask_through_the_sim(sim) -> None:
    # transformers builds no mask for an attention name without a mask function, and SDPA then
    # attends causally over every key: the sim's unquantized row must equal plain SDPA's, sliding
    # window included, on a sequence four times the window.
    sim.install([next(v for v in sim.VARIANTS if v.name == "bf16")])
    ids = torch.arange(3, 27)[None]
    ref, state = _logits(tiny_gemma3_config(6), "sdpa", None, ids)
    ours, _ = _logits(tiny_gemma3_config(6), "int8kv_sim", state, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # the window matters here: without it the logits after the first window differ
    unlimited, _ = _logits(tiny_gemma3_config(64), "sdpa", state, ids)
    assert torch.equal(unlimited[:, :6], ref[:, :6])
    assert (unlimited[:, 6:] - ref[:, 6:]).abs().max() > 1e-3


@pytest.mark.parametrize("with_bos", [True, False])
def test_every_scored_window_starts_with_the_models_bos(sim, tmp_path, monkeypatch, with_bos):
    folder = tiny_model_dir(tmp_path, with_bos)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(WORDS[(i * 7) % len(WORDS)] for i in range(100)))
    seen = []
    run = sim.window_logits
    scored = sim.window_nll

    def spy(model, ids):
        seen.append(ids.tolist())
        return run(model, ids)

    def in_chunks(model, ids, chunk=256, logits=None):
        return scored(model, ids, chunk=5, logits=logits)  # shorter than a window: the same sum

    monkeypatch.setattr(sim, "window_logits", spy)
    monkeypatch.setattr(sim, "window_nll", in_chunks)
    out = tmp_path / "sim.json"
    variants = "bf16,int4,int4_k_per_channel_b64_no_rotation_sinks64"
    sim.main(["--model", str(folder), "--corpus", str(corpus), "--window", "16", "--windows",
              "3", "--variants", variants, "--device", "cpu", "--out", str(out)])  # fmt: skip
    doc = __import__("json").loads(out.read_text())
    body = [3 + WORDS.index(WORDS[(i * 7) % len(WORDS)]) for i in range(100)]
    if with_bos:  # [<bos>] + 15 corpus tokens, consecutive across windows
        windows = [[2, *body[i * 15 : (i + 1) * 15]] for i in range(3)]
    else:
        windows = [body[i * 16 : (i + 1) * 16] for i in range(3)]
    assert seen == [w for w in windows for _ in range(3)]  # every variant, the same windows
    assert doc["bos"] == (2 if with_bos else None)
    assert doc["tokens"] == 3 * 15 and doc["window"] == 16 and doc["gpu"] is None
    assert [r["variant"] for r in doc["rows"]] == variants.split(",")
    assert doc["rows"][0]["delta_pct"] == 0 and doc["rows"][1]["delta_pct"] != 0
    assert doc["rows"][1]["capacity_vs_bf16"] == 3.56  # head size 256: 1024 / (144 + 144)
    assert doc["rows"][0]["top1_agreement"] == 1 and doc["rows"][0]["kl_mean"] == 0
    assert doc["rows"][1]["kl_mean"] > 0 and 0 <= doc["rows"][1]["top1_agreement"] <= 1
    assert len(doc["git_commit"]) >= 7 and doc["date"]
    assert doc["command"].startswith("python")


def test_window_nll_in_chunks_is_the_whole_windows_cross_entropy(sim) -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 20, 11, dtype=torch.bfloat16)
    ids = torch.randint(0, 11, (20,))

    class Fixed(torch.nn.Module):
        def forward(self, x):
            return type("Out", (), {"logits": logits})

    total, count = sim.window_nll(Fixed(), ids, chunk=3)
    whole = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[1:], reduction="sum")
    assert count == 19 and abs(total - whole.item()) < 1e-3


def test_variants_are_picked_by_name_with_bf16_first(sim) -> None:
    picked = sim.pick_variants("bf16, int4_k_per_channel_b32 ,int8")
    assert [v.name for v in picked] == ["bf16", "int4_k_per_channel_b32", "int8"]
    with pytest.raises(ValueError, match="unknown variants"):
        sim.pick_variants("bf16,int3")
    with pytest.raises(ValueError, match="first variant must be bf16"):
        sim.pick_variants("int8,bf16")


def test_sink_rows_keep_the_first_page_exact_and_quantize_the_rest_as_without(sim) -> None:
    torch.manual_seed(2)
    x = torch.randn(1, 1, 160, 256).to(torch.bfloat16)
    by_name = {v.name: v for v in sim.VARIANTS}
    plain = by_name["int4_k_per_channel_b64_no_rotation"]
    sinks = by_name["int4_k_per_channel_b64_no_rotation_sinks64"]
    for v, k_mode in ((plain.for_k(), "channel"), (plain, "")):  # K, then V
        s = sinks.for_k() if k_mode else sinks
        with_sinks, without = sim.fake_quant(x, s, k_mode), sim.fake_quant(x, v, k_mode)
        assert torch.equal(with_sinks[..., :64, :], x[..., :64, :])
        assert not torch.equal(without[..., :64, :], x[..., :64, :])
        assert torch.equal(with_sinks[..., 64:, :], without[..., 64:, :])
    assert sinks.bytes_per_token_head(256) == plain.bytes_per_token_head(256)


def _decode_reads(q, k, v, k_q, v_q, scale: float) -> torch.Tensor:
    """Attention as decode computes it, one query at a time: with i + 1 tokens in the sequence,
    positions below (i + 1) // 64 * 64 come from the full, quantized pages and the rest from
    the BF16 tail (the int4 contract's split). [b, heads, t, D] in, [b, t, heads, D] out."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    for i in range(q.shape[2]):
        done = (i + 1) // 64 * 64
        keys = torch.cat([k_q[..., :done, :], k[..., done : i + 1, :]], -2).float()
        vals = torch.cat([v_q[..., :done, :], v[..., done : i + 1, :]], -2).float()
        keys, vals = keys.repeat_interleave(groups, 1), vals.repeat_interleave(groups, 1)
        p = torch.softmax(q[..., i : i + 1, :].float() @ keys.transpose(-1, -2) * scale, -1)
        out[:, i] = (p @ vals)[:, :, 0]
    return out


def test_tail_attention_reads_full_pages_quantized_and_the_unfinished_one_in_bf16(sim) -> None:
    torch.manual_seed(3)
    t, d = 150, 16  # two full pages and a partial one; two query heads on one KV head
    q, k, v = torch.randn(1, 2, t, d), torch.randn(1, 1, t, d), torch.randn(1, 1, t, d)
    k_q, v_q = k + 0.3 * torch.randn_like(k), v + 0.3 * torch.randn_like(v)
    out = sim.tail_attention(q, k, v, k_q, v_q, None, 0.25)
    torch.testing.assert_close(out, _decode_reads(q, k, v, k_q, v_q, 0.25))
    # neither all-BF16 nor all-quantized attention: the select is per (query, key)
    plain = sim.tail_attention(q, k, v, k, v, None, 0.25)
    every = sim.tail_attention(q, k_q, v_q, k_q, v_q, None, 0.25)
    assert torch.equal(out[:, :63], plain[:, :63])  # page 0 before its last token: all tail
    for row in (63, 127):  # a page just filled: every key quantized
        torch.testing.assert_close(out[:, row], every[:, row])
    for row in (64, 100, 126, 149):
        assert (out[:, row] - plain[:, row]).abs().max() > 1e-2
        assert (out[:, row] - every[:, row]).abs().max() > 1e-2


def test_reads_tail_is_the_own_page_except_its_last_token(sim) -> None:
    tail = sim.reads_tail(200)
    for i, j, expected in ((0, 0, True), (62, 0, True), (63, 0, False), (63, 63, False),
                           (64, 63, False), (64, 64, True), (130, 128, True), (127, 64, False),
                           (199, 192, True), (5, 70, False)):  # fmt: skip
        assert bool(tail[i, j]) is expected, (i, j)


def test_reads_tail_full_page_is_the_own_page_at_its_last_token_too(sim) -> None:
    tail = sim.reads_tail(200, full_page=True)
    pos = torch.arange(200)
    assert torch.equal(tail, pos[:, None] // 64 == pos[None, :] // 64)
    assert not bool(sim.reads_tail(200)[63, 0]) and bool(tail[63, 0]) and not bool(tail[64, 63])
    assert _variant(sim, "int4_tail_full_v_gD").tail_full
    assert not _variant(sim, "int4_tail_v_gD").tail_full


def _variant(sim, name: str):
    return {v.name: v for v in sim.VARIANTS}[name]


def test_tail_variants_store_the_int4_contracts_format(sim) -> None:
    x = _kv().repeat_interleave(4, dim=-1)  # D = 256, as Gemma 3
    k = _k(sim, x, "int4_tail_v_g128")
    # K: per (64-token page, channel), not rotated, the same K as the per-channel b64 row
    assert torch.equal(k, _k(sim, x, "int4_k_per_channel_b64_no_rotation"))
    # V: per (token, G channels), not rotated: the reference's groups of G, G = D for gD
    for name, g in (("int4_tail_v_g32", 32), ("int4_tail_v_g128", 128), ("int4_tail_v_gD", 256)):
        expected = dequantize_int4(*quantize_int4(x.float(), g)).to(x.dtype)
        assert torch.equal(sim.fake_quant(x, _variant(sim, name)), expected), name
    assert not torch.equal(
        sim.fake_quant(x, _variant(sim, "int4_tail_v_g32")),
        sim.fake_quant(x, _variant(sim, "int4_tail_v_g128")),
    )
    assert _variant(sim, "int4_tail_v_g128").tail
    assert not _variant(sim, "int4_no_tail_v_g128").tail


def test_tail_variants_bytes_are_the_contracts(sim) -> None:
    # 2 (D / 2) codes + 4 D / 64 (K scale, zero per channel per page) + 4 D / G (V's)
    for name, d, expected in (("int4_tail_v_g128", 128, 140), ("int4_tail_v_g128", 64, 72),
                              ("int4_tail_v_g128", 256, 280), ("int4_tail_v_gD", 256, 276),
                              ("int4_tail_v_g64", 256, 288), ("int4_tail_v_g32", 128, 152),
                              ("int4_tail_v_gD_sinks64_int8", 128, 140)):  # fmt: skip
        assert _variant(sim, name).bytes_per_token_head(d) == expected, (name, d)


def test_int8_sinks_store_the_first_page_per_token_in_int8(sim) -> None:
    torch.manual_seed(4)
    x = torch.randn(1, 1, 160, 256).to(torch.bfloat16)
    with_sinks = _variant(sim, "int4_tail_v_g128_sinks64_int8")
    without = _variant(sim, "int4_tail_v_g128")
    q, scale = quantize_int8(x[..., :64, :].float())
    int8 = (q.float() * scale.float()[..., None]).to(x.dtype)
    for v, k_mode in ((with_sinks.for_k(), "channel"), (with_sinks, "")):  # K, then V
        plain = without.for_k() if k_mode else without
        ours = sim.fake_quant(x, v, k_mode)
        assert torch.equal(ours[..., :64, :], int8)
        assert torch.equal(ours[..., 64:, :], sim.fake_quant(x, plain, k_mode)[..., 64:, :])


def test_tail_rows_through_a_model_keep_its_masks_and_read_the_first_page_in_bf16(sim) -> None:
    from dataclasses import replace

    ids = torch.arange(3, 3 + 130)[None] % 29 + 3
    ref, state = _logits(tiny_gemma3_config(6, 160), "sdpa", None, ids)
    # unquantized through the tail path: plain SDPA, sliding window and causal layers alike
    sim.install([replace(_variant(sim, "bf16"), tail=True)])
    ours, _ = _logits(tiny_gemma3_config(6, 160), "int8kv_sim", state, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # int4 with the tail: every position of the first page but its last reads only BF16 keys
    sim.install([_variant(sim, "int4_tail_v_g128")])
    tail, _ = _logits(tiny_gemma3_config(6, 160), "int8kv_sim", state, ids)
    torch.testing.assert_close(tail[:, :63], ref[:, :63], rtol=1e-5, atol=1e-5)
    assert (tail[:, 63] - ref[:, 63]).abs().max() > 1e-3
    assert (tail[:, 64:] - ref[:, 64:]).abs().max() > 1e-3


def test_int8_groups_scale_each_group_of_channels_on_its_own(sim) -> None:
    x = _kv()
    by_name = {v.name: v for v in sim.VARIANTS}
    # each group of 32 channels is int8 against its own absmax: the reference on [.., 2, 32]
    q, scale = quantize_int8(x.float().unflatten(-1, (2, 32)))
    expected = (q.float() * scale.float()[..., None]).flatten(-2).to(x.dtype)
    assert torch.equal(sim.fake_quant(x, by_name["int8_g32"]), expected)
    # the outlier channel no longer sets the step of the other group's channels
    err = {n: (sim.fake_quant(x, by_name[n]).float() - x.float()).pow(2).mean().item()
           for n in ("int8", "int8_g32")}  # fmt: skip
    assert err["int8_g32"] < 0.8 * err["int8"]
    # D = 64: 64 bytes and an fp16 scale per group, for K and V
    assert by_name["int8_g32"].bytes_per_token_head(64) == 2 * (64 + 4)
    assert by_name["int8_g64"].bytes_per_token_head(64) == by_name["int8"].bytes_per_token_head(64)


def test_next_token_agreement_counts_argmax_matches_and_sums_kl(sim) -> None:
    ref = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    other = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    same, kl = sim.next_token_agreement(ref, other, chunk=2)  # chunks across the positions
    assert same == 2  # the second position's argmax differs
    p, q = ref.softmax(-1), other.softmax(-1)
    assert abs(kl - (p * (p.log() - q.log())).sum().item()) < 1e-5
    assert sim.next_token_agreement(ref, ref) == (3, 0.0)


def _pages_with_a_loud_token(seed: int) -> torch.Tensor:
    """Two 64-token K pages of one kv-head, per-channel offsets, one token in each page ten times
    larger than the rest in every channel (as an attention sink's key is)."""
    torch.manual_seed(seed)
    x = torch.randn(1, 1, 128, 64) + 3 * torch.randn(1, 1, 1, 64)
    x[..., 0, :] *= 10
    x[..., 70, :] *= 10
    return x.to(torch.bfloat16)


def test_varnorm_without_quantization_round_trips_exactly(sim) -> None:
    x = _pages_with_a_loud_token(5).unflatten(-2, (2, 64))
    row, col = sim.varnorm_factors(x)
    assert not torch.equal(row, torch.ones_like(row)) and not torch.equal(col, torch.ones_like(col))
    assert torch.equal(sim.varnorm_int4(x, quantize=False).to(x.dtype), x)
    # the factors are fp16 values, so the stored tile is what the simulation divides by
    assert torch.equal(row.to(torch.float16).float(), row)
    # normalized, every row and column has a root-mean-square near 1
    n = x.float() / (row * col)
    for dim in (-1, -2):
        assert (n.pow(2).mean(dim=dim).sqrt() - 1).abs().max() < 0.05


def test_varnorm_k_is_closer_on_a_page_with_a_loud_token_and_costs_a_factor_per_token(sim) -> None:
    x = _pages_with_a_loud_token(6)
    quiet = [t for t in range(128) if t not in (0, 70)]

    def err(name: str) -> float:
        return (_k(sim, x, name) - x).float()[..., quiet, :].pow(2).mean().item()

    assert err("int4_tail_v_gD_varnorm") < 0.5 * err("int4_tail_v_gD")
    # V is stored as without the normalization
    assert torch.equal(
        sim.fake_quant(x, _variant(sim, "int4_tail_v_gD_varnorm")),
        sim.fake_quant(x, _variant(sim, "int4_tail_v_gD")),
    )
    # one fp16 row factor per (token, kv-head); the column factors are folded into the scales
    for d in (64, 128, 256):
        plain = _variant(sim, "int4_tail_v_g128").bytes_per_token_head(d)
        assert _variant(sim, "int4_tail_v_g128_varnorm").bytes_per_token_head(d) == plain + 2


def test_static_rows_are_the_references_codes_times_the_calibrated_scales(sim) -> None:
    from int8kv_kernels.reference import quantize_int8_static

    x = _kv()  # [1, 2 kv-heads, 40, 64], channel 5 an outlier
    by_name = {v.name: v for v in sim.VARIANTS}
    static = sim.StaticCalibration()
    static.record(0, x, x * 0.5)
    for name, per in (("int8_static", "head"), ("int8_static_channel", "channel")):
        assert by_name[name].static == per
        k_scale, v_scale = static.scales(0, per)
        codes = quantize_int8_static(x.float().transpose(1, 2), k_scale)
        expected = (codes.float() * k_scale).transpose(1, 2).to(x.dtype)
        assert torch.equal(sim.fake_quant(x, by_name[name], static_scale=k_scale), expected)
    with pytest.raises(ValueError, match="calibrated static scale"):
        sim.fake_quant(x, by_name["int8_static"])


def test_static_scales_are_the_calibrate_commands_absmax_over_127(sim) -> None:
    from int8kv_shim.static.file import MIN_STAT

    torch.manual_seed(0)
    a, b = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 5, 4) * 3
    b[:, 1, :, 2] = 0.0
    a[:, 1, :, 2] = 0.0  # a channel that is zero in every batch: floored, never a zero scale
    static = sim.StaticCalibration()
    static.record(3, a, -a)
    static.record(3, b, -2 * b)  # the max over batches, per (kv-head, channel)
    k_max = torch.maximum(a.abs().amax(dim=(0, 2)), b.abs().amax(dim=(0, 2)))
    v_max = torch.maximum(a.abs().amax(dim=(0, 2)), 2 * b.abs().amax(dim=(0, 2)))
    k, v = static.scales(3, "channel")
    assert k.dtype == torch.float32 and k.shape == (2, 4)
    assert torch.equal(k, (k_max.double().clamp_min(MIN_STAT) / 127).float())
    assert torch.equal(v, (v_max.double().clamp_min(MIN_STAT) / 127).float())
    assert k[1, 2] == torch.tensor(MIN_STAT / 127, dtype=torch.float32)
    k_head, _ = static.scales(3, "head")  # each head's max over its channels, for every channel
    assert torch.equal(k_head, (k_max.amax(-1, keepdim=True).double() / 127).float().expand(2, 4))
    with pytest.raises(ValueError, match="layer 0"):
        static.scales(0, "head")


def test_per_channel_static_scales_keep_small_channels_beside_an_outlier(sim) -> None:
    x = _kv()
    by_name = {v.name: v for v in sim.VARIANTS}
    static = sim.StaticCalibration()
    static.record(0, x, x)

    def err(name: str) -> float:
        scale = static.scales(0, by_name[name].static)[0]
        out = sim.fake_quant(x, by_name[name], static_scale=scale).float()
        return (out - x.float())[..., 6:].pow(2).mean().item()  # the channels after the outlier

    assert err("int8_static_channel") < err("int8_static") / 10


def test_static_variants_bytes_are_the_codes_only(sim) -> None:
    by_name = {v.name: v for v in sim.VARIANTS}
    assert by_name["int8_static"].bytes_per_token_head(256) == 512
    assert by_name["int8_static_channel"].bytes_per_token_head(64) == 128


def test_static_rows_calibrate_on_the_shipped_text_led_by_bos(sim, tmp_path, monkeypatch) -> None:
    folder = tiny_model_dir(tmp_path, with_bos=True)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(WORDS[(i * 7) % len(WORDS)] for i in range(100)))
    # as `int8kv calibrate` plans them: a last window under 16 tokens after the BOS is dropped
    windows = sim.calibration_windows(str(folder), 32, 80)
    assert [len(w) for w in windows] == [32, 32] and all(int(w[0]) == 2 for w in windows)
    assert windows[0].tolist() != windows[1].tolist()  # two documents, round-robin
    windows = sim.calibration_windows(str(folder), 16, 40)  # the windows main takes below
    calibrated = []
    run = sim.calibrate

    def spy(model, variant_ref, static, cal):
        calibrated.append([w.tolist() for w in cal])
        run(model, variant_ref, static, cal)
        assert sorted(static.k_max) == [0, 1] and static.k_max[0].shape == (1, 256)
        assert variant_ref[0].name == "bf16"  # restored after the calibration run

    monkeypatch.setattr(sim, "calibrate", spy)
    out = tmp_path / "sim.json"
    sim.main(["--model", str(folder), "--corpus", str(corpus), "--window", "16", "--windows",
              "2", "--variants", "bf16,int8_static,int8_static_channel", "--device", "cpu",
              "--calibration-tokens", "40", "--out", str(out)])  # fmt: skip
    doc = __import__("json").loads(out.read_text())
    assert calibrated == [[w.tolist() for w in windows]]
    assert doc["static_calibration"]["tokens"] == sum(len(w) for w in windows)
    assert doc["static_calibration"]["texts"] == [p.name for p in sim.calibrate_cli.default_texts()]
    assert [r["variant"] for r in doc["rows"]] == ["bf16", "int8_static", "int8_static_channel"]
    assert doc["rows"][1]["capacity_vs_bf16"] == 2.0
