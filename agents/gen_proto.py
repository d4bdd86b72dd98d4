"""Regenerate agents/pb from agents/proto with betterproto2's compiler.

betterproto2 is the message library Envoy's API (envoy-data-plane) already uses, so one
message library serves the whole project. Run:  .venv/bin/python agents/gen_proto.py
(needs the `codegen` extra: grpcio-tools for protoc, betterproto2-compiler).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "proto"
OUT = HERE / "pb"


def main() -> None:
    files = sorted(str(p.relative_to(PROTO)) for p in PROTO.rglob("*.proto"))
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO}",
         f"--python_betterproto2_out={OUT}", *files],
        check=True,
    )
    print(f"generated {OUT} from {', '.join(files)}")


if __name__ == "__main__":
    main()
