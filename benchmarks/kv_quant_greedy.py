"""Greedy agreement with simulated KV-cache quantization (Hugging Face model, our torch references).

``benchmarks/kv_quant_sim.py`` scores a format teacher-forced: perplexity, and top-1 agreement as
a proxy for greedy agreement. This module decodes: for each prompt and variant it prefills the
prompt through the simulated cache, then generates ``--tokens`` tokens greedily, one at a time,
with a KV cache, and compares the continuation with the unquantized ``bf16`` variant's the way
``benchmarks/accuracy.py`` compares vLLM's (``common.greedy_prefix_fractions``: the share of the
tokens generated before the first divergence). The prompts are ``--prompts`` of ``accuracy.py``'s
``--prompt-set`` (its 256 by default: ``common.make_greedy_prompts`` with
``accuracy.GREEDY_LENGTHS``, each led by the model's BOS where its tokenizer adds one), one in
every ``--prompt-set / --prompts`` (``prompt_indices``), so that with ``--gpu-details`` (an
``accuracy.py`` details file of that set, which keeps each row's per-prompt prefix) the GPU's
agreement on the very same prompts is recorded beside the simulation's (``gpu_same_prompts``):
whether the simulation is calibrated is then not blurred by another sample of prompts.

Every K and V is stored as ``kv_quant_sim``'s variant says (its ``install``): the prefill's
queries read the earlier pages quantized and their own page from the BF16 tail, and each decode
step reads the full pages quantized and its own page from the tail (``tail_full`` variants keep a
page the step completed there), the variant's sink tokens in BF16 throughout. The cache keeps every
key of every layer at its absolute position (a ``DynamicCache`` without a config: with one,
transformers gives sliding-window layers a cache that drops old keys, which would shift the
pages); Gemma 3's sliding-window layers get their window from transformers' mask, as in
``kv_quant_sim``. Attention is PyTorch's SDPA, so this is a simulation of the storage format, not
of vLLM or our kernels: the GPU measurement is ``benchmarks/accuracy.py``'s ``greedy_agree``.

Without ``--variants`` the rows are the catalogue's formats at the model's head size: ``bf16``,
``int8`` (``int8_g64`` above head size 128, as the catalogue's int8 groups its scales), today's
``int4`` (``int4_tail_full_v_g<G>``, G from the catalogue) and the same with its BF16 sink page
(``..._sinks64``, ``INT8KV_INT4_SINK_PAGE=1``).

    python -m benchmarks.kv_quant_greedy --model /path/to/SmolLM2-135M-Instruct --prompts 64 \
        --gpu-details benchmarks/results/accuracy_chunk16_details.json
    python -m benchmarks.kv_quant_greedy --model /path/to/gemma3-270m --model-name gemma-3-270m \
        --prompts 64 --gpu-details benchmarks/results/accuracy_gemma3_chunk16_details.json \
        --out benchmarks/results/kv_quant_greedy_gemma3.json

Writes ``--out`` (default ``benchmarks/results/kv_quant_greedy.json``) through
``common.write_json`` after every prompt, so a cut run leaves the prompts it finished:
``{"gpu": null, "device", "model", "corpus", "bos", "prompt_set", "prompt_indices", "prompts",
"prompts_done", "lengths", "tokens", "versus", "command", "seconds", "rows": [{"variant",
"greedy_agree", "greedy_agree_se", "greedy_seq_agree", "ratio_vs_versus", "ratio_se",
"first_divergence"}]}`` and, with ``--gpu-details``, ``"gpu_same_prompts": {"file", "versus",
"rows": {label: {"greedy_agree", "greedy_agree_se", "ratio_vs_versus", "ratio_se"}}}`` over the
prompts done.
``first_divergence`` lists per prompt the index of the first generated token that differs from
``bf16``'s (``tokens`` when none does); ``ratio_vs_versus`` is the row's mean agreement over the
``versus`` row's (``int8``'s), its standard error by the delta method over the paired prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import common
from benchmarks.accuracy import GREEDY_LENGTHS
from benchmarks.kv_quant_sim import TAIL_PAGE, Variant, install, pick_variants
from int8kv_kernels.catalogue import get_dtype

GREEDY_TOKENS = 32


def catalogue_variants(head_size: int) -> list[str]:
    """The variant names of the catalogue's formats at ``head_size``: bf16, int8 (its scale
    groups), today's int4 (its V groups, tail keeping a completed page) and int4 with the BF16
    sink page."""
    int8 = get_dtype("int8").group_for(head_size)
    int4 = get_dtype("int4").group_for(head_size)
    int4_name = f"int4_tail_full_v_g{'D' if int4 == head_size else int4}"
    return [
        "bf16",
        "int8" if int8 == head_size else f"int8_g{int8}",
        int4_name,
        f"{int4_name}_sinks{TAIL_PAGE}",
    ]


def _cache() -> Any:
    from transformers import DynamicCache

    # no config: every layer a DynamicLayer, keeping all keys (a sliding-window layer's cache
    # would drop the keys before its window and shift every page's positions)
    return DynamicCache()


def decode_logits(
    model: torch.nn.Module, prompt: torch.Tensor, next_ids: torch.Tensor | None, steps: int
) -> torch.Tensor:
    """Prefill ``prompt`` [tokens] with a KV cache, then decode ``steps`` tokens one at a time;
    the token fed at step i is ``next_ids[i]`` (teacher-forced) or, when ``next_ids`` is None,
    the previous step's argmax (greedy). Returns the last position's logits of the prefill and of
    each step but the last fed one: [steps + 1, vocab], row i predicting the i-th generated
    token."""
    cache = _cache()
    rows = []
    with torch.inference_mode():
        out = model(prompt[None], cache=cache, use_cache=True, logits_to_keep=1)
        rows.append(out.logits[0, -1])
        for i in range(steps):
            token = rows[-1].argmax() if next_ids is None else next_ids[i]
            out = model(token.view(1, 1), cache=cache, use_cache=True, logits_to_keep=1)
            rows.append(out.logits[0, -1])
    return torch.stack(rows)


def greedy_continuation(model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> list[int]:
    """``tokens`` greedily generated token ids after ``prompt`` [tokens] (EOS not special)."""
    return decode_logits(model, prompt, None, tokens - 1).argmax(-1).tolist()


def prompt_indices(
    set_size: int, num: int, lengths: int = len(GREEDY_LENGTHS), shift: int = 0
) -> list[int]:
    """Which ``num`` of ``accuracy.py``'s ``set_size`` greedy prompts to run: one in every
    ``set_size // num`` consecutive ones, spread over the corpus as the whole set is, the k-th
    taken at the (k + ``shift``)-th of the ``lengths`` cycling prompt lengths (every length as
    often; shifts 0 to ``lengths`` - 1 pick disjoint sets when one in ``lengths`` is taken)."""
    if num < 1 or set_size % num:
        raise ValueError(f"{num} prompts do not divide the set of {set_size}")
    stride = set_size // num
    if 1 < stride < lengths:
        raise ValueError(f"one in {stride} prompts cannot cycle through {lengths} lengths")
    return [k * stride + (k + shift - k * stride) % lengths for k in range(num)]


# the GPU row a simulation is compared over when none is named
GPU_VERSUS = "int8"


def gpu_same_prompts(
    details: dict[str, Any], indices: Sequence[int], tokens: int, versus: str
) -> dict[str, Any]:
    """A GPU run's greedy agreement (``accuracy.py``'s details file: each row's per-prompt
    ``greedy_prefix`` over its prompt set) on the prompts ``indices`` of that set: per row its
    mean and standard error, and its ratio to the ``versus`` row's with the delta method's
    standard error, for comparing the simulation with the GPU on the same prompts."""
    if details["greedy"]["tokens"] != tokens:
        raise ValueError(
            f"the GPU run generated {details['greedy']['tokens']} tokens, not {tokens}"
        )
    fracs = {
        label: np.asarray([run["greedy_prefix"][i] for i in indices], dtype=np.float64) / tokens
        for label, run in details["runs"].items()
        if "greedy_prefix" in run
    }
    rows = {}
    for label, f in fracs.items():
        row = {"greedy_agree": round(float(np.mean(f)), 6)}
        if f.size > 1:
            row["greedy_agree_se"] = round(common.standard_error(f), 6)
            if versus in fracs:
                r, se = ratio_se(f, fracs[versus])
                row["ratio_vs_versus"], row["ratio_se"] = round(r, 4), round(se, 4)
        rows[label] = row
    return {"versus": versus, "rows": rows}


def ratio_se(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """mean(a) / mean(b) over paired samples and its delta-method standard error:
    sqrt(var(a - r b) / n) / mean(b), r the ratio."""
    if a.shape != b.shape or a.size < 2:
        raise ValueError(f"need two or more paired samples, got {a.shape} and {b.shape}")
    mb = float(np.mean(b))
    if mb == 0:
        return math.nan, math.nan
    r = float(np.mean(a)) / mb
    return r, common.standard_error(a - r * b) / mb


def summarize(
    continuations: dict[str, list[list[int]]], tokens: int, versus: str | None
) -> list[dict[str, Any]]:
    """One row per variant (the first the reference) from each variant's continuations of the
    same prompts."""
    names = list(continuations)
    ref = continuations[names[0]]
    fracs = {n: common.greedy_prefix_fractions(ref, c, tokens) for n, c in continuations.items()}
    rows = []
    for n in names:
        f = fracs[n]
        row: dict[str, Any] = {
            "variant": n,
            "greedy_agree": round(float(np.mean(f)), 6),
            "greedy_agree_se": round(common.standard_error(f), 6) if f.size > 1 else None,
            "greedy_seq_agree": round(float(np.mean(f == 1.0)), 6),
        }
        if versus is not None and versus in fracs and f.size > 1:
            r, se = ratio_se(f, fracs[versus])
            row["ratio_vs_versus"] = round(r, 4)
            row["ratio_se"] = round(se, 4)
        row["first_divergence"] = [
            common.common_prefix_len(a[:tokens], b[:tokens])
            for a, b in zip(ref, continuations[n], strict=True)
        ]
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face folder")
    p.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    p.add_argument("--corpus", default=str(common.DEFAULT_CORPUS))
    p.add_argument(
        "--prompt-set",
        type=int,
        default=256,
        help="the greedy prompts accuracy.py makes (its --greedy-prompts; default 256, its own)",
    )
    p.add_argument("--prompts", type=int, default=64, help="how many of them (prompt_indices)")
    p.add_argument(
        "--shift", type=int, default=0, help="prompt_indices' shift: another subset of the set"
    )
    p.add_argument(
        "--gpu-details",
        default="",
        help="an accuracy.py details file of the same prompt set: its rows' agreement on these "
        "prompts is recorded beside the simulation's",
    )
    p.add_argument("--gpu-versus", default=GPU_VERSUS, help="the GPU row its ratios are taken over")
    p.add_argument("--tokens", type=int, default=GREEDY_TOKENS)
    p.add_argument(
        "--variants",
        default="",
        help="comma-separated variant names, bf16 first (default: the catalogue's formats at the "
        "model's head size, see above)",
    )
    p.add_argument(
        "--versus", default="", help="the row the ratios are taken over (default: the int8 row)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "kv_quant_greedy.json"))
    args = p.parse_args(argv)

    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    config = AutoConfig.from_pretrained(args.model).get_text_config()
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    try:
        variants = pick_variants(args.variants or ",".join(catalogue_variants(head)))
    except ValueError as e:
        p.error(str(e))
    names = [v.name for v in variants]
    versus = args.versus or next((n for n in names if n.startswith("int8")), None)
    if versus is not None and versus not in names:
        p.error(f"--versus {versus} is not among the variants {names}")

    current: list[Variant] = [variants[0]]
    impl = install(current)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16, attn_implementation=impl
    ).to(args.device)
    model.eval()
    ids = common.load_corpus_ids(args.model, args.corpus)
    bos = common.tokenizer_bos(args.model)
    try:
        indices = prompt_indices(args.prompt_set, args.prompts, shift=args.shift)
    except ValueError as e:
        p.error(str(e))
    every = common.make_greedy_prompts(ids, args.prompt_set, GREEDY_LENGTHS, bos=bos)
    prompts = [every[i] for i in indices]
    details = None
    if args.gpu_details:
        details = json.loads(Path(args.gpu_details).read_text())
        if details["greedy"]["prompts"] != args.prompt_set:
            p.error(f"{args.gpu_details} ran {details['greedy']['prompts']} greedy prompts")
        try:
            gpu_same_prompts(details, indices, args.tokens, args.gpu_versus)
        except ValueError as e:
            p.error(str(e))
    # the commit the run started from: the tree may change under a run of hours
    commit = common.git_commit()
    continuations: dict[str, list[list[int]]] = {n: [] for n in names}
    start = time.time()
    result: dict[str, Any] = {}
    for prompt in tqdm(prompts, desc="prompts", file=sys.stderr):
        x = torch.tensor(prompt, dtype=torch.long, device=args.device)
        for v in variants:
            current[0] = v
            continuations[v.name].append(greedy_continuation(model, x, args.tokens))
        done = len(continuations[names[0]])
        result = {
            "gpu": None,
            "device": args.device,
            "model": args.model_name,
            "corpus": Path(args.corpus).name,
            "bos": bos,
            "prompt_set": args.prompt_set,
            "prompt_indices": indices,
            "prompts": len(prompts),
            "prompts_done": done,
            "lengths": list(GREEDY_LENGTHS),
            "tokens": args.tokens,
            "versus": versus,
            "command": common.command_line(),
            "git_commit": commit,
            "seconds": round(time.time() - start, 1),
            "rows": summarize(continuations, args.tokens, versus) if done > 1 else [],
        }
        if details is not None:  # its rows over the prompts done so far
            result["gpu_same_prompts"] = {
                "file": Path(args.gpu_details).name,
                **gpu_same_prompts(details, indices[:done], args.tokens, args.gpu_versus),
            }
        common.write_json(result, args.out)
    for row in result["rows"]:
        ratio = (
            f"  x{row['ratio_vs_versus']:.3f} ± {row['ratio_se']:.3f} of {versus}"
            if "ratio_vs_versus" in row
            else ""
        )
        print(
            f"{row['variant']:32s} greedy {row['greedy_agree']:.3f} ± "
            f"{row['greedy_agree_se'] or 0:.3f}  identical {row['greedy_seq_agree']:.2f}{ratio}"
        )
    print(f"kv_quant_greedy: wrote {args.out}")


if __name__ == "__main__":
    main()
