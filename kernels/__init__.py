"""INT8 / INT4 paged KV-cache kernels (Triton + torch only; never imports vLLM).

Public API:
    write_kv_cache      quantize new K/V into INT8 / INT4 pages (cache_write.py)
    write_kv_cache_int4 the int4 write with its tail pool (cache_write_int4.py)
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

from .attention import AttentionWorkspace, choose_num_splits, make_workspace, paged_attention
from .attention_int4 import paged_attention_int4
from .cache_write import write_kv_cache
from .cache_write_int4 import write_kv_cache_int4
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
]
