"""The shim against the real vLLM 0.24.0, each activation path in a fresh interpreter.

Scenarios (fixtures in conftest.py, one subprocess each): ``pristine`` (shim never imported),
``active`` (``import int8kv_shim`` first, INT8KV_SHIM=1), and below: off, plugin (late), sitecustomize
and the version guard. Most assertions compare a scenario's snapshot with ``pristine``: "our dtypes
added, everything else exactly as vLLM had it".
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from probe import SITECUSTOMIZE_DIR, prelude

from int8kv_shim.package import SUPPORTED_VLLM_VERSION

BACKEND_CLASS = "int8kv_shim.backend.Int8KVAttentionBackend"


# ---------------------------------------------------------------------------------------------
# Switched off


@pytest.fixture(scope="session")
def off(run_python, dtype_names: list[str]) -> dict[str, Any]:
    """INT8KV_SHIM=0 with the shim imported at start-up (sitecustomize), before vLLM."""
    code = prelude(dtype_names) + (
        "r = {'shim_imported_first': 'int8kv_shim' in sys.modules and 'vllm' not in sys.modules}\n"
        "import int8kv_shim\n"
        "r['mode'] = int8kv_shim.mode()\n"
        "r['state'] = probe.snapshot(NAMES)\n"
        "r['selection'] = probe.selection(NAMES)\n"
        "r['cli'] = probe.cli(NAMES)\n"
        "probe.emit(r)\n"
    )
    return run_python(code, shim="0", pythonpath=[SITECUSTOMIZE_DIR]).result()


def test_off_importing_the_shim_changes_nothing(off: dict, pristine: dict) -> None:
    assert off["shim_imported_first"]
    assert off["mode"] == "off"
    assert off["state"] == pristine["state"]
    assert off["selection"] == pristine["selection"]
    assert off["cli"] == pristine["cli"]


def test_pristine_vllm_rejects_our_dtypes(pristine: dict, dtype_names: list[str]) -> None:
    # Guards the other tests: if vLLM ever accepted these names itself, they would prove nothing.
    assert not pristine["shim_imported"]
    state = pristine["state"]
    assert not set(dtype_names) & set(state["cache_dtype_literal"])
    assert not any(state["cache_config_accepts"][d] for d in dtype_names)
    assert "CUSTOM" not in state["attn_overrides"]


# ---------------------------------------------------------------------------------------------
# Active (import path)


def test_active_configs_accept_our_dtypes_and_still_reject_bogus(
    active: dict, dtype_names: list[str]
) -> None:
    assert active["mode"] == "active"
    state = active["state"]
    for name in dtype_names:
        assert name in state["cache_dtype_literal"]
        assert name in state["cache_config_field"]
        assert name in state["selector_literal"]
        assert state["cache_config_accepts"][name]
        assert state["vllm_config_accepts"][name]
    assert state["cache_config_accepts"]["auto"]
    assert state["cache_config_accepts"]["int8_per_token_head"]
    assert not state["cache_config_accepts"]["bogus"]
    assert not state["vllm_config_accepts"]["bogus"]


def test_active_upstream_literal_is_extended_not_replaced(active: dict, pristine: dict) -> None:
    upstream = pristine["state"]["cache_dtype_literal"]
    assert active["state"]["cache_dtype_literal"][: len(upstream)] == upstream


def test_active_engine_args_and_serve_parser_accept_our_dtypes(
    active: dict, dtype_names: list[str]
) -> None:
    cli = active["cli"]
    assert set(dtype_names) <= set(active["state"]["cli_choices"])
    assert set(dtype_names) <= set(cli["choices"])
    for name in dtype_names:
        assert cli["parsed"][name] == name
        assert cli["engine_args"][name] == {"kv_cache_dtype": name, "cache_config": name}
    assert cli["parsed"]["bogus"] is None  # argparse: invalid choice


@pytest.mark.parametrize("cap", ["8.6", "8.0", "9.0"])
def test_active_selects_our_backend_for_our_dtypes(
    active: dict, pristine: dict, dtype_names: list[str], cap: str
) -> None:
    for name in dtype_names:
        chosen = active["selection"][f"cap={cap} kv={name}"]
        assert (chosen["chosen"], chosen["class"]) == ("CUSTOM", BACKEND_CLASS)
        # Nothing else accepts our names: a refusal by ours could never fall back silently.
        assert chosen["valid"] == ["CUSTOM"]
    for upstream in ("auto", "bfloat16"):
        key = f"cap={cap} kv={upstream}"
        assert active["selection"][key] == pristine["selection"][key]


def test_active_priorities_put_ours_first_and_leave_the_rest_alone(
    active: dict, pristine: dict, dtype_names: list[str]
) -> None:
    before = pristine["state"]["priorities"]
    after = active["state"]["priorities"]
    assert after.keys() == before.keys()
    for key, priorities in after.items():
        if key.rsplit("kv=", 1)[1] in dtype_names:
            assert priorities == ["CUSTOM", *before[key]], key
        else:
            assert priorities == before[key], key


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("cap=7.5", ["compute capability >= 8.0", "this GPU is 7.5"]),
        (
            "int4 block_size=16",
            [
                "--kv-cache-dtype int4 stores pages of 64 tokens: use --block-size 64 (or leave "
                "--block-size out), not 16"
            ],
        ),  # fmt: skip
        ("head_size=80", ["head sizes 64, 128, 256", "not 80"]),
        ("mla", ["does not support MLA"]),
        ("encoder_only", ["decoder self-attention only", "encoder_only"]),
        ("float32", ["float16 or bfloat16", "torch.float32"]),
    ],
)
def test_active_refusals_name_the_reason(active: dict, case: str, expected: list[str]) -> None:
    result = active["refusals"][case]
    assert result["chosen"] is None  # startup fails ("No valid attention backend ...")
    ours = " | ".join(result["reasons"]["CUSTOM"])
    for fragment in expected:
        assert fragment in ours, ours
    assert ours.startswith("int8kv-shim")


def test_active_backend_declarations(active: dict, dtype_names: list[str]) -> None:
    from int8kv_kernels.catalogue import get_dtype

    facts = active["backend"]
    assert facts["class"] == BACKEND_CLASS
    assert facts["name"] == facts["enum_roundtrip"] == "CUSTOM"
    assert facts["is_mla"] is False
    assert facts["forward_includes_kv_cache_update"] is False
    assert facts["supported_dtypes"] == ["torch.float16", "torch.bfloat16"]
    assert facts["supported_kv_cache_dtypes"] == dtype_names
    for name in dtype_names:
        assert facts["kv_cache_shape"][name] == [10, get_dtype(name).page_bytes(16, 8, 128)]
    # every registered dtype has kernels: none is refused by the impl at head size 128
    assert facts["impl_errors"] == {name: None for name in dtype_names}


def test_int4_layers_allocate_their_tail_pool_when_built(active: dict) -> None:
    from int8kv_kernels.catalogue import get_dtype

    facts = active["backend"]
    # max_num_seqs slots x (K, V) x kv heads x two 64-token pages x head size, the model's dtype,
    # with the block each half holds, and a sink page a slot (int4's defaults); built with the
    # model, so vLLM's memory profiling counts it before sizing the KV cache
    assert facts["tail_pools"] == {
        "int8": None,
        "int8_static": None,
        "int4": ["torch.bfloat16", [3, 2, 8, 128, 128], [[-1, -1]] * 3, [3, 2, 8, 64, 128]],
    }
    # a layer reading another layer's cache reads that layer's tail and allocates none
    assert facts["shared_layer_pool"] is True
    # and the cache tokens that memory would hold (8 kv-heads of 128 per int4 token)
    pool_bytes = 3 * 2 * 8 * 128 * 128 * 2 + 3 * 2 * 8 * 64 * 128 * 2 + 3 * 2 * 4
    tokens = pool_bytes // (8 * get_dtype("int4").bytes_per_token_head(128))
    assert facts["pool_accounting"] == [3, 1, pool_bytes, tokens]
    assert facts["int4_without_config"].startswith(
        "int8kv-shim: --kv-cache-dtype int4 sizes its tail pool from vLLM's config"
    )


def test_int4_sets_its_block_size_when_the_user_gave_none(active: dict) -> None:
    assert active["backend"]["preferred_block_size"] == {
        "int8": 16, "int8_static": 16, "int4": 64, "auto": 16,
    }  # fmt: skip
    assert active["refusals"]["int4 block_size=64"]["chosen"] == "CUSTOM"


def test_spec_page_bytes_match_kv_cache_shape(active: dict, dtype_names: list[str]) -> None:
    from int8kv_kernels.catalogue import get_dtype

    rows = active["backend"]["spec_vs_shape_bytes"]
    assert len(rows) == len(dtype_names) * 3 * 3 * 2
    for name, head, block, kind, spec_bytes, shape_bytes, merged_bytes, merged_cls in rows:
        assert spec_bytes == shape_bytes == merged_bytes, (name, head, block, kind)
        assert spec_bytes == get_dtype(name).page_bytes(block, 4, head)
        assert merged_cls.startswith("Int8KV"), merged_cls  # merge keeps our subclass


def test_active_str_dtype_table(active: dict, pristine: dict, dtype_names: list[str]) -> None:
    before = pristine["state"]["str_dtype_to_torch_dtype"]
    after = active["state"]["str_dtype_to_torch_dtype"]
    assert {k: v for k, v in after.items() if k not in dtype_names} == {
        k: v for k, v in before.items() if k not in dtype_names
    }
    assert all(after[name] == "torch.int8" for name in dtype_names)
    assert before["int8"] == "torch.int8"  # upstream already had it; undo must keep it


def test_active_registers_the_backend(active: dict) -> None:
    assert active["state"]["attn_overrides"] == {"CUSTOM": BACKEND_CLASS}


def test_layers_with_our_dtypes_get_our_spec(active: dict, dtype_names: list[str]) -> None:
    specs = active["backend"]["layer_specs"]
    for name in dtype_names:
        assert specs[f"{name} window=None"] == "Int8KVFullAttentionSpec"
        assert specs[f"{name} window=64"] == "Int8KVSlidingWindowSpec"
    assert specs["auto window=None"] == "FullAttentionSpec"  # other layers untouched
    assert specs["auto window=64"] == "SlidingWindowSpec"


def test_active_wraps_kv_cache_spec(active: dict, pristine: dict) -> None:
    # P7: layers with our dtypes get our spec; uninstrument restores the plain method (compared
    # in test_instrument_is_idempotent_and_uninstrument_restores_vllm).
    assert pristine["state"]["kv_cache_spec_method"] == "function"
    assert active["state"]["kv_cache_spec_method"].endswith("FunctionWrapper")


def test_instrument_is_idempotent_and_uninstrument_restores_vllm(
    active: dict, pristine: dict
) -> None:
    assert active["state_after_second_instrument"] == active["state"]
    assert active["mode_after_uninstrument"] == "off"
    assert active["state_after_uninstrument"] == pristine["state"]
    assert active["state_after_reinstrument"] == active["state"]
    assert len(active["applied"]) == len(set(active["applied"])) == 11
    assert "static_scales_loader" in active["applied"]
    # P13, in the engine core
    assert "report_tail_pool" in active["applied"]
    # P10; the runner hooks (P11/P12) only once an int4 layer meets an imported runner module
    assert "refuse_unsupported_int4_options" in active["applied"]
    assert not {"v1_runner_tail_slots", "v2_runner_tail_slots"} & set(active["applied"])


def test_active_wraps_the_engine_cores_kv_cache_sizing(active: dict, pristine: dict) -> None:
    # P13 reports the tail pool's share after vLLM sized the cache; uninstrument restores it
    assert pristine["state"]["engine_core_kv_cache_configs"] == "function"
    assert active["state"]["engine_core_kv_cache_configs"].endswith("FunctionWrapper")


def test_active_wraps_process_weights_after_loading(active: dict, pristine: dict) -> None:
    # P8; uninstrument restores the plain method (compared with pristine just above).
    assert pristine["state"]["process_weights_method"] == "function"
    assert active["state"]["process_weights_method"].endswith("FunctionWrapper")


def test_int8_static_layers_load_their_scales_after_weight_loading(active: dict) -> None:
    r = active["static_scales"]
    # <model_dir>/int8kv_scales.json, layer by layer (stat = 127 + 10 * layer + head + channel /
    # 128), as fp32 [kv heads, head size] tensors on the layer's device; vLLM's own _k_scale
    # stays at its default and is not used.
    assert r["model_dir"]["k"] == pytest.approx([137.0 + h for h in range(8)])
    assert r["model_dir"]["k_last_channel"] == pytest.approx(
        [137.0 + h + 127 / 128 for h in range(8)]
    )
    assert r["model_dir"]["shape"] == [8, 128]
    assert r["model_dir_layer0"]["k"] == pytest.approx([127.0 + h for h in range(8)])
    assert r["model_dir"]["v"] == pytest.approx([127.0 + h for h in range(8)])
    assert (r["model_dir"]["dtype"], r["model_dir"]["device"]) == ("torch.float32", "cpu")
    assert (r["model_dir"]["v_format"], r["model_dir"]["vllm_k_scale"]) == ("int8", 1.0)
    # INT8KV_SCALES wins over the file next to the model.
    assert r["env_override"]["k"] == pytest.approx([264.0 + h for h in range(8)])
    # TP=2 rank 1 of 8 kv heads: heads 4..7; TP=4 rank 2 of 2 kv heads: head 1, replicated.
    assert r["tp2_rank1"]["k"] == pytest.approx([141.0 + h for h in range(4)])
    assert r["tp4_rank2_two_heads"]["k"] == pytest.approx([138.0])
    # Other dtypes are untouched; each file is read once per process however many layers use it.
    assert r["int8_layer"] is None
    assert r["loads"] == ["int8kv_scales.json", "override.json", "two_heads.json",
                          "missing.json", "e4m3.json"]  # fmt: skip


def test_int8_static_refuses_at_startup_without_a_usable_file(active: dict) -> None:
    r = active["static_scales"]
    missing = r["files"]["missing.json"]
    assert r["missing"] == (
        f"ScalesFileError: int8kv-shim: calibration file {missing}: does not exist (from "
        "INT8KV_SCALES); --kv-cache-dtype int8_static needs one: create it with `int8kv "
        "calibrate MODEL` (writes MODEL/int8kv_scales.json) or set INT8KV_SCALES"
    )
    model_file = r["model_file"]
    assert r["wrong_head_dim"] == (
        f"ScalesFileError: int8kv-shim: calibration file {model_file}: was made for another "
        f"model ({model_file.rsplit('/', 1)[0]}): it has head_dim 128, the running model has "
        "head_dim 64"
    )
    # Scales never silently default: an int8_static impl without them fails at first use.
    assert r["unloaded_forward"].startswith("int8kv-shim: this int8_static layer has no scales")


def test_int8_static_e4m3_file_sets_v_format_and_its_scales(active: dict) -> None:
    r = active["static_scales"]
    assert r["e4m3"]["v_format"] == "e4m3"
    assert r["e4m3"]["v"] == pytest.approx([(127.0 + h) * 127 / 448 for h in range(8)])


# ---------------------------------------------------------------------------------------------
# Plugin path (late: vLLM fully imported before the shim)


@pytest.fixture(scope="session")
def plugin(run_python, dtype_names: list[str]) -> dict[str, Any]:
    code = prelude(dtype_names) + (
        "r = {'before': probe.snapshot(NAMES)}\n"
        "assert 'int8kv_shim' not in sys.modules\n"
        "from importlib.metadata import entry_points\n"
        "eps = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'int8kv_shim']\n"
        "r['entry_points'] = [e.value for e in eps]\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "r['after'] = probe.snapshot(NAMES)\n"
        "from int8kv_shim import patch\n"
        "r['applied'] = list(patch.applied_patches())\n"
        "eps[0].load()()\n"
        "eps[0].load()()\n"
        "r['after_twice_more'] = probe.snapshot(NAMES)\n"
        "r['applied_after'] = list(patch.applied_patches())\n"
        "r['selection'] = probe.selection(NAMES)\n"
        "probe.emit(r)\n"
    )
    return run_python(code, shim="1").result()


def test_plugin_entry_point_is_discoverable(plugin: dict) -> None:
    assert plugin["entry_points"] == ["int8kv_shim.plugin:register"]


def test_plugin_patches_an_already_imported_vllm(
    plugin: dict, pristine: dict, active: dict
) -> None:
    assert plugin["before"] == pristine["state"]
    assert plugin["after"] == active["state"]
    assert plugin["selection"] == active["selection"]


def test_plugin_register_twice_is_harmless(plugin: dict) -> None:
    assert plugin["after_twice_more"] == plugin["after"]
    assert plugin["applied_after"] == plugin["applied"]


# ---------------------------------------------------------------------------------------------
# sitecustomize path


def test_sitecustomize_path_patches_vllm(run_python, dtype_names: list[str], active: dict) -> None:
    code = prelude(dtype_names) + (
        "r = {'shim_imported_first': 'int8kv_shim' in sys.modules and 'vllm' not in sys.modules}\n"
        "r['state'] = probe.snapshot(NAMES)\n"
        "probe.emit(r)\n"
    )
    result = run_python(code, shim="1", pythonpath=[SITECUSTOMIZE_DIR]).result()
    assert result["shim_imported_first"]
    assert result["state"] == active["state"]


# ---------------------------------------------------------------------------------------------
# Version guard


def _fake_metadata_version(fake: str) -> str:
    """The version vLLM's distribution metadata reports (what the shim checks first)."""
    return (
        "import importlib.metadata as md\n"
        "_real_version = md.version\n"
        f"md.version = lambda name: {fake!r} if name == 'vllm' else _real_version(name)\n"
    )


def _fake_imported_tree_version(fake: str) -> str:
    """Metadata says 0.24.0 but the imported tree is another version (source/editable trees)."""
    return (
        "import types\n"
        "v = types.ModuleType('vllm._version')\n"
        f"v.__version__ = v.version = {fake!r}\n"
        "v.__version_tuple__ = v.version_tuple = (0, 25, 0)\n"
        "v.__commit_id__ = v.commit_id = None\n"
        "sys.modules['vllm._version'] = v\n"
    )


_GUARD_SCENARIO = (
    "import int8kv_shim\n"
    "r = {'state': probe.snapshot(NAMES)}\n"
    "r['mode'] = int8kv_shim.mode()  # read after vLLM's import: the tree check runs then\n"
    "r['cli'] = probe.cli(NAMES, create_engine_config=True)\n"
    "from vllm.engine.arg_utils import EngineArgs\n"
    "from int8kv_shim.package import UnsupportedVLLMVersionError\n"
    "try:\n"
    "    EngineArgs(model='/nonexistent', kv_cache_dtype=NAMES[0]).create_engine_config()\n"
    "except UnsupportedVLLMVersionError as exc:\n"
    "    r['error_type'] = type(exc).__name__\n"
    "probe.emit(r)\n"
)


@pytest.mark.parametrize(
    ("fake", "faker"),
    [
        ("0.23.0", _fake_metadata_version),
        ("0.25.0", _fake_metadata_version),
        ("0.24.1", _fake_metadata_version),
        ("0.25.0.dev1", _fake_imported_tree_version),
    ],
)
def test_version_guard_refuses_on_unsupported_vllm(
    run_python, dtype_names: list[str], pristine: dict, fake: str, faker
) -> None:
    code = prelude(dtype_names) + faker(fake) + _GUARD_SCENARIO
    run = run_python(code, shim="1")
    result = run.result()

    assert result["mode"] == "inert"
    assert result["error_type"] == "UnsupportedVLLMVersionError"
    # Inert: nothing widened, registered or wrapped, except the argparse choices (below).
    state, before = dict(result["state"]), dict(pristine["state"])
    assert state.pop("cli_choices") == before.pop("cli_choices") + dtype_names
    assert state == before
    # Exactly one warning, naming both versions.
    assert run.output.count("stays inactive") == 1, run.output[-4000:]
    warning = next(line for line in run.output.splitlines() if "stays inactive" in line)
    assert fake in warning and SUPPORTED_VLLM_VERSION in warning

    cli = result["cli"]
    assert cli["parsed"]["bogus"] is None
    for name in dtype_names:
        # argparse lets the name through so that startup can say what is wrong ...
        assert cli["parsed"][name] == name
        error = cli["engine_args"][name]["create_engine_config"]
        # ... which is our error, not pydantic's "Input should be 'auto', 'float16', ...".
        assert error.startswith("UnsupportedVLLMVersionError:"), error
        for fragment in (
            repr(name),
            fake,
            SUPPORTED_VLLM_VERSION,
            f"pip install vllm=={SUPPORTED_VLLM_VERSION}",
            "INT8KV_SHIM",
        ):
            assert fragment in error, error
    # vLLM's own dtypes go on to vLLM (which then fails here for want of a GPU, not because of us).
    assert "UnsupportedVLLMVersionError" not in cli["engine_args"]["auto"]["create_engine_config"]


# ---------------------------------------------------------------------------------------------
# GPU machine: the whole `vllm serve` parser and engine config (both need a CUDA platform)


@pytest.mark.gpu
def test_gpu_serve_parser_and_engine_config(run_python, dtype_names: list[str]) -> None:
    model = os.environ.get("SMOLLM2_DIR")
    if not model:
        pytest.skip("set SMOLLM2_DIR to a small local model folder")
    code = prelude(dtype_names) + (
        "import int8kv_shim\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "r = {'cli': probe.cli(NAMES)}\n"
        f"MODEL = {model!r}\n"
        "r['configs'] = {d: EngineArgs(model=MODEL, kv_cache_dtype=d)"
        ".create_engine_config().cache_config.cache_dtype for d in NAMES}\n"
        "probe.emit(r)\n"
    )
    result = run_python(code, shim="1").result()
    assert result["cli"]["parser_complete"]
    assert set(dtype_names) <= set(result["cli"]["choices"])
    assert result["configs"] == {d: d for d in dtype_names}
