"""The README quotes the result files: each generated table must appear in it verbatim."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _report():
    spec = importlib.util.spec_from_file_location("report", REPO / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "table", ["kernels", "accuracy", "throughput", "reliability", "kv_quant_sim", "issue_budget"]
)
def test_readme_quotes_result_file(table: str) -> None:
    generated = _report().TABLES[table]()
    readme = (REPO / "README.md").read_text()
    assert generated in readme, f"regenerate with `python benchmarks/report.py {table}`"


def test_kernels_table_rows_for_the_fa2_prefill_path_and_consecutive_writes(tmp_path) -> None:
    def row(kernel: str, impl: str, batch: int, ctx: int, ms: float, **extra) -> dict:
        shape = {"q_heads": 32, "kv_heads": 8, "head_dim": 128}
        return {"kernel": kernel, "impl": impl, **shape, "batch": batch, "ctx": ctx, "ms": ms,
                "gbs": 1.0, **extra}  # fmt: skip

    rows = [
        row("prefill", "bf16_fa2", 1, 8192, 1.0),
        row("prefill", "int8", 1, 8192, 2.0),
        row("prefill", "int8_fa2", 1, 8192, 1.25),
        row("prefill", "int8_static_fa2", 1, 8192, 1.1),
        row("write", "bf16_fa2", 16384, 0, 0.03, slots="consecutive"),
        row("write", "int8", 16384, 0, 0.02, slots="consecutive"),
        row("write", "bf16_fa2", 256, 0, 0.003, slots="random"),
        row("write", "int8", 256, 0, 0.006, slots="random"),
    ]
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"gpu": "G", "command": "x", "peak_bw_gbs": 1.0, "rows": rows}))
    lines = _report().kernels_table(path).splitlines()[5:]
    assert [line.split(" | ")[0] for line in lines] == [
        "| prefill", "| prefill, gather + FA2", "| write", "| write, consecutive slots",
    ]  # fmt: skip
    # ours over FA2: 0.50x for the Triton kernel, 0.80x for gather + FA2; static via FA2 0.91x
    assert "| 2000.0 | - | 0.50x |" in lines[0]
    assert "| 1250.0 | - | 0.80x |" in lines[1] and lines[1].endswith("| 0.91x | n/a |")
    assert "| 16384 | - | 20.0 | - | 1.50x |" in lines[3]
