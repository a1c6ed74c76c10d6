"""benchmarks/report.py's serving TTFT and starts tables, the README's serving table, the kernel
A/B table, the int4 decode table, the note on int4's default decode, the kernel table of a
throughput run's profile summaries and the host phases of a step-timed one, on small result files
made here (the committed files are pinned by tests/test_readme_results.py)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import report

COMMON = {"gpu": "NVIDIA H200", "date": "2026-12-05", "git_commit": "b" * 40}


def serving_row(dtype: str, conc: int, ttft: float, metrics: dict | None) -> dict:
    row = {"model": "smollm2", "dtype": dtype, "input_len": 7936, "output_len": 256,
           "concurrency": conc, "num_prompts": 4 * conc, "ttft_ms_p50": ttft,
           "ttft_ms_p99": 2 * ttft, "tpot_ms_p50": 2.0, "tpot_ms_p99": 3.0, "itl_ms_p50": 1.5,
           "itl_ms_p99": 9.0, "output_tok_s": 1000.0, "kv_cache_tokens": 10}  # fmt: skip
    if metrics is not None:
        row["server_metrics"] = metrics
    return row


def metrics(queue: float, prefill: float, ttft: float) -> dict:
    return {"queue_ms_mean": queue, "prefill_ms_mean": prefill, "ttft_ms_mean_server": ttft,
            "ttft_frontend_ms_mean": ttft - queue - prefill}  # fmt: skip


def write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "result.json"
    path.write_text(json.dumps({**COMMON, **doc}))
    return path


def test_serving_ttft_table_splits_ttft_and_compares_the_engine_core(tmp_path: Path) -> None:
    path = write(tmp_path, {
        "command": "python -m benchmarks.serve_bench --models smollm2",
        "rows": [serving_row("int8", 32, 300.0, metrics(10.0, 62.0, 320.0)),
                 serving_row("auto_fa2", 32, 150.0, metrics(0.0, 24.0, 230.0)),
                 serving_row("int4", 32, 300.0, None)],
    })  # fmt: skip
    table = [ln for ln in report.serving_ttft_table(path).splitlines() if ln.startswith("| Smol")]
    # auto_fa2 first; queue + prefill over FlashAttention-2's: 72 / 24
    assert table == [
        "| SmolLM2-135M-Instruct | 7936 | 32 | `auto_fa2` | 230 | 0 | 24 | 206 | reference | 1000 |",
        "| SmolLM2-135M-Instruct | 7936 | 32 | `int8` | 320 | 10 | 62 | 248 | 3.00x | 1000 |",
        "| SmolLM2-135M-Instruct | 7936 | 32 | `int4` | n/a | n/a | n/a | n/a | n/a | 1000 |",
    ]


def test_serving_ttft_table_adds_the_request_ages_where_the_step_timer_dated_them(
    tmp_path: Path,
) -> None:
    def dated(row: dict, at_core_us: float | None, at_scheduler_us: float) -> dict:
        phases = {"request_age_at_scheduler": {"calls": 4, "us_per_call": at_scheduler_us}}
        if at_core_us is not None:
            phases["request_age_at_engine_core"] = {"calls": 4, "us_per_call": at_core_us}
        return {**row, "step_timing": {"engine_steps": 10, "phases": phases}}

    path = write(tmp_path, {
        "command": "python -m benchmarks.serve_bench --step-timing",
        "rows": [dated(serving_row("int8", 32, 300.0, metrics(10.0, 62.0, 320.0)), 150e3, 240e3),
                 dated(serving_row("auto_fa2", 32, 150.0, metrics(0.0, 24.0, 230.0)), None, 9e3)],
    })  # fmt: skip
    lines = report.serving_ttft_table(path).splitlines()
    assert "| outside the engine core | of it, before the engine core's input thread | before " \
        "its scheduler | queue + prefill" in lines[2]  # fmt: skip
    assert lines[4:] == [
        "| SmolLM2-135M-Instruct | 7936 | 32 | `auto_fa2` | 230 | 0 | 24 | 206 | n/a | 9 "
        "| reference | 1000 |",
        "| SmolLM2-135M-Instruct | 7936 | 32 | `int8` | 320 | 10 | 62 | 248 | 150 | 240 | 3.00x "
        "| 1000 |",
    ]
    # with the server processes' CPU time, their busy fractions while the requests ran
    rows = [dated(serving_row("int8", 32, 300.0, metrics(10.0, 62.0, 320.0)), 150e3, 240e3)]
    rows[0]["process_cpu"] = {
        "api_server": {"cpu_s": 4.0, "busy": 0.5, "busy_run": 0.98, "main_thread_busy_run": 0.9},
        "engine_core": {"cpu_s": 5.0, "busy": 0.6, "busy_run": 1.2},
    }
    lines = report.serving_ttft_table(write(tmp_path, {"command": "x", "rows": rows})).splitlines()
    assert lines[2].endswith(
        "| CPU busy while requests ran (main thread): API server / engine core / client |"
    )
    assert lines[4].endswith("| 240 | n/a | 1000 | 0.98 (0.90) / 1.20 / n/a |")
    # with the API server's milestones too, a column for each, in the order a request passes them
    rows = [dated(serving_row("int8", 32, 300.0, metrics(10.0, 62.0, 320.0)), 150e3, 240e3)]
    rows[0]["step_timing"]["phases"] |= {
        "render": {"calls": 4, "us_per_call": 40e3},
        "request_age_at_handover": {"calls": 4, "us_per_call": 120e3},
    }
    lines = report.serving_ttft_table(write(tmp_path, {"command": "x", "rows": rows})).splitlines()
    assert "| outside the engine core | of it, until tokenised | until sent to the engine core | " \
        "before the engine core's input thread | before its scheduler | queue + prefill" \
        in lines[2]  # fmt: skip
    assert lines[3].count("|") == lines[2].count("|")
    assert lines[4].endswith("| 248 | 40 | 120 | 150 | 240 | n/a | 1000 |")
    # without them, the table keeps its columns
    assert "input thread" not in report.serving_ttft_table(
        write(
            tmp_path,
            {"command": "x", "rows": [serving_row("int8", 32, 300.0, metrics(10.0, 62.0, 320.0))]},
        )
    )


def summary_cells(newest: list[Path], paired: list[Path]) -> list[list[str]]:
    lines = report.serving_summary_table(newest, paired).splitlines()[2:]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def test_serving_summary_puts_each_models_newest_runs_before_its_newest_paired_run(
    tmp_path: Path,
) -> None:
    def run(name: str, model: str, dtypes: tuple[str, ...], ttfts: tuple[float, ...],
            *extra: dict) -> Path:  # fmt: skip
        rows = [{**serving_row(d, 32, t, None), "model": model}
                for d, t in zip(dtypes, ttfts, strict=True)]  # fmt: skip
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**COMMON, "command": "x", "rows": [*rows, *extra]}))
        return path

    pair = ("auto_fa2", "int8")
    smol = run("smol", "smollm2", pair, (100.0, 50.0))
    gemma = run("gemma", "gemma3", pair, (100.0, 200.0),
                {**serving_row("int8_per_token_head", 32, 1.0, None), "model": "gemma3",
                 "output_tok_s": 400.0})  # fmt: skip
    # a run beside upstream only: its cells against FlashAttention-2 stay empty
    gemma_upstream = run("gemma_upstream", "gemma3", ("int8_per_token_head", "int8"),
                         (100.0, 50.0))  # fmt: skip
    only_fa2 = run("only_fa2", "smollm2", ("auto_fa2",), (100.0,))
    cells = summary_cells([gemma, gemma_upstream, smol, only_fa2], [])
    # models in the headline's order, each model's runs in the list's order; a run without an
    # int8 row beside either baseline gives none
    assert [(c[0], c[4], c[5]) for c in cells] == [
        ("SmolLM2-135M-Instruct", "0.50x", "-"),
        ("gemma-3-270m", "2.00x", "2.50x"),
        ("gemma-3-270m", "-", "1.00x"),
    ]
    assert cells[0][6:] == ["one pass", "NVIDIA H200, 2026-12-05, commit `bbbbbbb`"]
    # servers up at once, one round and no rounds recorded: still a paired round
    at_once = tmp_path / "at_once.json"
    at_once.write_text(json.dumps({**COMMON, "command": "x", "rows": [
        {**serving_row(d, 32, 100.0, None), "servers_at_once": 2}
        for d in ("auto_fa2", "int8")]}))  # fmt: skip
    assert summary_cells([at_once], [])[0][6] == "one paired round"


def test_serving_summary_gives_paired_rounds_their_median_and_a_configured_profiler(
    tmp_path: Path,
) -> None:
    def rounds(dtype: str, tpots: list[float]) -> dict:
        each = [{"round": i, "position": i % 2, "tpot_ms_p50": t, "ttft_ms_p50": 100.0}
                for i, t in enumerate(tpots)]  # fmt: skip
        return {**serving_row(dtype, 32, 100.0, None), "rounds": each}

    def run(command: str, fa2: list[float], int8: list[float]) -> Path:
        path = tmp_path / f"run{len(list(tmp_path.iterdir()))}.json"
        rows = [rounds("auto_fa2", fa2), rounds("int8", int8)]
        path.write_text(json.dumps({**COMMON, "command": command, "rows": rows}))
        return path

    older = run("python -m benchmarks.serve_bench --rounds 1 --interleave", [5.0], [5.0])
    # paired by round: 0.80x, 0.60x, 1.10x, median 0.80x (the ratio of medians would be 0.88x)
    three = run("python -m benchmarks.serve_bench --rounds 3 --interleave",
                [5.0, 10.0, 4.0], [4.0, 6.0, 4.4])  # fmt: skip
    cells = summary_cells([], [older, three])
    assert [c[3:7] for c in cells] == [["0.80x", "1.00x", "-", "median of 3 paired rounds"]]
    profiled = run("python -m benchmarks.serve_bench --rounds 3 --interleave "
                   "--profile-concurrency 32", [5.0], [4.0])  # fmt: skip
    assert summary_cells([], [profiled])[0][6] == "one paired round, servers profiled"
    no_profile = run("python -m benchmarks.serve_bench --profile-concurrency 0", [5.0], [4.0])
    assert summary_cells([], [no_profile])[0][6] == "one paired round"


def test_serving_summary_takes_each_point_from_the_newest_paired_run_that_has_it(
    tmp_path: Path,
) -> None:
    def run(name: str, command: str, points: dict[int, float]) -> Path:
        rows = [{**serving_row(d, conc, 100.0, None), "servers_at_once": 2,
                 "tpot_ms_p50": tpot if d == "int8" else 10.0}
                for conc, tpot in points.items() for d in ("auto_fa2", "int8")]  # fmt: skip
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**COMMON, "command": command, "rows": rows}))
        return path

    older = run("older", "x", {1: 9.0, 32: 7.0})
    newer = run("newer", "x --serve-args '--renderer-num-workers 8'", {32: 8.0})
    cells = summary_cells([], [older, newer])
    # 1 request from the older run, which alone has it; 32 from the newer, with its threads
    assert [(c[2], c[3], c[6]) for c in cells] == [
        ("1", "0.90x", "one paired round"),
        ("32", "0.80x", "one paired round, 8 tokenising threads"),
    ]


def test_serving_step_kinds_table_splits_engine_time_by_kind_of_step(tmp_path: Path) -> None:
    def rounds(dtype: str, kinds: list[tuple[float, float]]) -> dict:
        each = [{"round": i, "position": i, "tpot_ms_p50": 4.0, "step_timing": {"phases": {
                    "engine_step.decode": {"calls": 90, "us_per_call": decode_us},
                    "engine_step.prompt": {"calls": 10, "us_per_call": prompt_us}}}}
                for i, (decode_us, prompt_us) in enumerate(kinds)]  # fmt: skip
        return {**serving_row(dtype, 32, 100.0, None), "rounds": each}

    path = write(tmp_path, {
        "command": "python -m benchmarks.serve_bench --rounds 2 --interleave",
        "rows": [rounds("auto_fa2", [(2000.0, 27000.0), (2500.0, 30000.0)]),
                 rounds("int8", [(1600.0, 24000.0), (2500.0, 33000.0)]),
                 # a point the step timer did not split by kind gets no line
                 {**serving_row("int4", 32, 100.0, None), "step_timing": {"phases": {}}}],
    })  # fmt: skip
    lines = report.serving_step_kinds_table(path).splitlines()[4:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    # the prompt steps' share: 10 x 27 ms of 10 x 27 + 90 x 2 ms = 60%
    assert [c[3:] for c in cells] == [
        ["`auto_fa2`, round 0 (1st)", "4.00", "90", "2.00", "reference", "10", "27.00",
         "reference", "60%"],
        ["`auto_fa2`, round 1", "4.00", "90", "2.50", "reference", "10", "30.00", "reference",
         "57%"],
        ["`int8`, round 0 (1st)", "4.00", "90", "1.60", "0.80x", "10", "24.00", "0.89x", "62%"],
        ["`int8`, round 1", "4.00", "90", "2.50", "1.00x", "10", "33.00", "1.10x", "59%"],
    ]  # fmt: skip


def test_serving_targets_table_judges_each_point_by_its_bound(tmp_path: Path) -> None:
    def row(dtype: str, conc: int, ttft: float, tpot: float, tok_s: float) -> dict:
        return {**serving_row(dtype, conc, ttft, None), "tpot_ms_p50": tpot,
                "output_tok_s": tok_s}  # fmt: skip

    path = write(tmp_path, {
        "command": "python -m benchmarks.serve_bench --models smollm2",
        "rows": [row("auto_fa2", 1, 100.0, 2.0, 500.0), row("int8", 1, 104.0, 2.1, 480.0),
                 row("auto_fa2", 8, 100.0, 2.0, 500.0), row("int8", 8, 110.0, 1.0, 900.0),
                 row("auto_fa2", 32, 100.0, 5.0, 900.0), row("int8", 32, 90.0, 3.7, 1000.0),
                 row("int8_per_token_head", 32, 300.0, 9.0, 800.0)],
    })  # fmt: skip
    lines = report.serving_targets_table(path).splitlines()[2:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    got = {(int(c[3]), c[4]): (c[5], c[6], c[7]) for c in cells}
    assert got == {
        (1, "TPOT p50 vs `auto_fa2`"): ("≤ 1.00x", "1.05x", "**no**"),
        (1, "TTFT p50 vs `auto_fa2`"): ("≤ 1.05x", "1.04x", "yes"),
        # no TPOT target at 8 requests
        (8, "TTFT p50 vs `auto_fa2`"): ("≤ 1.05x", "1.10x", "**no**"),
        # SmolLM2's own bound from 32 requests: 0.74x misses 0.72x
        (32, "TPOT p50 vs `auto_fa2`"): ("≤ 0.72x", "0.74x", "**no**"),
        (32, "TTFT p50 vs `auto_fa2`"): ("≤ 1.05x", "0.90x", "yes"),
        (32, "output tok/s vs `int8_per_token_head`"): ("≥ 1.30x", "1.25x", "**no**"),
    }


def test_serving_rounds_table_pairs_each_round_with_its_baseline(tmp_path: Path) -> None:
    def rounds(dtype: str, tpots: list[float], first: int) -> dict:
        each = [{"round": i, "position": int(i % 2 != first), "tpot_ms_p50": t,
                 "ttft_ms_p50": 100.0} for i, t in enumerate(tpots)]  # fmt: skip
        return {**serving_row(dtype, 32, 100.0, None), "rounds": each}

    path = write(tmp_path, {
        "command": "python -m benchmarks.serve_bench --rounds 3 --interleave",
        "rows": [rounds("auto_fa2", [5.0, 10.0, 4.0], 0), rounds("int8", [4.0, 6.0, 4.4], 1),
                 serving_row("int4", 32, 90.0, None)],  # no rounds: no line
    })  # fmt: skip
    lines = report.serving_rounds_table(path).splitlines()[4:]
    assert len(lines) == 1
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    # paired by round: 0.80x, 0.60x, 1.10x (median 0.80x), where the ratio of the medians
    # over the rounds (4.4 / 5.0) would say 0.88x
    assert cells[3:] == ["`int8`", "0.80x, 0.60x (1st), 1.10x", "0.80x",
                         "1.00x, 1.00x (1st), 1.00x", "1.00x"]  # fmt: skip
    # the targets table judges such a point by the same paired median
    targets = report.serving_targets_table(path).splitlines()[2:]
    tpot = [c.strip() for c in targets[0].strip("|").split("|")]
    assert tpot[4:] == ["TPOT p50 vs `auto_fa2`", "≤ 0.72x", "0.80x (median of 3 paired rounds)",
                        "**no**"]  # fmt: skip


def test_a_llama_run_with_other_than_two_layers_says_how_many(tmp_path: Path) -> None:
    def row(dtype: str, tpot: float) -> dict:
        return {**serving_row(dtype, 32, 100.0, None), "model": "llama3-8b-shape",
                "input_len": 8192, "tpot_ms_p50": tpot,
                "rounds": [{"round": 0, "position": 0, "tpot_ms_p50": tpot,
                            "ttft_ms_p50": 100.0}]}  # fmt: skip

    def run(command: str) -> Path:
        path = tmp_path / f"run{len(list(tmp_path.iterdir()))}.json"
        rows = [row("auto_fa2", 5.0), row("int8", 4.0)]
        path.write_text(json.dumps({**COMMON, "command": command, "rows": rows}))
        return path

    four = run("python -m benchmarks.serve_bench --llama-layers 4 --rounds 1 --interleave")
    two = run("python -m benchmarks.serve_bench --llama-layers 2 --rounds 1 --interleave")
    default = run("python -m benchmarks.serve_bench --rounds 1 --interleave")
    names = {
        p: {line.split("|")[1].strip() for line in report.serving_targets_table(p).splitlines()[2:]}
        for p in (four, two, default)
    }
    assert names[four] == {"Llama-3-8B's shape, random weights, 4 layers"}
    assert names[two] == names[default] == {"Llama-3-8B's shape, random weights"}
    four_cells = summary_cells([], [four])
    assert four_cells[0][0] == "Llama-3-8B's shape, random weights, 4 layers"


def test_serving_ttft_and_steps_tables_give_each_round_against_the_baselines_same_round(
    tmp_path: Path,
) -> None:
    def rounds(dtype: str, prefill: list[float], step_ms: list[float], first: int) -> dict:
        each = [{"round": i, "position": int(i % 2 != first), "tpot_ms_p50": 5.0,
                 "output_tok_s": 1000.0,
                 "server_metrics": {"ttft_ms_mean_server": 300.0, "queue_ms_mean": 0.0,
                                    "prefill_ms_mean": p, "ttft_frontend_ms_mean": 250.0},
                 "step_timing": {"engine_steps": 100,
                                 "phases": {"engine_step": {"ms_per_step": m}}}}
                for i, (p, m) in enumerate(zip(prefill, step_ms, strict=True))]  # fmt: skip
        return {**serving_row(dtype, 32, 100.0, None), "rounds": each}

    path = write(tmp_path, {
        "command": "python -m benchmarks.serve_bench --rounds 2 --interleave",
        "rows": [rounds("auto_fa2", [40.0, 20.0], [5.0, 8.0], 0),
                 rounds("int8", [20.0, 40.0], [4.0, 10.0], 1)],
    })  # fmt: skip

    def cells(table: str) -> list[list[str]]:
        return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[4:]]

    ttft = cells(report.serving_ttft_table(path))
    assert [(c[3], c[8]) for c in ttft] == [
        ("`auto_fa2`, round 0 (1st)", "reference"), ("`auto_fa2`, round 1", "reference"),
        ("`int8`, round 0", "0.50x"), ("`int8`, round 1 (1st)", "2.00x"),
    ]  # fmt: skip
    steps = cells(report.serving_steps_table(path))
    assert [(c[3], c[6], c[-2]) for c in steps] == [
        ("`auto_fa2`, round 0 (1st)", "5.000", "reference"),
        ("`auto_fa2`, round 1", "8.000", "reference"),
        ("`int8`, round 0", "4.000", "0.80x"), ("`int8`, round 1 (1st)", "10.000", "1.25x"),
    ]  # fmt: skip


def test_serving_layer_host_table_sets_each_rounds_layer_time_against_the_baseline(
    tmp_path: Path,
) -> None:
    from benchmarks import step_timing

    assert set(report.LAYER_PHASES) == step_timing.PER_LAYER  # not its parts, ATTENTION_PARTS

    def timing(attention_us: float, update_us: float) -> dict:
        return {"engine_steps": 10, "phases": {
            "engine_step.decode": {"calls": 9, "us_per_call": 3000.0},
            "engine_step.prompt": {"calls": 1, "us_per_call": 24000.0},
            "attention_forward.prompt": {"calls": 30, "us_per_call": attention_us},
            "kv_cache_update.prompt": {"calls": 30, "us_per_call": update_us}}}  # fmt: skip

    def rounds(dtype: str, layer: list[tuple[float, float]]) -> dict:
        each = [{"round": i, "position": i, "tpot_ms_p50": 5.0, "step_timing": timing(*lu)}
                for i, lu in enumerate(layer)]  # fmt: skip
        return {**serving_row(dtype, 32, 100.0, None), "rounds": each}

    path = write(tmp_path, {"command": "x", "rows": [
        rounds("auto_fa2", [(100.0, 20.0), (150.0, 30.0)]),
        rounds("int8", [(200.0, 40.0), (150.0, 30.0)]),
        serving_row("int4", 32, 100.0, None)]})  # fmt: skip
    lines = report.serving_layer_host_table(path).splitlines()[4:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert [c[3:] for c in cells] == [
        ["`auto_fa2`, round 0 (1st)", "3.00 (9)", "24.00 (1)", "100.0", "20.0", "reference"],
        ["`auto_fa2`, round 1", "3.00 (9)", "24.00 (1)", "150.0", "30.0", "reference"],
        ["`int8`, round 0 (1st)", "3.00 (9)", "24.00 (1)", "200.0", "40.0", "2.00x"],
        ["`int8`, round 1", "3.00 (9)", "24.00 (1)", "150.0", "30.0", "1.00x"],
        ["`int4`", "n/a", "n/a", "n/a", "n/a", "n/a"],
    ]


def test_serving_attention_parts_table_splits_a_layer_call_into_its_timed_parts(
    tmp_path: Path,
) -> None:
    from benchmarks import step_timing

    assert {name for name, _ in report.ATTENTION_PARTS} == step_timing.ATTENTION_PARTS

    def timing(attention_us: float, **parts: tuple[int, float]) -> dict:
        phases = {"attention_forward.prompt": {"calls": 18, "us_per_call": attention_us}}
        for name, (calls, us) in parts.items():
            phases[f"{name}.prompt"] = {"calls": calls, "us_per_call": us}
        return {"engine_steps": 10, "phases": phases}

    fa2 = {
        **serving_row("auto_fa2", 32, 100.0, None),
        "step_timing": timing(140.0, fa2_call=(18, 100.0)),
    }
    # our kernels launched twice in each attention call (the decodes, then the rest)
    ours = {
        **serving_row("int8", 32, 100.0, None),
        "step_timing": timing(320.0, fa2_call=(18, 60.0), attention_ours=(36, 50.0)),
    }
    path = write(tmp_path, {"command": "x", "rows": [
        fa2, ours, serving_row("int4", 32, 100.0, None)]})  # fmt: skip
    lines = report.serving_attention_parts_table(path).splitlines()[4:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert [c[3:] for c in cells] == [
        ["`auto_fa2`", "140.0", "100.0", "n/a", "n/a", "40.0", "reference"],
        ["`int8`", "320.0", "60.0", "100.0", "n/a", "160.0", "2.29x"],
        ["`int4`", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a"],
    ]


def controlled(row: dict, schedule_us: float, tpot: float = 2.0) -> dict:
    """``row`` with a step timing whose host controls took ``schedule_us`` (and a tenth of it)."""
    phases = {name: {"calls": 100, "us_per_call": schedule_us / (1 if i == 0 else 10)}
              for i, (name, _) in enumerate(report.HOST_CONTROL_PHASES)}  # fmt: skip
    return {**row, "tpot_ms_p50": tpot, "step_timing": {"engine_steps": 100, "phases": phases}}


def test_serving_host_control_table_sets_vllms_own_calls_against_the_baseline(
    tmp_path: Path,
) -> None:
    from benchmarks import step_timing

    sites = {phase for *_, phase in step_timing.SITES}
    assert {name for name, _ in report.HOST_CONTROL_PHASES} <= sites
    path = write(tmp_path, {"command": "x", "rows": [
        controlled(serving_row("auto_fa2", 32, 100.0, None), 1000.0, 4.0),
        controlled(serving_row("int8", 32, 100.0, None), 1400.0, 5.2),
        # int4's pages hold other block counts: not the same scheduler work, left out
        controlled(serving_row("int4", 32, 100.0, None), 500.0, 3.0),
        serving_row("int8", 8, 100.0, None)]})  # fmt: skip
    lines = report.serving_host_control_table(path).splitlines()[4:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert [c[2:] for c in cells] == [
        ["8", "`int8`", "2.00", "n/a", "n/a", "n/a", "n/a"],
        ["32", "`auto_fa2`", "4.00", "reference", "1000 (reference)", "100 (reference)",
         "100 (reference)"],
        ["32", "`int8`", "5.20", "1.30x", "1400 (1.40x)", "140 (1.40x)", "140 (1.40x)"],
    ]  # fmt: skip


def test_a_serving_point_whose_servers_hosts_ran_unlike_says_so(tmp_path: Path) -> None:
    base = controlled(serving_row("auto_fa2", 32, 100.0, None), 1000.0)
    assert report.host_control_note(controlled(serving_row("int8", 32, 100.0, None), 1090.0),
                                    base) == ""  # fmt: skip
    unlike = controlled(serving_row("int8", 32, 100.0, None), 700.0)
    assert report.host_control_note(unlike, base) == (
        ", vLLM's `schedule` took 0.70x as long in `int8`'s server"
    )
    assert report.host_control_note(serving_row("int8", 32, 100.0, None), base) == ""
    path = write(tmp_path, {"command": "python -m benchmarks.serve_bench --models smollm2",
                            "rows": [base, unlike]})  # fmt: skip
    summary = report.serving_summary_table(newest=[path], paired=[])
    assert "one pass, vLLM's `schedule` took 0.70x as long in `int8`'s server |" in summary
    targets = report.serving_targets_table(path)
    assert "| 1.00x (vLLM's `schedule` took 0.70x as long in `int8`'s server) |" in targets


def test_a_point_in_rounds_takes_the_median_of_its_rounds_host_controls() -> None:
    def rounds(dtype: str, schedule_us: list[float]) -> dict:
        each = [{"round": i, **controlled({}, us)} for i, us in enumerate(schedule_us)]
        return {**serving_row(dtype, 32, 100.0, None), "rounds": each}

    base = rounds("auto_fa2", [1000.0, 1000.0, 1000.0])
    # per round 1.30x, 0.80x, 1.20x: the median 1.20x, where the mean would say 1.10x
    ours = rounds("int8", [1300.0, 800.0, 1200.0])
    assert report.host_control_note(ours, base) == (
        ", vLLM's `schedule` took a median of 1.20x as long in `int8`'s server"
    )
    level = rounds("int8", [1300.0, 1000.0, 950.0])  # median 1.00x
    assert report.host_control_note(level, base) == ""


def test_serving_attention_ops_table_lists_what_each_op_calls(tmp_path: Path) -> None:
    opened = {"vllm::unified_attention_with_output": {
        "calls": 60, "us_per_call": 300.0, "self_us_per_call": 180.0,
        "calls_made": [{"name": "_vllm_fa2_C::varlen_fwd", "per_call": 1.0, "us_per_call": 60.0},
                       {"name": "aten::empty", "per_call": 2.5, "us_per_call": 20.0}]}}  # fmt: skip
    path = write(tmp_path, {"command": "x", "rows": [
        {"model": "smollm2", "dtype": "int8", "concurrency": 32, "attention_ops_opened": opened},
        {"model": "smollm2", "dtype": "auto_fa2", "concurrency": 32}]})  # fmt: skip
    lines = report.serving_attention_ops_table(path).splitlines()[2:]
    assert len(lines) == 1
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells[3:] == ["`int8`", "`vllm::unified_attention_with_output`", "60", "300.0", "180.0",
                         "`_vllm_fa2_C::varlen_fwd` 60.0 (1), `aten::empty` 20.0 (2.5)"]  # fmt: skip


def test_serving_profile_steps_table_sets_gpu_time_against_host_time(tmp_path: Path) -> None:
    kinds = {"graph": {"steps": 10, "host_forward_us_p50": 400.0, "host_forward_us_mean": 500.0,
                       "gpu_us_mean": {"ours": 600.0, "flash_attention": 0.0, "gemm": 300.0,
                                       "other": 100.0}, "gpu_us_mean_total": 1000.0},
             "eager": {"steps": 2, "host_forward_us_p50": 3000.0, "host_forward_us_mean": 4000.0,
                       "gpu_us_mean": {"ours": 100.0, "flash_attention": 700.0, "gemm": 150.0,
                                       "other": 50.0}, "gpu_us_mean_total": 1000.0}}  # fmt: skip
    path = write(tmp_path, {"command": "x", "rows": [
        {"model": "gemma3", "dtype": "int8", "concurrency": 32, "by_step_kind": kinds},
        {"model": "smollm2", "dtype": "int8", "concurrency": 32, "by_step_kind": {}},  # no steps
    ]})  # fmt: skip
    lines = report.serving_profile_steps_table(path).splitlines()[2:]
    cells = [[c.strip() for c in line.strip("|").split("|")][1:] for line in lines]
    assert cells == [
        ["gemma-3-270m", "32", "`int8`", "one CUDA graph replay", "10", "0.50 (0.40)",
         "0.60 / 0.00 / 0.30 / 0.10 / 1.00", "2.00"],
        ["gemma-3-270m", "32", "`int8`", "eager or piecewise", "2", "4.00 (3.00)",
         "0.10 / 0.70 / 0.15 / 0.05 / 1.00", "0.25"],
    ]  # fmt: skip


def test_serving_steps_table_gives_host_ms_per_step_and_counts_syncs(tmp_path: Path) -> None:
    def timed(dtype: str, step_ms: float, syncs: dict | None) -> dict:
        phases = {"engine_step": {"calls": 10, "us_per_call": 1000 * step_ms,
                                  "ms_per_step": step_ms},
                  "schedule": {"calls": 10, "us_per_call": 100.0, "ms_per_step": 0.1},
                  "execute_model.decode": {"calls": 8, "us_per_call": 900.0, "ms_per_step": 0.72},
                  "execute_model.prompt": {"calls": 2, "us_per_call": 5250.0,
                                           "ms_per_step": 1.05}}  # fmt: skip
        timing = {"engine_steps": 10, "phases": phases, "sync_debug": syncs is not None,
                  "syncs": syncs or {}}  # fmt: skip
        return {**serving_row(dtype, 1, 50.0, None), "step_timing": timing}

    path = write(tmp_path, {
        "command": "python -m benchmarks.serve_bench --step-timing",
        "rows": [timed("int8", 2.5, {"a.py:3": 4, "b.py:9": 1}), timed("auto_fa2", 2.0, {}),
                 serving_row("int4", 1, 50.0, None)],
    })  # fmt: skip
    table = [ln for ln in report.serving_steps_table(path).splitlines() if ln.startswith("| Smol")]
    # FlashAttention-2 first; phases a row has not timed read n/a; execute_model by step kind as
    # ms a call (calls); syncs summed over lines
    untimed = "| n/a " * 7
    assert table == [
        "| SmolLM2-135M-Instruct | 7936 | 1 | `auto_fa2` | 2.00 | 10 | 2.000 | 0.100 "
        f"{untimed}| 0.900 (8) | 5.250 (2) | reference | 0 |",
        "| SmolLM2-135M-Instruct | 7936 | 1 | `int8` | 2.00 | 10 | 2.500 | 0.100 "
        f"{untimed}| 0.900 (8) | 5.250 (2) | 1.25x | 5 |",
        f"| SmolLM2-135M-Instruct | 7936 | 1 | `int4` | 2.00 | n/a {untimed}| n/a | n/a | n/a "
        "| n/a | n/a | not counted |",
    ]


def test_decode_ab_table_puts_each_variant_beside_main(tmp_path: Path) -> None:
    def row(variant: str, impl: str, ctx: int, ms: float) -> dict:
        return {"variant": variant, "kernel": "decode", "impl": impl, "q_heads": 4,
                "kv_heads": 1, "head_dim": 256, "batch": 8, "ctx": ctx, "ms": ms}  # fmt: skip

    path = write(tmp_path, {
        "command": "python -m benchmarks.kernels --impls int4 ; python -m benchmarks.kernels",
        "note": "One host.",
        "variants": {"main": "today's", "old": "yesterday's"},
        "rows": [row("main", "int4", 8192, 0.020), row("old", "int4", 8192, 0.025),
                 row("main", "int4", 32768, 0.040)],
    })  # fmt: skip
    text = report.decode_ab_table(path)
    assert "Variants: `main`: today's; `old`: yesterday's." in text
    table = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert table[0] == "| heads | batch | ctx | `int4` µs: `main` / `old` | `old` over `main` |"
    assert table[1:] == ["| 4/1/256 | 8 | 8192 | 20.0 / 25.0 | 1.25x |",
                         "| 4/1/256 | 8 | 32768 | 40.0 / n/a | n/a |"]  # fmt: skip


def decode_row(impl: str, ctx: int, ms: float) -> dict:
    return {"kernel": "decode", "impl": impl, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
            "batch": 8, "ctx": ctx, "ms": ms, "gbs": 1000.0}  # fmt: skip


def test_int4_decode_table_judges_the_impl_it_is_given(tmp_path: Path) -> None:
    rows = [decode_row("bf16_fa2", 8192, 2.0), decode_row("int8", 8192, 1.0),
            decode_row("int4", 8192, 0.5), decode_row("int4_tail2", 8192, 1.0)]  # fmt: skip
    path = write(tmp_path, {"command": "x", "peak_bw_gbs": 3000.0, "rows": rows})
    default = report.int4_decode_table(path)
    tail2 = report.int4_decode_table(path, "int4_tail2")
    assert "| 32/8, 128 | - | 8 | 8192 | 500.0 |" in default
    assert "| 32/8, 128 | - | 8 | 8192 | 1000.0 |" in tail2
    # the 2.2x target against FlashAttention-2: met by int4 (4x), missed by int4_tail2 (2x)
    assert "| ≥ 2.2x | 1 | 1 | 4.00x |" in default
    assert "| ≥ 2.2x | 1 | 0 | 2.00x |" in tail2
    assert "`int4_tail2`'s (>1: `int4_tail2` faster)" in tail2


def test_default_decode_note_quotes_the_closest_timing_of_the_default(tmp_path: Path) -> None:
    impls = report.KERNEL_DEFAULT_IMPL["int4"]
    missing = report._default_decode_note(tmp_path / "none.json", impls)
    assert missing == "The default's second tail page and sink page are not timed yet."
    rows = [decode_row("bf16_fa2", c, 2.0) for c in (1024, 8192)]
    rows += [decode_row("int4_tail2", 1024, 1.0), decode_row("int4_tail2", 8192, 0.5),
             decode_row("int4", 8192, 0.25)]  # fmt: skip
    note = report._default_decode_note(write(tmp_path, {"command": "x", "rows": rows}), impls)
    assert note.startswith("With the default's two tail pages (`int4_tail2`)")
    assert "3.00x (2.00-4.00x) FlashAttention-2's speed, 2 points; its sink page is not" in note
    assert "NVIDIA H200 (2026-12-05, commit `bbbbbbb`)" in note
    # a run that times int4 as it ships is quoted instead
    rows.append(decode_row("int4_sink_tail2", 8192, 1.0))
    note = report._default_decode_note(write(tmp_path, {"command": "x", "rows": rows}), impls)
    assert note.startswith("As it ships, its sink page and two tail pages (`int4_sink_tail2`)")
    assert note.endswith("2.00x (2.00-2.00x) FlashAttention-2's speed, 1 point.")


def test_serving_starts_table_gives_the_shims_compiles_a_column_where_recorded(
    tmp_path: Path,
) -> None:
    def start(dtype: str, **phases: float) -> dict:
        return {"model": "gemma3", "dtype": dtype, "host_state": "fresh", "engine_start_s": 200.0,
                "init_engine_s": 70.0, "torch_compile_s": 29.0, "graph_capture_s": 4.0,
                "kv_cache_tokens": 10, **phases}  # fmt: skip

    recorded = write(tmp_path, {"command": "c", "rows": [], "engine_starts": [
        start("int4", kernel_warmup_s=115.5), start("auto_fa2")]})  # fmt: skip
    header, _, int4, fa2 = report.serving_starts_table(recorded).splitlines()
    assert "our kernels compiled s" in header
    assert int4.endswith("| 4 | 116 | 10 |")
    assert fa2.endswith("| 4 | - | 10 |")  # a server without the shim's layers
    older = write(tmp_path, {"command": "c", "rows": [], "engine_starts": [start("int8")]})
    header, rule, row = report.serving_starts_table(older).splitlines()
    assert "our kernels" not in header
    assert header.count("|") == rule.count("|") == row.count("|") == 9


def test_warmup_compile_table_sets_each_thread_count_against_one_at_a_time(tmp_path: Path) -> None:
    path = write(tmp_path, {
        "command": "python -m benchmarks.warmup_compile --models gemma3 --threads 1,16",
        "cpus": 16,
        "rows": [{"model": "gemma3", "dtype": "int4", "threads": 1, "warmup_s": 60.0,
                  "launches": 28},
                 {"model": "gemma3", "dtype": "int4", "threads": 16, "warmup_s": 12.0,
                  "launches": 28},
                 {"model": "smollm2", "dtype": "int4", "threads": 16, "error": "a | b"}],
    })  # fmt: skip
    table = report.warmup_compile_table(path)
    assert table.startswith("NVIDIA H200 (16 CPUs), 2026-12-05, commit `bbbbbbb`, `python -m")
    assert "| gemma3 | `int4` | 2 | 1 | 28 | 60.0 | - |" in table
    assert "| gemma3 | `int4` | 2 | 16 | 28 | 12.0 | 5.0x faster |" in table
    assert "| smollm2 | `int4` | 1 | 16 | - | failed: `a \\| b` | - |" in table


def test_a_merged_files_row_is_credited_to_the_run_that_lists_it() -> None:
    doc = {"date": "2026-12-02", "git_commit": "b" * 40, "parts": [
        {"rows": "auto_fa2, int8_bf16_prefill (its int8 row was replaced by the latest run)",
         "date": "2026-12-01", "git_commit": "a" * 40}]}  # fmt: skip
    assert report._run_of_row(doc, "int8_bf16_prefill") == "2026-12-01, commit `aaaaaaa`"
    # a name only in the remark, or only as a prefix of a listed one, is the file's own run
    assert report._run_of_row(doc, "int8") == "2026-12-02, commit `bbbbbbb`"
    assert report._run_of_row(doc, "auto") == "2026-12-02, commit `bbbbbbb`"


def test_profile_kernels_table_reads_each_profiles_kernels(tmp_path: Path) -> None:
    profile = {"wall_s": 3.0, "gpu_s": 1.0, "ops": {}}
    path = write(tmp_path, {"command": "python -m benchmarks.throughput --profile", "rows": [],
                            "profiles": {
        "int8": {**profile, "kernels": {"_attn_fwd": {"gpu_s": 0.0849, "calls": 2512}}},
        "int4": {**profile, "kernels": {"_flush_pages_kernel": {"gpu_s": 0.0849, "calls": 2512}}},
        "auto_fa2": {**profile, "kernels": {}},
    }})  # fmt: skip
    lines = report.profile_kernels_table(path).splitlines()
    assert lines[0] == ("| kernel | `auto_fa2`: ms (calls, µs a call) | `int4`: ms (calls, µs a "
                        "call) | `int8`: ms (calls, µs a call) |")  # fmt: skip
    # only kernels some profile lists, in _OUR_KERNELS' order; ms in all, calls, µs a call
    assert lines[2:] == [
        "| `_attn_fwd` | not listed | not listed | 84.9 (2512, 33.8) |",
        "| `_flush_pages_kernel` | not listed | 84.9 (2512, 33.8) | not listed |",
    ]


def test_throughput_steps_table_gives_each_runs_host_phases_per_step(tmp_path: Path) -> None:
    def run(wall: float, phases: dict) -> dict:
        timing = {name: {"calls": 10, "us_per_call": 1.0, "ms_per_step": ms}
                  for name, ms in phases.items()}  # fmt: skip
        return {"ms_per_step": wall, "step_timing": {"engine_steps": 10, "phases": timing}}

    call = {"command": "python -m benchmarks.throughput --paired --step-timing", "rows": [
        {"dtype": "int8", "runs": [run(10.5, {"engine_step": 10.1, "attention_forward": 2.0})]},
        {"dtype": "int4", "runs": [run(14.0, {"engine_step": 13.9, "int4_write": 0.4}),
                                   {"ms_per_step": 20.0}]},
    ]}  # fmt: skip
    path = write(tmp_path, {"model": "gemma-3-270m", "calls": [call]})
    lines = report.throughput_steps_table(path).splitlines()
    assert lines[2].startswith("| call | config | run | wall ms a step | engine step | schedule |")
    # phases in THROUGHPUT_STEP_PHASES' order; a run without step timing reads n/a throughout
    assert lines[4:] == [
        "| 1 | `int8` | 1 | 10.50 | 10.10 | n/a | n/a | 2.00 | n/a | n/a | n/a | n/a |",
        "| 1 | `int4` | 1 | 14.00 | 13.90 | n/a | n/a | n/a | 0.40 | n/a | n/a | n/a |",
        "| 1 | `int4` | 2 | 20.00 | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a |",
    ]


def test_step_kinds_table_counts_decode_steps_that_called_attention_on_the_host(
    tmp_path: Path,
) -> None:
    def run(decode_attention_calls: int) -> dict:
        phases = {
            "engine_step.decode": {"calls": 100, "us_per_call": 5000.0},
            "execute_model.decode": {"calls": 100, "us_per_call": 2000.0},
            "engine_step.prompt": {"calls": 10, "us_per_call": 30000.0},
            "execute_model.prompt": {"calls": 10, "us_per_call": 20000.0},
            "attention_forward.prompt": {"calls": 180, "us_per_call": 300.0},  # 18 layers
        }
        if decode_attention_calls:
            phases["attention_forward.decode"] = {"calls": decode_attention_calls,
                                                  "us_per_call": 170.0}  # fmt: skip
        return {"gen_tok_s": 6000.4, "mean_running": 100.04,
                "step_timing": {"engine_steps": 110, "phases": phases}}  # fmt: skip

    call = {"command": "python -m benchmarks.throughput --paired --step-timing", "rows": [
        {"dtype": "int8", "runs": [run(0)]}, {"dtype": "int4", "runs": [run(18 * 60)]},
    ]}  # fmt: skip
    lines = report.step_kinds_table(write(tmp_path, {"model": "m", "calls": [call]})).splitlines()
    assert lines[2].startswith(
        "| call | config | run | gen tok/s | requests running | decode steps"
    )
    # 60 decode steps' attention calls of 18 layers each (the layers: 180 calls over 10 steps)
    assert lines[4:] == [
        "| 1 | `int8` | 1 | 6000 | 100.0 | 100 | 0 | 5.00 | 2.00 | 10 | 30.00 | 20.00 |",
        "| 1 | `int4` | 1 | 6000 | 100.0 | 100 | 60 | 5.00 | 2.00 | 10 | 30.00 | 20.00 |",
    ]


def test_step_cost_table_divides_each_runs_step_by_its_requests_and_tokens(tmp_path: Path) -> None:
    def run(gen: float, ms: float, running: float, tokens: float) -> dict:
        return {"gen_tok_s": gen, "ms_per_step": ms, "mean_running": running,
                "tokens_per_step": tokens}  # fmt: skip

    call = {"command": "python -m benchmarks.throughput --paired --step-stats", "rows": [
        {"dtype": "int8", "runs": [run(7000.4, 10.0, 80.0, 2500.0)]},
        {"dtype": "int4", "runs": [run(6000.0, 14.0, 100.0, 3500.0), run(4000.0, 21.0, 105.0, 3500.0)]},
    ]}  # fmt: skip
    path = write(tmp_path, {"model": "gemma-3-270m", "calls": [call]})
    lines = report.step_cost_table(path).splitlines()
    assert lines[2].startswith("| call | config | run | gen tok/s | ms a step | requests running |")
    # µs a step per running request = ms a step / requests x 1000; per 1000 tokens likewise
    assert lines[4:] == [
        "| 1 | `int8` | 1 | 7000 | 10.00 | 80.0 | 125 | 2500 | 4.00 |",
        "| 1 | `int4` | 1 | 6000 | 14.00 | 100.0 | 140 | 3500 | 4.00 |",
        "| 1 | `int4` | 2 | 4000 | 21.00 | 105.0 | 200 | 3500 | 6.00 |",
    ]
    # a details file without calls: its rows, each run of them
    single = write(tmp_path, {"model": "m", "command": "python -m benchmarks.throughput",
                              "rows": [{"dtype": "auto_fa2", **run(5000.0, 6.0, 40.0, 1300.0)}]})  # fmt: skip
    assert report.step_cost_table(single).splitlines()[4] == (
        "| 1 | `auto_fa2` | 1 | 5000 | 6.00 | 40.0 | 150 | 1300 | 4.62 |"
    )
