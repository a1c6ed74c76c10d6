import pytest

from int8kv_kernels import PageLayout
from int8kv_kernels.catalogue import get_dtype


@pytest.mark.parametrize("name", ["int8", "int8_static"])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("nkv", [1, 3, 8])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_layout_matches_catalogue_and_aligns(name, block_size, nkv, head_size):
    lay = PageLayout(name, block_size, nkv, head_size)
    assert lay.page_bytes == get_dtype(name).page_bytes(block_size, nkv, head_size)
    # Regions are back to back, in order, and cover the page exactly.
    data = nkv * block_size * head_size
    assert (lay.k_data, lay.v_data, lay.k_scale) == (0, data, 2 * data)
    if name == "int8":
        assert lay.v_scale == lay.k_scale + 2 * nkv * block_size
        assert lay.page_bytes == lay.v_scale + 2 * nkv * block_size
    else:
        assert lay.page_bytes == 2 * data
    # Every data row starts 16-byte aligned, also in the next page; fp16 scales 2-byte aligned.
    for region in (lay.k_data, lay.v_data):
        assert region % 16 == 0 and head_size % 16 == 0
    assert lay.page_bytes % 16 == 0 and lay.k_scale % 2 == 0 and lay.v_scale % 2 == 0


def test_layout_rejects_unknown_dtype_and_bad_head_size():
    with pytest.raises(ValueError):
        PageLayout("int4", 16, 8, 128)
    with pytest.raises(ValueError):
        PageLayout("int8", 16, 8, 72)
