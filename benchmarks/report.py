"""Markdown tables for the README, generated from the result files (numbers are never typed).

    python benchmarks/report.py kernels     # "Kernel speed", from benchmarks/results/kernels.json
    python benchmarks/report.py kernel_targets  # "Kernel speed": issue 3's targets over that file
    python benchmarks/report.py accuracy    # "Accuracy", from accuracy.json (+ accuracy_details.json)
    python benchmarks/report.py throughput  # "Throughput", from throughput.json
    python benchmarks/report.py profile_1k  # "Throughput", 1K: the profiled pair and its profiles
    python benchmarks/report.py kernels_smol_b1024  # "Kernel speed", SmolLM2's heads at 1024 seqs
    python benchmarks/report.py launch_overhead     # "Kernel speed", host time per launch
    python benchmarks/report.py throughput_1k_s9_runs  # "Throughput", 1K: session 9's runs

tests/test_readme_results.py checks that the README holds exactly what this prints.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def kernels_table(path: Path = RESULTS / "kernels.json") -> str:
    """Decode/prefill/write times of our int8 kernels against FA2, vLLM's Triton and upstream int8."""
    result = json.loads(path.read_text())
    ms = {
        (
            r["kernel"],
            r["impl"],
            r["q_heads"],
            r["kv_heads"],
            r["head_dim"],
            r["batch"],
            r["ctx"],
        ): r
        for r in result["rows"]
    }
    peak = result["peak_bw_gbs"]
    # int4 (experimental) has a column only in files that time it
    with_int4 = any(r["impl"] == "int4" for r in result["rows"])
    lines = [
        f"{result['gpu']}, copy bandwidth {peak:.0f} GB/s, `{_short(result['command'])}`.",
        "Speedups are the other kernel's time over ours (>1: ours faster); %bw counts the bytes "
        "`int8` must read.",
        "",
        "| kernel | q/kv heads, dim | batch | ctx | `int8` µs | %bw | vs `bf16_fa2` | vs `bf16` (Triton) "
        "| vs `upstream_int8_pth` | `int8_static` vs `bf16_fa2` |"
        + (" `int4` vs `bf16_fa2` |" if with_int4 else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if with_int4 else ""),
    ]
    # int8_fa2: the prefill path the shim takes in vLLM (context gather + FlashAttention-2)
    label = {"int8": None, "int8_fa2": "prefill, gather + FA2"}
    order = {"decode": 0, "prefill": 1, "write": 2}
    for key, ours in sorted(
        ms.items(), key=lambda kv: (order.get(kv[0][0], 3), kv[0][2:], kv[0][1])
    ):
        kernel, impl, *shape = key
        if impl not in label:
            continue

        def ratio(other: str, mine: dict = ours, kernel: str = kernel, shape: list = shape) -> str:
            row = ms.get((kernel, other, *shape))
            return f"{row['ms'] / mine['ms']:.2f}x" if row else "n/a"

        def fa2_over(impl: str, kernel: str = kernel, shape: list = shape) -> str:
            row, fa2 = ms.get((kernel, impl, *shape)), ms.get((kernel, "bf16_fa2", *shape))
            return f"{fa2['ms'] / row['ms']:.2f}x" if row and fa2 else "n/a"

        nq, nkv, d, batch, ctx = shape
        bw = f"{100 * ours['gbs'] / peak:.0f}%" if kernel == "decode" else "-"
        static, int4 = impl.replace("int8", "int8_static"), impl.replace("int8", "int4")
        if kernel == "write" and ours.get("slots") == "consecutive":
            kernel = "write, consecutive slots"
        lines.append(
            f"| {label[impl] or kernel} | {nq}/{nkv}, {d} | {batch} | {ctx if ctx else '-'} | "
            f"{ours['ms'] * 1e3:.1f} | {bw} | {ratio('bf16_fa2')} | {ratio('bf16')} | "
            f"{ratio('upstream_int8_pth')} | {fa2_over(static)} |"
            + (f" {fa2_over(int4)} |" if with_int4 else "")
        )
    return "\n".join(lines)


def kernel_targets_table(path: Path = RESULTS / "kernels.json") -> str:
    """Issue 3's targets against every row of kernels.json they apply to: how many rows meet
    each, and the spread of the measure over those rows."""
    result = json.loads(path.read_text())
    peak = result["peak_bw_gbs"]
    rows = result["rows"]

    def measured(r: dict, impl: str) -> tuple:
        """What ``r`` measures, timed by ``impl``."""
        shape = (r["q_heads"], r["kv_heads"], r["head_dim"], r["batch"], r["ctx"])
        return (r["kernel"], impl, *shape, r.get("slots"))

    by_key = {measured(r, r["impl"]): r for r in rows}

    def over(kernel: str, mine: str, other: str, select) -> list[float]:
        """other's time / mine's (>1: mine faster) on every row ``select`` keeps."""
        return [by_key[measured(r, other)]["ms"] / r["ms"] for r in rows
                if r["kernel"] == kernel and r["impl"] == mine and select(r)
                and measured(r, other) in by_key]  # fmt: skip

    def long_decode(r: dict) -> bool:
        return r["ctx"] >= 8192 and r["batch"] >= 8

    def short_decode(r: dict) -> bool:
        return r["ctx"] == 1024

    def decode_step(r: dict) -> bool:
        return r["slots"] == "random"

    every = lambda r: True  # noqa: E731
    bw = [100 * r["gbs"] / peak for r in rows
          if r["kernel"] == "decode" and r["impl"] == "int8" and long_decode(r)]  # fmt: skip
    targets = [
        ("decode, ctx ≥ 8K, batch ≥ 8: vs `bf16_fa2`", "≥ 1.6x",
         over("decode", "int8", "bf16_fa2", long_decode), 1.6, "x"),
        ("decode, ctx ≥ 8K, batch ≥ 8: vs `bf16` (Triton)", "≈ 2.5x",
         over("decode", "int8", "bf16", long_decode), None, "x"),
        ("decode, ctx ≥ 8K, batch ≥ 8: vs `upstream_int8_pth`", "≥ 2x",
         over("decode", "int8", "upstream_int8_pth", long_decode), 2.0, "x"),
        ("decode, ctx ≥ 8K, batch ≥ 8: % of copy bandwidth", "≥ 80%", bw, 80.0, "%"),
        ("decode, ctx 1K: vs `bf16_fa2`", "≥ 1.0x",
         over("decode", "int8", "bf16_fa2", short_decode), 1.0, "x"),
        ("prefill, gather + FA2 (the shim's path): vs `bf16_fa2`", "≥ 0.9x",
         over("prefill", "int8_fa2", "bf16_fa2", every), 0.9, "x"),
        ("prefill, gather + FA2: vs `bf16` (Triton)", "≥ 1.0x",
         over("prefill", "int8_fa2", "bf16", every), 1.0, "x"),
        ("prefill, our Triton kernel: vs `bf16_fa2`", "≥ 0.9x",
         over("prefill", "int8", "bf16_fa2", every), 0.9, "x"),
        ("write, 256 random slots: BF16 time / ours", "≥ 0.87x (≤ 1.15x the time)",
         over("write", "int8", "bf16_fa2", decode_step), 1 / 1.15, "x"),
    ]  # fmt: skip
    lines = [
        f"{result['gpu']}, `{path.name}` ({len(rows)} rows). Per target: the rows it applies to "
        "(`int8`, every model shape), how many meet it, and the measure's spread over them.",
        "",
        "| target | wanted | rows | met | min | median | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, wanted, values, bound, unit in targets:
        fmt = (lambda v: f"{v:.0f}%") if unit == "%" else (lambda v: f"{v:.2f}x")
        met = "-" if bound is None else str(sum(v >= bound for v in values))
        spread = [min(values), statistics.median(values), max(values)] if values else []
        cells = " | ".join(map(fmt, spread)) if values else "- | - | -"
        lines.append(f"| {name} | {wanted} | {len(values)} | {met} | {cells} |")
    return "\n".join(lines)


def _short(command: str) -> str:
    # The interpreter path and $OUT differ per machine; the script and its flags are what matter.
    parts = command.split()
    script = next((i for i, p in enumerate(parts) if p.endswith(".py")), 0)
    kept: list[str] = []
    for part in parts[script:]:
        if part.startswith("/"):  # a machine-local output path: drop it with its flag
            if kept and kept[-1].startswith("--"):
                kept.pop()
            continue
        kept.append(part)
    return "python " + " ".join(kept)


def accuracy_table(path: Path = RESULTS / "accuracy.json") -> str:
    """Perplexity through the cache and agreement with BF16, per KV-cache dtype."""
    result = json.loads(path.read_text())
    details_path = path.with_name(path.stem + "_details.json")
    runs = json.loads(details_path.read_text())["runs"] if details_path.exists() else {}
    ref = result["rows"][0]
    ref_tokens = runs.get(ref["dtype"], {}).get("kv_cache_tokens")
    lines = [
        f"{result['model']} on `{result['corpus']}` ({result['tokens']} tokens scored), "
        f"{result['gpu']}, `{_short(result['command'])}`. ΔPPL and KV tokens are relative to "
        f"`{ref['dtype']}` (BF16).",
        "",
        "| `--kv-cache-dtype` | PPL | ΔPPL | top-1 agree | mean KL | greedy agree "
        "| identical continuations | KV tokens vs BF16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        run = runs.get(row["dtype"], {})
        seq = run.get("greedy_seq_agree")
        tokens = run.get("kv_cache_tokens")
        lines.append(
            f"| `{row['dtype']}` | {row['ppl']:.3f} | {100 * (row['ppl'] / ref['ppl'] - 1):+.3f}% "
            f"| {_num(row['top1_agree'], '.4f')} | {_num(row['kld'], '.5f')} "
            f"| {row['greedy_agree']:.3f} | {_num(seq, '.0%')} "
            f"| {f'{tokens / ref_tokens:.2f}x' if tokens and ref_tokens else 'n/a'} |"
        )
    calibrations = [
        f"`{label}` {run['calibrate_s']:.0f} s"
        for label, run in runs.items()
        if "calibrate_s" in run
    ]
    if calibrations:
        lines += ["", f"`int8kv calibrate` (shipped text, defaults): {', '.join(calibrations)}."]
    return "\n".join(lines)


def throughput_table(path: Path = RESULTS / "throughput.json") -> str:
    """Generation throughput per configuration and context, with ratios against the baselines."""
    result = json.loads(path.read_text())
    rows = {(r["dtype"], r["ctx"]): r for r in result["rows"]}
    bases = ("auto_fa2", "auto_triton", "int8_per_token_head")
    lines = [
        f"{result['model']}, {result['gpu']}, `{_short(result['command'].split(' ; ')[0])}`"
        + (
            " (rows of several runs, see the file's `command`)"
            if " ; " in result["command"]
            else ""
        )
        + ".",
        "",
        "| config | ctx | prompts | gen tok/s | vs `auto_fa2` | vs `auto_triton` "
        "| vs `int8_per_token_head` | KV tokens | vs BF16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (dtype, ctx), row in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ratios = []
        for base in bases:
            other = rows.get((base, ctx))
            ratios.append(f"{row['gen_tok_s'] / other['gen_tok_s']:.2f}x" if other else "n/a")
        bf16 = rows.get(("auto_fa2", ctx)) or rows.get(("auto_triton", ctx))
        cap = f"{row['kv_cache_tokens'] / bf16['kv_cache_tokens']:.2f}x" if bf16 else "n/a"
        lines.append(
            f"| `{dtype}` | {ctx} | {row['num_prompts']} | {row['gen_tok_s']:.0f} | "
            + " | ".join(ratios)
            + f" | {row['kv_cache_tokens']} | {cap} |"
        )
    return "\n".join(lines)


# Session 9's 1K runs on one H200 host, in the order they ran (each folder: one throughput.py call)
S9_RUNS = ("throughput_int8_1k_run1", "throughput_auto_fa2_1k", "throughput_int8_1k_run2")


def step_runs_table(folders: tuple[str, ...] = S9_RUNS) -> str:
    """One line per timed run (each call's throughput.json and ``--step-stats`` details file):
    speed, engine steps, time per step.
    Runs of one workload with different times per step ran on a host whose speed moved."""
    lines = [
        "| run (in order) | config | gen tok/s | engine steps | tokens per step | ms per step |",
        "|---|---|---|---|---|---|",
    ]
    for folder in folders:
        run = RESULTS / "logs" / "session9" / folder
        speed = {(r["dtype"], r["ctx"]): r["gen_tok_s"]
                 for r in json.loads((run / "throughput.json").read_text())["rows"]}  # fmt: skip
        for r in json.loads((run / "throughput_details.json").read_text())["rows"]:
            lines.append(
                f"| `{folder}` | `{r['dtype']}` | {speed[r['dtype'], r['ctx']]:.0f} "
                f"| {r['engine_steps']} | {r['tokens_per_step']:.0f} | {r['ms_per_step']:.1f} |"
            )
    return "\n".join(lines)


# Session 11's 1K calls on one H200 host, in order (throughput.py --repeats: several runs each)
S11_RUNS = ("5_throughput_1k_fa2", "6_throughput_1k_int8", "9_throughput_1k_int8_fa2")
S12_RUNS = ("5_throughput_1k_fa2", "6_throughput_1k_int8", "8_throughput_1k_int8_fa2")
S13_PAIRED = ("5_paired_1k_r1", "6_paired_1k_r3")


def repeat_runs_table(folders: tuple[str, ...] = S11_RUNS, session: str = "session11") -> str:
    """One line per timed run of ``throughput.py --repeats`` calls (their details files), in the
    order they ran, with the host probe (a fixed Python loop timed just before each run)."""
    lines = [
        "| call (in order) | config | run | gen tok/s | engine steps | tokens per step "
        "| ms per step | host probe ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for folder in folders:
        details = RESULTS / "logs" / session / folder / "throughput_details.json"
        for r in json.loads(details.read_text())["rows"]:
            for i, run in enumerate(r["runs"], 1):
                lines.append(
                    f"| `{folder}` | `{r['dtype']}` | {i} | {run['gen_tok_s']:.0f} "
                    f"| {run['engine_steps']} | {run['tokens_per_step']:.0f} "
                    f"| {run['ms_per_step']:.1f} | {run['host_probe_ms']:.1f} |"
                )
    return "\n".join(lines)


def paired_runs_table(details_paths: list[Path]) -> str:
    """One line per turn pair of ``throughput.py --paired`` calls (their details files): both
    configurations' runs, taken back to back in the order shown, their host probes and the B/A
    ratio; the last line per call and context is the median ratio the details file holds."""
    lines = [
        "| call | ctx | turn | order | A gen tok/s (probe ms) | B gen tok/s (probe ms) | B/A |",
        "|---|---|---|---|---|---|---|",
    ]
    every_call: dict[tuple[str, str, int], list[float]] = {}
    for path in details_paths:
        details = json.loads(path.read_text())
        runs = {(r["dtype"], r["ctx"]): r["runs"] for r in details["rows"] if "runs" in r}
        for pair in details.get("paired", []):
            a, b, ctx = pair["a"], pair["b"], pair["ctx"]
            label = f"`{path.parent.name}`"
            # throughput.paired_ratios writes one order entry and one ratio per pair of runs
            turns = zip(runs[(a, ctx)], runs[(b, ctx)], pair["order"], pair["ratios"], strict=True)
            for k, (ra, rb, order, ratio) in enumerate(turns, 1):
                lines.append(
                    f"| {label} | {ctx} | {k} | {' '.join(f'`{x}`' for x in order)} "
                    f"| {ra['gen_tok_s']:.0f} ({ra['host_probe_ms']:.1f}) "
                    f"| {rb['gen_tok_s']:.0f} ({rb['host_probe_ms']:.1f}) | {ratio:.2f}x |"
                )
            lines.append(
                f"| {label} | {ctx} | median | A = `{a}`, B = `{b}` | | | "
                f"**{pair['median_ratio']:.2f}x** |"
            )
            every_call.setdefault((a, b, ctx), []).extend(pair["ratios"])
    if len(details_paths) > 1:
        for (a, b, ctx), ratios in every_call.items():
            # the lower median, as throughput.paired_ratios takes within a call
            lines.append(
                f"| all calls | {ctx} | median of {len(ratios)} | A = `{a}`, B = `{b}` | | | "
                f"**{statistics.median_low(ratios):.2f}x** |"
            )
    return "\n".join(lines)


# vLLM's torch-profiler table (profile_LABEL_CTX.txt): columns split by runs of 2+ spaces
_PROFILE_COLS = ("name", "self_cpu_pct", "self_cpu", "cpu_total_pct", "cpu_total", "cpu_avg",
                 "self_cuda", "self_cuda_pct", "cuda_total", "cuda_avg", "calls")  # fmt: skip
# our backend's custom ops and FlashAttention-2's: where each configuration's attention host time
# shows up (vLLM lists only the rows with the most CUDA time, so one may be missing)
_ATTENTION_OPS = ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update",
                  "_vllm_fa2_C::varlen_fwd", "_C_cache_ops::reshape_and_cache_flash")  # fmt: skip


def _seconds(text: str) -> float:
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise ValueError(f"not a time: {text!r}")


def parse_profile(path: Path) -> dict:
    """Wall time, total GPU kernel time and per-op host time of a ``throughput.py --profile`` table."""
    import re

    lines = path.read_text().splitlines()
    wall = float(re.search(r"([\d.]+) s wall", lines[0]).group(1))
    ops: dict[str, dict] = {}
    for line in lines:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(_PROFILE_COLS) or not cells[-1].isdigit():
            continue
        row = dict(zip(_PROFILE_COLS, cells, strict=True))
        ops.setdefault(row["name"], row)  # the first (largest) row of a repeated name
    gpu = _seconds(re.search(r"Self CUDA time total: (\S+)", "\n".join(lines[-3:])).group(1))
    return {"wall_s": wall, "gpu_s": gpu, "ops": ops}


def profile_table(
    throughput_path: Path = RESULTS / "throughput_profiled_1k.json",
    logs: Path = RESULTS / "logs",
) -> str:
    """The profiled 1K pair: throughput, and per configuration GPU busy time against wall time
    and the host time of the attention ops, from the profile tables next to it."""
    result = json.loads(throughput_path.read_text())
    lines = [
        throughput_table(throughput_path),
        "",
        "| config | profiled generate, wall s | GPU kernel time, s | GPU busy | host time per call "
        "of the attention ops listed (CPU total) |",
        "|---|---|---|---|---|",
    ]
    for row in sorted(result["rows"], key=lambda r: r["dtype"]):
        prof = parse_profile(logs / f"profile_{row['dtype']}_{row['ctx']}.txt")
        host = ", ".join(
            f"`{name}` {_seconds(op['cpu_total']) * 1e6 / int(op['calls']):.0f} µs"
            for name in _ATTENTION_OPS
            if (op := prof["ops"].get(name))
        )
        lines.append(
            f"| `{row['dtype']}` | {prof['wall_s']:.2f} | {prof['gpu_s']:.2f} | "
            f"{100 * prof['gpu_s'] / prof['wall_s']:.0f}% | {host} |"
        )
    return "\n".join(lines)


def launch_overhead_table(
    path: Path = RESULTS / "launch_overhead.json",
    wrappers_path: Path = RESULTS / "launch_overhead_wrappers.json",
) -> str:
    """Host time per call of the kernel wrappers (benchmarks/launch_overhead.py): on the GPU per
    launch path, and our wrappers' own Python (``--stub-launches``, on a CPU)."""
    result = json.loads(path.read_text())
    wrappers = json.loads(wrappers_path.read_text()) if wrappers_path.exists() else {}
    columns = [
        (result, "_host_us", "GPU host, Triton's `kernel[grid]`"),
        (result, "_direct_host_us", "GPU host, `DirectLauncher`"),
        (result, "_replay_host_us", "GPU host, replay (layers after the first)"),
        (wrappers, "_wrapper_us", "our wrapper's Python (CPU, launches stubbed)"),
        (wrappers, "_binder_us", "Triton's binder alone (CPU, sm80 target)"),
    ]
    columns = [c for c in columns if f"write_kv_cache{c[1]}" in c[0]]
    lines = [
        f"{result['gpu']}, Triton {result['triton']}, `{_short(result['command'])}`"
        + (f"; `{_short(wrappers['command'])}` on a CPU" if wrappers else "")
        + ". Microseconds per call:",
        "",
        "| call | " + " | ".join(label for _, _, label in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name, label in (("noop", "a 2-argument Triton kernel"),
                        ("write_kv_cache", "`write_kv_cache`"),
                        ("paged_attention", "`paged_attention` (decode)")):  # fmt: skip
        cells = " | ".join(
            f"{res[name + suffix]:.1f}" if name + suffix in res else "-"  # no replay of noop
            for res, suffix, _ in columns
        )
        lines.append(f"| {label} | {cells} |")
    return "\n".join(lines)


def reliability_table(
    soak_path: Path = RESULTS / "soak.json", long_path: Path = RESULTS / "long_context.json"
) -> str:
    """The serving soak and the long-context comparison, one line each."""
    soak = json.loads(soak_path.read_text())
    long = json.loads(long_path.read_text())
    ref = long["reference"]
    lines = [
        "| check | model, GPU | command | result |",
        "|---|---|---|---|",
        f"| serving soak, `--kv-cache-dtype {soak['dtype']}` | {soak['model']}, {soak['gpu']} "
        f"| `{_short(soak['command'])}` | {soak['requests']} requests "
        f"({soak['completed']} completed, {soak['cancelled']} cancelled mid-stream, "
        f"{soak['shared_prefix_requests']} on shared prefixes), up to {soak['max_in_flight']} in "
        f"flight, {soak['errors']} errors, probes identical before and after: "
        f"{'yes' if soak['probe_identical'] else 'NO'} ({soak['load_s']:.0f} s of load) |",
    ]
    for dtype in dict.fromkeys(r["dtype"] for r in long["rows"]):
        if dtype == ref:
            continue
        rows = [r for r in long["rows"] if r["dtype"] == dtype]
        same = sum(r["identical_first_32"] for r in rows)
        kinds = sorted({r["divergence"] for r in rows} - {"none"})
        nan = sum(r["nan"] for r in rows)
        lines.append(
            f"| long context, `{dtype}` vs `{ref}` | {long['model']}, {long['gpu']} "
            f"| `{_short(long['command'])}` | {len(rows)} prompts of {long['prompt_len']} tokens: "
            f"{same}/{len(rows)} identical over the first 32 generated tokens"
            + (f" (divergences: {', '.join(kinds)})" if kinds else "")
            + f", {nan} with NaN |"
        )
    return "\n".join(lines)


def kv_quant_sim_table(path: Path = RESULTS / "kv_quant_sim.json") -> str:
    """ΔPPL of simulated cache formats (benchmarks/kv_quant_sim.py)."""
    result = json.loads(path.read_text())
    lines = [
        f"{result['model']} on `{result['corpus']}` ({result['tokens']} tokens, windows of "
        f"{result['window']}), {result['device']}, `{_short(result['command'])}`.",
        "",
        "| variant | PPL | ΔPPL | ± (s.e.) | K+V bytes per token and head | capacity vs BF16 |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| `{row['variant']}` | {row['ppl']:.3f} | {row['delta_pct']:+.2f}% "
            f"| {_num(row['delta_se_pct'], '.2f')} | {row['kv_bytes_per_token_head']:g} "
            f"| {row['capacity_vs_bf16']:.2f}x |"
        )
    return "\n".join(lines)


def issue_budget_table(path: Path = RESULTS / "decode_issue_budget.json") -> str:
    """Share of the SMs' instruction issue the decode loop needs at each GPU's peak bandwidth."""
    result = json.loads(path.read_text())
    rows = result["rows"]
    gpus = list(result["gpus"])
    lines = [
        f"`{result['command']}` (sm80 PTX of the decode loop; GPU figures from spec sheets).",
        "",
        "| dtype | q/kv heads, dim | warp-instructions per KiB of K/V | " + " | ".join(gpus) + " |",
        "|---|---|---|" + "---|" * len(gpus),
    ]

    def shape(r: dict) -> str:
        return f"{r['q_heads']}/{r['kv_heads']}, {r['head_dim']}"

    for r in rows:
        share = r["issue_share_at_peak_bandwidth"]
        cells = " | ".join(f"{100 * share[g]:.0f}%" for g in gpus)
        lines.append(
            f"| `{r['kv_dtype']}` | {shape(r)} | {r['warp_instructions_per_kib']:.0f} | {cells} |"
        )
    for r in rows:
        per_sm = r["programs_per_sm"]
        lines.append(
            f"| `{r['kv_dtype']}` programs per SM ({r['registers']} registers, "
            f"{r['shared_bytes'] / 1024:.0f} KiB shared memory) | {shape(r)} | - | "
            + " | ".join(str(per_sm[g]) for g in gpus)
            + " |"
        )
    return "\n".join(lines)


# Decode launch configs compared (tile, warps, stages; tune_decode.py): the default first
TUNE_CONFIGS = ((128, 4, 5), (128, 4, 4), (64, 4, 5), (64, 4, 4))


def tune_decode_table(path: Path = RESULTS / "tune_decode.json") -> str:
    """Per decode shape, the int8 kernel's bandwidth fraction under each of TUNE_CONFIGS (its best
    split count, no in-program split-K) and the sweep's best config."""
    result = json.loads(path.read_text())
    best: dict[tuple, dict[tuple, float]] = {}
    for r in result["rows"]:
        if r["dtype"] == "int8" and r["chunks"] == 1:
            shape = best.setdefault((r["batch"], r["ctx"]), {})
            config = (r["tile"], r["warps"], r["stages"])
            shape[config] = max(shape.get(config, 0.0), r["frac"])
    q, kv, d = result["shape"]
    lines = [
        f"{result['gpu']}, {q}/{kv} heads, D={d}, copy bandwidth {result['copy_gbs']:.0f} GB/s, "
        f"`{_short(result['command'])}`. Per cell: % of copy bandwidth (tile, warps, stages).",
        "",
        "| batch | ctx | "
        + " | ".join("/".join(map(str, c)) for c in TUNE_CONFIGS)
        + " | best of the sweep |",
        "|---|---|" + "---|" * (len(TUNE_CONFIGS) + 1),
    ]
    for (batch, ctx), fracs in best.items():
        top = max(fracs, key=fracs.get)
        cells = " | ".join(f"{100 * fracs[c]:.0f}%" if c in fracs else "-" for c in TUNE_CONFIGS)
        lines.append(
            f"| {batch} | {ctx} | {cells} | {'/'.join(map(str, top))}: {100 * fracs[top]:.0f}% |"
        )
    return "\n".join(lines)


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


TABLES = {
    "kernels": kernels_table,
    "kernel_targets": kernel_targets_table,
    "kernels_quick_s13": lambda: kernels_table(RESULTS / "kernels_quick_s13.json"),
    "accuracy": accuracy_table,
    "throughput": throughput_table,
    "profile_1k": profile_table,
    "kernels_smol_b1024": lambda: kernels_table(RESULTS / "kernels_smol_b1024.json"),
    "launch_overhead": launch_overhead_table,
    "throughput_1k_direct": lambda: throughput_table(RESULTS / "throughput_1k_direct.json"),
    "throughput_1k_s9": lambda: throughput_table(RESULTS / "throughput_1k_s9.json"),
    "throughput_1k_s9_runs": step_runs_table,
    "reliability": reliability_table,
    "kv_quant_sim": kv_quant_sim_table,
    "issue_budget": issue_budget_table,
    "throughput_1k_s11": lambda: throughput_table(RESULTS / "throughput_1k_s11.json"),
    "throughput_1k_s11_runs": repeat_runs_table,
    "throughput_1k_s12_runs": lambda: repeat_runs_table(S12_RUNS, "session12"),
    "throughput_1k_s13_paired": lambda: paired_runs_table(
        [RESULTS / "logs/session13" / c / "throughput_details.json" for c in S13_PAIRED]
    ),
    "tune_decode": tune_decode_table,
    "tune_decode_9_3_64": lambda: tune_decode_table(RESULTS / "tune_decode_9_3_64.json"),
}

if __name__ == "__main__":
    print(TABLES[sys.argv[1]]())
