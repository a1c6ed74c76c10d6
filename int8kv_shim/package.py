"""Which vLLM this shim supports, and the check against what is installed.

The installed version comes from distribution metadata: ``import vllm`` would import torch and half
of vLLM, which the shim must never do on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

SUPPORTED_VLLM_VERSION = "0.24.0"
"""The only vLLM release whose internals the patches were written against (pinned in pyproject)."""

DISTRIBUTION = "int8kv-shim"


def installed_vllm_version() -> str | None:
    """The installed vLLM distribution's version, or None when vLLM is not installed."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def shim_version() -> str:
    """This package's own version ("unknown" when running from an uninstalled checkout)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def is_supported_version(version: str | None) -> bool:
    """True for exactly the supported release.

    A local label (``0.24.0+cu129``, a rebuilt wheel of the same source) is accepted; pre-, post- and
    dev releases are not: their internals are not the ones the patches were checked against.
    """
    if version is None:
        return False
    return version.split("+", 1)[0] == SUPPORTED_VLLM_VERSION


@dataclass(frozen=True)
class VersionCheck:
    installed: str | None
    supported: bool

    def describe(self) -> str:
        if self.installed is None:
            return "vLLM is not installed"
        return f"vLLM {self.installed} is installed"


def check_vllm_version() -> VersionCheck:
    installed = installed_vllm_version()
    return VersionCheck(installed=installed, supported=is_supported_version(installed))


def inert_warning(found: str) -> str:
    """The one warning logged when INT8KV_SHIM is set but the shim cannot patch this vLLM.

    ``found`` says what was found instead, e.g. ``VersionCheck.describe()``.
    """
    return (
        f"int8kv-shim: INT8KV_SHIM is set but {found}; this shim supports only vLLM "
        f"{SUPPORTED_VLLM_VERSION}, so it stays inactive and vLLM runs unmodified. Its KV-cache "
        f"dtypes are unavailable until you pip install vllm=={SUPPORTED_VLLM_VERSION} "
        f"(or unset INT8KV_SHIM to silence this)."
    )


class UnsupportedVLLMVersionError(RuntimeError):
    """One of our dtypes was asked for while the installed vLLM is not the supported one."""

    def __init__(self, kv_cache_dtype: str, check: VersionCheck) -> None:
        super().__init__(
            f"--kv-cache-dtype {kv_cache_dtype!r} is provided by int8kv-shim, which supports only "
            f"vLLM {SUPPORTED_VLLM_VERSION}, but {check.describe()}. Either install the supported "
            f"version (pip install vllm=={SUPPORTED_VLLM_VERSION}), or use one of vLLM's own "
            f"KV-cache dtypes and deactivate the shim (unset INT8KV_SHIM, or pip uninstall "
            f"int8kv-shim)."
        )
        self.kv_cache_dtype = kv_cache_dtype
        self.installed = check.installed
