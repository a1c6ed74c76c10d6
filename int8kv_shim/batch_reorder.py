"""When vLLM's V1 model runner can skip its decodes-first reorder of the batch.

Our builder asks for decodes first (``reorder_batch_threshold = 1``), so vLLM's V1 runner calls
``reorder_batch_to_split_decodes_and_prefills`` every step. That function classifies every request
with a dozen small numpy operations before it finds nothing to move, which on a step of decodes
alone, most steps of a server, is all it does. The serving runs' step timer put it at most of the
host time an ``int8`` server's ``update_states`` spends beyond a BF16 server's
(``reorder_batch`` in ``benchmarks/results/serving_gemma3_h200_f7ff415.json``; docs/results.md).
:func:`is_decode_only` answers the same question exactly, in a few microseconds: when it says
yes, vLLM's function would have returned without a swap.
"""

from __future__ import annotations

from typing import Any


def is_decode_only(input_batch: Any, scheduler_output: Any, threshold: int | None) -> bool:
    """True when every request of ``input_batch`` is a decode in vLLM's sense, so that
    ``reorder_batch_to_split_decodes_and_prefills`` would find the batch in order and move nothing.

    vLLM's decode: at most ``threshold`` tokens scheduled, some context computed and its prompt
    done. Any other request (a first chunk, a continuation, a one-token remainder of a prompt)
    answers False and leaves the reorder to vLLM.
    """
    if threshold is None:
        return False
    num_reqs = len(input_batch.req_ids)
    if num_reqs == 0:
        return True
    scheduled = scheduler_output.num_scheduled_tokens
    if max(scheduled.values(), default=0) > threshold:
        return False
    computed = input_batch.num_computed_tokens_cpu[:num_reqs]
    return bool(
        (computed > 0).all() and (computed >= input_batch.num_prompt_tokens[:num_reqs]).all()
    )
