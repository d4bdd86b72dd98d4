"""The simulated engine as a real process: OpenAI API, vLLM metrics, queue and faults."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import EngineProc, start_engine, stop_engine, wait_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProc]:
    # One request at a time, so a second one has to queue.
    e = start_engine("sim-1", tokens_per_s=50, extra=("--max-concurrency", "1"))
    try:
        wait_engine(e)
        yield e
    finally:
        stop_engine(e)


@pytest.fixture(autouse=True)
def _healthy(engine: EngineProc) -> None:
    engine.fault(error_rate=0.0, latency_s=0.0, hang=False, unhealthy=False, crash_after=-1)


async def metrics(s: aiohttp.ClientSession, e: EngineProc) -> dict[str, float]:
    async with s.get(e.url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


async def test_api_streaming_and_metrics(engine: EngineProc) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(engine.url + "/v1/completions",
                          json={"model": "pool", "prompt": "hello", "max_tokens": 5}) as r:
            body = await r.json()
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 5
        chunks = []
        async with s.post(engine.url + "/v1/chat/completions",
                          json={"model": "pool", "messages": [], "stream": True,
                                "max_tokens": 4}) as r:
            assert r.headers["content-type"] == "text/event-stream"
            async for line in r.content:
                if line.startswith(b"data: "):
                    chunks.append(line[6:].strip())
        assert chunks[-1] == b"[DONE]"
        deltas = [json.loads(c)["choices"][0]["delta"]["content"] for c in chunks[:-1]]
        assert deltas == ["tok0 ", "tok1 ", "tok2 ", "tok3 "]
        async with s.get(engine.url + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "pool"
        m = await metrics(s, engine)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count"):
        assert name in m, name
    assert m["vllm:generation_tokens_total"] >= 9
    assert m["vllm:time_to_first_token_seconds_count"] >= 2


async def test_queue_shows_in_metrics(engine: EngineProc) -> None:
    async with aiohttp.ClientSession() as s:
        body = {"model": "pool", "messages": [], "max_tokens": 40}  # 0.8 s each
        first = asyncio.create_task(s.post(engine.url + "/v1/chat/completions", json=body))
        second = asyncio.create_task(s.post(engine.url + "/v1/chat/completions", json=body))
        deadline = time.monotonic() + 5
        seen = {}
        while time.monotonic() < deadline:
            seen = await metrics(s, engine)
            if seen["vllm:num_requests_running"] == 1 and seen["vllm:num_requests_waiting"] == 1:
                break
            await asyncio.sleep(0.02)
        assert seen["vllm:num_requests_running"] == 1
        assert seen["vllm:num_requests_waiting"] == 1
        assert seen["vllm:kv_cache_usage_perc"] > 0
        for t in (first, second):
            r = await t
            assert r.status == 200
            r.release()
        final = await metrics(s, engine)
        assert final["vllm:num_requests_running"] == 0
        assert final["vllm:num_requests_waiting"] == 0


async def test_fault_injection(engine: EngineProc) -> None:
    body = {"model": "pool", "messages": [], "max_tokens": 1}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        engine.fault(error_rate=1.0, error_status=503)
        async with s.post(engine.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 503 and (await r.json())["error"]["message"] == "injected fault"
        engine.fault(error_rate=0.0, latency_s=0.3)
        t0 = time.monotonic()
        async with s.post(engine.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
        assert time.monotonic() - t0 >= 0.3
        engine.fault(latency_s=0.0, unhealthy=True)
        async with s.get(engine.url + "/health") as r:
            assert r.status == 503
        engine.fault(unhealthy=False, hang=True)
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(engine.url + "/v1/chat/completions", json=body,
                              timeout=aiohttp.ClientTimeout(total=0.5)):
                pass
        engine.fault(hang=False)
        async with s.post(engine.url + "/admin/fault", json={"nonsense": 1}) as r:
            assert r.status == 400


async def test_crash_fault_kills_the_process() -> None:
    e = start_engine("sim-crash")
    try:
        wait_engine(e)
        e.fault(crash_after=0)
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientError):
                async with s.post(e.url + "/v1/chat/completions",
                                  json={"model": "pool", "messages": []}) as r:
                    await r.read()
        assert e.proc.wait(10) != 0
    finally:
        stop_engine(e)
