"""Kernel launches with less host work than ``kernel[grid](...)``, for the per-layer hot path.

vLLM runs attention eagerly whenever a step is not captured in a CUDA graph: every mixed
prefill/decode step, and every step of a batch over the capture limit (512 by default). Then each
layer pays the host cost of our launches, and on an H200 that cost decides 1K-context throughput
(benchmarks/results/logs/profile_int8_1024.txt: int8 spends less GPU time than FlashAttention-2 and
is still slower). Triton's ``JITFunction.run`` spends most of a launch in Python around the
specialization it computes (option strings, global-value checks, knob lookups, launch metadata):
benchmarks/launch_overhead.py measured 89 us per attention launch through it on an H200 host, 75 us
through DirectLauncher and 17 us as a replay (benchmarks/results/launch_overhead.json).

``DirectLauncher`` keeps the part that decides which binary runs, Triton's own binder (the same
generated function ``run`` calls, so the specialization is Triton's, bit for bit), and keys its own
cache on that specialization. A key seen before launches the cached ``CompiledKernel`` directly; a
new one goes through ``JITFunction.run``, which compiles (or loads) and launches, and returns the
kernel to cache. What the direct path skips besides the Python: the check that the globals a
kernel read have not changed since it compiled (ours are module constants), and one driver query
per tensor argument: tensors go to the launcher as their addresses, after a check that each is a
CUDA tensor. Under the interpreter, on another Triton release, or while a launch hook (a profiler
such as proton) is registered, it calls ``kernel[grid](...)`` unchanged.

Replays go further, for the wrappers whose calls repeat layer after layer (paged_attention,
write_kv_cache, gather_kv_context; int4's paged_attention_int4, write_kv_cache_int4,
write_sink_int4 and gather_kv_context_int4): ``DirectLauncher.record`` launches and returns a ``Replay`` that relaunches the
same binary with the same arguments except some tensors, and a ``ReplayCache`` holds them under a
key the wrapper computes from everything else that decides the launch. A replay skips the
wrapper's own Python and the binder; it checks what the binder would have specialized the swapped
tensors on (dtype, CUDA, 16-byte alignment), and where they differ the wrapper launches the usual
way.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch
import triton

try:  # Triton's parallel compile (3.6); another release has compile_in_parallel do nothing
    from triton.runtime import _async_compile
except ImportError:  # pragma: no cover
    _async_compile = None

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


@contextmanager
def compile_in_parallel(threads: int) -> Iterator[None]:
    """Inside, a :class:`DirectLauncher` launch compiles its binary on one of ``threads`` threads
    and launches nothing; on exit every compile has finished and Triton's own cache holds it, so
    the same launches then run without compiling.

    Triton's compile spends most of its time outside the GIL (MLIR and LLVM passes, ptxas), so
    the variants a start-up compiles one launch at a time build side by side here. A compile that
    fails is left out: the launch made afterwards compiles it again and raises its error. On
    another Triton release, or with fewer than two threads, this is a plain block (the launches in
    it compile and run as usual)."""
    if not _TRITON_OK or _async_compile is None or threads < 2:
        yield
        return
    with (
        ThreadPoolExecutor(threads, thread_name_prefix="int8kv-compile") as pool,
        _async_compile.AsyncCompileMode(pool, ignore_errors=True),
    ):
        yield


def _compiling_only() -> bool:
    return _async_compile is not None and _async_compile.active_mode.get() is not None


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
        self.replays = 0  # of them, replays (Replay.launch)

    def __call__(self, grid: Sequence[int], *args: Any, **kwargs: Any) -> None:
        self._launch(grid, args, kwargs, None)

    def record(
        self, swap: Sequence[Sequence[str]], grid: Sequence[int], *args: Any, **kwargs: Any
    ) -> Replay | None:
        """Launch as ``self(grid, *args, **kwargs)`` and return a :class:`Replay` of that launch
        that takes a new tensor for each group of argument names in ``swap``, by the group's first
        name (every name of the group gets that tensor's address); None where the launch did not
        go direct."""
        return self._launch(grid, args, kwargs, swap)

    def _launch(
        self,
        grid: Sequence[int],
        args: tuple,
        kwargs: dict[str, Any],
        swap: Sequence[Sequence[str]] | None,
    ) -> Replay | None:
        if not (self.direct and _ENABLED) or args[0].device.type != "cuda" or _launch_hooks_set():
            self.fn[tuple(grid)](*args, **kwargs)
            return None
        if _compiling_only():  # compile_in_parallel: queue this launch's compile, launch nothing
            self.fn.run(*args, grid=tuple(grid), warmup=True, **kwargs)
            return None
        index = _current_device()
        binder = self.fn.device_caches[index][4]
        bound, specialization, options = binder(*args, **kwargs)  # options: num_warps, ...
        key = (index, *options.items(), *specialization)
        cached = self._kernels.get(key)
        launched = cached is None
        if launched:
            kernel = self.fn.run(*args, grid=tuple(grid), warmup=False, **kwargs)
            kernel = kernel.result() if hasattr(kernel, "result") else kernel
            pointers = tuple(
                i for i, (ty, _) in enumerate(specialization)
                if isinstance(ty, str) and ty.startswith("*")
            )  # fmt: skip
            self._kernels[key] = cached = (kernel, pointers)
        kernel, pointers = cached
        values = list(bound.values())
        for i in pointers:
            tensor = values[i]
            # anything but a CUDA tensor: Triton's launch handles it (or raises its own error)
            if not getattr(tensor, "is_cuda", False):
                if not launched:
                    self.fn[tuple(grid)](*args, **kwargs)
                return None
            # Triton's launcher asks the driver where each tensor's pointer lives
            # (cuPointerGetAttribute); for an integer it takes the address as it is.
            values[i] = tensor.data_ptr()
        g0, g1, g2 = (*grid, 1, 1)[:3]
        if not launched:
            self.direct_launches += 1
            kernel.run(g0, g1, g2, _current_stream(index), kernel.function,
                       kernel.packed_metadata, None, None, None, *values)  # fmt: skip
        if swap is None:
            return None
        names = self.fn.arg_names
        slots = []
        for group in swap:
            positions = tuple(names.index(name) for name in group)
            # Triton specialized each pointer on whether its address is a multiple of 16 ("D"):
            # a binary compiled for aligned addresses must never get another. None: a group of
            # pointers the kernel does not specialize on alignment takes any address.
            aligned = (
                None if takes_any_alignment(self.fn, positions)
                else any(specialization[i][1] == "D" for i in positions)
            )  # fmt: skip
            slots.append((group[0], positions, bound[group[0]].dtype, aligned))
        return Replay(self, kernel, (g0, g1, g2), index, values, tuple(slots))


def takes_any_alignment(fn: Any, positions: Sequence[int]) -> bool:
    """Whether the kernel ``fn`` takes the pointer arguments at ``positions`` at any address: all
    in its ``do_not_specialize_on_alignment``, so Triton recorded no alignment for them."""
    return all(fn.params[i].do_not_specialize_on_alignment for i in positions)


def kernel_launchers() -> list[DirectLauncher]:
    """The launcher of every kernel of this package, each once (every module imported)."""
    import importlib
    import pkgutil

    package = __name__.rpartition(".")[0]
    modules = [importlib.import_module(f"{package}.{m.name}")
               for m in pkgutil.iter_modules(importlib.import_module(package).__path__)]  # fmt: skip
    found = {id(v): v for m in modules for v in vars(m).values() if isinstance(v, DirectLauncher)}
    return list(found.values())


class Replay:
    """A direct launch to repeat with other tensors in some argument slots (``DirectLauncher.record``).

    Everything else, binary, grid and every other argument, is the recorded launch's: the caller
    keys replays on what decides those (``ReplayCache``). ``bind(tensors)`` gives the argument
    values for ``launch``, or None where the recorded binary does not fit the tensors (another
    dtype, an address Triton would have specialized differently, not on the recorded device) or
    direct launches are off now: the caller then launches the usual way.
    """

    __slots__ = ("launcher", "kernel", "grid", "index", "values", "slots")

    def __init__(
        self,
        launcher: DirectLauncher,
        kernel: Any,
        grid: tuple[int, int, int],
        index: int,
        values: list,
        slots: tuple[tuple[str, tuple[int, ...], torch.dtype, bool | None], ...],
    ) -> None:
        self.launcher, self.kernel, self.grid, self.index = launcher, kernel, grid, index
        self.values, self.slots = values, slots

    def bind(self, tensors: Mapping[str, torch.Tensor]) -> list | None:
        """The launch's argument values with ``tensors`` (by argument name, see ``record``)
        swapped in; None where they do not fit."""
        if not (self.launcher.direct and _ENABLED) or _launch_hooks_set():
            return None
        if _current_device() != self.index:
            return None
        return self.swapped(tensors)

    def swapped(self, tensors: Mapping[str, torch.Tensor], on_cuda: bool = True) -> list | None:
        """The recorded argument values with ``tensors``' addresses swapped in, or None where one
        differs from what the binary was specialized on (dtype, 16-byte alignment) or, with
        ``on_cuda``, is not on a GPU."""
        values = self.values.copy()
        for name, positions, dtype, aligned in self.slots:
            tensor = tensors[name]
            if tensor.dtype != dtype or (on_cuda and not tensor.is_cuda):
                return None
            address = tensor.data_ptr()
            if aligned is not None and aligned != (address % 16 == 0):
                return None
            for i in positions:
                values[i] = address
        return values

    def launch(self, values: list) -> None:
        kernel = self.kernel
        self.launcher.direct_launches += 1
        self.launcher.replays += 1
        kernel.run(*self.grid, _current_stream(self.index), kernel.function,
                   kernel.packed_metadata, None, None, None, *values)  # fmt: skip


class ReplayCache:
    """A wrapper's recorded launches by the wrapper's key: everything that decides them but the
    tensors the replays swap. Bounded (emptied when full: a batch's key changes with its shape).
    """

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._entries: dict[tuple, tuple] = {}
        _caches.append(self)

    def add(self, key: tuple, replays: Sequence[Replay], *keep: Any) -> None:
        """Record ``replays`` under ``key``, launched in that order; ``keep``: objects the
        launches' arguments point into, kept alive with the entry."""
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[key] = (tuple(replays), keep)

    def run(self, key: tuple, **tensors: torch.Tensor | None) -> bool:
        """Replay the launches recorded under ``key`` with ``tensors`` by argument name (each
        replay takes those it swaps); False (nothing launched) where there are none or one does
        not fit."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        bound = []
        for replay in entry[0]:
            values = replay.bind(tensors)
            if values is None:
                return False
            bound.append((replay, values))
        for replay, values in bound:
            replay.launch(values)
        return True

    def clear(self) -> None:
        self._entries.clear()


# every wrapper's replay cache (one per module, made at import), for clear_replays
_caches: list[ReplayCache] = []


def clear_replays() -> None:
    """Forget every recorded launch, so that each wrapper's next call launches through its
    binder again (what ``benchmarks/launch_overhead.py`` times as the unrecorded path)."""
    for cache in _caches:
        cache.clear()
