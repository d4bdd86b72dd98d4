"""The fleet converges and changes under load with no failed request (real processes)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.harness import Fleet, Load
from controlplane.netutil import free_port

from .conftest import wait_for

pytestmark = pytest.mark.slow

SIM = "engine: sim, gpus: 1, args: [--ttft, '0.01', --tokens-per-s, '400']"
CATALOG = f"""
models:
  - name: alpha
    aliases: [a]
    min_replicas: 1
    max_replicas: 3
    drain_timeout_s: 20
    profiles: [{{name: v1, {SIM}}}]
  - name: beta
    min_replicas: 1
    max_replicas: 2
    drain_timeout_s: 20
    profiles: [{{name: v1, {SIM}}}]
"""


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    f = Fleet(tmp_path, CATALOG)
    try:
        await f.start(nodes=3)
        yield f
    finally:
        await f.close()


async def edit(f: Fleet, old: str, new: str, count: int = 1) -> None:
    """Edit the catalog file and wait until the control plane has read it."""
    assert f.cp is not None and f.cp.watcher is not None
    n = f.cp.watcher.applied + f.cp.watcher.refused
    text = f.catalog_path.read_text()
    assert old in text, old
    f.write_catalog(text.replace(old, new, count))
    await reloaded(f, n + 1)


async def reloaded(f: Fleet, n: int) -> None:
    assert f.cp is not None and f.cp.watcher is not None
    w = f.cp.watcher

    async def check() -> bool:
        return w.applied + w.refused >= n

    await wait_for(check, 10, f"catalog reload #{n}")


# ------------------------------------------------------------------ 1. the demo


def test_demo_converges_and_routes(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(5)]
    listener, admin, xds, api, agents = ports
    proc = subprocess.Popen(
        [sys.executable, "-m", "controlplane.cli", "demo", "--ports",
         ",".join(map(str, ports)), "--exit-after", "120"],
        stdout=(tmp_path / "demo.out").open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        out = tmp_path / "demo.out"

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"demo exited: {out.read_text()}")
            return "llmgw demo is up" in out.read_text()

        asyncio.run(wait_for(_sync(up), 120, "the demo to come up"))
        text = out.read_text()
        assert f"http://127.0.0.1:{listener}" in text and f"127.0.0.1:{admin}" in text
        with urllib.request.urlopen(f"http://127.0.0.1:{api}/status", timeout=5) as r:
            doc = json.loads(r.read())
        for m in doc["models"]:
            assert len(m["endpoints"]) >= m["min_replicas"], m
        used = [(n["name"], i) for n in doc["nodes"] for r in n["replicas"] for i in r["gpus"]
                if r["state"] in ("ready", "starting", "requested", "draining")]
        assert len(used) == len(set(used)), "a GPU is double-booked"
        # Envoy routes to every replica of each model, by name and by alias.
        for m in doc["models"]:
            seen = set()
            for i in range(20):
                name = m["name"] if i % 2 else m["aliases"][0]
                req = urllib.request.Request(
                    f"http://127.0.0.1:{listener}/v1/chat/completions",
                    data=json.dumps({"model": name, "messages": [], "max_tokens": 1}).encode(),
                    headers={"content-type": "application/json"})
                with urllib.request.urlopen(req, timeout=10) as r:
                    seen.add(r.headers["x-llmgw-replica"])
            assert len(seen) == len(m["endpoints"]), (seen, m["endpoints"])
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, (tmp_path / "demo.out").read_text()


def _sync(fn):  # type: ignore[no-untyped-def]
    async def wrapped() -> bool:
        return bool(fn())

    return wrapped


# ------------------------------------------------------------------ 3. scaling


async def test_min_max_and_removal_converge_without_failed_requests(fleet: Fleet) -> None:
    await fleet.converged({"alpha": 1, "beta": 1})
    async with Load(fleet.url, ["alpha", "a"]) as load_a:
        load_b = Load(fleet.url, ["beta"], workers=2)
        async with load_b:
            await load_a.wait_requests(20)
            await edit(fleet, "min_replicas: 1\n    max_replicas: 3",
                 "min_replicas: 3\n    max_replicas: 3")
            await fleet.converged({"alpha": 3, "beta": 1})
            await load_a.wait_requests(20)
            await edit(fleet, "min_replicas: 3\n    max_replicas: 3",
                 "min_replicas: 1\n    max_replicas: 1")
            await fleet.converged({"alpha": 1, "beta": 1})
            await load_b.wait_requests(10)
        assert load_b.result.failures == [] and load_b.result.cut_streams == []
        # Remove beta (its clients stopped first: a removed model is a 404 by design).
        text = fleet.catalog_path.read_text()
        await edit(fleet, text[text.index("  - name: beta"):], "")
        await fleet.converged({"alpha": 1})
        await load_a.wait_requests(20)
    r = load_a.result
    assert r.failures == [] and r.cut_streams == [], (r.failures[:5], r.cut_streams[:5])
    assert r.ok > 60 and not fleet.gpus_double_booked()
    assert len(r.by_replica) >= 3, "traffic reached the scaled-up replicas"


# ------------------------------------------------------------------ 4. rolling update


async def test_profile_change_rolls_without_failed_requests(fleet: Fleet) -> None:
    await edit(fleet, "min_replicas: 1\n    max_replicas: 3",
               "min_replicas: 2\n    max_replicas: 3")
    await fleet.converged({"alpha": 2, "beta": 1})
    before = {rid for _, rid, _ in fleet.replicas("alpha")}
    async with Load(fleet.url, ["alpha"], workers=4) as load:
        await load.wait_requests(20)
        await edit(fleet, "{name: v1, engine: sim, gpus: 1, args: [--ttft, '0.01'",
             "{name: v2, engine: sim, gpus: 1, args: [--ttft, '0.02'")
        await fleet.converged({"alpha": 2, "beta": 1}, timeout=90)
        await load.wait_requests(20)
    after = {rid for _, rid, _ in fleet.replicas("alpha")}
    assert not before & after, "every alpha replica was replaced"
    r = load.result
    assert r.failures == [] and r.cut_streams == [], (r.failures[:5], r.cut_streams[:5])


# ------------------------------------------------------------------ 5. invalid edit


async def test_invalid_catalog_edit_is_refused_while_traffic_flows(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="llmgw.catalog")
    await fleet.converged({"alpha": 1, "beta": 1})
    assert fleet.cp is not None and fleet.cp.watcher is not None
    w = fleet.cp.watcher
    async with Load(fleet.url, ["alpha", "beta"]) as load:
        await load.wait_requests(10)
        await edit(fleet, "max_replicas: 3", "max_replicas: 0")  # max < min
        assert w.refused == 1 and "alpha" in w.last_error and "max_replicas" in w.last_error
        assert any("keeping the last good catalog" in r.getMessage() for r in caplog.records)
        doc = fleet.cp.status()
        assert "max_replicas" in doc["catalog"]["last_error"]
        await load.wait_requests(20)
        # A later valid edit applies.
        await edit(fleet, "max_replicas: 0", "max_replicas: 3")
        assert w.last_error == ""
        await load.wait_requests(10)
    assert load.result.failures == [] and load.result.ok >= 40
    assert [m.max_replicas for m in fleet.catalog().models] == [3, 2]

