"""Open-loop load: requests at a fixed rate whatever the answers, each one timed.

Owns the client side of failover tests and benchmarks: a request starts every 1/rate
seconds (so a stalled backend cannot slow the offered load, as a closed loop would),
and each sample records when it started and ended, its status, the replica that
answered and whether a stream was cut. Bounded: it stops after `duration` or `stop()`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass(frozen=True)
class Sample:
    start: float
    end: float
    status: int  # HTTP status, 0 when the connection failed
    replica: str
    error: str = ""
    cut: bool = False  # a stream that ended without data: [DONE]

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.cut and not self.error


@dataclass
class OpenLoop:
    url: str
    model: str
    rate: float  # requests per second
    max_tokens: int = 2
    stream: bool = False
    timeout_s: float = 30.0
    max_in_flight: int = 2000
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self.dropped = 0  # not sent because max_in_flight were outstanding

    async def __aenter__(self) -> OpenLoop:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start(self, duration: float | None = None) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            connector=aiohttp.TCPConnector(limit=self.max_in_flight))
        self._runner = asyncio.create_task(self._run(duration))

    async def stop(self) -> list[Sample]:
        self._stop.set()
        if self._runner is not None:
            await self._runner
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
        return self.samples

    async def wait_done(self) -> list[Sample]:
        if self._runner is not None:
            await self._runner
        return await self.stop()

    async def _run(self, duration: float | None) -> None:
        t0 = time.monotonic()
        n = 0
        while not self._stop.is_set():
            due = t0 + n / self.rate
            if duration is not None and due - t0 >= duration:
                return
            delay = due - time.monotonic()
            if delay > 0:
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                    return
                except TimeoutError:
                    pass
            n += 1
            if len(self._tasks) >= self.max_in_flight:
                self.dropped += 1
                continue
            task = asyncio.create_task(self._one())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self) -> None:
        assert self._session is not None
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": self.max_tokens, "stream": self.stream}
        start = time.monotonic()
        status, replica, error, cut = 0, "", "", False
        try:
            async with self._session.post(self.url + "/v1/chat/completions", json=body) as r:
                status = r.status
                replica = r.headers.get("x-llmgw-replica", "")
                text = await r.text()
                if status != 200:
                    error = text[:200]
                elif self.stream and not text.rstrip().endswith("data: [DONE]"):
                    cut = True
        except (aiohttp.ClientError, TimeoutError) as e:
            error = f"{type(e).__name__}: {e}"
            cut = self.stream and status == 200
        self.samples.append(Sample(start, time.monotonic(), status, replica, error, cut))


def failures(samples: list[Sample], since: float = 0.0) -> list[Sample]:
    return [s for s in samples if s.start >= since and not s.ok]
