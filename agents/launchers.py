"""Engine launchers: the exact command line and environment for each engine.

Owns how a ReplicaSpec becomes a process: vLLM (`vllm serve`), SGLang
(`python -m sglang.launch_server`), llama.cpp (`llama-server`) and the built-in
simulated engine. Pure functions, tested on what they would launch; GPUs are chosen
with CUDA_VISIBLE_DEVICES, tensor parallelism follows the GPU count.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Launch:
    replica_id: str
    model: str  # served name
    engine: str
    model_path: str
    host: str
    port: int
    gpu_indices: tuple[int, ...] = ()
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    env: Mapping[str, str]  # added to the agent's environment
    health_path: str = "/health"
    # Prometheus series whose sum is the replica's in-flight requests.
    in_flight_metrics: tuple[str, ...] = ()


ENGINES = ("vllm", "sglang", "llamacpp", "sim")


class LaunchError(ValueError):
    pass


def _gpu_env(spec: Launch) -> dict[str, str]:
    # Always set, even empty: an engine must never see GPUs it was not given.
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in spec.gpu_indices)}


def _tp(spec: Launch) -> int:
    return max(1, len(spec.gpu_indices))


def build(spec: Launch, python: str = sys.executable) -> Command:
    """The command for a replica; LaunchError for an unknown engine or bad spec."""
    if spec.engine not in ENGINES:
        raise LaunchError(f"unknown engine {spec.engine!r} (one of {', '.join(ENGINES)})")
    if not spec.model_path and spec.engine != "sim":
        raise LaunchError(f"engine {spec.engine} needs a model_path")
    env = {**_gpu_env(spec), **spec.env}
    host, port = spec.host, str(spec.port)
    extra: Sequence[str] = spec.args
    if spec.engine == "vllm":
        argv = ["vllm", "serve", spec.model_path, "--host", host, "--port", port,
                "--served-model-name", spec.model]
        if _tp(spec) > 1:
            argv += ["--tensor-parallel-size", str(_tp(spec))]
        return Command((*argv, *extra), env,
                       in_flight_metrics=("vllm:num_requests_running",
                                          "vllm:num_requests_waiting"))
    if spec.engine == "sglang":
        argv = [python, "-m", "sglang.launch_server", "--model-path", spec.model_path,
                "--host", host, "--port", port, "--served-model-name", spec.model]
        if _tp(spec) > 1:
            argv += ["--tp", str(_tp(spec))]
        return Command((*argv, *extra), env,
                       in_flight_metrics=("sglang:num_running_reqs", "sglang:num_queue_reqs"))
    if spec.engine == "llamacpp":
        argv = ["llama-server", "-m", spec.model_path, "--host", host, "--port", port,
                "--alias", spec.model, "--metrics"]
        # All layers on GPU when it has one; llama.cpp splits across visible devices.
        if spec.gpu_indices:
            argv += ["-ngl", "99"]
        return Command((*argv, *extra), env,
                       in_flight_metrics=("llamacpp:requests_processing",
                                          "llamacpp:requests_deferred"))
    argv = [python, "-m", "agents.simengine", "--host", host, "--port", port,
            "--model", spec.model, "--replica-id", spec.replica_id]
    return Command((*argv, *extra), env,
                   in_flight_metrics=("vllm:num_requests_running", "vllm:num_requests_waiting"))
