"""The start-up line on what int4's tail pool takes of the KV memory (int8kv_shim/tail_pool_memory.py)
and patch P13, which calls it after the engine core sizes the cache."""

from __future__ import annotations

import json
import types
from types import SimpleNamespace

import pytest

from int8kv_kernels.catalogue import get_dtype
from int8kv_shim import patch, tail_pool_memory

GIB = 2**30
INT4 = get_dtype("int4")


@pytest.fixture(autouse=True)
def _one_page_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    # the figures below are worked out for a slot of one page (the newest, no sink page); the
    # tests of more pages switch them on themselves
    monkeypatch.setenv("INT8KV_INT4_TAIL_PAGES", "1")
    monkeypatch.setenv("INT8KV_INT4_SINK_PAGE", "0")


def test_by_default_a_slot_holds_two_tail_pages_and_a_sink_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one = tail_pool_memory.slot_bytes("int4", 32, 8, 128, 2)
    monkeypatch.delenv("INT8KV_INT4_TAIL_PAGES")
    monkeypatch.delenv("INT8KV_INT4_SINK_PAGE")
    assert tail_pool_memory.pages_per_slot() == 3
    assert tail_pool_memory.slot_bytes("int4", 32, 8, 128, 2) == 3 * one


def _specs(dtype: str, layers: int = 32, nkv: int = 8, d: int = 128) -> dict:
    spec = SimpleNamespace(int8kv_dtype=dtype, num_kv_heads=nkv, head_size=d)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}


def _llama_on_a_small_card() -> tail_pool_memory.TailPoolCost:
    # Llama-3-8B's attention (32 layers, 8 kv-heads of 128) at vLLM's default 256 sequences,
    # beside a 2.5 GiB cache: 4.5 GiB of KV memory in all
    cost = tail_pool_memory.tail_pool_cost(_specs("int4"), 256, 2, int(2.5 * GIB))
    assert cost is not None
    return cost


def test_the_cost_of_a_pool_beside_its_cache() -> None:
    cost = _llama_on_a_small_card()
    assert (cost.dtype, cost.slots, cost.layers) == ("int4", 256, 32)
    assert cost.slot_bytes == 32 * INT4.tail_slot_bytes(8, 128)
    assert cost.pool_bytes == 2 * GIB + 256 * 32 * 4
    assert cost.share() == pytest.approx(2 / 4.5, abs=1e-5)
    # the same figure as the catalogue's, in 4.5 GiB of KV memory
    tokens = INT4.tokens_with_tail(cost.kv_memory, 32, 8, 128, 256)
    bf16 = cost.kv_memory / (32 * 8 * 2 * 2 * 128)
    assert cost.vs_bf16() == pytest.approx(tokens / bf16, rel=1e-4)
    assert cost.vs_bf16(0) == pytest.approx(INT4.capacity_vs_bf16(128))
    # 5% of 4.5 GiB holds 28 slots of 8 MiB: 16 is the largest power of two under it
    assert cost.slots_for_share(0.05) == 16
    assert cost.share(16) <= 0.05 < cost.share(32)
    assert cost.slots_for_share(1e-9) == 1


def test_only_tail_dtypes_have_a_pool() -> None:
    assert tail_pool_memory.tail_pool_cost(_specs("int8"), 256, 2, GIB) is None
    assert tail_pool_memory.tail_pool_cost({"x": SimpleNamespace()}, 256, 2, GIB) is None
    # an int8 layer beside int4 ones has no slots
    mixed = {**_specs("int4", layers=2), "other": SimpleNamespace(int8kv_dtype="int8")}
    cost = tail_pool_memory.tail_pool_cost(mixed, 4, 2, GIB)
    assert cost is not None and cost.layers == 2


def test_the_line_advises_fewer_sequences_only_when_the_pool_is_large() -> None:
    text = tail_pool_memory.message(_llama_on_a_small_card())
    assert text.startswith(
        "int8kv-shim: int4's tail pool (256 slots = max_num_seqs, x 32 layers) takes 2.00 GiB "
        "of 4.50 GiB of KV memory (44%): the cache holds 2.03x the tokens BF16 would in that "
        "memory, 3.66x without the pool. --max-num-seqs 16 would give it 3% (3.56x)"
    ), text
    big = tail_pool_memory.tail_pool_cost(_specs("int4"), 256, 2, 60 * GIB)
    assert big is not None and big.share() < tail_pool_memory.WARN_SHARE
    assert "--max-num-seqs" not in tail_pool_memory.message(big)


def test_report_logs_a_warning_for_a_large_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[tuple[str, str]] = []
    fake = SimpleNamespace(
        info=lambda msg: said.append(("info", msg)), warning=lambda msg: said.append(("warn", msg))
    )
    monkeypatch.setattr(tail_pool_memory, "logger", fake)
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=256),
        model_config=SimpleNamespace(dtype=SimpleNamespace(itemsize=2)),
    )
    cache = SimpleNamespace(kv_cache_tensors=[SimpleNamespace(size=GIB)] * 2 + [])
    cost = tail_pool_memory.report(config, [_specs("int4"), _specs("int4")], [cache, cache])
    assert cost is not None and cost.cache_bytes == 2 * GIB
    assert [kind for kind, _ in said] == ["warn"] and "--max-num-seqs" in said[0][1]
    said.clear()
    assert tail_pool_memory.report(config, [_specs("int8")], [cache]) is None
    assert tail_pool_memory.report(config, [], []) is None
    assert said == []


def test_p13_reports_after_vllm_sized_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []

    def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory):  # vLLM's signature
        return ["configs", vllm_config, kv_cache_specs, available_memory]

    core = types.ModuleType("fake_engine_core")
    core.get_kv_cache_configs = get_kv_cache_configs
    monkeypatch.setattr(tail_pool_memory, "report", lambda *a: calls.append(a))
    # this process patches nothing else (the shim's other patches are tested in subprocesses)
    assert patch.applied_patches() == ()
    try:
        patch.patch_report_tail_pool(core)
        patch.patch_report_tail_pool(core)  # idempotent
        assert patch.applied_patches() == ("report_tail_pool",)
        assert core.get_kv_cache_configs is not get_kv_cache_configs
        assert core.get_kv_cache_configs("cfg", ["specs"], [1]) == [
            "configs",
            "cfg",
            ["specs"],
            [1],
        ]
        assert core.get_kv_cache_configs("cfg", kv_cache_specs=["s"], available_memory=[2]) == [
            "configs",
            "cfg",
            ["s"],
            [2],
        ]
        assert calls == [
            ("cfg", ["specs"], ["configs", "cfg", ["specs"], [1]]),
            ("cfg", ["s"], ["configs", "cfg", ["s"], [2]]),
        ]

        # a failing report is a warning, never an engine that does not start
        def broken(*a):
            raise RuntimeError("no specs")

        monkeypatch.setattr(tail_pool_memory, "report", broken)
        assert core.get_kv_cache_configs("cfg", [], []) == ["configs", "cfg", [], []]
    finally:
        patch.undo_all()
    assert core.get_kv_cache_configs is get_kv_cache_configs


def test_report_reads_vllms_own_spec_and_config_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    # the attributes report() reads, on the classes vLLM 0.24.0 hands get_kv_cache_configs
    torch = pytest.importorskip("torch")
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    from int8kv_shim.kv_spec import to_int8kv_spec

    full = FullAttentionSpec(block_size=64, num_kv_heads=8, head_size=128, dtype=torch.int8)
    spec = to_int8kv_spec(full, "int4")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    blocks = 1000
    config = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[KVCacheTensor(size=blocks * spec.page_size_bytes, shared_by=[n]) for n in names],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )  # fmt: skip
    vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        model_config=SimpleNamespace(dtype=torch.bfloat16),
    )
    monkeypatch.setattr(
        tail_pool_memory, "logger", SimpleNamespace(info=lambda m: None, warning=lambda m: None)
    )
    cost = tail_pool_memory.report(vllm_config, [dict.fromkeys(names, spec)], [config])
    assert cost is not None
    assert cost.cache_bytes == 4 * blocks * 64 * 8 * INT4.bytes_per_token_head(128)
    assert cost.pool_bytes == 8 * 4 * INT4.tail_slot_bytes(8, 128)
    # the cache's tokens per byte are the page's: 64 tokens a block
    assert cost.cache_bytes // cost.cache_bytes_per_token == blocks * 64


# ---------------------------------------------------------------------------------------------
# The default max_num_seqs (before the engine is built, patch P10)


def test_the_cap_is_the_largest_power_of_two_whose_pool_fits() -> None:
    cap = tail_pool_memory.capped_max_num_seqs
    slot = 32 * INT4.tail_slot_bytes(8, 128)  # Llama-3-8B's 32 layers: 8 MiB a sequence
    # 4% of 5 GiB holds 25 slots: 16
    assert cap("int4", 256, 5 * GIB, 32, 8, 128, 2) == 16
    assert 16 * slot <= 0.04 * 5 * GIB < 32 * slot
    # vLLM's default already fits: kept
    assert cap("int4", 256, 100 * GIB, 32, 8, 128, 2) is None
    assert cap("int4", 1024, 120 * GIB, 32, 8, 128, 2) == 512  # 614 slots fit
    # never below MIN_CAPPED_SEQS, however small the memory
    assert cap("int4", 256, GIB // 2, 32, 8, 128, 2) == tail_pool_memory.MIN_CAPPED_SEQS == 8
    assert cap("int4", 256, -GIB, 32, 8, 128, 2) is None
    assert cap("int8", 256, GIB, 32, 8, 128, 2) is None


def test_the_cap_never_leaves_cache_that_full_length_sequences_cannot_fill() -> None:
    """Never fewer slots than the sequences of max_model_len tokens the cache holds beside them:
    SmolLM2 at 8K on an H100 at 0.5 of its memory got 256 slots, a third of its int4 cache."""
    cap = tail_pool_memory.capped_max_num_seqs
    smol = ("int4", 1024, 39.6 * GIB, 30, 3, 64, 2)  # SmolLM2's 30 layers of 3 x 64
    assert cap(*smol, pages=3) == 256  # 4% of the memory: 256 slots
    seqs = tail_pool_memory.full_length_seqs(
        "int4", 39.6 * GIB, 30, 3, 64, 8192, tail_pool_memory.slot_bytes("int4", 30, 3, 64, 2, 3)
    )
    assert seqs == 739 and cap(*smol, pages=3, max_model_len=8192) == 752  # a multiple of 16
    slot = tail_pool_memory.slot_bytes("int4", 30, 3, 64, 2, pages=3)
    token = 30 * 3 * INT4.bytes_per_token_head(64)
    # the cache holds that many 8192-token sequences with their slots, and not one more
    assert seqs * (8192 * token + slot) <= 39.6 * GIB < (seqs + 1) * (8192 * token + slot)
    assert seqs == tail_pool_memory.full_length_seqs("int4", 39.6 * GIB, 30, 3, 64, 8192, slot)
    # long sequences: the 4% goal decides; short ones: vLLM's default already fits them
    assert cap(*smol, pages=3, max_model_len=131072) == 256
    assert cap(*smol, pages=3, max_model_len=2048) is None
    # an 8B model on a 24 GB card at 8K: 22 sequences fill the cache, where 4% holds 8; 22 is
    # rounded up to 24, a CUDA-graph batch size
    llama = ("int4", 256, 6.6 * GIB, 32, 8, 128, 2)
    slot = tail_pool_memory.slot_bytes("int4", 32, 8, 128, 2, pages=3)
    assert tail_pool_memory.full_length_seqs(*llama[:1], 6.6 * GIB, 32, 8, 128, 8192, slot) == 22
    assert cap(*llama, pages=3) == 8 and cap(*llama, pages=3, max_model_len=8192) == 24


@pytest.mark.parametrize(
    ("seqs", "size"),
    [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (121, 128), (125, 128),
     (248, 248), (250, 256), (256, 256), (257, 272), (500, 512), (512, 512), (739, 752)],
)  # fmt: skip
def test_graph_batch_size_is_the_next_of_vllms_capture_sizes(seqs: int, size: int) -> None:
    assert tail_pool_memory.graph_batch_size(seqs) == size


def test_graph_batch_size_is_the_next_of_the_users_capture_sizes() -> None:
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert tail_pool_memory.graph_batch_size(72, sizes) == 128
    assert tail_pool_memory.graph_batch_size(64, sizes) == 64
    assert tail_pool_memory.graph_batch_size(300, sizes) == 300  # none as large: no graph anyway
    read = tail_pool_memory.user_capture_sizes
    assert read(SimpleNamespace(cudagraph_capture_sizes=(8, 16), compilation_config=None)) == [
        8,
        16,
    ]
    assert read(SimpleNamespace(compilation_config={"cudagraph_capture_sizes": [4]})) == [4]
    assert read(SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_capture_sizes=[2])))
    assert read(SimpleNamespace(cudagraph_capture_sizes=None, compilation_config={})) is None
    assert read(SimpleNamespace()) is None


def test_the_users_capture_sizes_round_the_cap(tmp_path, monkeypatch) -> None:
    _weights(tmp_path, {"model.safetensors": 15 * GIB})
    args = _engine_args(tmp_path, cudagraph_capture_sizes=[1, 2, 4, 8, 16, 48, 64])
    # one page a slot, 8 MiB: 4% of 6.6 GiB holds 33 slots, 32, rounded up to 48
    seqs, warning = tail_pool_memory.default_max_num_seqs(args, 256, 24 * GIB)
    assert seqs == 48 and warning.endswith(
        "stays within 4% of the KV memory (about 6.6 GiB: GPU memory x --gpu-memory-utilization "
        "- weights): 32 slots, rounded up to 48, a batch size vLLM captures CUDA graphs for; give "
        "--max-num-seqs to choose"
    )
    # three pages a slot, 24 MiB: 22 sequences of 8192 tokens decide, rounded up to 48 too
    monkeypatch.setenv("INT8KV_INT4_TAIL_PAGES", "2")
    monkeypatch.setenv("INT8KV_INT4_SINK_PAGE", "1")
    args.create_model_config().max_model_len = 8192
    seqs, warning = tail_pool_memory.default_max_num_seqs(args, 256, 24 * GIB)
    assert seqs == 48 and "(max_model_len: 22), rounded up to 48, a batch size" in warning


def test_the_warning_names_the_floor_when_4_percent_holds_fewer_slots(tmp_path) -> None:
    args = _engine_args(tmp_path, kv_cache_memory_bytes=GIB)
    seqs, warning = tail_pool_memory.default_max_num_seqs(args, 256, None)
    # 4% of 1 GiB holds 5 slots of 8 MiB: the floor of 8 decides, and the warning says so
    assert seqs == tail_pool_memory.MIN_CAPPED_SEQS == 8
    assert "max_num_seqs 8 instead of vLLM's default 256, the fewest it sets: 4% of the KV " in (
        warning
    )
    assert "memory (1.0 GiB: --kv-cache-memory-bytes) holds 5 slots of its tail pool" in warning


def test_a_capped_max_num_seqs_has_a_full_decode_graph_for_its_fullest_batch() -> None:
    """vLLM's own capture sizes and dispatcher (VllmConfig._set_cudagraph_sizes and
    CudagraphDispatcher on a stand-in config): with max_num_seqs at graph_batch_size, every decode
    batch up to it replays a FULL graph; every max_num_seqs it skips over would have left its
    fullest batches without one."""
    pytest.importorskip("vllm")
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.config.compilation import CompilationConfig
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    def eager_decodes(max_num_seqs: int) -> list[int]:
        """The decode batch sizes that get no FULL graph at this max_num_seqs."""
        config = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(enforce_eager=False), compilation_config=config,
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs,
                                             max_num_batched_tokens=16384),
            num_speculative_tokens=0, performance_mode="balanced", lora_config=None,
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
        )  # fmt: skip
        VllmConfig._set_cudagraph_sizes(vllm_config)
        dispatcher = CudagraphDispatcher.__new__(CudagraphDispatcher)
        dispatcher.__dict__.update(
            vllm_config=vllm_config, compilation_config=config, uniform_decode_query_len=1,
            cudagraph_keys={CUDAGraphMode.PIECEWISE: set(), CUDAGraphMode.FULL: set()},
            keys_initialized=False, specialize_lora_count=False, cudagraph_mode=CUDAGraphMode.NONE,
        )  # fmt: skip
        dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE)
        return [n for n in range(1, max_num_seqs + 1)
                if dispatcher.dispatch(n, uniform_decode=True)[0] != CUDAGraphMode.FULL]  # fmt: skip

    assert eager_decodes(125) == [121, 122, 123, 124, 125]  # padded to 128: piecewise only
    for seqs in [*range(1, 40), 120, 121, 125, 129, 249, 250, 256, 257, 300, 500, 512]:
        size = tail_pool_memory.graph_batch_size(seqs)
        assert size >= seqs and eager_decodes(size) == []
        assert all(eager_decodes(m) for m in range(seqs, size))


def _weights(folder, sizes: dict[str, int]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, size in sizes.items():
        with open(folder / name, "wb") as f:
            f.truncate(size)  # sparse: the size without the disk


def test_sliding_window_layers_hold_only_their_window() -> None:
    """Gemma 3 270M: 18 layers of one 256-wide kv-head, 15 of them on a 512-token window. Counting
    every layer at 32K tokens held 98 sequences where vLLM itself reported 151, and capped int4's
    default at 128 sequences on an H100 at --gpu-memory-utilization 0.2."""
    slot = tail_pool_memory.slot_bytes("int4", 18, 1, 256, 2, pages=3)
    token = INT4.bytes_per_token_head(256)
    full = tail_pool_memory.full_length_seqs
    window = tail_pool_memory.SlidingWindow(layers=15, tokens=512)
    everything = full("int4", 15.5 * GIB, 18, 1, 256, 32768, slot)
    assert everything == 98
    windowed = full("int4", 15.5 * GIB, 18, 1, 256, 32768, slot, window)
    per_seq = (3 * 32768 + 15 * 512) * token + slot
    assert windowed == int(15.5 * GIB // per_seq) == 501
    # a window longer than the sequences changes nothing; a window on every layer counts them all
    longer = tail_pool_memory.SlidingWindow(layers=15, tokens=65536)
    assert full("int4", 15.5 * GIB, 18, 1, 256, 32768, slot, longer) == everything
    every = tail_pool_memory.SlidingWindow(layers=40, tokens=512)
    assert full("int4", 15.5 * GIB, 18, 1, 256, 32768, slot, every) == int(
        15.5 * GIB // (18 * 512 * token + slot)
    )
    # so the 4% goal (188 slots: 128) no longer caps Gemma 3 below vLLM's default there
    gemma = ("int4", 256, 15.5 * GIB, 18, 1, 256, 2)
    assert tail_pool_memory.capped_max_num_seqs(*gemma, pages=3, max_model_len=32768) == 128
    assert tail_pool_memory.capped_max_num_seqs(*gemma, pages=3, max_model_len=32768,
                                                window=window) is None  # fmt: skip


def _model_config(window: int | None, layer_types: list[str] | None = None) -> SimpleNamespace:
    text = SimpleNamespace() if layer_types is None else SimpleNamespace(layer_types=layer_types)
    return SimpleNamespace(get_sliding_window=lambda: window, hf_text_config=text)


def test_the_sliding_window_is_read_from_the_models_config() -> None:
    window = tail_pool_memory.sliding_window
    gemma3 = (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert window(_model_config(512, gemma3), 18) == tail_pool_memory.SlidingWindow(15, 512)
    # pipeline parallelism: a worker's share of the layers
    assert window(_model_config(512, gemma3), 9) == tail_pool_memory.SlidingWindow(8, 512)
    # Mistral's form: a window and no layer types is a window on every layer
    assert window(_model_config(4096), 32) == tail_pool_memory.SlidingWindow(32, 4096)
    assert window(_model_config(None), 32) is None
    assert window(_model_config(4096, ["full_attention"] * 32), 32) is None


def test_the_sliding_window_of_vllms_own_model_config(tmp_path) -> None:
    """vLLM's ModelConfig of a Gemma 3 text config (six layers: transformers' default pattern puts
    a full-attention layer after five on the window) and of a Llama one (no window)."""
    pytest.importorskip("vllm")
    from transformers import Gemma3TextConfig, LlamaConfig
    from vllm.engine.arg_utils import EngineArgs

    shape = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    Gemma3TextConfig(**shape, head_dim=256, sliding_window=8).save_pretrained(tmp_path / "gemma3")
    LlamaConfig(**shape).save_pretrained(tmp_path / "llama")
    configs = {
        name: EngineArgs(model=str(tmp_path / name), skip_tokenizer_init=True).create_model_config()
        for name in ("gemma3", "llama")
    }
    window = tail_pool_memory.sliding_window
    assert window(configs["gemma3"], 6) == tail_pool_memory.SlidingWindow(5, 8)
    assert window(configs["llama"], 6) is None


def test_the_users_kv_cache_memory_is_the_memory_the_cap_divides(tmp_path) -> None:
    _weights(tmp_path, {"model.safetensors": 15 * GIB})
    # 0.9 x 80 GiB - 15 GiB = 57 GiB: vLLM's 256 fit; 2 GiB of cache: 4% holds 10 slots of 8 MiB
    args = _engine_args(tmp_path)
    assert tail_pool_memory.default_max_num_seqs(args, 256, 80 * GIB) is None
    args = _engine_args(tmp_path, kv_cache_memory_bytes=2 * GIB)
    seqs, warning = tail_pool_memory.default_max_num_seqs(args, 256, 80 * GIB)
    assert seqs == 8
    assert "(8.0 MiB a sequence) stays within 4% of the KV memory (2.0 GiB: " in warning
    assert "--kv-cache-memory-bytes)" in warning
    # given bytes need neither the GPU's memory nor the weight files
    (tmp_path / "no-weights").mkdir()
    args = _engine_args(tmp_path / "no-weights", kv_cache_memory_bytes=2 * GIB)
    assert tail_pool_memory.default_max_num_seqs(args, 256, None)[0] == 8


def test_the_warning_names_the_window_when_full_length_sequences_set_the_cap(tmp_path) -> None:
    _weights(tmp_path, {"model.safetensors": 15 * GIB})
    args = _engine_args(tmp_path)
    config = args.create_model_config()
    config.max_model_len = 8192
    config.get_sliding_window = lambda: 1024
    config.hf_text_config = SimpleNamespace(
        layer_types=["sliding_attention", "full_attention"] * 16
    )
    # 6.6 GiB of 8 MiB slots: 4% holds 32, 8192-token sequences on every layer 23, 40 with the window
    seqs, warning = tail_pool_memory.default_max_num_seqs(args, 256, 24 * GIB)
    slot = tail_pool_memory.slot_bytes("int4", 32, 8, 128, 2)
    window = tail_pool_memory.SlidingWindow(16, 1024)
    assert slot == 8 * 2**20 + 128
    assert seqs == 40 == tail_pool_memory.full_length_seqs("int4", 6.6 * GIB, 32, 8, 128, 8192,
                                                           slot, window)  # fmt: skip
    assert tail_pool_memory.full_length_seqs("int4", 6.6 * GIB, 32, 8, 128, 8192, slot) == 23
    assert "sequences of 8192 tokens (max_model_len, 16 of its 32 layers holding their " in warning
    assert "1024-token window: 40); its tail pool" in warning
    # without vLLM's hybrid manager every layer keeps every token: 4% decides again
    args.disable_hybrid_kv_cache_manager = True
    seqs, warning = tail_pool_memory.default_max_num_seqs(args, 256, 24 * GIB)
    assert seqs == 32 and "stays within 4% of the KV memory" in warning


def test_weight_bytes_reads_the_weight_files(tmp_path) -> None:
    sharded = tmp_path / "sharded"
    _weights(sharded, {"model-1.safetensors": 3 * GIB, "model-2.safetensors": GIB,
                       "consolidated.safetensors": 4 * GIB})  # fmt: skip
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors",
                            "c": "model-1.safetensors"}}  # fmt: skip
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    # the index's files only: a second copy of the weights beside them is not counted twice
    assert tail_pool_memory.weight_bytes(str(sharded)) == 4 * GIB
    single = tmp_path / "single"
    _weights(single, {"model.safetensors": 5})
    assert tail_pool_memory.weight_bytes(str(single)) == 5
    bins = tmp_path / "bins"
    _weights(bins, {"pytorch_model.bin": 7})
    assert tail_pool_memory.weight_bytes(str(bins)) == 7
    (tmp_path / "empty").mkdir()
    assert tail_pool_memory.weight_bytes(str(tmp_path / "empty")) is None
    assert tail_pool_memory.weight_bytes("no-such-org/no-such-model-in-the-cache") is None


class _EngineArgs(SimpleNamespace):
    """What default_max_num_seqs and P10's cap read of vLLM's EngineArgs."""

    @classmethod
    def get_batch_defaults(cls, world_size: int) -> tuple[dict, dict]:
        return {}, {None: 256, "llm": 256}


def _engine_args(model_dir, **overrides) -> _EngineArgs:
    model_config = SimpleNamespace(
        model=str(model_dir), revision=None, dtype=SimpleNamespace(itemsize=2),
        get_total_num_hidden_layers=lambda: 32, get_total_num_kv_heads=lambda: 8,
        get_head_size=lambda: 128, get_sliding_window=lambda: None,
        hf_text_config=SimpleNamespace(),
    )  # fmt: skip
    values = dict(kv_cache_dtype="int4", max_num_seqs=None, tensor_parallel_size=1,
                  pipeline_parallel_size=1, gpu_memory_utilization=0.9, performance_mode=None,
                  create_model_config=lambda: model_config)  # fmt: skip
    values.update(overrides)
    return _EngineArgs(**values)


def test_an_8b_model_on_a_24gb_card_gets_fewer_sequences(tmp_path) -> None:
    _weights(tmp_path, {"model.safetensors": 15 * GIB})
    # 0.9 x 24 GiB - 15 GiB = 6.6 GiB; 4% of it holds 33 slots of 8 MiB: 32
    chosen = tail_pool_memory.default_max_num_seqs(_engine_args(tmp_path), 256, 24 * GIB)
    assert chosen is not None
    seqs, warning = chosen
    assert seqs == 32
    assert warning == (
        "int8kv-shim: --kv-cache-dtype int4: max_num_seqs 32 instead of vLLM's default 256, so "
        "that its tail pool (8.0 MiB a sequence) stays within 4% of the KV memory (about 6.6 GiB: "
        "GPU memory x --gpu-memory-utilization - weights); give --max-num-seqs to choose"
    )
    # tensor parallelism: half the weights and half the kv-heads per rank
    seqs, _ = tail_pool_memory.default_max_num_seqs(
        _engine_args(tmp_path, tensor_parallel_size=2), 256, 24 * GIB
    )
    assert seqs == 128  # 4% of 14.1 GiB over 4 MiB slots: 144
    # nothing to do: the user chose, another dtype, a big card, no GPU figure, no weight files
    assert tail_pool_memory.default_max_num_seqs(
        _engine_args(tmp_path, max_num_seqs=256), 256, 24 * GIB) is None  # fmt: skip
    assert tail_pool_memory.default_max_num_seqs(
        _engine_args(tmp_path, kv_cache_dtype="int8"), 256, 24 * GIB) is None  # fmt: skip
    assert tail_pool_memory.default_max_num_seqs(_engine_args(tmp_path), 256, 141 * GIB) is None
    assert tail_pool_memory.default_max_num_seqs(_engine_args(tmp_path), 256, None) is None
    empty = tmp_path / "no-weights"
    empty.mkdir()
    said: list[str] = []
    fake = SimpleNamespace(info=lambda msg, *a: said.append(msg % a))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tail_pool_memory, "logger", fake)
        assert tail_pool_memory.default_max_num_seqs(_engine_args(empty), 256, 24 * GIB) is None
    assert said == [
        f"int8kv-shim: no weight files of {empty} found on this machine, so no estimate of the KV "
        "memory: vLLM's default max_num_seqs 256 stays (a line after the cache is sized says what "
        "the tail pool takes)"
    ]


def test_the_warning_says_when_max_model_len_sets_the_cap(tmp_path, monkeypatch) -> None:
    _weights(tmp_path, {"model.safetensors": 15 * GIB})
    monkeypatch.setenv("INT8KV_INT4_TAIL_PAGES", "2")
    monkeypatch.setenv("INT8KV_INT4_SINK_PAGE", "1")
    args = _engine_args(tmp_path)
    args.create_model_config().max_model_len = 8192
    seqs, warning = tail_pool_memory.default_max_num_seqs(args, 256, 24 * GIB)
    # 6.6 GiB: 8 slots of 24 MiB fit 4%; 22 sequences of 8192 tokens fit the cache: 24 slots
    assert seqs == 24
    assert warning == (
        "int8kv-shim: --kv-cache-dtype int4: max_num_seqs 24 instead of vLLM's default 256, as "
        "many slots as the cache holds sequences of 8192 tokens (max_model_len: 22), rounded up "
        "to 24, a batch size vLLM captures CUDA graphs for; its tail pool (24.0 MiB a sequence) "
        "takes about 9% of the KV memory (about 6.6 GiB: GPU memory x --gpu-memory-utilization "
        "- weights); give --max-num-seqs to choose"
    )
    # with sequences of 128K tokens the 4% goal decides, and the warning says that
    args.create_model_config().max_model_len = 131072
    seqs, warning = tail_pool_memory.default_max_num_seqs(args, 256, 24 * GIB)
    assert seqs == 8 and "stays within 4% of the KV memory" in warning


def test_p10_sets_the_cap_before_vllm_builds_its_config(tmp_path, monkeypatch) -> None:
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    _weights(tmp_path, {"model.safetensors": 15 * GIB})
    monkeypatch.setattr(current_platform, "get_device_total_memory", lambda device_id=0: 24 * GIB)
    warned: list[str] = []
    monkeypatch.setattr(patch, "get_logger", lambda: SimpleNamespace(warning=warned.append))
    args = _engine_args(tmp_path)
    assert patch.cap_default_max_num_seqs(args, "llm") == 32 and args.max_num_seqs == 32
    assert len(warned) == 1 and "max_num_seqs 32 instead of vLLM's default 256" in warned[0]
    # throughput mode doubles vLLM's default before the cap compares with it
    args = _engine_args(tmp_path, performance_mode="throughput")
    assert patch.cap_default_max_num_seqs(args) == 32
    # the user's value, another dtype, and a process that cannot see a GPU are left alone
    for args in (
        _engine_args(tmp_path, max_num_seqs=300),
        _engine_args(tmp_path, kv_cache_dtype="int8"),
    ):
        before = args.max_num_seqs
        assert patch.cap_default_max_num_seqs(args) is None and args.max_num_seqs == before
    # vLLM's default comes down to --max-num-batched-tokens, as vLLM lowers it: 32 would not fit
    args = _engine_args(tmp_path, max_num_batched_tokens=48)
    assert patch.cap_default_max_num_seqs(args) == 32
    args = _engine_args(tmp_path, max_num_batched_tokens=16)
    assert patch.cap_default_max_num_seqs(args) is None and args.max_num_seqs is None

    def no_gpu(device_id: int = 0) -> int:
        raise NotImplementedError

    monkeypatch.setattr(current_platform, "get_device_total_memory", no_gpu)
    args = _engine_args(tmp_path)
    assert patch.cap_default_max_num_seqs(args) is None and args.max_num_seqs is None


def test_two_tail_pages_and_a_sink_page_triple_what_a_slot_costs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    single = tail_pool_memory.tail_pool_cost(_specs("int4"), 256, 2, int(2.5 * GIB))
    cap = tail_pool_memory.capped_max_num_seqs("int4", 256, 40 * GIB, 32, 8, 128, 2)
    monkeypatch.setenv("INT8KV_INT4_TAIL_PAGES", "2")
    two = tail_pool_memory.tail_pool_cost(_specs("int4"), 256, 2, int(2.5 * GIB))
    assert two.slot_bytes == 2 * single.slot_bytes
    assert tail_pool_memory.capped_max_num_seqs("int4", 256, 40 * GIB, 32, 8, 128, 2) == cap // 2
    monkeypatch.setenv("INT8KV_INT4_SINK_PAGE", "1")
    three = tail_pool_memory.tail_pool_cost(_specs("int4"), 256, 2, int(2.5 * GIB))
    assert three.slot_bytes == 3 * single.slot_bytes
    monkeypatch.setenv("INT8KV_INT4_TAIL_PAGES", "4")
    with pytest.raises(ValueError, match="INT8KV_INT4_TAIL_PAGES='4' is not one of 1, 2"):
        tail_pool_memory.pages_per_slot()


def test_a_page_count_given_is_used_whatever_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a computed table (benchmarks/tail_pool_capacity.py) names its pages; the runtime path
    # (pages=None) counts the ones this process turns on
    one = tail_pool_memory.slot_bytes("int4", 32, 8, 128, 2)
    assert one == 32 * INT4.tail_slot_bytes(8, 128)
    assert tail_pool_memory.slot_bytes("int4", 32, 8, 128, 2, pages=3) == 3 * one
    # 4% of 40 GiB: 204 slots of one page, 68 of three
    assert tail_pool_memory.capped_max_num_seqs("int4", 256, 40 * GIB, 32, 8, 128, 2) == 128
    assert tail_pool_memory.capped_max_num_seqs("int4", 256, 40 * GIB, 32, 8, 128, 2, pages=3) == 64
    monkeypatch.setenv("INT8KV_INT4_TAIL_PAGES", "2")
    monkeypatch.setenv("INT8KV_INT4_SINK_PAGE", "1")
    assert tail_pool_memory.slot_bytes("int4", 32, 8, 128, 2) == 3 * one
    assert tail_pool_memory.slot_bytes("int4", 32, 8, 128, 2, pages=1) == one
    assert tail_pool_memory.capped_max_num_seqs("int4", 256, 40 * GIB, 32, 8, 128, 2) == 64
    assert (
        tail_pool_memory.capped_max_num_seqs("int4", 256, 40 * GIB, 32, 8, 128, 2, pages=1) == 128
    )


def test_sink_pages_double_what_a_slot_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    single = tail_pool_memory.tail_pool_cost(_specs("int4"), 256, 2, int(2.5 * GIB))
    monkeypatch.setenv("INT8KV_INT4_SINK_PAGE", "1")
    double = tail_pool_memory.tail_pool_cost(_specs("int4"), 256, 2, int(2.5 * GIB))
    assert double.slot_bytes == 2 * single.slot_bytes
    # 4% of 5 GiB holds 12 slots of two 8 MiB pages: the minimum, 8
    assert tail_pool_memory.capped_max_num_seqs("int4", 256, 5 * GIB, 32, 8, 128, 2) == 8
