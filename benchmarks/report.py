"""Markdown tables for README.md and docs/, generated from the result files (numbers are never typed).

    python -m benchmarks.report NAME                    # print one table; NAME is a key of TABLES
    python -m benchmarks.report --profile-summary FILE  # a `throughput.py --profile` table as the
                                                        # JSON entry `throughput_1k_profiled` reads

Each caption names the GPU, the date and git commit of the measurement (the commit that added it)
and the command as recorded. tests/test_readme_results.py checks that every table is quoted
verbatim in README.md, docs/results.md or docs/measurement-history.md.
"""

from __future__ import annotations

import collections
import functools
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from benchmarks.common import config_for
from benchmarks.profile_summary import NAMES as PROFILE_CATEGORIES
from benchmarks.step_timing import RENDER, REQUEST_MILESTONES
from benchmarks.warmup_compile import MODELS as WARMUP_MODELS
from int8kv_kernels.catalogue import CATALOGUE, TAIL_DTYPES

RESULTS = Path(__file__).resolve().parent / "results"

# Head size of the models the accuracy files measure (from their config.json): for a dtype the
# accuracy run did not serve, capacity comes from the catalogue's bytes per token at this size.
MODEL_HEAD_SIZE = {"SmolLM2-135M-Instruct": 64, "gemma-3-270m": 256}


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _provenance(doc: dict) -> str:
    """``2026-12-01, commit `c1c5ebb```: when the measurement entered the repository."""
    if "git_commit" not in doc:
        return "date and commit not recorded"
    # a file whose rows came from several runs names each run's commit
    parts = [doc] + [q for q in doc.get("parts", []) if q["git_commit"] != doc["git_commit"]]
    return " and ".join(map(_run, parts))


def _run(stamp: dict) -> str:
    """``2026-12-01, commit `c1c5ebb```: one run's date and commit (a file's or a part's)."""
    return f"{stamp['date']}, commit `{stamp['git_commit'][:7]}`"


def _run_of_row(doc: dict, label: str) -> str:
    """The run (``_run``'s form) a row of a file merged from several came from: the part whose
    ``rows`` note lists ``label`` (before any bracketed remark), else the file's own stamp."""
    for q in doc.get("parts", []):
        listed = str(q.get("rows", "")).split("(")[0]
        if re.search(rf"(?<![\w]){re.escape(label)}(?![\w])", listed):
            return _run(q)
    return _run(doc)


def _short(command: str) -> str:
    # The interpreter path and $OUT differ per machine; the script and its flags are what matter.
    parts = command.split()
    # from the script's path, or from ``-m`` of a module run (``python -m benchmarks.NAME``)
    script = next((i for i, p in enumerate(parts) if p.endswith(".py") or p == "-m"), 0)
    kept: list[str] = []
    for part in parts[script:]:
        if part.startswith("/"):  # a machine-local output path: drop it with its flag
            if kept and kept[-1].startswith("--"):
                kept.pop()
            continue
        kept.append(part)
    return "python " + " ".join(kept)


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _spread(values: list[float]) -> str:
    """``1.58x (1.33-2.05x)``: median and range of speed ratios."""
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f}x)"


# --------------------------------------------------------------------------------------------
# kernels.json and its kind: microbenchmarks of the attention and write kernels


def _point(r: dict) -> tuple:
    """What a kernels row measures, whoever timed it: shape, batch, context and, for a decode on a
    sliding-window layer, its window (such rows compare only with rows of the same window)."""
    return (r["q_heads"], r["kv_heads"], r["head_dim"], r["batch"], r["ctx"], r.get("window"))


def _decode_over_fa2(rows: list[dict], impl: str) -> list[float]:
    """FlashAttention-2's decode time over ``impl``'s at every full-attention point both timed
    (>1: faster)."""
    fa2 = {
        _point(r): r["ms"]
        for r in rows
        if r["kernel"] == "decode" and r["impl"] == "bf16_fa2" and not r.get("window")
    }
    return [
        fa2[key] / r["ms"]
        for r in rows
        if r["kernel"] == "decode" and r["impl"] == impl and (key := _point(r)) in fa2
    ]  # fmt: skip


def _extent(result: dict) -> str:
    """``3 head shapes, batch 1-128, context 1K-32K``: what a kernels file's decode rows span."""
    rows = [r for r in result["rows"] if r["kernel"] == "decode"]
    shapes = {(r["q_heads"], r["kv_heads"], r["head_dim"]) for r in rows}
    batches, ctxs = [r["batch"] for r in rows], [r["ctx"] for r in rows]
    if len(shapes) == 1:
        ((nq, nkv, d),) = shapes
        what = f"{nq}/{nkv} heads, head size {d}"
    else:
        what = f"{len(shapes)} head shapes"
    return (f"{what}, batch {min(batches)}-{max(batches)}, "
            f"context {min(ctxs) // 1024}K-{max(ctxs) // 1024}K")  # fmt: skip


def kernel_speed_table(path: Path = RESULTS / "kernels.json") -> str:
    """Decode/prefill/write times of our int8 kernels against FA2, vLLM's Triton and upstream int8."""
    result = _load(path)
    ms = {(r["kernel"], r["impl"], *_point(r)): r for r in result["rows"]}
    peak = result["peak_bw_gbs"]
    # int4 (experimental) has a column only in files that time it
    with_int4 = any(r["impl"] == "int4" for r in result["rows"])
    lines = [
        f"{result['gpu']}, copy bandwidth {peak:.0f} GB/s, {_provenance(result)}, "
        f"`{_short(result['command'])}`.",
        "Speedups are the other kernel's time over ours (>1: ours faster); %bw counts the bytes "
        "`int8` must read; `decode, window W` is a sliding-window layer's decode, which reads only "
        "the window's keys.",
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
        ms.items(),
        key=lambda kv: (order.get(kv[0][0], 3), kv[0][2:7], kv[0][7] or 0, kv[0][1]),
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

        nq, nkv, d, batch, ctx, window = shape
        bw = f"{100 * ours['gbs'] / peak:.0f}%" if kernel == "decode" else "-"
        if window:
            kernel = f"decode, window {window}"
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


class _PrefillRows:
    """A kernel run's prefill rows by (q heads, kv heads, head size, new tokens, impl), and the
    cells of a prefill table: µs of an impl, and the ratio of two impls' times."""

    def __init__(self, result: dict) -> None:
        prefill = [r for r in result["rows"] if r["kernel"] == "prefill"]
        self.rows = {(r["q_heads"], r["kv_heads"], r["head_dim"], r["q_len"], r["impl"]): r
                     for r in prefill}  # fmt: skip
        self.ctxs = sorted({r["ctx"] for r in prefill})
        # largest head size, then most query heads, then fewest new tokens first
        self.keys = sorted({k[:4] for k in self.rows}, key=lambda k: (-k[2], -k[0], k[3]))

    def us(self, key: tuple, impl: str) -> str:
        row = self.rows.get((*key, impl))
        return f"{row['ms'] * 1e3:.1f}" if row else "n/a"

    def ratio(self, key: tuple, num: str, den: str) -> str:
        a, b = self.rows.get((*key, num)), self.rows.get((*key, den))
        return f"{a['ms'] / b['ms']:.2f}x" if a and b else "n/a"


def continuation_table(path: Path = RESULTS / "kernels_continuations.json") -> str:
    """Prefill rows of a few new tokens over one long sequence (the end of a chunked prompt),
    per model shape: our kernels with their keys split (as they launch) and unsplit (as every
    prefill launched before), ``int8``'s context gather + FlashAttention-2, against
    FlashAttention-2 on BF16."""
    result = _load(path)
    p = _PrefillRows(result)
    lines = [
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'])}`. One sequence "
        f"of {', '.join(map(str, p.ctxs))} keys whose last `new` are the new tokens; µs per "
        "launch (per pair for the gather + FlashAttention-2 path). Unsplit: our kernel with "
        "every key of a query block in one program; split: the keys spread over programs while "
        "those would leave SMs idle (`int4` is its default, the sink page and two tail pages).",
        "",
        "| q/kv heads, dim | new | `bf16_fa2` µs | `int8` µs | `int8` unsplit µs | split speedup "
        "| `int8` vs `bf16_fa2` | gather + FA2 µs | `int4` µs | `int4` unsplit µs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in p.keys:
        nq, nkv, d, q_len = key
        lines.append(
            f"| {nq}/{nkv}, {d} | {q_len} | "
            + " | ".join((
                p.us(key, "bf16_fa2"), p.us(key, "int8"), p.us(key, "int8_unsplit"),
                p.ratio(key, "int8_unsplit", "int8"), p.ratio(key, "bf16_fa2", "int8"),
                p.us(key, "int8_fa2"), p.us(key, "int4_sink_tail2"),
                p.us(key, "int4_sink_tail2_unsplit"),
            ))
            + " |"
        )  # fmt: skip
    return "\n".join(lines)


def int4_prefill_table(path: Path = RESULTS / "kernels_prefill_int4.json") -> str:
    """Prefill of ``new`` tokens over one long sequence (a chunked prompt's continuation), per
    model shape: ``int4`` (as it ships) on our kernel and through its context gather +
    FlashAttention-2, beside ``int8``'s gather + FlashAttention-2 and FlashAttention-2 on BF16."""
    result = _load(path)
    p = _PrefillRows(result)
    lines = [
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'])}`. One sequence "
        f"of {', '.join(map(str, p.ctxs))} keys (`int4`: 13 more, its partial page) whose last "
        "`new` are the new tokens; µs per launch, per pair for a gather + FlashAttention-2 "
        "path (the gather's BF16 copy of the whole context, then FlashAttention-2 over it).",
        "",
        "| q/kv heads, dim | new | `bf16_fa2` µs | `int8` gather + FA2 µs | `int4` ours µs "
        "| `int4` gather + FA2 µs | `int4` gather + FA2 vs ours | vs `int8` gather + FA2 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in p.keys:
        nq, nkv, d, q_len = key
        lines.append(
            f"| {nq}/{nkv}, {d} | {q_len} | "
            + " | ".join((
                p.us(key, "bf16_fa2"), p.us(key, "int8_fa2"), p.us(key, "int4_sink_tail2"),
                p.us(key, "int4_sink_tail2_fa2"),
                p.ratio(key, "int4_sink_tail2", "int4_sink_tail2_fa2"),
                p.ratio(key, "int8_fa2", "int4_sink_tail2_fa2"),
            ))
            + " |"
        )  # fmt: skip
    # "IMPL ('prefill', nq, nkv, d, batch, ctx, q_len): Error: message" (benchmarks/kernels.py)
    entry = re.compile(r"(\S+) \('prefill', (\d+), (\d+), (\d+), \d+, \d+, (\d+)\): (\w+)")
    skipped = [m.groups() for s in result.get("skipped", []) if (m := entry.match(s))]
    if skipped:
        lines += ["", "Not timed (the run's `skipped`): " + "; ".join(
            f"`{impl}` at {nq}/{nkv}, {d}, {q_len} new ({error})"
            for impl, nq, nkv, d, q_len, error in skipped
        ) + "."]  # fmt: skip
    return "\n".join(lines)


def int4_decode_parts_table(path: Path = RESULTS / "kernels_int4_head64_parts.json") -> str:
    """``int4``'s decode with its parts added one at a time (one BF16 tail page, two, then the
    sink page; the last, as ``int8``, also without split-KV) against ``int8``'s, µs per launch of
    one run."""
    result = _load(path)
    ms = {(r["impl"], *_point(r)): r["ms"] for r in result["rows"] if r["kernel"] == "decode"}
    impls = ["int8", "int8_unsplit", "int4", "int4_tail2", "int4_sink_tail2",
             "int4_sink_tail2_unsplit"]  # fmt: skip
    impls = [i for i in impls if any(k[0] == i for k in ms)]
    points = sorted({k[1:] for k in ms})
    lines = [
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'])}`. µs per launch "
        "(a split launch with its merge), CUDA graphs; in brackets the time over `int8`'s. "
        "`int4`: one BF16 tail page, no sink page; `int4_tail2`: two tail pages; "
        "`int4_sink_tail2`: two and the sink page (`int4` as it ships); `_unsplit`: "
        "without split-KV.",
        "",
        "| q/kv heads, dim | batch | ctx | " + " | ".join(f"`{i}`" for i in impls) + " |",
        "|---|---|---|" + "---|" * len(impls),
    ]
    for key in points:
        nq, nkv, d, batch, ctx, _ = key
        base = ms.get(("int8", *key))
        cells = []
        for impl in impls:
            t = ms.get((impl, *key))
            cells.append(
                "n/a" if t is None
                else f"{t * 1e3:.1f}" if impl == "int8" or base is None
                else f"{t * 1e3:.1f} ({t / base:.2f}x)"
            )  # fmt: skip
        lines.append(f"| {nq}/{nkv}, {d} | {batch} | {ctx} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernel_write_table(path: Path) -> str:
    """The cache write of one step, per dtype: a decode step's tokens at random slots and a
    prompt's tokens filling whole pages, µs per step against FlashAttention-2's BF16 write."""
    result = _load(path)
    rows = [r for r in result["rows"] if r["kernel"] == "write"]
    ms = {(r["impl"], r["q_heads"], r["kv_heads"], r["head_dim"], r["batch"], r["slots"]): r
          for r in rows}  # fmt: skip
    lines = [
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'])}`. µs per step's "
        "write, CUDA graphs; `int4`'s is its page flush and tail store after a copy that restores "
        "its tail slots' pages (one int32 per sequence), without its sink store (a launch of its "
        "own).",
        "",
        "| q/kv heads, dim | tokens | slots | dtype | µs | vs `bf16_fa2`'s write | vs `int8`'s |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in sorted(ms, key=lambda k: (k[1:], k[0] != "bf16_fa2", k[0] != "int8", k[0])):
        impl, nq, nkv, d, tokens, slots = key
        t = ms[key]["ms"]

        def over(other: str, key: tuple = key, t: float = t) -> str:
            row = ms.get((other, *key[1:]))
            return "reference" if other == key[0] else f"{t / row['ms']:.2f}x" if row else "n/a"

        lines.append(
            f"| {nq}/{nkv}, {d} | {tokens} | {slots} | `{impl}` | {t * 1e3:.1f} | "
            f"{over('bf16_fa2')} | {over('int8')} |"
        )
    return "\n".join(lines)


def int4_decode_table(path: Path = RESULTS / "kernels_int4.json", impl: str = "int4") -> str:
    """``int4``'s decode (``impl``: the kernel bench's label of the variant judged, such as
    ``int4_sink_tail2`` for int4 as it ships) against
    FlashAttention-2 and ``int8`` timed in one run, its targets, and the fraction of the copy
    bandwidth its own bytes (pages plus tail) take."""
    result = _load(path)
    ms = {(r["impl"], *_point(r)): r for r in result["rows"] if r["kernel"] == "decode"}
    peak = result["peak_bw_gbs"]
    points = sorted({key[1:] for key in ms if key[0] == impl}, key=lambda k: (*k[:5], k[5] or 0))

    def over(a: str, b: str, key: tuple) -> float | None:
        ra, rb = ms.get((a, *key)), ms.get((b, *key))
        return ra["ms"] / rb["ms"] if ra and rb else None

    targets = [
        ("ctx ≥ 8K, batch ≥ 8, head size ≥ 128: vs `bf16_fa2`", 2.2, "bf16_fa2",
         lambda k: k[4] >= 8192 and k[3] >= 8 and k[2] >= 128 and not k[5]),
        ("ctx 1K: vs `bf16_fa2`", 1.0, "bf16_fa2", lambda k: k[4] == 1024 and not k[5]),
        ("head size 64: vs `int8`", 1.0, "int8", lambda k: k[2] == 64 and not k[5]),
        ("every full-attention point: vs `int8`", None, "int8", lambda k: not k[5]),
        ("sliding window (same window): vs `bf16_fa2`", None, "bf16_fa2", lambda k: bool(k[5])),
    ]  # fmt: skip
    lines = [
        f"{result['gpu']}, copy bandwidth {peak:.0f} GB/s, {_provenance(result)}, "
        f"`{_short(result['command'])}`. Each ratio is the other kernel's time over `{impl}`'s "
        f"(>1: `{impl}` faster), both timed in this run; every sequence has 13 keys past its "
        f"context in the BF16 tail; %bw counts the bytes `{impl}` must read.",
        "",
        "| target | wanted | points | met | min | median | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for what, wanted, other, applies in targets:
        vals = [v for k in points if applies(k) and (v := over(other, impl, k)) is not None]
        if not vals:
            lines.append(
                f"| {what} | {f'≥ {wanted}x' if wanted else '-'} | 0 | - | not measured | | |"
            )
            continue
        met = sum(v >= wanted for v in vals) if wanted else "-"
        lines.append(
            f"| {what} | {f'≥ {wanted}x' if wanted else '-'} | {len(vals)} | {met} | "
            f"{min(vals):.2f}x | {statistics.median(vals):.2f}x | {max(vals):.2f}x |"
        )
    lines += [
        "",
        f"| q/kv heads, dim | window | batch | ctx | `{impl}` µs | %bw | vs `bf16_fa2` | vs `int8` "
        "| `int8` vs `bf16_fa2` |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in points:
        nq, nkv, d, batch, ctx, window = key
        mine = ms[(impl, *key)]
        cells = [over(a, b, key) for a, b in
                 (("bf16_fa2", impl), ("int8", impl), ("bf16_fa2", "int8"))]  # fmt: skip
        lines.append(
            f"| {nq}/{nkv}, {d} | {window or '-'} | {batch} | {ctx} | {mine['ms'] * 1e3:.1f} | "
            f"{100 * mine['gbs'] / peak:.0f}% | "
            + " | ".join("n/a" if c is None else f"{c:.2f}x" for c in cells)
            + " |"
        )
    return "\n".join(lines)


def int4_decode_loops_table(path: Path = RESULTS / "int4_decode_loops.json") -> str:
    """The ``int4`` decode loops of one A/B run (``prefetch`` 0: each step's copies issued at the
    end of the step before and waited on at its start, K zeros and V scales loaded at their use; 1:
    two buffers, those loaded a step ahead; 2: page ids too) beside ``int8``, point by point."""
    result = _load(path)
    ms: dict[tuple, float] = {}
    for r in result["rows"]:
        variant = r["impl"] if r.get("prefetch") is None else f"int4/{r['prefetch']}"
        ms[(variant, *_point(r))] = r["ms"]
    points = sorted({k[1:] for k in ms if k[0] == "int4/0"}, key=lambda k: (*k[:5], k[5] or 0))
    lines = [
        f"{result['gpu']}, copy bandwidth {result['copy_gbs']:.0f} GB/s, {_provenance(result)}, "
        f"`{_short(result['command'])}`. µs per decode launch, every sequence with 13 keys in its "
        "BF16 tail; the last two columns are the other loop's time over loop 1's (>1: loop 1 "
        "faster).",
        "",
        "| q/kv heads, dim | batch | ctx | loop 0 µs | loop 1 µs | loop 2 µs | `int8` µs "
        "| loop 0 / loop 1 | `int8` / loop 1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in points:
        nq, nkv, d, batch, ctx, _ = key
        t = {v: ms.get((v, *key)) for v in ("int4/0", "int4/1", "int4/2", "int8")}
        cells = ["-" if x is None else f"{x * 1e3:.1f}" for x in t.values()]
        lines.append(
            f"| {nq}/{nkv}, {d} | {batch} | {ctx} | {' | '.join(cells)} | "
            f"{t['int4/0'] / t['int4/1']:.2f}x | {t['int8'] / t['int4/1']:.2f}x |"
        )
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Source text as a table cell: ``|`` would end the cell."""
    return "`" + text.replace("|", "\\|") + "`" if text else "-"


def decode_stalls_table(path: Path = RESULTS / "decode_stalls.json") -> str:
    """Where the decode kernels' warps stall (benchmarks/decode_stalls.py, Proton's PC sampling):
    each impl's share of samples per warp state, the 8 largest and the rest; then the source lines
    with most of ``int4``'s samples (else the first impl's), each with its top three states."""
    result = _load(path)
    rows = [r for r in result["rows"] if r.get("stalls")]
    share = {r["impl"]: {s["reason"]: s["fraction"] for s in r["stalls"]} for r in rows}
    reasons = {reason for fractions in share.values() for reason in fractions}
    shown = sorted(reasons, key=lambda x: (-sum(f.get(x, 0.0) for f in share.values()), x))[:8]
    peak, p = result["peak_bw_gbs"], rows[0]

    def row(label: str, cells: list[str]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    lines = [
        f"{result['gpu']}, copy bandwidth {peak:.0f} GB/s, {_provenance(result)}, "
        f"`{_short(result['command'])}`. Decode at {p['q_heads']}/{p['kv_heads']} heads, "
        f"D={p['head_dim']}, batch {p['batch']}, context {p['ctx']}: share of the PC samples of "
        f"the kernels matching `{result['kernel']}` over {result['launches']} launches per impl, "
        "by the sampled warp's state (`selected`: it issued)."
        + (f" {result['note'][0].upper()}{result['note'][1:]}." if result.get("note") else ""),
        "",
        row("warp state", [f"`{r['impl']}`" for r in rows]),
        "|---|" + "---|" * len(rows),
        row("µs per launch", [_num(r.get("us"), ".1f") for r in rows]),
        row(
            "% of copy bandwidth", [f"{r['gbs'] / peak:.0%}" if "gbs" in r else "n/a" for r in rows]
        ),
        row("samples", [str(r["samples"]) for r in rows]),
    ]
    lines += [row(x, [pct(share[r["impl"]].get(x, 0.0)) for r in rows]) for x in shown]
    rest = [max(0.0, 1 - sum(share[r["impl"]].get(x, 0.0) for x in shown)) for r in rows]
    lines.append(row("other", [pct(x) for x in rest]))
    top = next((r for r in rows if r["impl"].startswith("int4")), p)
    lines += [
        "",
        f"`{top['impl']}`'s source lines with most samples (share of its samples; each line's top "
        "three states, as shares of the line's):",
        "",
        "| line | source | share | top states |",
        "|---|---|---|---|",
    ]
    for ln in top["lines"]:
        states = ", ".join(
            f"{s['reason']} {100 * s['samples'] / ln['samples']:.0f}%" for s in ln["stalls"]
        )
        where = re.sub(r"^.*/site-packages/", "", ln["where"])  # Triton's own: triton/language/...
        lines.append(f"| {where} | {_cell(ln['text'])} | {100 * ln['fraction']:.1f}% | {states} |")
    return "\n".join(lines)


def decode_ab_table(path: Path = RESULTS / "decode_ab_head256.json") -> str:
    """Kernel variants timed against this commit's (``main``) in one run: per point, each
    impl's time in every variant and the variant's time over ``main``'s (above 1: slower)."""
    result = _load(path)
    variants = [v for v in result["variants"] if v != "main"]
    by = {(r["variant"], r["impl"], *_point(r)): r["ms"] * 1e3 for r in result["rows"]}
    points = sorted({_point(r) for r in result["rows"]})
    pairs = [(v, i) for v in variants for i in sorted({r["impl"] for r in result["rows"]
                                                        if r["variant"] == v})]  # fmt: skip
    lines = [
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'].split(' ; ')[0])}` "
        "and the calls in the file's `command`. " + result["note"],
        "",
        "Variants: " + "; ".join(f"`{k}`: {v}" for k, v in result["variants"].items()) + ".",
        "",
        "| heads | batch | ctx | "
        + " | ".join(f"`{i}` µs: `main` / `{v}` | `{v}` over `main`" for v, i in pairs)
        + " |",
        "|---|---|---|" + "---|---|" * len(pairs),
    ]
    for pt in points:
        q, kv, d, batch, ctx = pt[:5]
        cells = []
        for v, i in pairs:
            ours, theirs = by.get(("main", i, *pt)), by.get((v, i, *pt))
            cells.append(f"{_num(ours, '.1f')} / {_num(theirs, '.1f')}")
            cells.append(f"{theirs / ours:.2f}x" if ours and theirs else "n/a")
        lines.append(f"| {q}/{kv}/{d} | {batch} | {ctx} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _long_decode(r: dict) -> bool:
    """The decode points the speed targets are about: long contexts, batched, full attention."""
    return r["ctx"] >= 8192 and r["batch"] >= 8 and not r.get("window")


def kernel_speed_targets_table(path: Path = RESULTS / "kernels.json") -> str:
    """The kernel speed targets against every row of kernels.json they apply to: how many rows
    meet each, and the spread of the measure over those rows."""
    result = _load(path)
    peak = result["peak_bw_gbs"]
    rows = result["rows"]

    def measured(r: dict, impl: str) -> tuple:
        """What ``r`` measures, timed by ``impl``."""
        return (r["kernel"], impl, *_point(r), r.get("slots"))

    by_key = {measured(r, r["impl"]): r for r in rows}

    def over(kernel: str, mine: str, other: str, select) -> list[float]:
        """other's time / mine's (>1: mine faster) on every row ``select`` keeps."""
        return [by_key[measured(r, other)]["ms"] / r["ms"] for r in rows
                if r["kernel"] == kernel and r["impl"] == mine and select(r)
                and measured(r, other) in by_key]  # fmt: skip

    def short_decode(r: dict) -> bool:
        return r["ctx"] == 1024 and not r.get("window")

    def windowed(r: dict) -> bool:
        return bool(r.get("window"))

    # A sliding-window decode reads the same keys at any context: its time at the longest context
    # over its time at 1K, per (shape, batch, window), should stay near 1.
    at_1k = {_point(r)[:4] + (r.get("window"),): r["ms"] for r in rows
             if r["kernel"] == "decode" and r["impl"] == "int8" and windowed(r)
             and r["ctx"] == 1024}  # fmt: skip
    longest = max((r["ctx"] for r in rows if windowed(r)), default=0)
    flat = [at_1k[key] / r["ms"] for r in rows
            if r["kernel"] == "decode" and r["impl"] == "int8" and windowed(r)
            and r["ctx"] == longest and (key := _point(r)[:4] + (r.get("window"),)) in at_1k]  # fmt: skip

    def decode_step(r: dict) -> bool:
        return r["slots"] == "random"

    every = lambda r: True  # noqa: E731
    bw = [100 * r["gbs"] / peak for r in rows
          if r["kernel"] == "decode" and r["impl"] == "int8" and _long_decode(r)]  # fmt: skip
    targets = [
        ("decode, ctx ≥ 8K, batch ≥ 8: vs `bf16_fa2`", "≥ 1.6x",
         over("decode", "int8", "bf16_fa2", _long_decode), 1.6, "x"),
        ("decode, ctx ≥ 8K, batch ≥ 8: vs `bf16` (Triton)", "≈ 2.5x",
         over("decode", "int8", "bf16", _long_decode), None, "x"),
        ("decode, ctx ≥ 8K, batch ≥ 8: vs `upstream_int8_pth`", "≥ 2x",
         over("decode", "int8", "upstream_int8_pth", _long_decode), 2.0, "x"),
        ("decode, ctx ≥ 8K, batch ≥ 8: % of copy bandwidth", "≥ 80%", bw, 80.0, "%"),
        ("decode, ctx 1K: vs `bf16_fa2`", "≥ 1.0x",
         over("decode", "int8", "bf16_fa2", short_decode), 1.0, "x"),
        ("decode, sliding window, any ctx: vs `bf16_fa2` (same window)", "≥ 1.0x",
         over("decode", "int8", "bf16_fa2", windowed), 1.0, "x"),
        (f"decode, sliding window: time at 1K over time at {longest // 1024}K (flat: 1.0x)",
         "≥ 0.9x", flat, 0.9, "x"),
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
        f"{result['gpu']}, `{path.name}` ({len(rows)} rows), {_provenance(result)}. Per target: "
        "the rows it applies to (`int8`, every model shape), how many meet it, and the measure's "
        "spread over them.",
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


def issue_budget_table(path: Path = RESULTS / "decode_issue_budget.json") -> str:
    """Share of the SMs' instruction issue the decode loop needs at each GPU's peak bandwidth."""
    result = _load(path)
    rows = result["rows"]
    gpus = list(result["gpus"])
    lines = [
        f"`{result['command']}` on a CPU, {_provenance(result)} (sm80 PTX of the decode loop; GPU "
        "figures from spec sheets).",
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
# head size 256: the 32-key tile of 2026-12-01 and before, then the 64-key one that replaced it
TUNE_CONFIGS_WIDE = ((32, 4, 5), (64, 4, 4), (64, 4, 3), (32, 4, 4), (64, 8, 4))
# int4: one 64-key page per tile; choose_config_int4's stages are 6 / 4 / 3 at head size 64 / 128 / 256
TUNE_CONFIGS_INT4 = ((64, 4, 6), (64, 4, 4), (64, 4, 3), (64, 8, 3), (64, 2, 4))


def tune_decode_table(
    path: Path = RESULTS / "tune_decode.json",
    configs: tuple[tuple[int, int, int], ...] = TUNE_CONFIGS,
    dtype: str = "int8",
) -> str:
    """Per decode shape, the ``dtype`` kernel's bandwidth fraction under each of ``configs`` (its
    best split count, no in-program split-K) and the sweep's best config."""
    result = _load(path)
    best: dict[tuple, dict[tuple, float]] = {}
    for r in result["rows"]:
        if r["dtype"] == dtype and r["chunks"] == 1:
            shape = best.setdefault((r["batch"], r["ctx"]), {})
            config = (r["tile"], r["warps"], r["stages"])
            shape[config] = max(shape.get(config, 0.0), r["frac"])
    q, kv, d = result["shape"]
    lines = [
        f"{result['gpu']}, {q}/{kv} heads, D={d}, copy bandwidth {result['copy_gbs']:.0f} GB/s, "
        f"{_provenance(result)}, `{_short(result['command'])}`. Per cell: % of copy bandwidth "
        "(tile, warps, stages).",
        "",
        "| batch | ctx | "
        + " | ".join("/".join(map(str, c)) for c in configs)
        + " | best of the sweep |",
        "|---|---|" + "---|" * (len(configs) + 1),
    ]
    for (batch, ctx), fracs in best.items():
        top = max(fracs, key=fracs.get)
        cells = " | ".join(f"{100 * fracs[c]:.0f}%" if c in fracs else "-" for c in configs)
        lines.append(
            f"| {batch} | {ctx} | {cells} | {'/'.join(map(str, top))}: {100 * fracs[top]:.0f}% |"
        )
    return "\n".join(lines)


def launch_overhead_table(
    path: Path = RESULTS / "launch_overhead.json",
    wrappers_path: Path = RESULTS / "launch_overhead_wrappers.json",
) -> str:
    """Host time per call of the kernel wrappers (benchmarks/launch_overhead.py): on the GPU per
    launch path, and our wrappers' own Python (``--stub-launches``, on a CPU)."""
    result = _load(path)
    wrappers = _load(wrappers_path) if wrappers_path.exists() else {}
    columns = [
        (result, "_host_us", "GPU host, Triton's `kernel[grid]`"),
        (result, "_direct_host_us", "GPU host, `DirectLauncher`"),
        (result, "_replay_host_us", "GPU host, replay (layers after the first)"),
        (wrappers, "_wrapper_us", "our wrapper's Python (CPU, launches stubbed)"),
        (wrappers, "_binder_us", "Triton's binder alone (CPU, sm80 target)"),
    ]
    columns = [c for c in columns if f"write_kv_cache{c[1]}" in c[0]]
    lines = [
        f"{result['gpu']}, Triton {result['triton']}, {_provenance(result)}, "
        f"`{_short(result['command'])}`"
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


# benchmarks/host_overhead.py's batches, as a reader knows them
HOST_BATCHES = {
    "decode": "32 decodes",
    "mixed": "31 decodes + a 2048-token first chunk",
    "gather": "31 decodes + a 2048-token chunk over 5888 cached tokens",
}


def host_overhead_table(
    path: Path = RESULTS / "host_overhead.json",
    before_path: Path = RESULTS / "host_overhead_642228b.json",
) -> str:
    """Host time of the attention path per vLLM step on a CPU (benchmarks/host_overhead.py), the
    code before the host-side changes against today's, each cell ``before -> after``."""
    after = _load(path)
    before = _load(before_path)
    old = {(r["dtype"], r["batch"]): r for r in before["rows"]}
    env = " ".join(f"{k}={v}" for k, v in after.get("int8kv_env", {}).items())
    checked = [r for doc in (before, after) for r in doc["rows"] if "sync" in r]
    syncs = [f"{r['dtype']} {r['batch']}: {r['sync']}" for r in checked if r["sync"]]

    def cell(r: dict, w: dict | None, field: str, ops: str | None = None, fmt: str = ".0f") -> str:
        def one(x: dict) -> str:
            return format(x[field], fmt) + (f" ({x[ops]})" if ops else "")

        return one(r) if w is None else f"{one(w)} → {one(r)}"

    groups = after["rows"][0].get("groups", 1)
    lines = [
        f"{after['cpu']} CPU, torch {after['torch']}, every kernel launch and FlashAttention-2 "
        "stubbed (Triton's binder run on each launch that is not a replay), SmolLM2-135M's "
        "attention (9/3 heads of 64, 30 layers"
        + (
            f", in {groups} KV-cache groups, each with its own block table and slot mapping"
            if groups > 1
            else ""
        )
        + ")"
        + (f", `{env}`" if env else "")
        + f"; before: {_provenance(before)}"
        + (f" ({before['note']})" if "note" in before else "")
        + f", `{_short(before['command'])}`; after: "
        f"{_provenance(after)}, `{_short(after['command'])}`. Microseconds of host time, "
        "medians over the steps, before → after; in brackets the aten ops dispatched."
        + (
            f" Host reads of a device value (`--check-syncs`: every batch once on torch's meta "
            f"device, as a GPU sync would be): {'; '.join(syncs) or 'none'} in the "
            f"{len(checked)} checked."
            if checked
            else ""
        ),
        "",
        "| dtype | batch | builder, once a step | forward, layers 2-30 each | cache update, "
        "layers 2-30 each | step: builder + 30 layers | direct launches / replays a step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in after["rows"]:
        w = old.get((r["dtype"], r["batch"]))

        def calls(x: dict) -> str:  # the counts are kept only where there was one
            return f"{x.get('launches_per_step', 0)} / {x.get('replays_per_step', 0)}"

        launches = calls(r) if w is None else f"{calls(w)} → {calls(r)}"
        lines.append(
            f"| `{r['dtype']}` | {HOST_BATCHES.get(r['batch'], r['batch'])} "
            f"| {cell(r, w, 'build_us', 'build_ops')} "
            f"| {cell(r, w, 'forward_rest_us', 'forward_rest_ops', '.1f')} "
            f"| {cell(r, w, 'update_rest_us', fmt='.1f')} | {cell(r, w, 'step_us')} "
            f"| {launches} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# accuracy.json: perplexity and agreement through vLLM, per KV-cache dtype


def _rows_by_label(result: dict) -> dict[str, dict]:
    return {r["label"]: r for r in result["rows"]}


def _pm(value: float, se: float | None, fmt: str, sign: str = "") -> str:
    """``+0.078% ± 0.022``: a measure with its standard error (``%`` only after the value)."""
    unit = "%" if fmt.endswith("%") else ""
    spec = sign + fmt.rstrip("%")
    text = f"{format(value, spec)}{unit}"
    return text if se is None else f"{text} ± {format(se, fmt.rstrip('%').lstrip('+'))}"


def accuracy_table(path: Path = RESULTS / "accuracy.json") -> str:
    """Perplexity and agreement with BF16 per row of an accuracy file, the prefill path named."""
    result = _load(path)
    ref = _rows_by_label(result).get("auto") or result["rows"][0]
    lines = [
        f"{result['model']} on `{result['corpus']}` ({result['tokens']} tokens scored), "
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'])}`. ΔPPL (± its "
        f"standard error) and KV tokens are relative to `{ref['label']}` (BF16). Prefill `pages`: "
        "every scored token's attention read K/V back from the KV-cache pages; `bf16`: a prompt "
        "chunk attends over its own fresh BF16 K/V (the shim's default prefill), its context "
        "from the pages.",
        "",
        "| row | `--kv-cache-dtype` | prefill | PPL | ΔPPL | top-1 agree | mean KL "
        "| greedy agree | KV tokens vs BF16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        tokens, ref_tokens = row.get("kv_cache_tokens"), ref.get("kv_cache_tokens")
        lines.append(
            f"| `{row['label']}` | `{row['kv_cache_dtype']}` | {row['prefill']} "
            f"| {row['ppl']:.3f} | {_pm(row['dppl_pct'], row.get('dppl_se_pct'), '.3f%', '+')} "
            f"| {_num(row.get('top1_agree'), '.4f')} | {_num(row.get('kld'), '.5f')} "
            f"| {_pm(row['greedy_agree'], row.get('greedy_agree_se'), '.3f')} "
            f"| {f'{tokens / ref_tokens:.2f}x' if tokens and ref_tokens else 'n/a'} |"
        )
    return "\n".join(lines)


# What a user weighs per dtype, in the order a user meets them
CHOICES = (
    ("auto", "BF16, vLLM's default"),
    ("int8_per_token_head", "vLLM 0.24.0's own INT8 cache"),
    ("int8", "**the one to use**: no calibration"),
    ("int8_static", "needs `int8kv calibrate` per model"),
    ("int4", "experimental"),
)
# kernels.json names upstream's INT8 cache by its kernel
KERNEL_IMPL = {"int8_per_token_head": "upstream_int8_pth"}
# What the kernel bench's rows of a dtype timed where that is not the dtype's default, said
# beside its cell: benchmarks/kernels.py's "int4" reads one tail page and no sink page, where
# int4's default reads two tail pages and a sink page (impl "int4_sink_tail2")
KERNEL_TIMED_AS = {
    "int4": "reading one tail page and no sink page (`INT8KV_INT4_TAIL_PAGES=1 "
    "INT8KV_INT4_SINK_PAGE=0`)"
}
# the kernel bench's labels of a dtype's default where KERNEL_TIMED_AS says it timed another,
# closest first, with what each reads
KERNEL_DEFAULT_IMPL = {
    "int4": (
        ("int4_sink_tail2", "as it ships, its sink page and two tail pages", ""),
        ("int4_tail2", "with the default's two tail pages", "; its sink page is not timed yet"),
    )
}


def _default_decode_note(path: Path, impls: tuple[tuple[str, str, str], ...]) -> str:
    """How the dtype's default decodes against FlashAttention-2, from another run's file: the
    first of ``impls`` (label, what it reads, what it leaves out) that the file times, or that
    the default is not timed yet."""
    result = _load(path) if path.exists() else None
    for impl, reads, left_out in impls:
        if points := (_decode_over_fa2(result["rows"], impl) if result else []):
            rows = [r for r in result["rows"] if r["impl"] == impl]
            return (
                f"{reads[0].upper()}{reads[1:]} (`{impl}`), in a run of its own, "
                f"[`{path.name}`](benchmarks/results/{path.name}) ({_extent({'rows': rows})}), "
                f"{result['gpu']} ({_provenance(result)}): {_spread(points)} "
                f"FlashAttention-2's speed, {len(points)} point{'s' * (len(points) != 1)}{left_out}."
            )
    return "The default's second tail page and sink page are not timed yet."


def dtype_choice_table(
    accuracy_paths: tuple[Path | tuple[Path, ...], ...] = (
        (
            RESULTS / "accuracy_chunk16.json",
            RESULTS / "accuracy_chunk16_int4_tails.json",
            RESULTS / "accuracy.json",
        ),
        (
            RESULTS / "accuracy_gemma3_chunk16.json",
            RESULTS / "accuracy_gemma3_chunk16_int4_tails.json",
            RESULTS / "accuracy_gemma3.json",
        ),
    ),
    kernels_path: Path = RESULTS / "kernels.json",
    int4_kernels_path: Path = RESULTS / "kernels_int4.json",
    int4_default_path: Path = RESULTS / "kernels_h100.json",
) -> str:
    """Per dtype: capacity, ΔPPL and greedy agreement through the cache on each real model, decode
    speed vs FA2 (``int4``'s from its own run, ``int4_kernels_path``, where kernels.json has
    none). Each model is one accuracy file or several of one model, the first holding a dtype's
    row giving its cells (the 16-token-chunk run before the 512-token one: the first is what a
    decoded token reads)."""
    models = [
        [p for p in ((group,) if isinstance(group, Path) else group) if p.exists()]
        for group in accuracy_paths
    ]
    models = [paths for paths in models if paths]
    accs = [[_load(p) for p in paths] for paths in models]
    kernels = _load(kernels_path)
    int4_kernels = _load(int4_kernels_path) if int4_kernels_path.exists() else None
    decode_points = _decode_over_fa2(kernels["rows"], "int8")
    notes: list[str] = []
    lines = [
        "| `--kv-cache-dtype` | what | KV tokens vs BF16 | ΔPPL through the cache "
        "| greedy agreement with BF16 | decode attention vs FlashAttention-2 |",
        "|---|---|---|---|---|---|",
    ]

    def current(acc: dict, dtype: str, prefill: str | None = None) -> dict | None:
        """A row of the format the dtype stores today (rows of an older format are kept for
        the record, marked with ``format``), read through the pages when ``prefill`` says; a
        row read through the pages counts only with the dtype's own settings (its label's
        configuration is the dtype's: no switch of another variant)."""
        return next(
            (r for r in acc["rows"] if r["kv_cache_dtype"] == dtype and "format" not in r
             and (prefill is None or r["prefill"] == prefill)
             and (prefill != "pages" or config_for(r["label"]) == config_for(dtype))),
            None,
        )  # fmt: skip

    for dtype, what in CHOICES:
        capacity, dppl, greedy = [], [], []
        for docs in accs:
            model = docs[0]["model"]
            head_size = MODEL_HEAD_SIZE.get(model)
            # the headline row of a cache: its label is its dtype, and it read the pages
            row = next((r for acc in docs if (r := current(acc, dtype, "pages"))), None)
            served = row or next((r for acc in docs if (r := current(acc, dtype))), None)
            ref = next(acc for acc in docs if served is None or served in acc["rows"])
            ref_row = _rows_by_label(ref)["auto"]
            if served and served.get("kv_cache_tokens"):
                capacity.append(f"{served['kv_cache_tokens'] / ref_row['kv_cache_tokens']:.2f}x")
            elif dtype in CATALOGUE and head_size:
                capacity.append(f"{CATALOGUE[dtype].capacity_vs_bf16(head_size):.2f}x (catalogue)")
            else:
                capacity.append("not measured")
            if dtype == "auto":
                dppl.append("reference")
                greedy.append("reference")
            elif row:
                dppl.append(_pm(row["dppl_pct"], row.get("dppl_se_pct"), ".3f%", "+"))
                greedy.append(_pm(row["greedy_agree"], row.get("greedy_agree_se"), ".3f"))
            else:
                dppl.append("not measured")
                greedy.append("not measured")
                other = next((r for acc in docs if (r := current(acc, dtype, "bf16"))), None)
                if other:
                    notes.append(
                        f"`{dtype}` through the pages is not measured yet on {model}; with "
                        f"the default prefill (`{other['label']}`): ΔPPL "
                        f"{_pm(other['dppl_pct'], other.get('dppl_se_pct'), '.3f%', '+')}, greedy "
                        f"agreement {_pm(other['greedy_agree'], other.get('greedy_agree_se'), '.3f')}."
                    )
        impl = KERNEL_IMPL.get(dtype, dtype)
        if dtype == "auto":
            speed = "1.00x"
        elif points := _decode_over_fa2(kernels["rows"], impl):
            speed = _spread(points)
        elif int4_kernels and (points := _decode_over_fa2(int4_kernels["rows"], impl)):
            speed = f"{_spread(points)}, {len(points)} point{'s' * (len(points) != 1)}"
            notes.append(
                f"`{dtype}`'s decode: its own run, [`{int4_kernels_path.name}`]"
                f"(benchmarks/results/{int4_kernels_path.name}) ({_extent(int4_kernels)}), "
                f"{int4_kernels['gpu']} ({_provenance(int4_kernels)})"
                + (f", {KERNEL_TIMED_AS[dtype]}." if dtype in KERNEL_TIMED_AS else ".")
                + (
                    " " + _default_decode_note(int4_default_path, KERNEL_DEFAULT_IMPL[dtype])
                    if dtype in KERNEL_DEFAULT_IMPL
                    else ""
                )
            )
        else:
            speed = "not measured"
        cells = [" / ".join(c) if len(set(c)) > 1 else c[0] for c in (capacity, dppl, greedy)]
        lines.append(f"| `{dtype}` | {what} | {' | '.join(cells)} | {speed} |")

    def files(paths: list[Path], docs: list[dict]) -> str:
        named = [f"[`{p.name}`](benchmarks/results/{p.name}), {_provenance(a)}"
                 for p, a in zip(paths, docs, strict=True)]  # fmt: skip
        return named[0] + "".join(f"; where it has no row of a dtype, {n}" for n in named[1:])

    # The table leads with one short line; which file and commit each figure comes from follows
    # it, folded, so the table stays readable and every figure keeps its source.
    caption = (
        "Cells joined by / are " + " / ".join(
            f"{docs[0]['model']} (head size {MODEL_HEAD_SIZE.get(docs[0]['model'], '?')})"
            for docs in accs
        ) + f", on `{Path(accs[0][0]['corpus']).name}`, "
        f"{accs[0][0]['gpu']}, ± one standard error; decode: median (range) over "
        f"{len(decode_points)} full-attention decode points, {kernels['gpu']}."
    )  # fmt: skip
    sources = [f"- {docs[0]['model']}: {files(paths, docs)}."
               for paths, docs in zip(models, accs, strict=True)]  # fmt: skip
    sources.append(
        f"- Decode: [`{kernels_path.name}`](benchmarks/results/{kernels_path.name}) "
        f"({_extent(kernels)}), {_provenance(kernels)}."
    )
    details = "\n".join(
        ["<details><summary>Where each figure comes from</summary>", "", *sources, "", "</details>"]
    )
    return "\n\n".join([caption, "\n".join(lines), details, *notes])


# The newest serving run of each model: the README's serving table quotes them and the serving
# targets table judges them.
SERVING_NEWEST: tuple[Path, ...] = (
    RESULTS / "serving_smollm2_55cdbef.json",
    RESULTS / "serving_gemma3_ce3fe6a.json",
    RESULTS / "serving_llama3_8b_shape.json",
)
# runs in paired rounds (serve_bench --interleave --rounds), judged beside the newest
SERVING_PAIRED: tuple[Path, ...] = (
    RESULTS / "serving_smollm2_75eff26.json",
    RESULTS / "serving_smollm2_35ad204.json",
    RESULTS / "serving_llama3_8b_shape_35ad204.json",
    RESULTS / "serving_llama3_8b_shape_18280da.json",
    RESULTS / "serving_gemma3_18280da.json",
    RESULTS / "serving_llama3_8b_shape_4_layers_8465ab0.json",
    RESULTS / "serving_llama3_8b_shape_4_layers_bb40257.json",
    RESULTS / "serving_gemma3_14f89bb.json",
    RESULTS / "serving_gemma3_parts_14914a9.json",
    RESULTS / "serving_gemma3_parts_a01bc15.json",
    RESULTS / "serving_llama3_8b_shape_c128_998fbe7.json",
)


def headline(
    accuracy_path: Path = RESULTS / "accuracy.json",
    kernels_path: Path = RESULTS / "kernels.json",
    throughput_path: Path = RESULTS / "throughput.json",
    second_model_paths: tuple[Path, ...] = (
        RESULTS / "accuracy_gemma3_chunk16.json",
        RESULTS / "accuracy_gemma3.json",
    ),
    serving: tuple[Path, ...] = SERVING_NEWEST,
) -> str:
    """The README's measured headline for ``int8``, each figure with its model and GPU."""
    acc = _load(accuracy_path)
    rows = _rows_by_label(acc)
    ours, upstream, bf16_prefill, ref = (
        rows["int8"], rows["int8_per_token_head"], rows["int8_bf16_prefill"], rows["auto"]
    )  # fmt: skip
    kernels = _load(kernels_path)
    long = [r for r in kernels["rows"] if _long_decode(r)]
    vs_fa2 = _decode_over_fa2(long, "int8")
    fa2_over_upstream = _decode_over_fa2(long, "upstream_int8_pth")
    vs_upstream = statistics.median(a / b for a, b in zip(vs_fa2, fa2_over_upstream, strict=True))
    tput = _load(throughput_path)
    speed = {(r["dtype"], r["ctx"]): r["gen_tok_s"] for r in tput["rows"]}

    def e2e(ctx: int) -> str:
        return f"{speed['int8', ctx] / speed['auto_fa2', ctx]:.2f}x"

    def pct(row: dict) -> str:
        return _pm(row["dppl_pct"], row.get("dppl_se_pct"), ".3f%", "+")

    model, gpu = acc["model"], acc["gpu"]
    details = accuracy_path.with_name(accuracy_path.stem + "_details.json")
    chunk = _load(details).get("settings", {}).get("chunk") if details.exists() else None
    chunks = f", {chunk}-token chunks" if chunk else ""
    prefill_run = _run_of_row(acc, bf16_prefill["label"])
    if prefill_run == _run_of_row(acc, ours["label"]):
        prefill_run = "same run"
    return "\n".join([
        f"- **Capacity:** `int8` holds {ours['kv_cache_tokens'] / ref['kv_cache_tokens']:.2f}x "
        f"the tokens of a BF16 cache in the same memory ({model}, head size "
        f"{MODEL_HEAD_SIZE.get(model, '?')}; {CATALOGUE['int8'].capacity_vs_bf16(128):.2f}x at "
        "head size 128).",
        f"- **The cache is as accurate as upstream's:** read back from the pages, perplexity "
        f"moves {pct(ours)} from BF16's, against {pct(upstream)} for vLLM's "
        f"`int8_per_token_head` ({model}, {acc['tokens']} tokens, {gpu}).",
        *([_second_model_line([_load(p) for p in second])] if (second := [
            p for p in second_model_paths if p.exists()]) else []),  # fmt: skip
        "- **Prompts are processed in BF16:** by default a prompt's first chunk, and any later "
        "chunk of more than 256 new tokens, attends over its own fresh BF16 K/V on "
        "FlashAttention-2, exactly as with a BF16 cache, and only its earlier chunks come from "
        "the pages (shorter continuations read every key from the pages); so measured, "
        f"perplexity moves {pct(bf16_prefill)} "
        f"(`{bf16_prefill['label']}`, {prefill_run}{chunks}).",
        *([f"- **Serving** (`vllm serve` + `vllm bench serve`, {_count_models(serving)}): "
           "`int8`'s time per output token and to first token against FlashAttention-2's, by "
           "model and concurrency, in [the serving table](#serving)."] if any(
            path.exists() for path in serving) else []),  # fmt: skip
        f"- **Decode attention:** {statistics.median(vs_fa2):.2f}x FlashAttention-2 on BF16 "
        f"(median of {len(vs_fa2)} points at ≥ 8K context and batch ≥ 8, "
        f"{min(vs_fa2):.2f}-{max(vs_fa2):.2f}x) and {vs_upstream:.2f}x upstream's INT8 kernel "
        f"({kernels['gpu']}).",
        f"- **End to end:** {e2e(8192)} FlashAttention-2's generation throughput at 8K context "
        f"and {e2e(1024)} at 1K ({tput['model']}, {tput['gpu']}).",
    ])  # fmt: skip


def _second_model_line(docs: list[dict]) -> str:
    """The headline's line for a second model: the cache against upstream's from the first of
    ``docs`` (runs of one model), and the BF16 engine against Hugging Face transformers on the
    same token windows (the ground truth), from a run whose BF16 reference scored the same."""
    acc = docs[0]
    rows = _rows_by_label(acc)
    ours, upstream, ref = rows["int8"], rows["int8_per_token_head"], rows["auto"]

    def pct(row: dict) -> str:
        return _pm(row["dppl_pct"], row.get("dppl_se_pct"), ".3f%", "+")

    truth = next(
        (d["transformers_ppl"] for d in docs if d.get("transformers_ppl")
         and _rows_by_label(d)["auto"]["ppl"] == ref["ppl"] and d["tokens"] == acc["tokens"]),
        None,
    )  # fmt: skip
    versus = (
        f"; vLLM's BF16 perplexity is within {abs(ref['ppl'] / truth - 1):.3%} of transformers'"
        if truth else ""
    )  # fmt: skip
    return (
        f"- **Head size 256, one KV head, sliding windows** ({acc['model']}, "
        f"{MODEL_HEAD_SIZE.get(acc['model'], '?')}-wide heads, a scale per 64 channels): through "
        f"the cache {pct(ours)} against upstream's {pct(upstream)}, at "
        f"{ours['kv_cache_tokens'] / ref['kv_cache_tokens']:.2f}x the tokens{versus} "
        f"({acc['tokens']} tokens, {acc['gpu']})."
    )


# --------------------------------------------------------------------------------------------
# throughput: LLM.generate over random prompts, per configuration and context


def throughput_table(path: Path = RESULTS / "throughput.json") -> str:
    """Generation throughput per configuration and context, with ratios against the baselines."""
    result = _load(path)
    rows = {(r["dtype"], r["ctx"]): r for r in result["rows"]}
    bases = ("auto_fa2", "auto_triton", "int8_per_token_head")
    per_row = all("git_commit" in r for r in result["rows"])
    lines = [
        f"{result['model']}, {result['gpu']}, {_provenance(result)}, "
        f"`{_short(result['command'].split(' ; ')[0])}`"
        + (
            " (rows of several runs, see the file's `command`)"
            if " ; " in result["command"]
            else ""
        )
        + ".",
        "",
        "| config | ctx | prompts | gen tok/s | vs `auto_fa2` | vs `auto_triton` "
        "| vs `int8_per_token_head` | KV tokens | vs BF16 |" + (" measured |" if per_row else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if per_row else ""),
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
            + (f" {_provenance(row)} |" if per_row else "")
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# serving.json: vllm bench serve against vllm serve (benchmarks/serve_bench.py)

# serve_bench's model names, in the order the README's serving table gives them
SERVING_MODEL_NAMES = {
    "smollm2": "SmolLM2-135M-Instruct",
    "gemma3": "gemma-3-270m",
    "llama3-8b-shape": "Llama-3-8B's shape, random weights",
}


# serve_bench's default --llama-layers: a run that names another count says so beside the name
SERVING_LLAMA_LAYERS = 2


def _serving_model_name(model: str, result: dict) -> str:
    """``model``'s name in ``result``'s tables, with the Llama shape's layer count where the run
    gave ``--llama-layers`` other than the default."""
    name = SERVING_MODEL_NAMES.get(model, model)
    layers = re.search(r"--llama-layers[= ](\d+)", result["command"])
    if model == "llama3-8b-shape" and layers and int(layers[1]) != SERVING_LLAMA_LAYERS:
        name += f", {layers[1]} layers"
    return name


def _pairing(rounds: int, row: dict) -> str:
    """How ``row``'s ratios were paired, from ``rounds`` (:func:`_paired_ratio`'s count): "median
    of N paired rounds", "one paired round" (also a run of servers up at once, each point on each
    in turn, that recorded no rounds), or "" (one server after another)."""
    if rounds > 1:
        return f"median of {rounds} paired rounds"
    return "one paired round" if rounds or row.get("servers_at_once", 1) > 1 else ""


# vLLM's own INT8 cache, the upstream row of every comparison
UPSTREAM = "int8_per_token_head"


def _serving_rows(result: dict) -> dict[tuple, dict]:
    return {(r["model"], r["input_len"], r["concurrency"], r["dtype"]): r for r in result["rows"]}


def _serving_keys(rows: dict[tuple, dict]) -> list[tuple]:
    """``_serving_rows``' keys by model, input and concurrency, FlashAttention-2 first."""
    order = {d: i for i, d in enumerate(("auto_fa2", "int8_per_token_head", "int8", "int4"))}
    return sorted(rows, key=lambda k: (k[0], k[1], k[2], order.get(k[3], 9)))


def _ratio(ours: dict, base: dict | None, key: str) -> str:
    return f"{ours[key] / base[key]:.2f}x" if base and base.get(key) else "n/a"


def _vs_fa2(dtype: str, ours: float | None, theirs: float | None) -> str:
    """A serving table's ratio cell: ``ours`` over FlashAttention-2's ``theirs`` ("reference" in
    FlashAttention-2's own row, "n/a" where either was not measured)."""
    if dtype == "auto_fa2":
        return "reference"
    return f"{ours / theirs:.2f}x" if ours is not None and theirs else "n/a"


def serving_table(path: Path = RESULTS / "serving.json") -> str:
    """Per model, input length and concurrency: TTFT, TPOT and output tok/s of every dtype, with
    ``int8``'s ratios to FlashAttention-2 on BF16 (``auto_fa2``) beside them."""
    result = _load(path)
    rows = _serving_rows(result)
    lines = [
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'].split(' ; ')[0])}`"
        + (" and the calls in the file's `command`" if " ; " in result["command"] else "")
        + ". Medians and 99th percentiles over each point's requests; output 256 tokens, "
        "`--ignore-eos`, greedy.",
        "",
        "| model | input | concurrency | dtype | prompts | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| ITL p50 / p99 ms | output tok/s | TTFT vs `auto_fa2` | TPOT vs `auto_fa2` "
        "| ITL p50 vs `auto_fa2` | KV tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in _serving_keys(rows):
        model, input_len, conc, dtype = key
        r = rows[key]
        base = rows.get((model, input_len, conc, "auto_fa2"))
        keys = ("ttft_ms_p50", "tpot_ms_p50", "itl_ms_p50")
        vs = (
            [_ratio(r, base, k) for k in keys] if dtype != "auto_fa2" else ["reference"] * 3
        )  # fmt: skip
        lines.append(
            f"| {SERVING_MODEL_NAMES.get(model, model)} | {input_len} | {conc} | `{dtype}` | "
            f"{r['num_prompts']} | {r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f} | "
            f"{r['tpot_ms_p50']:.2f} / {r['tpot_ms_p99']:.2f} | "
            f"{_num(r.get('itl_ms_p50'), '.2f')} / {r['itl_ms_p99']:.1f} | "
            f"{r['output_tok_s']:.0f} | {vs[0]} | {vs[1]} | {vs[2]} | {r['kv_cache_tokens']} |"
        )
    if result.get("not_measured"):
        lines += ["", f"Not measured in this run: {result['not_measured']}."]
    return "\n".join(lines)


def serving_ttft_table(path: Path = RESULTS / "serving.json") -> str:
    """Where each point's time to first token went, by the server's own metrics
    (``server_metrics``, ``benchmarks/server_metrics.py``): the mean over the point's requests of
    the engine core's queue, of its prefill (first scheduled to first token) and of the rest,
    outside the engine core's queue and prefill (the API server's tokenising, IPC and output
    processing, and the wait for the engine core to take the request in between two steps). With
    the step timer's request ages (``benchmarks/step_timing.py`` ``REQUEST_MILESTONES``), also how
    old a request was when the API server had tokenised it and sent it to the engine core, and
    when the engine core's input thread and then its scheduler took it (each run's own)."""
    result = _load(path)
    rows = _serving_rows(result)
    points = [r for row in rows.values() for _, r, _ in _round_points(row, {})]
    dated = [a for a in REQUEST_MILESTONES if any(_phase(r, a) for r in points)]
    cpu = any(r.get("process_cpu") for r in points)
    lines = [
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'])}`. Means over each "
        "point's requests, in ms, by the server's clock.",
        "",
        "| model | input | concurrency | dtype | TTFT | in the queue | prefill | outside the "
        "engine core | "
        + "".join(f"{'of it, ' if i == 0 else ''}{REQUEST_MILESTONE_COLUMNS[a]} | "
                  for i, a in enumerate(dated))
        + "queue + prefill vs `auto_fa2` | output tok/s |"
        + (" CPU busy while requests ran (main thread): API server / engine core / client |"
           if cpu else ""),
        "|---|---|---|---|---|---|---|---|" + "---|" * len(dated) + "---|---|"
        + ("---|" if cpu else ""),
    ]  # fmt: skip

    def engine_ms(row: dict | None) -> float | None:
        m = (row or {}).get("server_metrics") or {}
        if m.get("queue_ms_mean") is None or m.get("prefill_ms_mean") is None:
            return None
        return m["queue_ms_mean"] + m["prefill_ms_mean"]

    for key in _serving_keys(rows):
        model, input_len, conc, dtype = key
        base_row = rows.get((model, input_len, conc, "auto_fa2")) or {}
        for label, r, base in _round_points(rows[key], base_row):
            m = r.get("server_metrics") or {}
            ours, theirs = engine_ms(r), engine_ms(base)
            vs = _vs_fa2(dtype, ours, theirs)
            age_us = [_phase(r, a).get("us_per_call") for a in dated]
            ages = "".join(f"{_num(None if us is None else us / 1e3, '.0f')} | " for us in age_us)
            lines.append(
                f"| {SERVING_MODEL_NAMES.get(model, model)} | {input_len} | {conc} | "
                f"`{dtype}`{label} | {_num(m.get('ttft_ms_mean_server'), '.0f')} "
                f"| {_num(m.get('queue_ms_mean'), '.0f')} "
                f"| {_num(m.get('prefill_ms_mean'), '.0f')} | "
                f"{_num(m.get('ttft_frontend_ms_mean'), '.0f')} | {ages}{vs} "
                f"| {r['output_tok_s']:.0f} |" + (f" {_busy(r)} |" if cpu else "")
            )
    return "\n".join(lines)


# The TTFT table's column for each request age the step timer records, in the order a request
# passes them (benchmarks/step_timing.py REQUEST_MILESTONES)
REQUEST_MILESTONE_COLUMNS = {
    RENDER: "until tokenised",
    "request_age_at_handover": "until sent to the engine core",
    "request_age_at_engine_core": "before the engine core's input thread",
    "request_age_at_scheduler": "before its scheduler",
}


def _busy(point: dict) -> str:
    """The API server's, the engine core's and the benchmark client's CPU seconds over the time
    the point's requests ran (``process_cpu``'s ``busy_run``, ``benchmarks/process_cpu.py``), each
    with its main thread's in brackets where read: 1.00 is one core all the time, the most one
    thread can take."""
    cpu = point.get("process_cpu") or {}
    cells = []
    for role in ("api_server", "engine_core", "bench_client"):
        f = cpu.get(role) or {}
        main = f.get("main_thread_busy_run")
        cells.append(_num(f.get("busy_run"), ".2f") + ("" if main is None else f" ({main:.2f})"))
    return " / ".join(cells)


def _phase(point: dict, name: str) -> dict:
    """The step timer's figures of phase ``name`` over ``point`` (``{}`` if not timed)."""
    return ((point.get("step_timing") or {}).get("phases") or {}).get(name) or {}


def _profile_rows(paths: Sequence[Path]) -> Iterator[tuple[str, dict]]:
    """(the run's GPU and provenance, row) of every row of the profile files ``paths``."""
    for path in paths:
        result = _load(path)
        for row in result["rows"]:
            yield f"{result['gpu']}, {_provenance(result)}", row


def serving_profile_table(*paths: Path) -> str:
    """The profiled serving points (``serve_bench --profile-concurrency``): GPU kernel time by
    category over the whole point, how busy the GPU was, the attention op's host time, and the
    attention kernels' time per call, one line per dtype (a file per run)."""
    lines = [
        "| run | model | input | concurrency | dtype | prompts | GPU kernel ms: ours / "
        "FlashAttention-2 / GEMM / other / total | GPU busy | attention op: calls, host ms "
        "| largest attention kernels: ms in all (calls) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run, r in _profile_rows(paths):
        c = r["kernel_us_by_category"]
        ms = " / ".join(
            f"{v / 1e3:.0f}" for v in (*(c[k] for k in PROFILE_CATEGORIES), r["kernel_us_total"])
        )
        (op,) = r["host_attention_ops"] or [{"count": 0, "total_us": 0.0}]
        attention = [k for k in r["top_kernels"] if k["category"] in ("ours", "flash_attention")][
            :4
        ]
        top = ", ".join(
            f"`{_kernel_name(k['name'])}` {k['total_us'] / 1e3:.0f} ({k['count']})"
            for k in attention
        )
        lines.append(
            f"| {run} | {SERVING_MODEL_NAMES.get(r['model'], r['model'])} | {r['input_len']} "
            f"| {r['concurrency']} | `{r['dtype']}` | {r['num_prompts']} | {ms} | "
            f"{r['gpu_busy_fraction']:.0%} of {r['gpu_span_us'] / 1e6:.1f} s | "
            f"{op['count']}, {op['total_us'] / 1e3:.0f} | {top} |"
        )
    return "\n".join(lines)


def serving_profile_steps_table(*paths: Path) -> str:
    """The profiled serving points whose trace marks its steps (``by_step_kind`` of
    ``benchmarks/profile_summary.py``): per kind of step range, the range's host time and the GPU
    kernel time of the launches made in it, both means per range."""
    lines = [
        "| run | model | concurrency | dtype | step ranges | count | host ms a range: mean (median) "
        "| GPU kernel ms a range: ours / FlashAttention-2 / GEMM / other / total | GPU / host |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run, r in _profile_rows(paths):
        for kind, k in (r.get("by_step_kind") or {}).items():
            gpu = k["gpu_us_mean"]
            ms = " / ".join(
                f"{v / 1e3:.2f}"
                for v in (*(gpu[c] for c in PROFILE_CATEGORIES), k["gpu_us_mean_total"])
            )
            lines.append(
                f"| {run} | {SERVING_MODEL_NAMES.get(r['model'], r['model'])} "
                f"| {r['concurrency']} | `{r['dtype']}` | {STEP_KIND_NAMES.get(kind, kind)} "
                f"| {k['steps']} | {k['host_forward_us_mean'] / 1e3:.2f} "
                f"({k['host_forward_us_p50'] / 1e3:.2f}) | {ms} "
                f"| {k['gpu_us_mean_total'] / k['host_forward_us_mean']:.2f} |"
            )
    return "\n".join(lines)


def serving_attention_ops_table(*paths: Path) -> str:
    """The profiled serving points whose summary opens the attention layer's ops
    (``attention_ops_opened`` of ``benchmarks/profile_summary.py``): per op, its host time a call,
    of it the Python between the calls it makes, and the calls it makes that take the most."""
    lines = [
        "| run | model | concurrency | dtype | op | calls | host µs a call | of it, Python µs "
        "| largest calls it makes: µs a call (calls a call) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run, r in _profile_rows(paths):
        for op, o in (r.get("attention_ops_opened") or {}).items():
            made = ", ".join(
                f"`{c['name']}` {c['us_per_call']:.1f} ({c['per_call']:g})"
                for c in o["calls_made"][:4]
            )
            lines.append(
                f"| {run} | {SERVING_MODEL_NAMES.get(r['model'], r['model'])} "
                f"| {r['concurrency']} | `{r['dtype']}` | `{op}` | {o['calls']} "
                f"| {o['us_per_call']:.1f} | {o['self_us_per_call']:.1f} | {made} |"
            )
    return "\n".join(lines)


# profile_summary's kinds: a range with one graph replay is a captured whole step (vLLM captures
# uniform decode batches); the others (prompt chunks, mixed and uncaptured batches) run eagerly
STEP_KIND_NAMES = {"graph": "one CUDA graph replay", "eager": "eager or piecewise"}


def _kernel_name(name: str) -> str:
    """``flash_fwd_splitkv_kernel`` of ``void flash::flash_fwd_splitkv_kernel<...>(...)``."""
    base = name.split("<")[0].split("(")[0].strip()
    return base.split()[-1].split("::")[-1]


def serving_starts_table(path: Path = RESULTS / "serving.json") -> str:
    """Every ``vllm serve`` start of the serving runs: time to healthy and where it went (phases
    from the server log)."""
    result = _load(path)
    starts = result.get("engine_starts", [])
    # the shim's own kernel compiles, in runs that recorded them (serve_bench reads them since
    # 2026-12-06): a column of their own, inside vLLM's init
    warmups = any("kernel_warmup_s" in s for s in starts)
    lines = [
        "| model | dtype | host | start to `/health` s | vLLM init s | torch.compile s "
        f"| CUDA graphs s |{' our kernels compiled s |' if warmups else ''} KV tokens |",
        "|---|---|---|---|---|---|---|---|" + ("---|" if warmups else ""),
    ]
    for s in starts:
        warmup = ""
        if warmups:
            # none logged: a server without the shim's layers (FlashAttention-2, upstream's int8)
            warmup = f" {s['kernel_warmup_s']:.0f} |" if "kernel_warmup_s" in s else " - |"
        lines.append(
            f"| {SERVING_MODEL_NAMES.get(s['model'], s['model'])} | `{s['dtype']}` | "
            f"{s['host_state']} | {s['engine_start_s']:.0f} | "
            f"{_num(s.get('init_engine_s'), '.0f')} | {_num(s.get('torch_compile_s'), '.0f')} | "
            f"{_num(s.get('graph_capture_s'), '.0f')} |{warmup} {s['kv_cache_tokens']} |"
        )
    return "\n".join(lines)


def serving_rerun_table(
    path: Path = RESULTS / "serving_2026-12-02.json",
    before: Path = RESULTS / "serving_2026-12-01.json",
) -> str:
    """A later run's points beside the same points of ``before`` (same model, dtype, input and
    concurrency), ``before``'s FlashAttention-2 at that point for scale, then the later run's
    server starts. The runs are on different hosts and days: compare a dtype with itself."""
    result, earlier = _load(path), _load(before)
    old = _serving_rows(earlier)
    lines = [
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'])}`, against "
        f"`{before.name}` ({_provenance(earlier)}). Medians over each point's requests.",
        "",
        "| model | input | concurrency | dtype | TTFT p50 ms: then / now | TPOT p50 ms: then / now "
        "| output tok/s: then / now | compiles logged now | then `auto_fa2`: TTFT / TPOT / tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in sorted(_serving_rows(result).items()):
        model, input_len, conc, dtype = key
        was, fa2 = old.get(key), old.get((model, input_len, conc, "auto_fa2"))

        def pair(field: str, fmt: str, was: dict | None = was, r: dict = r) -> str:
            return f"{_num(was and was[field], fmt)} / {format(r[field], fmt)}"

        lines.append(
            f"| {SERVING_MODEL_NAMES.get(model, model)} | {input_len} | {conc} | `{dtype}` | "
            f"{pair('ttft_ms_p50', '.0f')} | {pair('tpot_ms_p50', '.2f')} | "
            f"{pair('output_tok_s', '.0f')} | {_num(r.get('jit_compiles'), 'd')} | "
            + (
                f"{fa2['ttft_ms_p50']:.0f} / {fa2['tpot_ms_p50']:.2f} / {fa2['output_tok_s']:.0f} |"
                if fa2 else "- |"
            )
        )  # fmt: skip
    return "\n".join(lines + ["", serving_starts_table(path)])


# The serving targets' bounds: int8's median TPOT at most 0.8x FlashAttention-2's from 32 requests
# at long input (0.72x on SmolLM2, whose weights are tiny beside its cache reads) and 1.0x at 1;
# its median TTFT at most 1.05x everywhere; its output tok/s at least 1.3x upstream's from 32.
SERVING_TPOT_LONG = {"smollm2": 0.72}
SERVING_TPOT_LONG_DEFAULT, SERVING_TPOT_ONE, SERVING_TTFT, SERVING_VS_UPSTREAM = 0.8, 1.0, 1.05, 1.3
# "8K" input: SmolLM2's 7936 (its 8192-token window less the 256 generated) and 8192
SERVING_LONG_INPUT = 7936


def _round_ratios(ours: dict, base: dict, figure: str) -> list[tuple[dict, float]]:
    """For two rows measured in rounds (``serve_bench --rounds``): each round of ``ours`` that
    ``base`` also has, with its ``figure`` over ``base``'s in the same round."""
    theirs = {r["round"]: r[figure] for r in base.get("rounds", ())}
    return [
        (r, r[figure] / theirs[r["round"]]) for r in ours.get("rounds", ()) if r["round"] in theirs
    ]


def _paired_ratio(ours: dict, base: dict, figure: str) -> tuple[float, int]:
    """``ours[figure] / base[figure]`` and 0, or for two rows measured in rounds the median of
    :func:`_round_ratios` and how many rounds were paired."""
    pairs = [x for _, x in _round_ratios(ours, base, figure)]
    if pairs:
        return statistics.median(pairs), len(pairs)
    return ours[figure] / base[figure], 0


def serving_targets_table(*paths: Path) -> str:
    """Every serving point a target applies to, from each result file in ``paths``: ``int8``'s
    median TPOT and TTFT against FlashAttention-2's and its output tok/s against upstream's, each
    with the bound it must meet and whether it does."""
    # by default also SmolLM2's H200 run, the only one with 128 requests, and the paired rounds
    paths = paths or (
        *SERVING_NEWEST,
        RESULTS / "serving.json",
        *SERVING_PAIRED,
    )
    lines = [
        "| model | run | input | concurrency | target | wanted | measured | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        result = _load(path)
        rows = _serving_rows(result)
        run = f"{result['gpu']}, {_provenance(result)}"
        for model, input_len, conc, dtype in _serving_keys(rows):
            if dtype != "int8":
                continue
            ours = rows[model, input_len, conc, dtype]
            fa2 = rows.get((model, input_len, conc, "auto_fa2"))
            upstream = rows.get((model, input_len, conc, UPSTREAM))
            long = conc >= 32 and input_len >= SERVING_LONG_INPUT
            # (what, int8's ratio and rounds, bound, whether the bound is a floor, the other row)
            checks = []
            if fa2:
                tpot = SERVING_TPOT_ONE if conc == 1 else (
                    SERVING_TPOT_LONG.get(model, SERVING_TPOT_LONG_DEFAULT) if long else None
                )  # fmt: skip
                if tpot is not None:
                    checks.append(("TPOT p50 vs `auto_fa2`",
                                   _paired_ratio(ours, fa2, "tpot_ms_p50"), tpot, False, fa2))  # fmt: skip
                checks.append(("TTFT p50 vs `auto_fa2`", _paired_ratio(ours, fa2, "ttft_ms_p50"),
                               SERVING_TTFT, False, fa2))  # fmt: skip
            if upstream and long:
                checks.append((f"output tok/s vs `{UPSTREAM}`",
                               _paired_ratio(ours, upstream, "output_tok_s"), SERVING_VS_UPSTREAM,
                               True, upstream))  # fmt: skip
            for what, (value, rounds), bound, at_least, base in checks:
                met = value >= bound if at_least else value <= bound
                control = host_control_note(ours, base).removeprefix(", ")
                how = ", ".join(x for x in (_pairing(rounds, ours), control) if x)
                paired = f" ({how})" if how else ""
                lines.append(
                    f"| {_serving_model_name(model, result)} | {run} | {input_len} | {conc} | "
                    f"{what} | {'≥' if at_least else '≤'} {bound:.2f}x | {value:.2f}x{paired} | "
                    f"{'yes' if met else '**no**'} |"
                )
    return "\n".join(lines)


# serve_bench --step-timing's phases (benchmarks/step_timing.py), in the order a step runs them
STEP_PHASES = (
    ("engine_step", "engine step"),
    ("schedule", "schedule"),
    ("execute_model", "execute_model"),
    ("update_states", "of it: update_states"),
    ("reorder_batch", "of that: the decodes-first reorder"),
    ("prepare_inputs", "of it: prepare_inputs"),
    ("build_attention_metadata", "of it: attention metadata"),
    ("sample_tokens", "sample_tokens"),
    ("update_from_output", "update_from_output"),
)


def serving_rounds_table(path: Path) -> str:
    """A run with ``serve_bench --rounds`` (``--interleave``: every dtype's server up at once,
    each point on each in turn): per point and dtype, TPOT and TTFT (medians over the point's
    requests) in each round against FlashAttention-2's in the same round, the median of those
    ratios, and which server ran the point first."""
    result = _load(path)
    rows = _serving_rows(result)
    lines = [
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'])}`. Each round's "
        "ratio against `auto_fa2` in the same round; (1st): this dtype's server ran the point "
        "first in that round.",
        "",
        "| model | input | concurrency | dtype | TPOT p50 against `auto_fa2`, each round | median "
        "| TTFT p50 against `auto_fa2`, each round | median |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in _serving_keys(rows):
        model, input_len, conc, dtype = key
        base = rows.get((model, input_len, conc, "auto_fa2"))
        if dtype == "auto_fa2" or not base or "rounds" not in rows[key]:
            continue
        cells = []
        for figure in ("tpot_ms_p50", "ttft_ms_p50"):
            ratios = _round_ratios(rows[key], base, figure)
            each = ", ".join(
                f"{x:.2f}x" + (" (1st)" if r["position"] == 0 else "") for r, x in ratios
            )
            median = f"{statistics.median(x for _, x in ratios):.2f}x" if ratios else "n/a"
            cells += [each or "n/a", median]
        lines.append(
            f"| {SERVING_MODEL_NAMES.get(model, model)} | {input_len} | {conc} | `{dtype}` | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def serving_steps_table(path: Path = RESULTS / "serving_gemma3.json") -> str:
    """The engine core's host time per engine step by phase (``serve_bench --step-timing``),
    each point's mean over its steps, beside the point's median TPOT; with ``--sync-debug`` the
    synchronizing CUDA calls the engine made after its warm-up steps."""
    result = _load(path)
    rows = _serving_rows(result)
    head = " | ".join(label for _, label in STEP_PHASES)
    lines = [
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'])}`. Host ms per "
        "engine step, means over each point's steps (vLLM's V1 model runner: `execute_model` "
        "runs the three phases after it, `update_states` the reorder); then `execute_model`'s "
        "mean over the decode steps and over the steps that carry a prompt chunk. n/a: not "
        "timed by that run.",
        "",
        f"| model | input | concurrency | dtype | TPOT p50 ms | engine steps | {head} "
        "| `execute_model` of a decode step: ms (steps) | of a step with a prompt chunk: ms "
        "(steps) | engine step vs `auto_fa2` | synchronizing CUDA calls |",
        "|---|---|---|---|---|---|" + "---|" * len(STEP_PHASES) + "---|---|---|---|",
    ]

    def per_call(phases: dict, name: str) -> str:
        phase = phases.get(name)
        return f"{phase['us_per_call'] / 1000:.3f} ({phase['calls']})" if phase else "n/a"

    for key in _serving_keys(rows):
        model, input_len, conc, dtype = key
        base_row = rows.get((model, input_len, conc, "auto_fa2")) or {}
        # a run in rounds: a line per round, against the baseline's same round
        for label, point, base in _round_points(rows[key], base_row):
            timing = point.get("step_timing") or {}
            phases = timing.get("phases") or {}
            step, base_step = (
                ((t or {}).get("phases") or {}).get("engine_step", {}).get("ms_per_step")
                for t in (timing, base.get("step_timing"))
            )  # fmt: skip
            vs = "reference" if dtype == "auto_fa2" else (
                f"{step / base_step:.2f}x" if step and base_step else "n/a"
            )  # fmt: skip
            syncs = (
                str(sum(timing["syncs"].values())) if timing.get("sync_debug") else "not counted"
            )  # fmt: skip
            cells = " | ".join(
                _num(phases.get(name, {}).get("ms_per_step"), ".3f") for name, _ in STEP_PHASES
            )
            lines.append(
                f"| {SERVING_MODEL_NAMES.get(model, model)} | {input_len} | {conc} | "
                f"`{dtype}`{label} | {point['tpot_ms_p50']:.2f} "
                f"| {_num(timing.get('engine_steps'), 'd')} | {cells} "
                f"| {per_call(phases, 'execute_model.decode')} "
                f"| {per_call(phases, 'execute_model.prompt')} | {vs} | {syncs} |"
            )
    return "\n".join(lines)


def serving_step_kinds_table(path: Path) -> str:
    """Where a point's engine time went by kind of step (``serve_bench --step-timing``): the
    decode-only steps and the steps that carry a prompt chunk, each's count and mean wall time,
    and the prompt steps' share of the two; each against ``auto_fa2``'s same round. The time per
    output token is paid in both kinds: every running sequence waits through a prompt step."""
    result = _load(path)
    rows = _serving_rows(result)
    lines = [
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'])}`. Engine steps by "
        "kind, the step timer's wall time of each (host work and the waits on the GPU in it); "
        "ratios against `auto_fa2` in the same round.",
        "",
        "| model | input | concurrency | dtype | TPOT p50 ms | decode steps | ms each | vs "
        "`auto_fa2` | steps with a prompt chunk | ms each | vs `auto_fa2` | their share of the "
        "engine time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def kinds(point: dict) -> dict[str, dict]:
        phases = (point.get("step_timing") or {}).get("phases") or {}
        return {k: phases.get(f"engine_step.{k}") or {} for k in ("decode", "prompt")}

    def vs(mine: dict, theirs: dict) -> str:
        a, b = mine.get("us_per_call"), theirs.get("us_per_call")
        return f"{a / b:.2f}x" if a and b else "n/a"

    for key in _serving_keys(rows):
        model, input_len, conc, dtype = key
        base_row = rows.get((model, input_len, conc, "auto_fa2")) or {}
        for label, point, base in _round_points(rows[key], base_row):
            mine, theirs = kinds(point), kinds(base)
            if not all(mine[k].get("calls") for k in mine):
                continue
            spent = {k: v["calls"] * v["us_per_call"] for k, v in mine.items()}
            share = spent["prompt"] / (spent["prompt"] + spent["decode"])
            cells = [
                f"{mine[k]['calls']} | {mine[k]['us_per_call'] / 1000:.2f} | "
                + ("reference" if dtype == "auto_fa2" else vs(mine[k], theirs[k]))
                for k in ("decode", "prompt")
            ]
            lines.append(
                f"| {SERVING_MODEL_NAMES.get(model, model)} | {input_len} | {conc} | "
                f"`{dtype}`{label} | {point['tpot_ms_p50']:.2f} | {' | '.join(cells)} "
                f"| {share:.0%} |"
            )
    return "\n".join(lines)


# the step timer's per-layer phases (benchmarks/step_timing.py PER_LAYER), as the table orders them
LAYER_PHASES = ("attention_forward", "kv_cache_update")


def serving_layer_host_table(path: Path) -> str:
    """The engine's host time by kind of step (``serve_bench --step-timing``, from the step timer's
    split of the engine step) and, in the steps that carry a prompt, each layer's attention and
    cache update on the host (ours or FlashAttention-2's, µs a layer call), per point (per round
    of a run in rounds, against the baseline's same round)."""
    result = _load(path)
    rows = _serving_rows(result)
    lines = [
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'])}`. Host time at "
        "full speed, means over each point's calls; n/a: not timed.",
        "",
        "| model | input | concurrency | dtype | engine step ms: decode (steps) | with a prompt "
        "chunk (steps) | in those steps, a layer's attention µs | its cache update µs | both "
        "vs `auto_fa2` |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def layer_us(point: dict) -> float | None:
        parts = [_phase(point, f"{n}.prompt").get("us_per_call") for n in LAYER_PHASES]
        return sum(parts) if all(p is not None for p in parts) else None

    def step_ms(point: dict, kind: str) -> str:
        p = _phase(point, f"engine_step.{kind}")
        return f"{p['us_per_call'] / 1000:.2f} ({p['calls']})" if p else "n/a"

    for key in _serving_keys(rows):
        model, input_len, conc, dtype = key
        base_row = rows.get((model, input_len, conc, "auto_fa2")) or {}
        for label, point, base in _round_points(rows[key], base_row):
            ours, theirs = layer_us(point), layer_us(base)
            vs = _vs_fa2(dtype, ours, theirs)
            cells = " | ".join(
                _num(_phase(point, f"{n}.prompt").get("us_per_call"), ".1f") for n in LAYER_PHASES
            )
            lines.append(
                f"| {SERVING_MODEL_NAMES.get(model, model)} | {input_len} | {conc} | "
                f"`{dtype}`{label} | {step_ms(point, 'decode')} | {step_ms(point, 'prompt')} "
                f"| {cells} | {vs} |"
            )
    return "\n".join(lines)


# the parts of an attention call the step timer times (benchmarks/step_timing.py ATTENTION_PARTS),
# as the parts table orders them, with their column names
ATTENTION_PARTS = (("fa2_call", "FlashAttention-2's call"), ("attention_ours", "our kernels"),
                   ("int4_write", "`int4`'s write"))  # fmt: skip


def serving_attention_parts_table(path: Path) -> str:
    """In the steps that carry a prompt, a layer's attention call on the host split into the parts
    the step timer times inside it (µs per attention call: a part called twice in one call counts
    twice) and the rest (our Python and torch ops between them), per point and round."""
    result = _load(path)
    rows = _serving_rows(result)
    names = " | ".join(f"of it: {label}" for _, label in ATTENTION_PARTS)
    lines = [
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'])}`. Host time at "
        "full speed in the steps that carry a prompt chunk, µs per layer's attention call; "
        "n/a: not timed.",
        "",
        f"| model | input | concurrency | dtype | a layer's attention µs | {names} | the rest | "
        "attention vs `auto_fa2` |",
        "|---|---|---|---|---|" + "---|" * len(ATTENTION_PARTS) + "---|---|",
    ]

    def per_call(point: dict) -> tuple[float | None, list[float | None]]:
        whole = _phase(point, "attention_forward.prompt")
        if not whole.get("calls"):
            return None, [None] * len(ATTENTION_PARTS)
        parts = []
        for name, _ in ATTENTION_PARTS:
            p = _phase(point, f"{name}.prompt")
            parts.append(p["calls"] * p["us_per_call"] / whole["calls"] if p else None)
        return whole["us_per_call"], parts

    for key in _serving_keys(rows):
        model, input_len, conc, dtype = key
        base_row = rows.get((model, input_len, conc, "auto_fa2")) or {}
        for label, point, base in _round_points(rows[key], base_row):
            whole, parts = per_call(point)
            timed = [x for x in parts if x is not None]
            rest = whole - sum(timed) if whole is not None and timed else None
            theirs = per_call(base)[0]
            vs = _vs_fa2(dtype, whole, theirs)
            cells = " | ".join(_num(x, ".1f") for x in (whole, *parts, rest))
            lines.append(
                f"| {SERVING_MODEL_NAMES.get(model, model)} | {input_len} | {conc} | "
                f"`{dtype}`{label} | {cells} | {vs} |"
            )
    return "\n".join(lines)


# vLLM's own per-step work, the same in two servers of one page size at one point: the
# scheduler's two calls in the engine core and the API server's output processing
# (benchmarks/step_timing.py); their ratio across two such servers is how fast each one's host
# ran. Our code runs in them only as the prefix-hit check of tail dtypes (int4), once per starting
# request, and it gives nothing back for the others.
HOST_CONTROL_PHASES = (("schedule", "scheduler's `schedule`"),
                       ("update_from_output", "scheduler's `update_from_output`"),
                       ("process_outputs", "API server's `process_outputs`"))  # fmt: skip


# beyond this fraction either way, a point's host control says its servers' hosts ran unlike
HOST_CONTROL_LEVEL = 0.10


def host_control_note(ours: dict, base: dict) -> str:
    """``, vLLM's `schedule` took 1.40x as long in `int8`'s server`` where the first control of
    :data:`HOST_CONTROL_PHASES` differs by more than :data:`HOST_CONTROL_LEVEL` between the two
    rows' servers (the same work: the hosts ran unlike; for rows in rounds, the median of the
    rounds' ratios), else ""."""
    name = HOST_CONTROL_PHASES[0][0]
    ratios = []
    for _, mine, theirs in _round_points(ours, base):
        a, b = (_phase(r, name).get("us_per_call") for r in (mine, theirs))
        if a and b:
            ratios.append(a / b)
    ratio = statistics.median(ratios) if ratios else 1.0
    if abs(ratio - 1) <= HOST_CONTROL_LEVEL:
        return ""
    median = "a median of " if len(ratios) > 1 else ""
    return f", vLLM's `{name}` took {median}{ratio:.2f}x as long in `{ours['dtype']}`'s server"


def serving_host_control_table(path: Path) -> str:
    """Per point (per round), the median TPOT against ``auto_fa2``'s beside a host-speed control:
    the host time of each of vLLM's own per-step calls in :data:`HOST_CONTROL_PHASES`, µs per
    call, against ``auto_fa2``'s server at the same point. Level controls: the servers' hosts ran
    alike and the TPOT ratio is the dtype's; unlevel: the host moved the TPOT ratio too.
    ``int4``'s rows are left out: its 64-token pages give the scheduler a quarter of the blocks
    to allocate and hash, so its calls are not the same work."""
    result = _load(path)
    rows = _serving_rows(result)
    names = " | ".join(f"{label} µs (vs `auto_fa2`)" for _, label in HOST_CONTROL_PHASES)
    lines = [
        f"{result['gpu']}, {_provenance(result)}, `{_short(result['command'])}`. Host time of "
        "vLLM's own per-step calls, the same work in servers of one page size (`int4` left "
        "out: 64-token pages), means over each point's calls; n/a: not timed.",
        "",
        f"| model | input | concurrency | dtype | TPOT p50 ms | vs `auto_fa2` | {names} |",
        "|---|---|---|---|---|---|" + "---|" * len(HOST_CONTROL_PHASES),
    ]
    for key in _serving_keys(rows):
        model, input_len, conc, dtype = key
        if config_for(dtype)["kv_cache_dtype"] in TAIL_DTYPES:
            continue
        base_row = rows.get((model, input_len, conc, "auto_fa2")) or {}
        for label, point, base in _round_points(rows[key], base_row):
            cells = []
            for name, _ in HOST_CONTROL_PHASES:
                ours = _phase(point, name).get("us_per_call")
                theirs = _phase(base, name).get("us_per_call")
                vs = _vs_fa2(dtype, ours, theirs)
                cells.append("n/a" if ours is None else f"{ours:.0f} ({vs})")
            tpot_vs = _vs_fa2(dtype, point["tpot_ms_p50"], base.get("tpot_ms_p50"))
            lines.append(
                f"| {SERVING_MODEL_NAMES.get(model, model)} | {input_len} | {conc} | "
                f"`{dtype}`{label} | {point['tpot_ms_p50']:.2f} | {tpot_vs} | "
                f"{' | '.join(cells)} |"
            )
    return "\n".join(lines)


def _round_points(row: dict, base: dict) -> list[tuple[str, dict, dict]]:
    """A serving row's points, each with its baseline: the row itself against ``base`` (the
    baseline's row), or for a run in rounds each round, labelled ", round r" (and " (1st)" where
    this dtype's server ran the point first), against the baseline's same round ({} if it has
    none)."""
    if not row.get("rounds"):
        return [("", row, base)]
    theirs = {r["round"]: r for r in base.get("rounds", ())}
    return [
        (f", round {r['round']}{' (1st)' if r.get('position') == 0 else ''}", r,
         theirs.get(r["round"], {}))
        for r in row["rounds"]
    ]  # fmt: skip


def _count_models(runs: Sequence[Path]) -> str:
    models = {r["model"] for path in runs if path.exists() for r in _load(path)["rows"]}
    return f"{len(models)} model{'s' if len(models) != 1 else ''}"


def serving_summary_table(
    newest: Sequence[Path] = SERVING_NEWEST, paired: Sequence[Path] = SERVING_PAIRED
) -> str:
    """The README's serving table: per model, ``int8``'s median TPOT and TTFT against
    FlashAttention-2's and its output tok/s against upstream's at each point of its newest runs
    (``newest``, in order), then each point from the newest run in paired rounds that has it (the
    median of the rounds' ratios; ``paired`` oldest first)."""
    lines = [
        "| model | prompt tokens | requests | time per output token | time to first token "
        f"| output tok/s vs `{UPSTREAM}` | measured | GPU, run |",
        "|---|---|---|---|---|---|---|---|",
    ]

    docs = {p: _load(p) for p in (*newest, *paired) if p.exists()}

    def of_model(paths: Sequence[Path], model: str) -> list[dict]:
        return [docs[p] for p in paths if p in docs and any(
            r["model"] == model for r in docs[p]["rows"])]  # fmt: skip

    def times(ratio: float | None) -> str:
        return "-" if ratio is None else f"{ratio:.2f}x"

    def int8_points(result: dict, model: str) -> list[tuple[tuple, str]]:
        """(point as the table names it, its line) of each int8 point of ``model`` with a
        FlashAttention-2 or an upstream row in ``result``."""
        rows = _serving_rows(result)
        # a server started for a profiled point keeps the profiler configured for every point
        notes = (
            ", servers profiled" if re.search(r"--profile-concurrency [1-9]", result["command"])
            else ""
        )  # fmt: skip
        threads = re.search(r"--renderer-num-workers[ =](\d+)", result["command"])
        notes += f", {threads[1]} tokenising threads" if threads else ""
        points = []
        for m, input_len, conc, dtype in _serving_keys(rows):
            fa2 = rows.get((m, input_len, conc, "auto_fa2"))
            upstream = rows.get((m, input_len, conc, UPSTREAM))
            if m != model or dtype != "int8" or not (fa2 or upstream):
                continue
            ours = rows[m, input_len, conc, dtype]
            (tpot, n), (ttft, _), (tok_s, n_up) = (
                _paired_ratio(ours, base, key) if base else (None, 0)
                for base, key in ((fa2, "tpot_ms_p50"), (fa2, "ttft_ms_p50"),
                                  (upstream, "output_tok_s"))
            )  # fmt: skip
            how = _pairing(n or n_up, ours) or "one pass"
            control = host_control_note(ours, fa2) if fa2 else ""
            name = _serving_model_name(m, result)
            points.append((
                (name, input_len, conc),
                f"| {name} | {input_len} | {conc} | {times(tpot)} | {times(ttft)} | "
                f"{times(tok_s)} | {how}{notes}{control} | {result['gpu']}, "
                f"{_provenance(result)} |",
            ))  # fmt: skip
        return points

    for model in SERVING_MODEL_NAMES:
        for result in of_model(newest, model):
            lines += [line for _, line in int8_points(result, model)]
        # each point once, from the newest paired run that has it
        paired_points: dict[tuple, str] = {}
        for result in of_model(paired, model)[::-1]:
            for point, line in int8_points(result, model):
                paired_points.setdefault(point, line)
        lines += [paired_points[point] for point in sorted(paired_points)]
    return "\n".join(lines)


def _calls_caption(result: dict) -> str:
    """Who measured, and each call's command in the order they ran."""
    calls = "; ".join(
        f"{i}. `{_short(call['command'])}`" for i, call in enumerate(result["calls"], 1)
    )
    return f"{result['model']}, {result['gpu']}, {_provenance(result)}. Calls, in order: {calls}."


def single_runs_table(path: Path = RESULTS / "throughput_1k_single_runs.json") -> str:
    """One line per call of one timed run each: speed, engine steps, time per step.
    Runs of one workload with different times per step ran on a host whose speed moved."""
    result = _load(path)
    lines = [
        _calls_caption(result),
        "",
        "| call | config | gen tok/s | engine steps | tokens per step | ms per step |",
        "|---|---|---|---|---|---|",
    ]
    for i, call in enumerate(result["calls"], 1):
        for r in call["rows"]:
            lines.append(
                f"| {i} | `{r['dtype']}` | {r['gen_tok_s']:.0f} "
                f"| {r['engine_steps']} | {r['tokens_per_step']:.0f} | {r['ms_per_step']:.1f} |"
            )
    return "\n".join(lines)


def repeat_runs_table(path: Path = RESULTS / "throughput_1k_repeats.json") -> str:
    """One line per timed run of ``throughput.py --repeats`` calls, in the order they ran, with
    the host probe (a fixed Python loop timed just before each run)."""
    result = _load(path)
    lines = [
        _calls_caption(result),
        "",
        "| call | config | run | gen tok/s | engine steps | tokens per step "
        "| ms per step | host probe ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, call in enumerate(result["calls"], 1):
        for r in call["rows"]:
            for k, run in enumerate(r["runs"], 1):
                lines.append(
                    f"| {i} | `{r['dtype']}` | {k} | {run['gen_tok_s']:.0f} "
                    f"| {run['engine_steps']} | {run['tokens_per_step']:.0f} "
                    f"| {run['ms_per_step']:.1f} | {run['host_probe_ms']:.1f} |"
                )
    return "\n".join(lines)


def paired_runs_table(path: Path = RESULTS / "throughput_1k_paired.json") -> str:
    """One line per turn pair of ``throughput.py --paired`` calls: both configurations' runs,
    taken back to back in the order shown, their host probes and the B/A ratio; the last line
    per call and context is the median ratio the call recorded."""
    result = _load(path)
    lines = [
        _calls_caption(result),
        "",
        "| call | ctx | turn | order | A gen tok/s (probe ms; ms a step) "
        "| B gen tok/s (probe ms; ms a step) | B/A |",
        "|---|---|---|---|---|---|---|",
    ]
    every_call: dict[tuple[str, str, int], list[float]] = {}
    for i, call in enumerate(result["calls"], 1):
        runs = {(r["dtype"], r["ctx"]): r["runs"] for r in call["rows"] if "runs" in r}
        for pair in call.get("paired", []):
            a, b, ctx = pair["a"], pair["b"], pair["ctx"]
            # throughput.paired_ratios writes one order entry and one ratio per pair of runs
            turns = zip(runs[(a, ctx)], runs[(b, ctx)], pair["order"], pair["ratios"], strict=True)
            for k, (ra, rb, order, ratio) in enumerate(turns, 1):
                lines.append(
                    f"| {i} | {ctx} | {k} | {' '.join(f'`{x}`' for x in order)} "
                    f"| {_paired_run(ra)} | {_paired_run(rb)} | {ratio:.2f}x |"
                )
            lines.append(
                f"| {i} | {ctx} | median | A = `{a}`, B = `{b}` | | | "
                f"**{pair['median_ratio']:.2f}x** |"
            )
            every_call.setdefault((a, b, ctx), []).extend(pair["ratios"])
    calls_of = collections.Counter(
        (p["a"], p["b"], p["ctx"]) for call in result["calls"] for p in call.get("paired", [])
    )
    for (a, b, ctx), ratios in every_call.items():
        if calls_of[(a, b, ctx)] > 1:
            # the lower median, as throughput.paired_ratios takes within a call
            lines.append(
                f"| all calls | {ctx} | median of {len(ratios)} | A = `{a}`, B = `{b}` | | | "
                f"**{statistics.median_low(ratios):.2f}x** |"
            )
    return "\n".join(lines)


# throughput.py --step-timing's phases (benchmarks/step_timing.py), the columns of its table
THROUGHPUT_STEP_PHASES = (
    ("engine_step", "engine step"),
    ("schedule", "schedule"),
    ("execute_model", "execute_model"),
    ("attention_forward", "of it: attention, all layers"),
    ("int4_write", "of that: `int4`'s write"),
    ("attention_ours", "of that: our kernels' calls"),
    ("fa2_call", "of that: FlashAttention-2's calls"),
    ("update_from_output", "update_from_output"),
)


def _throughput_calls(result: dict) -> list[dict]:
    """A throughput result's calls: its ``calls`` (paired calls merged), or, for a details file,
    the file itself as one call."""
    return result.get("calls") or [{"command": result["command"], "rows": result["rows"]}]


def _runs_table_head(path: Path, note: str, columns: list[str]) -> tuple[list[dict], list[str]]:
    """A throughput file's calls, and the caption and header of a table with a line per timed
    run: call, config and run, then ``columns``."""
    result = _load(path)
    calls = _throughput_calls(result)
    columns = ["call", "config", "run", *columns]
    return calls, [
        _calls_caption({**result, "calls": calls}) + " " + note,
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]


def _timed_runs(
    calls: list[dict], row_is_run: bool = False
) -> Iterator[tuple[int, dict, int, dict]]:
    """(call number, row, run number, run) of every timed run of ``calls``' rows; with
    ``row_is_run``, a row without ``runs`` (one run, a details file's) as its own run."""
    for i, call in enumerate(calls, 1):
        for row in call["rows"]:
            runs = row.get("runs") or ([row] if row_is_run else [])
            for k, run in enumerate(runs, 1):
                yield i, row, k, run


def throughput_steps_table(path: Path) -> str:
    """``throughput.py --step-timing``: per timed run, its wall time a step beside the host time
    the engine's step timer summed by phase, in ms per engine step. A file of ``calls`` (paired
    calls merged) gives each call's runs; a details file, its rows' runs."""
    calls, lines = _runs_table_head(
        path,
        "Host ms per engine step by phase, each timed run's sums over its steps (n/a: the phase "
        "was not called in the run).",
        ["wall ms a step", *(title for _, title in THROUGHPUT_STEP_PHASES)],
    )
    for i, row, k, run in _timed_runs(calls):
        phases = (run.get("step_timing") or {}).get("phases") or {}
        cells = [_num((phases.get(name) or {}).get("ms_per_step"), ".2f")
                 for name, _ in THROUGHPUT_STEP_PHASES]  # fmt: skip
        lines.append(
            f"| {i} | `{row['dtype']}` | {k} | {_num(run.get('ms_per_step'), '.2f')} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def step_cost_table(path: Path) -> str:
    """``throughput.py --step-stats``: per timed run, its time a step beside the requests it ran at
    once and the tokens a step carried, and the time a step per running request and per thousand
    tokens. Where those two stay level across configurations, a cache that holds more requests
    makes steps longer in proportion and the run no shorter. A file of ``calls`` (paired calls
    merged) gives each call's runs; a details file, its rows' runs."""
    calls, lines = _runs_table_head(
        path,
        "Requests running: vLLM's gauge read every 0.25 s of each timed run's wall time and "
        "averaged (its ramp-up and tail included).",
        ["gen tok/s", "ms a step", "requests running", "µs a step per running request",
         "tokens a step", "ms a step per 1000 tokens"],
    )  # fmt: skip
    for i, row, k, run in _timed_runs(calls, row_is_run=True):
        ms, running, tokens = run["ms_per_step"], run["mean_running"], run["tokens_per_step"]
        lines.append(
            f"| {i} | `{row['dtype']}` | {k} | {run['gen_tok_s']:.0f} | {ms:.2f} "
            f"| {running:.1f} | {ms / running * 1e3:.0f} | {tokens:.0f} "
            f"| {ms / tokens * 1e3:.2f} |"
        )
    return "\n".join(lines)


def step_kinds_table(path: Path) -> str:
    """``throughput.py --step-timing``: per timed run, its decode steps (no prompt chunk) and
    prompt-carrying steps apart: how many, how long (the engine step and its execute_model), and
    how many decode steps called the attention layers on the host, which a step replaying a FULL
    CUDA graph never does (counted in steps: the decode steps' attention calls over the layers a
    step calls, the prompt-carrying steps' calls over their count)."""
    calls, lines = _runs_table_head(
        path,
        "Steps by kind and host ms a step, from each timed run's step timer.",
        ["gen tok/s", "requests running", "decode steps", "of them with attention on the host",
         "ms a decode step", "of it execute_model", "prompt-carrying steps",
         "ms a prompt-carrying step", "of it execute_model"],
    )  # fmt: skip
    for i, row, k, run in _timed_runs(calls):
        phases = run["step_timing"]["phases"]
        calls_of = {name: p["calls"] for name, p in phases.items()}
        layers = calls_of["attention_forward.prompt"] / calls_of["engine_step.prompt"]
        cells = [f"{run['gen_tok_s']:.0f}", f"{run['mean_running']:.1f}"]
        for kind in ("decode", "prompt"):
            cells.append(str(calls_of[f"engine_step.{kind}"]))
            if kind == "decode":
                host = calls_of.get("attention_forward.decode", 0) / layers
                cells.append(f"{host:.0f}")
            cells += [f"{phases[f'{name}.{kind}']['us_per_call'] / 1e3:.2f}"
                      for name in ("engine_step", "execute_model")]  # fmt: skip
        lines.append(f"| {i} | `{row['dtype']}` | {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _paired_run(run: dict) -> str:
    """A timed run of a paired call: generation throughput (host probe ms; ms an engine step)."""
    step = f"; {run['ms_per_step']:.1f}" if "ms_per_step" in run else ""
    return f"{run['gen_tok_s']:.0f} ({run['host_probe_ms']:.1f}{step})"


# vLLM's torch-profiler table (profile_LABEL_CTX.txt): columns split by runs of 2+ spaces
_PROFILE_COLS = ("name", "self_cpu_pct", "self_cpu", "cpu_total_pct", "cpu_total", "cpu_avg",
                 "self_cuda", "self_cuda_pct", "cuda_total", "cuda_avg", "calls")  # fmt: skip
# our backend's custom ops and FlashAttention-2's: where each configuration's attention host time
# shows up (vLLM lists only the rows with the most CUDA time, so one may be missing)
_ATTENTION_OPS = ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update",
                  "_vllm_fa2_C::varlen_fwd", "_C_cache_ops::reshape_and_cache_flash")  # fmt: skip
# our Triton kernels, by the names the profiler gives them: their GPU time and calls
_OUR_KERNELS = ("_attn_fwd", "_attn_int4_fwd", "merge_splits", "_write_kv_kernel",
                "_flush_pages_kernel", "_store_tail_kernel", "_store_sink_kernel",
                "_gather_kv_kernel", "_gather_int4_kernel")  # fmt: skip


def _seconds(text: str) -> float:
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise ValueError(f"not a time: {text!r}")


def parse_profile(path: Path) -> dict:
    """Wall time, total GPU kernel time and per-op host time of a ``throughput.py --profile`` table."""
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


def profile_summary(path: Path) -> dict:
    """What ``profile_table`` and ``profile_kernels_table`` read of a profile: wall and GPU time,
    the attention ops' host time, our kernels' GPU time. Profiles are text tables too large to
    keep; a result file keeps this instead."""
    prof = parse_profile(path)
    return {
        "source": path.name,
        "wall_s": prof["wall_s"],
        "gpu_s": prof["gpu_s"],
        "ops": {
            name: {"cpu_total_s": round(_seconds(op["cpu_total"]), 6), "calls": int(op["calls"])}
            for name, op in prof["ops"].items()
            if name in _ATTENTION_OPS
        },
        "kernels": {
            name: {"gpu_s": round(_seconds(op["self_cuda"]), 6), "calls": int(op["calls"])}
            for name, op in prof["ops"].items()
            if name in _OUR_KERNELS
        },
    }  # fmt: skip


def profile_table(throughput_path: Path = RESULTS / "throughput_profiled_1k.json") -> str:
    """The profiled 1K pair: throughput, and per configuration GPU busy time against wall time
    and the host time of the attention ops, from the file's ``profiles``."""
    result = _load(throughput_path)
    lines = [
        throughput_table(throughput_path),
        "",
        "| config | profiled generate, wall s | GPU kernel time, s | GPU busy | host time per call "
        "of the attention ops listed (CPU total) |",
        "|---|---|---|---|---|",
    ]
    for row in sorted(result["rows"], key=lambda r: r["dtype"]):
        prof = result["profiles"][row["dtype"]]
        host = ", ".join(
            f"`{name}` {op['cpu_total_s'] * 1e6 / op['calls']:.0f} µs"
            for name in _ATTENTION_OPS
            if (op := prof["ops"].get(name))
        )
        lines.append(
            f"| `{row['dtype']}` | {prof['wall_s']:.2f} | {prof['gpu_s']:.2f} | "
            f"{100 * prof['gpu_s'] / prof['wall_s']:.0f}% | {host} |"
        )
    return "\n".join(lines)


def profile_kernels_table(throughput_path: Path) -> str:
    """Our kernels' GPU time in each configuration's profile (the file's ``profiles``, whose
    summaries keep them): ms in all, calls and µs a call; "not listed" where the profiler's table
    (its rows with the most CUDA time) has no row of that name, or the kernel does not run."""
    profiles = _load(throughput_path)["profiles"]
    labels = sorted(profiles)
    names = [k for k in _OUR_KERNELS if any(k in profiles[c].get("kernels", {}) for c in labels)]
    lines = [
        "| kernel | " + " | ".join(f"`{c}`: ms (calls, µs a call)" for c in labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for name in names:
        cells = []
        for c in labels:
            k = profiles[c].get("kernels", {}).get(name)
            cells.append(
                f"{k['gpu_s'] * 1e3:.1f} ({k['calls']}, {k['gpu_s'] * 1e6 / k['calls']:.1f})"
                if k else "not listed"
            )  # fmt: skip
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# serving, long context, format simulation, GPU test runs


def reliability_table(
    soak_path: Path = RESULTS / "soak.json", long_path: Path = RESULTS / "long_context.json"
) -> str:
    """The serving soak and the long-context comparison, one line each."""
    soak = _load(soak_path)
    long = _load(long_path)
    ref = long["reference"]
    lines = [
        "| check | model, GPU | measured | command | result |",
        "|---|---|---|---|---|",
        f"| serving soak, `--kv-cache-dtype {soak['dtype']}` | {soak['model']}, {soak['gpu']} "
        f"| {_provenance(soak)} | `{_short(soak['command'])}` | {soak['requests']} requests "
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
            f"| {_provenance(long)} | `{_short(long['command'])}` | {len(rows)} prompts of "
            f"{long['prompt_len']} tokens: {same}/{len(rows)} identical over the first 32 "
            "generated tokens"
            + (f" (divergences: {', '.join(kinds)})" if kinds else "")
            + f", {nan} with NaN |"
        )
    return "\n".join(lines)


def kv_quant_sim_table(path: Path = RESULTS / "kv_quant_sim.json") -> str:
    """ΔPPL of simulated cache formats (benchmarks/kv_quant_sim.py)."""
    result = _load(path)
    bos = "" if result.get("bos") is None else f", each led by BOS id {result['bos']}"
    # files written before the agreement metrics keep their table; rows without them print "-"
    agreement = any("top1_agreement" in row for row in result["rows"])
    lines = [
        f"{result['model']} on `{result['corpus']}` ({result['tokens']} tokens, windows of "
        f"{result['window']}{bos}), {result['device']}, {_provenance(result)}, "
        f"`{_short(result['command'])}`.",
        "",
        "| variant | PPL | ΔPPL | ± (s.e.) | K+V bytes per token and head | capacity vs BF16 |"
        + (" top-1 agreement with BF16 | KL(BF16 ‖ variant), nats |" if agreement else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if agreement else ""),
    ]
    for row in result["rows"]:
        lines.append(
            f"| `{row['variant']}` | {row['ppl']:.3f} | {row['delta_pct']:+.2f}% "
            f"| {_num(row['delta_se_pct'], '.2f')} | {row['kv_bytes_per_token_head']:g} "
            f"| {row['capacity_vs_bf16']:.2f}x |"
            + (
                f" {_num(row.get('top1_agreement'), '.4f')} | {_num(row.get('kl_mean'), '.5f')} |"
                if agreement
                else ""
            )
        )
    return "\n".join(lines)


def kv_quant_greedy_table(
    path: Path = RESULTS / "kv_quant_greedy.json", later_gpu_details: tuple[str, ...] = ()
) -> str:
    """Greedy agreement with BF16 of simulated cache formats, decoded through a KV cache
    (benchmarks/kv_quant_greedy.py); under it, the GPU run's agreement on the same prompts that
    the simulation recorded, and that of each GPU run made since (``later_gpu_details``: details
    files of ``accuracy.py`` over the same prompt set, read now)."""
    result = _load(path)
    bos = "" if result.get("bos") is None else f", each led by BOS id {result['bos']}"
    lengths = "/".join(str(n) for n in result["lengths"])
    done = result["prompts_done"]
    which = [] if done == result["prompts"] else [f"the first {done} of {result['prompts']}"]
    if "prompt_set" in result:
        stride = result["prompt_set"] // result["prompts"]
        first = result["prompt_indices"][0]
        which.append(
            f"one in every {stride} of `accuracy.py`'s {result['prompt_set']}"
            + (f" from its prompt {first}" if first else "")
        )
    else:  # a run before prompt_set: the prompt maker asked for this many, not accuracy.py's
        which.append(f"`make_greedy_prompts` for {result['prompts']}")
    which.append(f"{lengths} tokens in turn{bos}")
    versus = result["versus"]
    lines = [
        f"{result['model']}: {result['tokens']} greedy tokens after each of {done} prompts "
        f"({'; '.join(which)}) from `{result['corpus']}`, {result['device']}, "
        f"{_provenance(result)}, `{_short(result['command'])}`.",
        "",
        "| variant | greedy agreement with BF16 | ± (s.e.) | identical continuations "
        f"| over `{versus}`'s agreement | ± (s.e., delta method) |",
        "|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(result["rows"]):
        # the reference row's ratio is 1 / versus's agreement: no measure of a format
        ratio = row.get("ratio_vs_versus") if i else None
        lines.append(
            f"| `{row['variant']}` | {row['greedy_agree']:.3f} "
            f"| {_num(row['greedy_agree_se'], '.3f')} | {row['greedy_seq_agree']:.2f} "
            f"| {'-' if ratio is None else f'{ratio:.2f}x'} "
            f"| {'-' if ratio is None else _num(row.get('ratio_se'), '.2f')} |"
        )
    gpu_runs = [result["gpu_same_prompts"]] if result.get("gpu_same_prompts") else []
    if later_gpu_details:
        from benchmarks.kv_quant_greedy import GPU_VERSUS, gpu_same_prompts

        indices = result["prompt_indices"][:done]
        versus = gpu_runs[0]["versus"] if gpu_runs else GPU_VERSUS
        for name in later_gpu_details:
            details = _load(RESULTS / name)
            gpu_runs.append(
                {"file": name, **gpu_same_prompts(details, indices, result["tokens"], versus)}
            )
    for gpu in gpu_runs:
        cells = []
        # the details file names its reference row: every other row's agreement is with it
        reference = _load(RESULTS / gpu["file"])["reference"]
        for label, row in gpu["rows"].items():
            if label == reference:
                continue
            cell = (
                f"`{label}` {row['greedy_agree']:.3f} ± {_num(row.get('greedy_agree_se'), '.3f')}"
            )
            if "ratio_vs_versus" in row and label != gpu["versus"]:
                cell += f" ({row['ratio_vs_versus']:.2f}x ± {row['ratio_se']:.2f})"
            cells.append(cell)
        lines += [
            "",
            f"vLLM on the GPU, the same {done} prompts ([`{gpu['file']}`]"
            f"(../benchmarks/results/{gpu['file']}), agreement with its `{reference}` row; in brackets "
            f"over `{gpu['versus']}`'s): " + ", ".join(cells) + ".",
        ]
    return "\n".join(lines)


def tail_pool_capacity_table(path: Path = RESULTS / "tail_pool_capacity.json") -> str:
    """``int4``'s tokens over BF16's in the same KV memory, the tail pool taken out of it, by
    model, ``max_num_seqs`` and KV memory with one BF16 page a slot, then at the shim's default
    ``max_num_seqs`` with each count of pages a slot (computed: benchmarks/tail_pool_capacity.py)."""
    result = _load(path)
    # files from before the sink page and the second tail page: one page a slot
    names = result.get("slot_pages", {"1": "tail page"})

    def slot(pages: int) -> str:
        return f"{pages}: {names[str(pages)]}"

    rows = [r for r in result["rows"] if r.get("pages_per_slot", 1) == 1]
    gibs = sorted({r["kv_gib"] for r in rows})
    lines = [
        f"Computed from the catalogue's byte counts, not measured ({_provenance(result)}, "
        f"`{_short(result['command'])}`); 0.00x: the pool alone outgrows the memory. The "
        "`max_num_seqs` rows are for one BF16 page a slot: k pages a slot cost what k times the "
        "slots do.",
        "",
        "| model (layers, kv-heads x head size) | BF16 pages a slot | `max_num_seqs` | tail pool |"
        + "".join(f" {g} GiB |" for g in gibs),
        "|---|---|---|---|" + "---|" * len(gibs),
    ]
    seen: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        seen.setdefault((r["model"], r["max_num_seqs"]), {})[r["kv_gib"]] = r
    for (model, seqs), by_gib in seen.items():
        first = next(iter(by_gib.values()))
        shape = f"{first['layers']}, {first['kv_heads']} x {first['head_size']}"
        lines.append(
            f"| {model} ({shape}) | {slot(1)} | {seqs} | {first['tail_pool_gib']:g} GiB |"
            + "".join(f" {by_gib[g]['int4_vs_bf16']:.2f}x |" for g in gibs)
        )
    # the shim's own default (vLLM's lowered until the pool fits its share), where it has one
    defaults: dict[tuple[str, int], dict[int, dict]] = {}
    for r in result.get("shim_defaults", []):
        key = (r["model"], r.get("pages_per_slot", 1))
        defaults.setdefault(key, {})[r["kv_gib"]] = r
    for (model, pages), by_gib in defaults.items():
        first = next(iter(by_gib.values()))
        # files from before the default counted max_model_len's sequences name none
        length = f", {first['max_model_len']}-token sequences" if first.get("max_model_len") else ""
        lines.append(
            f"| {model} | {slot(pages)} | the shim's default for vLLM's {first['vllm_default']}"
            f"{length} | - |"
            + "".join(
                f" {by_gib[g]['int4_vs_bf16']:.2f}x ({by_gib[g]['max_num_seqs']}) |" for g in gibs
            )
        )
    return "\n".join(lines)


def gpu_test_runs_table(path: Path = RESULTS / "gpu_test_runs.json") -> str:
    """Every recorded GPU test run, latest first: pytest's summary, and the greedy comparisons of
    the end-to-end tests (identical prompts over the first tokens, with the BF16 control's)."""
    result = _load(path)
    lines = [
        "| measured | GPU | command | result | greedy comparisons: identical prompts (control) |",
        "|---|---|---|---|---|",
    ]
    for run in reversed(result["rows"]):  # the file lists them in the order they ran
        parts = []
        for c in run.get("comparisons", []):
            text = f"{c['what']}: {c['identical']}/{c['prompts']}"
            if control := c.get("control"):
                text += f" ({control['what']}: {control['identical']}/{control['prompts']})"
            parts.append(text)
        result_text = run["result"] + (f" ({run['note']})" if "note" in run else "")
        lines.append(
            f"| {_provenance(run)} | {run['gpu']} | `{run['command']}` | {result_text} "
            f"| {'; '.join(parts) or '-'} |"
        )
    return "\n".join(lines)


def warmup_compile_table(path: Path = RESULTS / "warmup_compile.json") -> str:
    """The start-up warm-up's compile time (benchmarks/warmup_compile.py) per model, dtype and
    ``INT8KV_COMPILE_THREADS``, each against one at a time in the same run; a run without a GPU
    (``--sm80-compile-only``) times the compiles alone."""
    result = _load(path)
    compiles_only = "target" in result
    where = f"no GPU, {result['target']}" if compiles_only else result["gpu"]
    timed = "compile s" if compiles_only else "warm-up s"
    lines = [
        f"{where} ({result['cpus']} CPUs{', ' + result['cpu'] if 'cpu' in result else ''}), "
        f"{_provenance(result)}, "
        f"`{_short(result['command'])}`; every row a fresh process with an empty Triton cache.",
        "",
        f"| model | dtype | layer shapes | compile threads | launches | {timed} | vs one at a time |",
        "|---|---|---|---|---|---|---|",
    ]
    serial = {
        (r["model"], r["dtype"]): r["warmup_s"]
        for r in result["rows"]
        if r["threads"] == 1 and "error" not in r
    }
    for r in result["rows"]:
        shapes = len(WARMUP_MODELS.get(r["model"], ())) or "?"
        if "error" in r:
            lines.append(f"| {r['model']} | `{r['dtype']}` | {shapes} | {r['threads']} | - | "
                         f"failed: {_cell(r['error'])} | - |")  # fmt: skip
            continue
        one = serial.get((r["model"], r["dtype"]))
        ratio = f"{one / r['warmup_s']:.1f}x faster" if one and r["threads"] > 1 else "-"
        lines.append(
            f"| {r['model']} | `{r['dtype']}` | {shapes} | {r['threads']} | {r['launches']} | "
            f"{r['warmup_s']:.1f} | {ratio} |"
        )
    return "\n".join(lines)


def serving_run_tables(tag: str, path: Path, *kinds: str) -> dict[str, Callable[[], str]]:
    """The :data:`TABLES` entries of one serving result file: ``serving_<tag>`` (its
    :func:`serving_table`) and, for each of ``kinds`` (``ttft``, ``starts``, ``steps``,
    ``rounds``, ``layers``, ``parts``, ``kinds``, ``control``), ``serving_<kind>_<tag>``."""
    tables = {"ttft": serving_ttft_table, "starts": serving_starts_table,
              "steps": serving_steps_table, "rounds": serving_rounds_table,
              "layers": serving_layer_host_table,
              "parts": serving_attention_parts_table,
              "kinds": serving_step_kinds_table,
              "control": serving_host_control_table}  # fmt: skip
    return {
        f"serving_{tag}": functools.partial(serving_table, path),
        **{f"serving_{kind}_{tag}": functools.partial(tables[kind], path) for kind in kinds},
    }


TABLES = {
    # README.md
    "headline": headline,
    "dtype_choice": dtype_choice_table,
    # docs/results.md
    "accuracy": accuracy_table,
    "kernel_speed": kernel_speed_table,
    "kernel_speed_targets": kernel_speed_targets_table,
    "kernel_speed_smollm2_1024_seqs": lambda: kernel_speed_table(
        RESULTS / "kernels_smol_b1024.json"
    ),
    "decode_issue_budget": issue_budget_table,
    "continuations": continuation_table,
    "tune_decode": tune_decode_table,
    "tune_decode_9_3_64": lambda: tune_decode_table(RESULTS / "tune_decode_9_3_64.json"),
    "tune_decode_4_1_256": lambda: tune_decode_table(
        RESULTS / "tune_decode_4_1_256.json", TUNE_CONFIGS_WIDE
    ),
    "tune_decode_16_8_256": lambda: tune_decode_table(
        RESULTS / "tune_decode_16_8_256.json", TUNE_CONFIGS_WIDE
    ),
    "tune_decode_int4_32_8_128": lambda: tune_decode_table(
        RESULTS / "tune_decode_int4_32_8_128.json", TUNE_CONFIGS_INT4, "int4"
    ),
    "tune_decode_int4_4_1_256": lambda: tune_decode_table(
        RESULTS / "tune_decode_int4_4_1_256.json", TUNE_CONFIGS_INT4, "int4"
    ),
    "tune_decode_int4_9_3_64": lambda: tune_decode_table(
        RESULTS / "tune_decode_int4_9_3_64.json", TUNE_CONFIGS_INT4, "int4"
    ),
    "launch_overhead": launch_overhead_table,
    "warmup_compile": warmup_compile_table,
    "warmup_compile_sm80": lambda: warmup_compile_table(RESULTS / "warmup_compile_sm80.json"),
    "throughput": throughput_table,
    "throughput_1k_paired": paired_runs_table,
    "serving": serving_table,
    "serving_starts": serving_starts_table,
    "serving_ttft": serving_ttft_table,
    "serving_targets": serving_targets_table,
    "serving_summary": serving_summary_table,
    "decode_ab_head256": decode_ab_table,
    "serving_profile_steps": lambda: serving_profile_steps_table(
        *sorted(RESULTS.glob("serving_*_profile.json"))
    ),
    "serving_profile": lambda: serving_profile_table(
        *sorted(RESULTS.glob("serving_*_profile.json"))
    ),
    "reliability": reliability_table,
    "int4_format_simulation": kv_quant_sim_table,
    "int4_format_simulation_gemma3": lambda: kv_quant_sim_table(
        RESULTS / "kv_quant_sim_gemma3.json"
    ),
    "int4_tail_simulation_gemma3": lambda: kv_quant_sim_table(
        RESULTS / "kv_quant_sim_tail_gemma3.json"
    ),
    "int4_tail_simulation": lambda: kv_quant_sim_table(RESULTS / "kv_quant_sim_tail.json"),
    "int4_varnorm_simulation": lambda: kv_quant_sim_table(RESULTS / "kv_quant_sim_varnorm.json"),
    "int4_varnorm_simulation_gemma3": lambda: kv_quant_sim_table(
        RESULTS / "kv_quant_sim_varnorm_gemma3.json"
    ),
    "int4_first_page_simulation": lambda: kv_quant_sim_table(
        RESULTS / "kv_quant_sim_first_page.json"
    ),
    "int4_first_page_simulation_gemma3": lambda: kv_quant_sim_table(
        RESULTS / "kv_quant_sim_first_page_gemma3.json"
    ),
    "int8_group_simulation_gemma3": lambda: kv_quant_sim_table(
        RESULTS / "kv_quant_sim_int8_groups_gemma3.json"
    ),
    "int8_group_simulation": lambda: kv_quant_sim_table(RESULTS / "kv_quant_sim_int8_groups.json"),
    "int8_static_simulation_gemma3": lambda: kv_quant_sim_table(
        RESULTS / "kv_quant_sim_int8_static_gemma3.json"
    ),
    "int8_static_simulation": lambda: kv_quant_sim_table(RESULTS / "kv_quant_sim_int8_static.json"),
    "int4_greedy_simulation": kv_quant_greedy_table,
    "int4_greedy_simulation_other_prompts": lambda: kv_quant_greedy_table(
        RESULTS / "kv_quant_greedy_other_prompts.json"
    ),
    "int4_greedy_simulation_gemma3": lambda: kv_quant_greedy_table(
        RESULTS / "kv_quant_greedy_gemma3.json"
    ),
    "int4_greedy_simulation_gemma3_other_prompts": lambda: kv_quant_greedy_table(
        RESULTS / "kv_quant_greedy_gemma3_shift2.json"
    ),
    "int4_tail_pages_simulation": lambda: kv_quant_sim_table(
        RESULTS / "kv_quant_sim_tail_pages.json"
    ),
    "int4_tail_pages_simulation_gemma3": lambda: kv_quant_sim_table(
        RESULTS / "kv_quant_sim_tail_pages_gemma3.json"
    ),
    "int4_greedy_simulation_tail_pages": lambda: kv_quant_greedy_table(
        RESULTS / "kv_quant_greedy_tail_pages.json",
        later_gpu_details=("accuracy_chunk16_int4_tails_details.json",),
    ),
    "int4_greedy_simulation_tail_pages_gemma3": lambda: kv_quant_greedy_table(
        RESULTS / "kv_quant_greedy_tail_pages_gemma3.json"
    ),
    "gpu_test_runs": gpu_test_runs_table,
    "tail_pool_capacity": tail_pool_capacity_table,
    # docs/measurement-history.md
    "int4_decode": int4_decode_table,
    "host_overhead": host_overhead_table,
    "host_overhead_groups": lambda: host_overhead_table(
        RESULTS / "host_overhead_groups.json", RESULTS / "host_overhead_groups_14914a9.json"
    ),
    "int4_decode_head256": lambda: int4_decode_table(RESULTS / "kernels_head256.json"),
    "int4_decode_h100": lambda: int4_decode_table(RESULTS / "kernels_h100.json", "int4_sink_tail2"),
    "kernel_speed_targets_h100": lambda: kernel_speed_targets_table(RESULTS / "kernels_h100.json"),
    "decode_ab_int8_head256": lambda: decode_ab_table(RESULTS / "decode_ab_int8_head256.json"),
    "decode_ab_int8_pairs": lambda: decode_ab_table(RESULTS / "decode_ab_int8_pairs.json"),
    "decode_ab_int4_tail_tile": lambda: decode_ab_table(RESULTS / "decode_ab_int4_tail_tile.json"),
    "int4_decode_head64": lambda: int4_decode_table(
        RESULTS / "kernels_int4_head64.json", "int4_sink_tail2"
    ),
    "throughput_int4": lambda: throughput_table(RESULTS / "throughput_int4.json"),
    "throughput_int4_8465ab0": lambda: throughput_table(RESULTS / "throughput_int4_8465ab0.json"),
    "throughput_int4_18280da": lambda: throughput_table(RESULTS / "throughput_int4_18280da.json"),
    "throughput_int4_gemma3": lambda: throughput_table(RESULTS / "throughput_int4_gemma3.json"),
    "int4_prefill": int4_prefill_table,
    "int4_decode_parts_head64": int4_decode_parts_table,
    "int4_prefill_gemma3": lambda: int4_prefill_table(RESULTS / "kernels_gemma3_prefill.json"),
    "kernel_write_gemma3": lambda: kernel_write_table(RESULTS / "kernels_gemma3_write.json"),
    "throughput_int4_gemma3_profiled": lambda: profile_table(
        RESULTS / "throughput_int4_gemma3_profiled.json"
    ),
    "throughput_int4_gemma3_profile_kernels": lambda: profile_kernels_table(
        RESULTS / "throughput_int4_gemma3_profiled.json"
    ),
    "throughput_int4_gemma3_paired": lambda: paired_runs_table(
        RESULTS / "throughput_int4_gemma3_paired.json"
    ),
    "throughput_int4_gemma3_paired_steps": lambda: step_cost_table(
        RESULTS / "throughput_int4_gemma3_paired.json"
    ),
    "throughput_int4_gemma3_step_kinds": lambda: step_kinds_table(
        RESULTS / "throughput_int4_gemma3_steps.json"
    ),
    "throughput_int4_gemma3_step_phases": lambda: throughput_steps_table(
        RESULTS / "throughput_int4_gemma3_steps.json"
    ),
    "int4_write_split_flush": lambda: decode_ab_table(RESULTS / "int4_write_split_flush.json"),
    "int4_decode_keys_together": lambda: decode_ab_table(
        RESULTS / "int4_decode_keys_together.json"
    ),
    "accuracy_bf16_prefill": lambda: accuracy_table(RESULTS / "accuracy_bf16_prefill.json"),
    **serving_run_tables(
        "smollm2_55cdbef", RESULTS / "serving_smollm2_55cdbef.json", "ttft", "steps", "starts"
    ),
    **serving_run_tables(
        "gemma3_55cdbef", RESULTS / "serving_gemma3_55cdbef.json", "ttft", "steps", "starts"
    ),
    **serving_run_tables(
        "gemma3_ce3fe6a",
        RESULTS / "serving_gemma3_ce3fe6a.json",
        *("ttft", "steps", "layers", "starts"),
    ),
    **serving_run_tables(
        "gemma3_parts_14914a9",
        RESULTS / "serving_gemma3_parts_14914a9.json",
        *("ttft", "steps", "layers", "parts", "control", "starts"),
    ),
    **serving_run_tables(
        "gemma3_parts_a01bc15",
        RESULTS / "serving_gemma3_parts_a01bc15.json",
        *("ttft", "steps", "layers", "parts", "control", "starts"),
    ),
    **serving_run_tables(
        "llama3_8b_shape_c128_998fbe7",
        RESULTS / "serving_llama3_8b_shape_c128_998fbe7.json",
        *("ttft", "steps", "layers", "parts", "control", "starts"),
    ),
    **serving_run_tables(
        "gemma3_14f89bb",
        RESULTS / "serving_gemma3_14f89bb.json",
        *("ttft", "steps", "starts"),
    ),
    **serving_run_tables(
        "llama3_8b_shape_4_layers_bb40257",
        RESULTS / "serving_llama3_8b_shape_4_layers_bb40257.json",
        *("rounds", "ttft", "steps", "kinds", "starts"),
    ),
    **serving_run_tables(
        "llama3_8b_shape_4_layers_8465ab0",
        RESULTS / "serving_llama3_8b_shape_4_layers_8465ab0.json",
        "ttft",
        "steps",
        "starts",
    ),
    **serving_run_tables(
        "llama3_8b_shape_18280da",
        RESULTS / "serving_llama3_8b_shape_18280da.json",
        *("rounds", "ttft", "steps", "layers", "starts"),
    ),
    **serving_run_tables(
        "gemma3_18280da",
        RESULTS / "serving_gemma3_18280da.json",
        *("rounds", "ttft", "steps", "layers", "starts"),
    ),
    **serving_run_tables(
        "smollm2_35ad204",
        RESULTS / "serving_smollm2_35ad204.json",
        *("rounds", "ttft", "steps", "layers", "starts"),
    ),
    **serving_run_tables(
        "llama3_8b_shape_35ad204",
        RESULTS / "serving_llama3_8b_shape_35ad204.json",
        *("rounds", "ttft", "steps", "layers", "starts"),
    ),
    "serving_attention_ops": lambda: serving_attention_ops_table(
        *sorted(RESULTS.glob("serving_*_profile.json"))
    ),
    **serving_run_tables(
        "smollm2_75eff26",
        RESULTS / "serving_smollm2_75eff26.json",
        "rounds",
        "ttft",
        "steps",
        "starts",
    ),
    **serving_run_tables(
        "gemma3_75eff26", RESULTS / "serving_gemma3_75eff26.json", "steps", "starts"
    ),
    **serving_run_tables("gemma3", RESULTS / "serving_gemma3.json", "ttft", "starts", "steps"),
    **serving_run_tables("gemma3_auto_fa2_32k", RESULTS / "serving_gemma3_auto_fa2_32k.json"),
    **serving_run_tables("gemma3_h200", RESULTS / "serving_gemma3_h200_f7ff415.json", "steps"),
    **serving_run_tables("smollm2_39e697b", RESULTS / "serving_smollm2_39e697b.json", "steps"),
    **serving_run_tables("gemma3_39e697b", RESULTS / "serving_gemma3_39e697b.json", "steps"),
    **serving_run_tables(
        "smollm2_dda1a88", RESULTS / "serving_smollm2_dda1a88.json", "ttft", "steps", "starts"
    ),
    **serving_run_tables(
        "llama3_8b_shape", RESULTS / "serving_llama3_8b_shape.json", "ttft", "starts"
    ),
    "kernel_speed_head256_h100": lambda: kernel_speed_table(RESULTS / "kernels_head256_h100.json"),
    "kernel_speed_targets_head256_h100": lambda: kernel_speed_targets_table(
        RESULTS / "kernels_head256_h100.json"
    ),
    "int4_decode_loops": int4_decode_loops_table,
    "int4_decode_h100_76e0410": lambda: int4_decode_table(
        RESULTS / "kernels_int4_h100.json", "int4_tail2"
    ),
    **serving_run_tables(
        "gemma3_90d00a7", RESULTS / "serving_gemma3_90d00a7.json", "ttft", "starts"
    ),
    **serving_run_tables(
        "gemma3_47429f4", RESULTS / "serving_gemma3_47429f4.json", "ttft", "starts"
    ),
    "serving_steps_gemma3_47429f4": lambda: serving_steps_table(
        RESULTS / "serving_gemma3_steps.json"
    ),
    **serving_run_tables("gemma3_2b8b82b", RESULTS / "serving_gemma3_2b8b82b.json", "ttft"),
    **serving_run_tables("2026_12_01", RESULTS / "serving_2026-12-01.json", "starts"),
    "serving_int8_rerun": serving_rerun_table,
    **serving_run_tables("2026_12_02", RESULTS / "serving_2026-12-02_170c68e.json", "starts"),
    "kernel_speed_int4": lambda: kernel_speed_table(RESULTS / "kernels_quick_int4.json"),
    "int4_decode_one_page_steps": lambda: int4_decode_table(RESULTS / "kernels_int4_3411932.json"),
    "int4_decode_two_page_steps": lambda: int4_decode_table(
        RESULTS / "kernels_int4_2026-12-02.json"
    ),
    "throughput_1k_repeats": repeat_runs_table,
    "throughput_1k_repeats_pooled": lambda: throughput_table(
        RESULTS / "throughput_1k_repeats.json"
    ),
    "throughput_1k_repeats_with_replays": lambda: repeat_runs_table(
        RESULTS / "throughput_1k_repeats_with_replays.json"
    ),
    "throughput_1k_single_runs": single_runs_table,
    "throughput_1k_single_runs_pooled": lambda: throughput_table(
        RESULTS / "throughput_1k_single_runs.json"
    ),
    "throughput_1k_profiled": profile_table,
    "throughput_1k_direct_launches": lambda: throughput_table(
        RESULTS / "throughput_1k_direct.json"
    ),
}
# quoted in docs/results.md once a GPU run has written the file (one per decode shape profiled)
for _path in sorted(RESULTS.glob("decode_stalls*.json")):
    TABLES[_path.stem] = functools.partial(decode_stalls_table, _path)
for _name in (
    "accuracy_gemma3",
    "accuracy_chunk16",
    "accuracy_gemma3_chunk16",
    "accuracy_gemma3_chunk16_int4_tails",
    "accuracy_chunk16_int4_tails",
):
    if (RESULTS / f"{_name}.json").exists():
        TABLES[_name] = functools.partial(accuracy_table, RESULTS / f"{_name}.json")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--profile-summary"]:
        print(json.dumps({p: profile_summary(Path(p)) for p in argv[1:]}, indent=2))
        return 0
    if len(argv) != 1 or argv[0] not in TABLES:
        print(f"usage: python -m benchmarks.report {{{','.join(TABLES)}}}", file=sys.stderr)
        return 2
    print(TABLES[argv[0]]())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
