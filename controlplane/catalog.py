"""The model catalog: which models exist, their aliases and how Envoy routes to them.

Owns the pydantic schema of the catalog YAML and its loading. Every object here is
frozen: a loaded catalog is a value that the publisher and the reconciler read, never
mutate. Validation errors name the file, the model and the field.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Model names travel in JSON bodies and in Envoy route matchers; anything printable
# without whitespace is accepted (HF-style "org/name:tag" included).
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


class CatalogError(ValueError):
    """A catalog file could not be read or is invalid; the message says where."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Routing(_Frozen):
    """Per-model data-path settings that Envoy enforces (cluster and route)."""

    connect_timeout_s: float = Field(2.0, gt=0, le=60)
    # Streams are never cut by a whole-request timeout: only silence ends them.
    stream_idle_timeout_s: float = Field(300.0, gt=0)
    # Per-try idle timeout: resets on every upstream byte, so a long generation is
    # never cut, while a frozen engine is abandoned (and retried) quickly.
    per_try_idle_timeout_s: float = Field(10.0, gt=0)
    num_retries: int = Field(2, ge=0, le=10)
    retry_on_503: bool = True
    outlier_consecutive_5xx: int = Field(3, ge=1)
    outlier_consecutive_gateway_failure: int = Field(3, ge=1)
    outlier_interval_s: float = Field(1.0, gt=0)
    outlier_base_ejection_s: float = Field(10.0, gt=0)
    outlier_max_ejection_percent: int = Field(100, ge=0, le=100)
    health_check_path: str = "/health"
    health_check_interval_s: float = Field(1.0, gt=0)
    health_check_timeout_s: float = Field(1.0, gt=0)
    health_check_unhealthy_threshold: int = Field(2, ge=1)
    health_check_healthy_threshold: int = Field(1, ge=1)
    max_connections: int = Field(4096, ge=1)
    max_pending_requests: int = Field(4096, ge=1)
    max_requests: int = Field(4096, ge=1)
    max_retries: int = Field(64, ge=0)
    # How Envoy picks a replica (docs: README "Load-aware routing"):
    #  least_request  Envoy's least-request on its own in-flight counts only;
    #  weighted       least-request on top of EDS weights the control plane derives
    #                 from each replica's /metrics (queue, running, KV cache);
    #  orca           client_side_weighted_round_robin on ORCA load reports the
    #                 engine returns in the endpoint-load-metrics response header.
    load_balancing: Literal["least_request", "weighted", "orca"] = "weighted"
    # How least-request picks among equally weighted replicas: full_scan takes the
    # replica with the fewest requests in flight (ties at random); two_choices is
    # Envoy's default (the better of two random picks), which with two replicas sends
    # the busier one a quarter of the traffic whatever its load. A model has few
    # replicas, so the scan is cheap.
    least_request_pick: Literal["full_scan", "two_choices"] = "full_scan"
    # With unequal weights Envoy schedules by weight / (in flight + 1) ** bias; a
    # higher bias keeps in-flight counts level while weights still tilt the share.
    active_request_bias: float = Field(2.0, ge=0, le=10)
    # ORCA (load_balancing: orca): a replica must report this long before its weight
    # is used, reports older than the expiry are dropped, weights recomputed this often.
    orca_blackout_s: float = Field(1.0, ge=0)
    orca_weight_expiration_s: float = Field(30.0, gt=0)
    orca_weight_update_s: float = Field(0.5, ge=0.1)
    # Session affinity: requests carrying this header hash (Maglev) to one replica, so
    # a conversation reuses its prefix cache; requests without it are load-balanced.
    session_header: str | None = Field(None, pattern=r"^[a-z0-9-]{1,64}$")


class Autoscale(_Frozen):
    """Scale a model between min_replicas and max_replicas from its engines' load.

    Up one replica when the average queue per serving replica stays at or above
    `up_waiting_per_replica` (or KV-cache usage at or above `up_kv_usage`) for
    `up_after_s`; down one when requests running plus waiting per replica stay at or
    below `down_load_per_replica` for `down_after_s` (the replica is drained first).
    After any decision nothing changes for `cooldown_s`.
    """

    up_waiting_per_replica: float = Field(1.0, gt=0)
    up_kv_usage: float = Field(0.9, gt=0, le=1)
    up_after_s: float = Field(10.0, ge=0)
    down_load_per_replica: float = Field(0.5, ge=0)
    down_after_s: float = Field(60.0, ge=0)
    cooldown_s: float = Field(30.0, ge=0)


ENGINES = ("vllm", "sglang", "llamacpp", "sim")


class Profile(_Frozen):
    """How to run one replica: engine, weights, arguments and the GPUs it needs.

    A model lists profiles in order of preference; placement uses the first that fits
    a node (e.g. one H100, else two A100s).
    """

    name: str = "default"
    engine: str = "vllm"
    model_path: str = ""
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    gpus: int = Field(1, ge=0, le=64)
    # Minimum memory of each GPU, in MiB; 0: any.
    gpu_memory_mb: int = Field(0, ge=0)
    # Substring of the GPU product name every GPU must have ("H100"); None: any.
    gpu_model: str | None = None
    # Higher places first when GPUs are short.
    priority: int = 0

    @field_validator("engine")
    @classmethod
    def _engine_ok(cls, v: str) -> str:
        if v not in ENGINES:
            raise ValueError(f"unknown engine {v!r} (one of {', '.join(ENGINES)})")
        return v

    @model_validator(mode="after")
    def _path(self) -> Profile:
        if self.engine != "sim" and not self.model_path:
            raise ValueError(f"engine {self.engine} needs model_path")
        return self

    @property
    def hash(self) -> str:
        """Identity of what a replica runs: a change means the replica is replaced."""
        doc = self.model_dump(mode="json", exclude={"priority", "name"})
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]


class Model(_Frozen):
    """One servable model: names, replica bounds, where and how it runs, routing."""

    name: str
    aliases: tuple[str, ...] = ()
    routing: Routing = Routing()
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=0)
    # Node labels a node must carry (all of them) to run this model.
    pool: dict[str, str] = Field(default_factory=dict)
    profiles: tuple[Profile, ...] = (Profile(engine="sim"),)
    # Seconds a draining replica gets to finish in-flight requests before it stops.
    drain_timeout_s: float = Field(120.0, ge=0)
    # Load-driven replica count within [min_replicas, max_replicas]; None: fixed.
    autoscale: Autoscale | None = None

    @property
    def priority(self) -> int:
        return max((p.priority for p in self.profiles), default=0)

    @property
    def profile_hashes(self) -> frozenset[str]:
        return frozenset(p.hash for p in self.profiles)

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"invalid model name {v!r}")
        return v

    @field_validator("aliases")
    @classmethod
    def _aliases_ok(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for a in v:
            if not _NAME_RE.match(a):
                raise ValueError(f"invalid alias {a!r}")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> Model:
        if not self.profiles:
            raise ValueError("at least one profile is required")
        names = [p.name for p in self.profiles]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate profile names {names}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})"
            )
        return self

    @property
    def names(self) -> tuple[str, ...]:
        """The name followed by every alias: each routes to this model."""
        return (self.name, *self.aliases)


class Listener(_Frozen):
    """Where Envoy accepts client traffic."""

    address: str = "127.0.0.1"
    port: int = Field(10000, ge=1, le=65535)
    # Largest request (prompt) Envoy buffers to read the body's "model"; a larger
    # one gets a 413 JSON error. Envoy's default of 1 MiB is too small for prompts.
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=64 * 1024, le=1024 * 1024 * 1024)


class Catalog(_Frozen):
    """The whole catalog: models plus the gateway listener."""

    listener: Listener = Listener()
    models: tuple[Model, ...] = ()

    @model_validator(mode="after")
    def _unique(self) -> Catalog:
        seen: dict[str, str] = {}
        for m in self.models:
            for n in m.names:
                if n in seen:
                    raise ValueError(
                        f"name {n!r} of model {m.name!r} is already used by model {seen[n]!r}"
                    )
                seen[n] = m.name
        return self

    def model(self, name: str) -> Model | None:
        for m in self.models:
            if m.name == name:
                return m
        return None


def parse_catalog(text: str, source: str = "<catalog>") -> Catalog:
    """Parse catalog YAML; raise CatalogError naming the source, model and field."""
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise CatalogError(f"{source}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise CatalogError(f"{source}: top level must be a mapping, got {type(raw).__name__}")
    try:
        return Catalog.model_validate(raw)
    except ValidationError as e:
        raise CatalogError(_describe(source, raw, e)) from e


def load_catalog(path: str | Path) -> Catalog:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise CatalogError(f"{p}: cannot read: {e.strerror}") from e
    return parse_catalog(text, str(p))


def _describe(source: str, raw: dict[str, object], err: ValidationError) -> str:
    lines = [f"{source}: invalid catalog"]
    models = raw.get("models")
    for e in err.errors():
        loc = list(e["loc"])
        where = ".".join(str(x) for x in loc) or "(top level)"
        # Name the model by its name rather than its list index when we can.
        if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
            name = None
            if isinstance(models, list) and loc[1] < len(models):
                entry = models[loc[1]]
                if isinstance(entry, dict):
                    name = entry.get("name")
            field = ".".join(str(x) for x in loc[2:]) or "(model)"
            where = f"model {name!r} (models[{loc[1]}]) field {field}"
        lines.append(f"  {where}: {e['msg']}")
    return "\n".join(lines)
