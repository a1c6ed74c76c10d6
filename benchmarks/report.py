"""Markdown tables for the README, generated from the result files (numbers are never typed).

    python benchmarks/report.py kernels    # the "Kernel speed" table from benchmarks/results/kernels.json

tests/test_readme_results.py checks that the README holds exactly what this prints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def kernels_table(path: Path = RESULTS / "kernels.json") -> str:
    """Decode/prefill/write times of our int8 kernels against FA2, vLLM's Triton and upstream int8."""
    result = json.loads(path.read_text())
    ms = {
        (r["kernel"], r["impl"], r["q_heads"], r["kv_heads"], r["head_dim"], r["batch"], r["ctx"]): r
        for r in result["rows"]
    }
    peak = result["peak_bw_gbs"]
    lines = [
        f"{result['gpu']}, copy bandwidth {peak:.0f} GB/s, `{_short(result['command'])}`.",
        "Speedups are the other kernel's time over ours (>1: ours faster); %bw counts the bytes "
        "`int8` must read.",
        "",
        "| kernel | q/kv heads, dim | batch | ctx | `int8` µs | %bw | vs `bf16_fa2` | vs `bf16` (Triton) "
        "| vs `upstream_int8_pth` | `int8_static` vs `bf16_fa2` |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, ours in sorted(ms.items(), key=lambda kv: (kv[0][0] != "decode", kv[0][2:])):
        kernel, impl, *shape = key
        if impl != "int8":
            continue

        def ratio(other: str, mine: dict = ours, kernel: str = kernel, shape: list = shape) -> str:
            row = ms.get((kernel, other, *shape))
            return f"{row['ms'] / mine['ms']:.2f}x" if row else "n/a"

        static = ms.get((kernel, "int8_static", *shape))
        static_vs = (
            f"{ms[(kernel, 'bf16_fa2', *shape)]['ms'] / static['ms']:.2f}x"
            if static and (kernel, "bf16_fa2", *shape) in ms
            else "n/a"
        )
        nq, nkv, d, batch, ctx = shape
        bw = f"{100 * ours['gbs'] / peak:.0f}%" if kernel == "decode" else "-"
        lines.append(
            f"| {kernel} | {nq}/{nkv}, {d} | {batch} | {ctx if ctx else '-'} | "
            f"{ours['ms'] * 1e3:.1f} | {bw} | {ratio('bf16_fa2')} | {ratio('bf16')} | "
            f"{ratio('upstream_int8_pth')} | {static_vs} |"
        )
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


TABLES = {"kernels": kernels_table}

if __name__ == "__main__":
    print(TABLES[sys.argv[1]]())
