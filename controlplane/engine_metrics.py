"""What an engine's Prometheus /metrics says about its load.

Owns the mapping from each engine's metric names (vLLM, SGLang, llama.cpp server and
the simulated engine, which uses vLLM's) to one value: requests running, requests
waiting, KV-cache usage (0..1), the time-to-first-token histogram's running sum and
count, and the generated-token counter (recent means and rates come from two
scrapes). Pure: text in, value out.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# First name present wins; samples of one name are summed (one per served model).
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs",
           "llamacpp:requests_processing")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred")
# vllm:gpu_cache_usage_perc is the older, deprecated name of kv_cache_usage_perc.
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
            "llamacpp:kv_cache_usage_ratio")
TTFT = ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds")
GENERATED = ("vllm:generation_tokens_total", "sglang:generation_tokens_total",
             "llamacpp:tokens_predicted_total")


class MetricsFormatError(ValueError):
    """The text is not Prometheus exposition format, or has none of the load metrics."""


@dataclass(frozen=True)
class EngineLoad:
    running: float
    waiting: float
    kv_usage: float
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    generated_tokens: float | None = None


_WANTED = tuple(sorted({*RUNNING, *WAITING, *KV_USAGE, *TTFT, *GENERATED}))


def _relevant_lines(text: str) -> str:
    """Only the samples we read. A vLLM page is mostly histograms we do not need, and
    parsing all of it for every replica every second would be most of the poller's
    CPU; a sample line starts with its metric name, so a prefix test selects ours."""
    return "\n".join(line for line in text.splitlines() if line.startswith(_WANTED)) + "\n"


def parse_engine_metrics(text: str) -> EngineLoad:
    """Load figures from a /metrics page; raise MetricsFormatError if there are none."""
    values: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(_relevant_lines(text)):
            for s in fam.samples:
                # Histograms come as <name>_sum / <name>_count samples; counters may
                # carry a _total suffix. Both are kept under the sample's own name.
                values[s.name] = values.get(s.name, 0.0) + float(s.value)
    except (ValueError, TypeError) as e:
        raise MetricsFormatError(f"not Prometheus text: {e}") from e

    def first(names: tuple[str, ...], suffix: str = "") -> float | None:
        for n in names:
            if n + suffix in values:
                return values[n + suffix]
        return None

    running, waiting = first(RUNNING), first(WAITING)
    if running is None and waiting is None:
        raise MetricsFormatError("no running/waiting request metric (vLLM, SGLang or llama.cpp)")
    return EngineLoad(
        running=running or 0.0,
        waiting=waiting or 0.0,
        kv_usage=min(1.0, max(0.0, first(KV_USAGE) or 0.0)),
        ttft_sum=first(TTFT, "_sum") or 0.0,
        ttft_count=first(TTFT, "_count") or 0.0,
        generated_tokens=first(GENERATED),
    )
