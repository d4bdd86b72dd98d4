"""Autoscaling end to end: agents, simulated engines with a small batch, a real Envoy.

A sustained load above one replica's capacity scales the model up to max_replicas;
once it stops, the model scales back to min_replicas, draining replicas one step at
a time; no request fails and no stream is cut at any point."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from bench.harness import Fleet, Load

pytestmark = pytest.mark.slow

CATALOG = """
models:
  - name: m
    min_replicas: 1
    max_replicas: 3
    drain_timeout_s: 10
    autoscale: {up_waiting_per_replica: 1, up_after_s: 1, down_load_per_replica: 0.6,
                down_after_s: 2, cooldown_s: 1}
    profiles:
      - name: sim
        engine: sim
        gpus: 1
        # Two requests at a time, ~0.25 s each: about 8 requests/s per replica.
        args: [--ttft, "0.05", --tokens-per-s, "50", --max-concurrency, "2"]
"""


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    f = Fleet(tmp_path, CATALOG, load_interval_s=0.25)
    try:
        await f.start(nodes=3)
        yield f
    finally:
        await f.close()


async def test_scales_up_under_sustained_queue_and_back_down_without_failures(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.autoscaler")

    def decided(direction: str) -> float:
        return REGISTRY.get_sample_value("llmgw_autoscale_decisions_total",
                                         {"model": "m", "direction": direction}) or 0.0

    counted = {d: decided(d) for d in ("up", "down")}
    await fleet.converged({"m": 1})
    assert fleet.cp is not None and fleet.cp.autoscaler is not None
    # 12 clients against a replica that runs 2 at a time: a queue that lasts.
    async with Load(fleet.url, ["m"], workers=12, max_tokens=10, stream_every=2) as heavy:
        await fleet.converged({"m": 3}, timeout=90)
        await heavy.wait_requests(20)
    ups = [d for d in fleet.cp.autoscaler.decisions if d.to_replicas > d.from_replicas]
    assert [(d.from_replicas, d.to_replicas) for d in ups] == [(1, 2), (2, 3)]
    assert all("queue" in d.reason for d in ups)
    # A trickle keeps flowing while the model scales down through drains.
    async with Load(fleet.url, ["m"], workers=1, max_tokens=4, stream_every=2) as light:
        await fleet.converged({"m": 1}, timeout=90)
        await light.wait_requests(5)
    downs = [d for d in fleet.cp.autoscaler.decisions if d.to_replicas < d.from_replicas]
    assert [(d.from_replicas, d.to_replicas) for d in downs] == [(3, 2), (2, 1)]
    assert all("load" in d.reason for d in downs)
    for res in (heavy.result, light.result):
        assert res.failures == [] and res.cut_streams == [], (res.failures, res.cut_streams)
    assert heavy.result.ok > 50 and light.result.ok >= 5
    # Every decision is logged with its reason and shown by `llmgw status`.
    logged = [r.getMessage() for r in caplog.records if r.name == "llmgw.autoscaler"]
    assert len(logged) == 4 and all("replicas (" in m for m in logged)
    doc = fleet.cp.status()
    assert [(d["from_replicas"], d["to_replicas"]) for d in doc["autoscaler"]] == [
        (1, 2), (2, 3), (3, 2), (2, 1)]
    assert doc["models"][0]["autoscale"] is True
    assert {d: decided(d) - n for d, n in counted.items()} == {"up": 2, "down": 2}
