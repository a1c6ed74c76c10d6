"""CPU tests of ``benchmarks/accuracy.py``: its rows from the workers' arrays, and ``main`` end to end
with the per-dtype engine processes faked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fake_logprobs import softmax_logprobs, topk_arrays

from benchmarks import accuracy, common


def test_compute_rows_reference_first_and_schema() -> None:
    rng = np.random.default_rng(3)
    n, vocab, k = 50, 64, 5
    targets = rng.integers(0, vocab, size=n)

    def result(noise: float) -> dict[str, np.ndarray]:
        lp = softmax_logprobs(
            rng.normal(size=(n, vocab)) * 0 + base + noise * rng.normal(size=(n, vocab))
        )
        ids, top, tgt = topk_arrays(lp, targets, k)
        return {
            "target_lp": tgt.astype(np.float32),
            "top_ids": ids.astype(np.int32),
            "top_lp": top.astype(np.float32),
            "greedy": np.arange(64, dtype=np.int32).reshape(2, 32),
        }

    base = rng.normal(size=(n, vocab)) * 3
    res = {"auto": result(0.0), "int8": result(0.01)}
    res["int8"]["greedy"] = res["int8"]["greedy"].copy()
    res["int8"]["greedy"][1, 16] = -1
    runs = {"int8": {"int8kv_prefill": "triton", "kv_cache_tokens": 2000},
            "auto": {"kv_cache_tokens": 1000}}  # fmt: skip
    rows, extras = accuracy.compute_rows(res, "auto", targets, 32, runs=runs)
    assert [r["label"] for r in rows] == ["auto", "int8"]
    assert rows[0]["top1_agree"] == 1.0 and rows[0]["kld"] == 0.0 and rows[0]["greedy_agree"] == 1.0
    assert rows[1]["greedy_agree"] == pytest.approx(0.75)
    assert extras["int8"]["greedy_seq_agree"] == 0.5
    assert extras["int8"]["greedy_prefix"] == [32, 16]
    assert rows[1]["greedy_agree_se"] == pytest.approx(0.25)  # fractions 1 and 0.5
    assert "greedy_vs_int8_per_token_head" not in extras["int8"]  # that row did not run
    assert rows[0]["dppl_pct"] == 0.0 and rows[1]["dppl_pct"] != 0.0
    assert [(r["prefill"], r["kv_cache_tokens"]) for r in rows] == [
        ("pages", 1000),
        ("pages", 2000),
    ]
    # a row of ours that did not run with INT8KV_PREFILL=triton did not read the pages
    rows, _ = accuracy.compute_rows(res, "auto", targets, 32, runs={"int8": {}})
    assert rows[1]["prefill"] == "bf16" and rows[1]["kv_cache_dtype"] == "int8"
    # with the row to compare with: each other row's mean difference, prompt by prompt
    res["int8_per_token_head"] = result(0.02)
    res["int8_per_token_head"]["greedy"] = res["auto"]["greedy"].copy()
    res["int8_per_token_head"]["greedy"][:, 8] = -1  # both prompts diverge at token 8
    rows, extras = accuracy.compute_rows(res, "auto", targets, 32)
    vs = extras["int8"]["greedy_vs_int8_per_token_head"]
    assert vs["diff"] == pytest.approx((1 + 0.5) / 2 - 0.25) and vs["se"] == pytest.approx(0.25)
    assert "greedy_vs_int8_per_token_head" not in extras["int8_per_token_head"]
    assert "greedy_vs_int8_per_token_head" not in extras["auto"]
    doc = {"model": "m", "corpus": "c", "tokens": n, "rows": rows, "gpu": "g", "command": "x"}
    common.validate_accuracy(json.loads(json.dumps(doc)))


def _fake_accuracy_child(fail: set[str]):
    """Stand-in for ``common.run_child`` that writes what an accuracy worker would."""

    def run(argv, env, timeout_s, log_path):
        argv = list(argv)
        label = argv[argv.index("--label") + 1]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if label in fail:
            log_path.write_text("Traceback ...\nValueError: unsupported kv cache dtype\n")
            return 1, 0.1, log_path.read_text()
        inputs = json.loads(Path(argv[argv.index("--inputs") + 1]).read_text())
        k = int(argv[argv.index("--logprobs") + 1])
        rng = np.random.default_rng(0)  # same "model" for every dtype ...
        base = rng.normal(size=(1, 64)) * 3
        parts = []
        for w in inputs["windows"]:
            noise = 0.0 if label == "auto" else 0.02  # ... plus a little cache noise
            lp = softmax_logprobs(base + noise * rng.normal(size=(len(w) - 1, 64)))
            ids, top, tgt = topk_arrays(lp, np.asarray(w[1:]) % 64, k)
            parts.append((tgt, ids, top))
        greedy = np.tile(np.arange(4, dtype=np.int32), (len(inputs["greedy_prompts"]), 1))
        np.savez(
            argv[argv.index("--result") + 1],
            target_lp=np.concatenate([p[0] for p in parts]).astype(np.float32),
            top_ids=np.concatenate([p[1] for p in parts]).astype(np.int32),
            top_lp=np.concatenate([p[2] for p in parts]).astype(np.float32),
            greedy=greedy,
            meta=np.array(json.dumps({"label": label, "kv_cache_tokens": 1000,
                                      "int8kv_prefill": env.get("INT8KV_PREFILL", "")})),
        )  # fmt: skip
        ours = label not in ("auto", "int8_per_token_head")
        assert ("INT8KV_SHIM" in env) == ours
        # every row of ours reads the pages but the one that asks for the BF16 prefill
        assert (env.get("INT8KV_PREFILL") == "triton") == (ours and "bf16_prefill" not in label)
        return 0, 0.1, "done"

    return run


def test_accuracy_main_end_to_end_with_faked_engines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(accuracy.common, "load_corpus_ids", lambda m, c: list(range(3000)))
    monkeypatch.setattr(accuracy.common, "tokenizer_bos", lambda m: 7)
    monkeypatch.setattr(accuracy.common, "run_child", _fake_accuracy_child({"int4"}))
    monkeypatch.setattr(accuracy.common, "gpu_name", lambda: "FakeGPU")
    out = tmp_path / "res" / "accuracy.json"
    rc = accuracy.main(
        [
            "--model",
            str(tmp_path),
            "--dtypes",
            "auto,int8_per_token_head,int8,int8_bf16_prefill,int4",
            "--window",
            "256",
            "--min-scored",
            "1000",
            "--logprobs",
            "4",
            "--greedy-prompts",
            "6",
            "--greedy-tokens",
            "4",
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "w"),
        ]
    )
    assert rc == 1  # int4 failed, the rest is still written
    doc = json.loads(out.read_text())
    common.validate_accuracy(doc)
    labels = [r["label"] for r in doc["rows"]]
    assert labels == ["auto", "int8_per_token_head", "int8", "int8_bf16_prefill"]
    assert [r["prefill"] for r in doc["rows"]] == ["pages", "pages", "pages", "bf16"]
    # 3000 corpus tokens in windows of BOS + 255: 11 windows, 255 scored each
    assert doc["tokens"] == 11 * 255 and doc["gpu"] == "FakeGPU" and doc["bos"] == 7
    inputs = json.loads((tmp_path / "w" / "inputs.json").read_text())
    assert all(w[0] == 7 for w in inputs["windows"] + inputs["greedy_prompts"])
    assert doc["rows"][0]["kld"] == 0.0 and doc["rows"][1]["kld"] > 0
    details = json.loads((out.parent / "accuracy_details.json").read_text())
    assert "unsupported kv cache dtype" in details["runs"]["int4"]["error"]
    assert details["runs"]["int8"]["kv_cache_tokens"] == 1000


def test_accuracy_merge_rows_adds_missing_dtypes_only_under_the_same_reference() -> None:
    def doc(rows, command):
        return {"model": "m", "corpus": "c", "tokens": 10, "gpu": "g", "command": command,
                "rows": [{"label": d, "ppl": p} for d, p in rows]}  # fmt: skip

    new = doc([("auto", 20.0), ("int8", 20.1), ("int4", 21.0)], "new")
    old = doc([("auto", 20.0), ("int8", 20.3), ("int8_static", 20.5)], "old")
    old["transformers_ppl"] = 19.9  # a result of the old run alone
    runs = {"runs": {"auto": {"rc": 0}, "int8": {"rc": 0, "run": "new"}, "int4": {"rc": 0}}}
    old_runs = {"runs": {"auto": {}, "int8": {"run": "old"}, "int8_static": {"run": "old"},
                         "transformers": {"ppl": 19.9}}}  # fmt: skip
    merged, details = accuracy.merge_rows(new, runs, old, old_runs)
    # the new run's int8 row wins in the old file's order; int4, new, comes after int8
    assert [(r["label"], r["ppl"]) for r in merged["rows"]] == [
        ("auto", 20.0), ("int8", 20.1), ("int4", 21.0), ("int8_static", 20.5)
    ]  # fmt: skip
    assert merged["command"] == "old ; new"
    assert (
        details["runs"]["int8"]["run"] == "new" and details["runs"]["int8_static"]["run"] == "old"
    )
    assert merged["transformers_ppl"] == 19.9 and details["runs"]["transformers"] == {"ppl": 19.9}
    # the old run's date and commit stay on record beside the new run's
    stamped = accuracy.merge_rows(
        {**new, "date": "d2", "git_commit": "b" * 40}, runs,
        {**old, "date": "d1", "git_commit": "a" * 40}, old_runs,
    )[0]  # fmt: skip
    assert stamped["git_commit"] == "b" * 40
    assert stamped["parts"] == [{"date": "d1", "git_commit": "a" * 40}]
    # another reference value, or another corpus: the rows would not compare
    with pytest.raises(ValueError, match="reference rows differ"):
        accuracy.merge_rows(new, runs, doc([("auto", 20.01)], "old"), old_runs)
    with pytest.raises(ValueError, match="corpus differs"):
        accuracy.merge_rows(new, runs, {**old, "corpus": "other"}, old_runs)
    # greedy agreement over other prompts (256 now, 64 in older files) is another measurement
    greedy = {"prompts": 256, "lengths": [128], "tokens": 32}
    with pytest.raises(ValueError, match="greedy prompts differ"):
        accuracy.merge_rows(
            new, {**runs, "greedy": greedy}, old, {**old_runs, "greedy": greedy | {"prompts": 64}}
        )
    both = accuracy.merge_rows(new, {**runs, "greedy": greedy}, old, {**old_runs, "greedy": greedy})
    assert both[1]["greedy"] == greedy


@pytest.mark.parametrize(
    "path", sorted(common.RESULTS_DIR.glob("accuracy*.json")), ids=lambda p: p.name
)
def test_committed_accuracy_headline_rows_read_the_cache(path: Path) -> None:
    """A quantized dtype's headline row (label = dtype) must have been measured through the pages:
    on the FlashAttention-2 prefill most scored tokens never read the quantized cache."""
    if path.name.endswith("_details.json"):
        pytest.skip("details file")
    doc = json.loads(path.read_text())
    common.validate_accuracy(doc)
    for row in doc["rows"]:
        if row["label"] == row["kv_cache_dtype"] or row["kv_cache_dtype"] == "auto":
            assert row["prefill"] == "pages", f"{path.name}: {row['label']} did not read the cache"
        if row["label"].endswith(accuracy.BF16_PREFILL_SUFFIX):
            assert row["prefill"] == "bf16", f"{path.name}: {row['label']} is mislabelled"


@pytest.mark.parametrize("chunk", [16, 512, 1024])
def test_chunking_caps_each_window_at_the_chunk_and_vllm_accepts_it(chunk: int) -> None:
    settings = accuracy.chunking(chunk)
    assert settings["long_prefill_token_threshold"] == chunk
    # a step holds a chunk of several windows when they are small, and one whole chunk always
    assert settings["max_num_batched_tokens"] >= max(chunk, accuracy.STEP_TOKENS)
    assert settings["max_num_batched_tokens"] >= settings["max_num_seqs"]
    SchedulerConfig = pytest.importorskip("vllm.config").SchedulerConfig
    config = SchedulerConfig(**settings, max_model_len=2049, is_encoder_decoder=False)
    assert config.long_prefill_token_threshold == chunk
