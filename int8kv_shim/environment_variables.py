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
FALSY_VALUES: frozenset[str] = frozenset({"0", "false", "no", "off"})


def is_truthy(value: str | None) -> bool:
    """Whether ``value`` is one of :data:`TRUTHY_VALUES`."""
    return value is not None and value.strip().lower() in TRUTHY_VALUES


def is_falsy(value: str | None) -> bool:
    """Whether ``value`` is one of :data:`FALSY_VALUES` (the switches that are on unless set so)."""
    return value is not None and value.strip().lower() in FALSY_VALUES


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

INT8KV_PREFILL = "INT8KV_PREFILL"
"""How prefills attend: ``flash`` (default) with vLLM's FlashAttention-2 where that runs, over the
new tokens' fresh BF16 K/V and, for a chunked-prefill continuation of more than 256 tokens, its
context gathered from the cache; ``triton`` through the quantized pages with our kernels
like every other token (``flash_prefill.py``)."""

PREFILL_MODES: tuple[str, ...] = ("flash", "triton")


def prefill_mode(environ: Mapping[str, str] | None = None) -> str:
    """``flash`` (default) or ``triton``, from ``INT8KV_PREFILL``; anything else is an error."""
    env = os.environ if environ is None else environ
    raw = env.get(INT8KV_PREFILL)
    mode = (raw or "").strip().lower() or "flash"
    if mode not in PREFILL_MODES:
        raise ValueError(
            f"int8kv-shim: {INT8KV_PREFILL}={raw!r} is not one of {', '.join(PREFILL_MODES)}"
        )
    return mode


INT8KV_DIRECT_LAUNCH = "INT8KV_DIRECT_LAUNCH"
"""``0`` / ``off`` / ``false`` / ``no``: launch our kernels through Triton's ``kernel[grid](...)``
instead of ``int8kv_kernels.launch``'s direct path (the same results, more host time per launch),
should the direct path ever fail. Unset or anything else: direct launches on."""


def direct_launch_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether our kernels launch directly (``INT8KV_DIRECT_LAUNCH``; on unless switched off)."""
    env = os.environ if environ is None else environ
    return not is_falsy(env.get(INT8KV_DIRECT_LAUNCH))


INT8KV_COMPILE_THREADS = "INT8KV_COMPILE_THREADS"
"""How many of our kernels' variants a server's start-up compiles at a time
(``kernel_warmup.py``): a positive integer; ``1`` compiles them one by one as they first launch.
Unset: the CPUs this process may run on, at most 16. Anything else is an error."""

MAX_DEFAULT_COMPILE_THREADS = 16


def compile_threads(environ: Mapping[str, str] | None = None) -> int:
    """The start-up's parallel compiles, from ``INT8KV_COMPILE_THREADS`` (default: the CPUs this
    process may use, at most :data:`MAX_DEFAULT_COMPILE_THREADS`)."""
    env = os.environ if environ is None else environ
    raw = env.get(INT8KV_COMPILE_THREADS)
    if raw is None or not raw.strip():
        return max(1, min(MAX_DEFAULT_COMPILE_THREADS, len(os.sched_getaffinity(0))))
    text = raw.strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"int8kv-shim: {INT8KV_COMPILE_THREADS}={raw!r} is not a positive integer")
    return int(text)


INT8KV_INT4_SINK_PAGE = "INT8KV_INT4_SINK_PAGE"
"""Whether ``int4`` keeps each sequence's first page in the model's dtype beside its 4-bit page
(``sink_pages.py``), one more page per ``max_num_seqs`` slot and layer: on by default (measured
through the cache on both real models, it and the two-page tail bring ``int4`` level with
``int8``); ``0`` / ``off`` / ``false`` / ``no`` switches it off. Anything else is an error."""


def int4_sink_page_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``int4`` keeps sink pages (``INT8KV_INT4_SINK_PAGE``; on unless switched off)."""
    env = os.environ if environ is None else environ
    raw = env.get(INT8KV_INT4_SINK_PAGE)
    if raw is None or not raw.strip() or is_truthy(raw):
        return True
    if is_falsy(raw):
        return False
    raise ValueError(
        f"int8kv-shim: {INT8KV_INT4_SINK_PAGE}={raw!r} is not one of "
        f"{', '.join(sorted(TRUTHY_VALUES | FALSY_VALUES))}"
    )


INT8KV_INT4_TAIL_PAGES = "INT8KV_INT4_TAIL_PAGES"
"""How many of a running sequence's newest pages ``int4`` keeps in the model's dtype: ``2``
(default) its newest page and the one before it, so a query always reads its last 65..128 keys
exact; ``1`` its newest page only (half the tail pool's memory). Anything else is an error."""

INT4_TAIL_PAGES: tuple[int, ...] = (1, 2)
INT4_DEFAULT_TAIL_PAGES = 2


def int4_tail_pages(environ: Mapping[str, str] | None = None) -> int:
    """``2`` (default) or ``1``, from ``INT8KV_INT4_TAIL_PAGES``; anything else is an error."""
    env = os.environ if environ is None else environ
    raw = env.get(INT8KV_INT4_TAIL_PAGES)
    text = (raw or "").strip() or str(INT4_DEFAULT_TAIL_PAGES)
    allowed = [str(n) for n in INT4_TAIL_PAGES]
    if text not in allowed:
        raise ValueError(
            f"int8kv-shim: {INT8KV_INT4_TAIL_PAGES}={raw!r} is not one of {', '.join(allowed)}"
        )
    return int(text)
