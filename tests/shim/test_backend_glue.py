"""Our backend's builder + impl driven like vLLM's model runner drives them (CPU, interpreter)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("backend_glue_check.py")


@pytest.mark.parametrize(
    "args",
    [["int8"], ["int8", "flash"], ["int8_static", "flash"], ["int8", "broken"],
     ["int8", "v2"], ["int8", "v2_spec"]],
)  # fmt: skip
def test_builder_and_impl_run_our_kernels_like_vllm_does(args: list[str]) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("INT8KV_SHIM", None)  # the classes are used directly; no patching needed
    run = subprocess.run(
        [sys.executable, str(CHECK), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert f"glue ok ({' '.join(args)}," in run.stdout
    # FlashAttention-2 raising on a batch: one warning through vLLM's logger, saying what happened
    # and how to skip the attempt; nothing of the kind when it works
    warning = "FlashAttention-2 failed on a prefill (RuntimeError: FlashAttention only supports"
    log = run.stdout + run.stderr
    if "broken" in args:
        assert log.count(warning) == 1, log[-4000:]
        assert "set INT8KV_PREFILL=triton to skip the attempt" in log
    else:
        assert warning not in log
    # the first step with prefills says where they ran (once per process)
    route = "int8kv-shim: first step with prefills: "
    assert log.count(route) == 1, log[-4000:]
    if "v2_spec" in args:
        routed = "1 sequence(s) on FlashAttention-2 (0 context tokens gathered), 1 on our kernels"
    elif len(args) > 1:
        routed = "2 sequence(s) on FlashAttention-2 (65 context tokens gathered), 0 on our kernels"
    else:
        routed = "our kernels (FlashAttention-2 is off or unavailable here, see above)"
    assert route + routed in log, log[-4000:]
    assert "is experimental" not in log  # int4's warning: test_int4_wiring.py
