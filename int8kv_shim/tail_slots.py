"""The tail pool's slots: which slot of every layer's tail holds each running request's newest page.

``int4`` keeps the newest page of every running sequence in the model's dtype, in a per-layer pool
of ``num_slots`` slots (``tail``: ``[num_slots, 2, num_kv_heads, page_tokens, head_size]``, and
``tail_page``, the block each slot holds, allocated by the attention impl). The write kernel
quantizes a page into the cache when it fills, and the slot keeps it until the sequence's next
token starts a new page (attention reads it from the slot until then). With
``INT8KV_INT4_TAIL_PAGES=2`` (the default) a slot holds two pages (``tail``: ``[num_slots, 2,
num_kv_heads, 2 x page_tokens, head_size]``, ``tail_page`` ``[num_slots, 2]``): the newest and the
one before it, page pg in half pg % 2, kept until the sequence is two pages on; a slot new this
step holds neither of its sequence's pages (the write kernel marks both halves). Which slot a
sequence uses is decided here, once per worker process, for all layers:

* a request gets a slot the first step it is scheduled and keeps it for its life, **keyed by its
  request id**: vLLM can leave a running request unscheduled for a step (the token budget ran out
  behind a long prefill), and its unfinished page must survive that;
* the slot is freed when vLLM reports the request finished or preempted (a preempted request is
  recomputed from its full pages when it resumes, into a new slot);
* every step the model runner hooks (``int8kv_shim.patch``, P11 and P12) fill two persistent
  int32 device buffers in the batch's row order (the rows of ``CommonAttentionMetadata.block_table``):
  ``slot_of_seq[r]`` (-1 for padding rows and dummy runs: they write no tail and read none) and
  ``slot_is_new[r]`` (1 when row r got its slot this step: the slot's old contents belong to
  someone else). They are filled from pinned host memory with one non-blocking copy, never a
  device-to-host sync, and stay at the same address, so FULL CUDA graphs replay them.

Slots = the scheduler's ``max_num_seqs``: vLLM never runs more requests at once, so running out is a
bug, reported as :class:`TailSlotsExhaustedError` rather than a silently shared slot.

Imports torch (not vLLM): loaded by the attention impl, never at shim import.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch

from int8kv_shim import sink_pages
from int8kv_shim._logging import get_logger

logger = get_logger()


class TailSlotsExhaustedError(RuntimeError):
    """More running requests than tail slots (cannot happen while slots = max_num_seqs)."""


class TailSlots:
    """Request id -> tail slot, and the per-step ``slot_of_seq`` / ``slot_is_new`` buffers."""

    def __init__(self, num_slots: int, device: torch.device | str) -> None:
        if num_slots < 1:
            raise ValueError(f"int8kv-shim: the tail pool needs at least one slot, not {num_slots}")
        device = torch.device(device)
        self.num_slots = num_slots
        self.device = device
        self._slot_of: dict[str, int] = {}
        self._free = list(range(num_slots))  # a heap: the lowest free slot goes first
        # Row 0 slot_of_seq, row 1 slot_is_new: one tensor, so one copy per step.
        self._rows = torch.empty((2, num_slots), dtype=torch.int32, device=device)
        self._rows[0].fill_(-1)
        self._rows[1].zero_()
        self.slot_of_seq = self._rows[0]
        self.slot_is_new = self._rows[1]
        cuda = device.type == "cuda"
        # device="cpu" spelled out: vLLM builds the model (and so this) under its device as
        # torch's default, where a pinned buffer of no named device is refused
        self._host = torch.empty((2, num_slots), dtype=torch.int32, device="cpu", pin_memory=cuda)
        self._host_np = self._host.numpy()
        # The pinned buffer is rewritten only after the previous step's copy out of it ran
        # (vLLM's own pinned inputs follow the same rule, with its prepare_inputs_event).
        self._copied = torch.cuda.Event() if cuda else None
        # (layers, bytes) of the tail pools allocated in this process, for the one log line.
        self.pool_layers = 0
        self.pool_bytes = 0
        # Bytes one token costs the KV cache over those layers (what the pool's memory would
        # hold as cache tokens instead).
        self.cache_bytes_per_token = 0
        self._pool_logged = False

    def __repr__(self) -> str:
        return f"TailSlots({len(self._slot_of)}/{self.num_slots} held, device={self.device})"

    def slot_of(self, req_id: str) -> int | None:
        """The slot request ``req_id`` holds, or None."""
        return self._slot_of.get(req_id)

    @property
    def num_held(self) -> int:
        return len(self._slot_of)

    def release(self, req_ids: Iterable[str]) -> None:
        """Free the slots of finished or preempted requests (ids without a slot are ignored)."""
        for req_id in req_ids:
            slot = self._slot_of.pop(req_id, None)
            if slot is not None:
                heapq.heappush(self._free, slot)

    def assign(self, req_ids: Sequence[str], renew: Collection[str] = ()) -> None:
        """Fill ``slot_of_seq`` / ``slot_is_new`` for a batch whose row r is request ``req_ids[r]``.

        A request without a slot gets one (``slot_is_new`` 1); rows past the batch get -1 / 0.
        ``renew``: requests whose old slot holds nothing of theirs any more (resumed after a
        preemption), given a fresh one.
        """
        rows = len(req_ids)
        if rows > self.num_slots:
            raise TailSlotsExhaustedError(
                f"int8kv-shim: a batch of {rows} requests, but int4's tail pool has "
                f"{self.num_slots} slots (max_num_seqs)"
            )
        if renew:
            self.release(r for r in renew if r in self._slot_of)
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host_np
        for row, req_id in enumerate(req_ids):
            slot = self._slot_of.get(req_id)
            new = slot is None
            if new:
                slot = self._take(req_id)
            host[0, row] = slot
            host[1, row] = new
        host[0, rows:] = -1
        host[1, rows:] = 0
        self._rows.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _take(self, req_id: str) -> int:
        if not self._free:
            raise TailSlotsExhaustedError(
                f"int8kv-shim: int4's tail pool has {self.num_slots} slots (max_num_seqs) and "
                f"every one is held by a running request; request {req_id!r} got none (vLLM ran "
                "more requests than max_num_seqs, or a finished one was never reported)"
            )
        slot = heapq.heappop(self._free)
        self._slot_of[req_id] = slot
        return slot

    def clear_rows(self) -> None:
        """Every row -1 / 0, for dummy runs (profiling, capture, idle data-parallel steps): their
        rows are no request, and must neither write nor read anyone's tail. Slots stay held."""
        self._rows[0].fill_(-1)
        self._rows[1].zero_()

    def count_pool(self, nbytes: int, cache_bytes_per_token: int) -> None:
        """Account one layer's tail pool (``nbytes``) and what a token costs that layer's cache
        (for :meth:`log_pool_once`)."""
        self.pool_layers += 1
        self.pool_bytes += nbytes
        self.cache_bytes_per_token += cache_bytes_per_token

    def pool_cache_tokens(self) -> int:
        """How many tokens of the KV cache the pools' memory would hold."""
        return self.pool_bytes // max(self.cache_bytes_per_token, 1)

    def log_pool_once(self) -> None:
        """One line with the pools' total size (called once every layer has its pool). The pool
        costs max_num_seqs pages per layer whatever the context, which on a card with a few GiB
        of KV memory is a large share of it: the line says in cache tokens what it takes."""
        if self._pool_logged or not self.pool_layers:
            return
        self._pool_logged = True
        logger.info(
            "int8kv-shim: int4 tail pool: %d slots (max_num_seqs) x %d layers, %.1f MiB in all, "
            "allocated with the model (vLLM counts it as non-KV memory): the memory of %d "
            "cache tokens; a lower --max-num-seqs gives it to the cache",
            self.num_slots,
            self.pool_layers,
            self.pool_bytes / 2**20,
            self.pool_cache_tokens(),
        )


# The one manager of this process (each worker process has its own; TP ranks each theirs).
_manager: TailSlots | None = None


def manager() -> TailSlots | None:
    """This process's slot manager, or None when no layer uses a tail pool."""
    return _manager


def install(num_slots: int, device: torch.device | str) -> TailSlots:
    """The process's manager (made on the first call) and the model runners' hooks that feed it.

    Called by every attention impl of a tail dtype; the hooks are attached only then, so vLLM's
    runners run untouched for every other dtype.
    """
    global _manager
    device = torch.device(device)
    if _manager is None:
        _manager = TailSlots(num_slots, device)
        from int8kv_shim import patch

        patch.attach_runner_hooks()
    elif _manager.num_slots != num_slots or _manager.device != device:
        raise ValueError(
            f"int8kv-shim: this process's tail pool has {_manager.num_slots} slots on "
            f"{_manager.device}; a layer asked for {num_slots} on {device}"
        )
    return _manager


def uninstall() -> None:
    """Forget the manager (tests; the runner hooks then pass every call straight through)."""
    global _manager
    _manager = None


# --------------------------------------------------------------------------------------------------
# What the model runner hooks (int8kv_shim.patch, P11 / P12) call. Each reads only the named
# attributes of vLLM's objects, so the tests can hand in vLLM's real SchedulerOutput and a stand-in
# runner.


def _resumed(scheduler_output: Any) -> Collection[str]:
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    return getattr(cached, "resumed_req_ids", None) or ()


def _ended(scheduler_output: Any) -> set[str]:
    return set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())


def v1_states_updated(runner: Any, scheduler_output: Any) -> None:
    """After V1's ``GPUModelRunner._update_states``: the persistent batch holds exactly the
    scheduled requests, in their final row order (condensed, decodes first)."""
    slots = _manager
    if slots is None:
        return
    slots.release(_ended(scheduler_output))
    batch = runner.input_batch
    req_ids = batch.req_ids[: batch.num_reqs]
    slots.assign(req_ids, renew=_resumed(scheduler_output))
    sinks = sink_pages.manager()
    if sinks is not None:
        sink_pages.ended(sinks, scheduler_output)
        _assign_sinks(sinks, req_ids, scheduler_output)


def _assign_sinks(
    sinks: sink_pages.SinkPages, req_ids: Sequence[str], scheduler_output: Any
) -> None:
    sink_pages.scheduled(sinks, scheduler_output)
    sinks.assign(req_ids)


def v2_requests_finished(scheduler_output: Any) -> None:
    """After V2's ``GPUModelRunner.finish_requests`` (finished and preempted requests)."""
    if _manager is not None:
        _manager.release(_ended(scheduler_output))
    sinks = sink_pages.manager()
    if sinks is not None:
        sink_pages.ended(sinks, scheduler_output)


def v2_inputs_prepared(input_batch: Any, scheduler_output: Any) -> None:
    """After V2's ``GPUModelRunner.prepare_inputs``: ``input_batch.req_ids`` is the row order."""
    if _manager is not None:
        _manager.assign(input_batch.req_ids, renew=_resumed(scheduler_output))
        sinks = sink_pages.manager()
        if sinks is not None:
            _assign_sinks(sinks, input_batch.req_ids, scheduler_output)


def dummy_run_starts() -> None:
    """Before a dummy run of either runner (profiling, CUDA-graph capture, idle DP steps)."""
    if _manager is not None:
        _manager.clear_rows()
    sinks = sink_pages.manager()
    if sinks is not None:
        sinks.clear_rows()
