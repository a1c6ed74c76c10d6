"""Kernel launches with less host work than ``kernel[grid](...)``, for the per-layer hot path.

vLLM runs attention eagerly whenever a step is not captured in a CUDA graph: every mixed
prefill/decode step, and every step of a batch over the capture limit (512 by default). Then each
layer pays the host cost of our launches, and on an H200 that cost decides 1K-context throughput
(benchmarks/results/logs/profile_int8_1024.txt: int8 spends less GPU time than FlashAttention-2 and
is still slower). Triton's ``JITFunction.run`` spends most of a launch in Python around the
specialization it computes (option strings, global-value checks, knob lookups, launch metadata):
benchmarks/launch_overhead.py measured 86 us per attention launch through it on the H200 host and
61 us through this launcher (benchmarks/results/launch_overhead.json).

``DirectLauncher`` keeps the part that decides which binary runs, Triton's own binder (the same
generated function ``run`` calls, so the specialization is Triton's, bit for bit), and keys its own
cache on that specialization. A key seen before launches the cached ``CompiledKernel`` directly; a
new one goes through ``JITFunction.run``, which compiles (or loads) and launches, and returns the
kernel to cache. What the direct path skips besides the Python: the check that the globals a
kernel read have not changed since it compiled (ours are module constants), and one driver query
per tensor argument: tensors go to the launcher as their addresses, after a check that each is a
CUDA tensor. Under the interpreter, on another Triton release, or while a launch hook (a profiler
such as proton) is registered, it calls ``kernel[grid](...)`` unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton

# The private pieces used (JITFunction.device_caches' binder, CompiledKernel.run's argument order)
# are those of this release; vLLM 0.24.0 pins torch 2.11, which pins it.
SUPPORTED_TRITON = "3.6.0"
_TRITON_OK = triton.__version__.split("+")[0] == SUPPORTED_TRITON
_ENABLED = True


def set_direct_launches(enabled: bool) -> None:
    """Turn direct launches off (every launcher then calls ``kernel[grid](...)``: the same results,
    more host time) or back on, for the whole process. A safety valve."""
    global _ENABLED
    _ENABLED = bool(enabled)


def _launch_hooks_set() -> bool:
    # Triton 3.6 keeps (empty) HookChains here; a profiler such as proton adds to them. Empty
    # chains do nothing, so the direct launch passes None, which the launcher skips.
    rt = triton.knobs.runtime
    return any(getattr(h, "calls", h) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


# What JITFunction.run launches on: the current device (not the tensors') and its current stream.
def _current_device() -> int:
    return torch.cuda.current_device()


def _current_stream(index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(index)


class DirectLauncher:
    """``launcher(grid, *args, num_warps=, num_stages=, **constexprs)`` == ``fn[grid](...)``."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        # Interpreted kernels (TRITON_INTERPRET=1) have no binary to cache.
        self.direct = _TRITON_OK and isinstance(fn, triton.runtime.jit.JITFunction)
        # key -> (compiled kernel, positions of its pointer arguments)
        self._kernels: dict[tuple, tuple[Any, tuple[int, ...]]] = {}
        self.direct_launches = 0  # launches of a cached binary (tests, benchmarks)

    def __call__(self, grid: Sequence[int], *args: Any, **kwargs: Any) -> None:
        if not (self.direct and _ENABLED) or args[0].device.type != "cuda" or _launch_hooks_set():
            self.fn[tuple(grid)](*args, **kwargs)
            return
        index = _current_device()
        binder = self.fn.device_caches[index][4]
        bound, specialization, options = binder(*args, **kwargs)  # options: num_warps, ...
        key = (index, *options.items(), *specialization)
        cached = self._kernels.get(key)
        if cached is None:
            kernel = self.fn.run(*args, grid=tuple(grid), warmup=False, **kwargs)
            kernel = kernel.result() if hasattr(kernel, "result") else kernel
            pointers = tuple(
                i for i, (ty, _) in enumerate(specialization)
                if isinstance(ty, str) and ty.startswith("*")
            )  # fmt: skip
            self._kernels[key] = (kernel, pointers)
            return
        kernel, pointers = cached
        values = list(bound.values())
        for i in pointers:
            tensor = values[i]
            # anything but a CUDA tensor: Triton's launch handles it (or raises its own error)
            if not getattr(tensor, "is_cuda", False):
                self.fn[tuple(grid)](*args, **kwargs)
                return
            # Triton's launcher asks the driver where each tensor's pointer lives
            # (cuPointerGetAttribute); for an integer it takes the address as it is.
            values[i] = tensor.data_ptr()
        g0, g1, g2 = (*grid, 1, 1)[:3]
        stream = _current_stream(index)
        self.direct_launches += 1
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *values)  # fmt: skip
