"""Names of the environment variables int8kv-shim reads, and how their values are parsed.

Deliberately not ``VLLM_*``: vLLM warns about unknown variables with its own prefix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

INT8KV_SHIM = "INT8KV_SHIM"
"""Activation switch. Truthy values (case-insensitive, surrounding blanks ignored): ``1``, ``true``,
``yes``, ``on``. Anything else, or unset, leaves vLLM untouched."""

TRUTHY_VALUES: frozenset[str] = frozenset({"1", "true", "yes", "on"})


def is_truthy(value: str | None) -> bool:
    """Whether ``value`` is one of :data:`TRUTHY_VALUES`."""
    return value is not None and value.strip().lower() in TRUTHY_VALUES


def activation_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``INT8KV_SHIM`` asks for the shim to patch vLLM."""
    env = os.environ if environ is None else environ
    return is_truthy(env.get(INT8KV_SHIM))


INT8KV_SCALES = "INT8KV_SCALES"
"""Path of the ``int8_static`` calibration file (``int8kv calibrate`` writes it). Unset: the file
``int8kv_scales.json`` in the model's folder."""

INT8KV_CALIBRATE = "INT8KV_CALIBRATE"
"""Set by ``int8kv calibrate`` in every vLLM process it starts (not for users): ``absmax`` or
``histogram`` makes the attention impl record K/V statistics as they enter the cache."""
