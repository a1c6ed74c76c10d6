"""The bad-input matrix (CPU part): every input the shim cannot serve, and exactly what
the user sees for it. One test per row; the README "Limitations" list is checked against it.

Three vLLM subprocesses serve the whole matrix (session fixtures, ~8 s each with a warm vLLM
model-info cache): ``matrix_active`` (INT8KV_SHIM=1), ``matrix_off`` (unset) and
``matrix_old_vllm`` (0.25.0 faked in the metadata, as tests/shim does). Their subprocess side is
the ``_sub_*`` functions below (run through ``import test_bad_inputs`` in the child), built on
tests/shim/probe.py. The NaN/Inf rows run the kernels in-process (Triton interpreter on CPU).

GPU-only rows (not here): a real `vllm serve` start-up refusal for each model kind, NaN through
a whole forward pass, skip-layers serving a real model.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from probe import prelude
from test_shim_vllm import _GUARD_SCENARIO, _fake_metadata_version

from int8kv_shim.package import SUPPORTED_VLLM_VERSION
from int8kv_shim.patch import unsupported_model_reason

TESTS = Path(__file__).resolve().parent
README = TESTS.parent / "README.md"

# Minimal config.json per model kind: enough for vLLM's ModelConfig on CPU (no weights, no
# tokenizer, no network); vLLM's registry decides the kind from the architecture.
_COMMON = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
           "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512,
           "torch_dtype": "bfloat16"}  # fmt: skip
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "num_key_value_heads": 2},
    "mla": {**_COMMON, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "num_key_value_heads": 4, "kv_lora_rank": 64, "q_lora_rank": None,
            "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "first_k_dense_replace": 1},
    "hybrid": {**_COMMON, "architectures": ["JambaForCausalLM"], "model_type": "jamba",
               "num_key_value_heads": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
               "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 1},
    "attention_free": {**_COMMON, "architectures": ["MambaForCausalLM"], "model_type": "mamba"},
    "encoder_only": {**_COMMON, "architectures": ["BertModel"], "model_type": "bert",
                     "torch_dtype": "float32"},
}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Subprocess side (runs in a child interpreter that imported vLLM; returns JSON-able data)


def _error(call: Any) -> str:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _argparse_error(argv: list[str]) -> str:
    """What `vllm serve ... --kv-cache-dtype X` prints when argparse refuses X (stderr)."""
    import contextlib
    import io

    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm serve")  # what the `vllm serve` CLI names itself
    with contextlib.suppress(RuntimeError):  # "Failed to infer device type": no GPU here
        make_arg_parser(parser)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parser.parse_args(argv)
    except SystemExit:
        return stderr.getvalue().strip().splitlines()[-1]
    return "ok"


def _cache_config_error(dtype: str) -> str:
    from vllm.config import CacheConfig

    return _error(lambda: CacheConfig(cache_dtype=dtype))


def _sub_off() -> dict[str, Any]:
    import int8kv_shim

    return {
        "mode": int8kv_shim.mode(),
        "argparse": _argparse_error(["--kv-cache-dtype", "int8"]),
        "cache_config": _cache_config_error("int8"),
    }


def _model_configs(dtypes: dict[str, list[str]]) -> dict[str, str]:
    from vllm.engine.arg_utils import EngineArgs

    result = {}
    for kind, names in dtypes.items():
        folder = tempfile.mkdtemp(prefix=f"int8kv-{kind}-")
        Path(folder, "config.json").write_text(json.dumps(MODEL_CONFIGS[kind]))
        for name in names:
            args = EngineArgs(model=folder, kv_cache_dtype=name, skip_tokenizer_init=True)
            result[f"{kind} {name}"] = _error(args.create_model_config)
    return result


def _forced_custom_on_auto_layer() -> str:
    """`--attention-backend CUSTOM` on a `--kv-cache-dtype-skip-layers` layer (dtype auto): the
    error vLLM's CUDA platform raises for a forced backend, on a faked sm86."""
    import probe
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    real = CudaPlatformBase.__dict__["get_device_capability"]
    CudaPlatformBase.get_device_capability = classmethod(
        lambda cls, device_id=0: DeviceCapability(8, 6)
    )
    try:
        return _error(lambda: CudaPlatformBase.get_attn_backend_cls(
            AttentionBackendEnum.CUSTOM, probe._selector_config(kv_cache_dtype="auto"), 32
        ))  # fmt: skip
    finally:
        CudaPlatformBase.get_device_capability = real


def _skip_layers_grouping() -> dict[str, Any]:
    """Layer 0 skipped (vLLM sets its dtype to "auto"), layer 1 int8: each layer's spec from the
    (patched) Attention.get_kv_cache_spec, then vLLM's own grouping of the mix."""
    import torch
    import vllm.model_executor.layers.attention.attention as attention
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16), model_config=SimpleNamespace(use_mla=False),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
    )  # fmt: skip
    specs = {}
    for index, dtype in ((0, "auto"), (1, "int8")):
        layer = SimpleNamespace(
            attn_type=AttentionType.DECODER, kv_cache_dtype=dtype, sliding_window=None,
            num_kv_heads=4, head_size=128, head_size_v=128,
            kv_cache_torch_dtype=torch.bfloat16 if dtype == "auto" else torch.int8,
        )  # fmt: skip
        specs[f"model.layers.{index}.self_attn.attn"] = attention.Attention.get_kv_cache_spec(
            layer, config
        )
    result: dict[str, Any] = {
        name: [type(s).__name__, s.block_size, s.page_size_bytes] for name, s in specs.items()
    }
    try:
        groups = get_kv_cache_groups(config, specs)
        result["groups"] = [
            [g.layer_names, type(g.kv_cache_spec).__name__,
             {n: s.page_size_bytes for n, s in getattr(g.kv_cache_spec, "kv_cache_specs", {}).items()}]
            for g in groups
        ]  # fmt: skip
    except Exception as exc:
        result["groups"] = f"{type(exc).__name__}: {exc}"
    return result


def _sub_active() -> dict[str, Any]:
    import probe

    import int8kv_shim

    refusals = probe.refusals()  # cap 7.5, head 80, MLA, encoder_only, float32
    refusals["head_size=96"] = probe.select_backend((8, 6), head_size=96)
    return {
        "mode": int8kv_shim.mode(),
        "models": _model_configs(
            {
                "llama": ["int8", "int8_static"],
                "mla": ["int8", "auto"],
                "hybrid": ["int8", "auto"],
                "attention_free": ["int8"],
                "encoder_only": ["int8_static"],
            }
        ),  # fmt: skip
        "bogus_argparse": _argparse_error(["--kv-cache-dtype", "bogus"]),
        "bogus_cache_config": _cache_config_error("bogus"),
        "refusals": refusals,
        "forced_custom_on_auto": _forced_custom_on_auto_layer(),
        "skip_layers": _skip_layers_grouping(),
    }


# ---------------------------------------------------------------------------------------------
# Session fixtures: one subprocess each


def _script(dtype_names: list[str], body: str) -> str:
    # the child imports this module: run_python puts tests/ on its PYTHONPATH
    return prelude(dtype_names) + body


@pytest.fixture(scope="session")
def matrix_active(run_python, dtype_names: list[str]) -> dict[str, Any]:
    body = "import test_bad_inputs as m\nprobe.emit(m._sub_active())\n"
    return run_python(_script(dtype_names, body), shim="1", pythonpath=[TESTS]).result()


@pytest.fixture(scope="session")
def matrix_off(run_python, dtype_names: list[str]) -> dict[str, Any]:
    body = "import test_bad_inputs as m\nprobe.emit(m._sub_off())\n"
    return run_python(_script(dtype_names, body), shim=None, pythonpath=[TESTS]).result()


@pytest.fixture(scope="session")
def matrix_old_vllm(run_python, dtype_names: list[str]) -> tuple[dict[str, Any], str]:
    # The scenario test_version_guard_refuses_on_unsupported_vllm runs, kept for its messages.
    run = run_python(
        prelude(dtype_names) + _fake_metadata_version("0.25.0") + _GUARD_SCENARIO, shim="1"
    )
    return run.result(), run.output


# ---------------------------------------------------------------------------------------------
# 1. Unsupported vLLM version


def test_unsupported_vllm_is_inert_with_one_warning_and_names_what_to_do(
    matrix_old_vllm: tuple[dict[str, Any], str],
) -> None:
    result, output = matrix_old_vllm
    assert result["mode"] == "inert"
    warnings = [line for line in output.splitlines() if "stays inactive" in line]
    assert len(warnings) == 1, output[-3000:]
    assert warnings[0].endswith(
        "int8kv-shim: INT8KV_SHIM is set but vLLM 0.25.0 is installed; this shim supports only "
        f"vLLM {SUPPORTED_VLLM_VERSION}, so it stays inactive and vLLM runs unmodified. Its "
        f"KV-cache dtypes are unavailable until you pip install vllm=={SUPPORTED_VLLM_VERSION} "
        "(or unset INT8KV_SHIM to silence this)."
    )
    assert result["cli"]["engine_args"]["int8"]["create_engine_config"] == (
        "UnsupportedVLLMVersionError: --kv-cache-dtype 'int8' is provided by int8kv-shim, which "
        f"supports only vLLM {SUPPORTED_VLLM_VERSION}, but vLLM 0.25.0 is installed. Either "
        f"install the supported version (pip install vllm=={SUPPORTED_VLLM_VERSION}), or use one "
        "of vLLM's own KV-cache dtypes and deactivate the shim (unset INT8KV_SHIM, or pip "
        "uninstall int8kv-shim)."
    )


# ---------------------------------------------------------------------------------------------
# 2. Shim off, our dtype asked; 3. unknown dtype with the shim on: vLLM's own validation


def test_shim_off_our_dtype_gets_vllms_own_refusal(matrix_off: dict[str, Any]) -> None:
    # README promises nothing is patched while INT8KV_SHIM is unset, so no shim hint here: the
    # user sees vLLM's list of valid values (and `int8kv doctor --dtype int8` says "set
    # INT8KV_SHIM=1", tests/shim/test_shim_light.py).
    assert matrix_off["mode"] == "off"
    argparse = matrix_off["argparse"]
    assert argparse.startswith(
        "vllm serve: error: argument --kv-cache-dtype: invalid choice: 'int8'"
    )
    assert "'auto'" in argparse and "'int8_per_token_head'" in argparse
    assert "int8_static" not in argparse
    cache_config = matrix_off["cache_config"]
    assert cache_config.startswith("ValidationError: 1 validation error for CacheConfig")
    assert re.search(
        r"cache_dtype\n  Input should be 'auto', .*'int8_per_token_head'", cache_config
    )


def test_unknown_dtype_with_the_shim_on_is_still_vllms_refusal(
    matrix_active: dict[str, Any],
) -> None:
    assert matrix_active["mode"] == "active"
    argparse = matrix_active["bogus_argparse"]
    assert argparse.startswith(
        "vllm serve: error: argument --kv-cache-dtype: invalid choice: 'bogus'"
    )
    for name in ("int8", "int8_static", "int4"):  # ours are listed among the valid ones
        assert f"'{name}'" in argparse, name
    cache_config = matrix_active["bogus_cache_config"]
    assert cache_config.startswith("ValidationError: 1 validation error for CacheConfig")
    assert "'int8', 'int8_static' or 'int4'" in cache_config
    assert "input_value='bogus'" in cache_config


# ---------------------------------------------------------------------------------------------
# 4. Model kinds our cache cannot serve: refused when the model config is built (start-up)

_HINT = "; use one of vLLM's own --kv-cache-dtype values (auto, fp8, ...)"


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("mla int8", "ValueError: int8kv-shim: --kv-cache-dtype int8: DeepseekV2ForCausalLM: MLA "
         "(latent-attention) models are not supported: their cache holds one compressed latent "
         "per token, not per-head K and V" + _HINT),
        ("hybrid int8", "ValueError: int8kv-shim: --kv-cache-dtype int8: JambaForCausalLM: hybrid "
         "(attention + Mamba/linear-attention) models are not supported: vLLM sizes their "
         "attention pages together with the recurrent-state pages using its own byte count, "
         "which does not include our per-token scales" + _HINT),
        ("attention_free int8", "ValueError: int8kv-shim: --kv-cache-dtype int8: "
         "MambaForCausalLM: attention-free models have no KV cache to quantize" + _HINT),
        ("encoder_only int8_static", "ValueError: int8kv-shim: --kv-cache-dtype int8_static: "
         "BertModel: encoder-only models are not supported: only decoder self-attention has a "
         "KV cache to quantize" + _HINT),
    ],
)  # fmt: skip
def test_unsupported_model_kinds_are_refused_at_startup(
    matrix_active: dict[str, Any], key: str, message: str
) -> None:
    assert matrix_active["models"][key] == message


def test_supported_models_and_vllms_own_dtypes_pass_the_model_check(
    matrix_active: dict[str, Any],
) -> None:
    models = matrix_active["models"]
    assert models["llama int8"] == models["llama int8_static"] == "ok"
    assert models["mla auto"] == models["hybrid auto"] == "ok"  # vLLM's own dtypes: untouched


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"use_mla": True, "attn_type": "decoder"}, "MLA (latent-attention)"),
        ({"attn_type": "hybrid"}, "hybrid (attention + Mamba"),
        ({"attn_type": "attention_free"}, "attention-free"),
        ({"attn_type": "encoder_only"}, "encoder-only"),
        ({"attn_type": "encoder_decoder"}, "encoder-decoder models are not supported"),
        ({"attn_type": "decoder"}, None),
        ({"use_mla": False, "attn_type": "decoder"}, None),
    ],
)
def test_unsupported_model_reason_on_stand_in_configs(
    fields: dict[str, Any], expected: str | None
) -> None:
    # encoder_decoder has no tiny config above (vLLM's ones need processors); the decision is
    # the same function, on vLLM's attn_type.
    reason = unsupported_model_reason(SimpleNamespace(architecture="X", **fields), "int8")
    if expected is None:
        assert reason is None
    else:
        assert reason.startswith("int8kv-shim: --kv-cache-dtype int8: X: " + expected), reason
        assert reason.endswith(_HINT)


# ---------------------------------------------------------------------------------------------
# 5. Per-layer refusals by our backend (vLLM's "No valid attention backend" error carries them)


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("head_size=80", "int8kv-shim's int8 kernels support head sizes 64, 128, 256, not 80"),
        ("head_size=96", "int8kv-shim's int8 kernels support head sizes 64, 128, 256, not 96"),
        ("cap=7.5", "int8kv-shim needs compute capability >= 8.0 (Ampere or newer); this GPU "
                    "is 7.5"),
        ("mla", "int8kv-shim does not support MLA (latent-attention) models; use one of vLLM's "
                "own --kv-cache-dtype values"),
        ("encoder_only", "int8kv-shim supports decoder self-attention only, not encoder_only "
                         "attention"),
        ("float32", "int8kv-shim needs float16 or bfloat16 activations, not torch.float32"),
    ],
)  # fmt: skip
def test_backend_refusals_name_the_reason(
    matrix_active: dict[str, Any], case: str, reason: str
) -> None:
    result = matrix_active["refusals"][case]
    assert result["chosen"] is None  # nothing else serves our dtype: start-up stops
    assert reason in result["reasons"]["CUSTOM"]


# ---------------------------------------------------------------------------------------------
# 6. int8_static without / with a corrupt / with a mismatched calibration file


def test_int8_static_file_refusals_are_pinned_in_tests_shim() -> None:
    # The exact one-line messages (missing, unreadable, corrupt JSON, not ours, other model,
    # non-finite/non-positive scale) are pinned in tests/shim/test_scales_file.py, and the
    # start-up path (Attention.process_weights_after_loading) in test_shim_vllm.py
    # (test_int8_static_refuses_at_startup_without_a_usable_file). This row makes sure they stay.
    pinned = (TESTS / "shim" / "test_scales_file.py").read_text()
    for test in ("test_refuses_a_missing_file", "test_refuses_corrupt_json",
                 "test_refuses_other_json"):  # fmt: skip
        assert f"def {test}(" in pinned
    assert re.search(r"def test_refuses_\w*(model|head|layer)", pinned), "mismatched-file rows"
    startup = (TESTS / "shim" / "test_shim_vllm.py").read_text()
    assert "def test_int8_static_refuses_at_startup_without_a_usable_file(" in startup


def test_int8_static_file_refusal_names_the_file(tmp_path: Path) -> None:
    from int8kv_shim.static import file as scales_file

    path = tmp_path / "int8kv_scales.json"
    path.write_text("{ not json")
    with pytest.raises(scales_file.ScalesFileError) as exc:
        scales_file.load(path)
    assert str(exc.value).startswith(f"int8kv-shim: calibration file {path}: is not valid JSON")
    assert "\n" not in str(exc.value)


# ---------------------------------------------------------------------------------------------
# 7. NaN / Inf in K or V activations (kernels, Triton interpreter on CPU)

NKV, HEAD, BS = 2, 64, 16


def _write(kv_dtype: str, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
           slots: torch.Tensor) -> None:  # fmt: skip
    from int8kv_kernels import write_kv_cache

    static = torch.full((NKV, HEAD), 0.02) if kv_dtype == "int8_static" else None
    write_kv_cache(key, value, cache, slots, kv_dtype=kv_dtype, block_size=BS,
                   k_scale=static, v_scale=static)  # fmt: skip


@pytest.mark.parametrize("kv_dtype", ["int8", "int8_static"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["k", "v"])
def test_nonfinite_token_touches_only_its_own_slot(kv_dtype: str, bad: float, where: str) -> None:
    from int8kv_kernels import PageLayout
    from int8kv_kernels.reference import _views, write_kv_cache_ref

    layout = PageLayout(kv_dtype, BS, NKV, HEAD)
    cache = torch.randint(-128, 128, (2, layout.page_bytes), dtype=torch.int8)
    key = torch.randn(3, NKV, HEAD, dtype=torch.bfloat16)
    value = torch.randn(3, NKV, HEAD, dtype=torch.bfloat16)
    # The last token (the interpreter runs programs in order, so nothing overwrites what it might
    # spill into), kv head 0, one element; slot 4 (written before) and 6 (never) are its neighbours.
    (key if where == "k" else value)[2, 0, 5] = bad
    slots = torch.tensor([3, 4, 5])
    before = cache.clone()
    _write(kv_dtype, key, value, cache, slots)

    # The reference is the specification: bit for bit, bad token included.
    ref = before.clone()
    static = torch.full((NKV, HEAD), 0.02) if kv_dtype == "int8_static" else None
    write_kv_cache_ref(key, value, ref, slots, kv_dtype=kv_dtype, block_size=BS,
                       k_scale=static, v_scale=static)  # fmt: skip
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    # Neighbours: identical to writing them without the bad token.
    clean = before.clone()
    _write(kv_dtype, key[:2], value[:2], clean, slots[:2])
    kd, vd, ks, vs = _views(cache, layout)
    ckd, cvd, cks, cvs = _views(clean, layout)
    others = [s for s in range(2 * BS) if s != 5]  # every slot of both pages but the bad one
    blk, off = torch.tensor(others) // BS, torch.tensor(others) % BS
    pairs = [(kd, ckd), (vd, cvd)] + ([(ks, cks), (vs, cvs)] if ks is not None else [])
    for got, want in pairs:
        assert torch.equal(got[blk, :, off].view(torch.uint8), want[blk, :, off].view(torch.uint8))
    data, scale = (kd, ks) if where == "k" else (vd, vs)
    if kv_dtype == "int8":
        # Flagged: this (token, head) stores scale NaN and data 0.
        assert torch.isnan(scale[0, 0, 5]) and (data[0, 0, 5] == 0).all()
        assert torch.isfinite(scale[0, 1, 5])  # the token's other head is fine
    else:
        # No per-token scale: Inf saturates at +-127, NaN stores 0; the rest of the row as usual.
        expected = 0 if bad != bad else (127 if bad > 0 else -127)
        assert int(data[0, 0, 5, 5]) == expected


def test_nonfinite_token_flags_its_sequence_and_no_other() -> None:
    """Attention: sequence 0 holds the bad token, sequence 1 does not; 1's output is bit-identical
    to a run without the bad token, 0's is NaN from the bad token on (flagged, never plausible).
    A stale NaN token in a reused block past the owner's seq_len is never read either."""
    from kvbatch import make_batch, make_cache, run_attention  # the kernel tests' batch builders

    from int8kv_kernels import write_kv_cache

    torch.manual_seed(0)
    nq = 4
    b = make_batch([1, 1], [40, 37], nq, HEAD, BS, "cpu")
    cache, _, _ = make_cache("int8", BS, NKV, HEAD, b.num_blocks, "cpu")
    bad_k = torch.randn(1, NKV, HEAD, dtype=torch.bfloat16)  # sequence 0, position 10
    bad_v = torch.randn(1, NKV, HEAD, dtype=torch.bfloat16)  # stale: sequence 1's block, past 37
    slot0 = torch.tensor([int(b.block_table[0, 10 // BS]) * BS + 10 % BS])
    slot1 = torch.tensor([int(b.block_table[1, 40 // BS]) * BS + 40 % BS])
    # Baseline: the same tokens, finite. Then the same with one NaN in K and one Inf in V.
    for k, v, slot in ((bad_k, bad_k, slot0), (bad_v, bad_v, slot1)):
        write_kv_cache(k, v, cache, slot, kv_dtype="int8", block_size=BS)
    clean_out = run_attention(b, cache, kv_dtype="int8", block_size=BS, nkv=NKV).clone()
    poisoned = cache.clone()
    bad_k[0, 0, 0] = float("nan")
    bad_v[0, 1, 3] = float("inf")
    write_kv_cache(bad_k, bad_k.nan_to_num(), poisoned, slot0, kv_dtype="int8", block_size=BS)
    write_kv_cache(bad_v.nan_to_num(posinf=0), bad_v, poisoned, slot1, kv_dtype="int8",
                   block_size=BS)  # fmt: skip
    assert not torch.equal(poisoned, cache)
    out = run_attention(b, poisoned, kv_dtype="int8", block_size=BS, nkv=NKV)

    q_heads_of_kv0 = slice(0, nq // NKV)
    assert torch.equal(out[1].view(torch.int16), clean_out[1].view(torch.int16))
    assert torch.isnan(out[0, q_heads_of_kv0]).all()
    assert torch.equal(out[0, nq // NKV :].view(torch.int16),
                       clean_out[0, nq // NKV :].view(torch.int16))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 8. --kv-cache-dtype-skip-layers: BF16 and our layers in one model


def test_skip_layers_keep_vllms_spec_and_group_with_ours(matrix_active: dict[str, Any]) -> None:
    from int8kv_kernels.catalogue import get_dtype

    r = matrix_active["skip_layers"]
    skipped, ours = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"
    assert r[skipped] == ["FullAttentionSpec", 16, 2 * 16 * 4 * 128 * 2]  # bf16 K+V
    assert r[ours] == ["Int8KVFullAttentionSpec", 16, get_dtype("int8").page_bytes(16, 4, 128)]
    # vLLM puts both in one group of one type (same block size, same token count per block) and
    # each layer keeps its own page size: the BF16 layer is not squeezed into our page or back.
    assert r["groups"] == [[[skipped, ours], "UniformTypeKVCacheSpecs",
                            {skipped: r[skipped][2], ours: r[ours][2]}]]  # fmt: skip


def test_forcing_our_backend_onto_a_skipped_layer_says_why(matrix_active: dict[str, Any]) -> None:
    message = matrix_active["forced_custom_on_auto"]
    assert message.startswith(
        "ValueError: Selected backend AttentionBackendEnum.CUSTOM is not valid for this "
        "configuration. Reason: "
    ), message
    assert (
        "int8kv-shim's backend serves only --kv-cache-dtype int8 / int8_static / int4, not 'auto'"
        in message
    )


# ---------------------------------------------------------------------------------------------
# 9. README "Limitations" lists each refusal above


def test_readme_limitations_list_every_refusal() -> None:
    text = README.read_text()
    limitations = text[text.index("## Limitations") : text.index("## Tests")]
    for fragment in (
        "vLLM 0.24.0 only",  # 1
        "INT8KV_SHIM",  # 2
        "`bogus`",  # 3
        "MLA", "hybrid", "attention-free", "encoder-only", "encoder-decoder",  # 4
        "head sizes other than 64, 128 and 256", "compute capability ≥ 8.0", "float16 or bfloat16",  # 5
        "calibration file",  # 6
        "NaN", "Inf",  # 7
        "--kv-cache-dtype-skip-layers", "--attention-backend CUSTOM",  # 8
    ):  # fmt: skip
        assert fragment in limitations, fragment
