"""CPU checks of ``benchmarks/long_context.py``'s row logic (the engines run on the GPU host)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks import long_context


def _phase(tokens: list[list[int]], lps: list[list[list[list[float]]]]) -> dict:
    return {"token_ids": tokens, "logprobs": lps}


def _lps(tokens: list[int], alt: int = 999, value: float = -0.5) -> list[list[list[float]]]:
    return [[[t, value], [alt, value - 0.1]] for t in tokens]


def test_rows_agreement_divergence_and_nan() -> None:
    ref_tokens = [list(range(40)), list(range(40)), list(range(40))]
    got_tokens = [list(range(40)), list(range(35)) + [77] * 5, list(range(10)) + [55] * 30]
    ref = _phase(ref_tokens, [_lps(t, alt=77) for t in ref_tokens])
    got_lps = [_lps(t) for t in got_tokens]
    got_lps[1][35] = [[77, -0.5], [35, -0.6]]  # ref's token 35 is in got's top-k: a near tie
    got_lps[2][12] = [[55, math.nan]]
    # json round trip, as the worker's result file goes: NaN survives
    got = json.loads(json.dumps(_phase(got_tokens, got_lps)))
    rows = long_context.prompt_rows("int8", ref, got, gen_tokens=40)
    assert [r["agree_len"] for r in rows] == [40, 35, 10]
    assert [r["identical_first_32"] for r in rows] == [True, True, False]
    assert [r["divergence"] for r in rows] == ["none", "near_tie", "mismatch"]
    assert [r["nan"] for r in rows] == [False, False, True]
    assert rows[2]["nan_positions"] == [12]


def test_non_finite_positions() -> None:
    assert long_context.non_finite_positions([[[1, -0.1]], [[2, -math.inf]], [[3, math.nan]]]) == [
        1,
        2,
    ]


def test_no_model_is_a_usage_error(tmp_path: Path) -> None:
    assert long_context.main(["--model", str(tmp_path), "--out", str(tmp_path / "x.json")]) == 2
