"""Fixtures of the vLLM end-to-end tests.

The shim is NOT activated in the pytest process: every engine runs in its own subprocess
(``e2e_support.run_vllm``) with ``INT8KV_SHIM=1`` set only there, so these tests can be collected
together with the CPU suites without patching vLLM for them.

Engines are expensive (about a minute each, several for the first torch.compile), so each distinct
engine runs once per session and every test reading it shares the result (``engine`` fixture).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import e2e_support
import pytest


def _bundle_model(variable: str) -> Path:
    """A model folder the GPU bundle exports in ``variable``; skips without vLLM or the model."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not importable (stage the GPU bundle first)")
    path = os.environ.get(variable)
    if not path or not (Path(path) / "config.json").exists():
        pytest.skip(f"${variable} is not set or holds no model (source the GPU bundle's stage.sh)")
    return Path(path)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (the GPU bundle's ``$SMOLLM2_DIR``)."""
    return _bundle_model("SMOLLM2_DIR")


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Gemma 3 270M as a Hugging Face folder (the GPU bundle's ``$GEMMA3_DIR``)."""
    return _bundle_model("GEMMA3_DIR")


@pytest.fixture(scope="session")
def e2e_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh folder, or ``INT8KV_E2E_WORKDIR``, where engines run in an earlier pytest process
    with the same spec are not run again (``e2e_support.reusable_result``)."""
    if os.environ.get("INT8KV_E2E_WORKDIR"):
        path = Path(os.environ["INT8KV_E2E_WORKDIR"])
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("int8kv-e2e")


@pytest.fixture(scope="session")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    return e2e_support.make_prompts(e2e_support.corpus_token_ids(smollm2_dir))


@pytest.fixture(scope="session")
def tiny_model_dir(smollm2_dir: Path, e2e_workdir: Path) -> Path:
    scale = float(os.environ.get("INT8KV_E2E_TINY_ATTN_SCALE", e2e_support.TINY_ATTN_OUT_SCALE))
    return e2e_support.build_tiny_llama(
        e2e_workdir / "tiny-gqa-llama", smollm2_dir, attn_out_scale=scale
    )


EngineFn = Callable[..., dict[str, Any]]


@pytest.fixture(scope="session")
def engine_log(e2e_workdir: Path) -> Callable[[str], Path]:
    """``engine_log(name)``: the log file of the engine ``engine(name, ...)`` ran (or reused)."""
    return lambda name: e2e_support.engine_files(e2e_workdir, name)[2]


@pytest.fixture(scope="session")
def engine(e2e_workdir: Path) -> EngineFn:
    """``engine(name, llm_kwargs, phases, shim, env=None)``: run once per session, then served
    from memory (``env``: extra variables for that engine's process only).

    A failed engine is remembered too, so every test that needs it fails at once with the same log
    instead of starting it again.
    """
    cache: dict[str, dict[str, Any] | Exception] = {}

    def run(
        name: str,
        llm_kwargs: Mapping[str, Any],
        phases: Sequence[Mapping[str, Any]],
        shim: bool,
        env: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        if name not in cache:
            try:
                cache[name] = e2e_support.run_vllm(
                    name, llm_kwargs, phases, shim=shim, workdir=e2e_workdir, env=env
                )
            except RuntimeError as e:
                cache[name] = e
        got = cache[name]
        if isinstance(got, Exception):
            pytest.fail(str(got), pytrace=False)
        return got

    return run
