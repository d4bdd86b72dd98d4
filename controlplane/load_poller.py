"""The metrics poller: each serving replica's load, read from its /metrics.

Owns the scrape loop and the per-replica view. Every `interval_s` it fetches
/metrics from every endpoint the publisher serves (not draining ones) at once, each
with a timeout, and replaces the view with a new immutable mapping: address ->
ReplicaLoad (running, waiting, KV usage, mean TTFT and decode rate since the last
scrape, or the error). Nothing here is in the request path; listeners (load weights,
autoscaler) get each new view as a value.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import aiohttp

from controlplane.endpoints import Endpoint
from controlplane.engine_metrics import EngineLoad, MetricsFormatError, parse_engine_metrics
from controlplane.metrics import LOAD_SCRAPES

log = logging.getLogger("llmgw.load")


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's load at one scrape. `ok` False: the scrape failed (`error`)."""

    model: str
    address: str
    at: float
    ok: bool = True
    error: str = ""
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    # Mean time to first token of the requests finished since the previous scrape;
    # None when none finished (or the engine has no such histogram).
    ttft_s: float | None = None
    # Tokens generated per second per running sequence since the previous scrape:
    # how fast this replica decodes (a throttled GPU shows here first); None when
    # nothing ran or the engine has no token counter.
    decode_tps: float | None = None
    raw: EngineLoad | None = None


LoadView = Mapping[str, ReplicaLoad]
Listener = Callable[[LoadView], None]


def by_model(view: LoadView, ok_only: bool = False) -> dict[str, list[ReplicaLoad]]:
    """The view's loads grouped by model (failed scrapes left out with `ok_only`)."""
    out: dict[str, list[ReplicaLoad]] = {}
    for r in view.values():
        if r.ok or not ok_only:
            out.setdefault(r.model, []).append(r)
    return out


def _recent_ttft(now: EngineLoad, before: ReplicaLoad | None) -> float | None:
    prev = before.raw if before is not None else None
    if prev is None:
        return None
    n = now.ttft_count - prev.ttft_count
    if n <= 0:
        return None
    return (now.ttft_sum - prev.ttft_sum) / n


def _decode_rate(now: EngineLoad, at: float, before: ReplicaLoad | None) -> float | None:
    if before is None or before.raw is None or at <= before.at:
        return None
    prev = before.raw
    if now.generated_tokens is None or prev.generated_tokens is None:
        return None
    running = (now.running + prev.running) / 2
    tokens = now.generated_tokens - prev.generated_tokens
    if running <= 0 or tokens <= 0:
        return None
    return tokens / (at - before.at) / running


class LoadPoller:
    def __init__(self, endpoints: Callable[[], Mapping[str, tuple[Endpoint, ...]]], *,
                 interval_s: float = 1.0, timeout_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("poll interval and timeout must be positive")
        self._endpoints = endpoints
        self.interval_s = interval_s
        self.timeout_s = min(timeout_s, interval_s)
        self.clock = clock
        self._view: LoadView = MappingProxyType({})
        self._listeners: list[Listener] = []

    @property
    def view(self) -> LoadView:
        """The latest per-replica loads (an immutable mapping, address -> load)."""
        return self._view

    def add_listener(self, fn: Listener) -> None:
        self._listeners.append(fn)

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                started = self.clock()
                await self.poll_once(session)
                await asyncio.sleep(max(0.0, started + self.interval_s - self.clock()))

    async def poll_once(self, session: aiohttp.ClientSession) -> LoadView:
        targets = [e for eps in self._endpoints().values() for e in eps if not e.draining]
        results = await asyncio.gather(*(self._scrape(session, e) for e in targets))
        self._view = MappingProxyType({r.address: r for r in results})
        for fn in self._listeners:
            try:
                fn(self._view)
            except Exception:
                log.exception("load listener %r failed", fn)
        return self._view

    async def _scrape(self, session: aiohttp.ClientSession, e: Endpoint) -> ReplicaLoad:
        now = self.clock()
        before = self._view.get(e.address)
        try:
            async with session.get(f"http://{e.address}/metrics") as resp:
                if resp.status != 200:
                    raise MetricsFormatError(f"HTTP {resp.status}")
                load = parse_engine_metrics(await resp.text())
        except (TimeoutError, aiohttp.ClientError, MetricsFormatError) as err:
            why = str(err) or type(err).__name__
            if before is None or before.ok:
                log.warning("cannot read load of %s replica %s: %s", e.model, e.address, why)
            LOAD_SCRAPES.labels(e.model, "error").inc()
            return ReplicaLoad(e.model, e.address, now, ok=False, error=why)
        LOAD_SCRAPES.labels(e.model, "ok").inc()
        return ReplicaLoad(e.model, e.address, now, running=load.running, waiting=load.waiting,
                           kv_usage=load.kv_usage, ttft_s=_recent_ttft(load, before),
                           decode_tps=_decode_rate(load, now, before), raw=load)
