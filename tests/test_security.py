"""xDS with mTLS: only Envoys with a certificate from the configured CA get config."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from bench.harness import wait_for
from controlplane.catalog import parse_catalog
from controlplane.cli import xds_credentials
from controlplane.envoy_proc import EnvoyProcess, XdsTls
from controlplane.netutil import free_port
from controlplane.runtime import ControlPlane

from .certs import issue, make_ca

pytestmark = pytest.mark.slow
SERVER_NAME = "llmgw-controlplane"


async def test_xds_mtls_accepts_only_the_right_client_certificate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    ca, ca_key, ca_name = make_ca()
    server = issue(ca_key, ca_name, SERVER_NAME, server=True)
    good = issue(ca_key, ca_name, "envoy-1", server=False)
    _, rogue_key, rogue_name = make_ca("rogue")
    rogue = issue(rogue_key, rogue_name, "envoy-x", server=False)
    files = {}
    for name, data in [("ca.pem", ca.cert), ("good.pem", good.cert), ("good.key", good.key),
                       ("rogue.pem", rogue.cert), ("rogue.key", rogue.key)]:
        files[name] = tmp_path / name
        files[name].write_bytes(data)
    creds = xds_credentials(server.cert, server.key, ca.cert)
    cp = ControlPlane(parse_catalog(f"listener: {{port: {free_port()}}}\nmodels: [{{name: a}}]"),
                      xds=("127.0.0.1", 0), api=None, xds_credentials=creds)
    await cp.start()
    envoys = []
    try:
        ok = EnvoyProcess("127.0.0.1", cp.xds_port, node_id="good", workdir=tmp_path,
                          tls=XdsTls(files["ca.pem"], files["good.pem"], files["good.key"],
                                     SERVER_NAME))
        envoys.append(ok)
        await ok.start()
        await ok.wait_listener()
        bad = EnvoyProcess("127.0.0.1", cp.xds_port, node_id="rogue", workdir=tmp_path,
                           tls=XdsTls(files["ca.pem"], files["rogue.pem"], files["rogue.key"],
                                      SERVER_NAME))
        plain = EnvoyProcess("127.0.0.1", cp.xds_port, node_id="plain", workdir=tmp_path)
        envoys += [bad, plain]
        for e in (bad, plain):
            await e.start(wait_live=False)

        async def refused() -> bool:
            for e in (bad, plain):
                if await e.stat("cluster.llmgw_xds.upstream_cx_total") < 2:
                    return False  # wait for at least a retry
                if await e.stat("control_plane.connected_state") != 0:
                    return False
            return True

        await wait_for(refused, 30, "the rogue and plaintext Envoys to be refused")
        live, _ = cp.ads.clients.snapshot()
        assert [c.node_id for c in live] == ["good"]
        assert await ok.stat("control_plane.connected_state") == 1
    finally:
        for e in envoys:
            await e.stop()
        await cp.stop()
    for key in (good.key, server.key, rogue.key):
        secret = key.decode().splitlines()[1]
        assert secret not in caplog.text
        for e in envoys:
            assert secret not in e.log_path.read_text(errors="replace")
