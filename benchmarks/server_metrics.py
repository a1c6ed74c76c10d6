"""Where a serving point's time went, by ``vllm serve``'s own Prometheus metrics (``GET /metrics``).

vLLM 0.24.0's API server publishes per-request histograms that split a request's life (queue,
prefill, decode) and counters of tokens, preemptions and prefix-cache lookups
(``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``), every one labelled ``model_name`` and
``engine``. ``benchmarks/serve_bench.py`` scrapes ``/metrics`` right before and right after a
timed ``vllm bench serve`` (after the warm-up) and ``point_figures`` turns the two scrapes into the
point's figures: each histogram's mean over the requests that finished in between (the difference
of its ``_sum`` over the difference of its ``_count``), each counter's increase. Label sets of one
metric name are summed (one per engine; one engine here).

What the intervals are (``vllm/v1/metrics/stats.py``, ``update_from_finished_request``):

- ``queue_ms_mean``: the engine core's QUEUED event to its first SCHEDULED (a preempted request's
  later waits are not in it);
- ``prefill_ms_mean``: first SCHEDULED to the engine step that produced the first token (every
  step that carried a chunk of the prompt, and any preemption in between);
- ``decode_ms_mean``: first token to last token; ``inference_ms_mean``: first SCHEDULED to last
  token (prefill + decode);
- ``ttft_ms_mean_server``, ``e2e_ms_mean_server``: the API server's clock, from the request's
  arrival to its first token and to its end; ``tpot_ms_mean_server``: each request's decode time
  over its output tokens but the first, averaged over requests; ``itl_ms_mean_server``: the mean
  gap between a request's consecutive tokens, over all gaps;
- ``ttft_frontend_ms_mean``: ``ttft_ms_mean_server - queue_ms_mean - prefill_ms_mean``, TTFT spent
  outside the engine core's queue and prefill: the API server's work on the request before the
  engine core queued it (rendering, tokenising, the IPC), the request's wait in the engine core's
  input queue (its scheduler takes new requests between steps, and stamps them queued then) and
  the API server's work on the first token after the engine core produced it (IPC, output
  processing);
- ``requests``: requests that finished between the scrapes (the point's ``num_prompts`` when
  nothing else reached the server);
- ``prompt_tokens``, ``generation_tokens``, ``preemptions``, ``prefix_cache_queries``,
  ``prefix_cache_hits`` (tokens), ``prefix_cache_hit_rate`` (hits over queries);
- ``output_steps`` and ``output_step_tokens_mean``: engine steps that returned output to the API
  server (a step that only ran a prompt chunk returns none) and their mean scheduled tokens
  (prompt + generated), from ``vllm:iteration_tokens_total``.

Gauges (requests running or waiting, KV cache usage) are not used: a reading before and after a
point says nothing about the point. A figure whose metric is missing from a scrape, or whose
histogram saw no request, is left out.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Mapping
from typing import Any

# figure -> histogram name (seconds); vllm/v1/metrics/loggers.py, PrometheusStatLogger.__init__
HISTOGRAMS = {
    "queue_ms_mean": "vllm:request_queue_time_seconds",
    "prefill_ms_mean": "vllm:request_prefill_time_seconds",
    "decode_ms_mean": "vllm:request_decode_time_seconds",
    "inference_ms_mean": "vllm:request_inference_time_seconds",
    "ttft_ms_mean_server": "vllm:time_to_first_token_seconds",
    "e2e_ms_mean_server": "vllm:e2e_request_latency_seconds",
    "tpot_ms_mean_server": "vllm:request_time_per_output_token_seconds",
    "itl_ms_mean_server": "vllm:inter_token_latency_seconds",
}
# figure -> counter name (exposed with ``_total``)
COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "preemptions": "vllm:num_preemptions",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
}
# a histogram of tokens per engine step, whose own name ends in _total
STEP_TOKENS = "vllm:iteration_tokens_total"
# observed once per finished request: its _count is the requests that finished
FINISHED = HISTOGRAMS["e2e_ms_mean_server"]
LABELS = ("model_name", "engine")

SCRAPE_TIMEOUT_S = 10.0


def parse(text: str) -> dict[str, float]:
    """Prometheus text exposition -> sample name -> value summed over its label sets, without
    histogram buckets (a sum over ``le`` means nothing) and ``_created`` stamps."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def scrape(base_url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, float]:
    """``GET base_url/metrics``, parsed; raises ``OSError`` (``urllib.error.URLError``, a
    timeout) or ``ValueError`` (not the text format)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, no proxy
    with opener.open(f"{base_url}/metrics", timeout=timeout_s) as r:
        return parse(r.read().decode("utf-8"))


def _delta(before: Mapping[str, float], after: Mapping[str, float], name: str) -> float | None:
    if name not in before or name not in after:
        return None
    return after[name] - before[name]


def _mean_ms(before: Mapping[str, float], after: Mapping[str, float], name: str) -> float | None:
    total, count = _delta(before, after, name + "_sum"), _delta(before, after, name + "_count")
    if total is None or not count:
        return None
    return total / count * 1000.0


def point_figures(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """The figures of the requests between two scrapes of one server (``parse`` of each): means
    in ms rounded to 3 decimals, counts as integers, the hit rate to 4 decimals; see the module
    docstring for what each is."""
    out: dict[str, Any] = {}
    finished = _delta(before, after, FINISHED + "_count")
    if finished is not None:
        out["requests"] = int(round(finished))
    for key, name in HISTOGRAMS.items():
        mean = _mean_ms(before, after, name)
        if mean is not None:
            out[key] = mean
    if all(k in out for k in ("ttft_ms_mean_server", "queue_ms_mean", "prefill_ms_mean")):
        out["ttft_frontend_ms_mean"] = (
            out["ttft_ms_mean_server"] - out["queue_ms_mean"] - out["prefill_ms_mean"]
        )
    for key in [*HISTOGRAMS, "ttft_frontend_ms_mean"]:
        if key in out:
            out[key] = round(out[key], 3)
    for key, name in COUNTERS.items():
        d = _delta(before, after, name + "_total")
        if d is not None:
            out[key] = int(round(d))
    if out.get("prefix_cache_queries"):
        out["prefix_cache_hit_rate"] = round(
            out.get("prefix_cache_hits", 0) / out["prefix_cache_queries"], 4
        )
    steps = _delta(before, after, STEP_TOKENS + "_count")
    if steps is not None:
        out["output_steps"] = int(round(steps))
        tokens = _delta(before, after, STEP_TOKENS + "_sum")
        if steps and tokens is not None:
            out["output_step_tokens_mean"] = round(tokens / steps, 1)
    # a NaN would make the results file invalid JSON for strict readers
    return {k: v for k, v in out.items() if not (isinstance(v, float) and not math.isfinite(v))}
