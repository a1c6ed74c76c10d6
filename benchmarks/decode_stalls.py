"""Why a decode kernel streams below copy bandwidth: where its warps stall, from Triton's own
profiler (Proton) in CUPTI PC-sampling mode.

    python -m benchmarks.decode_stalls --shape 32,8,128 --batch 32 --ctx 32768 --impls int4 int8
        --out benchmarks/results/decode_stalls.json

Per impl, the decode launch benchmarks/kernels.py times at that point (its ``attention_launches``,
on one cache; ``int4`` with ``TAIL_TOKENS`` keys per sequence in its BF16 tail) runs
``--launches`` times while Proton samples, eagerly: Proton starts and stops the sampling around
each kernel launch. The first of them compiles and loads the kernel while it samples, because
Proton keeps a module's cubin, which maps a sampled PC to its source line, only when it is loaded
while PC sampling is on. After the profile the same launch is timed with ``graph_ms`` (µs, and
the bandwidth its bytes take, as kernels.py counts them).

Proton writes a hatchet tree (``<out stem>_<impl>.hatchet`` next to the JSON, and into $OUT):
a sampled PC's counts sit on a node named ``<dir>/<file>:<line>@<kernel>`` below the kernel's
node, or on the kernel's node itself when no line is known. Each such node has one
``stalled_<reason>`` value per warp state (``stalled_selected``: the warp issued) and
``num_samples`` / ``num_stalled_samples``; a node's values are its own, not its children's.
``num_samples`` also counts CUPTI's not-issued copy of each sample, so the sum of the
``stalled_*`` values is the number of samples. Only kernels whose name matches ``--kernel``
(default: the attention kernels, not the split merge) are aggregated; every kernel seen is listed
with its samples. The JSON keeps per impl the samples per warp state and the top source lines,
each with its top three states (``python -m benchmarks.report decode_stalls`` renders them).
"""

from __future__ import annotations

import argparse
import json
import linecache
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.kernels import (
    IMPLS,
    L2_BYTES,
    TAIL_PAGES,
    TAIL_TOKENS,
    attention_launches,
    copy_bw_gbs,
    graph_ms,
    has_tail,
)

# Proton's name for a sampled PC's source line (formatFileLineFunction: file + ":" + line + "@" +
# function); greedy, so a path with ':' in it stays whole
FRAME = re.compile(r"^(?P<file>.*):(?P<line>\d+)@(?P<function>.+)$")
STALL = "stalled_"
KERNELS_DIR = common.REPO / "kernels"


def stall_counts(metrics: dict) -> dict[str, int]:
    """The non-zero ``stalled_*`` values of a node's metrics, by warp state (Proton spells one
    ``stalled_not_Selected``: lower case)."""
    return {
        key[len(STALL) :].lower(): int(value)
        for key, value in metrics.items()
        if key.startswith(STALL) and isinstance(value, int | float) and value
    }


def sampled_nodes(tree: list | dict) -> Iterator[tuple[str, str | None, int | None, dict]]:
    """(kernel, file, line, counts per warp state) of every node of a Proton hatchet tree that
    holds PC samples; file and line are None for samples with no source line."""
    stack = [n for n in (tree if isinstance(tree, list) else [tree]) if isinstance(n, dict)]
    while stack:
        node = stack.pop()
        stack.extend(c for c in reversed(node.get("children", [])) if isinstance(c, dict))
        counts = stall_counts(node.get("metrics", {}))
        if not counts:
            continue
        name = node.get("frame", {}).get("name", "")
        where = FRAME.match(name)
        if where:
            yield where["function"], where["file"], int(where["line"]), counts
        else:
            yield name, None, None, counts


def source_line(path: str, line: int) -> tuple[str, str]:
    """(``kernels/<file>`` or the path as Proton wrote it, the line's text). A file of the kernels
    package (installed as int8kv_kernels) is named by its place in this repository and read there
    when the sampled path is not readable here."""
    path = re.sub("^/+", "/", path)  # Proton joins an empty dir and an absolute file with "/"
    p = Path(path)
    ours = p.parent.name in ("kernels", "int8kv_kernels") and (KERNELS_DIR / p.name).is_file()
    for candidate in (p, KERNELS_DIR / p.name) if ours else (p,):
        text = linecache.getline(str(candidate), line).strip()
        if text:
            break
    return (f"kernels/{p.name}" if ours else path), text


def ranked_states(counts: Counter) -> list[tuple[str, int]]:
    """Most samples first; ties by name, whatever order the tree was walked in."""
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def summarize(tree: list | dict, kernel: str, top_lines: int = 15) -> dict:
    """Samples of the kernels matching the regex ``kernel``: per warp state and per source line
    (the ``top_lines`` with most samples, each with its top three states), and every kernel's
    sample count."""
    kernels: Counter = Counter()
    states: Counter = Counter()
    lines: defaultdict = defaultdict(Counter)
    no_line = 0
    for name, file, line, counts in sampled_nodes(tree):
        kernels[name] += sum(counts.values())
        if not re.search(kernel, name):
            continue
        states.update(counts)
        if file is None:
            no_line += sum(counts.values())
        else:
            lines[(file, line)].update(counts)
    total = sum(states.values())

    def share(n: int) -> float:
        return n / total if total else 0.0

    ranked = sorted(lines.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))[:top_lines]
    top = []
    for (file, line), counts in ranked:
        where, text = source_line(file, line)
        n = sum(counts.values())
        top.append({"where": f"{where}:{line}", "text": text, "samples": n,
                    "fraction": share(n), "stalls": [{"reason": r, "samples": c}
                                                     for r, c in ranked_states(counts)[:3]]})  # fmt: skip
    return {
        "kernels": dict(kernels.most_common()),
        "samples": total,
        "samples_without_line": no_line,
        "stalls": [
            {"reason": r, "samples": n, "fraction": share(n)} for r, n in ranked_states(states)
        ],
        "lines": top,
    }


def decode_launch(impl: str, nq: int, nkv: int, d: int, batch: int, ctx: int):
    """(launch, bytes it must move) of the decode step kernels.bench_attention times, on a single
    cache."""
    fns, must_kv, q_bytes = attention_launches(impl, nq, nkv, d, batch, ctx, 1, copies=1)
    return fns[0], must_kv + q_bytes


def profile(fn: Callable[[], None], launches: int, stem: Path) -> Path:
    """Run ``fn`` ``launches`` times under Proton's PC sampling, writing ``stem``.hatchet."""
    import triton.profiler as proton

    stem.parent.mkdir(parents=True, exist_ok=True)
    path = Path(f"{stem}.hatchet")
    path.unlink(missing_ok=True)  # an earlier run's file must not pass for this one's
    torch.cuda.synchronize()
    proton.start(str(stem), backend="cupti", mode="pcsampling")
    try:
        for _ in range(launches):
            fn()
        torch.cuda.synchronize()
    finally:
        proton.finalize()
    if not path.exists():
        raise RuntimeError(f"Proton wrote no {path} (is profiling disabled by a Proton knob?)")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="32,8,128", help="q_heads,kv_heads,head_dim")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--impls", nargs="+", default=["int4", "int8"],
                    choices=[*IMPLS, *TAIL_PAGES])  # fmt: skip
    ap.add_argument("--launches", type=int, default=200, help="launches sampled per impl")
    ap.add_argument("--kernel", default="_attn",
                    help="regex of the kernel names aggregated (default: the attention kernels)")  # fmt: skip
    ap.add_argument("--top-lines", type=int, default=15)
    ap.add_argument("--out", default="benchmarks/results/decode_stalls.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_stalls: no CUDA device visible; Proton's PC sampling needs one")
    import triton

    nq, nkv, d = map(int, args.shape.split(","))
    out = Path(args.out)
    torch.manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(), "command": common.command_line(),
              "peak_bw_gbs": copy_bw_gbs(), "triton": triton.__version__,
              "launches": args.launches, "kernel": args.kernel, "rows": []}  # fmt: skip
    print(f"{result['gpu']}: copy {result['peak_bw_gbs']:.0f} GB/s", flush=True)
    for impl in args.impls:
        row = {"impl": impl, "q_heads": nq, "kv_heads": nkv, "head_dim": d,
               "batch": args.batch, "ctx": args.ctx}  # fmt: skip
        if has_tail(impl):
            row["tail_tokens"] = TAIL_TOKENS
        result["rows"].append(row)
        try:  # whatever fails, the JSON keeps what the run got so far
            fn, moved = decode_launch(impl, nq, nkv, d, args.batch, args.ctx)
            if moved < 2 * L2_BYTES:
                print(f"{impl}: {moved >> 20} MiB fits in L2: its time and %bw flatter it")
            stem = out.with_name(f"{out.stem}_{impl}")
            try:
                raw = profile(fn, args.launches, stem)
                row["raw"] = raw.name
                common.copy_to_out(raw)
                row.update(summarize(json.loads(raw.read_text()), args.kernel, args.top_lines))
            except Exception as e:  # the launch is still timed
                row["error"] = f"profile: {type(e).__name__}: {e}"[:500]
            ms = graph_ms(fn)
            row.update(us=ms * 1e3, gbs=moved / ms / 1e6)
        except Exception as e:
            row.setdefault("error", f"{type(e).__name__}: {e}"[:500])
        finally:
            torch.cuda.empty_cache()
        print_row(row, result["peak_bw_gbs"])
        common.write_json(result, out)


def print_row(row: dict, peak: float) -> None:
    """The row in a few lines of stdout: time, kernels seen, top warp states."""
    head = f"{row['impl']}:"
    if "us" in row:
        head += f" {row['us']:.1f} us, {100 * row['gbs'] / peak:.0f}% of copy bandwidth"
    print(head, row.get("error", ""), flush=True)
    print("  kernels sampled:", row.get("kernels"), flush=True)
    for s in row.get("stalls", [])[:8]:
        print(f"  {s['reason']:<24} {100 * s['fraction']:5.1f}%", flush=True)
    for ln in row.get("lines", [])[:5]:
        print(f"  {100 * ln['fraction']:5.1f}% {ln['where']}: {ln['text']}", flush=True)


if __name__ == "__main__":
    main()
