"""benchmarks/tail_pool_capacity.py: int4's tokens against BF16's once its tail pool has its share."""

import json
from pathlib import Path

from benchmarks import tail_pool_capacity as tpc
from int8kv_shim.tail_pool_memory import full_length_seqs, graph_batch_size, slot_bytes

GIB = 2**30


def test_rows_take_the_pool_out_of_the_kv_memory() -> None:
    rows = tpc.rows({"m": (32, 8, 128)}, kv_gib=[4], max_num_seqs=[0, 256, 1024], slot_pages=[1])
    by_seqs = {r["max_num_seqs"]: r for r in rows}
    # no pool: the catalogue's 140 bytes per token and kv-head at head size 128
    assert by_seqs[0]["int4_tokens"] == 4 * GIB // (32 * 8 * 140)
    assert by_seqs[0]["bf16_tokens"] == 4 * GIB // (32 * 8 * 512)
    assert by_seqs[0]["int4_vs_bf16"] == 3.66
    # 256 slots: 32 layers of 256 BF16 pages of 8 kv-heads x 64 tokens x 128, and block ids
    pool = 32 * 256 * (2 * 8 * 64 * 128 * 2 + 4)
    assert by_seqs[256]["tail_pool_gib"] == round(pool / GIB, 3) == 2.0
    assert by_seqs[256]["int4_tokens"] == (4 * GIB - pool) // (32 * 8 * 140)
    assert by_seqs[256]["int4_vs_bf16"] == 1.83
    # a pool larger than the memory leaves no cache
    assert by_seqs[1024]["int4_tokens"] == 0 and by_seqs[1024]["int4_vs_bf16"] == 0.0


def test_every_page_of_a_slot_is_a_page_of_the_pool() -> None:
    rows = tpc.rows({"m": (32, 8, 128)}, kv_gib=[4, 8], max_num_seqs=[64, 256, 768])
    by = {(r["kv_gib"], r["pages_per_slot"], r["max_num_seqs"]): r for r in rows}
    assert {p for _, p, _ in by} == set(tpc.SLOT_PAGES) == {1, 2, 3}
    # three pages a slot: the pool of three times the slots with one
    for gib in (4, 8):
        three, one = by[(gib, 3, 256)], by[(gib, 1, 768)]
        assert three["tail_pool_gib"] == one["tail_pool_gib"] == 6.0
        assert three["int4_tokens"] == one["int4_tokens"]
    # 6 GiB of pool outgrow 4 GiB of KV memory, and take 3/4 of 8
    assert by[(4, 3, 256)]["int4_vs_bf16"] == 0.0
    pool = 3 * 32 * 256 * (2 * 8 * 64 * 128 * 2 + 4)
    assert by[(8, 3, 256)]["int4_tokens"] == (8 * GIB - pool) // (32 * 8 * 140)
    assert by[(8, 2, 64)]["tail_pool_gib"] == by[(8, 1, 64)]["tail_pool_gib"] * 2 == 1.0


def test_the_table_does_not_read_this_process_environment(monkeypatch) -> None:
    # the shim's runtime default counts the pages the environment turns on; the table names its own
    plain = (tpc.rows(), tpc.default_rows())
    monkeypatch.setenv("INT8KV_INT4_TAIL_PAGES", "2")
    monkeypatch.setenv("INT8KV_INT4_SINK_PAGE", "1")
    assert (tpc.rows(), tpc.default_rows()) == plain


def test_main_writes_stamped_rows(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("OUT", raising=False)
    out = tmp_path / "cap.json"
    assert tpc.main(["--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"gpu", "command", "date", "git_commit", "rows"} <= set(doc) and doc["gpu"] is None
    n = len(tpc.MODELS) * len(tpc.KV_GIB) * len(tpc.SLOT_PAGES) * len(tpc.MAX_NUM_SEQS)
    assert len(doc["rows"]) == n
    assert doc["slot_pages"] == {"1": "tail page", "2": "tail + sink page, or two tail pages",
                                 "3": "two tail pages + sink page"}  # fmt: skip
    assert len(doc["shim_defaults"]) == len(tpc.MODELS) * len(tpc.KV_GIB) * len(tpc.SLOT_PAGES)
    # more slots, or more pages a slot, never leave more tokens
    for model in tpc.MODELS:
        for gib in tpc.KV_GIB:
            ratio = {
                (r["pages_per_slot"], r["max_num_seqs"]): r["int4_vs_bf16"]
                for r in doc["rows"]
                if (r["model"], r["kv_gib"]) == (model, gib)
            }
            for pages in tpc.SLOT_PAGES:
                ratios = [ratio[(pages, seqs)] for seqs in tpc.MAX_NUM_SEQS]
                assert ratios == sorted(ratios, reverse=True), (model, gib, pages, ratios)
            for seqs in tpc.MAX_NUM_SEQS:
                by_pages = [ratio[(pages, seqs)] for pages in tpc.SLOT_PAGES]
                assert by_pages == sorted(by_pages, reverse=True), (model, gib, seqs, by_pages)
            assert ratio[(1, tpc.MAX_NUM_SEQS[0])] > 3.4, (model, gib)


def test_the_shims_default_keeps_int4_above_3_5x_where_vllms_does_not() -> None:
    rows = {(r["model"], r["kv_gib"]): r for r in tpc.default_rows(slot_pages=[1])}
    small = rows[("Llama-3-8B", 4)]
    # vLLM's 256 sequences leave 1.83x (the test above); the shim's default 16 leaves 3.54x
    assert small["max_num_seqs"] == 16 and small["int4_vs_bf16"] == 3.54
    # a default that already fits is kept
    assert rows[("Gemma 3 270M", 64)]["max_num_seqs"] == 256
    # the least: SmolLM2 in 4 GiB, 78 sequences of 8192 tokens (more than 4% would hold), rounded
    # up to 80, a CUDA-graph batch size
    assert min(r["int4_vs_bf16"] for r in rows.values()) == 3.46
    assert rows[("SmolLM2-135M", 4)]["max_num_seqs"] == 80


def test_the_shims_default_pays_for_more_pages_a_slot_in_sequences() -> None:
    rows = {(r["model"], r["kv_gib"], r["pages_per_slot"]): r for r in tpc.default_rows()}
    assert len(rows) == len(tpc.MODELS) * len(tpc.KV_GIB) * 3
    # Llama-3-8B, 24 MiB a slot of three pages: 4% of 4 GiB holds 6 slots (the floor: 8), but
    # the cache holds 13 sequences of its 8192 tokens beside their slots, rounded up to 16, a
    # CUDA-graph batch size (3.31x); in 8 GiB 26, 32; one page a slot: 4% of 8 GiB holds 32 slots
    # of 8 MiB, more than its 28 sequences
    assert (
        rows[("Llama-3-8B", 4, 3)]["max_num_seqs"],
        rows[("Llama-3-8B", 4, 3)]["int4_vs_bf16"],
    ) == (16, 3.31)
    assert rows[("Llama-3-8B", 8, 3)]["max_num_seqs"] == 32
    assert rows[("Llama-3-8B", 8, 1)]["max_num_seqs"] == 32
    for (model, gib, pages), r in rows.items():
        layers, nkv, d = tpc.MODELS[model]
        slot = slot_bytes("int4", layers, nkv, d, 2, pages=pages)
        full = full_length_seqs(
            "int4",
            gib * GIB,
            layers,
            nkv,
            d,
            tpc.MAX_MODEL_LEN[model],
            slot,
            tpc.WINDOWS.get(model),
        )
        seqs = r["max_num_seqs"]
        # the pool within 4% of the memory, or as many slots as full-length sequences fit,
        # rounded up to a CUDA-graph batch size
        within_share = seqs * slot <= 0.04 * gib * GIB
        assert seqs == 256 or within_share or seqs == graph_batch_size(full), (model, gib, pages)
        # Gemma 3 in 4 GiB: 136 slots for the 129 32K-token sequences its sliding windows let it
        # hold
        assert r["int4_vs_bf16"] >= 3.25, (model, gib, pages)
        # what the extra pages cost is sequences: never more than with fewer pages
        if pages > 1:
            assert r["max_num_seqs"] <= rows[(model, gib, pages - 1)]["max_num_seqs"]
