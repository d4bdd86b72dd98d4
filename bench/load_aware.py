"""Load-aware balancing with one slowed replica: llmgw's three policies vs the peers'.

Two simulated engines (agents/simengine.py) with realistic LLM behaviour: 100 ms to
first token, 50 tokens/s per sequence, a batch of 8 sequences (further requests
queue, as in vLLM's scheduler), 32 tokens per answer. One of them is slowed by fault
injection (decode 3x slower, as on a throttled or shared GPU: its first token is as
fast while it has a free slot, but each sequence holds its slot 3x longer), so it can
carry about 4 requests/s against the other's 10.8. A steady open-loop load of
streaming requests (fixed rate, so a slow backend cannot slow the offered load) runs
through each balancer in turn, on the same two engines:

  llmgw least_request (two choices)
                        Envoy's default least-request: the better of two random picks
  llmgw least_request   least-request over every replica (llmgw's default pick)
  llmgw orca            Envoy's client_side_weighted_round_robin on the engines' ORCA
                        load reports (endpoint-load-metrics response header)
  llmgw weighted        least-request on EDS weights from the control plane's poller
                        (/metrics every 0.5 s: queue, KV cache, TTFT)
  vllm-router / sglang-router, each with its default load-aware `cache_aware` policy
                        and with `power_of_two`, installed from PyPI into bench/.venvs

For each: client-side time to first token p50/p99, end-to-end p99, throughput, failed
requests, and the share of requests the slowed replica served (from the engines' own
request counters, so it is the same measure for every balancer). The first seconds
of each run are warm-up (weights to settle) and are not counted.

Load: 13.5 requests/s, about 90% of the pair's capacity (10.8 + 4 requests/s), so
where the requests go decides whether queues form. Each policy runs --repeat times,
interleaved with the others (a run's p99 is noisy on a shared 2-core machine); the
table gives medians, the range of p99 across rounds, and the p99 of all rounds'
requests pooled.

Arrivals are evenly spaced by default; `--arrivals poisson` draws exponential gaps
(as vLLM's benchmark_serving does by default), the same sequence for every balancer
of a round. Even spacing favours any fixed rotation (a deterministic pattern with the
right ratio need never queue); Poisson bursts are what in-flight-aware picks are for.

`--gateways 2` runs two instances of every balancer and sends requests to them in
turn, as behind an L4 load balancer: each instance sees only its own requests in
flight. llmgw's instances are each a control plane and an Envoy (in a deployment, one
control plane feeds every Envoy; each here computes the same weights from the same
engines' /metrics, so the stand-in changes nothing Envoy sees).

Run:  .venv/bin/python bench/load_aware.py [--rate 13.5] [--seconds 25] [--warmup 8]
                  [--repeat 3] [--arrivals fixed|poisson] [--gateways 1]
                  [--policies "llmgw weighted,..."]
                  [--name load_aware]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import png_path, print_table, write_json  # noqa: E402
from bench.proxy_overhead import Path_, ensure_venv, spawn, tree, wait_http  # noqa: E402
from controlplane.catalog import parse_catalog  # noqa: E402
from controlplane.endpoints import Endpoint  # noqa: E402
from controlplane.engine_metrics import parse_engine_metrics  # noqa: E402
from controlplane.envoy_proc import EnvoyProcess  # noqa: E402
from controlplane.netutil import free_port  # noqa: E402
from controlplane.publisher import StaticSource  # noqa: E402
from controlplane.runtime import ControlPlane  # noqa: E402

MODEL = "m"
ENGINE_ARGS = ["--ttft", "0.1", "--tokens-per-s", "50", "--max-concurrency", "8"]
MAX_TOKENS = 32
SLOWDOWN = 3.0
POLICIES = [
    ("llmgw least_request (two choices)", "llmgw", "least_request two_choices"),
    ("llmgw least_request", "llmgw", "least_request"),
    ("llmgw orca", "llmgw", "orca"),
    ("llmgw weighted", "llmgw", "weighted"),
    ("vllm-router cache_aware", "vllm-router", "cache_aware"),
    ("vllm-router power_of_two", "vllm-router", "power_of_two"),
    ("sglang-router cache_aware", "sglang-router", "cache_aware"),
    ("sglang-router power_of_two", "sglang-router", "power_of_two"),
]


@dataclass(frozen=True)
class Req:
    start: float
    ttft: float | None  # None: failed before the first token
    total: float
    ok: bool


async def engine_served(port: int, s: aiohttp.ClientSession) -> float:
    async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def wait_idle(ports: list[int], s: aiohttp.ClientSession, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loads = []
        for p in ports:
            async with s.get(f"http://127.0.0.1:{p}/metrics") as r:
                loads.append(parse_engine_metrics(await r.text()))
        if all(x.running == 0 and x.waiting == 0 for x in loads):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("engines did not go idle between runs")


async def open_loop(urls: list[str], rate: float, seconds: float,
                    gaps: random.Random | None = None) -> list[Req]:
    """Streaming requests at `rate`, taking the gateways in turn; each timed to its
    first chunk and its end.

    Evenly spaced, or with exponential gaps (Poisson arrivals, as vLLM's
    benchmark_serving sends by default) drawn from `gaps`."""
    out: list[Req] = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 50}],
            "max_tokens": MAX_TOKENS, "stream": True}

    async def one(s: aiohttp.ClientSession, url: str) -> None:
        t0 = time.monotonic()
        first: float | None = None
        ok = False
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                async for line in r.content:
                    if first is None and line.startswith(b"data: "):
                        first = time.monotonic() - t0
                    if line.startswith(b"data: [DONE]"):
                        ok = r.status == 200
        out.append(Req(t0, first, time.monotonic() - t0, ok))

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks: list[asyncio.Task[None]] = []
        t0 = time.monotonic()
        due = t0
        while due < t0 + seconds:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(one(s, urls[len(tasks) % len(urls)])))
            due += gaps.expovariate(rate) if gaps else 1.0 / rate
        await asyncio.gather(*tasks)
    return out


async def start_balancer(kind: str, policy: str, ports: list[int], work: Path,
                         index: int = 0) -> Path_:
    p = Path_(f"{kind} {policy}")
    log = work / f"{kind}-{policy}-{index}.log"
    upstreams = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        if kind == "llmgw":
            port = free_port()
            lb, _, pick = policy.partition(" ")
            cat = parse_catalog(f"listener: {{port: {port}}}\nmodels: [{{name: {MODEL}, "
                                f"routing: {{load_balancing: {lb}, "
                                f"least_request_pick: {pick or 'full_scan'}}}}}]")
            cp = ControlPlane(cat, xds=("127.0.0.1", 0), api=None, load_interval_s=0.5,
                              weight_min_interval_s=1.0,
                              sources=[StaticSource([Endpoint(MODEL, "127.0.0.1", x)
                                                     for x in ports])])
            await cp.start()
            env = EnvoyProcess("127.0.0.1", cp.xds_port, workdir=work,
                               node_id=f"la-{policy.replace(' ', '-')}-{index}")
            await env.start()
            await env.wait_listener()
            p.url = f"http://127.0.0.1:{port}"

            async def stop() -> None:
                await env.stop()
                await cp.stop()

            p.stop_async = stop
            await wait_http(p.url, 30)
        else:
            venv = ensure_venv(kind, log)
            port = free_port()
            if kind == "vllm-router":
                cmd = [str(venv / "bin" / "vllm-router")]
            else:
                cmd = [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router"]
            cmd += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *upstreams,
                    "--policy", policy, "--prometheus-port", str(free_port()),
                    "--log-level", "warning" if kind == "vllm-router" else "warn"]
            proc = spawn(cmd, log)
            p.procs, p.url = [proc], f"http://127.0.0.1:{port}"
            await wait_http(p.url, 180, proc)
            p.pids = tree(proc.pid)
    except Exception as e:  # the table says why a balancer could not run
        p.unavailable = f"{type(e).__name__}: {e}"
        await p.stop()
    return p


async def measure(name: str, kind: str, policy: str, ports: list[int], work: Path,
                  s: aiohttp.ClientSession, a: argparse.Namespace,
                  rnd: int) -> dict[str, Any]:
    """One run of one balancer: warm-up, then the measured open loop.

    With Poisson arrivals every balancer of a round gets the same arrival times."""
    def gaps(part: int) -> random.Random | None:
        return random.Random(rnd * 2 + part) if a.arrivals == "poisson" else None

    await wait_idle(ports, s)
    bals: list[Path_] = []
    try:
        for i in range(a.gateways):
            bals.append(await start_balancer(kind, policy, ports, work, i))
            if bals[-1].unavailable:
                return {"policy": name, "unavailable": bals[-1].unavailable}
        urls = [b.url for b in bals]
        await open_loop(urls, a.rate, a.warmup, gaps(0))
        before = [await engine_served(x, s) for x in ports]
        t0 = time.monotonic()
        reqs = await open_loop(urls, a.rate, a.seconds, gaps(1))
        wall = time.monotonic() - t0
        after = [await engine_served(x, s) for x in ports]
    finally:
        for b in bals:
            await b.stop()
    served = [b - x for b, x in zip(after, before, strict=True)]
    ok = [r for r in reqs if r.ok]
    ttfts = [r.ttft * 1000 for r in ok if r.ttft is not None]
    return {
        "policy": name,
        "requests": len(reqs), "failed": len(reqs) - len(ok),
        "throughput_rps": len(ok) / wall,
        "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p99_ms": pct(ttfts, 0.99),
        "ttfts_ms": [round(x, 1) for x in ttfts],
        "e2e_p99_ms": pct([r.total * 1000 for r in ok], 0.99),
        "slow_share": served[1] / max(1.0, sum(served)),
    }


def aggregate(name: str, rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians across rounds; failures and requests summed; p99's range kept."""
    out: dict[str, Any] = {"policy": name, "rounds": len(rs)}
    for k in ("throughput_rps", "ttft_p50_ms", "ttft_p99_ms", "e2e_p99_ms", "slow_share"):
        out[k] = statistics.median(r[k] for r in rs)
    out["requests"] = sum(r["requests"] for r in rs)
    out["failed"] = sum(r["failed"] for r in rs)
    out["ttft_p99_min_ms"] = min(r["ttft_p99_ms"] for r in rs)
    out["ttft_p99_max_ms"] = max(r["ttft_p99_ms"] for r in rs)
    # Every request of every round together: one bad round weighs as much as it hurt.
    out["ttft_p99_pooled_ms"] = pct([x for r in rs for x in r["ttfts_ms"]], 0.99)
    return out


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=13.5, help="requests per second")
    ap.add_argument("--seconds", type=float, default=25.0, help="measured seconds per policy")
    ap.add_argument("--warmup", type=float, default=8.0, help="uncounted seconds first")
    ap.add_argument("--policies", default=",".join(name for name, _, _ in POLICIES))
    ap.add_argument("--repeat", type=int, default=3,
                    help="rounds over every policy (interleaved); medians are reported")
    ap.add_argument("--arrivals", choices=("fixed", "poisson"), default="fixed",
                    help="evenly spaced requests, or Poisson (same seed per round)")
    ap.add_argument("--gateways", type=int, default=1,
                    help="instances of each balancer, taking requests in turn (as behind an "
                         "L4 load balancer): each sees only its own share in flight")
    ap.add_argument("--name", default="load_aware", help="result file name (JSON, PNG)")
    a = ap.parse_args()
    wanted = set(a.policies.split(","))
    work = Path(tempfile.mkdtemp(prefix="llmgw-load-aware-"))
    ports = [free_port(), free_port()]
    engines = [spawn([sys.executable, "-m", "agents.simengine", "--port", str(port),
                      "--model", MODEL, "--replica-id", rid, *ENGINE_ARGS],
                     work / f"engine-{rid}.log")
               for port, rid in zip(ports, ("fast", "slow"), strict=True)]
    runs: dict[str, list[dict[str, Any]]] = {}
    unavailable: dict[str, str] = {}
    try:
        for port in ports:
            await wait_http(f"http://127.0.0.1:{port}", 30)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{ports[1]}/admin/fault",
                              json={"decode_slowdown": SLOWDOWN}) as r:
                assert r.status == 200
            for rnd in range(a.repeat):
                for name, kind, policy in POLICIES:
                    if name not in wanted or name in unavailable:
                        continue
                    row = await measure(name, kind, policy, ports, work, s, a, rnd)
                    if "unavailable" in row:
                        unavailable[name] = row["unavailable"]
                        print(f"{name}: cannot run here: {row['unavailable']}", flush=True)
                        continue
                    runs.setdefault(name, []).append(row)
                    print(f"round {rnd + 1}/{a.repeat}, {name}: TTFT p99 "
                          f"{row['ttft_p99_ms']:.0f} ms, slow share {row['slow_share']:.2f}",
                          flush=True)
    finally:
        for e in engines:
            e.terminate()
        for e in engines:
            e.wait(10)
    done = [aggregate(name, rs) for name, rs in runs.items()]
    cols = ["policy", "requests", "failed", "throughput_rps", "ttft_p50_ms", "ttft_p99_ms",
            "ttft_p99_min_ms", "ttft_p99_max_ms", "ttft_p99_pooled_ms", "e2e_p99_ms", "slow_share"]
    print_table(f"one replica decoding {SLOWDOWN:g}x slower, {a.rate:g} req/s ({a.arrivals} "
                f"arrivals, {a.gateways} gateway(s)), {a.seconds:g} s "
                f"per run; median of {a.repeat} rounds (p99 min/max across rounds; pooled: "
                f"p99 of all rounds' requests together)", cols,
                [[r[c] for c in cols] for r in done])
    for name, why in unavailable.items():
        print(f"{name}: not measured: {why}")
    rows = done + [{"policy": n, "unavailable": w} for n, w in unavailable.items()]
    out = write_json(a.name, {
        "rate_rps": a.rate, "arrivals": a.arrivals, "gateways": a.gateways,
        "seconds": a.seconds,
        "warmup_s": a.warmup, "rounds": a.repeat,
        "runs": runs,
        "engine_args": ENGINE_ARGS, "max_tokens": MAX_TOKENS,
        "slow_decode_slowdown": SLOWDOWN, "results": rows})
    png = png_path(a.name)
    plot(done, png)
    print(f"wrote {out} and {png}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["policy"].replace(" ", "\n", 1) for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    x = range(len(rows))
    axes[0].bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in rows], 0.4, label="p50")
    axes[0].bar([i + 0.2 for i in x], [r["ttft_p99_ms"] for r in rows], 0.4, label="p99",
                yerr=[[r["ttft_p99_ms"] - r["ttft_p99_min_ms"] for r in rows],
                      [r["ttft_p99_max_ms"] - r["ttft_p99_ms"] for r in rows]], capsize=3)
    axes[0].set_yscale("log")
    axes[0].set_title("time to first token (ms, log; p99 bar: median, min-max of rounds)")
    axes[0].legend()
    axes[1].bar(list(x), [r["slow_share"] for r in rows], 0.6, color="tab:red")
    axes[1].axhline(0.5, color="grey", linestyle="--", linewidth=1)
    axes[1].set_title("share of requests served by the slowed replica")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, fontsize=7)
    fig.suptitle("llmgw: load-aware balancing with one slowed replica")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    asyncio.run(main())
