"""The README quotes the result files: each generated table must appear in it verbatim."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _report():
    spec = importlib.util.spec_from_file_location("report", REPO / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "table", ["kernels", "accuracy", "throughput", "reliability", "kv_quant_sim"]
)
def test_readme_quotes_result_file(table: str) -> None:
    generated = _report().TABLES[table]()
    readme = (REPO / "README.md").read_text()
    assert generated in readme, f"regenerate with `python benchmarks/report.py {table}`"
