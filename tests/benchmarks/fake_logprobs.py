"""Log-probability arrays the benchmark tests build their fake vLLM outputs from."""

from __future__ import annotations

import numpy as np


def softmax_logprobs(logits: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis."""
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def topk_arrays(
    lp: np.ndarray, targets: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(top-k ids, their log-probs, the targets' log-probs) of full (n, vocab) log-probs."""
    ids = np.argsort(-lp, axis=1)[:, :k]
    return ids, np.take_along_axis(lp, ids, 1), lp[np.arange(len(lp)), targets]
