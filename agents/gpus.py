"""GPU discovery: NVML where a driver is present, a declared simulated inventory otherwise.

Owns turning "what GPUs does this node have" into a list of values. NVML comes from
nvidia-ml-py (the `nvml` extra); without it, or without a driver, the agent needs
`--simulate-gpus` such as "4xH100-80GB" or "2xA100-40GB,1xL4-24GB".
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_mb: int


class GpuError(ValueError):
    pass


_SIM = re.compile(r"^(\d+)x([A-Za-z0-9._]+)-(\d+)GB$")


def parse_simulated(spec: str, node: str) -> list[GpuInfo]:
    """Parse '4xH100-80GB[,2xL4-24GB]' into GPUs with stable made-up UUIDs."""
    out: list[GpuInfo] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        m = _SIM.match(part)
        if not m:
            raise GpuError(f"--simulate-gpus: {part!r} is not like '4xH100-80GB'")
        count, name, gb = int(m.group(1)), m.group(2), int(m.group(3))
        if not 1 <= count <= 64:
            raise GpuError(f"--simulate-gpus: {count} GPUs in {part!r} (1 to 64)")
        for _ in range(count):
            i = len(out)
            uid = hashlib.sha256(f"{node}/{i}/{name}".encode()).hexdigest()
            out.append(GpuInfo(i, f"GPU-sim-{uid[:8]}-{uid[8:12]}-{uid[12:16]}", name,
                               gb * 1024))
    if len(out) > 64:
        raise GpuError("--simulate-gpus: at most 64 GPUs per node")
    return out


def from_nvml() -> list[GpuInfo] | None:
    """GPUs as NVML reports them, or None when NVML (library or driver) is absent."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total // (1024 * 1024)
            out.append(GpuInfo(i, _s(uuid), _s(name), int(mem)))
        return out
    finally:
        pynvml.nvmlShutdown()


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def discover(simulate: str | None, node: str) -> tuple[list[GpuInfo], str]:
    """(GPUs, where they came from). A simulated spec wins when given."""
    if simulate:
        return parse_simulated(simulate, node), "simulated"
    found = from_nvml()
    if found is not None:
        return found, "nvml"
    raise GpuError("no NVML (nvidia-ml-py and a driver) on this machine: pass "
                   "--simulate-gpus, e.g. 4xH100-80GB")
