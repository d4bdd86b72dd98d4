"""What a proxy adds in front of OpenAI engines: llmgw's Envoy vs a plain Envoy vs the
routers users pick instead, measured in one run on this machine.

Paths, all to the same simulated engine (agents/simengine.py, answering at once):
  direct         the engine itself (the floor every proxy adds to)
  llmgw          Envoy configured by llmgw: body routing on "model", retries, health checks
  static-envoy   a plain static Envoy: one route to the engine, no body routing
  vllm-router    vLLM's Rust router, from PyPI into its own virtualenv
  sglang-router  SGLang's Rust router, from PyPI into its own virtualenv
  litellm        LiteLLM's Python proxy, from PyPI into its own virtualenv

For each: requests/s and p50/p99 latency of short non-streaming requests at a fixed
concurrency (wrk, a C load generator, so the client is not the bottleneck: see the
direct row), the proxy's own CPU time per request (from /proc), and the time to first
token of streams at 1 and 16 concurrent clients. Added latency = path - direct, from the
same run. Body routing's cost is measured too: llmgw vs static Envoy CPU per request at
1 KB, 100 KB and 1 MB bodies. A peer that cannot run here is reported with the reason.

Run:  .venv/bin/python bench/proxy_overhead.py [--seconds 8] [--connections 8]
      (needs `wrk`: apt-get install wrk; peers are installed into bench/.venvs/)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import png_path, print_table, write_json  # noqa: E402
from controlplane.catalog import parse_catalog  # noqa: E402
from controlplane.endpoints import Endpoint  # noqa: E402
from controlplane.envoy_proc import EnvoyProcess, envoy_binary  # noqa: E402
from controlplane.netutil import free_port  # noqa: E402
from controlplane.publisher import StaticSource  # noqa: E402
from controlplane.runtime import ControlPlane  # noqa: E402

HERE = Path(__file__).resolve().parent
VENVS = HERE / ".venvs"
MODEL = "m"
KEY = "sk-llmgw-bench"  # LiteLLM wants a master key; every path gets the same header
PEERS = {
    "vllm-router": ["vllm-router==0.1.17"],
    "sglang-router": ["sglang-router==0.3.2"],
    "litellm": ["litellm[proxy]==1.108.7"],
}


def body(prompt_bytes: int = 16, stream: bool = False, max_tokens: int = 1) -> str:
    import json

    return json.dumps({"model": MODEL, "max_tokens": max_tokens, "stream": stream,
                       "messages": [{"role": "user", "content": "x" * prompt_bytes}]})


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def tree(pid: int) -> list[int]:
    """pid and all its descendants (routers and LiteLLM fork workers)."""
    out = [pid]
    for p in out:
        with contextlib.suppress(OSError):
            for child in Path(f"/proc/{p}/task/{p}/children").read_text().split():
                out.append(int(child))
    return out


@dataclass
class Path_:
    name: str
    url: str = ""
    pids: list[int] = field(default_factory=list)
    unavailable: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    stop_async: Any = None

    async def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        if self.stop_async is not None:
            await self.stop_async()


async def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None,
                    headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.post(url + "/v1/chat/completions", data=body(),
                                  headers={"content-type": "application/json",
                                           **(headers or {})}) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {timeout:.0f}s")


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None
          ) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def ensure_venv(name: str, log: Path) -> Path:
    venv = VENVS / name
    if not (venv / ".ok").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *PEERS[name]],
                           stdout=log.open("ab"), stderr=subprocess.STDOUT)
        if r.returncode != 0:
            raise RuntimeError(f"pip install {' '.join(PEERS[name])} failed (see {log})")
        (venv / ".ok").write_text("ok")
    return venv


async def start_path(name: str, engine_ports: list[int], work: Path) -> Path_:
    p = Path_(name)
    log = work / f"{name}.log"
    upstreams = [f"http://127.0.0.1:{port}" for port in engine_ports]
    upstream = upstreams[0]
    try:
        if name == "direct":
            p.url = upstream  # one engine: what every proxy's per-request path adds to
        elif name == "llmgw":
            port = free_port()
            cat = parse_catalog(f"listener: {{port: {port}}}\nmodels: [{{name: {MODEL}}}]")
            cp = ControlPlane(cat, xds=("127.0.0.1", 0), api=None,
                              sources=[StaticSource([Endpoint(MODEL, "127.0.0.1", port)
                                                     for port in engine_ports])])
            await cp.start()
            env = EnvoyProcess("127.0.0.1", cp.xds_port, workdir=work, node_id="bench-llmgw")
            await env.start()
            await env.wait_listener()
            assert env.proc is not None
            p.url, p.pids = f"http://127.0.0.1:{port}", [env.proc.pid]

            async def stop() -> None:
                await env.stop()
                await cp.stop()

            p.stop_async = stop
        elif name == "static-envoy":
            port = free_port()
            cfg = work / "static-envoy.yaml"
            cfg.write_text(yaml.safe_dump(static_envoy(port, engine_ports)))
            proc = spawn([str(envoy_binary()), "-c", str(cfg), "--disable-hot-restart",
                          "--concurrency", "1", "-l", "warning"], log)
            p.procs, p.pids, p.url = [proc], [proc.pid], f"http://127.0.0.1:{port}"
        elif name == "vllm-router":
            venv = ensure_venv(name, log)
            port = free_port()
            proc = spawn([str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port",
                          str(port), "--worker-urls", *upstreams, "--policy", "power_of_two",
                          "--prometheus-port", str(free_port()), "--log-level", "warning"], log)
            p.procs, p.url = [proc], f"http://127.0.0.1:{port}"
        elif name == "sglang-router":
            venv = ensure_venv(name, log)
            port = free_port()
            proc = spawn([str(venv / "bin" / "python"), "-m", "sglang_router.launch_router",
                          "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                          *upstreams, "--policy", "power_of_two", "--prometheus-port",
                          str(free_port()), "--log-level", "warn"], log)
            p.procs, p.url = [proc], f"http://127.0.0.1:{port}"
        elif name == "litellm":
            venv = ensure_venv(name, log)
            port = free_port()
            cfg = work / "litellm.yaml"
            cfg.write_text(yaml.safe_dump({"model_list": [{
                "model_name": MODEL, "litellm_params": {
                    "model": f"openai/{MODEL}", "api_base": u + "/v1", "api_key": "x"}}
                for u in upstreams]}))
            proc = spawn([str(venv / "bin" / "litellm"), "--config", str(cfg), "--host",
                          "127.0.0.1", "--port", str(port), "--num_workers", "1"], log,
                         env={"LITELLM_MASTER_KEY": KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                              "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR"})
            p.procs, p.url = [proc], f"http://127.0.0.1:{port}"
        if p.procs:
            await wait_http(p.url, 180, p.procs[0], {"authorization": f"Bearer {KEY}"})
            p.pids = tree(p.procs[0].pid)
    except Exception as e:  # report, do not hide: the table says why
        p.unavailable = f"{type(e).__name__}: {e}"
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
        if tail:
            p.unavailable += " | " + " / ".join(tail)[:300]
        await p.stop()
    return p


def static_envoy(port: int, engine_ports: list[int]) -> dict[str, Any]:
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [{
                "name": "plain", "enable_reuse_port": False,
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                 "http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "plain",
                        "route_config": {"virtual_hosts": [{
                            "name": "all", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"},
                                        "route": {"cluster": "engine", "timeout": "0s"}}]}]},
                        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http."
                                     "router.v3.Router"}}]}}]}],
                "per_connection_buffer_limit_bytes": 8388608}],
            "clusters": [{
                "name": "engine", "type": "STATIC", "connect_timeout": "1s",
                "lb_policy": "LEAST_REQUEST",
                "load_assignment": {"cluster_name": "engine", "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {
                        "address": "127.0.0.1", "port_value": ep}}}} for ep in engine_ports]}]}}]},
    }


def wrk(url: str, seconds: float, connections: int, payload: str, work: Path
        ) -> dict[str, float]:
    bodyfile = work / f"body-{len(payload)}.json"
    bodyfile.write_text(payload)
    script = work / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {KEY}"\n'
        f'local f = io.open("{bodyfile}", "rb"); wrk.body = f:read("*a"); f:close()\n')
    duration = f"-d{max(1, round(seconds))}s"  # wrk takes whole seconds
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", duration, "--latency",
                          "-s", str(script), url + "/v1/chat/completions"],
                         capture_output=True, text=True, timeout=seconds + 60).stdout
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if m is None:
        raise RuntimeError(f"wrk printed no result: {out[-500:]}")
    rps = float(m.group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    pct = {}
    for q, v, unit in re.findall(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M):
        pct[int(q)] = float(v) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
    return {"rps": rps, "requests": total, "p50_ms": pct.get(50, 0.0),
            "p99_ms": pct.get(99, 0.0), "errors": int(non2xx.group(1)) if non2xx else 0}


async def ttft(url: str, clients: int, per_client: int) -> float:
    """Median time to the first streamed chunk, in ms."""
    times: list[float] = []

    async def one(s: aiohttp.ClientSession) -> None:
        for _ in range(per_client):
            t0 = time.perf_counter()
            async with s.post(url + "/v1/chat/completions",
                              data=body(stream=True, max_tokens=4),
                              headers={"content-type": "application/json",
                                       "authorization": f"Bearer {KEY}"}) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        times.append(time.perf_counter() - t0)
                        break
                await r.read()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as s:
        await asyncio.gather(*(one(s) for _ in range(clients)))
    return statistics.median(times) * 1000


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--paths", default="direct,llmgw,static-envoy,vllm-router,sglang-router,"
                                       "litellm")
    a = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is needed: apt-get install wrk")
    work = Path(tempfile.mkdtemp(prefix="llmgw-proxy-"))
    # Two engines behind every proxy (the routers' power-of-two policy needs two).
    engine_ports = [free_port(), free_port()]
    engines = [spawn([sys.executable, "-m", "agents.simengine", "--port", str(port),
                      "--model", MODEL, "--ttft", "0", "--tokens-per-s", "1000000",
                      "--max-concurrency", "1024"], work / f"engine-{port}.log")
               for port in engine_ports]
    rows: list[dict[str, Any]] = []
    try:
        for port, proc in zip(engine_ports, engines, strict=True):
            await wait_http(f"http://127.0.0.1:{port}", 30, proc)
        for name in a.paths.split(","):
            p = await start_path(name, engine_ports, work)
            row: dict[str, Any] = {"path": name, "unavailable": p.unavailable}
            if not p.unavailable:
                try:
                    wrk(p.url, 2, a.connections, body(), work)  # warm up
                    c0 = cpu_seconds(p.pids)
                    r = wrk(p.url, a.seconds, a.connections, body(), work)
                    cpu = cpu_seconds(p.pids) - c0
                    row.update(r)
                    row["cpu_us_per_req"] = (cpu / r["requests"] * 1e6) if p.pids else None
                    row["ttft1_ms"] = await ttft(p.url, 1, 30)
                    row["ttft16_ms"] = await ttft(p.url, 16, 10)
                    if name in ("llmgw", "static-envoy"):
                        for size in (1024, 100 * 1024, 1024 * 1024):
                            c0 = cpu_seconds(p.pids)
                            rb = wrk(p.url, max(2.0, a.seconds / 2), 4, body(size), work)
                            row[f"cpu_us_per_req_{size // 1024}k"] = (
                                (cpu_seconds(p.pids) - c0) / max(1, rb["requests"]) * 1e6)
                            row[f"rps_{size // 1024}k"] = rb["rps"]
                finally:
                    await p.stop()
            rows.append(row)
            print(f"measured {name}" + (f" (unavailable: {p.unavailable})"
                                         if p.unavailable else ""), flush=True)
    finally:
        for proc in engines:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
    direct = next((r for r in rows if r["path"] == "direct" and "p50_ms" in r), None)
    for r in rows:
        if direct and "p50_ms" in r:
            r["added_p50_ms"] = r["p50_ms"] - direct["p50_ms"]
            r["added_p99_ms"] = r["p99_ms"] - direct["p99_ms"]
            r["added_ttft1_ms"] = r["ttft1_ms"] - direct["ttft1_ms"]
            r["added_ttft16_ms"] = r["ttft16_ms"] - direct["ttft16_ms"]
    cols = ["path", "rps", "p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms",
            "cpu_us_per_req", "added_ttft1_ms", "added_ttft16_ms", "errors"]
    print_table(f"short requests, {a.connections} connections, {a.seconds:.0f}s each (wrk)",
                cols, [[_fmt(r.get(c)) for c in cols] for r in rows])
    body_cols = ["path"] + [f"cpu_us_per_req_{k}k" for k in (1, 100, 1024)] + \
        [f"rps_{k}k" for k in (1, 100, 1024)]
    print_table("body routing cost (4 connections)", body_cols,
                [[_fmt(r.get(c)) for c in body_cols] for r in rows
                 if r["path"] in ("llmgw", "static-envoy") and "rps_1k" in r])
    for r in rows:
        if r["unavailable"]:
            print(f"{r['path']}: not measured: {r['unavailable']}")
    out = write_json("proxy_overhead", {"seconds": a.seconds, "connections": a.connections,
                                        "results": rows})
    plot(rows, png_path("proxy_overhead"))
    print(f"wrote {out} and {png_path('proxy_overhead')}")


def _fmt(v: Any) -> Any:
    return "-" if v is None else (round(v, 3) if isinstance(v, float) else v)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "rps" in r]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = [r["path"] for r in ok]
    axes[0].bar(names, [r["rps"] for r in ok])
    axes[0].set_title("requests/s (same concurrency)")
    axes[1].bar(names, [r["p50_ms"] for r in ok], label="p50")
    axes[1].bar(names, [r["p99_ms"] - r["p50_ms"] for r in ok], bottom=[r["p50_ms"] for r in ok],
                label="p99")
    axes[1].set_yscale("log")
    axes[1].set_title("latency (ms, log)")
    axes[1].legend()
    axes[2].bar(names, [r.get("ttft1_ms", 0) for r in ok], label="1 stream")
    axes[2].set_title("time to first token, 1 stream (ms)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    asyncio.run(main())
