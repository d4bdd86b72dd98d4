"""The `llmgw` command line: help texts, catalog validation, envoy, status, refusals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from click.testing import CliRunner

from controlplane.catalog import parse_catalog
from controlplane.cli import main
from controlplane.netutil import free_port
from controlplane.runtime import ControlPlane

from .conftest import wait_for

COMMANDS = ["controlplane", "agent", "envoy", "status", "demo", "drain", "uncordon",
            "catalog", "catalog validate"]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_has_help(cmd: str) -> None:
    r = CliRunner().invoke(main, [*cmd.split(), "--help"])
    assert r.exit_code == 0, r.output
    assert "Usage: main" in r.output or "Usage:" in r.output
    # The first help line says what it does, in a sentence.
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines[1].strip()) > 15


def test_top_level_help_lists_commands() -> None:
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0
    for cmd in ("controlplane", "agent", "envoy", "status", "demo", "drain", "catalog"):
        assert cmd in r.output


def test_catalog_validate(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("models:\n  - {name: a, aliases: [b]}\n")
    r = CliRunner().invoke(main, ["catalog", "validate", str(good)])
    assert r.exit_code == 0 and "OK (1 models, 2 names" in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - {name: a, min_replicas: 3, max_replicas: 1}\n")
    r = CliRunner().invoke(main, ["catalog", "validate", str(bad)])
    assert r.exit_code == 1 and "bad.yaml" in r.output and "model 'a'" in r.output
    r = CliRunner().invoke(main, ["catalog", "validate", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 1 and "cannot read" in r.output


def test_controlplane_refuses_to_run_without_agent_auth(tmp_path: Path) -> None:
    cat = tmp_path / "c.yaml"
    cat.write_text("models: []\n")
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_AGENT_TOKEN"}
    r = CliRunner().invoke(main, ["controlplane", "--catalog", str(cat)], env=env)
    assert r.exit_code == 1 and "agents must authenticate" in r.output


def test_agent_without_gpus_or_simulation_says_what_to_do() -> None:
    r = CliRunner().invoke(main, ["agent", "--control-plane", "127.0.0.1:1", "--node", "n"])
    assert r.exit_code == 1 and "--simulate-gpus" in r.output


async def llmgw(*args: str) -> tuple[int, str]:
    """Run the CLI without blocking the event loop the control plane runs on."""
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "controlplane.cli", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(p.communicate(), 60)
    return p.returncode or 0, out.decode()


@pytest.mark.slow
async def test_envoy_command_and_status(tmp_path: Path) -> None:
    cp = ControlPlane(parse_catalog(f"listener: {{port: {free_port()}}}\nmodels: [{{name: a}}]"),
                      xds=("127.0.0.1", 0), api=("127.0.0.1", 0))
    await cp.start()
    admin = free_port()
    out = tmp_path / "envoy.out"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "controlplane.cli", "envoy", "--xds", f"127.0.0.1:{cp.xds_port}",
        "--admin", f"127.0.0.1:{admin}", "--node-id", "cli-envoy", "--workdir",
        str(tmp_path), stdout=out.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        async def live() -> bool:
            assert proc.returncode is None, out.read_text()
            return "Envoy is LIVE" in out.read_text()

        await wait_for(live, 30, "llmgw envoy to report LIVE")
        text = out.read_text()
        assert f"admin http://127.0.0.1:{admin}" in text and "listener http://127.0.0.1:" in text
        api = f"http://127.0.0.1:{cp.api_port}"
        rc, text = await llmgw("status", "--url", api, "--json")
        assert rc == 0 and json.loads(text)["xds"]["envoys"][0]["node_id"] == "cli-envoy"
        rc, text = await llmgw("status", "--url", api, "--envoy-admin",
                               f"http://127.0.0.1:{admin}")
        assert rc == 0 and "cli-envoy" in text and "Models" in text and "Traffic" in text, text
        rc, text = await llmgw("status", "--url", api, "--json", "--envoy-admin",
                               f"http://127.0.0.1:{admin}")
        assert json.loads(text)["traffic"]["a"]["requests"] == 0
        async with aiohttp.ClientSession() as s, s.get(api + "/metrics") as r:
            metrics = await r.text()
        for name in ("llmgw_xds_pushes_total", "llmgw_xds_nacks_total", "llmgw_nodes",
                     "llmgw_replicas", "llmgw_gpus", "llmgw_published_endpoints",
                     "llmgw_reconciler_actions", "llmgw_catalog_reloads", "llmgw_agent_streams",
                     "llmgw_replica_load", "llmgw_load_weight", "llmgw_load_scrapes",
                     "llmgw_load_weight_updates", "llmgw_autoscale_decisions"):
            assert f"# TYPE {name}" in metrics or f"# HELP {name}" in metrics, name
        # A second Envoy on the same admin port fails loudly.
        rc, text = await llmgw("envoy", "--xds", f"127.0.0.1:{cp.xds_port}", "--admin",
                               f"127.0.0.1:{admin}")
        assert rc == 1 and "already in use" in text
        rc, text = await llmgw("status", "--url", f"http://127.0.0.1:{free_port()}")
        assert rc == 1 and "cannot reach the control plane" in text
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 20)
        await cp.stop()
