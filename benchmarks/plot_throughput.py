"""Plot benchmarks/results/throughput.json: generation tok/s per config and context, and KV capacity.

    python -m benchmarks.plot_throughput [throughput.json] [throughput.png]

Needs matplotlib (``pip install ".[bench]"``); a GPU host without it can leave the plot to any
machine that has the JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# Fixed order and colours so plots of different runs compare at a glance.
ORDER = ["auto_fa2", "auto_triton", "int8_per_token_head", "int8", "int8_static", "int4"]
BASELINE = "auto_fa2"


def _ctx_label(ctx: int) -> str:
    return f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)


def plot(json_path: str | Path, png_path: str | Path) -> Path:
    """Write a two-panel PNG (gen tok/s grouped by context; kv_cache_tokens per config)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(json_path).read_text())
    rows = doc["rows"]
    labels = sorted({r["dtype"] for r in rows}, key=lambda d: (ORDER + [d]).index(d))
    ctxs = sorted({r["ctx"] for r in rows})
    by = {(r["dtype"], r["ctx"]): r for r in rows}

    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2.2, 1]}, constrained_layout=True
    )
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        xs, ys = [], []
        for j, ctx in enumerate(ctxs):
            if (label, ctx) in by:
                xs.append(j + (i - (len(labels) - 1) / 2) * width)
                ys.append(by[(label, ctx)]["gen_tok_s"])
        bars = ax1.bar(xs, ys, width, label=label, color=f"C{(ORDER + [label]).index(label)}")
        for bar, ctx in zip(bars, [c for c in ctxs if (label, c) in by], strict=True):
            base = by.get((BASELINE, ctx))
            if base and label != BASELINE:
                ratio = by[(label, ctx)]["gen_tok_s"] / base["gen_tok_s"]
                ax1.annotate(
                    f"{ratio:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax1.set_xticks(range(len(ctxs)), [_ctx_label(c) for c in ctxs])
    ax1.set_xlabel("context (prompt) length")
    ax1.set_ylabel("generated tokens / s")
    ax1.set_title(f"generation throughput (ratios vs {BASELINE})")
    ax1.legend(fontsize=8)

    caps = {
        label: max(r["kv_cache_tokens"] for r in rows if r["dtype"] == label) for label in labels
    }
    bars = ax2.bar(
        range(len(labels)),
        [caps[label] / 1e6 for label in labels],
        color=[f"C{(ORDER + [label]).index(label)}" for label in labels],
    )
    base_cap = caps.get(BASELINE)
    for bar, label in zip(bars, labels, strict=True):
        if base_cap:
            ax2.annotate(
                f"{caps[label] / base_cap:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax2.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax2.set_ylabel("KV cache capacity (M tokens)")
    ax2.set_title("KV capacity, same memory budget")
    fig.suptitle(f"{doc.get('model', '')} on {doc.get('gpu', '')}", fontsize=10)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def main(argv: list[str]) -> int:
    src = Path(argv[1]) if len(argv) > 1 else RESULTS / "throughput.json"
    dst = Path(argv[2]) if len(argv) > 2 else src.with_suffix(".png")
    print(plot(src, dst))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
