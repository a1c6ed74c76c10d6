"""INT8 / INT4 paged KV-cache kernels (Triton + torch only; never imports vLLM).

Public API:
    write_kv_cache      quantize new K/V into INT8 / INT4 pages (cache_write.py)
    write_kv_cache_int4 the int4 write with its tail pool (cache_write_int4.py)
    write_sink_int4     int4's sink pages: a sequence's first page in the model's dtype
    paged_attention_int4  attention over int4 pages + tails (attention_int4.py)
    paged_attention     varlen causal attention over INT8 pages (attention.py)
    gather_kv_context   dequantize chunked-prefill contexts into contiguous K/V (context_gather.py)
    make_workspace      split-KV scratch for CUDA-graph-safe decode (attention.py)
    PageLayout          byte offsets of an INT8 page's regions (page_layout.py)
    Int4PageLayout      byte offsets of an ``int4`` page's regions (page_layout.py)
    V_FORMATS           values of the ``v_format`` keyword ("int8", "e4m3": FP8-E4M3 V, e4m3.py)
    INT8_DTYPES, INT4_DTYPES  the dtypes of each page layout (all dtype facts: catalogue.py)

``kv_dtype="int4"`` (4-bit, K per channel of a 64-token page, V per token group, the last page
in a tail pool) goes through the same two entry points with its own keywords (tail,
tail_page, slot_of_seq, ...); its kernels live in cache_write_int4.py / attention_int4.py and its
torch specification in reference_int4.py. Launch planning shared by both attention formats:
attention_plan.py.
"""

if __name__ == "kernels":
    # This folder is the package int8kv_kernels. It was imported as the top-level name `kernels`
    # because the checkout's root is on sys.path (pytest, `python -m benchmarks.NAME` run from the
    # checkout), where it shadows PyPI's `kernels`, which transformers imports when that is
    # installed. Hand the name to the next `kernels` on sys.path, or fail as a missing one would.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _others = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec(__name__, _others)
    if _spec is None or _spec.loader is None:
        raise ImportError(
            f"No module named {__name__!r} (the checkout's {__name__}/ is int8kv_kernels)"
        )
    _module = _util.module_from_spec(_spec)
    _sys.modules[__name__] = _module
    try:
        _spec.loader.exec_module(_module)
    except BaseException:
        del _sys.modules[__name__]
        raise
else:
    from .attention import AttentionWorkspace, choose_num_splits, make_workspace, paged_attention
    from .attention_int4 import paged_attention_int4
    from .cache_write import write_kv_cache
    from .cache_write_int4 import write_kv_cache_int4, write_sink_int4
    from .catalogue import INT4_DTYPES, INT8_DTYPES, V_FORMATS
    from .context_gather import gather_kv_context
    from .page_layout import Int4PageLayout, PageLayout, get_page_bytes

__all__ = [
    "INT4_DTYPES",
    "INT8_DTYPES",
    "AttentionWorkspace",
    "Int4PageLayout",
    "PageLayout",
    "V_FORMATS",
    "choose_num_splits",
    "gather_kv_context",
    "get_page_bytes",
    "make_workspace",
    "paged_attention",
    "paged_attention_int4",
    "write_kv_cache",
    "write_kv_cache_int4",
    "write_sink_int4",
]
