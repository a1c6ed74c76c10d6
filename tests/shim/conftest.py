"""Fixtures for the shim tests: fresh Python subprocesses against the real, installed vLLM.

Patching vLLM in the pytest process would leak into every later test and would make "import
order" meaningless, so each scenario runs in its own interpreter. Importing vLLM costs seconds, so
each scenario runs once per session and several tests read its result.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SHIM_TESTS = Path(__file__).resolve().parent

sys.path.insert(0, str(SHIM_TESTS))
import probe  # noqa: E402
from probe import prelude  # noqa: E402


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
        if pythonpath:
            # In front of, not instead of, an inherited PYTHONPATH (which may be where vLLM is).
            inherited = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
            env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), *inherited])
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


@pytest.fixture(scope="session")
def pristine(run_python, dtype_names: list[str]) -> dict[str, Any]:
    """vLLM as it is without the shim: installed, not activated, not imported until vLLM loads
    its plugins (in ``probe.cli``)."""
    code = prelude(dtype_names) + (
        "r = {'state': probe.snapshot(NAMES), 'selection': probe.selection(NAMES)}\n"
        "r['shim_imported'] = 'int8kv_shim' in sys.modules\n"
        # cli() builds EngineArgs, so vLLM loads its plugins: ours is imported, and stays off.
        "r['cli'] = probe.cli(NAMES)\n"
        "probe.emit(r)\n"
    )
    return run_python(code, shim=None).result()


@pytest.fixture(scope="session")
def active(run_python, dtype_names: list[str]) -> dict[str, Any]:
    """INT8KV_SHIM=1 and a plain `import int8kv_shim` before vLLM; then re-/un-/re-instrument."""
    code = prelude(dtype_names) + (
        "import int8kv_shim\n"
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules\n"
        "r = {'mode': int8kv_shim.mode()}\n"
        "r['state'] = probe.snapshot(NAMES)\n"
        "r['selection'] = probe.selection(NAMES)\n"
        "r['refusals'] = probe.refusals()\n"
        "r['backend'] = probe.backend_facts(NAMES)\n"
        "r['static_scales'] = probe.static_scales_loading()\n"
        "r['cli'] = probe.cli(NAMES)\n"
        "from int8kv_shim import patch\n"
        "r['applied'] = list(patch.applied_patches())\n"
        "int8kv_shim.instrument()\n"
        "r['state_after_second_instrument'] = probe.snapshot(NAMES)\n"
        "int8kv_shim.uninstrument()\n"
        "r['mode_after_uninstrument'] = int8kv_shim.mode()\n"
        "r['state_after_uninstrument'] = probe.snapshot(NAMES)\n"
        "int8kv_shim.instrument()\n"
        "r['state_after_reinstrument'] = probe.snapshot(NAMES)\n"
        "probe.emit(r)\n"
    )
    return run_python(code, shim="1").result()
