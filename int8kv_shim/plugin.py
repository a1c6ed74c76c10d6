"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` once per process (front end, engine core, every worker), after vLLM
itself is imported, and may call it again through other code paths; it must be idempotent. vLLM
calls it whether or not the user wants the shim, so the switch is checked here.
"""

from __future__ import annotations

from int8kv_shim.environment_variables import activation_requested


def register() -> None:
    """Instrument vLLM when ``INT8KV_SHIM`` is truthy; otherwise do nothing."""
    if activation_requested():
        from int8kv_shim import instrument

        instrument()
