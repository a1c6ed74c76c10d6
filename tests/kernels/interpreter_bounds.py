"""Bounds checks for our kernels under the Triton interpreter.

On a GPU an out-of-bounds load is an illegal-address fault at best; under the interpreter it
reads whatever host memory lies there and a test can still pass. With :func:`install`, every
load and store a kernel of ``int8kv_kernels`` makes (the lanes its mask lets through) must fall
inside the storage of one of that launch's tensor arguments, or the launch raises
:class:`OutOfBounds`. Other kernels (vLLM's, under the shim tests) are not checked.

It hooks internals of Triton's interpreter (``GridExecutor._init_args_hst``, where the launch's
tensors are bound, ``GridExecutor.__call__``, where the launch ends, and
``InterpreterBuilder.create_masked_load`` / ``_store``), so it refuses to install where they are
missing rather than silently checking nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# modules whose kernels are checked (str.startswith prefixes)
CHECKED_MODULES: tuple[str, ...] = ("int8kv_kernels",)

# [(first byte, end byte)] of the running launch's tensor storages; None: not one of ours
_ranges: list[tuple[int, int]] | None = None
_installed = False


class OutOfBounds(AssertionError):
    """A kernel of ours addressed memory outside every tensor of its launch."""


def _storages(args: list[Any]) -> list[tuple[int, int]]:
    out = []
    for a in args:
        if hasattr(a, "untyped_storage"):
            s = a.untyped_storage()
            out.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
    return out


def check(ptrs: np.ndarray, mask: np.ndarray, itemsize: int, what: str) -> None:
    """Raise OutOfBounds if an unmasked address of ``ptrs`` is outside the launch's tensors."""
    if _ranges is None:
        return
    p = np.asarray(ptrs).astype(np.int64)
    sel = p[np.broadcast_to(np.asarray(mask, dtype=bool), p.shape)]
    if sel.size == 0:
        return
    ok = np.zeros(sel.shape, dtype=bool)
    for lo, hi in _ranges:
        ok |= (sel >= lo) & (sel + itemsize <= hi)
    if not ok.all():
        bad = sel[~ok]
        raise OutOfBounds(
            f"{what} of {bad.size} element(s) outside every tensor of the launch "
            f"(first address {int(bad[0]):#x}; tensors at {[(hex(a), b - a) for a, b in _ranges]})"
        )


def install() -> None:
    """Hook the interpreter (idempotent)."""
    global _installed
    if _installed:
        return
    from triton.runtime import interpreter

    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    for owner, name in ((executor, "_init_args_hst"), (executor, "__call__"),
                        (builder, "create_masked_load"), (builder, "create_masked_store")):  # fmt: skip
        if not hasattr(owner, name):
            raise RuntimeError(f"interpreter_bounds: Triton's interpreter has no {name}")
    init_args, call = executor._init_args_hst, executor.__call__
    load, store = builder.create_masked_load, builder.create_masked_store
    np_dtype = interpreter._get_np_dtype

    def bound_args(self, args_dev, kwargs):
        global _ranges
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        ours = (getattr(self.fn, "__module__", None) or "").startswith(CHECKED_MODULES)
        _ranges = _storages([*args_hst, *kwargs_hst.values()]) if ours else None
        return args_hst, kwargs_hst

    def launch(self, *args, **kwargs):
        global _ranges
        try:
            return call(self, *args, **kwargs)
        finally:
            _ranges = None

    def checked_load(self, ptrs, mask, other, *rest):
        check(ptrs.data, mask.data, np.dtype(np_dtype(ptrs.get_element_ty())).itemsize, "load")
        return load(self, ptrs, mask, other, *rest)

    def checked_store(self, ptrs, value, mask, *rest):
        check(ptrs.data, mask.data, np.dtype(np_dtype(ptrs.get_element_ty())).itemsize, "store")
        return store(self, ptrs, value, mask, *rest)

    executor._init_args_hst, executor.__call__ = bound_args, launch
    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
    _installed = True
