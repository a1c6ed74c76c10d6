"""INT8 paged KV-cache kernels (Triton + torch only; never imports vLLM).

Public API:
    write_kv_cache      quantize new K/V into INT8 pages (cache_write.py)
    paged_attention     varlen causal attention over INT8 pages (attention.py)
    make_workspace      split-KV scratch for CUDA-graph-safe decode (attention.py)
    PageLayout          byte offsets of a page's regions (page_layout.py)
    V_FORMATS           values of the ``v_format`` keyword ("int8", "e4m3": FP8-E4M3 V, e4m3.py)
"""

from .attention import AttentionWorkspace, choose_num_splits, make_workspace, paged_attention
from .cache_write import write_kv_cache
from .e4m3 import V_FORMATS
from .page_layout import INT8_DTYPES, PageLayout, get_page_bytes

__all__ = [
    "INT8_DTYPES",
    "AttentionWorkspace",
    "PageLayout",
    "V_FORMATS",
    "choose_num_splits",
    "get_page_bytes",
    "make_workspace",
    "paged_attention",
    "write_kv_cache",
]
