"""CPU tests of the vLLM end-to-end tests' helpers (``e2e_support.py``): prompts, the tiny model,
the phases every GPU test asks for and the judgement against a control."""

from __future__ import annotations

import json
from pathlib import Path

import e2e_support
import pytest

from benchmarks.greedy import Comparison


def test_e2e_prompts_cover_lengths_and_share_a_prefix() -> None:
    ids = list(range(120_000))
    prompts = e2e_support.make_prompts(ids, rounds=3)
    per_round = len(e2e_support.PROMPT_LENGTHS) + len(e2e_support.SHARED_SUFFIX_LENS)
    assert len(prompts) == 3 * per_round
    assert sum(len(p) > 1024 for p in prompts) >= 15
    assert max(len(p) for p in prompts) + e2e_support.GEN_TOKENS <= e2e_support.MAX_MODEL_LEN
    n = e2e_support.SHARED_PREFIX_LEN
    prefixes = set()
    for r in range(3):
        shared = prompts[
            (r + 1) * per_round - len(e2e_support.SHARED_SUFFIX_LENS) : (r + 1) * per_round
        ]
        assert all(p[:n] == shared[0][:n] for p in shared)
        assert len({tuple(p[n:]) for p in shared}) == len(shared)
        prefixes.add(tuple(shared[0][:n]))
    assert len(prefixes) == 3  # each round shares its own prefix
    shared_rows = {
        i
        for r in range(3)
        for i in range(
            (r + 1) * per_round - len(e2e_support.SHARED_SUFFIX_LENS), (r + 1) * per_round
        )
    }
    firsts = [p[0] for i, p in enumerate(prompts) if i not in shared_rows]
    assert len(set(firsts)) == len(firsts)
    with pytest.raises(ValueError, match="corpus has"):
        e2e_support.make_prompts(ids[:40_000], rounds=3)


def test_gpu_tests_record_the_near_tie_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine the GPU tests start records NEAR_TIE_TOPK logprobs per position: the window
    was once widened to 20 in one place while the tests' phases still asked for 5, so a GPU run
    judged with top-5 (p12@t4 in tests/benchmarks/test_greedy.py)."""
    import test_tp2
    import test_vllm_e2e

    specs: list[list[dict]] = []

    def engine(name, kwargs, phases, shim, env=None):
        specs.append(phases)
        return {}

    prompts = [[1, 2, 3]]
    for dtype in ("auto", "int8", "int8_per_token_head"):
        test_vllm_e2e._tiny(engine, "tiny", prompts, dtype)
        test_vllm_e2e._smol_eager(engine, "smol", prompts, dtype)
        test_vllm_e2e._smol_eager(engine, "smol", prompts, dtype, through_cache=True)
        test_vllm_e2e._smol_graphs(engine, "smol", prompts, dtype)
        test_vllm_e2e._smol_preempt(engine, "smol", prompts, dtype)
        test_tp2._run_tp(engine, Path("tiny"), prompts, dtype, 2, monkeypatch, None)
    assert len(specs) == 18
    assert {ph["logprobs"] for phases in specs for ph in phases} == {e2e_support.NEAR_TIE_TOPK}


def test_tiny_llama_builder(tmp_path: Path) -> None:
    """The tiny GQA model folder is loadable by transformers with the shapes vLLM will see."""
    pytest.importorskip("transformers")
    tok_dir = tmp_path / "tok"
    _fake_tokenizer(tok_dir)
    out = e2e_support.build_tiny_llama(tmp_path / "tiny", tok_dir, attn_out_scale=0.5)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (8, 2, 128)
    assert cfg["hidden_size"] == 256 and cfg["num_hidden_layers"] == 4
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        k = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
        o = f.get_tensor("model.layers.0.self_attn.o_proj.weight")
    assert tuple(k.shape) == (2 * 128, 256) and str(k.dtype) == "torch.bfloat16"
    assert tuple(o.shape) == (256, 8 * 128)
    # same seed, same weights
    again = e2e_support.build_tiny_llama(tmp_path / "tiny2", tok_dir, attn_out_scale=0.5)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def _fake_tokenizer(path: Path) -> None:
    """A small byte-level BPE tokenizer folder (the real SmolLM2 one is only on the GPU host)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(300)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t1", eos_token="t2")
    fast.save_pretrained(str(path))


def test_assert_like_control_allows_slack_but_no_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))

    def cmp(identical: int, near: int, mismatch: int = 0) -> Comparison:
        c = Comparison(n=32, identical=identical)
        c.near_tie, c.mismatch = list(range(near)), list(range(near, near + mismatch))
        c.first_divergence = {i: 0 for i in range(near + mismatch)}
        return c

    control = cmp(50, 22)  # 0.694 identical; floor with SLACK 0.15: 0.544
    e2e_support.assert_like_control(cmp(40, 32), control, "ours", "control")  # 0.556
    with pytest.raises(AssertionError, match="identical, control"):
        e2e_support.assert_like_control(cmp(39, 33), control, "ours", "control")  # 0.542
    with pytest.raises(AssertionError, match="real mismatches at \\[p0@t0\\]"):
        e2e_support.assert_like_control(cmp(71, 0, 1), control, "ours", "control")
    # a comparison reported for information only asserts nothing and is recorded without a verdict
    e2e_support.report_comparison("ours", cmp(10, 62), "control", control)
    # every judgement is on disk as it is made, failed ones included
    rows = [json.loads(x) for x in (tmp_path / "logs" / "e2e_comparisons.jsonl").open()]
    assert [(r["identical"], r["real_mismatches"], r["passed"]) for r in rows] == [
        (40, 0, True),
        (39, 0, False),
        (71, 1, False),
        (10, 0, None),
    ]
    assert rows[0]["control"] == {"what": "control", "identical": 50, "prompts": 72,
                                  "tokens": 32, "real_mismatches": 0,
                                  "largest_near_tie_gap_nats": 0.0}  # fmt: skip


def test_engine_results_are_reused_only_for_the_same_spec_in_a_kept_workdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []

    def fake_child(cmd, env, timeout_s, log):
        calls.append(cmd)
        Path(cmd[-1]).write_text(json.dumps({"phases": {"ref": len(calls)}}))
        Path(log).write_text("ok")
        return 0, 1.0, ""

    monkeypatch.setattr(e2e_support.common, "run_child", fake_child)
    monkeypatch.delenv("OUT", raising=False)
    kw, phases = {"model": "m"}, [{"name": "ref"}]

    def run(**over):
        args = {"llm_kwargs": kw, "phases": phases, "shim": True, "env": None} | over
        return e2e_support.run_vllm("e", workdir=tmp_path, **args)

    monkeypatch.delenv("INT8KV_E2E_WORKDIR", raising=False)
    assert run()["phases"]["ref"] == 1
    assert run()["phases"]["ref"] == 2  # a fresh workdir per pytest process: always run
    monkeypatch.setenv("INT8KV_E2E_WORKDIR", str(tmp_path))
    got = run()
    assert got["phases"]["ref"] == 2 and got["reused"] and len(calls) == 2
    assert run(shim=False)["phases"]["ref"] == 3
    assert run(env={"INT8KV_PREFILL": "triton"})["phases"]["ref"] == 4
    assert run(llm_kwargs={"model": "n"})["phases"]["ref"] == 5
    assert run(llm_kwargs={"model": "n"})["reused"] and len(calls) == 5
