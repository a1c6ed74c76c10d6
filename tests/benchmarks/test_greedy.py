"""``benchmarks/greedy.py``: how two runs' greedy outputs compare (near ties vs real mismatches)."""

from __future__ import annotations

import pytest

from benchmarks.greedy import compare_greedy


def _run(ids: list[list[int]], lps: list[list[list[list[float]]]] | None = None) -> dict:
    return {"token_ids": ids, "logprobs": lps or [[] for _ in ids]}


def test_compare_greedy_identical_near_tie_and_mismatch() -> None:
    ref = _run(
        [[1, 2, 3], [1, 2, 3], [1, 2, 3]],
        [
            [[[1, -0.1]], [[2, -0.1]], [[3, -0.1]]],
            [[[1, -0.1]], [[2, -0.6], [7, -0.8]], [[3, -0.1]]],
            [[[1, -0.1]], [[2, -0.1]], [[3, -0.1]]],
        ],
    )
    other = _run(
        [[1, 2, 3], [1, 7, 5], [1, 9, 3]],
        [
            [[[1, -0.1]], [[2, -0.1]], [[3, -0.1]]],
            [[[1, -0.1]], [[7, -0.6], [2, -0.8]], [[5, -0.1]]],
            [[[1, -0.1]], [[9, -0.01]], [[3, -0.1]]],
        ],
    )
    cmp = compare_greedy(ref, other, n=3)
    assert cmp.identical == 1 and cmp.near_tie == [1] and cmp.mismatch == [2]
    assert cmp.first_divergence == {1: 1, 2: 1}
    assert cmp.identical_fraction == pytest.approx(1 / 3)
    assert "p1@t1" in cmp.summary() and "p2@t1" in cmp.summary()
    # ref: -0.6 vs -0.8 for the two tokens, other: -0.6 vs -0.8 -> 0.2 nats apart
    assert cmp.margin == {1: pytest.approx(0.2)}
    assert "largest logprob gap 0.200 nats" in cmp.summary()
    # a real mismatch prints both runs' top-k there
    assert cmp.mismatch_topk == {
        2: "ref picked 2, top-k {2: -0.100}; other picked 9, top-k {9: -0.010}"
    }
    assert "\n    p2: ref picked 2" in cmp.summary()
    # only the first n tokens count
    assert compare_greedy(ref, other, n=1).identical == 3


def test_flat_distribution_flip_is_a_near_tie_within_top20() -> None:
    """An H200 run's prompt 12 at token 4 (p12@t4): five candidates within 0.19 nats; int8 picked the
    fourth. Top-5 records miss the other run's token, top-20 ones hold it (its logprob here is an
    assumed -3.1: the recorded lists stop at -3.015)."""
    ref_top5 = [[198, -2.637], [1188, -2.699], [4571, -2.762], [5344, -2.762], [685, -2.824]]
    int8_top5 = [[5344, -2.702], [4571, -2.765], [1188, -2.765], [685, -2.827], [919, -3.015]]
    int8_top20 = int8_top5 + [[198, -3.1]] + [[1000 + i, -3.2 - 0.1 * i] for i in range(14)]
    ref = _run([[198]], [[ref_top5]])
    assert compare_greedy(ref, _run([[5344]], [[int8_top5]]), n=1).mismatch == [0]
    cmp = compare_greedy(ref, _run([[5344]], [[int8_top20]]), n=1)
    assert cmp.near_tie == [0] and not cmp.mismatch
    assert cmp.margin == {0: pytest.approx(0.398)}  # int8's own gap: -2.702 - (-3.1)
