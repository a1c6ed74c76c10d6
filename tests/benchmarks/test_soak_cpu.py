"""CPU test of ``benchmarks/soak.py``'s client and checker against a fake OpenAI-compatible server.

The fake server (aiohttp.web, in a thread of this process) answers ``/v1/completions``
deterministically, streamed or not, and can be told to answer given arrivals with a 500, a
malformed body or a dropped connection, or to change its texts after some requests (a probe that
drifts). No vLLM engine, no GPU: this is what makes the soak's verdict trustworthy when the GPU run
reports 0 errors.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from benchmarks import soak

REQUESTS = 300
CONCURRENCY = 64
MAX_MODEL_LEN = 1024


@dataclass
class FakeServer:
    """Deterministic completions; ``faults`` maps load arrival numbers (0-based, probes not
    counted) to ``"500"``, ``"malformed"`` or ``"drop"``; ``drift_after`` > 0 changes every text
    once that many completion requests (probes included) have arrived."""

    faults: dict[int, str] = field(default_factory=dict)
    drift_after: int = 0
    arrivals: int = 0  # load requests seen (probes carry a cache_salt and are not counted)
    served: int = 0  # all completion requests seen
    disconnects: int = 0  # streams the client closed before we finished writing
    delay_s: float = 0.002  # before answering: keeps requests in flight long enough to overlap
    base_url: str = ""

    def text(self, prompt: str, n: int, temperature: float) -> list[str]:
        salt = "drift" if self.drift_after and self.served > self.drift_after else ""
        seed = hashlib.sha256(f"{salt}{prompt}{temperature}".encode()).hexdigest()
        return [f" w{seed[i % 60 : i % 60 + 4]}" for i in range(n)]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.served += 1
        fault = None
        if "cache_salt" not in body:
            fault = self.faults.get(self.arrivals)
            self.arrivals += 1
        await asyncio.sleep(self.delay_s)
        if fault == "500":
            return web.json_response({"error": {"message": "injected"}}, status=500)
        if fault == "drop":
            request.transport.close()  # type: ignore[union-attr]
            return web.Response()
        n = int(body["max_tokens"])
        words = self.text(body["prompt"], n, float(body.get("temperature", 1.0)))
        usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
        if not body.get("stream"):
            if fault == "malformed":
                return web.Response(text='{"choices": [{"text": "trunc', content_type="text/json")
            choice = {"index": 0, "text": "".join(words), "finish_reason": "length"}
            return web.json_response({"id": "x", "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if fault == "malformed":  # first chunk already broken, so even a cancel sees it
                await resp.write(b"data: {not json\n\n")
            for i, w in enumerate(words):
                reason = "length" if i == n - 1 else None
                chunk = {"choices": [{"index": 0, "text": w, "finish_reason": reason}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(0)
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            self.disconnects += 1
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer()
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.add_routes(
        [
            web.post("/v1/completions", server.completions),
            web.get("/v1/models", server.models),
            web.get("/health", server.health),
        ]
    )
    runner = web.AppRunner(app, handle_signals=False)
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        server.base_url = f"http://127.0.0.1:{port}"
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10), "fake server did not start"
    yield server
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _specs(n: int = REQUESTS) -> list[soak.RequestSpec]:
    text = soak.common.DEFAULT_CORPUS.read_text(encoding="utf-8")
    return soak.build_workload(text, n, max_model_len=MAX_MODEL_LEN, seed=0)


def _load(server: FakeServer, specs: list[soak.RequestSpec]) -> soak.LoadReport:
    return asyncio.run(
        soak.run_load(
            server.base_url,
            "fake-model",
            specs,
            concurrency=CONCURRENCY,
            time_limit_s=60,
            request_timeout_s=20,
            progress=False,
        )
    )


def test_workload_mix() -> None:
    specs = _specs(1000)
    budget = soak.prompt_char_budget(
        MAX_MODEL_LEN, soak.output_cap(MAX_MODEL_LEN), soak.DEFAULT_MAX_PROMPT_CHARS
    )
    assert specs == _specs(1000), "the workload must be deterministic"
    assert all(len(s.prompt) <= budget for s in specs)
    assert all(s.max_tokens <= soak.output_cap(MAX_MODEL_LEN) for s in specs)
    streams = [s for s in specs if s.stream]
    assert 0.4 < len(streams) / len(specs) < 0.6
    assert sum(s.cancel_after is not None for s in streams) > 50
    assert all(s.stream for s in specs if s.cancel_after is not None)
    assert 150 < sum(s.shared_prefix is not None for s in specs) < 350
    assert 300 < sum(s.temperature == 0 for s in specs) < 500
    assert min(len(s.prompt) for s in specs) < 100 < budget // 2 < max(len(s.prompt) for s in specs)
    # at the default max_model_len the longest prompts reach about 2K tokens
    big = soak.build_workload(soak.common.DEFAULT_CORPUS.read_text(), 200, max_model_len=4096)
    assert max(len(s.prompt) for s in big) > 0.9 * soak.DEFAULT_MAX_PROMPT_CHARS


def test_clean_load_has_no_errors_and_cancellations_are_fine(fake_server: FakeServer) -> None:
    specs = _specs()
    report = _load(fake_server, specs)
    assert report.errors == 0, report.error_examples
    assert report.requests == REQUESTS == report.completed + report.cancelled
    expected_cancel = [s for s in specs if s.cancel_after is not None]
    assert report.cancelled == len(expected_cancel) > 0
    assert report.max_in_flight == CONCURRENCY
    assert not report.time_limit_hit


def test_injected_faults_are_counted(fake_server: FakeServer) -> None:
    fake_server.faults = {3: "500", 50: "500", 100: "malformed", 150: "malformed", 200: "drop"}
    report = _load(fake_server, _specs())
    assert report.errors == 5, report.error_examples
    assert report.error_kinds == {"http_5xx": 2, "malformed": 2, "connection": 1}
    assert report.requests == REQUESTS == report.completed + report.cancelled + report.errors
    assert {e["kind"] for e in report.error_examples} == {"http_5xx", "malformed", "connection"}


def test_time_limit_stops_issuing(fake_server: FakeServer) -> None:
    fake_server.delay_s = 0.2
    report = asyncio.run(
        soak.run_load(
            fake_server.base_url,
            "fake-model",
            _specs(),
            concurrency=8,
            time_limit_s=0.5,
            request_timeout_s=5,
            progress=False,
        )
    )
    assert report.time_limit_hit and 8 <= report.requests < REQUESTS
    assert report.errors == 0 and report.completed + report.cancelled == report.requests
    doc = {"errors": 0, "probe_identical": True, "time_limit_hit": report.time_limit_hit}
    assert soak.verdict(doc) == 1


def test_checker_rejects_malformed_answers() -> None:
    ok = {"choices": [{"text": "a", "finish_reason": "stop"}], "usage": {"completion_tokens": 4}}
    assert soak.check_completion(json.dumps(ok), 4).status == "ok"
    bad = [
        "not json",
        json.dumps({"choices": []}),
        json.dumps({**ok, "choices": [{"text": 1, "finish_reason": "stop"}]}),
        json.dumps({**ok, "choices": [{"text": "a", "finish_reason": "abort"}]}),
        json.dumps({**ok, "usage": {"completion_tokens": 5}}),
        json.dumps({"choices": ok["choices"]}),  # no usage
    ]
    for body in bad:
        assert soak.check_completion(body, 4).kind == "malformed", body

    def stream(*lines: str) -> soak.Outcome:
        checker = soak.StreamChecker(max_tokens=4)
        for line in lines:
            checker.feed(line.encode())
        return checker.outcome()

    chunk = 'data: {"choices": [{"text": "a", "finish_reason": null}]}'
    last = 'data: {"choices": [{"text": "b", "finish_reason": "length"}]}'
    usage = 'data: {"choices": [], "usage": {"completion_tokens": 2}}'
    got = stream(chunk, "", last, "", usage, "", "data: [DONE]", "")
    assert (got.status, got.text, got.completion_tokens) == ("ok", "ab", 2)
    assert stream(chunk, last).kind == "malformed"  # no [DONE]
    assert stream(chunk, "data: [DONE]").kind == "malformed"  # no finish_reason
    assert stream("data: {oops", last, "data: [DONE]").kind == "malformed"
    assert stream(chunk, 'data: {"error": {"message": "boom"}}').kind == "stream_error"
    too_many = 'data: {"choices": [], "usage": {"completion_tokens": 9}}'
    assert stream(last, too_many, "data: [DONE]").kind == "malformed"


def test_main_writes_json_and_passes(fake_server: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    rc = soak.main(_argv(fake_server, out))
    doc = json.loads(out.read_text())
    assert rc == 0, doc
    assert list(doc)[:5] == ["requests", "errors", "probe_identical", "duration_s", "dtype"]
    assert isinstance(doc["requests"], int) and doc["requests"] == REQUESTS
    assert isinstance(doc["errors"], int) and doc["errors"] == 0
    assert doc["probe_identical"] is True and doc["probe_differences"] == []
    assert isinstance(doc["duration_s"], float) and doc["dtype"] == "int8"
    assert doc["completed"] + doc["cancelled"] == REQUESTS and doc["cancelled"] > 0
    assert doc["max_in_flight"] == CONCURRENCY
    assert doc["served_model"] == "fake-model"
    # probes are sent before and after, each pass with a salt (they bypass the fault counter)
    assert fake_server.served == REQUESTS + 2 * doc["probes"]


def test_main_fails_when_probes_drift(fake_server: FakeServer, tmp_path: Path) -> None:
    fake_server.drift_after = 50  # texts change mid-load: the second probe pass differs
    out = tmp_path / "soak.json"
    rc = soak.main(_argv(fake_server, out))
    doc = json.loads(out.read_text())
    assert rc == 1
    assert doc["errors"] == 0 and doc["probe_identical"] is False
    assert len(doc["probe_differences"]) == doc["probes"]


def test_main_fails_on_errors(fake_server: FakeServer, tmp_path: Path) -> None:
    fake_server.faults = {7: "500"}
    out = tmp_path / "soak.json"
    rc = soak.main(_argv(fake_server, out))
    doc = json.loads(out.read_text())
    assert rc == 1
    assert doc["errors"] == 1 and doc["probe_identical"] is True
    assert doc["error_examples"][0]["kind"] == "http_5xx"


def _argv(server: FakeServer, out: Path) -> list[str]:
    return [
        "--base-url",
        server.base_url,
        "--requests",
        str(REQUESTS),
        "--concurrency",
        str(CONCURRENCY),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--time-limit",
        "60",
        "--out",
        str(out),
        "--no-progress",
    ]


def test_server_args_and_port() -> None:
    assert soak.dtype_args("int8") == ["--kv-cache-dtype", "int8"]
    assert soak.dtype_args("auto") == [
        "--kv-cache-dtype",
        "auto",
        "--attention-backend",
        "TRITON_ATTN",
    ]
    args = soak.parse_args(["--dtype", "int8", "--", "--max-num-seqs", "32", "--enforce-eager"])
    assert args.vllm_args == ["--max-num-seqs", "32", "--enforce-eager"]
    server = soak.VllmServer(
        "/m",
        "int8",
        max_model_len=2048,
        gpu_memory_utilization=0.3,
        extra_args=args.vllm_args,
        log_path=Path("/tmp/x.log"),
        startup_timeout_s=1,
    )
    assert server.env["INT8KV_SHIM"] == "1"
    assert server.argv[-3:] == ["--max-num-seqs", "32", "--enforce-eager"]
    assert f"--port {server.port}" in " ".join(server.argv)
    assert (
        "INT8KV_SHIM"
        not in soak.VllmServer(
            "/m",
            "auto",
            max_model_len=2048,
            gpu_memory_utilization=0.3,
            extra_args=[],
            log_path=Path("/tmp/x.log"),
            startup_timeout_s=1,
        ).env
    )


def test_server_death_is_an_error(tmp_path: Path) -> None:
    """A launcher whose process dies before /health raises with the log tail; no hang."""
    server = soak.VllmServer(
        "/nonexistent-model",
        "int8",
        max_model_len=2048,
        gpu_memory_utilization=0.3,
        extra_args=[],
        log_path=tmp_path / "server.log",
        startup_timeout_s=60,
    )
    server.argv = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3"):
        with server:
            pass
    assert not server.alive()
