"""Where each byte of a quantized (INT8 / INT4) KV-cache page lives.

The vLLM backend hands the kernels one ``torch.int8`` tensor per layer of shape
``(num_blocks, page_bytes)`` (the block stride may be larger than ``page_bytes`` when vLLM pads
pages). Inside a page the layout is "HND": for each kv-head, the ``block_size`` token rows of that
head are one contiguous chunk, so a kernel tile of one kv-head is a handful of contiguous chunks.

``int8`` (dynamic fp16 scales per (token, kv-head, group of G channels)), H = num_kv_heads,
B = block_size, D = head_size, G = 64 above D = 128 and D otherwise (the catalogue's ``group_for``),
NG = D / G (1 at D <= 128, 4 at 256)::

    byte 0                                                                      page_bytes
    | K data            | V data            | K scales           | V scales           |
    | int8 [H][B][D]    | int8 [H][D][B]    | fp16 [H][NG][B]    | fp16 [H][NG][B]    |
    ^ k_data = 0        ^ v_data = H*B*D    ^ k_scale = 2*H*B*D  ^ v_scale = k_scale + 2*H*B*NG

    one K data row (token t, head h) = D bytes at k_data + (h*B + t)*D  -> 16-byte aligned
    V is key-major: element d of (token t, head h) at v_data + (h*D + d)*B + t, i.e. for each
    (head, d) the B tokens of the page are one contiguous (16-byte aligned) run
    the scale of channels [g*G, (g+1)*G) of (token t, head h) = fp16 at
    k_scale + 2*((h*NG + g)*B + t) (and v_scale): for each (head, group) the B tokens' scales of
    the page are one contiguous run, read as at NG = 1 once per group

``int8_static`` (fp32 scales per (layer, kv-head, channel) passed in, nothing per token)::

    | K data int8 [H][B][D] | V data int8 [H][D][B] |      page_bytes = 2*H*B*D

    with ``v_format="e4m3"`` the V bytes are FP8-E4M3FN codes (e4m3.py) instead of int8 integers;
    the layout is the same.

Why this shape:

* one page holds a token's whole state (data and scales), so prefix caching, swapping and
  offloading move it as a unit;
* data rows start at multiples of D (a multiple of 16), never after an inline scale, so every row
  load is a run of 16-byte vector loads (upstream's inline fp32 scale breaks that);
* V is key-major because the attention's PV product reduces over keys: a V tile then reaches shared
  memory with keys contiguous and the matrix-multiply operand is read four keys per 32-bit word.
  Stored D-contiguous like K, the same operand compiled to one byte-wide shared-memory load per
  element (int8 has no transposing ``ldmatrix``), the largest instruction cost of the loop
  (``benchmarks/compile_sm80.py`` checks it stays gone). A token's V is then D single bytes B
  apart, so the write stores a tile of consecutive tokens at a time, token fastest across threads:
  the bytes of consecutive slots share 32-byte sectors (cache_write.py);
* scales sit in their own region after the data, read by the kernels through an fp16 view of the
  same storage (byte offsets / 2), so they cost one small coalesced load per tile;
* a scale per 64 channels, not per head, above D = 128: at D = 256 one scale gives the small
  channels of a vector the step its largest one sets (+0.46% perplexity on Gemma 3 against +0.14%
  per 64 channels, docs/results.md). The kernels keep K and V bytes untouched: attention runs one
  dot per group and scales its score columns (K) or P columns (V) by that group's scales. At
  D = 128 that grouped kernel measured slower than one scale per head and no accuracy gain was
  measured, so D <= 128 keeps NG = 1 and the kernels' NG = 1 specialisation.

``int4`` (``Int4PageLayout``): 4-bit codes, asymmetric fp16 (scale, zero). B = 64 tokens (the
catalogue's ``page_tokens``), G = min(D, 128) channels per V group, NG = D / G (1 or 2)::

    byte 0                                                                          page_bytes
    | K codes          | V codes          | K scale/zero           | V scale/zero             |
    | u8 [H][B][D/2]   | u8 [H][D/2][B]   | fp16 [H][2][D]         | fp16 [H][NG][2][B]       |
    ^ k_data = 0       ^ v_data = H*B*D/2 ^ k_sz = H*B*D           ^ v_sz = H*B*D + 4*H*D

    byte i of a (token, head) holds channel i in its low nibble and channel i + D/2 in its high
    nibble (codes 0..15), so (b & 15) is the tile of channels [0, D/2) and (b >> 4) the tile of
    [D/2, D), each a whole tl.dot operand, no shuffle.
    K: one D/2-byte row per (head, token) at k_data + (h*B + t)*D/2 (16-byte aligned, D >= 32);
       the page's K of one head is one contiguous B*D/2 run (4 KiB at D = 128).
    V: key-major as int8's: byte i of token t at v_data + (h*D/2 + i)*B + t, a 64-byte run per
       (head, byte column).
    K scale/zero, per (page, head, channel) -- the page's 64 tokens share them: scale of channel
       c at fp16 index k_sz/2 + (h*2 + 0)*D + c, zero at (h*2 + 1)*D + c; element = code * scale
       + zero.
    V scale/zero, per (token, head, group): scale of token t, group g at fp16 index
       v_sz/2 + ((h*NG + g)*2 + 0)*B + t, zero at ((h*NG + g)*2 + 1)*B + t.

        D =  64, G =  64:  one V group (both nibbles of every byte)
        D = 128, G = 128:  one V group
        D = 256, G = 128:  V group 0 = the low nibbles, group 1 = the high nibbles

Why this shape, for decode (a memory-bound pass over every page of every sequence):

* a tile is one page: the K (scale, zero) of its D channels are one contiguous 4*D-byte run per
  head (512 B at D = 128), loaded once per tile and folded into q (score = (q * s_K) . codes +
  q . z_K), so no K element is ever multiplied by a scale;
* every packed byte is loaded once (16-byte rows for K, 64-byte runs for V) and split into two
  nibble tiles in registers;
* V is key-major for int8's reason: the PV product's operand reaches shared memory with keys
  contiguous and is read in 32-bit words; stored like K it compiled to byte-wide shared-memory
  loads (``benchmarks/compile_sm80.py`` checks they stay gone);
* V's per-token (scale, zero) of one group are 64 contiguous fp16 each, one small coalesced load
  per tile (``scale * p`` scales the P column, ``sum p * zero`` is one row sum per group);
* a page's bytes are written once, when it fills (the write kernel quantizes it from the tail
  pool, see cache_write_int4.py): the per-channel K scales need all 64 tokens.

``page_bytes`` equals ``catalogue.get_dtype(name).page_bytes(B, H, D)`` (checked at construction).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .catalogue import INT4_DTYPES, INT8_DTYPES, get_dtype


@dataclass(frozen=True)
class PageLayout:
    """Byte offsets of the regions of one page (see the module docstring for the diagram)."""

    dtype_name: str
    block_size: int
    num_kv_heads: int
    head_size: int

    def __post_init__(self) -> None:
        if self.dtype_name not in INT8_DTYPES:
            hint = " (use Int4PageLayout)" if self.dtype_name in INT4_DTYPES else ""
            raise ValueError(f"no int8 page layout for kv dtype {self.dtype_name!r}{hint}")
        if self.head_size % 16:
            raise ValueError(f"head_size {self.head_size} must be a multiple of 16")
        if self.has_scales and self.head_size % self.group_size:
            raise ValueError(
                f"{self.dtype_name}: head_size {self.head_size} is not a multiple of its "
                f"{self.group_size}-channel scale groups"
            )
        # Sum of our regions must be exactly what vLLM allocates from the catalogue.
        assert self._end() == get_dtype(self.dtype_name).page_bytes(
            self.block_size, self.num_kv_heads, self.head_size
        )

    @property
    def has_scales(self) -> bool:
        return get_dtype(self.dtype_name).scale_kind == "per_token_head"

    @property
    def group_size(self) -> int:
        """Channels sharing one dynamic scale (the head, for int8_static's static scales)."""
        return get_dtype(self.dtype_name).group_for(self.head_size)

    @property
    def num_groups(self) -> int:
        """Dynamic scales per (token, kv-head), for K and for V: 0 for int8_static."""
        return self.head_size // self.group_size if self.has_scales else 0

    @property
    def data_bytes(self) -> int:
        """Bytes of the K (or V) data region."""
        return self.num_kv_heads * self.block_size * self.head_size

    @property
    def k_data(self) -> int:
        return 0

    @property
    def v_data(self) -> int:
        return self.data_bytes

    @property
    def k_scale(self) -> int:
        """Byte offset of the K scale region (== page end for int8_static, which has none)."""
        return 2 * self.data_bytes

    @property
    def v_scale(self) -> int:
        return self.k_scale + self._scale_region_bytes

    @property
    def _scale_region_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.block_size * self.num_groups

    def _end(self) -> int:
        return self.v_scale + self._scale_region_bytes

    def kernel_constexprs(self) -> dict:
        """The layout's compile-time arguments shared by the int8 write, attention and context
        gather kernels (as ``Int4PageLayout.kernel_constexprs`` for int4). One dict per layout,
        built once: callers unpack it and must not change it."""
        return self._constexprs

    @functools.cached_property
    def _constexprs(self) -> dict:
        return dict(
            HEAD_SIZE=self.head_size,
            BLOCK_SIZE=self.block_size,
            K_DATA=self.k_data,
            V_DATA=self.v_data,
            K_SCALE=self.k_scale,
            V_SCALE=self.v_scale,
            # scale groups per (token, kv-head); 1 for int8_static, whose kernels read none
            NG=max(self.num_groups, 1),
            DYNAMIC=self.has_scales,
        )

    @property
    def page_bytes(self) -> int:
        return self._end()


@functools.cache
def cached_page_layout(
    kv_dtype: str, block_size: int, num_kv_heads: int, head_size: int
) -> PageLayout:
    """``PageLayout(...)``, built and checked once per layer shape instead of on every kernel call
    (the launch wrappers run once per layer per step, on the host's critical path)."""
    return PageLayout(kv_dtype, block_size, num_kv_heads, head_size)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1); plain Python, where triton.next_power_of_2 goes
    through Triton's JIT call machinery (microseconds per launch)."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class Int4PageLayout:
    """Byte offsets of an ``int4`` page's regions (see the module docstring for the diagram)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_name: str = "int4"

    def __post_init__(self) -> None:
        if self.dtype_name not in INT4_DTYPES:
            raise ValueError(f"no int4 page layout for kv dtype {self.dtype_name!r}")
        d, pt = self.head_size, get_dtype(self.dtype_name).page_tokens
        if self.block_size != pt:
            raise ValueError(
                f"{self.dtype_name}: block size {self.block_size}, but its pages hold {pt} tokens"
            )
        if d < 32 or d & (d - 1):
            raise ValueError(f"int4: head_size {d} must be a power of two >= 32")
        # A V group is both nibble halves of a byte (G = D) or one of them (G = D / 2).
        if self.group_size not in (d, d // 2):
            raise ValueError(f"int4: V group size {self.group_size} must be head_size {d} or half")
        assert self._end() == get_dtype(self.dtype_name).page_bytes(
            self.block_size, self.num_kv_heads, self.head_size
        )

    @property
    def group_size(self) -> int:
        """Channels of one V (scale, zero) group."""
        return get_dtype(self.dtype_name).group_for(self.head_size)

    @property
    def num_groups(self) -> int:
        """V (scale, zero) pairs per (token, head)."""
        return self.head_size // self.group_size

    @property
    def row_bytes(self) -> int:
        """Bytes of one (token, head) vector, two 4-bit codes per byte: a contiguous row for K, one
        byte every ``block_size`` for the key-major V."""
        return self.head_size // 2

    @property
    def data_bytes(self) -> int:
        """Bytes of the K (or V) code region."""
        return self.num_kv_heads * self.block_size * self.row_bytes

    @property
    def k_data(self) -> int:
        return 0

    @property
    def v_data(self) -> int:
        return self.data_bytes

    @property
    def k_sz(self) -> int:
        """K's per-channel (scale, zero) region: fp16 [H][2][D]."""
        return 2 * self.data_bytes

    @property
    def v_sz(self) -> int:
        """V's per-token (scale, zero) region: fp16 [H][NG][2][B]."""
        return self.k_sz + 4 * self.num_kv_heads * self.head_size

    def _end(self) -> int:
        return self.v_sz + 4 * self.num_kv_heads * self.block_size * self.num_groups

    @property
    def page_bytes(self) -> int:
        return self._end()

    def kernel_constexprs(self) -> dict[str, int]:
        """The layout's compile-time arguments shared by the int4 write and attention kernels.
        One dict per layout, built once: callers unpack it and must not change it."""
        return self._constexprs

    @functools.cached_property
    def _constexprs(self) -> dict[str, int]:
        return dict(
            HEAD_SIZE=self.head_size,
            BLOCK_SIZE=self.block_size,
            NGV=self.num_groups,
            K_DATA=self.k_data,
            V_DATA=self.v_data,
            K_SZ=self.k_sz,
            V_SZ=self.v_sz,
        )


@functools.cache
def cached_int4_layout(
    kv_dtype: str, block_size: int, num_kv_heads: int, head_size: int
) -> Int4PageLayout:
    """``Int4PageLayout(...)``, built and checked once per layer shape."""
    return Int4PageLayout(block_size, num_kv_heads, head_size, kv_dtype)


def get_page_bytes(dtype_name: str, block_size: int, num_kv_heads: int, head_size: int) -> int:
    """Bytes of one page of one layer (== catalogue page_bytes)."""
    if dtype_name in INT4_DTYPES:
        return cached_int4_layout(dtype_name, block_size, num_kv_heads, head_size).page_bytes
    return PageLayout(dtype_name, block_size, num_kv_heads, head_size).page_bytes
