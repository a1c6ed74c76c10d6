"""Fixtures for the shim tests: fresh Python subprocesses against the real, installed vLLM.

Patching vLLM in the pytest process would leak into every later test and would make "import
order" meaningless, so each scenario runs in its own interpreter. Importing vLLM costs seconds, so
each scenario runs once per session and several tests read its result.
"""

from __future__ import annotations

from typing import Any

import pytest
from probe import prelude

# run_python, Run and dtype_names live in tests/conftest.py: tests/test_bad_inputs.py uses them too.


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
