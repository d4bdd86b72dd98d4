# The llmgw image: control plane and node agent (same code, different command).
# Real engines (vLLM, SGLang, llama.cpp) are installed on top of it per deployment;
# without one an agent can still run the simulated engine (engine: sim).
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends iproute2 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/llmgw
COPY pyproject.toml constraints.txt README.md ./
COPY controlplane ./controlplane
COPY xds ./xds
COPY agents ./agents
COPY envoy ./envoy
# nvml: read real GPUs through the NVIDIA driver the container runtime mounts.
RUN pip install --no-cache-dir -c constraints.txt '.[nvml]'

# Ports: 18000 xDS (Envoy), 18001 status API and metrics, 18002 agents.
EXPOSE 18000 18001 18002
ENTRYPOINT ["llmgw"]
CMD ["--help"]
