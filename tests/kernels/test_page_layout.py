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
        # one fp16 scale per 64 channels of a (token, kv-head) above head size 128, else one
        groups = head_size // 64 if head_size > 128 else 1
        assert lay.num_groups == groups
        assert lay.v_scale == lay.k_scale + 2 * nkv * block_size * groups
        assert lay.page_bytes == lay.v_scale + 2 * nkv * block_size * groups
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
    # above head size 128 int8's scale groups must tile the head; int8_static has none, and up to
    # 128 a head is one group whatever its size
    with pytest.raises(ValueError, match="scale groups"):
        PageLayout("int8", 16, 8, 160)
    assert PageLayout("int8_static", 16, 8, 160).num_groups == 0
    assert PageLayout("int8", 16, 8, 96).num_groups == 1


@pytest.mark.parametrize("head_size,groups", [(32, 1), (64, 1), (128, 1), (192, 3), (256, 4)])
def test_int8_bytes_per_token_head_count_group_scales(head_size, groups):
    # K and V data, plus one fp16 scale per 64-channel group for each above head size 128 (one
    # scale per head up to it: 260 bytes, 1.97x BF16's tokens at 128)
    assert get_dtype("int8").bytes_per_token_head(head_size) == 2 * head_size + 4 * groups
    assert get_dtype("int8_static").bytes_per_token_head(head_size) == 2 * head_size


def test_int8_capacity_at_head_size_128_is_one_scale_per_token_head():
    int8 = get_dtype("int8")
    assert int8.bytes_per_token_head(128) == 260
    assert f"{int8.capacity_vs_bf16(128):.2f}" == "1.97"
    assert PageLayout("int8", 16, 8, 128).kernel_constexprs()["NG"] == 1
    assert PageLayout("int8", 16, 8, 256).kernel_constexprs()["NG"] == 4
