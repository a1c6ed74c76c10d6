"""``int8kv calibrate``: the pure parts on CPU (recording math, merging across ranks, sequence
planning, CLI), and one GPU test that calibrates SmolLM2 and serves ``int8_static`` with the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from int8kv_shim import cli
from int8kv_shim.static import cli as calibrate
from int8kv_shim.static import file as scales_file
from int8kv_shim.static import recorder as calibration
from int8kv_shim.static.recorder import (
    BINS_PER_OCTAVE,
    Recorder,
    merge_worker_stats,
    percentile_from_histogram,
)

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------------
# Recording


def test_recorder_absmax_histogram_and_padding() -> None:
    gen = torch.Generator().manual_seed(0)
    rec = Recorder(histogram=True)
    heads, dim = 3, 16
    batches = []
    for n in (7, 12):
        # heads and channels of different magnitudes: every (kv-head, channel) has its own stat
        key = (
            torch.randn(n + 2, heads, dim, generator=gen)
            * torch.tensor([1.0, 4.0, 0.1]).view(1, -1, 1)
            * torch.logspace(-2, 2, dim, base=2.0).view(1, 1, -1)
        ).half()
        value = torch.randn(n + 2, heads, dim, generator=gen).half()
        key[-1] = value[-1] = 1000.0  # padding rows (slot -1 / beyond the mapping): never counted
        slots = torch.arange(n + 1)
        slots[-1] = -1
        rec.record("model.layers.0.self_attn.attn", key, value, slots)
        batches.append((key[:n].float(), value[:n].float()))
    k = torch.cat([b[0] for b in batches]).abs()
    v = torch.cat([b[1] for b in batches]).abs()

    absmax = rec.summary()["model.layers.0.self_attn.attn"]
    assert absmax["tokens"] == 7 + 12
    # [heads][dim] lists: the absmax of each (kv-head, channel) over the tokens
    assert torch.equal(torch.tensor(absmax["k"], dtype=torch.float32), k.amax(dim=0))
    assert torch.equal(torch.tensor(absmax["v"], dtype=torch.float32), v.amax(dim=0))

    p = rec.summary(99.0)["model.layers.0.self_attn.attn"]
    for got, data in ((p["k"], k), (p["v"], v)):
        assert len(got) == heads and all(len(row) == dim for row in got)
        exact = torch.quantile(  # per (kv-head, channel) over the tokens
            data.permute(1, 2, 0).reshape(heads * dim, -1).double(), 0.99, dim=1,
            interpolation="higher",
        )  # fmt: skip
        flat = torch.tensor(got, dtype=torch.float64).reshape(-1)
        top = data.amax(dim=0).reshape(-1).double()
        assert torch.all(exact <= flat)
        assert torch.all(
            flat <= torch.minimum(exact * 2 ** (1 / BINS_PER_OCTAVE) * (1 + 1e-9), top)
        )


def test_percentile_from_histogram_bounds() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.exp(torch.randn(2, 50_000, generator=gen) * 3)  # spans many octaves
    x[1, :10] = 0.0
    hist = torch.zeros(2, calibration.NUM_BINS, dtype=torch.int64)
    hist.scatter_add_(1, calibration.bin_index(x), torch.ones_like(x, dtype=torch.int64))
    absmax = x.amax(dim=1)
    assert torch.equal(percentile_from_histogram(hist, absmax, 100.0), absmax.double())
    for q in (50.0, 99.0, 99.9):
        got = percentile_from_histogram(hist, absmax, q)
        exact = torch.quantile(x.double(), q / 100, dim=1, interpolation="higher")
        assert torch.all(got >= exact) and torch.all(got <= exact * 2 ** (1 / BINS_PER_OCTAVE))


def test_recorder_without_histogram_refuses_a_percentile() -> None:
    rec = Recorder(histogram=False)
    rec.record("l.0", torch.ones(2, 1, 4), torch.ones(2, 1, 4), torch.arange(2))
    with pytest.raises(RuntimeError, match="INT8KV_CALIBRATE=histogram"):
        rec.summary(99.9)


def test_active_recorder_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibration, "_recorder", None)
    assert calibration.active_recorder({}) is None
    first = calibration.active_recorder({"INT8KV_CALIBRATE": "histogram"})
    assert first is not None and first.histogram and not first.armed
    assert calibration.active_recorder({"INT8KV_CALIBRATE": "histogram"}) is first  # per process
    with pytest.raises(ValueError, match="INT8KV_CALIBRATE='bogus'"):
        calibration.active_recorder({"INT8KV_CALIBRATE": "bogus"})


# --------------------------------------------------------------------------------------------------
# Merging across workers


def _channels(values: list[float]) -> list[list[float]]:
    """Per-head values as two channels each: (x, x + 0.5)."""
    return [[float(x), x + 0.5] for x in values]


def _worker(tp_rank: int, tp_size: int, layers: dict[int, tuple[list[float], list[float]]]) -> dict:
    """A worker's collect result; each head's value x reported as channels (x, x + 0.5)."""
    return {
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "layers": {
            f"model.layers.{i}.self_attn.attn": {
                "k": _channels(k),
                "v": _channels(v),
                "tokens": 100,
            }
            for i, (k, v) in layers.items()
        },
    }


def test_merge_places_partitioned_heads() -> None:
    results = [
        _worker(1, 2, {0: ([5, 6, 7, 8], [1, 1, 1, 1]), 1: ([1, 2, 3, 4], [2, 2, 2, 2])}),
        _worker(0, 2, {0: ([1, 2, 3, 4], [0, 0, 0, 0]), 1: ([9, 9, 9, 9], [3, 3, 3, 3])}),
    ]
    stats, tokens = merge_worker_stats(results, total_kv_heads=8, num_layers=2)
    assert tokens == 100
    assert stats[0] == (
        "model.layers.0.self_attn.attn",
        _channels([1, 2, 3, 4, 5, 6, 7, 8]),
        _channels([0] * 4 + [1] * 4),
    )
    assert stats[1][1] == _channels([9, 9, 9, 9, 1, 2, 3, 4])


def test_merge_replicated_heads_and_pipeline_stages() -> None:
    # TP=4 over 2 kv heads: ranks 0,1 hold head 0 and ranks 2,3 head 1 (replicas agree, or the
    # larger wins); PP=2: layer 0 on one stage, layer 1 on the other.
    results = [_worker(r, 4, {0: ([1.0 + (r == 1)], [r + 0.5])}) for r in range(4)] + [
        _worker(r, 4, {1: ([10.0 + r], [1.0])}) for r in range(4)
    ]
    stats, _ = merge_worker_stats(results, total_kv_heads=2, num_layers=2)
    assert stats[0][1:] == (_channels([2.0, 1.0]), _channels([1.5, 3.5]))
    assert stats[1][1:] == (_channels([11.0, 13.0]), _channels([1.0, 1.0]))
    # replicas that disagree per channel: the max of each channel
    a, b = _worker(0, 2, {0: ([1.0], [1.0])}), _worker(1, 2, {0: ([1.0], [1.0])})
    b["layers"]["model.layers.0.self_attn.attn"]["k"] = [[0.5, 4.0]]
    stats, _ = merge_worker_stats([a, b], total_kv_heads=1, num_layers=1)
    assert stats[0][1] == [[1.0, 4.0]]


def test_merge_refuses_incomplete_results() -> None:
    with pytest.raises(ValueError, match=r"no statistics for layers \[1\]"):
        merge_worker_stats([_worker(0, 1, {0: ([1.0], [1.0])})], total_kv_heads=1, num_layers=2)
    with pytest.raises(ValueError, match="some kv heads were reported by no worker"):
        merge_worker_stats([_worker(0, 2, {0: ([1.0], [1.0])})], total_kv_heads=2, num_layers=1)
    with pytest.raises(ValueError, match="reported 2 heads, expected 1"):
        merge_worker_stats([_worker(0, 2, {0: ([1.0, 2.0], [1.0, 2.0])})], 2, 1)


def test_tp2_workers_to_a_file_that_serves_tp1_and_tp4(tmp_path: Path) -> None:
    results = [_worker(r, 2, {i: ([r + 1.0 + i], [127.0]) for i in range(3)}) for r in range(2)]
    stats, tokens = merge_worker_stats(results, total_kv_heads=2, num_layers=3)
    built = scales_file.build(
        model="m", num_layers=3, num_kv_heads=2, head_dim=2, v_format="e4m3",
        statistic="absmax", num_tokens=tokens, stats=stats,
    )  # fmt: skip
    loaded = scales_file.load(scales_file.write(tmp_path / "s.json", built))
    k = [[3 / 127, 3.5 / 127], [4 / 127, 4.5 / 127]]
    v = [[127 / 448, 127.5 / 448]]
    assert scales_file.scales_for_rank(loaded, 2, 1, 0) == (k, v * 2)
    assert scales_file.scales_for_rank(loaded, 2, 4, 3) == (k[1:], v)


# --------------------------------------------------------------------------------------------------
# Sequence planning, engine overrides, CLI


def test_plan_sequences_mixes_documents_and_meets_the_budget() -> None:
    prose, code, chat = list(range(1000, 1100)), list(range(2000, 2040)), list(range(3000, 3036))
    seqs = calibrate.plan_sequences([prose, code, chat], [1], seq_len=21, num_tokens=10_000)
    assert all(s[0] == 1 and len(s) <= 21 for s in seqs)
    assert [s[1] // 1000 for s in seqs[:3]] == [1, 2, 3]  # round robin
    body = [t for s in seqs for t in s[1:]]
    assert sorted(body) == sorted(prose + code + chat)  # every token once
    short_tail = calibrate.plan_sequences([list(range(25))], [], seq_len=20, num_tokens=100)
    assert short_tail == [list(range(20))]  # a 5-token tail is not worth a sequence

    budget = calibrate.plan_sequences([prose, code, chat], [1], seq_len=21, num_tokens=101)
    assert sum(map(len, budget)) == 101  # 4 full sequences, then one trimmed to the budget

    with pytest.raises(ValueError, match="no room"):
        calibrate.plan_sequences([prose], [1, 2], seq_len=2, num_tokens=10)


def test_calibration_overrides() -> None:
    changes, notes = calibrate.calibration_overrides(
        {"kv_cache_dtype": "fp8", "enable_prefix_caching": None, "worker_extension_cls": ""}
    )
    assert changes == {
        "kv_cache_dtype": "int8",
        "kv_cache_dtype_skip_layers": [],
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "worker_extension_cls": "int8kv_shim.static.recorder.CalibrationWorkerExtension",
    }
    assert notes == ["ignoring kv_cache_dtype='fp8': calibration runs with kv_cache_dtype='int8'"]
    with pytest.raises(SystemExit, match="cannot be combined"):
        calibrate.calibration_overrides({"worker_extension_cls": "my.Ext"})


def test_cli_parses_calibrate_and_engine_args() -> None:
    args = cli.parse_args(
        ["calibrate", "/m", "--out", "f.json", "--text", "a.txt", "--text", "b.txt",
         "--num-tokens", "4096", "--v-format", "e4m3", "--percentile", "99.9",
         "--", "--tensor-parallel-size", "2", "--max-model-len", "4096"]
    )  # fmt: skip
    assert (args.command, args.model, args.out, args.text) == (
        "calibrate",
        "/m",
        "f.json",
        ["a.txt", "b.txt"],
    )
    assert (args.num_tokens, args.v_format, args.percentile) == (4096, "e4m3", 99.9)
    assert args.engine_args == ["--tensor-parallel-size", "2", "--max-model-len", "4096"]
    defaults = cli.parse_args(["calibrate", "/m"])
    assert (defaults.num_tokens, defaults.v_format, defaults.percentile, defaults.engine_args) == (
        calibrate.DEFAULT_NUM_TOKENS,
        "int8",
        None,
        [],
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["calibrate", "/m", "--v-format", "fp4"],
        ["calibrate", "/m", "--percentile", "0"],
        ["calibrate", "/m", "--num-tokens", "0"],
        ["dtypes", "--", "--tensor-parallel-size", "2"],
    ],
)
def test_cli_rejects_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2


def test_output_path(tmp_path: Path) -> None:
    assert calibrate.output_path(str(tmp_path), None) == tmp_path / "int8kv_scales.json"
    assert calibrate.output_path("org/model", "x.json") == Path("x.json")
    with pytest.raises(SystemExit, match="not a local folder: pass --out FILE"):
        calibrate.output_path("org/model", None)


def test_shipped_calibration_text_is_package_data() -> None:
    texts = calibrate.default_texts()
    assert [t.name for t in texts] == ["code_samples.txt", "dialogue.txt", "persuasion_ch1-7.txt"]
    assert sum(t.stat().st_size for t in texts) > 100_000
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"calibration_data/*.txt"' in pyproject


# --------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_gpu_calibrate_smollm2_then_serve_int8_static(tmp_path: Path) -> None:
    model = os.environ.get("SMOLLM2_DIR")
    if not model:
        pytest.skip("set SMOLLM2_DIR to a small local model folder")
    out = tmp_path / "scales.json"
    env = {k: v for k, v in os.environ.items() if k not in ("INT8KV_SHIM", "INT8KV_SCALES")}
    run = subprocess.run(
        [sys.executable, "-m", "int8kv_shim.cli", "calibrate", model, "--out", str(out),
         "--num-tokens", "8192", "--", "--max-model-len", "2048", "--gpu-memory-utilization", "0.5"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    config = json.loads((Path(model) / "config.json").read_text())
    loaded = scales_file.load(out)
    scales_file.check_model(
        loaded,
        out,
        num_layers=config["num_hidden_layers"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
    )
    assert loaded.num_tokens == 8192 and loaded.statistic == "absmax"
    assert all(s > 0 for layer in loaded.layers.values() for s in layer.k_scale + layer.v_scale)

    code = (
        "from vllm import LLM, SamplingParams\n"
        f"llm = LLM({model!r}, kv_cache_dtype='int8_static', max_model_len=1024, "
        "gpu_memory_utilization=0.5, enforce_eager=True)\n"
        "out = llm.generate(['The capital of France is'], SamplingParams(max_tokens=8, temperature=0))\n"
        "print('GENERATED', repr(out[0].outputs[0].text))\n"
    )
    serve = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "INT8KV_SHIM": "1", "INT8KV_SCALES": str(out)},
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert serve.returncode == 0, serve.stderr[-6000:]
    assert "GENERATED" in serve.stdout

    missing = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "INT8KV_SHIM": "1", "INT8KV_SCALES": str(tmp_path / "missing.json")},
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert missing.returncode != 0
    assert f"calibration file {tmp_path / 'missing.json'}: does not exist" in missing.stderr
