"""Helpers of the vLLM end-to-end tests: prompts, a tiny random GQA Llama, running vLLM, judging.

Importable without vLLM or a GPU (tests/e2e/test_e2e_support.py tests them on CPU); the greedy
comparison itself is ``benchmarks.greedy``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The engine runner, its child-process handling (a timeout kills the engine core too) and the
# greedy comparison are the benchmarks' own.
from benchmarks import common
from benchmarks.greedy import NEAR_TIE_TOPK, Comparison

CORPUS = common.DEFAULT_CORPUS

# Prompt lengths (tokens): short to well past 1K so that prompts span many KV blocks and decode
# runs with long contexts (split-KV decode paths), plus prompts sharing a long prefix for the
# prefix-cache test.
PROMPT_LENGTHS = (
    12,
    20,
    33,
    48,
    64,
    100,
    150,
    250,
    300,
    400,
    600,
    700,
    800,
    1000,
    1100,
    1300,
    1500,
    1800,
    2000,
    2300,
)
SHARED_PREFIX_LEN = 1200
SHARED_SUFFIX_LENS = (17, 50, 90, 200)
TINY_ATTN_OUT_SCALE = 1.0  # standard init; see build_tiny_llama
MAX_MODEL_LEN = 2560  # longest prompt (2300) + generated tokens, rounded up to a block multiple
GEN_TOKENS = 32
# Rounds of 24 prompts. The tests compare how many prompts stay identical with a control's count,
# allowing a slack of 0.15 (SLACK below); the standard error of the difference of two such
# fractions near 0.3 is sqrt(2 * 0.21 / n): 0.13 for n = 24 (the slack is ~1 s.e., so an equally good
# cache fails about one comparison in seven), 0.076 for n = 72 (~2 s.e.).
PROMPT_ROUNDS = int(os.environ.get("INT8KV_E2E_PROMPT_ROUNDS", "3"))
# How many fewer prompts (a fraction) a comparison may keep identical than its control measured in
# the same run: 0.15 is about 11 of 72, two standard errors of the difference.
SLACK = float(os.environ.get("INT8KV_E2E_SLACK", "0.15"))


def kv_settings(dtype: str) -> tuple[dict[str, Any], bool]:
    """(LLM kwargs, shim on?) of a KV-cache dtype, as the benchmarks run it: BF16 (``auto``) and
    upstream's ``int8_per_token_head`` on vLLM's Triton backend without the shim, ``auto_fa2`` on
    FlashAttention-2, ours with the shim and no backend named (its plugin must pick ours)."""
    return common.llm_kwargs_for(dtype), bool(common.config_for(dtype)["shim"])


def corpus_token_ids(tokenizer_dir: str | Path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return list(tok(CORPUS.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])


def make_prompts(ids: Sequence[int], rounds: int = PROMPT_ROUNDS) -> list[list[int]]:
    """``rounds`` x 24 deterministic prompts cut from the corpus; per round, 20 of varied length
    and 4 with a shared prefix (each round its own prefix).

    Each prompt starts at a different place (no accidental shared prefixes among the varied ones),
    the shared ones of a round all start with the same ``SHARED_PREFIX_LEN`` tokens and continue
    with different text.
    """
    per_round = sum(PROMPT_LENGTHS) + SHARED_PREFIX_LEN + sum(SHARED_SUFFIX_LENS)
    need = rounds * per_round
    if len(ids) < need:
        raise ValueError(f"corpus has {len(ids)} tokens, prompts need {need}")
    prompts, pos = [], 0
    for _ in range(rounds):
        for n in PROMPT_LENGTHS:
            prompts.append(list(ids[pos : pos + n]))
            pos += n
        prefix = list(ids[pos : pos + SHARED_PREFIX_LEN])
        pos += SHARED_PREFIX_LEN
        for n in SHARED_SUFFIX_LENS:
            prompts.append(prefix + list(ids[pos : pos + n]))
            pos += n
    return prompts


# --------------------------------------------------------------------------------------------
# tiny random GQA Llama


def build_tiny_llama(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    *,
    seed: int = 0,
    head_dim: int = 128,
    attn_out_scale: float = 1.0,
) -> Path:
    """Save a random 4-layer GQA Llama (8 query / 2 KV heads) with SmolLM2's tokenizer to ``out_dir``.

    hidden 256, ``head_dim`` 128 by default (SmolLM2 covers 64), vocab = the tokenizer's, BF16
    safetensors, fixed seed. ``attn_out_scale`` multiplies every ``o_proj`` weight: it sets how much
    the attention output (the only thing the KV cache touches) weighs in the residual stream.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(attn_out_scale)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


# --------------------------------------------------------------------------------------------
# running vLLM


def engine_files(workdir: str | Path, name: str) -> tuple[Path, Path, Path]:
    """(spec, result, log) files of the engine ``name`` that :func:`run_vllm` runs in
    ``workdir``."""
    return tuple(Path(workdir) / f"{name}.{ext}" for ext in ("spec.json", "result.json", "log"))


def run_vllm(
    name: str,
    llm_kwargs: Mapping[str, Any],
    phases: Sequence[Mapping[str, Any]],
    *,
    shim: bool,
    workdir: str | Path,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``benchmarks/vllm_worker.py`` for one engine in a fresh process and return its result.

    ``shim`` sets ``INT8KV_SHIM=1`` in that process only (and removes it otherwise); ``env`` adds
    variables to that process only. The log goes to ``workdir/NAME.log`` and, on a device run, also
    to ``$OUT/logs/``.
    """
    Path(workdir).mkdir(parents=True, exist_ok=True)
    spec, result, log = engine_files(workdir, name)
    spec_text = json.dumps(
        {"llm_kwargs": dict(llm_kwargs), "phases": list(phases), "shim": shim, "env": env or {}}
    )
    reuse = reusable_result(spec, result, spec_text)
    if reuse is not None:
        return reuse
    result.unlink(missing_ok=True)
    spec.write_text(spec_text)
    env = common.with_repo_on_path(dict(os.environ) | dict(env or {}))
    if shim:
        env["INT8KV_SHIM"] = "1"
    else:
        env.pop("INT8KV_SHIM", None)
    timeout_s = timeout_s or float(os.environ.get("INT8KV_E2E_TIMEOUT", "1200"))
    rc, seconds, tail = common.run_child(
        common.module_command("benchmarks.vllm_worker", str(spec), str(result)), env, timeout_s, log
    )
    if os.environ.get("OUT"):
        dst = Path(os.environ["OUT"]) / "logs"
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, dst / f"e2e_{name}.log")
    if rc != 0 or not result.exists():
        raise RuntimeError(f"vLLM run {name!r} failed (rc={rc}) after {seconds:.0f}s:\n{tail}")
    out = json.loads(result.read_text())
    out["wall_s"] = round(seconds, 1)
    result.write_text(json.dumps(out))
    return out


def reusable_result(spec: Path, result: Path, spec_text: str) -> dict[str, Any] | None:
    """The result an earlier pytest process left in ``INT8KV_E2E_WORKDIR`` for exactly this spec
    (model, engine arguments, phases, shim, extra environment), or None.

    A GPU call has a time limit that the Gemma 3 file's engines do not fit together; with the
    variable set, a second call on the same host starts only the engines the first did not finish.
    The kernels' code is not in the spec: keep the folder only between calls on one tree.
    """
    if not os.environ.get("INT8KV_E2E_WORKDIR") or not result.exists() or not spec.exists():
        return None
    if spec.read_text() != spec_text:
        return None
    out = json.loads(result.read_text())
    out["reused"] = True
    return out


# --------------------------------------------------------------------------------------------
# the vllm_worker phases of the tests


def generation_phase(
    name: str,
    prompts: list[list[int]],
    max_tokens: int = GEN_TOKENS,
    skip_reading_prefix_cache: bool | None = None,
) -> dict[str, Any]:
    """One phase of a ``vllm_worker`` spec: greedy generation recording NEAR_TIE_TOPK logprobs."""
    return {
        "name": name,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "logprobs": NEAR_TIE_TOPK,
        "skip_reading_prefix_cache": skip_reading_prefix_cache,
    }


def assert_like_control(
    ours: Comparison, control: Comparison, what: str, control_what: str
) -> None:
    """No real mismatch, and at most SLACK of the prompts fewer identical than the control."""
    floor = control.identical_fraction - SLACK
    report_comparison(what, ours, control_what, control, ok=not ours.mismatch
                      and ours.identical_fraction >= floor)  # fmt: skip
    assert not ours.mismatch, f"{what}: {ours.summary()}"
    assert ours.identical_fraction >= floor, (
        f"{what}: {ours.identical}/{ours.total} identical, control {control_what} "
        f"{control.identical}/{control.total} (slack {SLACK})"
    )


def _comparison_fields(c: Comparison) -> dict[str, Any]:
    return {
        "identical": c.identical,
        "prompts": c.total,
        "tokens": c.n,
        "real_mismatches": len(c.mismatch),
        "largest_near_tie_gap_nats": max(c.margin.values(), default=0.0),
    }


def report_comparison(
    what: str, ours: Comparison, control_what: str, control: Comparison, *, ok: bool | None = None
) -> None:
    """Print a comparison beside its control and record it (:func:`record_comparison`); ``ok``:
    the judgement, None for a comparison recorded for information only."""
    print(f"{what}: {ours.summary()}\n  control, {control_what}: {control.summary()}")
    record_comparison(what, ours, control_what, control, ok=ok)


def record_comparison(
    what: str, ours: Comparison, control_what: str, control: Comparison, *, ok: bool | None
) -> None:
    """On a device run (``$OUT`` set), append the judgement to ``$OUT/logs/e2e_comparisons.jsonl``
    as it is made: a call cut off by its time limit keeps the comparisons of the tests that got
    that far, which pytest's summary (printed at the end) does not. ``passed`` is null for a
    comparison recorded for information only."""
    if not os.environ.get("OUT"):
        return
    path = Path(os.environ["OUT"]) / "logs" / "e2e_comparisons.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    row = {"what": what, **_comparison_fields(ours), "passed": ok,
           "control": {"what": control_what, **_comparison_fields(control)}}  # fmt: skip
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
