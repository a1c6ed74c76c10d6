"""benchmarks/kv_quant_greedy.py: a KV-cached decode reads the cache as the whole window does."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from tiny_models import WORDS, tiny_gemma3_config, tiny_model_dir

from benchmarks import common
from benchmarks import kv_quant_greedy as greedy
from benchmarks import kv_quant_sim as sim
from benchmarks.accuracy import GREEDY_LENGTHS

PROMPT, STEPS = 30, 120  # decode positions 29..149: across the ends of pages 0 and 1


def _variant(name: str) -> sim.Variant:
    return next(v for v in sim.VARIANTS if v.name == name)


def _model(sliding_window: int, impl: str = "int8kv_sim"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # the same weights for every sliding window
    config = tiny_gemma3_config(sliding_window, 256)
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()


def _ids() -> torch.Tensor:
    return (torch.arange(PROMPT) * 7) % 29 + 3


def _decode(variant: str, sliding_window: int = 6) -> torch.Tensor:
    """[STEPS + 1, vocab] greedy decode logits of ``variant``, rows at positions PROMPT - 1 on."""
    sim.install([_variant(variant)])
    return greedy.decode_logits(_model(sliding_window), _ids(), None, STEPS)


def _window(variant: str | None, tokens: torch.Tensor, sliding_window: int = 6) -> torch.Tensor:
    """The same positions' logits of one teacher-forced pass over prompt + ``tokens``
    (``variant`` None: transformers' own SDPA, no simulation)."""
    if variant is not None:
        sim.install([_variant(variant)])
    model = _model(sliding_window, "sdpa" if variant is None else "int8kv_sim")
    ids = torch.cat([_ids(), tokens])
    with torch.inference_mode():
        return model(ids[None]).logits[0, PROMPT - 1 :]


@pytest.mark.parametrize(
    "variant", ["bf16", "int4_tail_full_v_g128", "int4_tail_full_v_g128_sinks64", "int4_tail_v_gD"]
)
def test_decode_steps_give_the_teacher_forced_windows_logits(variant: str) -> None:
    # pages, tail and sinks aligned: each step reads what the window's query at its position
    # reads, on a model whose first layer slides over 6 keys
    decoded = _decode(variant)
    tokens = decoded.argmax(-1)[:-1]
    torch.testing.assert_close(decoded, _window(variant, tokens), rtol=1e-4, atol=1e-4)


def test_decode_keeps_the_sliding_window_and_absolute_positions() -> None:
    # unquantized, the cached decode is transformers' own SDPA over the whole sequence ...
    decoded = _decode("bf16")
    tokens = decoded.argmax(-1)[:-1]
    torch.testing.assert_close(decoded, _window(None, tokens), rtol=1e-4, atol=1e-4)
    # fed the same tokens, the teacher-forced decode is the greedy one
    sim.install([_variant("bf16")])
    assert torch.equal(greedy.decode_logits(_model(6), _ids(), tokens, STEPS), decoded)
    # ... and the window matters: without it (a sliding window past the sequence) it differs
    unlimited = _window(None, tokens, sliding_window=256)
    assert (unlimited - decoded).abs().max() > 1e-3


def test_decode_reads_the_sink_page_and_the_tail_in_bf16() -> None:
    decoded = {n: _decode(n) for n in ("bf16", "int4_tail_full_v_g128",
                                       "int4_tail_full_v_g128_sinks64", "int4_tail_v_g128")}  # fmt: skip
    ref = _window(None, decoded["bf16"].argmax(-1)[:-1])
    pos = torch.arange(PROMPT - 1, PROMPT + STEPS)  # each row's position
    same = {n: torch.isclose(d, ref, rtol=1e-4, atol=1e-4).all(-1) for n, d in decoded.items()}
    # the first page in the tail: BF16 while it is the own page, its last position included
    # (the tail keeps a page its step completed) ...
    assert same["int4_tail_full_v_g128"][pos < 64].all()
    assert not same["int4_tail_full_v_g128"][pos >= 64].any()
    # ... and read back quantized at its last position when the tail drops a completed page
    assert same["int4_tail_v_g128"][pos < 63].all() and not same["int4_tail_v_g128"][pos == 63]
    # the sink page in BF16: up to the second page's end only BF16 keys are read
    assert same["int4_tail_full_v_g128_sinks64"][pos < 128].all()
    assert not same["int4_tail_full_v_g128_sinks64"][pos >= 128].any()


def test_tail_attention_takes_the_last_queries_of_the_keys() -> None:
    torch.manual_seed(3)
    t, d = 150, 16
    q, k, v = torch.randn(1, 2, t, d), torch.randn(1, 1, t, d), torch.randn(1, 1, t, d)
    k_q, v_q = k + 0.3 * torch.randn_like(k), v + 0.3 * torch.randn_like(v)
    whole = sim.tail_attention(q, k, v, k_q, v_q, None, 0.25, full_page=True)
    for first in (0, 63, 64, 140):
        part = sim.tail_attention(q[..., first:, :], k, v, k_q, v_q, None, 0.25, full_page=True)
        torch.testing.assert_close(part, whole[:, first:])
    with pytest.raises(ValueError, match="queries"):
        sim.tail_attention(q, k[..., :10, :], v, k_q, v_q, None, 0.25)


def test_catalogue_variants_follow_the_catalogues_groups() -> None:
    assert greedy.catalogue_variants(64) == [
        "bf16", "int8", "int4_tail_full_v_gD", "int4_tail_full_v_gD_sinks64"]  # fmt: skip
    assert greedy.catalogue_variants(256) == [
        "bf16", "int8_g64", "int4_tail_full_v_g128", "int4_tail_full_v_g128_sinks64"]  # fmt: skip
    for name in greedy.catalogue_variants(64) + greedy.catalogue_variants(256):
        v = _variant(name)
        if name.startswith("int4"):
            assert v.tail and v.tail_full and v.sinks == (64 if "sinks" in name else 0)
            assert v.sink_bits == 16 and v.k_mode == "channel" and not v.rotate
    assert replace(_variant("int4_tail_full_v_gD_sinks64"), name="x", sinks=0) == replace(
        _variant("int4_tail_full_v_gD"), name="x"
    )


def test_ratio_se_is_the_delta_methods() -> None:
    a, b = np.array([0.5, 1.0, 0.25, 0.0]), np.array([1.0, 1.0, 0.5, 0.5])
    r, se = greedy.ratio_se(a, b)
    assert r == pytest.approx(0.4375 / 0.75)
    resid = a - r * b
    assert se == pytest.approx(np.std(resid, ddof=1) / 2 / 0.75)
    assert greedy.ratio_se(b, b) == (1.0, 0.0)


def test_summarize_counts_prefixes_and_first_divergences() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1]]
    rows = greedy.summarize(
        {"bf16": ref, "int8": [[1, 2, 3, 4], [5, 6, 0, 8], [1, 1, 1, 1]],
         "int4": [[1, 0, 3, 4], [0, 6, 7, 8], [1, 1, 1, 1]]}, 4, "int8")  # fmt: skip
    by = {r["variant"]: r for r in rows}
    assert by["int8"]["first_divergence"] == [4, 2, 4]
    assert by["int4"]["first_divergence"] == [1, 0, 4]
    assert by["int4"]["greedy_agree"] == pytest.approx((0.25 + 0 + 1) / 3, abs=1e-6)
    assert by["int4"]["greedy_seq_agree"] == pytest.approx(1 / 3, abs=1e-6)
    assert by["int8"]["ratio_vs_versus"] == 1.0 and by["int8"]["ratio_se"] == 0.0
    assert by["int4"]["ratio_vs_versus"] == pytest.approx(1.25 / 2.5, abs=1e-4)


def test_main_writes_every_prompts_continuations_led_by_bos(tmp_path, monkeypatch) -> None:
    folder = tiny_model_dir(tmp_path, with_bos=True)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(WORDS[(i * 7) % len(WORDS)] for i in range(1100)))
    seen = []
    run = greedy.greedy_continuation

    def spy(model, prompt, tokens):
        seen.append(prompt.tolist())
        return run(model, prompt, tokens)

    monkeypatch.setattr(greedy, "greedy_continuation", spy)
    out = tmp_path / "greedy.json"
    greedy.main(["--model", str(folder), "--prompts", "2", "--tokens", "5", "--corpus",
                 str(corpus), "--out", str(out)])  # fmt: skip
    ids = common.load_corpus_ids(folder, corpus)
    every = common.make_greedy_prompts(ids, 256, GREEDY_LENGTHS, bos=2)
    assert seen[0] == every[0] and seen[4] == every[129]
    doc = json.loads(out.read_text())
    # head size 256: int8's scales per 64 channels, int4's V per 128
    assert [r["variant"] for r in doc["rows"]] == greedy.catalogue_variants(256)
    assert doc["versus"] == "int8_g64" and doc["prompts_done"] == 2 and doc["gpu"] is None
    # prompts 0 and 129 of accuracy.py's 256: BOS + 128 and 256 tokens, for each variant
    assert doc["prompt_indices"] == [0, 129] and doc["prompt_set"] == 256
    assert [len(p) for p in seen] == [129] * 4 + [257] * 4
    assert all(p[0] == 2 for p in seen)
    assert doc["rows"][0]["greedy_agree"] == 1 and doc["rows"][0]["first_divergence"] == [5, 5]
    assert all(0 <= d <= 5 for r in doc["rows"] for d in r["first_divergence"])
    assert len(doc["git_commit"]) >= 7 and doc["command"].startswith("python")


def test_prompt_indices_spread_over_the_set_and_cycle_the_lengths() -> None:
    picked = greedy.prompt_indices(256, 64)
    assert picked[:6] == [0, 5, 10, 15, 16, 21] and len(set(picked)) == 64
    assert [i % 4 for i in picked] == [k % 4 for k in range(64)]  # every length 16 times
    assert all(4 * k <= i < 4 * k + 4 for k, i in enumerate(picked))  # one per 4 consecutive
    assert greedy.prompt_indices(8, 8) == list(range(8))
    shifted = [greedy.prompt_indices(256, 64, shift=s) for s in range(4)]
    assert shifted[0] == picked and len({i for p in shifted for i in p}) == 256
    assert [i % 4 for i in shifted[2]] == [(k + 2) % 4 for k in range(64)]
    for size, num in ((256, 60), (256, 128)):
        with pytest.raises(ValueError):
            greedy.prompt_indices(size, num)


def test_gpu_same_prompts_takes_the_rows_agreement_on_the_picked_prompts() -> None:
    details = {"greedy": {"tokens": 4}, "runs": {
        "auto": {"greedy_prefix": [4, 4, 4, 4]},
        "int8": {"greedy_prefix": [4, 0, 2, 1]},
        "int4": {"greedy_prefix": [1, 3, 1, 0]},
        "failed": {"rc": 1},
    }}  # fmt: skip
    out = greedy.gpu_same_prompts(details, [0, 2], 4, "int8")
    assert set(out["rows"]) == {"auto", "int8", "int4"}
    assert out["rows"]["int8"]["greedy_agree"] == 0.75
    assert out["rows"]["int4"]["ratio_vs_versus"] == pytest.approx(0.25 / 0.75, abs=1e-4)
    with pytest.raises(ValueError, match="generated 4 tokens"):
        greedy.gpu_same_prompts(details, [0, 2], 32, "int8")
