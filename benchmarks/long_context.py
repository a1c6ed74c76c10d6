"""Long context: greedy decoding at the longest context the model allows, BF16 vs int8.

For SmolLM2-135M (``max_position_embeddings`` 8192, read from the model's config.json) each of
``--num-prompts`` corpus slices fills the context up to ``max_model_len - --gen-tokens`` tokens, and
``--gen-tokens`` greedy tokens (EOS ignored) are generated after it, in one fresh engine per
configuration (``--configs``; the first is the reference): ``auto`` (BF16 cache, TRITON_ATTN, shim
off) and ``int8`` (shim on, our backend). ``max_num_seqs`` is small (``--max-num-seqs``, default 4)
so decode steps hold few sequences and our decode kernel splits each 8K-token KV range over many
programs (split-KV / flash-decoding, the path that long contexts take in serving).

Per prompt and configuration: the greedy agreement length with the reference (tokens before the
first divergence), whether the first 32 tokens are identical, how the first divergence looks (a
near tie: both tokens in each other's top-``--logprobs``, or a real mismatch), and whether any
returned logprob is NaN or infinite. A NaN anywhere makes the exit status 1; so does a
configuration whose engine fails. Agreement is reported, not gated: at 8K context SmolLM2 sits on
near ties often enough that any rounding change (a quantized cache, even another BF16 kernel) flips
some of them within 64 tokens.

``--logprobs`` defaults to 5 rather than 1: the NaN check reads every returned logprob either way,
and with only the top-1 a divergence could never be told apart from a near tie.

Writes ``--out`` (benchmarks/results/long_context.json): ``model``, ``ctx`` (max_model_len),
``prompt_len``, ``gen_tokens``, ``rows``, ``runs`` (per configuration: engine start, KV tokens,
errors), ``gpu``, ``command``. A bigger model: ``--model DIR --model-name NAME`` (its own
max_position_embeddings; ``--max-model-len`` to cap it when the KV cache would not hold the
prompts).

GPU host: ``bash benchmarks/run_gpu_e2e.sh longctx [args]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.greedy import compare_greedy

# The engine runner the e2e tests use too: one vLLM engine, greedy phases, token ids and top-k
# logprobs (benchmarks/vllm_worker.py).
WORKER = "benchmarks.vllm_worker"

IDENTICAL_PREFIX = 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("SMOLLM2_DIR"), help="HF model folder")
    p.add_argument("--model-name", default="SmolLM2-135M-Instruct", help="name for the JSON")
    p.add_argument("--configs", default="auto,int8", help="comma list of row labels; first = ref")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--logprobs", type=int, default=5, help="top-k logprobs per generated token")
    p.add_argument("--max-model-len", type=int, default=0, help="0 = max_position_embeddings")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs")
    p.add_argument("--corpus", default=str(common.DEFAULT_CORPUS))
    p.add_argument("--timeout", type=float, default=1200, help="seconds per configuration")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "long_context.json"))
    p.add_argument("--workdir", default=None)
    return p.parse_args(argv)


def non_finite_positions(logprobs: list[list[list[float]]]) -> list[int]:
    """Generated positions where any returned logprob is NaN or ±inf.

    ``logprobs[pos]`` is a list of ``[token_id, logprob]`` (vllm_worker's format).
    """
    return [
        pos
        for pos, entries in enumerate(logprobs)
        if any(not math.isfinite(float(lp)) for _, lp in entries)
    ]


def prompt_rows(
    label: str, ref: dict[str, Any], got: dict[str, Any], gen_tokens: int
) -> list[dict[str, Any]]:
    """One row per prompt of ``got`` (a vllm_worker phase) against the reference phase."""
    cmp = compare_greedy(ref, got, n=gen_tokens)
    rows = []
    for i, (a, b) in enumerate(zip(ref["token_ids"], got["token_ids"], strict=True)):
        bad = non_finite_positions(got["logprobs"][i])
        agree = common.common_prefix_len(a, b)
        rows.append(
            {
                "dtype": label,
                "prompt": i,
                "agree_len": agree,
                "identical_first_32": agree >= IDENTICAL_PREFIX and len(b) >= IDENTICAL_PREFIX,
                "divergence": (
                    "none"
                    if i not in cmp.first_divergence
                    else "near_tie"
                    if i in cmp.near_tie
                    else "mismatch"
                ),
                "generated": len(b),
                "logprob_positions": len(got["logprobs"][i]),
                "nan": bool(bad),
                "nan_positions": bad[:10],
            }
        )
    return rows


def llm_kwargs(args: argparse.Namespace, label: str, max_len: int) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "model": args.model,
        **common.llm_kwargs_for(label),
        "max_model_len": max_len,
        "max_num_seqs": args.max_num_seqs,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enable_prefix_caching": False,  # each prompt is computed, never served from another's
        "seed": 0,
    }
    if args.enforce_eager:
        kw["enforce_eager"] = True
    return kw


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.model or not (Path(args.model) / "config.json").exists():
        print("long_context: no model folder (--model or $SMOLLM2_DIR)", file=sys.stderr)
        return 2
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    max_len = args.max_model_len or int(cfg["max_position_embeddings"])
    prompt_len = max_len - args.gen_tokens
    ids = common.load_corpus_ids(args.model, args.corpus)
    prompts = common.make_greedy_prompts(ids, args.num_prompts, [prompt_len])
    labels = common.parse_list(args.configs)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="int8kv-longctx-"))
    workdir.mkdir(parents=True, exist_ok=True)
    logdir = Path(os.environ["OUT"]) / "logs" if os.environ.get("OUT") else workdir
    print(
        f"long_context: {args.model_name}, max_model_len {max_len}, {len(prompts)} prompts of "
        f"{prompt_len} tokens + {args.gen_tokens} generated, configs {labels}",
        flush=True,
    )

    phases: dict[str, dict[str, Any]] = {}
    runs: dict[str, Any] = {}
    for label in labels:
        spec, result = workdir / f"{label}.spec.json", workdir / f"{label}.result.json"
        phase = {
            "name": "long",
            "prompts": prompts,
            "max_tokens": args.gen_tokens,
            "logprobs": args.logprobs,
            "skip_reading_prefix_cache": True,
        }
        kw = llm_kwargs(args, label, max_len)
        spec.write_text(json.dumps({"llm_kwargs": kw, "phases": [phase]}))
        result.unlink(missing_ok=True)
        rc, secs, tail = common.run_child(
            common.module_command(WORKER, str(spec), str(result)),
            common.with_repo_on_path(common.child_env(label)),
            args.timeout,
            logdir / f"long_context_{label}.log",
        )
        run: dict[str, Any] = {"rc": rc, "wall_s": round(secs, 1), "llm_kwargs": kw}
        if rc == 0 and result.exists():
            # json reads the NaN / Infinity that json.dump wrote for non-finite logprobs
            got = json.loads(result.read_text())
            phases[label] = got["phases"]["long"]
            run |= {"engine": got["engine"], "generate_s": phases[label]["seconds"]}
        else:
            run["error"] = "timeout" if rc == -9 else common.error_summary(tail)
        runs[label] = run
        print(f"long_context: {label}: rc={rc} in {secs:.0f}s {run.get('error', '')}", flush=True)

    rows: list[dict[str, Any]] = []
    ref_label = labels[0]
    if ref_label in phases:
        for label in labels:
            if label in phases:
                rows += prompt_rows(label, phases[ref_label], phases[label], args.gen_tokens)
    else:  # no reference: still report NaNs of the others
        for label, ph in phases.items():
            for i, lps in enumerate(ph["logprobs"]):
                bad = non_finite_positions(lps)
                rows.append({"dtype": label, "prompt": i, "nan": bool(bad), "nan_positions": bad})

    doc = {
        "model": args.model_name,
        "ctx": max_len,
        "prompt_len": prompt_len,
        "gen_tokens": args.gen_tokens,
        "reference": ref_label,
        "max_num_seqs": args.max_num_seqs,
        "enforce_eager": args.enforce_eager,
        "rows": rows,
        "runs": runs,
        "gpu": common.gpu_name(),
        "command": common.command_line(),
    }
    for path in common.write_json(doc, args.out):
        print(f"long_context: wrote {path}")
    print(f"{'dtype':<14}{'prompt':>7}{'agree':>7}{'first32':>9}  {'divergence':<11}{'nan':>5}")
    for r in rows:
        print(
            f"{r['dtype']:<14}{r['prompt']:>7}{r.get('agree_len', '-')!s:>7}"
            f"{r.get('identical_first_32', '-')!s:>9}  {r.get('divergence', '-'):<11}"
            f"{r['nan']!s:>5}"
        )
    nan = any(r["nan"] for r in rows)
    failed = [label for label, r in runs.items() if r["rc"] != 0 or label not in phases]
    if nan:
        print("long_context: FAIL: NaN/inf logprobs", file=sys.stderr)
    if failed:
        print(f"long_context: FAIL: configurations {failed} did not run", file=sys.stderr)
    return 1 if nan or failed else 0


if __name__ == "__main__":
    sys.exit(main())
