"""What each engine launcher would run, for single- and multi-GPU profiles."""

from __future__ import annotations

import sys

import pytest

from agents.gpus import GpuError, parse_simulated
from agents.launchers import Launch, LaunchError, build


def spec(engine: str, gpus: tuple[int, ...] = (0,), **kw: object) -> Launch:
    base = dict(replica_id="r1", model="llama3", engine=engine,
                model_path="meta-llama/Meta-Llama-3-8B-Instruct", host="127.0.0.1",
                port=8001, gpu_indices=gpus)
    base.update(kw)
    return Launch(**base)  # type: ignore[arg-type]


def test_vllm_single_and_multi_gpu() -> None:
    c = build(spec("vllm"))
    assert c.argv == ("vllm", "serve", "meta-llama/Meta-Llama-3-8B-Instruct", "--host",
                      "127.0.0.1", "--port", "8001", "--served-model-name", "llama3")
    assert c.env == {"CUDA_VISIBLE_DEVICES": "0"}
    c = build(spec("vllm", (2, 3, 4, 5), args=("--max-model-len", "8192"),
                   env={"VLLM_LOGGING_LEVEL": "WARNING"}))
    assert c.argv[9:] == ("--tensor-parallel-size", "4", "--max-model-len", "8192")
    assert c.env == {"CUDA_VISIBLE_DEVICES": "2,3,4,5", "VLLM_LOGGING_LEVEL": "WARNING"}
    assert c.in_flight_metrics == ("vllm:num_requests_running", "vllm:num_requests_waiting")


def test_sglang_single_and_multi_gpu() -> None:
    c = build(spec("sglang"), python="/py")
    assert c.argv == ("/py", "-m", "sglang.launch_server", "--model-path",
                      "meta-llama/Meta-Llama-3-8B-Instruct", "--host", "127.0.0.1", "--port",
                      "8001", "--served-model-name", "llama3")
    c = build(spec("sglang", (0, 1)), python="/py")
    assert c.argv[-2:] == ("--tp", "2") and c.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert c.in_flight_metrics == ("sglang:num_running_reqs", "sglang:num_queue_reqs")


def test_llamacpp_gpu_and_cpu() -> None:
    c = build(spec("llamacpp", model_path="/models/llama3.Q4_K_M.gguf"))
    assert c.argv == ("llama-server", "-m", "/models/llama3.Q4_K_M.gguf", "--host",
                      "127.0.0.1", "--port", "8001", "--alias", "llama3", "--metrics",
                      "-ngl", "99")
    cpu = build(spec("llamacpp", (), model_path="/m.gguf"))
    assert "-ngl" not in cpu.argv and cpu.env["CUDA_VISIBLE_DEVICES"] == ""


def test_sim_and_errors() -> None:
    c = build(spec("sim", model_path=""))
    assert c.argv[:3] == (sys.executable, "-m", "agents.simengine")
    assert c.argv[c.argv.index("--replica-id"):][:2] == ("--replica-id", "r1")
    with pytest.raises(LaunchError, match="unknown engine"):
        build(spec("tgi"))
    with pytest.raises(LaunchError, match="model_path"):
        build(spec("vllm", model_path=""))


def test_simulated_gpus() -> None:
    gpus = parse_simulated("2xH100-80GB,1xL4-24GB", "node-a")
    assert [(g.index, g.name, g.memory_mb) for g in gpus] == [
        (0, "H100", 81920), (1, "H100", 81920), (2, "L4", 24576)]
    assert gpus == parse_simulated("2xH100-80GB,1xL4-24GB", "node-a")  # stable UUIDs
    assert gpus[0].uuid != parse_simulated("2xH100-80GB", "node-b")[0].uuid
    for bad in ("H100", "0xH100-80GB", "65xH100-80GB", "4xH100"):
        with pytest.raises(GpuError):
            parse_simulated(bad, "n")
