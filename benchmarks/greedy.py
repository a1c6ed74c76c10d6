"""Comparing two runs' greedy outputs for the same prompts: identical, near ties, real mismatches.

Used by ``benchmarks/long_context.py`` and the vLLM end-to-end tests; the runs are
``benchmarks/vllm_worker.py`` phases (token ids and top-k logprobs per generated position).
Pure Python: no vLLM, no GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Logprobs each generated position records: compare_greedy's near-tie window (its docstring says
# why 20; it is also vLLM's default max_logprobs, the most a request may ask for).
NEAR_TIE_TOPK = 20


@dataclass
class Comparison:
    """How two runs' greedy outputs for the same prompts compare over the first ``n`` tokens."""

    n: int
    identical: int = 0
    near_tie: list[int] = field(default_factory=list)  # diverged where both tokens are near-ties
    mismatch: list[int] = field(default_factory=list)  # diverged on a token the other ruled out
    first_divergence: dict[int, int] = field(default_factory=dict)
    # near ties: how near, in nats (the larger of the two runs' logprob gaps between the tokens)
    margin: dict[int, float] = field(default_factory=dict)
    # real mismatches: both runs' top-k (token: logprob) at the divergence, so a log tells a flat
    # distribution (the top-k spans a fraction of a nat) from a wrong one
    mismatch_topk: dict[int, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.identical + len(self.near_tie) + len(self.mismatch)

    @property
    def identical_fraction(self) -> float:
        return self.identical / self.total if self.total else 0.0

    def summary(self) -> str:
        return (
            f"{self.identical}/{self.total} identical over the first {self.n} tokens; "
            f"near-tie divergences at {self._fmt(self.near_tie)}"
            + (
                f" (largest logprob gap {max(self.margin.values()):.3f} nats)"
                if self.margin
                else ""
            )
            + f"; real mismatches at {self._fmt(self.mismatch)}"
            + "".join(f"\n    p{i}: {self.mismatch_topk[i]}" for i in self.mismatch_topk)
        )

    def _fmt(self, idx: list[int]) -> str:
        return "[" + ", ".join(f"p{i}@t{self.first_divergence[i]}" for i in idx) + "]"


def compare_greedy(ref: Mapping[str, Any], other: Mapping[str, Any], n: int) -> Comparison:
    """Compare two phases' outputs (``vllm_worker`` format) prompt by prompt, over the first ``n``
    generated tokens.

    A divergence is a *near tie* when, at the first differing position, each run's token is among
    the other run's top-k logprobs there — the convention of vLLM's own ``check_logprobs_close``:
    two tokens that close in probability are legitimately flipped by any rounding difference
    (batch composition, CUDA graph padding, a quantized cache). Otherwise it is a *mismatch*: one
    run picked a token the other considered unlikely, which points at a real difference.

    The runs record k = NEAR_TIE_TOPK = 20 (the e2e tests' generation_phase). With k = 5 the window
    was a rank, not a probability: SmolLM2 continuing a novel often has five candidates within
    0.2 nats, so a token 0.3 nats down fell outside it (an H200 run of the e2e tests, prompt 12 at
    token 4: ref's top-5 spanned 0.19 nats, the other's 0.31), while near ties the same rule
    accepted elsewhere reached 0.69 nats. A broken cache or kernel moves whole distributions
    (diverging at the first tokens of most prompts, as the CPU simulation of a broken context
    gather showed), far outside any top-20.
    """
    cmp = Comparison(n=n)
    a_ids, b_ids = ref["token_ids"], other["token_ids"]
    if len(a_ids) != len(b_ids):
        raise ValueError(f"{len(a_ids)} vs {len(b_ids)} prompts")
    for i, (a, b) in enumerate(zip(a_ids, b_ids, strict=True)):
        a, b = a[:n], b[:n]
        pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if pos is None and len(a) == len(b):
            cmp.identical += 1
            continue
        pos = min(len(a), len(b)) if pos is None else pos
        cmp.first_divergence[i] = pos
        if pos < min(len(a), len(b)):
            # each run's logprobs of its own token and of the other run's token there
            ref_own, ref_other = _logprob(ref, i, pos, a[pos]), _logprob(ref, i, pos, b[pos])
            own, other_ = _logprob(other, i, pos, b[pos]), _logprob(other, i, pos, a[pos])
        else:
            ref_own = ref_other = own = other_ = None
        if None not in (ref_other, other_):
            cmp.near_tie.append(i)
            if None not in (ref_own, own):
                cmp.margin[i] = max(ref_own - ref_other, own - other_)
        else:
            cmp.mismatch.append(i)
            if pos < min(len(a), len(b)):
                cmp.mismatch_topk[i] = (
                    f"ref picked {a[pos]}, top-k {_topk(ref, i, pos)}; "
                    f"other picked {b[pos]}, top-k {_topk(other, i, pos)}"
                )
    return cmp


def _topk(run: Mapping[str, Any], prompt: int, pos: int) -> str:
    lps = run.get("logprobs") or []
    if prompt >= len(lps) or pos >= len(lps[prompt]):
        return "(none recorded)"
    return "{" + ", ".join(f"{t}: {lp:.3f}" for t, lp in lps[prompt][pos]) + "}"


def _logprob(run: Mapping[str, Any], prompt: int, pos: int, token: int) -> float | None:
    """The run's logprob of ``token`` at ``pos`` if it is among its top-k there, else None."""
    lps = run.get("logprobs") or []
    if prompt >= len(lps) or pos >= len(lps[prompt]):
        return None
    return next((lp for t, lp in lps[prompt][pos] if t == token), None)
