"""Test-wide setup.

Without a GPU, Triton kernels run on CPU tensors through the interpreter. Both variables must be set
before triton (or vLLM, which imports it) is first imported, hence here, at collection start.
``CUDA_VISIBLE_DEVICES=""`` also stops vLLM from swapping in its placeholder ``triton`` module.
"""

import os
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# tests/shim/probe.py, the subprocess side of the vLLM scenarios (pyproject's pytest `pythonpath`
# makes it importable as `probe` here; run_python does the same for its children).
import probe
import pytest
import torch

HAS_GPU = torch.cuda.is_available()

if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # every interpreted launch of our kernels stays inside its tensors (tests/kernels/)
    import interpreter_bounds

    interpreter_bounds.install()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded_rng(request: pytest.FixtureRequest) -> None:
    # Each test starts from its own fixed RNG state (from its id), so its random data does not
    # depend on which tests ran before it: a failure seen in a full run reproduces on its own (an
    # H200 run once failed two int4 tests that then passed when rerun alone).
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_GPU else "cpu"


# Fresh-interpreter runs against the real vLLM, shared by tests/shim and tests/test_bad_inputs.py
# (session-scoped, so each scenario fixture built on them runs once per session).


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def result(self) -> dict[str, Any]:
        assert self.returncode == 0, f"subprocess failed:\n{self.output[-6000:]}"
        return probe.parse_result(self.stdout)


@pytest.fixture(scope="session")
def dtype_names() -> list[str]:
    from int8kv_kernels.catalogue import DTYPE_NAMES

    return list(DTYPE_NAMES)


@pytest.fixture(scope="session")
def run_python(tmp_path_factory: pytest.TempPathFactory):
    # Outside the checkout, so the installed package (and its entry points) is what gets imported.
    cwd = tmp_path_factory.mktemp("subprocess-cwd")

    def run(
        code: str,
        *,
        shim: str | None,
        pythonpath: list[Path] | None = None,
        timeout: float = 600,
    ) -> Run:
        env = dict(os.environ)
        for name in ("INT8KV_SHIM", "VLLM_PLUGINS"):
            env.pop(name, None)
        if shim is not None:
            env["INT8KV_SHIM"] = shim
        # In front of, not instead of, an inherited PYTHONPATH (which may be where vLLM is); the
        # folder of `probe` last, so the scenario's own folders win.
        inherited = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
        folders = [*(pythonpath or ()), probe.SHIM_TESTS]
        env["PYTHONPATH"] = os.pathsep.join([*map(str, folders), *inherited])
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return Run(proc.returncode, proc.stdout, proc.stderr)

    return run
