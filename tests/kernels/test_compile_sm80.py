"""Every kernel specialisation compiles for sm80 (Ampere) with no Hopper-only instruction, and
the int4 decode configuration compiles for sm90 without wgmma."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_sm80():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the interpreter would replace the kernels
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    r = subprocess.run([sys.executable, "-m", "benchmarks.compile_sm80"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "compiled" in r.stdout
