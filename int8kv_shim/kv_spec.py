"""KV-cache specs whose page size counts every byte of our page, scales included.

vLLM sizes the KV cache in the engine-core process from these specs (pickled from the workers), so
the page size must come from the catalogue and nowhere else: the backend's ``get_kv_cache_shape``
uses the same catalogue, and vLLM checks that shape bytes == spec page bytes when it reshapes.
Imports vLLM: only ever imported from code that runs once vLLM is already loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from int8kv_kernels.catalogue import get_dtype


def _page_bytes(spec: FullAttentionSpec | SlidingWindowSpec, kv_dtype: str) -> int:
    if spec.head_size_v != spec.head_size:
        raise ValueError(
            f"int8kv-shim: K head size {spec.head_size} != V head size {spec.head_size_v}; "
            "models with different K and V head sizes are not supported"
        )
    return get_dtype(kv_dtype).page_bytes(spec.block_size, spec.num_kv_heads, spec.head_size)


def _merge_kv_dtype(merged, specs):  # type: ignore[no-untyped-def]
    names = {s.int8kv_dtype for s in specs}
    if len(names) != 1:
        raise ValueError(f"int8kv-shim: one KV-cache group mixes dtypes {sorted(names)}")
    return replace(merged, int8kv_dtype=names.pop())


@dataclass(frozen=True, kw_only=True)
class Int8KVFullAttentionSpec(FullAttentionSpec):
    """Full attention with one of our quantized page layouts."""

    int8kv_dtype: str = "int8"

    @property
    def real_page_size_bytes(self) -> int:
        return _page_bytes(self, self.int8kv_dtype)

    @classmethod
    def merge(cls, specs: list[Int8KVFullAttentionSpec]) -> Int8KVFullAttentionSpec:
        # FullAttentionSpec.merge rebuilds the spec from its own fields only, dropping ours.
        return _merge_kv_dtype(super().merge(specs), specs)


@dataclass(frozen=True, kw_only=True)
class Int8KVSlidingWindowSpec(SlidingWindowSpec):
    """Sliding-window attention with one of our quantized page layouts."""

    int8kv_dtype: str = "int8"

    @property
    def real_page_size_bytes(self) -> int:
        return _page_bytes(self, self.int8kv_dtype)

    @classmethod
    def merge(cls, specs: list[Int8KVSlidingWindowSpec]) -> Int8KVSlidingWindowSpec:
        return _merge_kv_dtype(super().merge(specs), specs)


def to_int8kv_spec(
    spec: FullAttentionSpec | SlidingWindowSpec, kv_dtype: str
) -> Int8KVFullAttentionSpec | Int8KVSlidingWindowSpec:
    """The same spec as vLLM built for the layer, as our subclass that sizes our page."""
    if isinstance(spec, SlidingWindowSpec):
        cls: type = Int8KVSlidingWindowSpec
    elif type(spec) is FullAttentionSpec:
        cls = Int8KVFullAttentionSpec
    else:
        raise ValueError(
            f"int8kv-shim: --kv-cache-dtype {kv_dtype} does not support {type(spec).__name__} layers"
        )
    values = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
    return cls(**values, int8kv_dtype=kv_dtype)
