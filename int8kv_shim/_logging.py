"""One logger for the shim: vLLM's when vLLM is already imported, the standard library's otherwise.

Never imports vLLM itself: the shim's activation path runs before vLLM, in every process.
"""

from __future__ import annotations

import logging
import sys

# A child of vLLM's configured "vllm" logger, so our lines share its handler, format and
# VLLM_LOGGING_LEVEL instead of disappearing into an unconfigured root logger.
_VLLM_CHILD = "vllm.int8kv_shim"
_STDLIB = "int8kv_shim"


def get_logger() -> logging.Logger:
    vllm_logger = sys.modules.get("vllm.logger")
    init_logger = getattr(vllm_logger, "init_logger", None)
    if init_logger is not None:
        return init_logger(_VLLM_CHILD)
    return logging.getLogger(_STDLIB)
