"""Our int4 builder + impl driven like vLLM's model runner drives them (int4_wiring_check.py, in
its own process): the wiring with stand-in kernels, and with the real tail-pool kernels."""

import os
import subprocess
import sys
from pathlib import Path

from int8kv_kernels.catalogue import get_dtype

CHECK = Path(__file__).with_name("int4_wiring_check.py")


# int4_wiring_check.py's figures are for a slot of one page (the newest, no sink page): each test
# that keeps more switches them on
ONE_PAGE = {"INT8KV_INT4_TAIL_PAGES": "1", "INT8KV_INT4_SINK_PAGE": "0"}


def _run(*args: str, one_page: bool = True, **extra_env: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    for name in ("INT8KV_SHIM", *ONE_PAGE):  # classes used directly; int4's switches as given
        env.pop(name, None)
    env |= (ONE_PAGE if one_page else {}) | extra_env
    run = subprocess.run(
        [sys.executable, str(CHECK), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run.stdout + run.stderr


def test_int4_builder_and_impl_wiring() -> None:
    log = _run()
    assert "wiring ok" in log
    # the pool's size, once, through the shim's logger; the experimental warning, once
    pool = "int8kv-shim: int4 tail pool: 4 slots (max_num_seqs) x 1 layers, 0.1 MiB in all"
    assert log.count(pool) == 1, log[-4000:]
    # and what it costs the cache, in tokens: 4 slots of a 64-token BF16 page (2 kv-heads of 64)
    # and a block id, over what a token costs the int4 cache
    tokens = (4 * (2 * 2 * 64 * 64 * 2 + 4)) // (2 * get_dtype("int4").bytes_per_token_head(64))
    assert f"the memory of {tokens} cache tokens; a lower --max-num-seqs" in log, log[-4000:]
    experimental = (
        "--kv-cache-dtype int4 is experimental: its kernels match their torch reference, but"
    )
    assert log.count(experimental) == 1 and "(README, Limitations)" in log, log[-4000:]


def test_int4_through_the_glue_with_the_real_kernels() -> None:
    assert "kernels ok" in _run("kernels")


def test_int4_two_tail_pages_through_the_glue_with_the_real_kernels() -> None:
    # the page before the newest, completed a step earlier, comes back exact from the tail
    log = _run("kernels", INT8KV_INT4_TAIL_PAGES="2")
    assert "kernels with two tail pages ok (sink pages False)" in log, log[-2000:]
    log = _run("kernels", INT8KV_INT4_TAIL_PAGES="2", INT8KV_INT4_SINK_PAGE="1")
    assert "kernels with two tail pages ok (sink pages True)" in log, log[-2000:]


def test_int4_as_shipped_through_the_glue_with_the_real_kernels() -> None:
    # neither variable set: two tail pages and a sink page
    log = _run("kernels", one_page=False)
    assert "kernels with two tail pages ok (sink pages True)" in log, log[-2000:]


def test_int4_sink_pages_through_the_glue_with_the_real_kernels() -> None:
    # the page a sequence wrote in an earlier step comes back exact from its sink
    log = _run("kernels", INT8KV_INT4_SINK_PAGE="1")
    assert "kernels with sink pages ok" in log, log[-2000:]


def test_int4_continuations_on_flash_attention_read_their_context_as_our_kernels_do() -> None:
    # the continuations' context through the real int4 gather, FlashAttention's stand-in after it
    assert "kernels ok" in _run("kernels", "flash")
    log = _run("kernels", "flash", one_page=False)
    assert "kernels with two tail pages ok (sink pages True)" in log, log[-2000:]
