"""The checkout's ``kernels/`` folder is the package ``int8kv_kernels``; run from the checkout (the
root on sys.path, as under pytest or ``python -m benchmarks.NAME``) it must not take the top-level
name ``kernels`` from PyPI's package of that name, which transformers imports when it is installed."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import os, sys
sys.path.insert(0, os.getcwd())
try:
    import kernels
except ImportError as e:
    print("missing", e)
else:
    print("found", os.path.abspath(kernels.__file__))
import int8kv_kernels
print("ours", hasattr(int8kv_kernels, "paged_attention"))
"""


def _pypi_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_checkout_root_on_path_leaves_the_name_kernels_to_pypi() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "ours True", out.stdout
    first = lines[0]
    if _pypi_kernels_installed():
        assert first.startswith("found "), out.stdout
        assert not Path(first.split(" ", 1)[1]).is_relative_to(ROOT), out.stdout
    else:
        assert first.startswith("missing "), out.stdout
