"""Helpers shared by the benchmark scripts (``python -m benchmarks.NAME``) and the e2e tests.

Everything here is importable without vLLM or a GPU (the metric math and JSON handling are unit
tested on CPU in ``tests/benchmarks/test_common.py``); vLLM is only imported inside the functions
that need an engine.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "benchmarks"
RESULTS_DIR = BENCH_DIR / "results"
DEFAULT_CORPUS = BENCH_DIR / "corpus" / "pride_and_prejudice.txt"

# (q_heads, kv_heads, head_dim) of the kernel benchmarks: a Llama-3-8B-like GQA model, a
# Qwen2-7B-like one, SmolLM2-135M's (the first real model of the end-to-end runs), Gemma 3 270M's
# (head size 256 on one KV head: the second) and a 256-wide GQA shape (Gemma-class models).
MODEL_SHAPES = [(32, 8, 128), (28, 4, 128), (9, 3, 64), (4, 1, 256), (16, 8, 256)]

SHIM_ENV = "INT8KV_SHIM"
SCALES_ENV = "INT8KV_SCALES"


def _int4_env(sink: bool, tail_pages: int) -> dict[str, str]:
    """The environment of an ``int4`` row: its sink page on or off, its tail pages (1 or 2)."""
    return {
        "INT8KV_INT4_SINK_PAGE": "1" if sink else "0",
        "INT8KV_INT4_TAIL_PAGES": str(tail_pages),
    }


# How each row label of the benchmarks maps onto vLLM arguments.
#
# - Upstream configurations run WITHOUT the shim (``shim=False``), so their rows are plain vLLM
#   0.24.0 numbers, not "vLLM as patched by us"; pass ``--shim-everywhere`` to the scripts to check
#   that activating the shim leaves them unchanged.
# - The GPU bundle has no FlashAttention-3 (Hopper's default), so BF16 on the H200 must name its
#   backend: FA2 (vLLM's BF16 default on Ampere) or TRITON_ATTN (the backend upstream's
#   int8_per_token_head runs on, which makes auto-vs-int8_per_token_head a pure KV-format
#   comparison). ``auto`` is the accuracy baseline and uses TRITON_ATTN for that reason.
# - Our dtypes pass no backend: the shim's plugin must select our CUSTOM backend by itself, which is
#   part of what is being tested.
CONFIGS: dict[str, dict[str, Any]] = {
    "auto": {"kv_cache_dtype": "auto", "attention_backend": "TRITON_ATTN", "shim": False},
    "auto_triton": {"kv_cache_dtype": "auto", "attention_backend": "TRITON_ATTN", "shim": False},
    "auto_fa2": {
        "kv_cache_dtype": "auto",
        "attention_config": {"backend": "FLASH_ATTN", "flash_attn_version": 2},
        "shim": False,
    },
    "int8_per_token_head": {
        "kv_cache_dtype": "int8_per_token_head",
        "attention_backend": "TRITON_ATTN",
        "shim": False,
    },
    "int8": {"kv_cache_dtype": "int8", "shim": True},
    # every token through the quantized pages, prefills too (int8kv_shim/flash_prefill.py)
    "int8_prefill_triton": {
        "kv_cache_dtype": "int8",
        "shim": True,
        "env": {"INT8KV_PREFILL": "triton"},
    },
    # int8 with every kernel launched through Triton's kernel[grid](...): the A/B of
    # kernels/launch.py's direct launches in one run (host-bound at 1K context)
    "int8_kernel_grid": {
        "kv_cache_dtype": "int8",
        "shim": True,
        "env": {"INT8KV_DIRECT_LAUNCH": "0"},
    },
    # int8_static rows need a calibration file (``ensure_scales`` makes one per V format).
    "int8_static": {"kv_cache_dtype": "int8_static", "shim": True, "v_format": "int8"},
    "int8_static_e4m3": {"kv_cache_dtype": "int8_static", "shim": True, "v_format": "e4m3"},
    # int4 rows set both of its switches, so that a label keeps its meaning whatever the shipped
    # defaults and the caller's environment: "int4" is the default, its first page (sink) and its
    # two newest pages in the model's dtype (int8kv_shim/sink_pages.py, tail_slots.py)
    "int4": {"kv_cache_dtype": "int4", "shim": True, "env": _int4_env(sink=True, tail_pages=2)},
    # the default of 2026-12-05 and before: the newest page only, no sink page
    "int4_tail1": {"kv_cache_dtype": "int4", "shim": True, "env": _int4_env(False, 1)},
    "int4_sink_page": {"kv_cache_dtype": "int4", "shim": True, "env": _int4_env(True, 1)},
    "int4_tail2": {"kv_cache_dtype": "int4", "shim": True, "env": _int4_env(False, 2)},
    # the label the default's first GPU rows were measured under (same settings as "int4")
    "int4_sink_page_tail2": {"kv_cache_dtype": "int4", "shim": True, "env": _int4_env(True, 2)},
}


def config_for(label: str) -> dict[str, Any]:
    """vLLM settings of a row label; unknown labels are taken as one of our kv-cache dtypes."""
    if label in CONFIGS:
        return dict(CONFIGS[label])
    return {"kv_cache_dtype": label, "shim": True}


def llm_kwargs_for(label: str) -> dict[str, Any]:
    """The ``LLM(...)`` keyword arguments of a row label (without the ``shim`` flag)."""
    cfg = config_for(label)
    for key in ("shim", "v_format", "env"):
        cfg.pop(key, None)
    return cfg


def child_env(
    label: str, shim_everywhere: bool = False, scales: str | Path | None = None
) -> dict[str, str]:
    """Environment for the subprocess that runs ``label``: the shim on only where it is needed,
    and ``INT8KV_SCALES`` pointing at the calibration file of an ``int8_static`` row.

    ``INT8KV_SHIM`` must be in the environment before vLLM is imported (the shim patches at import),
    which is why every configuration runs in a fresh process.
    """
    cfg = config_for(label)
    env = dict(os.environ) | cfg.get("env", {})
    if cfg["shim"] or shim_everywhere:
        env[SHIM_ENV] = "1"
    else:
        env.pop(SHIM_ENV, None)
    if scales is not None:
        env[SCALES_ENV] = str(scales)
    return env


def ensure_scales(
    label: str, model: str, workdir: Path, logdir: Path, timeout_s: float = 600
) -> tuple[Path | None, dict[str, Any]]:
    """The calibration file an ``int8_static*`` row serves with, made by ``int8kv calibrate`` (the
    shipped text, default settings) in ``workdir``: (path or None on failure, what happened).
    Rows without a ``v_format`` need none: (None, {})."""
    v_format = config_for(label).get("v_format")
    if v_format is None:
        return None, {}
    path = workdir / f"int8kv_scales_{v_format}.json"
    info: dict[str, Any] = {"scales": str(path), "v_format": v_format}
    if path.exists():
        return path, info
    cmd = [sys.executable, "-m", "int8kv_shim.cli", "calibrate", model, "--out", str(path)]
    cmd += ["--v-format", v_format]
    rc, secs, tail = run_child(
        cmd, child_env(label), timeout_s, logdir / f"calibrate_{v_format}.log"
    )
    info |= {"calibrate_rc": rc, "calibrate_s": round(secs, 1)}
    if rc != 0 or not path.exists():
        info["calibrate_error"] = "timeout" if rc == -9 else error_summary(tail)
        return None, info
    return path, info


def parse_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [t.strip() for t in text.split(",") if t.strip()]


# --------------------------------------------------------------------------------------------
# corpus


def load_corpus_ids(tokenizer_dir: str | Path, corpus: str | Path = DEFAULT_CORPUS) -> list[int]:
    """Token ids of the whole corpus, without special tokens (a model's BOS is added per scored
    sequence: :func:`tokenizer_bos`).

    Tokenized in one piece, so window boundaries later fall mid-sentence exactly as in a stream.
    """
    tok = _tokenizer(str(tokenizer_dir))
    text = Path(corpus).read_text(encoding="utf-8")
    return list(tok(text, add_special_tokens=False)["input_ids"])


def tokenizer_bos(tokenizer_dir: str | Path) -> int | None:
    """The BOS id a model's tokenizer puts in front of every text it encodes, or None when it adds
    none (SmolLM2). Gemma 3 adds ``<bos>`` and scores about twice the perplexity without it, so
    every sequence cut from the corpus must start with it, as the tokenizer would have begun it."""
    tok = _tokenizer(str(tokenizer_dir))
    return bos_of(tok.bos_token_id, tok("a")["input_ids"])


@lru_cache(maxsize=4)
def _tokenizer(tokenizer_dir: str) -> Any:
    """A model folder's tokenizer, loaded once per process (the corpus and its BOS both need it;
    Gemma 3's 262K-entry vocabulary takes seconds to load)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def bos_of(bos_token_id: int | None, encoded: Sequence[int]) -> int | None:
    """``bos_token_id`` when the tokenizer's encoding of a text (``encoded``) starts with it."""
    if bos_token_id is None or not encoded or encoded[0] != bos_token_id:
        return None
    return int(bos_token_id)


def make_windows(
    ids: Sequence[int], window: int, max_windows: int = 0, bos: int | None = None
) -> list[list[int]]:
    """Split ``ids`` into consecutive non-overlapping windows of exactly ``window`` tokens.

    With ``bos`` every window is ``[bos]`` followed by ``window - 1`` corpus tokens, so each
    starts as the model saw every sequence in training; the scored tokens (all after the first)
    are then corpus tokens only. The ragged tail is dropped so every window has the same context
    profile. ``max_windows`` > 0 keeps only the first ones.
    """
    if window < 2:
        raise ValueError("a window needs at least 2 tokens to score one")
    body = window - (bos is not None)
    n = len(ids) // body
    if max_windows > 0:
        n = min(n, max_windows)
    head = [] if bos is None else [bos]
    return [head + list(ids[i * body : (i + 1) * body]) for i in range(n)]


def make_greedy_prompts(
    ids: Sequence[int],
    num_prompts: int,
    lengths: Sequence[int],
    seed_offset: int = 0,
    bos: int | None = None,
) -> list[list[int]]:
    """``num_prompts`` corpus slices of cycling ``lengths``, spread evenly over the corpus, each
    after ``bos`` when given (see :func:`make_windows`).

    Deterministic (no RNG): the same corpus gives the same prompts on every machine.
    """
    longest = max(lengths)
    if len(ids) < longest + 1:
        raise ValueError("corpus shorter than the longest prompt")
    span = len(ids) - longest
    head = [] if bos is None else [bos]
    out = []
    for i in range(num_prompts):
        start = (seed_offset + i * span // max(num_prompts, 1)) % (span + 1)
        out.append(head + list(ids[start : start + lengths[i % len(lengths)]]))
    return out


# --------------------------------------------------------------------------------------------
# prompt logprobs -> arrays


def extract_prompt_logprobs(
    prompt_logprobs: Sequence[Mapping[int, Any] | None], prompt_ids: Sequence[int], k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Turn one request's ``RequestOutput.prompt_logprobs`` into dense arrays.

    vLLM returns, per prompt position, ``None`` for position 0 and then a dict ``token_id ->
    Logprob`` holding the top-``k`` tokens of the next-token distribution *and* the actual next
    prompt token (so ``k`` or ``k + 1`` entries). Accepts that list of dicts and vLLM's
    ``FlatLogprobs`` (``flat_logprobs=True``; indexable the same way).

    Returns ``target_lp`` (n-1,), the log-probability of each actual next token; ``top_ids``
    (n-1, k) and ``top_lp`` (n-1, k), the top-k tokens sorted by decreasing log-probability.
    """
    n = len(prompt_ids)
    if len(prompt_logprobs) != n:
        raise ValueError(f"{len(prompt_logprobs)} logprob positions for {n} prompt tokens")
    flat = _flat_arrays(prompt_logprobs, n, k)
    if flat is not None:
        return flat
    target_lp = np.empty(n - 1, dtype=np.float32)
    top_ids = np.empty((n - 1, k), dtype=np.int32)
    top_lp = np.empty((n - 1, k), dtype=np.float32)
    for pos in range(1, n):
        d = prompt_logprobs[pos]
        if d is None:
            raise ValueError(f"no logprobs at prompt position {pos}")
        tgt = prompt_ids[pos]
        target_lp[pos - 1] = _lp(d[tgt])
        # Sort by the value, not by vLLM's rank field: the target's rank is computed separately and
        # can tie with a top-k entry; the k best values are what the distribution says.
        best = sorted(d.items(), key=lambda kv: -_lp(kv[1]))[:k]
        if len(best) < k:
            raise ValueError(f"position {pos}: {len(best)} logprobs, asked for {k}")
        top_ids[pos - 1] = [t for t, _ in best]
        top_lp[pos - 1] = [_lp(v) for _, v in best]
    return target_lp, top_ids, top_lp


def _lp(v: Any) -> float:
    return float(v.logprob if hasattr(v, "logprob") else v)


def _flat_arrays(
    prompt_logprobs: Any, n: int, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Fast path for ``FlatLogprobs``: every scored position holds exactly 1 + k entries, the target
    first and then the top-k in rank order (vllm/logprobs.py ``append_logprobs_for_next_position``).
    """
    if not hasattr(prompt_logprobs, "start_indices"):
        return None
    starts = np.asarray(prompt_logprobs.start_indices[1:])
    ends = np.asarray(prompt_logprobs.end_indices[1:])
    if len(starts) != n - 1 or not np.all(ends - starts == k + 1):
        return None  # not the layout we rely on: take the generic path
    ids = np.asarray(prompt_logprobs.token_ids, dtype=np.int64)
    lps = np.asarray(prompt_logprobs.logprobs, dtype=np.float32)
    idx = starts[:, None] + np.arange(k + 1)[None, :]
    return lps[idx[:, 0]], ids[idx[:, 1:]].astype(np.int32), lps[idx[:, 1:]]


# --------------------------------------------------------------------------------------------
# metrics


def perplexity(target_lp: np.ndarray) -> float:
    """exp of the mean negative log-likelihood of the actual tokens."""
    return float(math.exp(-float(np.mean(target_lp, dtype=np.float64))))


def ppl_delta_se_pct(ref_lp: np.ndarray, lp: np.ndarray, num_blocks: int) -> float:
    """Standard error (in percent points) of ΔPPL = PPL(lp) / PPL(ref_lp) - 1, from the paired
    per-token log-likelihood differences averaged per block (the scored windows: tokens within a
    window are correlated, windows are not), so it measures how much of a ΔPPL is sampling noise."""
    d = np.asarray(ref_lp, dtype=np.float64) - np.asarray(lp, dtype=np.float64)
    if num_blocks < 2:
        raise ValueError("need at least two blocks for a standard error")
    means = np.array([b.mean() for b in np.array_split(d, num_blocks)])
    se = float(np.std(means, ddof=1) / math.sqrt(num_blocks))
    return 100 * math.exp(float(d.mean())) * se


def top1_agreement(ref_top_ids: np.ndarray, top_ids: np.ndarray) -> float:
    """Fraction of positions whose most likely next token is the same in both runs."""
    return float(np.mean(ref_top_ids[:, 0] == top_ids[:, 0]))


def truncated_kl(
    ref_ids: np.ndarray,
    ref_lp: np.ndarray,
    ref_tgt_lp: np.ndarray,
    ids: np.ndarray,
    lp: np.ndarray,
    tgt_lp: np.ndarray,
    targets: np.ndarray,
) -> np.ndarray:
    """Per-position KL(P_ref || Q) estimated from top-k prompt logprobs.

    vLLM only returns the top-k (k <= ``max_logprobs``) log-probabilities per position plus the
    actual token's, not the 49K-entry distribution. We therefore compute the KL between the two
    distributions *coarse-grained* to the outcomes S = top-k of P_ref ∪ {actual token}, plus one
    "everything else" bucket:

        KL ≈ Σ_{i∈S} p_i log(p_i / q_i) + p_rest log(p_rest / q_rest),
        p_rest = 1 - Σ_S p_i,  q_rest = 1 - Σ_S q_i.

    With exact q_i this is a lower bound on the true KL (merging outcomes never increases KL — the
    data-processing inequality) and it is tight when the top-k holds nearly all of the mass, as it
    does for a trained LM at k = 20. q_i is exact when token i is in Q's top-k or is the actual
    token; otherwise it is below Q's k-th log-probability and we use that value (an upper bound on
    q_i, so that term is slightly under-estimated). Both runs share the model and differ only in
    the KV cache, so the two top-k sets almost always coincide.

    Arrays: ``*_ids``/``*_lp`` (n, k) sorted top-k; ``*_tgt_lp`` (n,) actual-token log-probs;
    ``targets`` (n,) actual token ids. Returns (n,) non-negative float64.
    """
    ref_ids = ref_ids.astype(np.int64)
    ids = ids.astype(np.int64)
    targets = targets.astype(np.int64)[:, None]
    # q for each of P's top-k tokens: exact where Q listed it, else Q's k-th value (see above).
    match = ref_ids[:, :, None] == ids[:, None, :]  # (n, k, k)
    found = match.any(axis=2)
    q_found = np.where(match, lp[:, None, :].astype(np.float64), -np.inf).max(axis=2)
    q_floor = lp.min(axis=1, keepdims=True).astype(np.float64)
    q_top = np.where(found, q_found, q_floor)
    is_tgt = ref_ids == targets
    q_top = np.where(is_tgt, tgt_lp[:, None].astype(np.float64), q_top)
    p_top = ref_lp.astype(np.float64)
    # The actual token joins S when it is outside P's top-k (its p and q are both exact).
    tgt_extra = ~is_tgt.any(axis=1)
    p_t = np.where(tgt_extra, np.exp(ref_tgt_lp.astype(np.float64)), 0.0)
    q_t = np.where(tgt_extra, np.exp(tgt_lp.astype(np.float64)), 0.0)
    kl = np.sum(np.exp(p_top) * (p_top - q_top), axis=1)
    kl += np.where(
        tgt_extra, p_t * (np.log(np.maximum(p_t, 1e-45)) - np.log(np.maximum(q_t, 1e-45))), 0.0
    )
    p_rest = np.clip(1.0 - np.exp(p_top).sum(axis=1) - p_t, 0.0, 1.0)
    q_rest = np.clip(1.0 - np.exp(q_top).sum(axis=1) - q_t, 1e-12, 1.0)
    kl += np.where(
        p_rest > 1e-12, p_rest * (np.log(np.maximum(p_rest, 1e-12)) - np.log(q_rest)), 0.0
    )
    return np.maximum(kl, 0.0)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens on which two sequences agree."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def greedy_prefix_fractions(
    ref: Sequence[Sequence[int]], other: Sequence[Sequence[int]], n: int | None = None
) -> np.ndarray:
    """Per prompt: the share of the first ``n`` reference tokens generated before the first
    divergence (position-wise matching after a divergence would compare unrelated texts, so only
    the common prefix counts). A continuation shorter than ``n`` that matches as far as it goes
    scores its length over ``n``."""
    if len(ref) != len(other) or not ref:
        raise ValueError("need the same, non-zero number of sequences")
    fracs = []
    for a, b in zip(ref, other, strict=True):
        m = n if n is not None else len(a)
        if m <= 0:
            raise ValueError("empty reference continuation")
        fracs.append(common_prefix_len(a[:m], b[:m]) / m)
    return np.asarray(fracs, dtype=np.float64)


def greedy_agreement(
    ref: Sequence[Sequence[int]], other: Sequence[Sequence[int]], n: int | None = None
) -> tuple[float, float]:
    """Agreement of greedy continuations with the reference's, over the first ``n`` tokens:
    ``(token_agree, seq_agree)``, the mean of :func:`greedy_prefix_fractions` and the fraction of
    prompts whose first n tokens are all identical."""
    fracs = greedy_prefix_fractions(ref, other, n)
    return float(np.mean(fracs)), float(np.mean(fracs == 1.0))


def standard_error(x: np.ndarray) -> float:
    """Standard error of the mean of independent samples ``x`` (at least two)."""
    if x.size < 2:
        raise ValueError(f"a standard error needs at least two samples, got {x.size}")
    return float(np.std(x, ddof=1) / np.sqrt(x.size))


def paired_mean_diff(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean of ``a - b`` over paired samples (the same prompts) and its standard error: whether
    one configuration's greedy agreement beats another's by more than the prompts' spread."""
    if a.shape != b.shape:
        raise ValueError(f"paired samples differ in shape: {a.shape}, {b.shape}")
    return float(np.mean(a - b)), standard_error(a - b)


# --------------------------------------------------------------------------------------------
# results files


# What write_json adds to every document: when and from which commit it was measured.
# git_commit_note: why a file's git_commit was set after its run (a GPU host's copy of the tree can
# carry the git metadata of an older checkout, and stamp that commit)
STAMP_KEYS = {"date", "git_commit", "git_commit_note"}
ACCURACY_KEYS = {"model", "corpus", "tokens", "rows"}
ACCURACY_OPTIONAL_KEYS = {
    "gpu", "command", "bos", "transformers_ppl",
    # a file whose rows come from several runs (--merge-rows-from): each run's command and commit
    "parts",
} | STAMP_KEYS  # fmt: skip
# plus "format" on a row kept for the record of a format its dtype no longer stores (report.py's
# dtype table skips those)
ACCURACY_ROW_KEYS = {
    "label",
    "kv_cache_dtype",
    "prefill",
    "ppl",
    "dppl_pct",
    "dppl_se_pct",
    "top1_agree",
    "kld",
    "greedy_agree",
    "greedy_agree_se",
    "kv_cache_tokens",
}
# How the scored tokens' attention got its K/V: "pages", read back from the KV cache (what judges
# a cache); "bf16", prompt chunks over their own fresh BF16 K/V (our default prefill).
PREFILL_KINDS = ("pages", "bf16")
THROUGHPUT_KEYS = {"gpu", "command", "model", "rows"}
THROUGHPUT_ROW_KEYS = {"dtype", "ctx", "num_prompts", "output_len", "gen_tok_s", "kv_cache_tokens"}


def validate_accuracy(doc: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` unless ``doc`` has exactly the schema of ``accuracy.py``'s JSON."""
    keys = set(doc)
    if not ACCURACY_KEYS <= keys or keys - ACCURACY_KEYS - ACCURACY_OPTIONAL_KEYS:
        raise ValueError(f"accuracy keys {sorted(keys)}")
    if not isinstance(doc["model"], str) or not isinstance(doc["corpus"], str):
        raise ValueError("model and corpus must be strings")
    if not isinstance(doc["tokens"], int) or isinstance(doc["tokens"], bool):
        raise ValueError("tokens must be an int")
    labels = [row.get("label") for row in doc["rows"]]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate row labels {labels}")
    for row in doc["rows"]:
        if not ACCURACY_ROW_KEYS <= set(row) or set(row) - ACCURACY_ROW_KEYS - {"format"}:
            raise ValueError(f"accuracy row keys {sorted(row)}")
        if "format" in row and not isinstance(row["format"], str):
            raise ValueError("format (a row of a format its dtype no longer stores) is a string")
        if not isinstance(row["label"], str) or not isinstance(row["kv_cache_dtype"], str):
            raise ValueError("label and kv_cache_dtype must be strings")
        if row["prefill"] not in PREFILL_KINDS:
            raise ValueError(f"prefill must be one of {PREFILL_KINDS}, got {row['prefill']!r}")
        _check_float(row["ppl"], "ppl", nullable=False)
        for key in ("dppl_pct", "dppl_se_pct", "top1_agree", "kld", "greedy_agree_se"):
            _check_float(row[key], key, nullable=True)
        _check_float(row["greedy_agree"], "greedy_agree", nullable=False)
        tokens = row["kv_cache_tokens"]
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool)):
            raise ValueError("kv_cache_tokens must be an int or null")


def validate_throughput(doc: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` unless ``doc`` has exactly the throughput JSON's schema (the
    ``STAMP_KEYS`` of a written file allowed)."""
    if set(doc) - STAMP_KEYS != THROUGHPUT_KEYS:
        raise ValueError(f"throughput keys {sorted(doc)}")
    for row in doc["rows"]:
        if set(row) != THROUGHPUT_ROW_KEYS:
            raise ValueError(f"throughput row keys {sorted(row)}")
        for key in ("ctx", "num_prompts", "output_len", "kv_cache_tokens"):
            if not isinstance(row[key], int) or isinstance(row[key], bool):
                raise ValueError(f"{key} must be an int")
        _check_float(row["gen_tok_s"], "gen_tok_s", nullable=False)


def _check_float(v: Any, name: str, nullable: bool) -> None:
    if v is None and nullable:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")


def merge_rows(
    old: Iterable[Mapping[str, Any]], new: Iterable[Mapping[str, Any]], key: Sequence[str]
) -> list[dict[str, Any]]:
    """Rows of ``old`` with those of ``new`` replacing any of the same ``key``, new ones appended."""
    merged = {tuple(r[k] for k in key): dict(r) for r in old}
    for r in new:
        merged[tuple(r[k] for k in key)] = dict(r)
    return list(merged.values())


def git_commit(repo: str | Path = REPO) -> str:
    """``git rev-parse HEAD`` of ``repo``, with ``-dirty`` appended when a tracked file differs
    from it (untracked files do not count); ``"unknown"`` outside a checkout or without git.

    ``INT8KV_GIT_COMMIT`` (a full 40-digit hash) overrides it: a GPU host's copy of the tree can
    carry the git metadata of an older checkout, and would stamp that commit, dirty."""
    told = os.environ.get("INT8KV_GIT_COMMIT", "")
    if re.fullmatch("[0-9a-f]{40}", told):
        return told

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=60)

    try:
        head = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0 or status.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def stamp(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` with this run's ``date`` (UTC, ``YYYY-MM-DD``) and ``git_commit`` added, each
    unless ``doc`` already has it: which code measured a result, and when."""
    out = dict(doc)
    out.setdefault("date", datetime.now(timezone.utc).date().isoformat())
    if "git_commit" not in out:
        out["git_commit"] = git_commit()
    return out


def write_json(doc: Mapping[str, Any], path: str | Path) -> list[Path]:
    """Write ``doc`` with its :func:`stamp` to ``path`` and, when ``$OUT`` is set (device runs), a
    copy into ``$OUT``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamp(doc), indent=2) + "\n")
    copy = copy_to_out(path)
    return [path] + ([copy] if copy else [])


def copy_to_out(path: str | Path) -> Path | None:
    """When ``$OUT`` is set (device runs), copy ``path`` into it (overwriting) unless it is
    already there; the copy's path, or None."""
    out = os.environ.get("OUT")
    if not out:
        return None
    path = Path(path)
    dst = Path(out) / path.name
    if dst.resolve() == path.resolve():
        return None
    Path(out).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, dst)
    return dst


# --------------------------------------------------------------------------------------------
# running one configuration in a fresh process


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args`` with this interpreter: how a benchmark starts its workers (with
    :func:`with_repo_on_path` in their environment when ``module`` is one of ``benchmarks``)."""
    return [sys.executable, "-m", module, *args]


def with_repo_on_path(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the repository root in front of its ``PYTHONPATH``: a child running
    ``python -m benchmarks.NAME`` then finds the package whatever its working directory."""
    inherited = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    return {**env, "PYTHONPATH": os.pathsep.join([str(REPO), *inherited])}


def start_child(argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen:
    """Start ``argv`` in its own process group with stdout+stderr going to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:  # the child holds its own descriptor
        return subprocess.Popen(
            list(argv), env=dict(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def kill_child(proc: subprocess.Popen) -> int:
    """Kill a child's whole process group (its engine core too); -9, the rc a timeout reports."""
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
        proc.wait()
    return -9


def run_child(
    argv: Sequence[str], env: Mapping[str, str], timeout_s: float, log_path: Path
) -> tuple[int, float, str]:
    """Run ``argv`` with stdout+stderr teed to ``log_path``; returns (rc, seconds, log tail).

    rc is -9 on timeout (the child's process group is killed, its engine core included).
    """
    t0 = time.monotonic()
    proc = start_child(argv, env, log_path)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = kill_child(proc)
    return rc, time.monotonic() - t0, log_tail(log_path)


def log_tail(log_path: Path) -> str:
    """The last 3000 characters of a child's log."""
    return log_path.read_text(errors="replace")[-3000:]


def error_summary(log_tail: str) -> str:
    """The most telling line of a failed child's log (last exception-looking line)."""
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln or "Exception" in ln:
            return ln[:500]
    return (lines[-1] if lines else "no output")[:500]


def gpu_name() -> str:
    """GPU model as nvidia-smi reports it, without initialising CUDA in this process."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        return out.splitlines()[0] if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def shim_switches(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The shim's variables (``INT8KV_*``) a run had, sorted: which of its switches a result was
    measured with (int4's sink page and tail pages, the prefill path, ...)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in sorted(env.items()) if k.startswith("INT8KV_")}


def command_line() -> str:
    """How this script was invoked, for the results' ``command`` field: ``python -m
    benchmarks.NAME ...`` for a module run (the scripts' way), else the script's path from the
    repository root. Arguments are shell-quoted where they need it (``--model-name 'Gemma 3'``),
    so the line runs as written."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.startswith("benchmarks."):
        return shlex.join(["python", "-m", spec.name, *sys.argv[1:]])
    rel = os.path.relpath(sys.argv[0], REPO) if sys.argv else "?"
    return shlex.join(["python", rel, *sys.argv[1:]])


def kv_cache_tokens(llm: Any) -> tuple[int, int, int]:
    """(tokens, num_gpu_blocks, block_size) of a started ``vllm.LLM``.

    The engine core (a separate process) sends its block count back to the front end at start-up
    (vllm/v1/engine/core_client.py), so ``cache_config`` holds the real numbers. For a model with
    only full attention this equals the "GPU KV cache size: N tokens" line vLLM logs.
    """
    cc = llm.llm_engine.vllm_config.cache_config
    blocks = int(cc.num_gpu_blocks or 0)
    return blocks * int(cc.block_size), blocks, int(cc.block_size)
