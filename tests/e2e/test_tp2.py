"""Tensor parallelism: greedy output at ``tensor_parallel_size=2`` equals TP=1's.

Needs 2 GPUs (skipped otherwise): ``bash benchmarks/run_gpu_e2e.sh tp2`` on a 2-GPU host, or
``python -m pytest tests/e2e/test_tp2.py -m gpu -v`` with the bundle staged.

Model: SmolLM2-135M cannot run at TP=2 in vLLM 0.24.0. It has 9 query heads and 3 KV heads, and
``ModelConfig.verify_with_parallel_config`` (vllm/config/model.py) refuses any TP size that does not
divide the number of *query* heads ("Total number of attention heads (9) must be divisible by
tensor parallel size (2)"); its KV heads could not be split either (``QKVParallelLinear`` splits
KV heads evenly when tp <= kv heads and replicates them only when tp >= kv heads and divides it).
So the model here is the e2e tests' tiny random GQA Llama (8 query / 2 KV heads, head_dim 128):
at TP=2 each rank holds 4 query heads and 1 KV head, i.e. the shim's cache and kernels see the
per-rank head counts and each rank writes and reads its own half of the KV cache.

Comparison: TP=2 changes the matmul split and adds all-reduces, so the BF16 residual stream
rounds differently from TP=1's; on a random model (flat next-token distributions, near ties
everywhere, see ``test_tiny_gqa_matches_bf16``) that flips some greedy tokens in any dtype. As in the
tiny test: no real mismatch (a divergence where either run's token is outside the other's top-5)
and at least ``INT8KV_E2E_TINY_MIN`` (default 0.25) of the prompts identical over 32 tokens. A
rank reading the other rank's heads or a wrong scale gives real mismatches at the first tokens.

``int8_static``: one calibration file (``int8kv calibrate`` at TP=1, holding both KV heads) serves
TP=1 and TP=2 (each rank takes its own head's scales); compared the same way.
``int4``: each rank keeps its own BF16 tail pool for its own KV head, and its sequences' tail slots
come from its own worker's slot manager; compared the same way.
``INT8KV_E2E_TP_DTYPES`` (default ``auto,int8,int8_static,int4``) picks the dtypes. ``auto`` is the BF16
control, how much TP=2 alone moves greedy outputs on this model: with it listed, each quantized
dtype must also stay within ``SLACK`` of it (measured on 2 H200s, 72 prompts: BF16 50/72
identical, ``int8`` 46/72, every divergence a near tie with a logprob gap of at most 0.016 nats).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from e2e_support import GEN_TOKENS, MAX_MODEL_LEN, assert_like_control, generation_phase

from benchmarks.greedy import Comparison, compare_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

TINY_MIN = float(os.environ.get("INT8KV_E2E_TINY_MIN", "0.25"))
TP_DTYPES = [
    d.strip()
    for d in os.environ.get("INT8KV_E2E_TP_DTYPES", "auto,int8,int8_static,int4").split(",")
]
COMMON = {
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 32,
    "gpu_memory_utilization": 0.25,
    "seed": 0,
    "enforce_eager": True,  # TP is what is tested here, not graph capture (and it starts faster)
    "enable_prefix_caching": False,
}
# The host keeps NVLink multicast off (it can take shared GPUs down); make sure the engines we
# start inherit that, and keep vLLM's symmetric-memory all-reduce (multicast-based on Hopper) out.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
}


@pytest.fixture(autouse=True)
def _no_multicast(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in NO_MULTICAST_ENV.items():
        if name not in os.environ:
            monkeypatch.setenv(name, value)


@pytest.fixture(scope="session")
def tiny_scales(tiny_model_dir: Path, e2e_workdir: Path) -> Path:
    """``int8kv calibrate`` of the tiny model at TP=1: the one file both TP sizes load."""
    out = e2e_workdir / "tiny_int8kv_scales.json"
    log = e2e_workdir / "tiny_calibrate.log"
    cmd = [
        sys.executable,
        "-m",
        "int8kv_shim.cli",
        "calibrate",
        str(tiny_model_dir),
        "--out",
        str(out),
        "--num-tokens",
        "16384",
        "--",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--gpu-memory-utilization",
        "0.25",
    ]
    env = {**os.environ, **{k: v for k, v in NO_MULTICAST_ENV.items() if k not in os.environ}}
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1200)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "logs").mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "logs" / "e2e_tiny_calibrate.log").write_text(log.read_text())
    assert proc.returncode == 0 and out.exists(), log.read_text()[-3000:]
    return out


def _run_tp(
    engine, tiny_model_dir: Path, prompts, dtype: str, tp: int, monkeypatch, scales: Path | None
) -> dict[str, Any]:
    kw: dict[str, Any] = {**COMMON, "model": str(tiny_model_dir), "kv_cache_dtype": dtype}
    kw["tensor_parallel_size"] = tp
    shim = dtype != "auto"
    if not shim:
        kw["attention_backend"] = "TRITON_ATTN"  # no FA3 in the H200 bundle (see CONFIGS)
    if scales is not None:
        monkeypatch.setenv("INT8KV_SCALES", str(scales))
    return engine(f"tp_tiny_{dtype}_tp{tp}", kw, [generation_phase("ref", prompts)], shim)


def _tp2_vs_tp1(request, engine, tiny_model_dir, prompts, dtype: str, monkeypatch) -> Comparison:
    scales = request.getfixturevalue("tiny_scales") if dtype == "int8_static" else None
    tp1 = _run_tp(engine, tiny_model_dir, prompts, dtype, 1, monkeypatch, scales)
    tp2 = _run_tp(engine, tiny_model_dir, prompts, dtype, 2, monkeypatch, scales)
    cmp = compare_greedy(tp1["phases"]["ref"], tp2["phases"]["ref"], n=GEN_TOKENS)
    print(f"tiny {dtype} TP=2 vs TP=1: {cmp.summary()}")
    print(f"engines: TP=1 {tp1['engine']}, TP=2 {tp2['engine']}")
    return cmp


@pytest.mark.parametrize("dtype", TP_DTYPES)
def test_tp2_matches_tp1(
    request, engine, tiny_model_dir, prompts, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cmp = _tp2_vs_tp1(request, engine, tiny_model_dir, prompts, dtype, monkeypatch)
    assert not cmp.mismatch and cmp.identical_fraction >= TINY_MIN, cmp.summary()
    if dtype != "auto" and "auto" in TP_DTYPES:
        # As close to TP=1 as BF16's own TP=2 is (engines run once: the auto case's are reused).
        control = _tp2_vs_tp1(request, engine, tiny_model_dir, prompts, "auto", monkeypatch)
        assert_like_control(cmp, control, f"tiny {dtype} TP=2 vs TP=1", "bf16 TP=2 vs TP=1")
