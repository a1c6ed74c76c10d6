"""Sink pages: each sequence's first page (keys 0..63) kept in the model's dtype beside its int4 page.

A CPU simulation (``benchmarks/results/kv_quant_sim_varnorm*.json``) cut ``int4``'s KL divergence
from BF16 by 27-33% on two models with the first page unquantized (the attention-sink tokens the
whole sequence attends to), and per-token quantization of that page instead made things worse
(``kv_quant_sim_first_page*.json``): what the page needs is precision. This module decides, per
step and per batch row, which sink each row reads and which it writes; the layers own the pools
(``sink`` [num_sinks, 2, num_kv_heads, 64, head_size] per layer, like the tail pool) and the
kernels read and write them (``int8kv_kernels``: ``paged_attention_int4(sink=, sink_of_seq=)``,
``write_sink_int4``).

**Keyed by content**, not by request or block: the first 64 prompt token ids and the LoRA adapter
(the K and V of positions 0..63 depend on nothing else). So a prefix-cache hit finds the sink of
the request that computed the page, whatever block or KV-cache group holds it, and sequences that
share a first page share its sink. Prompts shorter than a page, prompts given as embeddings and
multimodal prompts get none (their first page is read from the 4-bit cache, as without sinks).

* The first request that computes a page of a content it has no complete sink for **owns** a new
  sink and writes it (``sink_store_of_seq``) as its tokens 0..63 go into the cache; the sink is
  **complete** once that request's computed tokens reach 64 (at the start of a later step).
* Every row whose content has a complete sink, and the owner itself, **read** it
  (``sink_of_seq``); the kernels read it only where the page is a full 4-bit page.
* A finished request's sink stays (a later prompt with the same start, a multi-turn
  conversation's next turn, finds it); when every sink is taken, the least recently used one that
  no running request reads is reused. A request that then finds no sink reads its 4-bit page: less
  precise, never wrong. An owner that ends (finished, preempted) before its page is complete drops
  its partial sink.

Slots = the scheduler's ``max_num_seqs``; the per-step buffers follow ``tail_slots.TailSlots``:
pinned host memory, one non-blocking copy, fixed device addresses (FULL CUDA graphs replay them).

Imports torch (not vLLM): loaded by the attention impl, never at shim import.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from int8kv_shim._logging import get_logger

logger = get_logger()

PAGE_TOKENS = 64

SinkKey = tuple[tuple[int, ...], int]


@dataclass
class _Sink:
    key: SinkKey
    owner: str | None  # the request writing it, until its page is complete
    readers: set[str] = field(default_factory=set)  # running requests with its content


@dataclass
class _Request:
    key: SinkKey | None
    computed: int  # tokens computed before this step
    scheduled: int = 0  # tokens this step computes

    @property
    def page_done(self) -> bool:
        """Whether its first page is in the cache once this step has run."""
        return self.computed + self.scheduled >= PAGE_TOKENS


def sink_key(prompt_token_ids: Sequence[int] | None, lora_id: int = 0,
             has_multimodal: bool = False) -> SinkKey | None:  # fmt: skip
    """What a first page's K and V depend on, or None for prompts that get no sink."""
    if prompt_token_ids is None or has_multimodal or len(prompt_token_ids) < PAGE_TOKENS:
        return None
    return tuple(int(t) for t in prompt_token_ids[:PAGE_TOKENS]), int(lora_id)


class SinkPages:
    """Content -> sink index, and the per-step ``sink_of_seq`` / ``sink_store_of_seq`` buffers in
    the rows of the step's block table (the rows of ``tail_slots.TailSlots``)."""

    def __init__(self, num_sinks: int, num_rows: int, device: torch.device | str) -> None:
        if num_sinks < 1:
            raise ValueError(f"int8kv-shim: the sink pool needs at least one sink, not {num_sinks}")
        device = torch.device(device)
        self.num_sinks = num_sinks
        self.device = device
        self._sinks: list[_Sink | None] = [None] * num_sinks
        self._by_key: dict[SinkKey, int] = {}
        # sinks no running request reads, least recently used first: what a new one may reuse
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._free = list(range(num_sinks - 1, -1, -1))  # popped from the end: 0 first
        self._requests: dict[str, _Request] = {}
        # Row 0 sink_of_seq, row 1 sink_store_of_seq: one tensor, so one copy per step.
        self._rows = torch.full((2, num_rows), -1, dtype=torch.int32, device=device)
        self.sink_of_seq = self._rows[0]
        self.sink_store_of_seq = self._rows[1]
        cuda = device.type == "cuda"
        self._host = torch.full((2, num_rows), -1, dtype=torch.int32, device="cpu",
                                pin_memory=cuda)  # fmt: skip
        self._host_np = self._host.numpy()
        self._copied = torch.cuda.Event() if cuda else None
        # whether a row of the batch last assigned writes its sink: when none does, an eager
        # step launches no sink store (the metadata builder reads this, on the host)
        self.stores = False
        self.full_misses = 0  # requests that found every sink in use (logged once)

    def __repr__(self) -> str:
        held = sum(s is not None for s in self._sinks)
        return f"SinkPages({held}/{self.num_sinks} held, device={self.device})"

    # ---------------------------------------------------------------------------------------
    # requests

    def add(self, req_id: str, key: SinkKey | None, num_computed_tokens: int) -> None:
        """A request scheduled for the first time."""
        self._requests[req_id] = _Request(key, num_computed_tokens)

    def computed(self, req_id: str, num_computed_tokens: int, num_scheduled_tokens: int) -> None:
        """A request's computed tokens at the start of this step and the tokens it computes in
        it (every scheduled request, each step, before ``assign``). The sink it owns is complete
        once its page is in the cache: anyone may read it from then on."""
        req = self._requests.get(req_id)
        if req is None:
            return
        req.computed, req.scheduled = num_computed_tokens, num_scheduled_tokens
        self._complete_if_done(req_id, req, done=req.computed >= PAGE_TOKENS)

    def end(self, req_ids: Iterable[str], finished: bool = True) -> None:
        """Finished (``finished``) or preempted requests: a sink whose page they did not complete
        goes, a complete one stays; a preempted request keeps its content key for its return."""
        for req_id in req_ids:
            req = self._requests.get(req_id)
            if req is None:
                continue
            if finished:
                del self._requests[req_id]
            index = self._by_key.get(req.key) if req.key is not None else None
            if index is None:
                continue
            sink = self._sinks[index]
            assert sink is not None
            self._complete_if_done(req_id, req, done=req.page_done)
            sink.readers.discard(req_id)
            if sink.owner == req_id:
                self._drop(index)
            elif not sink.readers:
                self._idle[index] = None

    def _complete_if_done(self, req_id: str, req: _Request, done: bool) -> None:
        index = self._by_key.get(req.key) if req.key is not None else None
        sink = self._sinks[index] if index is not None else None
        if done and sink is not None and sink.owner == req_id:
            sink.owner = None

    # ---------------------------------------------------------------------------------------
    # the step's rows

    def assign(self, req_ids: Sequence[str]) -> None:
        """Fill the buffers for a batch whose row r is request ``req_ids[r]`` (rows past it: -1)."""
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host_np
        for row, req_id in enumerate(req_ids):
            host[0, row], host[1, row] = self._row(req_id)
        host[:, len(req_ids) :] = -1
        self.stores = bool((host[1] >= 0).any())
        self._rows.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def clear_rows(self) -> None:
        """Every row -1, for dummy runs (profiling, capture, idle data-parallel steps)."""
        self._rows.fill_(-1)
        self.stores = False

    def _row(self, req_id: str) -> tuple[int, int]:
        req = self._requests.get(req_id)
        if req is None or req.key is None:
            return -1, -1
        index = self._by_key.get(req.key)
        if index is not None:
            sink = self._sinks[index]
            assert sink is not None
            if sink.owner is not None and sink.owner != req_id:
                # another request is still writing this content's page: this one reads its own
                # page (4-bit), never a half-written sink
                return -1, -1
            self._use(index, req_id)
            return index, index if sink.owner == req_id else -1
        if req.computed >= PAGE_TOKENS:
            return -1, -1  # its page was computed and its sink reused since: the 4-bit page
        index = self._allocate(req.key, req_id)
        if index is None:
            return -1, -1
        self._use(index, req_id)
        return index, index

    def _use(self, index: int, req_id: str) -> None:
        sink = self._sinks[index]
        assert sink is not None
        sink.readers.add(req_id)
        self._idle.pop(index, None)

    def _allocate(self, key: SinkKey, owner: str) -> int | None:
        if self._free:
            index = self._free.pop()
        elif self._idle:
            index, _ = self._idle.popitem(last=False)
            old = self._sinks[index]
            assert old is not None
            del self._by_key[old.key]
        else:
            self.full_misses += 1
            if self.full_misses == 1:
                logger.info(
                    "int8kv-shim: every one of the %d sink pages is read by a running request; "
                    "a new request's first page stays 4-bit (this line is logged once)",
                    self.num_sinks,
                )
            return None
        self._sinks[index] = _Sink(key, owner)
        self._by_key[key] = index
        return index

    def _drop(self, index: int) -> None:
        sink = self._sinks[index]
        assert sink is not None
        del self._by_key[sink.key]
        self._sinks[index] = None
        self._idle.pop(index, None)
        self._free.append(index)


# --------------------------------------------------------------------------------------------------
# From vLLM's SchedulerOutput (what the model-runner hooks of tail_slots.py hand over)


def lora_id(new_req: Any) -> int:
    lora = getattr(new_req, "lora_request", None)
    return int(getattr(lora, "lora_int_id", 0) or 0)


def scheduled(pages: SinkPages, scheduler_output: Any) -> None:
    """Record the step's new, resumed and running requests (before ``assign``)."""
    scheduled_tokens = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        key = sink_key(new.prompt_token_ids, lora_id(new), bool(getattr(new, "mm_features", None)))
        pages.add(new.req_id, key, new.num_computed_tokens)
        pages.computed(new.req_id, new.num_computed_tokens, scheduled_tokens.get(new.req_id, 0))
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        pages.computed(req_id, computed, scheduled_tokens.get(req_id, 0))


def ended(pages: SinkPages, scheduler_output: Any) -> None:
    """Record the requests vLLM reports finished or preempted (before ``scheduled``)."""
    pages.end(scheduler_output.finished_req_ids)
    pages.end(scheduler_output.preempted_req_ids or (), finished=False)


# The one manager of this process, when sink pages are on (each worker process has its own).
_manager: SinkPages | None = None


def manager() -> SinkPages | None:
    """This process's sink manager, or None when no layer keeps sink pages."""
    return _manager


def install(num_sinks: int, num_rows: int, device: torch.device | str) -> SinkPages:
    """The process's manager (made on the first call; the tail slots' runner hooks feed it)."""
    global _manager
    device = torch.device(device)
    if _manager is None:
        _manager = SinkPages(num_sinks, num_rows, device)
    elif (_manager.num_sinks, _manager.device) != (num_sinks, device):
        raise ValueError(
            f"int8kv-shim: this process's sink pool has {_manager.num_sinks} sinks on "
            f"{_manager.device}; a layer asked for {num_sinks} on {device}"
        )
    return _manager


def uninstall() -> None:
    """Forget the manager (tests)."""
    global _manager
    _manager = None
