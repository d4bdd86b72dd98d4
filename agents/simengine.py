"""The simulated OpenAI-compatible engine, for machines with no GPU.

Owns a small aiohttp server that behaves like a vLLM replica from the outside:
/v1/chat/completions and /v1/completions (JSON and SSE, token by token with a
configurable time to first token and token rate), /v1/models, /health, and /metrics
with vLLM's metric names. A concurrency limit queues requests so load shows in the
metrics. Like vLLM, a request that carries `endpoint-load-metrics-format: TEXT|JSON`
gets an ORCA load report in the `endpoint-load-metrics` response header (named
metrics kv_cache_usage_perc and num_requests_waiting); unlike vLLM it also reports
rps_fractional (its request rate), without which Envoy's client-side weighted round
robin cannot compute a weight (`orca_rps=False` reproduces vLLM exactly). Faults
(error rate, added latency, hang, crash, failing health) come from flags or from
POST /admin/fault, for tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import time
import uuid
from dataclasses import asdict, dataclass, fields
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


@dataclass
class Faults:
    error_rate: float = 0.0  # share of requests answered 500
    error_status: int = 500
    latency_s: float = 0.0  # added before the first token
    # Decode this many times slower (a throttled or shared GPU): each sequence holds
    # its batch slot longer, so the replica's capacity falls and its queue grows.
    decode_slowdown: float = 1.0
    hang: bool = False  # accept requests, never answer (like SIGSTOP, but per request)
    unhealthy: bool = False  # /health answers 503
    crash_after: int = -1  # exit the process after this many more requests (-1 never)


@dataclass
class EngineConfig:
    model: str = "sim-model"
    replica_id: str = ""
    ttft_s: float = 0.02
    tokens_per_s: float = 200.0
    default_max_tokens: int = 16
    max_concurrency: int = 64
    kv_cache_tokens: int = 65536
    # Report rps_fractional in ORCA headers (vLLM does not).
    orca_rps: bool = True


class _Metrics:
    """vLLM's metric names, on a registry of this engine's own."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        lbl = ["model_name"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests running", lbl, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", lbl, registry=r)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage (0-1)", lbl, registry=r)
        self.prompt = Counter("vllm:prompt_tokens", "Prompt tokens", lbl, registry=r)
        self.gen = Counter("vllm:generation_tokens", "Generated tokens", lbl, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", lbl,
                              registry=r, buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
                                                   0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.success = Counter("vllm:request_success", "Finished requests",
                               [*lbl, "finished_reason"], registry=r)
        self.model = model
        for g in (self.running, self.waiting, self.kv):
            g.labels(model).set(0)


class SimEngine:
    def __init__(self, cfg: EngineConfig, faults: Faults | None = None) -> None:
        self.cfg = cfg
        self.faults = faults or Faults()
        self.metrics = _Metrics(cfg.model)
        self._slots = asyncio.Semaphore(cfg.max_concurrency)
        self._waiting = 0
        self._running = 0
        self._kv_in_use = 0
        self.served = 0
        # Request rate for ORCA: an exponentially decayed count (time constant 2 s).
        self._rate = 0.0
        self._rate_at = time.monotonic()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1024**3)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/admin/fault", self._get_fault)
        app.router.add_post("/admin/fault", self._set_fault)
        return app

    # ------------------------------------------------------------------ handlers

    async def _health(self, _: web.Request) -> web.Response:
        if self.faults.unhealthy:
            return web.json_response({"status": "unhealthy"}, status=503)
        return web.json_response({"status": "ok"})

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.cfg.model, "object": "model", "owned_by": "llmgw-sim"}]})

    async def _metrics(self, _: web.Request) -> web.Response:
        m = self.metrics
        m.running.labels(m.model).set(self._running)
        m.waiting.labels(m.model).set(self._waiting)
        m.kv.labels(m.model).set(min(1.0, self._kv_in_use / self.cfg.kv_cache_tokens))
        return web.Response(body=generate_latest(m.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _get_fault(self, _: web.Request) -> web.Response:
        return web.json_response(asdict(self.faults))

    async def _set_fault(self, req: web.Request) -> web.Response:
        body = await req.json()
        known = {f.name for f in fields(Faults)}
        unknown = set(body) - known
        if unknown:
            return web.json_response({"error": f"unknown fault fields {sorted(unknown)}"},
                                     status=400)
        for k, v in body.items():
            setattr(self.faults, k, v)
        return web.json_response(asdict(self.faults))

    async def _chat(self, req: web.Request) -> web.StreamResponse:
        return await self._generate(req, chat=True)

    async def _completions(self, req: web.Request) -> web.StreamResponse:
        return await self._generate(req, chat=False)

    async def _generate(self, req: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await req.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "invalid JSON body")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        f = self.faults
        if f.crash_after >= 0:
            if f.crash_after == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            f.crash_after -= 1
        if f.hang:
            await asyncio.Event().wait()
        if f.error_rate > 0 and random.random() < f.error_rate:
            return _error(f.error_status, "injected fault")
        max_tokens = int(body.get("max_tokens") or self.cfg.default_max_tokens)
        prompt = json.dumps(body.get("messages") if chat else body.get("prompt", ""))
        prompt_tokens = max(1, len(prompt) // 4)
        stream = bool(body.get("stream"))
        t0 = time.monotonic()
        self._count_request(t0)
        orca = self._orca_header(req.headers.get("endpoint-load-metrics-format", ""))
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        self._running += 1
        self._kv_in_use += prompt_tokens + max_tokens
        try:
            self.metrics.prompt.labels(self.cfg.model).inc(prompt_tokens)
            await asyncio.sleep(self.cfg.ttft_s + f.latency_s)
            self.metrics.ttft.labels(self.cfg.model).observe(time.monotonic() - t0)
            self.served += 1
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:12]
            if stream:
                return await self._stream(req, rid, chat, max_tokens, prompt_tokens, orca)
            await asyncio.sleep(max_tokens * self._token_gap())
            text = " ".join(f"tok{i}" for i in range(max_tokens))
            self.metrics.gen.labels(self.cfg.model).inc(max_tokens)
            self.metrics.success.labels(self.cfg.model, "length").inc()
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text},
                 "finish_reason": "length"}
                if chat else {"index": 0, "text": text, "finish_reason": "length"}
            )
            return web.json_response(
                {"id": rid, "object": "chat.completion" if chat else "text_completion",
                 "created": int(time.time()), "model": self.cfg.model,
                 "system_fingerprint": self.cfg.replica_id, "choices": [choice],
                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                           "total_tokens": prompt_tokens + max_tokens}},
                headers=self._headers(orca))
        finally:
            self._running -= 1
            self._kv_in_use -= prompt_tokens + max_tokens
            self._slots.release()

    _RATE_TAU_S = 2.0

    def _token_gap(self) -> float:
        return max(1.0, self.faults.decode_slowdown) / self.cfg.tokens_per_s

    def _count_request(self, now: float) -> None:
        self._rate = self._decayed_rate(now) + 1.0 / self._RATE_TAU_S
        self._rate_at = now

    def _decayed_rate(self, now: float) -> float:
        return self._rate * math.exp(-(now - self._rate_at) / self._RATE_TAU_S)

    def orca_report(self) -> dict[str, float]:
        """The load report vLLM would send, plus rps_fractional unless turned off."""
        kv = min(1.0, self._kv_in_use / self.cfg.kv_cache_tokens)
        out = {"named_metrics.kv_cache_usage_perc": kv,
               "named_metrics.num_requests_waiting": float(self._waiting)}
        if self.cfg.orca_rps:
            out["rps_fractional"] = self._decayed_rate(time.monotonic())
        return out

    def _orca_header(self, fmt: str) -> dict[str, str]:
        """Computed when the request arrives (with it counted), as vLLM does."""
        fmt = fmt.strip().upper()
        if fmt not in ("TEXT", "JSON"):
            return {}
        self._kv_in_use += 1  # this request, so a report is never all zero
        try:
            rep = self.orca_report()
        finally:
            self._kv_in_use -= 1
        if fmt == "TEXT":
            value = "TEXT " + ", ".join(f"{k}={v:.6g}" for k, v in rep.items())
        else:
            doc: dict[str, Any] = {"named_metrics": {}}
            for k, v in rep.items():
                if k.startswith("named_metrics."):
                    doc["named_metrics"][k.removeprefix("named_metrics.")] = v
                else:
                    doc[k] = v
            value = "JSON " + json.dumps(doc)
        return {"endpoint-load-metrics": value}

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {"x-llmgw-replica": self.cfg.replica_id, **(extra or {})}

    async def _stream(self, req: web.Request, rid: str, chat: bool, max_tokens: int,
                      prompt_tokens: int, orca: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           **self._headers(orca)})
        await resp.prepare(req)
        obj = "chat.completion.chunk" if chat else "text_completion"
        gap = self._token_gap()
        for i in range(max_tokens):
            piece = f"tok{i} "
            choice: dict[str, Any] = (
                {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                if chat else {"index": 0, "text": piece, "finish_reason": None}
            )
            if i == max_tokens - 1:
                choice["finish_reason"] = "length"
            chunk = {"id": rid, "object": obj, "created": int(time.time()),
                     "model": self.cfg.model, "system_fingerprint": self.cfg.replica_id,
                     "choices": [choice]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.metrics.gen.labels(self.cfg.model).inc()
            if i < max_tokens - 1:
                await asyncio.sleep(gap)
        await resp.write(b"data: [DONE]\n\n")
        self.metrics.success.labels(self.cfg.model, "length").inc()
        await resp.write_eof()
        return resp


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "server_error" if status >= 500
                   else "invalid_request_error", "param": None, "code": status}},
        status=status)


async def serve(cfg: EngineConfig, host: str, port: int, faults: Faults | None = None,
                ready: asyncio.Event | None = None) -> None:
    """Run until cancelled or SIGTERM/SIGINT."""
    engine = SimEngine(cfg, faults)
    runner = web.AppRunner(engine.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=False)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="llmgw-simengine",
                                description="Simulated OpenAI-compatible engine (vLLM-like).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="sim-model", help="served model name")
    p.add_argument("--replica-id", default="")
    p.add_argument("--ttft", type=float, default=0.02, help="seconds to first token")
    p.add_argument("--tokens-per-s", type=float, default=200.0)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--error-rate", type=float, default=0.0)
    p.add_argument("--latency", type=float, default=0.0, help="added seconds before first token")
    p.add_argument("--no-orca-rps", action="store_true",
                   help="ORCA reports exactly as vLLM sends them (no rps_fractional)")
    a = p.parse_args(argv)
    cfg = EngineConfig(model=a.model, replica_id=a.replica_id or f"{a.host}:{a.port}",
                       ttft_s=a.ttft, tokens_per_s=a.tokens_per_s,
                       max_concurrency=a.max_concurrency, orca_rps=not a.no_orca_rps)
    asyncio.run(serve(cfg, a.host, a.port, Faults(error_rate=a.error_rate, latency_s=a.latency)))


if __name__ == "__main__":
    main()
