"""Access to ``int8kv_kernels.catalogue`` without running ``int8kv_kernels/__init__.py``.

The package init may import torch and triton (it exports the kernels). The shim's activation path
runs in every Python process and at interpreter start, so it loads just the catalogue file, under its
real module name: a later ``import int8kv_kernels.catalogue`` (by the kernels themselves) finds that
same module object in ``sys.modules``, so there is only ever one catalogue.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
from types import ModuleType

_PACKAGE = "int8kv_kernels"
_MODULE = f"{_PACKAGE}.catalogue"
_lock = threading.Lock()


def load_catalogue() -> ModuleType:
    """The ``int8kv_kernels.catalogue`` module (``CATALOGUE``, ``DTYPE_NAMES``, ``get_dtype``)."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        return module
    with _lock:
        module = sys.modules.get(_MODULE)
        if module is not None:
            return module
        if _PACKAGE in sys.modules:
            # The package is initialised already: nothing to avoid, import it the normal way.
            return importlib.import_module(_MODULE)
        return _load_without_package_init()


def _load_without_package_init() -> ModuleType:
    # find_spec on a top-level name locates the package without executing it.
    package_spec = importlib.util.find_spec(_PACKAGE)
    if package_spec is None or not package_spec.submodule_search_locations:
        raise ImportError(f"{_PACKAGE} is not installed; reinstall int8kv-shim")
    spec = importlib.machinery.PathFinder.find_spec(
        _MODULE, list(package_spec.submodule_search_locations)
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"{_MODULE} not found in {package_spec.submodule_search_locations}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_MODULE]
        raise
    _attach_to_package_when_imported(module)
    return module


def _attach_to_package_when_imported(module: ModuleType) -> None:
    # A submodule normally becomes an attribute of its package when imported through it; this one
    # was not, so `int8kv_kernels.catalogue` attribute access would fail once the package loads.
    import wrapt

    def attach(package: ModuleType) -> None:
        if not hasattr(package, "catalogue"):
            package.catalogue = module

    wrapt.register_post_import_hook(attach, _PACKAGE)


def dtype_names() -> tuple[str, ...]:
    """Our ``--kv-cache-dtype`` names, in catalogue order."""
    return tuple(load_catalogue().DTYPE_NAMES)


def page_tokens(name: str | None) -> int | None:
    """The block size dtype ``name`` fixes (its page's tokens); None: any block size, or not ours."""
    entry = load_catalogue().CATALOGUE.get(name or "")
    return None if entry is None else entry.page_tokens


def needs_tail_pool(name: str | None) -> bool:
    """Whether dtype ``name`` keeps each sequence's unfinished page in the shim's tail pool."""
    entry = load_catalogue().CATALOGUE.get(name or "")
    return entry is not None and entry.tail


def block_size_reason(name: str | None, block_size: int | None) -> str | None:
    """Why ``block_size`` cannot hold dtype ``name``'s pages, in one line; None when it can."""
    fixed = page_tokens(name)
    if fixed is None or block_size is None or block_size == fixed:
        return None
    return (
        f"--kv-cache-dtype {name} stores pages of {fixed} tokens: use --block-size {fixed} "
        f"(or leave --block-size out), not {block_size}"
    )
