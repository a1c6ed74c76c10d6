"""The attention backend vLLM selects, as ``AttentionBackendEnum.CUSTOM``, for layers whose KV-cache
dtype is one of ours.

vLLM imports this module only after the shim registered it (patch P5), in a process that already
imported vLLM and torch. Here: the declared capabilities (vLLM's ``validate_configuration`` uses
them to accept or refuse a layer at startup, with the reason in the error) and the KV-cache shape.
The metadata builder and the implementation, which call the kernels (``int8kv_kernels``), live in
``attention_impl.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType

from int8kv_shim.attention_impl import Int8KVAttentionImpl, Int8KVAttentionMetadataBuilder
from int8kv_shim.catalogue_loader import block_size_reason, load_catalogue, page_tokens

if TYPE_CHECKING:
    from vllm.platforms.interface import DeviceCapability

_catalogue = load_catalogue()

# Ampere and newer: the kernels rely on bf16 tensor-core MMA and cp.async.
MIN_COMPUTE_CAPABILITY = (8, 0)


class Int8KVAttentionBackend(AttentionBackend):
    """Paged attention over an int8 / int4 KV cache, one flat int8 page per block and layer."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(_catalogue.DTYPE_NAMES)
    # Quantizing K/V on write is its own op (do_kv_cache_update), separate from attention.
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        # Must be the enum member's name: Attention.__init__ maps it back with
        # AttentionBackendEnum[backend.get_name()].
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[Int8KVAttentionImpl]:
        return Int8KVAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[Int8KVAttentionMetadataBuilder]:
        return Int8KVAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``(num_blocks, page_bytes)``: the kernels own the layout inside a page (data, scales)."""
        dtype = _catalogue.get_dtype(cache_dtype_str)
        return (num_blocks, dtype.page_bytes(block_size, num_kv_heads, head_size))

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # The union; supports_combination narrows it per dtype.
        return sorted({h for d in _catalogue.CATALOGUE.values() for h in d.head_sizes})

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """The block size vLLM uses when the user gave no ``--block-size``: the one our dtype's
        pages fix (``int4``: 64), else vLLM's default.

        vLLM calls it in each worker (``Platform.update_block_size_for_backend``) with the
        engine's config current; the front end already set the same value (patch P10).
        """
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        cache = getattr(config, "cache_config", None)
        fixed = page_tokens(getattr(cache, "cache_dtype", None))
        return fixed if fixed is not None else super().get_preferred_block_size(default_block_size)

    @classmethod
    def is_mla(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        # Encoder attention has no KV cache to quantize.
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return (capability.major, capability.minor) >= MIN_COMPUTE_CAPABILITY

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        entry = _catalogue.CATALOGUE.get(kv_cache_dtype or "")
        if (
            entry is not None
            and head_size not in entry.head_sizes
            and cls.supports_head_size(head_size)
        ):
            return _head_size_reason(kv_cache_dtype, head_size)
        # vLLM passes the block size here only when the user chose it (--block-size).
        return block_size_reason(kv_cache_dtype, block_size)

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        use_per_head_quant_scales: bool,
        device_capability: DeviceCapability,
        attn_type: str,
        use_non_causal: bool = False,
        use_batch_invariant: bool = False,
        use_kv_connector: bool = False,
    ) -> list[str]:
        """vLLM's checks, with its generic reasons replaced by ones a user can act on.

        The reasons end up in vLLM's "No valid attention backend found ..." startup error, next
        to ``CUSTOM``, which says nothing about this shim by itself.
        """
        reasons = super().validate_configuration(
            head_size=head_size,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            use_mla=use_mla,
            has_sink=has_sink,
            use_sparse=use_sparse,
            use_mm_prefix=use_mm_prefix,
            use_per_head_quant_scales=use_per_head_quant_scales,
            device_capability=device_capability,
            attn_type=attn_type,
            use_non_causal=use_non_causal,
            use_batch_invariant=use_batch_invariant,
            use_kv_connector=use_kv_connector,
        )
        cap = device_capability
        major, minor = MIN_COMPUTE_CAPABILITY
        precise = {
            "compute capability not supported": (
                f"int8kv-shim needs compute capability >= {major}.{minor} (Ampere or newer); "
                f"this GPU is {cap.major}.{cap.minor}"
            ),
            "head_size not supported": _head_size_reason(kv_cache_dtype, head_size),
            "dtype not supported": (
                f"int8kv-shim needs float16 or bfloat16 activations, not {dtype}"
            ),
            "kv_cache_dtype not supported": (
                f"int8kv-shim's backend serves only --kv-cache-dtype "
                f"{' / '.join(_catalogue.DTYPE_NAMES)}, not {kv_cache_dtype!r}"
            ),
            "MLA not supported": (
                "int8kv-shim does not support MLA (latent-attention) models; use one of vLLM's "
                "own --kv-cache-dtype values"
            ),
            f"attention type {attn_type} not supported": (
                f"int8kv-shim supports decoder self-attention only, not {attn_type} attention"
            ),
        }
        return [precise.get(reason, f"int8kv-shim: {reason}") for reason in reasons]


def _head_size_reason(kv_cache_dtype: str | None, head_size: int) -> str:
    entry = _catalogue.CATALOGUE.get(kv_cache_dtype or "")
    sizes = (
        entry.head_sizes if entry is not None else Int8KVAttentionBackend.get_supported_head_sizes()
    )
    return (
        f"int8kv-shim's {kv_cache_dtype} kernels support head sizes "
        f"{', '.join(map(str, sizes))}, not {head_size}"
    )
