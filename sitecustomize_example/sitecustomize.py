# Python imports this file at start-up when its folder is on PYTHONPATH; the shim instruments itself
# only if INT8KV_SHIM is truthy, and imports neither vLLM nor torch. See README.md here.
import int8kv_shim  # noqa: F401
