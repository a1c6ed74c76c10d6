import struct
from pathlib import Path

import pytest

from benchmarks import cuda_archs


def entry(kind: int, sm: int, payload: bytes = b"\0" * 24) -> bytes:
    """One fatbin entry: a 64-byte header (kind, sizes, version, arch) and its payload."""
    head = struct.pack("<HHIQIIHHI", kind, 0x101, 64, len(payload), 0, 0, 8, 7, sm)
    return head + b"\0" * (64 - len(head)) + payload


def fatbin(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", cuda_archs.FATBIN_MAGIC, 1, 16, len(body)) + body


def test_reads_each_entry_kind_and_architecture_across_fatbins() -> None:
    blob = (
        b"\x7fELF padding"
        + fatbin(entry(2, 80), entry(1, 80))
        + b"\0" * 13
        + fatbin(entry(2, 90), entry(2, 80))
    )
    found = cuda_archs.fatbin_entries(blob)
    assert found == {("sass", 80): 2, ("ptx", 80): 1, ("sass", 90): 1}


def test_an_entry_cut_off_before_its_architecture_is_not_counted() -> None:
    blob = fatbin(entry(2, 86), entry(1, 86))
    assert cuda_archs.fatbin_entries(blob[:-70]) == {("sass", 86): 1}


def test_library_row_lists_sass_and_ptx_apart(tmp_path: Path) -> None:
    lib = tmp_path / "lib.so"
    lib.write_bytes(fatbin(entry(2, 80), entry(1, 90)))
    row = cuda_archs.library_row(lib)
    assert (row["sass_archs"], row["ptx_archs"]) == ([80], [90])


def test_installed_flash_attention_2_has_no_hopper_machine_code() -> None:
    # what the results file says of vLLM 0.24.0's wheel, checked against the installed one
    try:
        lib = cuda_archs.default_library()
    except SystemExit:
        pytest.skip("vllm is not installed")
    if not lib.exists():
        pytest.skip(f"{lib.name} is not installed")
    row = cuda_archs.library_row(lib)
    assert 80 in row["sass_archs"] and 90 not in row["sass_archs"], row
