"""What a tail pool takes of the KV memory: a default ``max_num_seqs`` that keeps it small, and one
line at start-up once vLLM has sized the cache.

``int4`` keeps every running sequence's newest page in the model's dtype, ``max_num_seqs`` slots
in every layer (``int8kv_shim/tail_slots.py``), allocated with the model, so vLLM sizes the cache
from the memory the pool left. Beside tens of GiB of KV memory the pool is a rounding error; beside
a few GiB (an 8B model on a 24 GB card at vLLM's default of 256 sequences) it takes much of what the
4-bit pages save, and a user who reads only "3.6x" would never know. So:

* before the engine is built (patch P10), when the user gave no ``--max-num-seqs``,
  :func:`capped_max_num_seqs` lowers vLLM's default to the largest power of two whose pool fits
  ``GOAL_SHARE`` of the KV memory (``--kv-cache-memory-bytes`` when given, else estimated as GPU
  memory x ``--gpu-memory-utilization`` minus the rank's share of the weight files: activations
  are not known yet, so the estimate is high and the cap errs towards more sequences), never below
  ``MIN_CAPPED_SEQS``, and never below the number of ``max_model_len``-token sequences the cache
  holds beside their slots, sliding-window layers holding only their window: fewer slots than that
  would leave cache memory that no running sequence can fill (at 8K on SmolLM2, 256 slots used a
  third of an ``int4`` cache), rounded up to a size vLLM captures CUDA graphs for
  (:func:`graph_batch_size`); a warning says so;
* once the engine core has sized the cache (patch P13), :func:`report` logs the cache's bytes and
  the pool's, the tokens per byte against a BF16 cache of the same memory, and, when the pool takes
  more than ``WARN_SHARE`` of it, the ``--max-num-seqs`` that would bring it within ``GOAL_SHARE``.

Arithmetic on vLLM's specs, configs and engine arguments (duck-typed): never imports vLLM or torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from int8kv_shim._logging import get_logger
from int8kv_shim.catalogue_loader import load_catalogue, needs_tail_pool

logger = get_logger()

# Above this share of the KV memory (cache and pool together) the line is a warning ...
WARN_SHARE = 0.10
# ... that names the --max-num-seqs bringing the pool within this one, which is also what the
# default max_num_seqs aims at: at head size 128 int4 holds 3.66x BF16's tokens per byte, 3.51x
# with 4% of the memory in the pool.
GOAL_SHARE = 0.04
# The default max_num_seqs is never capped below this.
MIN_CAPPED_SEQS = 8
GIB = 2**30


def pages_per_slot() -> int:
    """BF16 pages a tail slot costs each layer: its tail pages (``INT8KV_INT4_TAIL_PAGES``: 1, or 2
    with the page before the newest), and a sink page when they are on (``INT8KV_INT4_SINK_PAGE``:
    one sink per slot)."""
    from int8kv_shim.environment_variables import int4_sink_page_enabled, int4_tail_pages

    return int4_tail_pages() + (1 if int4_sink_page_enabled() else 0)


@dataclass(frozen=True)
class TailPoolCost:
    """One worker's tail pool against its KV cache (bytes; per-token sums over the pool's layers)."""

    dtype: str
    slots: int
    layers: int
    slot_bytes: int  # one slot in every layer
    cache_bytes: int  # the KV cache vLLM allocated
    cache_bytes_per_token: int  # what a token costs this dtype's pages, every layer
    bf16_bytes_per_token: int  # and a BF16 cache's

    @property
    def pool_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def kv_memory(self) -> int:
        """The memory a BF16 cache would have had: the cache's and the pool's."""
        return self.cache_bytes + self.pool_bytes

    def share(self, slots: int | None = None) -> float:
        """The pool's share of the KV memory with ``slots`` slots (default: as allocated)."""
        slots = self.slots if slots is None else slots
        return slots * self.slot_bytes / max(self.kv_memory, 1)

    def vs_bf16(self, slots: int | None = None) -> float:
        """This dtype's tokens over a BF16 cache's in the same KV memory, ``slots`` slots out."""
        slots = self.slots if slots is None else slots
        tokens = max(self.kv_memory - slots * self.slot_bytes, 0) / self.cache_bytes_per_token
        return tokens / (self.kv_memory / self.bf16_bytes_per_token)

    def slots_for_share(self, share: float = GOAL_SHARE) -> int:
        """The largest power of two up to ``slots`` whose pool is at most ``share`` of the KV
        memory (1 when even one slot is more)."""
        best = 1
        while best * 2 <= self.slots and self.share(best * 2) <= share:
            best *= 2
        return best


def tail_pool_cost(
    specs: Mapping[str, Any], max_num_seqs: int, elem_bytes: int, cache_bytes: int
) -> TailPoolCost | None:
    """The pool of the layers in ``specs`` (layer name -> vLLM KV-cache spec) whose dtype has a
    tail, or None when none has: ``max_num_seqs`` slots of ``elem_bytes`` elements."""
    ours = [s for s in specs.values() if needs_tail_pool(getattr(s, "int8kv_dtype", None))]
    if not ours:
        return None
    names = {s.int8kv_dtype for s in ours}
    if len(names) != 1:
        raise ValueError(f"int8kv-shim: tail pools of several dtypes {sorted(names)}")
    entry = load_catalogue().get_dtype(names.pop())
    return TailPoolCost(
        dtype=entry.name,
        slots=max_num_seqs,
        layers=len(ours),
        slot_bytes=pages_per_slot() * sum(entry.tail_slot_bytes(s.num_kv_heads, s.head_size, elem_bytes) for s in ours),
        cache_bytes=cache_bytes,
        cache_bytes_per_token=sum(s.num_kv_heads * entry.bytes_per_token_head(s.head_size) for s in ours),
        bf16_bytes_per_token=sum(s.num_kv_heads * 2 * 2 * s.head_size for s in ours),
    )  # fmt: skip


def message(cost: TailPoolCost) -> str:
    """The start-up line for ``cost``; its advice when the pool's share is above ``WARN_SHARE``."""
    line = (
        f"int8kv-shim: {cost.dtype}'s tail pool ({cost.slots} slots = max_num_seqs, x "
        f"{cost.layers} layers) takes {cost.pool_bytes / GIB:.2f} GiB of "
        f"{cost.kv_memory / GIB:.2f} GiB of KV memory ({cost.share():.0%}): the cache holds "
        f"{cost.vs_bf16():.2f}x the tokens BF16 would in that memory, "
        f"{cost.vs_bf16(0):.2f}x without the pool"
    )
    if cost.share() <= WARN_SHARE:
        return line
    better = cost.slots_for_share()
    return (
        f"{line}. --max-num-seqs {better} would give it {cost.share(better):.0%} "
        f"({cost.vs_bf16(better):.2f}x), if that many concurrent sequences are enough"
    )


def report(
    vllm_config: Any, kv_cache_specs: Sequence[Mapping[str, Any]], kv_cache_configs: Sequence[Any]
) -> TailPoolCost | None:
    """Log what the first worker's tail pool costs beside its cache (every worker of a run has the
    same layers and slots); None, and nothing logged, without a tail pool."""
    if not kv_cache_specs or not kv_cache_configs:
        return None
    cost = tail_pool_cost(
        kv_cache_specs[0],
        vllm_config.scheduler_config.max_num_seqs,
        vllm_config.model_config.dtype.itemsize,
        sum(t.size for t in kv_cache_configs[0].kv_cache_tensors),
    )
    if cost is not None:
        log = logger.warning if cost.share() > WARN_SHARE else logger.info
        log(message(cost))
    return cost


@dataclass(frozen=True)
class SlidingWindow:
    """A model's sliding-window attention: ``layers`` of a worker's layers keep only the newest
    ``tokens`` tokens in the cache."""

    layers: int
    tokens: int


def sliding_window(model_config: Any, layers: int) -> SlidingWindow | None:
    """The sliding window of ``layers`` layers of ``model_config`` (vLLM's ``ModelConfig``) from its
    Hugging Face config: every layer when it has no ``layer_types`` (Mistral's form), else the
    share of ``"sliding_attention"`` ones (Gemma 3's five in six); None without one."""
    tokens = model_config.get_sliding_window()
    if not tokens:
        return None
    layer_types = getattr(model_config.hf_text_config, "layer_types", None)
    if layer_types is None:
        return SlidingWindow(layers, tokens)
    sliding = sum(t == "sliding_attention" for t in layer_types)
    if not sliding:
        return None
    return SlidingWindow(round(layers * sliding / len(layer_types)), tokens)


def slot_bytes(
    kv_dtype: str,
    layers: int,
    num_kv_heads: int,
    head_size: int,
    elem_bytes: int,
    pages: int | None = None,
) -> int:
    """What one sequence slot costs over ``layers`` layers: its ``pages`` BF16 pages in every
    layer; by default this process's (``pages_per_slot``: its tail pages and, with sink pages on,
    its sink page)."""
    entry = load_catalogue().get_dtype(kv_dtype)
    pages = pages_per_slot() if pages is None else pages
    return pages * layers * entry.tail_slot_bytes(num_kv_heads, head_size, elem_bytes)


@dataclass(frozen=True)
class CapTerms:
    """What decides the default ``max_num_seqs``: a slot's bytes, the slots ``share`` of the KV
    memory holds, and the ``max_model_len``-token sequences the cache holds beside their slots
    (0 without a ``max_model_len``)."""

    slot: int
    fits: int
    full: int

    @property
    def by_share(self) -> int:
        """The largest power of two up to ``fits`` slots, never below ``MIN_CAPPED_SEQS``."""
        return max(MIN_CAPPED_SEQS, 1 << (self.fits.bit_length() - 1) if self.fits > 0 else 0)

    def cap(self, capture_sizes: Sequence[int] | None = None) -> int:
        """The larger of the two, rounded up to a CUDA-graph batch size (:func:`graph_batch_size`,
        ``capture_sizes`` the user's)."""
        return graph_batch_size(max(self.by_share, self.full), capture_sizes)


def cap_terms(
    kv_dtype: str,
    kv_memory: float,
    layers: int,
    num_kv_heads: int,
    head_size: int,
    elem_bytes: int,
    share: float = GOAL_SHARE,
    pages: int | None = None,
    max_model_len: int | None = None,
    window: SlidingWindow | None = None,
) -> CapTerms | None:
    """The :class:`CapTerms` of ``kv_memory`` bytes (``window``'s layers holding only their
    window); None for a dtype without a tail pool or no memory. A slot holds ``pages`` BF16 pages
    a layer, by default this process's (``pages_per_slot``)."""
    entry = load_catalogue().get_dtype(kv_dtype)
    if not entry.tail or kv_memory <= 0:
        return None
    slot = slot_bytes(kv_dtype, layers, num_kv_heads, head_size, elem_bytes, pages)
    full = (
        full_length_seqs(kv_dtype, kv_memory, layers, num_kv_heads, head_size, max_model_len,
                         slot, window)
        if max_model_len else 0
    )  # fmt: skip
    return CapTerms(slot, int(share * kv_memory // slot), full)


def capped_max_num_seqs(
    kv_dtype: str,
    vllm_default: int,
    kv_memory_estimate: float,
    layers: int,
    num_kv_heads: int,
    head_size: int,
    elem_bytes: int,
    share: float = GOAL_SHARE,
    pages: int | None = None,
    max_model_len: int | None = None,
    window: SlidingWindow | None = None,
    capture_sizes: Sequence[int] | None = None,
) -> int | None:
    """The largest power of two (at least ``MIN_CAPPED_SEQS``) whose tail pool of ``layers``
    layers fits ``share`` of ``kv_memory_estimate`` bytes, or, when more, the number of
    ``max_model_len``-token sequences the cache holds beside their slots
    (:func:`full_length_seqs`, ``window``'s layers holding only their window), rounded up to a
    CUDA-graph batch size (:func:`graph_batch_size`, ``capture_sizes`` the user's), when it is
    below ``vllm_default``; None to keep vLLM's default (no tail, or the default already fits). A
    slot holds ``pages`` BF16 pages a layer, by default this process's (``pages_per_slot``)."""
    terms = cap_terms(kv_dtype, kv_memory_estimate, layers, num_kv_heads, head_size, elem_bytes,
                      share, pages, max_model_len, window)  # fmt: skip
    if terms is None:
        return None
    cap = terms.cap(capture_sizes)
    return cap if cap < vllm_default else None


def graph_batch_size(seqs: int, capture_sizes: Sequence[int] | None = None) -> int:
    """The smallest batch size at or above ``seqs`` that vLLM 0.24 captures CUDA graphs for: of
    ``capture_sizes`` when the user gave them (``seqs`` itself when none is as large), else of
    its default sizes (``VllmConfig._set_cudagraph_sizes``: 1, 2, 4, multiples of 8 below 256,
    then of 16, up to ``--max-cudagraph-capture-size``, 512 unless given).

    vLLM captures a FULL decode graph, in its default cudagraph mode, only for sizes up to
    ``max_num_seqs`` and pads a decode batch up to the next size, so with ``max_num_seqs`` between
    two sizes its fullest decode steps have no FULL graph and run piecewise, attention outside the
    graph: with 125 sequences of Gemma 3 at 8K, 572 of 835 decode steps did
    (``throughput_int4_gemma3_steps.json``)."""
    if capture_sizes:
        return min((s for s in capture_sizes if s >= seqs), default=seqs)
    if seqs <= 4:
        return 1 << max(0, seqs - 1).bit_length()
    step = 8 if seqs <= 256 else 16
    return -(-seqs // step) * step


def user_capture_sizes(engine_args: Any) -> list[int] | None:
    """The CUDA-graph capture sizes the user gave (``--cudagraph-capture-sizes``, or the
    compilation config's), None when vLLM picks them."""
    sizes = getattr(engine_args, "cudagraph_capture_sizes", None)
    config = getattr(engine_args, "compilation_config", None)
    if sizes is None and config is not None:
        get = config.get if isinstance(config, dict) else partial(getattr, config)
        sizes = get("cudagraph_capture_sizes", None)
    return list(sizes) if sizes else None


def full_length_seqs(
    kv_dtype: str,
    kv_memory: float,
    layers: int,
    num_kv_heads: int,
    head_size: int,
    max_model_len: int,
    slot: int,
    window: SlidingWindow | None = None,
) -> int:
    """How many sequences of ``max_model_len`` tokens ``kv_memory`` bytes hold, each with its
    ``slot`` bytes of tail pool: more slots than this only serve shorter sequences, fewer leave
    cache memory that no running sequence fills. ``window``'s layers hold only the newest
    ``window.tokens`` tokens of a sequence (vLLM's hybrid KV-cache manager frees the blocks behind
    a sliding window)."""
    entry = load_catalogue().get_dtype(kv_dtype)
    token_layer = num_kv_heads * entry.bytes_per_token_head(head_size)
    windowed = min(window.layers, layers) if window else 0
    tokens = (layers - windowed) * max_model_len
    if window:
        tokens += windowed * min(window.tokens, max_model_len)
    return int(kv_memory // (tokens * token_layer + slot))


def weight_bytes(model: str, revision: str | None = None) -> int | None:
    """Bytes of a model's weight files (safetensors, else PyTorch bins; the index's files when
    there is one), from its folder or its Hugging Face cache snapshot; None when not found."""
    folder = Path(model)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(
                snapshot_download(model, revision=revision, local_files_only=True,
                                  allow_patterns=["*.safetensors", "*.bin", "*.index.json"])
            )  # fmt: skip
        except Exception:  # not downloaded, no hub package: no estimate
            return None
    for pattern, index in (("*.safetensors", "model.safetensors.index.json"),
                           ("*.bin", "pytorch_model.bin.index.json")):  # fmt: skip
        if (folder / index).is_file():
            names = set(json.loads((folder / index).read_text())["weight_map"].values())
            files = [folder / name for name in names]
        else:
            files = sorted(folder.glob(pattern))
        sizes = [f.stat().st_size for f in files if f.is_file()]
        if sizes:
            return sum(sizes)
    return None


def kv_memory_of(
    engine_args: Any, model_config: Any, total_gpu_bytes: int | None, vllm_default: int
) -> tuple[float, str] | None:
    """(bytes, where they come from) of one worker's KV memory: ``--kv-cache-memory-bytes`` when
    given, else GPU memory x ``--gpu-memory-utilization`` minus the rank's share of the weight
    files; None when neither the GPU memory nor the weight files are known."""
    given = getattr(engine_args, "kv_cache_memory_bytes", None)
    if given:
        return given, f"{given / GIB:.1f} GiB: --kv-cache-memory-bytes"
    if not total_gpu_bytes:
        return None
    weights = weight_bytes(model_config.model, getattr(model_config, "revision", None))
    if weights is None:  # not downloaded yet: the next start has them
        logger.info(
            "int8kv-shim: no weight files of %s found on this machine, so no estimate of the KV "
            "memory: vLLM's default max_num_seqs %d stays (a line after the cache is sized says "
            "what the tail pool takes)",
            model_config.model,
            vllm_default,
        )
        return None
    ranks = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    kv_memory = engine_args.gpu_memory_utilization * total_gpu_bytes - weights / ranks
    return kv_memory, (
        f"about {kv_memory / GIB:.1f} GiB: GPU memory x --gpu-memory-utilization - weights"
    )


def default_max_num_seqs(
    engine_args: Any, vllm_default: int, total_gpu_bytes: int | None
) -> tuple[int, str] | None:
    """(max_num_seqs, the warning that says why) for ``engine_args`` (vLLM's ``EngineArgs``) when
    its dtype has a tail pool, the user gave no ``--max-num-seqs`` and vLLM's default
    (``vllm_default``) would give the pool more than ``GOAL_SHARE`` of the KV memory; None
    otherwise, or when the KV memory is neither given nor estimable (:func:`kv_memory_of`)."""
    kv_dtype = getattr(engine_args, "kv_cache_dtype", None)
    if getattr(engine_args, "max_num_seqs", None) is not None or not needs_tail_pool(kv_dtype):
        return None
    if not total_gpu_bytes and not getattr(engine_args, "kv_cache_memory_bytes", None):
        return None  # no GPU visible: no estimate, and no model config built for nothing
    model_config = engine_args.create_model_config()
    found = kv_memory_of(engine_args, model_config, total_gpu_bytes, vllm_default)
    if found is None:
        return None
    kv_memory, memory = found
    tp = engine_args.tensor_parallel_size
    pp = engine_args.pipeline_parallel_size
    layers = max(1, model_config.get_total_num_hidden_layers() // pp)
    kv_heads = max(1, model_config.get_total_num_kv_heads() // tp)
    head_size, elem_bytes = model_config.get_head_size(), model_config.dtype.itemsize
    max_model_len = getattr(model_config, "max_model_len", None)
    # without vLLM's hybrid manager a sliding-window layer keeps every token, as a full one does
    hybrid = not getattr(engine_args, "disable_hybrid_kv_cache_manager", False)
    window = sliding_window(model_config, layers) if hybrid else None
    terms = cap_terms(kv_dtype, kv_memory, layers, kv_heads, head_size, elem_bytes,
                      max_model_len=max_model_len, window=window)  # fmt: skip
    if terms is None:
        return None
    cap = terms.cap(user_capture_sizes(engine_args))
    if cap >= vllm_default:
        return None
    slot, fits, full = terms.slot, terms.fits, terms.full
    rounded = (
        f", rounded up to {cap}, a batch size vLLM captures CUDA graphs for"
        if cap != max(full, terms.by_share) else ""
    )  # fmt: skip
    if full > terms.by_share:  # max_model_len's sequences decided
        windowed = (
            f", {window.layers} of its {layers} layers holding their {window.tokens}-token window"
            if window else ""
        )  # fmt: skip
        why = (
            f"as many slots as the cache holds sequences of {max_model_len} tokens "
            f"(max_model_len{windowed}: {full}){rounded}; its tail pool ({slot / 2**20:.1f} MiB a "
            f"sequence) takes about {cap * slot / kv_memory:.0%} of the KV memory ({memory})"
        )
    elif fits < MIN_CAPPED_SEQS:
        why = (
            f"the fewest it sets{rounded}: {GOAL_SHARE:.0%} of the KV memory ({memory}) holds "
            f"{fits} slots of its tail pool ({slot / 2**20:.1f} MiB a sequence)"
        )
    else:
        why = (
            f"so that its tail pool ({slot / 2**20:.1f} MiB a sequence) stays within "
            f"{GOAL_SHARE:.0%} of the KV memory ({memory})"
            + (f": {terms.by_share} slots{rounded}" if rounded else "")
        )
    return cap, (
        f"int8kv-shim: --kv-cache-dtype {kv_dtype}: max_num_seqs {cap} instead of vLLM's default "
        f"{vllm_default}, {why}; give --max-num-seqs to choose"
    )
