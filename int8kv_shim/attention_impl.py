"""The attention backend's runtime half: metadata builder and impl, wired to our Triton kernels.

Shaped like vLLM's ``v1/attention/backends/triton_attn.py``. Imports vLLM and torch: only loaded
when vLLM resolves our backend class, never at shim import.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec

from int8kv_kernels import (
    AttentionWorkspace,
    gather_kv_context,
    make_workspace,
    paged_attention,
    write_kv_cache,
    write_sink_int4,
)
from int8kv_kernels.attention import MAX_SPLITS, choose_num_splits
from int8kv_kernels.cache_write_int4 import tail_pool_shapes
from int8kv_kernels.catalogue import (
    EXPERIMENTAL_DTYPES,
    FLASH_CONTEXT_DTYPES,
    KERNEL_DTYPES,
    STATIC_DTYPE,
    V_FORMATS,
    get_dtype,
)
from int8kv_kernels.launch import set_direct_launches
from int8kv_kernels.page_layout import next_power_of_2
from int8kv_shim import flash_prefill, patch, sink_pages, tail_slots
from int8kv_shim._logging import get_logger
from int8kv_shim.catalogue_loader import needs_tail_pool, page_tokens
from int8kv_shim.environment_variables import (
    INT8KV_DIRECT_LAUNCH,
    direct_launch_enabled,
    int4_sink_page_enabled,
    int4_tail_pages,
)
from int8kv_shim.flash_prefill import (
    CONTEXT_BUFFER_BYTES,
    MIN_CONTINUATION_TOKENS,
    PrefillSplit,
    Subset,
    computed_tokens_cpu,
    context_bytes_per_token,
    flash_attention,
    split_batch,
)
from int8kv_shim.kernel_warmup import warm_up_layers
from int8kv_shim.static.recorder import active_recorder

# vLLM's logger tree (a child of "vllm"): a logger named after this module has no handler, and
# its INFO lines would vanish
logger = get_logger()
# what Int8KVAttentionMetadataBuilder._log_route has logged in this process
_routes_logged: set[str] = set()

# Split-KV scratch is sized for this many decode tokens; larger decode batches fill the GPU
# without splitting, and the kernels then use fewer splits (never an allocation, never wrong).
_WORKSPACE_TOKENS = 256


def missing_kernels(kv_cache_dtype: str) -> str | None:
    """Why ``kv_cache_dtype`` cannot run in this release; None when its kernels exist.

    A dtype without kernels is still registered (so vLLM accepts the name) and refused at
    start-up with this message instead of failing inside a kernel.
    """
    if kv_cache_dtype in KERNEL_DTYPES:
        return None
    return f"--kv-cache-dtype {kv_cache_dtype} is registered but has no kernels in this release"


@dataclass
class Rows:
    """Some consecutive sequences of a batch: views of its per-sequence tensors (the tail slot
    and sink rows None where the dtype has none)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_of_seq: torch.Tensor | None = None
    sink_of_seq: torch.Tensor | None = None


@dataclass
class Int8KVAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    num_splits: int
    workspace: AttentionWorkspace
    num_reqs: int = 0
    # Set when the batch mixes decodes with longer queries: the model runner puts the decodes
    # first (reorder_batch_threshold = 1), and they run as their own launch on the decode
    # configuration (split-KV, small tiles) instead of the prefill one the longest query picks.
    num_decodes: int = 0
    num_decode_tokens: int = 0
    # With num_decodes: the rows of the leading decodes and of the sequences after them (their
    # query_start_loc counted from their first token), sliced here once a step rather than by
    # every layer's forward
    decode_rows: Rows | None = None
    prefill_rows: Rows | None = None
    # Prefills (first chunks and long enough continuations) on FlashAttention (flash_prefill.py).
    split: PrefillSplit | None = None
    # Dtypes with a tail pool (int4): row r's tail slot (-1: none) and whether it is new this step,
    # views of the process's persistent buffers (tail_slots.py), in the rows of block_table.
    slot_of_seq: torch.Tensor | None = None
    slot_is_new: torch.Tensor | None = None
    # int4 with sink pages (sink_pages.py): row r's sink to read (-1: none) and to write (-1: none)
    sink_of_seq: torch.Tensor | None = None
    sink_store_of_seq: torch.Tensor | None = None
    # whether a row writes its sink this step (host rows, SinkPages.stores): an eager step
    # without one launches no sink store; a CUDA-graph capture launches it whatever this says
    sink_stores: bool = True


class Int8KVAttentionMetadataBuilder(AttentionMetadataBuilder[Int8KVAttentionMetadata]):
    # Every launch shape of our kernels is correct for any batch with the same token and sequence
    # counts (grids depend on nothing else; lengths are read on the device), so mixed batches can
    # be captured too.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS
    # vLLM's model runner puts the requests with one query token first in every batch, so build()
    # can give them a launch of their own (as vLLM's FlashInfer and MLA backends do).
    reorder_batch_threshold: int | None = 1
    # vLLM's V1 model runner then builds once for all KV-cache groups of one spec (Gemma 3's five
    # groups of sliding-window layers) and gives each the build with its own block table
    # (update_block_table): one build a step per spec, not per group, on every step's host path.
    supports_update_block_table: bool = True

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # vLLM's V1 runner reorders for us every step; on decode-only steps it need not look.
        patch.attach_reorder_hook()
        self.block_size = kv_cache_spec.block_size
        model_config = vllm_config.model_config
        self.num_kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
        num_q_heads = model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.max_model_len = model_config.max_model_len
        self.sliding_window = getattr(kv_cache_spec, "sliding_window", None)
        self.workspace = make_workspace(
            _WORKSPACE_TOKENS, num_q_heads, model_config.get_head_size(), MAX_SPLITS, device
        )
        our_dtype = getattr(kv_cache_spec, "int8kv_dtype", None)
        # The impls (built with the model, before any builder) made the process's slot manager.
        self.slots = _slot_manager() if needs_tail_pool(our_dtype) else None
        if self.slots is not None:
            self.slots.log_pool_once()
        # and, with sink pages on, the sink manager the same layers made
        self.sinks = sink_pages.manager() if self.slots is not None else None
        # Decided once per builder, like the impl's own choice (same cached function).
        self.flash_prefill = flash_attention(model_config.get_head_size()) is not None
        # Continuations need their context dequantized into BF16, within CONTEXT_BUFFER_BYTES
        # per layer call.
        self.max_context_tokens = (
            CONTEXT_BUFFER_BYTES
            // context_bytes_per_token(self.num_kv_heads, model_config.get_head_size())
            if our_dtype in FLASH_CONTEXT_DTYPES
            else 0
        )
        self.min_continuation_tokens = MIN_CONTINUATION_TOKENS
        self.speculative = getattr(vllm_config, "speculative_config", None) is not None
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 4
        )
        if device.type == "cuda":
            # Before vLLM captures CUDA graphs and its JIT monitor starts watching.
            forward_context = vllm_config.compilation_config.static_forward_context
            impls = [getattr(forward_context.get(name), "impl", None) for name in layer_names]
            warm_up_layers(
                [i for i in impls if isinstance(i, Int8KVAttentionImpl)],
                block_size=self.block_size, model_dtype=model_config.dtype, device=device,
            )  # fmt: skip

    def _decode_splits(self, num_seqs: int) -> int:
        # A function of the batch's power-of-two size class and max_model_len only: a CUDA graph
        # captured for N >= n sequences (N <= next_pow2(n), since every power of two is a capture
        # size) and an eager run of n sequences then use the same split count, so the same
        # reduction order and bit-identical output; the real lengths are read on the device.
        return choose_num_splits(
            next_power_of_2(num_seqs), self.num_kv_heads, self.max_model_len, self.num_sms,
            sliding_window=self.sliding_window,
        )  # fmt: skip

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> Int8KVAttentionMetadata:
        m = common_attn_metadata
        # Host-side counts only (query_start_loc_cpu): no device sync.
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(m)
        mixed = num_decodes > 0 and num_prefills > 0
        slot_of_seq = slot_is_new = None
        if self.slots is not None:
            if m.num_reqs > self.slots.num_slots:
                raise tail_slots.TailSlotsExhaustedError(
                    f"int8kv-shim: a batch of {m.num_reqs} rows, but int4's tail pool has "
                    f"{self.slots.num_slots} slots (max_num_seqs)"
                )
            slot_of_seq = self.slots.slot_of_seq[: m.num_reqs]
            slot_is_new = self.slots.slot_is_new[: m.num_reqs]
        sink_of_seq = sink_store_of_seq = None
        if self.sinks is not None:
            sink_of_seq = self.sinks.sink_of_seq[: m.num_reqs]
            sink_store_of_seq = self.sinks.sink_store_of_seq[: m.num_reqs]
        split = None
        if m.max_query_len > 1:
            split, reason = self._prefill_route(
                m, first_seq=num_decodes if mixed else 0, slot_of_seq=slot_of_seq,
                sink_of_seq=sink_of_seq,
            )  # fmt: skip
            self._log_route(split, reason)
        decode_rows = prefill_rows = None
        if mixed:
            nd, n = num_decodes, m.num_reqs
            decode_rows = Rows(
                m.query_start_loc[: nd + 1], m.seq_lens[:nd], m.block_table_tensor[:nd],
                _rows(slot_of_seq, 0, nd), _rows(sink_of_seq, 0, nd),
            )  # fmt: skip
            prefill_rows = Rows(
                m.query_start_loc[nd : n + 1] - num_decode_tokens, m.seq_lens[nd:n],
                m.block_table_tensor[nd:n], _rows(slot_of_seq, nd, n), _rows(sink_of_seq, nd, n),
            )  # fmt: skip
        return Int8KVAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc,
            max_seq_len=m.max_seq_len,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            block_size=self.block_size,
            num_splits=self._decode_splits(num_decodes if mixed else m.num_reqs),
            workspace=self.workspace,
            num_reqs=m.num_reqs,
            num_decodes=num_decodes if mixed else 0,
            num_decode_tokens=num_decode_tokens if mixed else 0,
            decode_rows=decode_rows,
            prefill_rows=prefill_rows,
            split=split,
            slot_of_seq=slot_of_seq,
            slot_is_new=slot_is_new,
            sink_of_seq=sink_of_seq,
            sink_store_of_seq=sink_store_of_seq,
            sink_stores=self.sinks is not None and self.sinks.stores,
        )

    def update_block_table(
        self,
        metadata: Int8KVAttentionMetadata,
        blk_table: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> Int8KVAttentionMetadata:
        """``metadata`` (built for another KV-cache group of the same spec, same batch) with this
        group's block table and slot mapping: what ``build`` would give, without its host work.
        Everything else depends on the batch and the spec only (the window, the split count),
        and the workspace is scratch that each layer call uses and leaves."""
        new = copy.copy(metadata)
        new.block_table, new.slot_mapping = blk_table, slot_mapping
        if metadata.decode_rows is not None and metadata.prefill_rows is not None:
            nd, n = metadata.num_decodes, metadata.num_reqs
            new.decode_rows = dataclasses.replace(metadata.decode_rows, block_table=blk_table[:nd])
            new.prefill_rows = dataclasses.replace(
                metadata.prefill_rows, block_table=blk_table[nd:n]
            )
        if metadata.split is not None:
            new.split = metadata.split.with_block_table(blk_table)
        return new

    def _prefill_route(
        self,
        m: CommonAttentionMetadata,
        first_seq: int,
        slot_of_seq: torch.Tensor | None = None,
        sink_of_seq: torch.Tensor | None = None,
    ) -> tuple[PrefillSplit | None, str | None]:
        """The FlashAttention-2 split of a batch with prefills, or None and why, in words (for
        the log)."""
        if not self.flash_prefill:
            return None, "our kernels (FlashAttention-2 is off or unavailable here, see above)"
        if not flash_prefill.enabled():
            return None, "our kernels (FlashAttention-2 failed earlier in this process)"
        computed, exact = computed_tokens_cpu(
            m.query_start_loc_cpu, m.num_reqs, m._num_computed_tokens_cpu,
            m.seq_lens_cpu_upper_bound,
        )  # fmt: skip
        if computed is None:
            return None, "our kernels (vLLM passed no CPU counts of cached tokens)"
        split = split_batch(
            m.query_start_loc_cpu,
            computed,
            m.num_reqs,
            m.seq_lens,
            m.block_table_tensor,
            # An upper bound under speculative decoding (see computed_tokens_cpu): a count of 0 is
            # still exact, a larger one may not be, so continuations then stay on our kernels.
            self.max_context_tokens if exact or not self.speculative else 0,
            self.min_continuation_tokens,
            first_seq=first_seq,
            slot_of_seq=slot_of_seq,
            sink_of_seq=sink_of_seq,
        )
        if split is None:
            return None, "our kernels (no sequence qualifies for FlashAttention-2)"
        return split, None

    def _log_route(self, split: PrefillSplit | None, reason: str | None) -> None:
        # Once per process each: the route of the first step with prefills, of the first that used
        # FlashAttention-2 and of the first that gathered cached context for it, when those came
        # later. Which path ran decides speed and rounding, and nothing else shows it. The message
        # is built only when it is logged (every step with prefills passes here).
        kinds = {"any"}
        if split is not None:
            kinds |= {"flash", "gather"} if split.flash.context_tokens else {"flash"}
        new = kinds - _routes_logged
        if not new:
            return
        if split is not None:
            rest = sum(subset.seq_lens.shape[0] for subset in split.our_kernels())
            reason = (
                f"{split.flash.seq_lens.shape[0]} sequence(s) on FlashAttention-2 "
                f"({split.flash.context_tokens} context tokens gathered), {rest} on our kernels"
            )
        which = (
            "first" if "any" in new
            else "first FlashAttention-2" if "flash" in new
            else "first context-gathering"
        )  # fmt: skip
        logger.info("int8kv-shim: %s step with prefills: %s", which, reason)
        _routes_logged.update(kinds)

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> Int8KVAttentionMetadata:
        metadata = self.build(0, common_attn_metadata)
        # Capturing with max_model_len-long sequences only makes capture slow (as in triton_attn).
        metadata.seq_lens.fill_(1)
        # A graph replays whatever it captured for any later batch: one launch of our kernels for
        # every sequence (correct for any batch).
        metadata.split = None
        metadata.num_decodes = metadata.num_decode_tokens = 0
        metadata.decode_rows = metadata.prefill_rows = None
        metadata.num_splits = self._decode_splits(common_attn_metadata.num_reqs)
        # and the sink store, which writes only the rows a later batch gives a sink to store
        metadata.sink_stores = True
        return metadata


class Int8KVAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **unsupported: object,
    ) -> None:
        refuse = _refusal(kv_cache_dtype, head_size, alibi_slopes, attn_type, sinks, unsupported)
        if refuse:
            raise ValueError(f"int8kv-shim: {refuse}")
        if not direct_launch_enabled():
            set_direct_launches(False)
            logger.info_once(
                "int8kv-shim: %s=0: kernels launch through Triton's kernel[grid]",
                INT8KV_DIRECT_LAUNCH,
            )
        if kv_cache_dtype in EXPERIMENTAL_DTYPES:
            logger.warning_once(
                "int8kv-shim: --kv-cache-dtype %s is experimental: its kernels match their torch "
                "reference, but its decode misses its speed target and not every end-to-end "
                "test has run on a GPU with its defaults (README, Limitations)",
                kv_cache_dtype,
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        # a page's bytes per token, which gives do_kv_cache_update the block size (once, not per
        # call: the catalogue lookup is on every layer's eager path)
        self._page_bytes_per_token = num_kv_heads * get_dtype(kv_cache_dtype).bytes_per_token_head(
            head_size
        )
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        # Static scales (int8_static): set by set_static_scales() after weight loading (patch P8).
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.v_format = "int8"
        # The scale keyword arguments of every kernel call; None until int8_static has its scales.
        self._scale_kwargs: dict[str, Any] | None = (
            None if kv_cache_dtype == STATIC_DTYPE else {"k_scale": None, "v_scale": None}
        )
        # Set only under `int8kv calibrate` (INT8KV_CALIBRATE): records K/V as they enter the cache.
        self._recorder = active_recorder()
        # FlashAttention for prefills over their BF16 K/V (and dequantized context); None: our
        # kernels for every token. A layer that reads another layer's cache has no K/V of its own.
        self._flash_attention = (
            flash_attention(head_size) if kv_sharing_target_layer_name is None else None
        )
        # int4: this layer's tail pool (tail_slots.py), allocated here, while vLLM loads the
        # model, so its memory profiling counts it as non-KV memory and the KV capacity it
        # reports is what is left. A layer reading another layer's cache reads that layer's tail
        # (looked up at its first forward) and has none of its own.
        self.uses_tail = needs_tail_pool(kv_cache_dtype)
        self.tail: torch.Tensor | None = None
        self.tail_page: torch.Tensor | None = None
        self.sink: torch.Tensor | None = None  # int4's sink pages (INT8KV_INT4_SINK_PAGE)
        if self.uses_tail and kv_sharing_target_layer_name is None:
            self.tail, self.tail_page, self.sink = _allocate_tail(
                kv_cache_dtype, num_kv_heads, head_size
            )

    @property
    def flash_prefill(self) -> bool:
        """Whether this layer's prefills run on FlashAttention-2 (with gathered context)."""
        return self._flash_attention is not None

    def set_static_scales(
        self, k_scale: torch.Tensor, v_scale: torch.Tensor, v_format: str, source: str = ""
    ) -> None:
        """fp32 scales [num_kv_heads, head_size] of this rank's heads, one per (kv-head, channel),
        and V's storage format (``int8_static``)."""
        where = f" (from {source})" if source else ""
        if self.kv_cache_dtype != STATIC_DTYPE:
            raise ValueError(
                f"int8kv-shim: static scales{where} given to a {self.kv_cache_dtype} layer"
            )
        if v_format not in V_FORMATS:
            raise ValueError(f"int8kv-shim: v_format {v_format!r}{where} is not one of {V_FORMATS}")
        expected = (self.num_kv_heads, self.head_size)
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if tuple(scale.shape) != expected or scale.dtype != torch.float32:
                raise ValueError(
                    f"int8kv-shim: {name}{where} must be fp32 {list(expected)}, "
                    f"not {scale.dtype} {list(scale.shape)}"
                )
        self.k_scale, self.v_scale, self.v_format = k_scale, v_scale, v_format
        self._scale_kwargs = {"k_scale": k_scale, "v_scale": v_scale, "v_format": v_format}

    def _kernel_scales(self) -> dict[str, Any]:
        kwargs = self._scale_kwargs
        if kwargs is None:
            raise RuntimeError(
                "int8kv-shim: this int8_static layer has no scales: the calibration file is loaded "
                "right after vLLM's Attention.process_weights_after_loading, which did not run "
                "for it"
            )
        return kwargs

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Int8KVAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("int8kv-shim: fused output quantization is not supported")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        md = attn_metadata
        n = md.num_actual_tokens
        if self.uses_tail and key is not None and self.kv_sharing_target_layer_name is None:
            # Before any attention of this step, FlashAttention's first chunks included: the
            # write needs the step's metadata (do_kv_cache_update gets only the slot mapping).
            self._write_with_tail(key, value, kv_cache, md)
            if (
                md.sink_store_of_seq is not None
                and self.sink is not None
                # a graph captured now replays for later batches, whose rows may write theirs
                and (md.sink_stores or _capturing(key))
            ):
                write_sink_int4(key, value, self.sink, md.sink_store_of_seq,
                                query_start_loc=md.query_start_loc, seq_lens=md.seq_lens,
                                num_seqs=md.num_reqs)  # fmt: skip
        lo = 0  # first token after the decodes that run as their own launch
        qsl, seq_lens, block_table = md.query_start_loc, md.seq_lens, md.block_table
        slots, sinks = md.slot_of_seq, md.sink_of_seq
        if md.decode_rows is not None and md.prefill_rows is not None:
            lo, d, r = md.num_decode_tokens, md.decode_rows, md.prefill_rows
            self._paged(query[:lo], kv_cache, output[:lo], md, d.query_start_loc, d.seq_lens,
                        d.block_table, 1, d.slot_of_seq, d.sink_of_seq)  # fmt: skip
            qsl, seq_lens, block_table = r.query_start_loc, r.seq_lens, r.block_table
            slots, sinks = r.slot_of_seq, r.sink_of_seq
        split = md.split if self._flash_attention is not None and key is not None else None
        if split is not None:
            try:
                return self._forward_split(query, key, value, kv_cache, md, split, output)
            except flash_prefill.FlashAttentionFailed as e:
                # Raised before `output` was written (argument checks; the context gather may
                # have run, into its own buffer): our kernels redo those rows.
                flash_prefill.disable(e.__cause__ or e)
                self._flash_attention = None
        self._paged(query[lo:n], kv_cache, output[lo:n], md, qsl, seq_lens, block_table,
                    md.max_query_len, slots, sinks)  # fmt: skip
        return output

    def _write_with_tail(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        md: Int8KVAttentionMetadata,
    ) -> None:
        """The step's new K/V into the int4 pages and this layer's tail (the kernels' contract:
        a page that fills is quantized from its tail rows and the new tokens; the last page goes
        to the tail in the model's dtype, a full one too until the next token starts a page)."""
        write_kv_cache(
            key,
            value,
            kv_cache,
            md.slot_mapping,  # not used by int4: rows are placed by block table and lengths
            kv_dtype=self.kv_cache_dtype,
            block_size=md.block_size,
            tail=self.tail,
            tail_page=self.tail_page,
            query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens,
            block_table=md.block_table,
            slot_of_seq=md.slot_of_seq,
            slot_is_new=md.slot_is_new,
            num_seqs=md.num_reqs,
            max_query_len=md.max_query_len,
        )

    def _forward_split(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        md: Int8KVAttentionMetadata,
        split: PrefillSplit,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Flash sequences on FlashAttention-2 (with their dequantized context), the rest on ours."""

        def gather(k: torch.Tensor, v: torch.Tensor, s: Subset) -> tuple[torch.Tensor, ...]:
            return gather_kv_context(
                kv_cache, k, v, kv_dtype=self.kv_cache_dtype, block_size=md.block_size,
                block_table=s.block_table, cu_seqlens_q=s.query_start_loc,
                cu_seqlens_k=s.key_start_loc, max_seqlen_k=s.max_key_len,
                num_k_tokens=s.num_key_tokens, **self._kernel_scales(),
                **self._pool_args(s.slot_of_seq, s.sink_of_seq),
            )  # fmt: skip

        def paged(q: torch.Tensor, out: torch.Tensor, s: Subset) -> None:
            self._paged(q, kv_cache, out, md, s.query_start_loc, s.seq_lens, s.block_table,
                        s.max_query_len, s.slot_of_seq, s.sink_of_seq)  # fmt: skip

        return flash_prefill.forward_split(
            query, key, value, output, split, flash_attention=self._flash_attention,
            gather_context=gather, paged=paged, softmax_scale=self.scale,
            sliding_window=self.sliding_window, soft_cap=self.logits_soft_cap,
        )  # fmt: skip

    def _paged(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
        md: Int8KVAttentionMetadata,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        max_query_len: int,
        slot_of_seq: torch.Tensor | None = None,
        sink_of_seq: torch.Tensor | None = None,
    ) -> None:
        """Our kernels over the quantized pages, for the sequences these tensors describe
        (``slot_of_seq``: their tail slots, for dtypes with a tail pool; ``sink_of_seq``: their
        sink pages, for int4 with sink pages)."""
        paged_attention(
            query,
            kv_cache,
            output,
            kv_dtype=self.kv_cache_dtype,
            block_size=md.block_size,
            num_kv_heads=self.num_kv_heads,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            max_query_len=max_query_len,
            max_seq_len=md.max_seq_len,
            softmax_scale=self.scale,
            sliding_window=self.sliding_window,
            soft_cap=self.logits_soft_cap,
            workspace=md.workspace,
            num_splits=md.num_splits,
            **self._pool_args(slot_of_seq, sink_of_seq),
            **self._kernel_scales(),
        )

    def _pool_args(
        self, slot_of_seq: torch.Tensor | None, sink_of_seq: torch.Tensor | None
    ) -> dict[str, Any]:
        """The tail pool and sink pages of dtypes that have them (int4), for the sequences
        whose tail slots and sink rows these are: the keywords of our attention and gather."""
        if not self.uses_tail:
            return {}
        pools = {"tail": self._attention_tail(), "tail_page": self.tail_page,
                 "slot_of_seq": slot_of_seq}  # fmt: skip
        if sink_of_seq is not None:
            pools.update(sink=self._attention_sink(), sink_of_seq=sink_of_seq)
        return pools

    def _attention_sink(self) -> torch.Tensor:
        """This layer's sink pool, or, for a layer reading another layer's cache, that layer's."""
        if self.sink is None:
            from vllm.forward_context import get_forward_context

            layers = get_forward_context().no_compile_layers
            self.sink = layers[self.kv_sharing_target_layer_name].impl.sink
        return self.sink

    def _attention_tail(self) -> torch.Tensor:
        """This layer's tail pool, or, for a layer reading another layer's cache, that layer's
        (with its ``tail_page``, which says which block each slot holds)."""
        if self.tail is None:
            from vllm.forward_context import get_forward_context

            layers = get_forward_context().no_compile_layers
            target = layers[self.kv_sharing_target_layer_name].impl
            self.tail, self.tail_page = target.tail, target.tail_page
        return self.tail

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.uses_tail:
            return  # written in forward(), which has the step's metadata (_write_with_tail)
        if self._recorder is not None and self._recorder.armed:
            self._recorder.record(layer.layer_name, key, value, slot_mapping)
        write_kv_cache(
            key,
            value,
            kv_cache,
            slot_mapping,
            kv_dtype=self.kv_cache_dtype,
            # the page holds block_size tokens' whole state, so its byte count gives block_size
            block_size=kv_cache.shape[1] // self._page_bytes_per_token,
            **self._kernel_scales(),
        )

    def fused_output_quant_supported(self, quant_key: object) -> bool:
        return False

    def fused_rope_kvcache_supported(self) -> bool:
        return False


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s launches are being captured into a CUDA graph (vLLM's capture, or any
    other) rather than run."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _rows(x: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    return None if x is None else x[start:end]


def _slot_manager() -> tail_slots.TailSlots:
    slots = tail_slots.manager()
    if slots is None:
        raise RuntimeError(
            "int8kv-shim: an int4 metadata builder was built before any int4 attention layer "
            "(the layers make the tail pool's slot manager)"
        )
    return slots


def _allocate_tail(
    kv_cache_dtype: str, num_kv_heads: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One layer's (tail, tail_page, sink), sized from the vLLM config being built: the tail holds
    ``INT8KV_INT4_TAIL_PAGES`` pages a slot ([slots, 2, kv-heads, 64 x pages, head size], and
    ``tail_page`` [slots] for one page, [slots, 2] for two: the block each half holds); ``sink``,
    a page per slot, unless ``INT8KV_INT4_SINK_PAGE`` is off (then None)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None:
        raise ValueError(
            f"int8kv-shim: --kv-cache-dtype {kv_cache_dtype} sizes its tail pool from vLLM's "
            "config (max_num_seqs, the model's dtype), and none is current: build the layer "
            "inside vLLM's model loading (or under set_current_vllm_config)"
        )
    num_slots = config.scheduler_config.max_num_seqs
    dtype = config.model_config.dtype
    device = torch.device(config.device_config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    slots = tail_slots.install(num_slots, device)
    tokens = page_tokens(kv_cache_dtype)
    assert tokens is not None, kv_cache_dtype
    shape, held = tail_pool_shapes(num_slots, num_kv_heads, head_size, int4_tail_pages(), tokens)
    tail = torch.zeros(shape, dtype=dtype, device=device)
    tail_page = torch.full(held, -1, dtype=torch.int32, device=device)
    sink = None
    if int4_sink_page_enabled():
        sink_pages.install(num_slots, num_slots, device)
        sink = torch.zeros(
            num_slots, 2, num_kv_heads, tokens, head_size, dtype=dtype, device=device
        )
    cache_bytes_per_token = num_kv_heads * get_dtype(kv_cache_dtype).bytes_per_token_head(head_size)
    pool_bytes = sum(x.numel() * x.element_size() for x in (tail, sink) if x is not None)
    slots.count_pool(pool_bytes + tail_page.numel() * 4, cache_bytes_per_token)
    return tail, tail_page, sink


def _refusal(
    kv_cache_dtype: str,
    head_size: int,
    alibi_slopes: object,
    attn_type: str,
    sinks: object,
    unsupported: dict[str, object],
) -> str | None:
    """Why a layer cannot run on our kernels, in one line; None when it can."""
    dtype = get_dtype(kv_cache_dtype)
    if missing := missing_kernels(kv_cache_dtype):
        return missing
    if head_size not in dtype.head_sizes:
        return (
            f"head size {head_size} is not supported by --kv-cache-dtype {kv_cache_dtype} "
            f"(supported: {', '.join(map(str, dtype.head_sizes))})"
        )
    if attn_type != AttentionType.DECODER:
        return f"{attn_type} attention is not supported (decoder self-attention only)"
    if alibi_slopes is not None:
        return "ALiBi attention is not supported"
    if sinks is not None:
        return "attention sinks are not supported"
    extra = [k for k, v in unsupported.items() if v not in (None, False, -1)]
    if extra:
        return f"unsupported attention options: {', '.join(sorted(extra))}"
    return None
