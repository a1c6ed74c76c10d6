"""CPU tests of ``benchmarks/common.py``: corpus handling, prompt logprobs, metric math,
configurations, result files.

No vLLM engine and no GPU: vLLM is only imported for its ``Logprob``/``FlatLogprobs`` containers
and argument classes (skipped where vLLM is not installed).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from fake_logprobs import softmax_logprobs, topk_arrays

from benchmarks import common

REPO = common.REPO


class _LP:
    """Stand-in for vllm.logprobs.Logprob (only ``.logprob`` is read)."""

    def __init__(self, logprob: float, rank: int | None = None) -> None:
        self.logprob = logprob
        self.rank = rank


def _prompt_logprobs_dicts(lp: np.ndarray, prompt: list[int], k: int) -> list[dict | None]:
    """What vLLM returns for a prompt, built from full (n, vocab) log-probs: None, then per
    position the actual next token (with its rank) plus the top-k."""
    out: list[dict | None] = [None]
    for pos in range(1, len(prompt)):
        row = lp[pos - 1]
        order = np.argsort(-row, kind="stable")
        tgt = prompt[pos]
        d = {int(tgt): _LP(float(row[tgt]), int(np.where(order == tgt)[0][0]) + 1)}
        for r, t in enumerate(order[:k]):
            d[int(t)] = _LP(float(row[t]), r + 1)
        out.append(d)
    return out


def test_corpus_is_the_recorded_file() -> None:
    path = REPO / "benchmarks" / "corpus" / "pride_and_prejudice.txt"
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() in (REPO / "benchmarks/corpus/README.md").read_text()
    assert len(data) < 2 * 1024 * 1024
    text = data.decode("ascii")
    assert text.startswith("PRIDE AND PREJUDICE") and "Gutenberg" not in text


def test_make_windows_drops_tail_and_caps() -> None:
    ids = list(range(10))
    assert common.make_windows(ids, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert common.make_windows(ids, 4, max_windows=1) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError):
        common.make_windows(ids, 1)


def test_every_window_and_greedy_prompt_starts_with_the_models_bos() -> None:
    """Gemma 3 scores twice the perplexity on a chunk without <bos>: with a BOS, each window is
    BOS + window-1 consecutive corpus tokens (no corpus token lost or repeated), each prompt too."""
    ids = list(range(100, 111))
    assert common.make_windows(ids, 4, bos=2) == [[2, 100, 101, 102], [2, 103, 104, 105],
                                                   [2, 106, 107, 108]]  # fmt: skip
    prompts = common.make_greedy_prompts(list(range(100, 5100)), 8, (10, 20), bos=2)
    assert [len(p) for p in prompts] == [11, 21] * 4
    for p in prompts:
        assert p[0] == 2 and p[1:] == list(range(p[1], p[1] + len(p) - 1))
    # the BOS is the tokenizer's only when its encoding of a text starts with it (SmolLM2's not)
    assert common.bos_of(2, [2, 17, 18]) == 2
    assert common.bos_of(1, [17, 18]) is None and common.bos_of(None, [2, 17]) is None


def test_greedy_prompts_are_deterministic_slices() -> None:
    ids = list(range(5000))
    a = common.make_greedy_prompts(ids, 8, (10, 20))
    assert a == common.make_greedy_prompts(ids, 8, (10, 20))
    assert [len(p) for p in a] == [10, 20] * 4
    for p in a:  # contiguous corpus slices
        assert p == list(range(p[0], p[0] + len(p)))
    assert len({p[0] for p in a}) == 8


def test_extract_prompt_logprobs_from_dicts() -> None:
    rng = np.random.default_rng(0)
    lp = softmax_logprobs(rng.normal(size=(5, 50)) * 3)
    prompt = [7, 3, 49, 0, 11, 25]
    d = _prompt_logprobs_dicts(lp, prompt, k=4)
    tgt, ids, top = common.extract_prompt_logprobs(d, prompt, 4)
    np.testing.assert_allclose(tgt, lp[np.arange(5), prompt[1:]], rtol=1e-6)
    np.testing.assert_array_equal(ids, np.argsort(-lp, axis=1)[:, :4])
    np.testing.assert_allclose(top, -np.sort(-lp, axis=1)[:, :4], rtol=1e-6)


def test_extract_prompt_logprobs_rejects_length_mismatch() -> None:
    with pytest.raises(ValueError):
        common.extract_prompt_logprobs([None, {1: _LP(-1.0)}], [1, 2, 3], 1)


def test_extract_prompt_logprobs_from_vllm_flat_logprobs() -> None:
    pytest.importorskip("vllm")
    from vllm.logprobs import append_logprobs_for_next_position, create_prompt_logprobs

    rng = np.random.default_rng(1)
    lp = softmax_logprobs(rng.normal(size=(6, 40)) * 2)
    prompt = [1, 5, 9, 2, 33, 7, 8]
    k = 3
    for flat in (True, False):
        container = create_prompt_logprobs(flat)
        for pos in range(1, len(prompt)):  # exactly how vLLM fills it (target first, then top-k)
            row = lp[pos - 1]
            order = np.argsort(-row)[:k]
            tgt = prompt[pos]
            rank = int((row > row[tgt]).sum()) + 1
            append_logprobs_for_next_position(
                container,
                [tgt, *order.tolist()],
                [float(row[tgt]), *row[order].tolist()],
                [None] * (k + 1),
                rank,
                k,
            )
        tgt_lp, ids, top = common.extract_prompt_logprobs(container, prompt, k)
        np.testing.assert_allclose(tgt_lp, lp[np.arange(6), prompt[1:]], rtol=1e-6)
        np.testing.assert_array_equal(ids, np.argsort(-lp, axis=1)[:, :k])
        np.testing.assert_allclose(top, -np.sort(-lp, axis=1)[:, :k], rtol=1e-6)


def test_perplexity() -> None:
    assert common.perplexity(np.log(np.full(10, 0.25))) == pytest.approx(4.0)
    assert common.perplexity(np.array([0.0, 0.0])) == pytest.approx(1.0)


def test_top1_agreement() -> None:
    a = np.array([[1, 2], [3, 4], [5, 6], [7, 8]])
    b = np.array([[1, 9], [4, 3], [5, 6], [0, 7]])
    assert common.top1_agreement(a, b) == 0.5


def test_truncated_kl_is_zero_for_identical_and_close_to_exact() -> None:
    rng = np.random.default_rng(2)
    n, vocab, k = 200, 300, 20
    # peaked distributions, like a trained LM's: the top-20 hold most of the mass
    p = softmax_logprobs(rng.normal(size=(n, vocab)) * 4)
    q = softmax_logprobs(np.log(np.exp(p)) + rng.normal(size=(n, vocab)) * 0.05)
    targets = rng.integers(0, vocab, size=n)
    pi, pl, pt = topk_arrays(p, targets, k)
    qi, ql, qt = topk_arrays(q, targets, k)
    zero = common.truncated_kl(pi, pl, pt, pi, pl, pt, targets)
    np.testing.assert_allclose(zero, 0.0, atol=1e-9)
    est = common.truncated_kl(pi, pl, pt, qi, ql, qt, targets)
    exact = (np.exp(p) * (p - q)).sum(axis=1)
    assert np.all(est >= 0)
    # coarse-graining keeps it below the exact KL (up to the imputation), and close to it
    assert est.mean() <= exact.mean() * 1.05
    assert est.mean() >= exact.mean() * 0.5


def test_truncated_kl_two_point_distribution_is_exact() -> None:
    # vocab of 3, k = 2: S + the rest bucket covers everything -> exact KL
    p = np.log(np.array([[0.7, 0.2, 0.1]]))
    q = np.log(np.array([[0.6, 0.3, 0.1]]))
    targets = np.array([2])
    pi, pl, pt = topk_arrays(p, targets, 2)
    qi, ql, qt = topk_arrays(q, targets, 2)
    est = common.truncated_kl(pi, pl, pt, qi, ql, qt, targets)
    exact = float((np.exp(p) * (p - q)).sum())
    assert est[0] == pytest.approx(exact, rel=1e-9)


def test_truncated_kl_imputes_tokens_missing_from_q() -> None:
    # P's 2nd token falls out of Q's top-2: its q is taken as Q's 2nd value (an upper bound)
    p = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    q = np.log(np.array([[0.5, 0.1, 0.35, 0.05]]))
    targets = np.array([0])
    pi, pl, pt = topk_arrays(p, targets, 2)
    qi, ql, qt = topk_arrays(q, targets, 2)
    est = common.truncated_kl(pi, pl, pt, qi, ql, qt, targets)[0]
    q_imp = 0.35  # Q's 2nd largest
    expected = 0.5 * math.log(0.5 / 0.5) + 0.3 * math.log(0.3 / q_imp)
    p_rest, q_rest = 1 - 0.8, max(1 - 0.5 - q_imp, 1e-12)
    expected += p_rest * math.log(p_rest / q_rest)
    assert est == pytest.approx(max(expected, 0.0), rel=1e-9)


def test_greedy_agreement() -> None:
    ref = [[1, 2, 3, 4], [1, 2, 3, 4], [9, 9, 9, 9]]
    other = [[1, 2, 3, 4], [1, 2, 0, 4], [8, 9, 9, 9]]
    tok, seq = common.greedy_agreement(ref, other, 4)
    assert tok == pytest.approx((1 + 0.5 + 0) / 3)  # common prefix only: pos 3 of #2 not counted
    assert seq == pytest.approx(1 / 3)
    assert common.greedy_agreement(ref, ref, 4) == (1.0, 1.0)
    assert common.greedy_agreement(ref, other, 2) == (pytest.approx(2 / 3), pytest.approx(2 / 3))
    assert common.greedy_prefix_fractions(ref, other, 4).tolist() == [1.0, 0.5, 0.0]
    assert common.greedy_prefix_fractions(ref, [[1, 2], [1], [9]], 4).tolist() == [0.5, 0.25, 0.25]


def test_paired_mean_diff_and_standard_error() -> None:
    a, b = np.array([1.0, 0.5, 0.0, 1.0]), np.array([1.0, 1.0, 0.0, 0.5])
    diff, se = common.paired_mean_diff(a, b)  # differences 0, -0.5, 0, 0.5
    assert diff == 0.0 and se == pytest.approx(math.sqrt(0.5 / 3) / 2)
    assert common.standard_error(np.array([2.0, 4.0])) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least two"):
        common.standard_error(np.array([1.0]))
    with pytest.raises(ValueError, match="differ in shape"):
        common.paired_mean_diff(a, b[:3])


def test_validate_accuracy_rejects_extra_and_missing_keys() -> None:
    row = {"label": "int8", "kv_cache_dtype": "int8", "prefill": "pages", "ppl": 10.0,
           "dppl_pct": 0.1, "dppl_se_pct": None, "top1_agree": None, "kld": None,
           "greedy_agree": 1.0, "greedy_agree_se": 0.01, "kv_cache_tokens": 100}  # fmt: skip
    good = {"model": "m", "corpus": "c", "tokens": 5, "rows": [row]}
    common.validate_accuracy(good)
    for bad in (
        {**good, "extra": 1},
        {k: v for k, v in good.items() if k != "tokens"},
        {**good, "rows": [{**row, "seq": 1.0}]},
        {**good, "rows": [{**row, "ppl": None}]},
        {**good, "rows": [{**row, "greedy_agree": float("nan")}]},
        {**good, "rows": [{**row, "prefill": "flash"}]},
        {**good, "rows": [{**row, "kv_cache_tokens": 1.5}]},
        {**good, "rows": [row, row]},
        {**good, "tokens": 5.0},
    ):
        with pytest.raises(ValueError):
            common.validate_accuracy(bad)


def test_validate_throughput() -> None:
    row = {
        "dtype": "int8",
        "ctx": 1024,
        "num_prompts": 3,
        "output_len": 256,
        "gen_tok_s": 123.4,
        "kv_cache_tokens": 1000,
    }
    good = {"gpu": "g", "command": "c", "model": "m", "rows": [row]}
    common.validate_throughput(good)
    with pytest.raises(ValueError):
        common.validate_throughput({**good, "settings": {}})
    with pytest.raises(ValueError):
        common.validate_throughput({**good, "rows": [{**row, "ctx": "1K"}]})


def test_merge_rows_replaces_by_key() -> None:
    old = [{"dtype": "a", "ctx": 1, "v": 1}, {"dtype": "b", "ctx": 1, "v": 2}]
    new = [{"dtype": "b", "ctx": 1, "v": 3}, {"dtype": "b", "ctx": 8, "v": 4}]
    got = common.merge_rows(old, new, ("dtype", "ctx"))
    assert got == [
        {"dtype": "a", "ctx": 1, "v": 1},
        {"dtype": "b", "ctx": 1, "v": 3},
        {"dtype": "b", "ctx": 8, "v": 4},
    ]


def test_write_json_copies_to_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    written = common.write_json({"a": 1}, tmp_path / "res" / "x.json")
    assert [p.name for p in written] == ["x.json", "x.json"]
    assert json.loads((out / "x.json").read_text()) == common.stamp({"a": 1})


def test_configs_and_child_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INT8KV_SHIM", "1")
    assert "INT8KV_SHIM" not in common.child_env("auto_fa2")
    assert common.child_env("auto_fa2", shim_everywhere=True)["INT8KV_SHIM"] == "1"
    assert common.child_env("int8")["INT8KV_SHIM"] == "1"
    assert common.llm_kwargs_for("int8") == {"kv_cache_dtype": "int8"}
    assert common.llm_kwargs_for("int4") == {"kv_cache_dtype": "int4"}
    assert common.llm_kwargs_for("int8_per_token_head")["attention_backend"] == "TRITON_ATTN"
    fa2 = common.llm_kwargs_for("auto_fa2")["attention_config"]
    assert fa2 == {"backend": "FLASH_ATTN", "flash_attn_version": 2}


def test_vllm_accepts_the_benchmark_settings() -> None:
    """The LLM(...) arguments we pass exist in the installed vLLM (engine creation needs a GPU)."""
    pytest.importorskip("vllm")
    import dataclasses

    from vllm.config import AttentionConfig
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    used = {
        "kv_cache_dtype",
        "attention_backend",
        "attention_config",
        "max_logprobs",
        "num_gpu_blocks_override",
        "enable_prefix_caching",
        "max_num_batched_tokens",
        "max_num_seqs",
        "max_model_len",
        "gpu_memory_utilization",
        "enforce_eager",
        "seed",
        "disable_log_stats",
    }
    assert used <= fields, used - fields
    for label in common.CONFIGS:
        kw = common.llm_kwargs_for(label)
        if "attention_config" in kw:
            AttentionConfig(**kw["attention_config"])
        if "attention_backend" in kw:
            AttentionConfig.validate_backend_before(kw["attention_backend"])


def test_int8_static_rows_calibrate_once_per_v_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def fake_child(argv, env, timeout_s, log_path):
        argv = list(argv)
        calls.append(argv)
        assert env["INT8KV_SHIM"] == "1" and argv[1:4] == ["-m", "int8kv_shim.cli", "calibrate"]
        Path(argv[argv.index("--out") + 1]).write_text("{}")
        return 0, 1.0, "wrote"

    monkeypatch.setattr(common, "run_child", fake_child)
    assert common.ensure_scales("int8", "m", tmp_path, tmp_path) == (None, {})
    path, info = common.ensure_scales("int8_static_e4m3", "m", tmp_path, tmp_path)
    assert path == tmp_path / "int8kv_scales_e4m3.json" and info["calibrate_rc"] == 0
    assert calls[0][calls[0].index("--v-format") + 1] == "e4m3"
    assert common.ensure_scales("int8_static_e4m3", "m", tmp_path, tmp_path)[0] == path
    assert len(calls) == 1  # the file exists now: no second calibration
    env = common.child_env("int8_static_e4m3", scales=path)
    assert env["INT8KV_SCALES"] == str(path) and env["INT8KV_SHIM"] == "1"
    assert common.llm_kwargs_for("int8_static_e4m3") == {"kv_cache_dtype": "int8_static"}

    monkeypatch.setattr(common, "run_child", lambda *a: (1, 1.0, "ValueError: no GPU"))
    path, info = common.ensure_scales("int8_static", "m", tmp_path, tmp_path)
    assert path is None and info["calibrate_error"] == "ValueError: no GPU"


def test_ppl_delta_standard_error() -> None:
    rng = np.random.default_rng(0)
    ref = rng.normal(-3.0, 1.0, 40_000)
    same = ref.copy()
    # identical runs: zero difference, zero error
    assert common.ppl_delta_se_pct(ref, same, 40) == 0.0
    # independent per-token noise of sd 0.05 nats: SE of the mean difference = 0.05 / sqrt(40000)
    noisy = ref + rng.normal(0.0, 0.05, ref.size)
    se = common.ppl_delta_se_pct(ref, noisy, 40)
    assert 0.7 * 0.025 < se < 1.3 * 0.025  # percent points
    with pytest.raises(ValueError):
        common.ppl_delta_se_pct(ref, noisy, 1)


def test_config_env_reaches_only_its_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INT8KV_PREFILL", raising=False)
    assert common.llm_kwargs_for("int8_prefill_triton") == {"kv_cache_dtype": "int8"}
    assert common.child_env("int8_prefill_triton")["INT8KV_PREFILL"] == "triton"
    assert "INT8KV_PREFILL" not in common.child_env("int8")
    monkeypatch.delenv("INT8KV_DIRECT_LAUNCH", raising=False)
    assert common.child_env("int8_kernel_grid")["INT8KV_DIRECT_LAUNCH"] == "0"
    assert "INT8KV_DIRECT_LAUNCH" not in common.child_env("int8")
    # every int4 row names both of int4's switches: a label means the same settings whatever
    # the shipped defaults and whatever the caller's environment says
    monkeypatch.setenv("INT8KV_INT4_SINK_PAGE", "1")
    monkeypatch.setenv("INT8KV_INT4_TAIL_PAGES", "1")
    settings = {
        "int4": ("1", "2"),
        "int4_sink_page_tail2": ("1", "2"),
        "int4_tail1": ("0", "1"),
        "int4_sink_page": ("1", "1"),
        "int4_tail2": ("0", "2"),
    }
    for label, (sink, pages) in settings.items():
        assert common.llm_kwargs_for(label) == {"kv_cache_dtype": "int4"}
        env = common.child_env(label)
        assert (env["INT8KV_INT4_SINK_PAGE"], env["INT8KV_INT4_TAIL_PAGES"]) == (sink, pages)
    assert common.config_for("int4") == common.config_for("int4_sink_page_tail2")
    # and int4's default is what the shim does with neither variable set
    from int8kv_shim.environment_variables import int4_sink_page_enabled, int4_tail_pages

    assert (int4_sink_page_enabled({}), int4_tail_pages({})) == (True, 2)


def test_results_are_copied_into_out_overwriting_but_never_onto_themselves(tmp_path, monkeypatch):
    out = tmp_path / "out"
    doc = tmp_path / "results" / "r.json"
    monkeypatch.delenv("OUT", raising=False)
    assert common.write_json({"a": 1}, doc) == [doc] and common.copy_to_out(doc) is None
    monkeypatch.setenv("OUT", str(out))
    assert common.write_json({"a": 2}, doc) == [doc, out / "r.json"]
    common.write_json({"a": 3}, doc)  # a later save (kernels.py saves after every row)
    assert json.loads((out / "r.json").read_text()) == common.stamp({"a": 3})
    assert common.copy_to_out(out / "r.json") is None  # already in $OUT


def test_command_line_of_a_module_run(monkeypatch: pytest.MonkeyPatch) -> None:
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="benchmarks.accuracy")
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [str(common.BENCH_DIR / "accuracy.py"), "--dtypes", "int8"])
    assert common.command_line() == "python -m benchmarks.accuracy --dtypes int8"
    main.__spec__ = None  # run by its path
    assert common.command_line() == "python benchmarks/accuracy.py --dtypes int8"
    # an argument with spaces is quoted, so the recorded line runs as written
    monkeypatch.setattr(sys, "argv", ["x", "--model-name", "Gemma 3 270M", "--windows", "5"])
    main.__spec__ = types.SimpleNamespace(name="benchmarks.kv_quant_sim")
    line = common.command_line()
    assert line == "python -m benchmarks.kv_quant_sim --model-name 'Gemma 3 270M' --windows 5"


def test_children_find_the_package_from_any_folder(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = common.module_command("benchmarks.greedy")
    assert argv[:2] == [sys.executable, "-m"]
    ran = subprocess.run(argv, cwd=tmp_path, env=common.with_repo_on_path(env), capture_output=True)
    assert ran.returncode == 0, ran.stderr
    assert subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True).returncode != 0
    env["PYTHONPATH"] = "/elsewhere"
    assert common.with_repo_on_path(env)["PYTHONPATH"] == f"{REPO}{os.pathsep}/elsewhere"


def test_write_json_stamps_the_date_and_commit_unless_the_document_has_them(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    common.write_json({"a": 1}, path)
    doc = json.loads(path.read_text())
    assert doc == {"a": 1, "date": doc["date"], "git_commit": common.git_commit()}
    assert doc["date"] == datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    kept = {"a": 2, "date": "2001-02-03", "git_commit": "abc"}
    common.write_json(kept, path)
    assert json.loads(path.read_text()) == kept


def test_git_commit_marks_changed_tracked_files_dirty(tmp_path: Path) -> None:
    assert common.git_commit(tmp_path) == "unknown"  # not a checkout
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, env=env, check=True,
                              capture_output=True, text=True).stdout.strip()  # fmt: skip

    git("init", "-q")
    (tmp_path / "f.txt").write_text("1")
    git("add", "f.txt")
    git("commit", "-q", "-m", "one")
    head = git("rev-parse", "HEAD")
    assert re.fullmatch("[0-9a-f]{40}", head) and common.git_commit(tmp_path) == head
    (tmp_path / "new.txt").write_text("untracked")  # untracked files do not count
    assert common.git_commit(tmp_path) == head
    (tmp_path / "f.txt").write_text("2")
    assert common.git_commit(tmp_path) == head + "-dirty"


def test_git_commit_can_be_told_the_tree_s_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    told = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("INT8KV_GIT_COMMIT", told)
    assert common.git_commit() == told
    assert common.stamp({})["git_commit"] == told
    monkeypatch.setenv("INT8KV_GIT_COMMIT", "not-a-hash")  # ignored: the checkout's own
    assert common.git_commit() != "not-a-hash"


def test_shim_switches_are_the_int8kv_variables_sorted() -> None:
    env = {
        "INT8KV_PREFILL": "triton",
        "PATH": "/bin",
        "INT8KV_INT4_SINK_PAGE": "0",
        "XINT8KV_A": "1",
    }
    assert common.shim_switches(env) == {"INT8KV_INT4_SINK_PAGE": "0", "INT8KV_PREFILL": "triton"}
    assert list(common.shim_switches(env)) == ["INT8KV_INT4_SINK_PAGE", "INT8KV_PREFILL"]
