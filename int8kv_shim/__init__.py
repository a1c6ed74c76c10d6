"""int8kv-shim: quantized KV caches (``int8``, ``int8_static``, ``int4``) for vLLM 0.24.0.

Importing this package does nothing unless ``INT8KV_SHIM`` is truthy (see
:mod:`int8kv_shim.environment_variables`); then it calls :func:`instrument`, which registers
post-import hooks. Even then it imports neither vLLM nor torch: the patches run when vLLM imports
the modules they change, or at once for modules already imported (the plugin path, which runs late).

Three ways in, all idempotent: the ``vllm.general_plugins`` entry point (:mod:`int8kv_shim.plugin`,
every vLLM process), a ``sitecustomize`` that imports this package (``int8kv run -- COMMAND`` puts
the package's own, ``int8kv_shim/_autoload/``, on ``PYTHONPATH``; ``sitecustomize_example/`` is the
one-import one to copy), or a plain ``import int8kv_shim`` before vLLM.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import Literal

from int8kv_shim.environment_variables import activation_requested

__all__ = ["instrument", "uninstrument", "mode"]

Mode = Literal["off", "active", "inert"]

# RLock: wrapt runs a hook immediately, inside instrument(), for a module already imported.
_lock = threading.RLock()
_mode: Mode = "off"
# wrapt cannot unregister a post-import hook, so each module is hooked at most once per process
# and the hook consults _mode; uninstrument() therefore leaves harmless no-op hooks behind.
_hooked: set[str] = set()
_warned = False
_imported_version_ok: bool | None = None  # the tree's verdict, once vLLM is imported


def mode() -> Mode:
    """``"active"`` (patching vLLM), ``"inert"`` (unsupported vLLM: guards only) or ``"off"``."""
    return _mode


def instrument() -> Mode:
    """Patch vLLM for our KV-cache dtypes (or, on an unsupported vLLM, guard it). Idempotent."""
    global _mode
    with _lock:
        if _mode != "off":
            return _mode
        from int8kv_shim import patch
        from int8kv_shim.package import check_vllm_version

        check = check_vllm_version()
        _mode = "active" if check.supported else "inert"
        if not check.supported:
            patch.set_inert_reason(check)
        if check.installed is None:
            _warn_inert_once(check.describe())  # no vLLM import will ever come to warn later
        for name in dict.fromkeys(["vllm", *patch.ACTIVE_SITES, *patch.GUARD_SITES]):
            if name not in _hooked:
                import wrapt

                _hooked.add(name)
                wrapt.register_post_import_hook(_on_import, name)  # runs now if imported
            elif name in sys.modules:
                _on_import(sys.modules[name])
        return _mode


def uninstrument() -> None:
    """Undo every patch and guard; vLLM behaves as if the shim had never been imported."""
    global _mode
    with _lock:
        if _mode == "off":
            return
        _mode = "off"
        from int8kv_shim import patch

        patch.undo_all()


def _on_import(module: ModuleType) -> None:
    global _mode
    with _lock:
        if _mode == "off":
            return
        from int8kv_shim import patch
        from int8kv_shim.package import check_vllm_version

        if module.__name__ == "vllm":
            if _mode == "inert":
                _warn_inert_once(check_vllm_version().describe())
            return
        if _mode == "active" and not _imported_vllm_is_supported():
            _mode = "inert"
            for name, guards in patch.GUARD_SITES.items():
                if name in sys.modules and name != module.__name__:
                    for guard in guards:
                        guard(sys.modules[name])
        sites = patch.ACTIVE_SITES if _mode == "active" else patch.GUARD_SITES
        for apply in sites.get(module.__name__, ()):
            try:
                apply(module)
            except Exception as exc:
                raise RuntimeError(
                    f"int8kv-shim could not patch {module.__name__} ({apply.__name__}); "
                    "unset INT8KV_SHIM to run vLLM without the shim"
                ) from exc


def _imported_vllm_is_supported() -> bool:
    """Second opinion from the imported tree, for source/editable installs whose metadata lies."""
    global _imported_version_ok
    if _imported_version_ok is not None:
        return _imported_version_ok
    from int8kv_shim import patch
    from int8kv_shim.package import VersionCheck, is_supported_version

    try:
        from vllm._version import __version__ as imported  # a constant; cheap once vllm loads
    except ImportError:
        imported = None  # nothing better to go on than the metadata, which said yes
    _imported_version_ok = imported is None or is_supported_version(imported)
    if not _imported_version_ok:
        patch.set_inert_reason(VersionCheck(installed=imported, supported=False))
        _warn_inert_once(f"the imported vLLM tree is version {imported}")
    return _imported_version_ok


def _warn_inert_once(found: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    from int8kv_shim._logging import get_logger
    from int8kv_shim.package import inert_warning

    get_logger().warning(inert_warning(found))


def __getattr__(name: str) -> str:
    if name == "__version__":
        from int8kv_shim.package import shim_version

        return shim_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if activation_requested():
    instrument()
