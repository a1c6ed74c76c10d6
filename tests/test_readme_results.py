"""The docs quote the result files: each generated table must appear verbatim where it belongs."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _report():
    spec = importlib.util.spec_from_file_location("report", REPO / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Where each table is quoted: what a user chooses by in the README, every current measurement in
# docs/results.md, superseded ones with their reasoning in docs/measurement-history.md.
README, RESULTS, HISTORY = "README.md", "docs/results.md", "docs/measurement-history.md"
WHERE = {
    "headline": README,
    "dtype_choice": README,
    "serving_summary": README,
    "accuracy": RESULTS,
    "accuracy_gemma3": RESULTS,
    "accuracy_chunk16": RESULTS,
    "accuracy_gemma3_chunk16": RESULTS,
    "accuracy_gemma3_chunk16_int4_tails": RESULTS,
    "accuracy_chunk16_int4_tails": RESULTS,
    "kernel_speed": RESULTS,
    "kernel_speed_targets": RESULTS,
    "kernel_speed_smollm2_1024_seqs": RESULTS,
    "decode_issue_budget": RESULTS,
    "continuations": RESULTS,
    "serving_gemma3_auto_fa2_32k": RESULTS,
    "serving_smollm2_dda1a88": RESULTS,
    "serving_ttft_smollm2_dda1a88": RESULTS,
    "serving_steps_smollm2_dda1a88": RESULTS,
    "serving_starts_smollm2_dda1a88": RESULTS,
    "tune_decode": RESULTS,
    "tune_decode_9_3_64": RESULTS,
    "tune_decode_4_1_256": RESULTS,
    "tune_decode_16_8_256": RESULTS,
    "tune_decode_int4_32_8_128": RESULTS,
    "tune_decode_int4_4_1_256": RESULTS,
    "tune_decode_int4_9_3_64": RESULTS,
    "int4_decode": RESULTS,
    "int4_decode_head256": RESULTS,
    "int4_decode_h100": RESULTS,
    "int4_decode_head64": RESULTS,
    "int4_decode_h100_76e0410": HISTORY,
    "kernel_speed_targets_h100": RESULTS,
    "kernel_speed_head256_h100": RESULTS,
    "kernel_speed_targets_head256_h100": RESULTS,
    "decode_ab_int8_head256": RESULTS,
    "decode_ab_int8_pairs": RESULTS,
    "decode_ab_int4_tail_tile": RESULTS,
    "int4_decode_loops": RESULTS,
    "decode_stalls": RESULTS,
    "decode_stalls_4_1_256": RESULTS,
    "decode_stalls_4_1_256_b8": RESULTS,
    "decode_stalls_16_8_256": RESULTS,
    "decode_stalls_16_8_256_int8_scales_pagewise": RESULTS,
    "decode_ab_head256": RESULTS,
    "launch_overhead": RESULTS,
    "warmup_compile": RESULTS,
    "warmup_compile_sm80": RESULTS,
    "host_overhead": RESULTS,
    "host_overhead_groups": RESULTS,
    "throughput": RESULTS,
    "throughput_1k_paired": RESULTS,
    "throughput_int4": RESULTS,
    "throughput_int4_8465ab0": RESULTS,
    "throughput_int4_18280da": RESULTS,
    "throughput_int4_gemma3": RESULTS,
    "int4_prefill": RESULTS,
    "int4_decode_parts_head64": RESULTS,
    "int4_prefill_gemma3": RESULTS,
    "kernel_write_gemma3": RESULTS,
    "throughput_int4_gemma3_profiled": RESULTS,
    "throughput_int4_gemma3_profile_kernels": RESULTS,
    "throughput_int4_gemma3_paired": RESULTS,
    "throughput_int4_gemma3_paired_steps": RESULTS,
    "throughput_int4_gemma3_step_kinds": RESULTS,
    "throughput_int4_gemma3_step_phases": RESULTS,
    "int4_write_split_flush": RESULTS,
    "int4_decode_keys_together": RESULTS,
    "accuracy_bf16_prefill": RESULTS,
    "serving_smollm2_55cdbef": RESULTS,
    "serving_ttft_smollm2_55cdbef": RESULTS,
    "serving_steps_smollm2_55cdbef": RESULTS,
    "serving_starts_smollm2_55cdbef": RESULTS,
    "serving_gemma3_55cdbef": RESULTS,
    "serving_ttft_gemma3_55cdbef": RESULTS,
    "serving_steps_gemma3_55cdbef": RESULTS,
    "serving_starts_gemma3_55cdbef": RESULTS,
    "serving_gemma3_ce3fe6a": RESULTS,
    "serving_ttft_gemma3_ce3fe6a": RESULTS,
    "serving_steps_gemma3_ce3fe6a": RESULTS,
    "serving_layers_gemma3_ce3fe6a": RESULTS,
    "serving_starts_gemma3_ce3fe6a": RESULTS,
    "serving_gemma3_parts_14914a9": RESULTS,
    "serving_ttft_gemma3_parts_14914a9": RESULTS,
    "serving_steps_gemma3_parts_14914a9": RESULTS,
    "serving_layers_gemma3_parts_14914a9": RESULTS,
    "serving_parts_gemma3_parts_14914a9": RESULTS,
    "serving_control_gemma3_parts_14914a9": RESULTS,
    "serving_starts_gemma3_parts_14914a9": RESULTS,
    "serving_gemma3_parts_a01bc15": RESULTS,
    "serving_ttft_gemma3_parts_a01bc15": RESULTS,
    "serving_steps_gemma3_parts_a01bc15": RESULTS,
    "serving_layers_gemma3_parts_a01bc15": RESULTS,
    "serving_parts_gemma3_parts_a01bc15": RESULTS,
    "serving_control_gemma3_parts_a01bc15": RESULTS,
    "serving_starts_gemma3_parts_a01bc15": RESULTS,
    "serving_llama3_8b_shape_c128_998fbe7": RESULTS,
    "serving_ttft_llama3_8b_shape_c128_998fbe7": RESULTS,
    "serving_steps_llama3_8b_shape_c128_998fbe7": RESULTS,
    "serving_layers_llama3_8b_shape_c128_998fbe7": RESULTS,
    "serving_parts_llama3_8b_shape_c128_998fbe7": RESULTS,
    "serving_control_llama3_8b_shape_c128_998fbe7": RESULTS,
    "serving_starts_llama3_8b_shape_c128_998fbe7": RESULTS,
    "serving_gemma3_14f89bb": RESULTS,
    "serving_ttft_gemma3_14f89bb": RESULTS,
    "serving_steps_gemma3_14f89bb": RESULTS,
    "serving_starts_gemma3_14f89bb": RESULTS,
    "serving_llama3_8b_shape_4_layers_bb40257": RESULTS,
    "serving_rounds_llama3_8b_shape_4_layers_bb40257": RESULTS,
    "serving_ttft_llama3_8b_shape_4_layers_bb40257": RESULTS,
    "serving_steps_llama3_8b_shape_4_layers_bb40257": RESULTS,
    "serving_kinds_llama3_8b_shape_4_layers_bb40257": RESULTS,
    "serving_starts_llama3_8b_shape_4_layers_bb40257": RESULTS,
    "serving_llama3_8b_shape_4_layers_8465ab0": RESULTS,
    "serving_ttft_llama3_8b_shape_4_layers_8465ab0": RESULTS,
    "serving_steps_llama3_8b_shape_4_layers_8465ab0": RESULTS,
    "serving_starts_llama3_8b_shape_4_layers_8465ab0": RESULTS,
    "serving": RESULTS,
    "serving_starts": RESULTS,
    "serving_ttft": RESULTS,
    "serving_targets": RESULTS,
    "serving_gemma3": RESULTS,
    "serving_ttft_gemma3": RESULTS,
    "serving_starts_gemma3": RESULTS,
    "serving_steps_gemma3": RESULTS,
    "serving_llama3_8b_shape": RESULTS,
    "serving_ttft_llama3_8b_shape": RESULTS,
    "serving_starts_llama3_8b_shape": RESULTS,
    "serving_profile": RESULTS,
    "serving_profile_steps": RESULTS,
    "serving_llama3_8b_shape_18280da": RESULTS,
    "serving_rounds_llama3_8b_shape_18280da": RESULTS,
    "serving_ttft_llama3_8b_shape_18280da": RESULTS,
    "serving_steps_llama3_8b_shape_18280da": RESULTS,
    "serving_layers_llama3_8b_shape_18280da": RESULTS,
    "serving_starts_llama3_8b_shape_18280da": RESULTS,
    "serving_gemma3_18280da": RESULTS,
    "serving_rounds_gemma3_18280da": RESULTS,
    "serving_ttft_gemma3_18280da": RESULTS,
    "serving_steps_gemma3_18280da": RESULTS,
    "serving_layers_gemma3_18280da": RESULTS,
    "serving_starts_gemma3_18280da": RESULTS,
    "serving_smollm2_35ad204": RESULTS,
    "serving_rounds_smollm2_35ad204": RESULTS,
    "serving_ttft_smollm2_35ad204": RESULTS,
    "serving_steps_smollm2_35ad204": RESULTS,
    "serving_layers_smollm2_35ad204": RESULTS,
    "serving_starts_smollm2_35ad204": RESULTS,
    "serving_llama3_8b_shape_35ad204": RESULTS,
    "serving_rounds_llama3_8b_shape_35ad204": RESULTS,
    "serving_ttft_llama3_8b_shape_35ad204": RESULTS,
    "serving_steps_llama3_8b_shape_35ad204": RESULTS,
    "serving_layers_llama3_8b_shape_35ad204": RESULTS,
    "serving_starts_llama3_8b_shape_35ad204": RESULTS,
    "serving_attention_ops": RESULTS,
    "reliability": RESULTS,
    "int4_format_simulation": RESULTS,
    "int4_format_simulation_gemma3": RESULTS,
    "int4_tail_simulation_gemma3": RESULTS,
    "int4_tail_simulation": RESULTS,
    "int4_varnorm_simulation": RESULTS,
    "int4_varnorm_simulation_gemma3": RESULTS,
    "int4_first_page_simulation": RESULTS,
    "int4_first_page_simulation_gemma3": RESULTS,
    "int4_greedy_simulation": RESULTS,
    "int4_greedy_simulation_other_prompts": RESULTS,
    "int4_greedy_simulation_gemma3": RESULTS,
    "int4_greedy_simulation_gemma3_other_prompts": RESULTS,
    "int4_tail_pages_simulation": RESULTS,
    "int4_tail_pages_simulation_gemma3": RESULTS,
    "int4_greedy_simulation_tail_pages": RESULTS,
    "int4_greedy_simulation_tail_pages_gemma3": RESULTS,
    "int8_group_simulation_gemma3": RESULTS,
    "int8_group_simulation": RESULTS,
    "int8_static_simulation_gemma3": RESULTS,
    "int8_static_simulation": RESULTS,
    "gpu_test_runs": RESULTS,
    "tail_pool_capacity": RESULTS,
    "kernel_speed_int4": HISTORY,
    "serving_smollm2_75eff26": HISTORY,
    "serving_rounds_smollm2_75eff26": HISTORY,
    "serving_ttft_smollm2_75eff26": HISTORY,
    "serving_steps_smollm2_75eff26": HISTORY,
    "serving_starts_smollm2_75eff26": HISTORY,
    "serving_gemma3_75eff26": HISTORY,
    "serving_steps_gemma3_75eff26": HISTORY,
    "serving_starts_gemma3_75eff26": HISTORY,
    "serving_smollm2_39e697b": HISTORY,
    "serving_steps_smollm2_39e697b": HISTORY,
    "serving_gemma3_39e697b": HISTORY,
    "serving_steps_gemma3_39e697b": HISTORY,
    "serving_gemma3_90d00a7": HISTORY,
    "serving_ttft_gemma3_90d00a7": HISTORY,
    "serving_starts_gemma3_90d00a7": HISTORY,
    "serving_gemma3_47429f4": HISTORY,
    "serving_ttft_gemma3_47429f4": HISTORY,
    "serving_starts_gemma3_47429f4": HISTORY,
    "serving_steps_gemma3_47429f4": HISTORY,
    "serving_gemma3_h200": HISTORY,
    "serving_steps_gemma3_h200": HISTORY,
    "serving_gemma3_2b8b82b": HISTORY,
    "serving_ttft_gemma3_2b8b82b": HISTORY,
    "serving_2026_12_01": HISTORY,
    "serving_starts_2026_12_01": HISTORY,
    "serving_int8_rerun": HISTORY,
    "serving_2026_12_02": HISTORY,
    "serving_starts_2026_12_02": HISTORY,
    "int4_decode_one_page_steps": HISTORY,
    "int4_decode_two_page_steps": HISTORY,
    "throughput_1k_repeats": HISTORY,
    "throughput_1k_repeats_pooled": HISTORY,
    "throughput_1k_repeats_with_replays": HISTORY,
    "throughput_1k_single_runs": HISTORY,
    "throughput_1k_single_runs_pooled": HISTORY,
    "throughput_1k_profiled": HISTORY,
    "throughput_1k_direct_launches": HISTORY,
}


@pytest.mark.parametrize("table", sorted(_report().TABLES))
def test_docs_quote_result_file(table: str) -> None:
    assert table in WHERE, f"say in WHERE which document quotes `{table}`"
    generated = _report().TABLES[table]()
    doc = WHERE[table]
    assert generated in (REPO / doc).read_text(), (
        f"regenerate with `python -m benchmarks.report {table}` and quote it in {doc}"
    )


def test_result_files_say_when_and_where_they_were_measured() -> None:
    # a reader trusts a number that names its GPU, command, date and commit
    for path in sorted((REPO / "benchmarks" / "results").glob("*.json")):
        if path.stem.endswith("_details"):  # a run's per-configuration companion
            assert path.with_name(path.name.replace("_details", "")).exists(), path.name
            continue
        doc = json.loads(path.read_text())
        measured = doc["rows"] if path.name == "gpu_test_runs.json" else [doc]
        for entry in measured:
            missing = {"gpu", "date", "git_commit"} - set(entry)
            assert not missing, f"{path.name}: no {', '.join(sorted(missing))}"
            assert len(entry["git_commit"]) == 40, path.name
            assert "command" in entry or "calls" in entry or "settings" in entry, path.name


def test_short_commands_keep_the_script_or_module_and_drop_machine_paths() -> None:
    short = _report()._short
    assert short("/usr/bin/python3 benchmarks/x.py --out /tmp/a.json --n 3") == (
        "python benchmarks/x.py --n 3"
    )
    assert short("python -m benchmarks.kv_quant_sim --model /tmp/g --model-name 'Gemma 3'") == (
        "python -m benchmarks.kv_quant_sim --model-name 'Gemma 3'"
    )


def row(kernel: str, impl: str, batch: int, ctx: int, ms: float, **extra) -> dict:
    """A kernels.json row at the 32/8, D=128 shape (``gbs`` 900 unless given)."""
    shape = {"q_heads": 32, "kv_heads": 8, "head_dim": 128}
    return {"kernel": kernel, "impl": impl, **shape, "batch": batch, "ctx": ctx, "ms": ms,
            "gbs": 900.0, **extra}  # fmt: skip


def test_kernels_table_rows_for_the_fa2_prefill_path_and_consecutive_writes(tmp_path) -> None:
    rows = [
        row("prefill", "bf16_fa2", 1, 8192, 1.0),
        row("prefill", "int8", 1, 8192, 2.0),
        row("prefill", "int8_fa2", 1, 8192, 1.25),
        row("prefill", "int8_static_fa2", 1, 8192, 1.1),
        row("write", "bf16_fa2", 16384, 0, 0.03, slots="consecutive"),
        row("write", "int8", 16384, 0, 0.02, slots="consecutive"),
        row("write", "bf16_fa2", 256, 0, 0.003, slots="random"),
        row("write", "int8", 256, 0, 0.006, slots="random"),
    ]
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"gpu": "G", "command": "x", "peak_bw_gbs": 1.0, "rows": rows}))
    lines = _report().kernel_speed_table(path).splitlines()[5:]
    assert [line.split(" | ")[0] for line in lines] == [
        "| prefill", "| prefill, gather + FA2", "| write", "| write, consecutive slots",
    ]  # fmt: skip
    # ours over FA2: 0.50x for the Triton kernel, 0.80x for gather + FA2; static via FA2 0.91x
    assert "| 2000.0 | - | 0.50x |" in lines[0]
    assert "| 1250.0 | - | 0.80x |" in lines[1] and lines[1].endswith("| 0.91x |")  # no int4 col
    assert "| 16384 | - | 20.0 | - | 1.50x |" in lines[3]


def test_kernel_targets_count_the_rows_each_target_applies_to(tmp_path) -> None:
    rows = [
        row("decode", "bf16_fa2", 8, 8192, 2.0), row("decode", "int8", 8, 8192, 1.0),
        row("decode", "bf16_fa2", 32, 8192, 3.0), row("decode", "int8", 32, 8192, 2.0),
        # batch 1 and 4K are outside the long-decode target; 1K has its own
        row("decode", "bf16_fa2", 1, 8192, 1.0), row("decode", "int8", 1, 8192, 1.0),
        row("decode", "bf16_fa2", 8, 4096, 1.0), row("decode", "int8", 8, 4096, 1.0),
        row("decode", "bf16_fa2", 8, 1024, 0.9), row("decode", "int8", 8, 1024, 1.0),
        row("prefill", "bf16_fa2", 1, 8192, 1.0), row("prefill", "bf16", 1, 8192, 4.0),
        row("prefill", "int8", 1, 8192, 2.0), row("prefill", "int8_fa2", 1, 8192, 1.0),
        row("write", "bf16_fa2", 256, 0, 0.003, slots="random"),
        row("write", "int8", 256, 0, 0.0033, slots="random"),
        # consecutive slots are not the decode-step write the target means
        row("write", "bf16_fa2", 16384, 0, 0.03, slots="consecutive"),
        row("write", "int8", 16384, 0, 0.09, slots="consecutive"),
    ]  # fmt: skip
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"gpu": "G", "command": "x", "peak_bw_gbs": 1000.0, "rows": rows}))
    table = {line.split(" | ")[0][2:]: line.split(" | ")[2:]
             for line in _report().kernel_speed_targets_table(path).splitlines() if line.startswith("| ")}  # fmt: skip
    # rows, met, min, median, max
    assert table["decode, ctx ≥ 8K, batch ≥ 8: vs `bf16_fa2`"] == [
        "2", "1", "1.50x", "1.75x", "2.00x |"]  # fmt: skip
    assert table["decode, ctx ≥ 8K, batch ≥ 8: % of copy bandwidth"][:2] == ["2", "2"]
    assert table["decode, ctx 1K: vs `bf16_fa2`"][:3] == ["1", "0", "0.90x"]
    assert table["prefill, our Triton kernel: vs `bf16_fa2`"][:3] == ["1", "0", "0.50x"]
    assert table["prefill, gather + FA2: vs `bf16` (Triton)"][:3] == ["1", "1", "4.00x"]
    assert table["write, 256 random slots: BF16 time / ours"][:3] == ["1", "1", "0.91x"]


def test_parse_profile_reads_wall_gpu_total_and_op_rows(tmp_path) -> None:
    cells = ["vllm::unified_kv_cache_update", "5.00%", "700.000ms", "6.00%", "800.000ms",
             "261.438us", "0.000us", "0.00%", "0.000us", "0.000us", "3060"]  # fmt: skip
    kernel = ["_attn_fwd", "0.00%", "0.000us", "0.00%", "0.000us", "0.000us", "532.363ms",
              "35.31%", "532.363ms", "124.968us", "4260"]  # fmt: skip
    text = "\n".join(
        [
            "profiled generate: 1100 prompts, 64 output tokens each, 6.16 s wall (profiler ...)",
            "",
            "-----  -----",
            "  ".join(cells),
            "  ".join(kernel),
            "-----  -----",
            "Self CPU time total: 4.772s",
            "Self CUDA time total: 1.508s",
        ]
    )
    path = tmp_path / "profile_int8_1024.txt"
    path.write_text(text)
    prof = _report().parse_profile(path)
    assert prof["wall_s"] == 6.16 and prof["gpu_s"] == 1.508
    assert prof["ops"]["vllm::unified_kv_cache_update"]["cpu_total"] == "800.000ms"
    assert prof["ops"]["_attn_fwd"]["calls"] == "4260"
    # what a result file keeps of it: the attention ops' host time and our kernels' GPU time,
    # in seconds
    assert _report().profile_summary(path) == {
        "source": "profile_int8_1024.txt", "wall_s": 6.16, "gpu_s": 1.508,
        "ops": {"vllm::unified_kv_cache_update": {"cpu_total_s": 0.8, "calls": 3060}},
        "kernels": {"_attn_fwd": {"gpu_s": 0.532363, "calls": 4260}},
    }  # fmt: skip


def _accuracy_row(label: str, dtype: str, prefill: str, dppl: float, tokens: int) -> dict:
    return {"label": label, "kv_cache_dtype": dtype, "prefill": prefill, "ppl": 10.0,
            "dppl_pct": dppl, "dppl_se_pct": 0.01, "top1_agree": 0.9, "kld": 0.001,
            "greedy_agree": 0.5, "greedy_agree_se": 0.02, "kv_cache_tokens": tokens}  # fmt: skip


def test_dtype_choice_judges_a_cache_only_by_rows_that_read_its_pages(tmp_path) -> None:
    rows = [
        _accuracy_row("auto", "auto", "pages", 0.0, 1000),
        _accuracy_row("int8_per_token_head", "int8_per_token_head", "pages", 0.08, 1880),
        # the default prefill's row may not stand in for the cache's
        _accuracy_row("int8", "int8", "bf16", 0.003, 1940),
        _accuracy_row("int8_static_bf16_prefill", "int8_static", "bf16", 0.06, 2000),
        # a format the dtype no longer stores, kept for the record
        _accuracy_row("int4_replaced_format", "int4", "pages", 6.4, 3560) | {"format": "old"},
    ]
    acc = tmp_path / "accuracy.json"
    acc.write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "corpus": "c.txt", "tokens": 5,
                               "gpu": "G", "command": "x", "date": "d", "git_commit": "a" * 40,
                               "rows": rows}))  # fmt: skip
    kernels = tmp_path / "kernels.json"
    decode = [row("decode", impl, 8, 8192, ms) for impl, ms in
              (("bf16_fa2", 2.0), ("int8", 1.0), ("upstream_int8_pth", 4.0))]  # fmt: skip
    kernels.write_text(json.dumps({"gpu": "G", "command": "x", "peak_bw_gbs": 1.0, "rows": decode}))
    lines = _report().dtype_choice_table((acc,), kernels, tmp_path / "none.json").splitlines()
    cells = {line.split(" | ")[0][3:-1]: line.split(" | ")[2:] for line in lines
             if line.startswith("| `")}  # fmt: skip
    assert cells["int8"] == ["1.94x", "not measured", "not measured", "2.00x (2.00-2.00x) |"]
    assert cells["int8_per_token_head"][1:] == ["+0.080% ± 0.010", "0.500 ± 0.020",
                                                "0.50x (0.50-0.50x) |"]  # fmt: skip
    # no row served today's int4: capacity from the catalogue at the model's head size, no speed
    assert cells["int4"] == ["3.56x (catalogue)", "not measured", "not measured", "not measured |"]
    # int4's decode from its own run's file, named under the table
    int4 = tmp_path / "kernels_int4.json"
    int4.write_text(json.dumps({"gpu": "G", "command": "y", "peak_bw_gbs": 1.0, "rows": [
        row("decode", "bf16_fa2", 8, 8192, 2.0), row("decode", "int4", 8, 8192, 2.5)]}))  # fmt: skip
    with_int4 = _report().dtype_choice_table((acc,), kernels, int4)
    assert (
        "| `int4` | experimental | 3.56x (catalogue) | not measured | not measured | 0.80x "
        "(0.80-0.80x), 1 point |" in with_int4
    )
    assert "`int4`'s decode: its own run, [`kernels_int4.json`]" in with_int4
    assert lines[-1].startswith("`int8_static` through the pages is not measured yet on "
                                "SmolLM2-135M-Instruct; with the default prefill "
                                "(`int8_static_bf16_prefill`): ΔPPL +0.060%")  # fmt: skip


def test_dtype_choice_puts_each_models_measure_side_by_side(tmp_path) -> None:
    def acc(name: str, model: str, int8_dppl: float, int8_tokens: int) -> Path:
        rows = [_accuracy_row("auto", "auto", "pages", 0.0, 1000),
                _accuracy_row("int8", "int8", "pages", int8_dppl, int8_tokens)]  # fmt: skip
        path = tmp_path / name
        path.write_text(json.dumps({"model": model, "corpus": "c.txt", "tokens": 5, "gpu": "G",
                                    "command": "x", "date": "d", "git_commit": "a" * 40,
                                    "rows": rows}))  # fmt: skip
        return path

    kernels = tmp_path / "kernels.json"
    decode = [row("decode", impl, 8, 8192, ms) for impl, ms in (("bf16_fa2", 2.0), ("int8", 1.0))]
    kernels.write_text(json.dumps({"gpu": "G", "command": "x", "peak_bw_gbs": 1.0, "rows": decode}))
    paths = (
        acc("a.json", "SmolLM2-135M-Instruct", 0.08, 1940),
        acc("b.json", "gemma-3-270m", 0.5, 1980),
    )
    table = _report().dtype_choice_table(paths, kernels, tmp_path / "none.json")
    int8 = next(line for line in table.splitlines() if line.startswith("| `int8` |"))
    # capacity, ΔPPL, greedy: the first model's, then the second's; one value when they agree
    assert int8.split(" | ")[2:5] == ["1.94x / 1.98x", "+0.080% ± 0.010 / +0.500% ± 0.010",
                                      "0.500 ± 0.020"]  # fmt: skip
    assert "SmolLM2-135M-Instruct (head size 64" in table and "gemma-3-270m (head size 256" in table


def test_launch_overhead_table_shows_each_launch_path_measured(tmp_path) -> None:
    base = {"command": "python3 benchmarks/launch_overhead.py", "gpu": "G", "triton": "3.6.0"}
    old = {f"{n}_host_us": v for n, v in (("noop", 17.6), ("write_kv_cache", 46.3),
                                          ("paged_attention", 87.6))}  # fmt: skip
    path, wrappers = tmp_path / "lo.json", tmp_path / "missing.json"
    path.write_text(json.dumps(base | old))
    assert _report().launch_overhead_table(path, wrappers).splitlines()[-1] == (
        "| `paged_attention` (decode) | 87.6 |"
    )
    path.write_text(json.dumps(base | old | {k.replace("_host", "_direct_host"): v / 4
                                             for k, v in old.items()}))  # fmt: skip
    wrappers.write_text(json.dumps({"command": "python3 x --stub-launches", "noop_wrapper_us": 0.1,
                                    "write_kv_cache_wrapper_us": 5.0,
                                    "paged_attention_wrapper_us": 10.0}))  # fmt: skip
    lines = _report().launch_overhead_table(path, wrappers).splitlines()
    assert lines[2].count("|") == 5  # call + three columns
    assert lines[-1] == "| `paged_attention` (decode) | 87.6 | 21.9 | 10.0 |"
    replays = {"write_kv_cache_replay_host_us": 8.0, "paged_attention_replay_host_us": 9.0}
    path.write_text(json.dumps(json.loads(path.read_text()) | replays))
    lines = _report().launch_overhead_table(path, wrappers).splitlines()
    assert lines[-3] == "| a 2-argument Triton kernel | 17.6 | 4.4 | - | 0.1 |"  # no replay
    assert lines[-1] == "| `paged_attention` (decode) | 87.6 | 21.9 | 9.0 | 10.0 |"


def test_paired_runs_table_lists_each_turn_pair(tmp_path) -> None:
    runs_a = [
        {"gen_tok_s": 100.0, "host_probe_ms": 8.0},
        {"gen_tok_s": 50.0, "host_probe_ms": 16.0},
    ]
    runs_b = [
        {"gen_tok_s": 110.0, "host_probe_ms": 8.1},
        {"gen_tok_s": 60.0, "host_probe_ms": 15.0},
    ]
    call = {
        "command": "python3 benchmarks/throughput.py --paired --repeats 2",
        "rows": [
            {"dtype": "auto_fa2", "ctx": 1024, "runs": runs_a},
            {"dtype": "int8", "ctx": 1024, "runs": runs_b},
        ],
        "paired": [
            {"a": "auto_fa2", "b": "int8", "ctx": 1024, "ratios": [1.1, 1.2], "median_ratio": 1.1,
             "order": [["auto_fa2", "int8"], ["int8", "auto_fa2"]]}
        ],
    }  # fmt: skip
    measurement = {"gpu": "G", "model": "M", "date": "2026-12-01", "git_commit": "a" * 40}
    path = tmp_path / "paired.json"
    path.write_text(json.dumps(measurement | {"calls": [call]}))
    table = _report().paired_runs_table(path).splitlines()
    assert table[0].endswith(
        "Calls, in order: 1. `python benchmarks/throughput.py --paired --repeats 2`."
    )
    assert table[4] == "| 1 | 1024 | 1 | `auto_fa2` `int8` | 100 (8.0) | 110 (8.1) | 1.10x |"
    assert table[5] == "| 1 | 1024 | 2 | `int8` `auto_fa2` | 50 (16.0) | 60 (15.0) | 1.20x |"
    assert table[6].endswith("| A = `auto_fa2`, B = `int8` | | | **1.10x** |")
    assert len(table) == 7
    # a second call: its own lines, then one line over every pair of both calls
    second = json.loads(json.dumps(call))
    second["paired"][0] |= {"ratios": [0.9, 1.3], "median_ratio": 0.9}
    path.write_text(json.dumps(measurement | {"calls": [call, second]}))
    table = _report().paired_runs_table(path).splitlines()
    assert len(table) == 11 and table[9].startswith("| 2 | 1024 | median |")
    assert table[10] == (
        "| all calls | 1024 | median of 4 | A = `auto_fa2`, B = `int8` | | | **1.10x** |"
    )


def test_dtype_choice_takes_a_dtypes_cells_from_the_first_file_of_its_model_that_has_it(
    tmp_path,
) -> None:
    def acc(name: str, rows: list[dict]) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({"model": "gemma-3-270m", "corpus": "c.txt", "tokens": 5,
                                    "gpu": "G", "command": name, "date": "d",
                                    "git_commit": "a" * 40, "rows": rows}))  # fmt: skip
        return path

    decoded = acc("chunk16.json", [
        _accuracy_row("auto", "auto", "pages", 0.0, 1000),
        _accuracy_row("int8", "int8", "pages", 0.14, 1940),
    ])  # fmt: skip
    prompts = acc("chunk512.json", [
        _accuracy_row("auto", "auto", "pages", 0.0, 1000),
        # the dtype's older format, kept for the record: never a cell
        _accuracy_row("int8_scale_per_head", "int8", "pages", 0.51, 1980) | {"format": "old"},
        _accuracy_row("int8_static", "int8_static", "pages", 1.8, 2000),
    ])  # fmt: skip
    kernels = tmp_path / "kernels.json"
    kernels.write_text(json.dumps({"gpu": "G", "command": "x", "peak_bw_gbs": 1.0, "rows": [
        row("decode", "bf16_fa2", 8, 8192, 2.0), row("decode", "int8", 8, 8192, 1.0)]}))  # fmt: skip
    table = _report().dtype_choice_table(((decoded, prompts),), kernels, tmp_path / "none.json")
    cells = {line.split(" | ")[0][3:-1]: line.split(" | ")[2:5] for line in table.splitlines()
             if line.startswith("| `")}  # fmt: skip
    assert cells["int8"] == ["1.94x", "+0.140% ± 0.010", "0.500 ± 0.020"]
    assert cells["int8_static"] == ["2.00x", "+1.800% ± 0.010", "0.500 ± 0.020"]
    assert (
        "[`chunk16.json`]" in table and "where it has no row of a dtype, [`chunk512.json`]" in table
    )


def test_greedy_simulation_table_names_its_prompts_and_the_gpus_agreement_on_them(
    tmp_path,
) -> None:
    rows = [
        {"variant": "bf16", "greedy_agree": 1.0, "greedy_agree_se": 0.0, "greedy_seq_agree": 1.0,
         "ratio_vs_versus": 2.0, "ratio_se": 0.3},
        {"variant": "int8", "greedy_agree": 0.5, "greedy_agree_se": 0.05,
         "greedy_seq_agree": 0.25, "ratio_vs_versus": 1.0, "ratio_se": 0.0},
        {"variant": "int4_tail_full_v_gD", "greedy_agree": 0.3, "greedy_agree_se": 0.04,
         "greedy_seq_agree": 0.125, "ratio_vs_versus": 0.6, "ratio_se": 0.071},
    ]  # fmt: skip
    doc = {"gpu": None, "device": "cpu", "model": "M", "corpus": "c.txt", "bos": 2,
           "prompt_set": 256, "prompt_indices": [2, 7], "prompts": 64, "prompts_done": 40,
           "lengths": [128, 256], "tokens": 32, "versus": "int8",
           "command": "python -m benchmarks.kv_quant_greedy --model /m", "date": "2026-12-05",
           "git_commit": "b" * 40, "rows": rows}  # fmt: skip
    path = tmp_path / "greedy.json"
    path.write_text(json.dumps(doc))
    lines = _report().kv_quant_greedy_table(path).splitlines()
    assert lines[0].startswith(
        "M: 32 greedy tokens after each of 40 prompts (the first 40 of 64; one in every 4 of "
        "`accuracy.py`'s 256 from its prompt 2; 128/256 tokens in turn, each led by BOS id 2) "
        "from `c.txt`"
    )
    assert "`python -m benchmarks.kv_quant_greedy`" in lines[0]
    assert lines[4] == "| `bf16` | 1.000 | 0.000 | 1.00 | - | - |"
    assert lines[6] == "| `int4_tail_full_v_gD` | 0.300 | 0.040 | 0.12 | 0.60x | 0.07 |"
    assert len(lines) == 7
    # the GPU's rows on the same prompts, its reference row (the details file's) left out
    gpu_rows = {"auto": {"greedy_agree": 1.0, "greedy_agree_se": 0.0},
                "int8": {"greedy_agree": 0.6, "greedy_agree_se": 0.05, "ratio_vs_versus": 1.0,
                         "ratio_se": 0.0},
                "int4": {"greedy_agree": 0.3, "greedy_agree_se": 0.04, "ratio_vs_versus": 0.5,
                         "ratio_se": 0.06}}  # fmt: skip
    gpu = {"file": "accuracy_chunk16_details.json", "versus": "int8", "rows": gpu_rows}
    path.write_text(json.dumps(doc | {"gpu_same_prompts": gpu}))
    last = _report().kv_quant_greedy_table(path).splitlines()[-1]
    assert last.startswith(
        "vLLM on the GPU, the same 40 prompts ([`accuracy_chunk16_details.json`]"
    )
    assert last.endswith(
        "agreement with its `auto` row; in brackets over `int8`'s): `int8` 0.600 ± 0.050, "
        "`int4` 0.300 ± 0.040 (0.50x ± 0.06)."
    )


def test_host_overhead_table_puts_each_figure_before_and_after(tmp_path) -> None:
    def row(dtype: str, batch: str, us: float, launches: int) -> dict:
        return {"dtype": dtype, "batch": batch, "build_us": us, "build_ops": 3,
                "forward_rest_us": us / 10, "forward_rest_ops": 2, "update_rest_us": 1.25,
                "step_us": 30 * us, "launches_per_step": launches, "replays_per_step": 90 - launches}  # fmt: skip

    base = {"cpu": "x86_64", "torch": "2.11", "date": "2026-12-05"}
    after, before = tmp_path / "after.json", tmp_path / "before.json"
    after.write_text(json.dumps({**base, "command": "python -m benchmarks.host_overhead",
                                 "git_commit": "b" * 40, "int8kv_env": {"INT8KV_X": "1"},
                                 "rows": [row("int8", "mixed", 100.0, 3), row("int4", "decode", 7.0, 4)]}))  # fmt: skip
    before.write_text(json.dumps({**base, "command": "python -m benchmarks.host_overhead",
                                  "git_commit": "a" * 40, "rows": [row("int8", "mixed", 250.0, 33)]}))  # fmt: skip
    lines = _report().host_overhead_table(after, before).splitlines()
    assert (
        "`INT8KV_X=1`" in lines[0]
        and "commit `aaaaaaa`" in lines[0]
        and "commit `bbbbbbb`" in lines[0]
    )
    assert lines[-2] == (
        "| `int8` | 31 decodes + a 2048-token first chunk | 250 (3) → 100 (3) | 25.0 (2) → 10.0 (2) "
        "| 1.2 → 1.2 | 7500 → 3000 | 33 / 57 → 3 / 87 |"
    )
    # a row the earlier code had no figure for stands alone
    assert lines[-1] == "| `int4` | 32 decodes | 7 (3) | 0.7 (2) | 1.2 | 210 | 4 / 86 |"
