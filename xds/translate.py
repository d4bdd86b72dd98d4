"""Pure translation: (catalog, Ready endpoints) -> Envoy resources.

Owns every Envoy setting llmgw publishes: one EDS cluster per model, its load
assignment, the listener with body-based model routing, and the route table with
OpenAI-style errors. Functions here do no I/O and keep no state: the same input gives
byte-identical output. A cluster depends only on model-level settings, never on its
endpoints, so an endpoint change is an EDS-only update and Envoy keeps host state.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from datetime import timedelta

import envoy_data_plane.envoy.config.accesslog.v3 as accesslog
import envoy_data_plane.envoy.config.cluster.v3 as cluster
import envoy_data_plane.envoy.config.core.v3 as core
import envoy_data_plane.envoy.config.endpoint.v3 as endpoint
import envoy_data_plane.envoy.config.listener.v3 as listener
import envoy_data_plane.envoy.config.route.v3 as route
import envoy_data_plane.envoy.extensions.filters.http.json_to_metadata.v3 as j2m
import envoy_data_plane.envoy.extensions.filters.http.router.v3 as router
import envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 as hcm
import envoy_data_plane.envoy.extensions.retry.host.previous_hosts.v3 as previous_hosts
import envoy_data_plane.envoy.type.matcher.v3 as matcher
import envoy_data_plane.envoy.type.v3 as type_v3
from envoy_data_plane.envoy.extensions.load_balancing_policies.client_side_weighted_round_robin.v3 import (  # noqa: E501
    ClientSideWeightedRoundRobin,
)
from envoy_data_plane.envoy.extensions.load_balancing_policies.least_request.v3 import (
    LeastRequest,
    LeastRequestSelectionMethod,
)
from envoy_data_plane.google.protobuf import Any, ListValue, Struct, Value

from controlplane.catalog import Catalog, Model
from controlplane.endpoints import Endpoint

LISTENER_NAME = "llmgw"
ROUTE_CONFIG_NAME = "llmgw"
METADATA_NAMESPACE = "llmgw"
METADATA_KEY = "model"
# Values json_to_metadata writes when the body has no "model" or is not JSON.
# Neither can be a model name (names start with an alphanumeric character).
MISSING_MODEL = "__missing__"
INVALID_BODY = "__invalid__"

MAX_MODELS_LIST_BYTES = 4 * 1024 * 1024
# ORCA: the request header that asks an engine (vLLM) for a load report, and the
# response header that carries it (stripped before the client sees it).
ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"
ORCA_REPORT_HEADER = "endpoint-load-metrics"
# Named ORCA metrics that count as utilization when a report has no
# application_utilization (vLLM reports these two).
ORCA_UTILIZATION_METRICS = ("named_metrics.kv_cache_usage_perc",)
AFFINITY_SUFFIX = "-session"
_ADS = core.ConfigSource(ads=core.AggregatedConfigSource(), resource_api_version=core.ApiVersion.V3)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def cluster_name(model_name: str) -> str:
    """Envoy cluster (and EDS service) name for a model.

    Model names may hold '/' or ':', which make awkward stat names; those are
    replaced, and a short hash keeps two such names from colliding.
    """
    safe = _UNSAFE.sub("_", model_name)
    if safe != model_name:
        safe += "-" + hashlib.sha256(model_name.encode()).hexdigest()[:8]
    return f"model-{safe}"


def affinity_cluster_name(model_name: str) -> str:
    """The model's second cluster for requests with a session header (Maglev)."""
    return cluster_name(model_name) + AFFINITY_SUFFIX


def cluster_names(model: Model) -> tuple[str, ...]:
    """Every cluster of a model: the load-balanced one, and the session one if any."""
    if model.routing.session_header:
        return (cluster_name(model.name), affinity_cluster_name(model.name))
    return (cluster_name(model.name),)


def _s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def _value(v: object) -> Value:
    if isinstance(v, str):
        return Value(string_value=v)
    if isinstance(v, bool):
        return Value(bool_value=v)
    if isinstance(v, int | float):
        return Value(number_value=float(v))
    if isinstance(v, Mapping):
        return Value(struct_value=_struct(v))
    if isinstance(v, list | tuple):
        return Value(list_value=ListValue(values=[_value(x) for x in v]))
    raise TypeError(f"cannot encode {type(v).__name__} in a Struct")


def _struct(d: Mapping[str, object]) -> Struct:
    return Struct(fields={k: _value(v) for k, v in d.items()})


def openai_error(message: str, type_: str, code: str) -> core.SubstitutionFormatString:
    """An OpenAI-style error body; Envoy command operators (%...%) expand in message."""
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    # Struct cannot hold None through _value; JSON null is written explicitly.
    fmt = _struct({"error": {k: v for k, v in body["error"].items() if v is not None}})
    err = fmt.fields["error"].struct_value
    assert err is not None
    err.fields["param"] = Value(null_value=0)  # type: ignore[arg-type]
    return core.SubstitutionFormatString(json_format=fmt, content_type="application/json")


# --------------------------------------------------------------------------- clusters


def _policy(name: str, cfg: object) -> cluster.LoadBalancingPolicy:
    return cluster.LoadBalancingPolicy(policies=[cluster.LoadBalancingPolicyPolicy(
        typed_extension_config=core.TypedExtensionConfig(
            name=name, typed_config=Any.pack(cfg)))])  # type: ignore[arg-type]


def _least_request_policy(model: Model) -> cluster.LoadBalancingPolicy:
    method = (LeastRequestSelectionMethod.FULL_SCAN
              if model.routing.least_request_pick == "full_scan"
              else LeastRequestSelectionMethod.N_CHOICES)
    bias = core.RuntimeDouble(default_value=model.routing.active_request_bias,
                              runtime_key="llmgw.active_request_bias")
    return _policy("envoy.load_balancing_policies.least_request",
                   LeastRequest(selection_method=method, active_request_bias=bias))


def _orca_policy(model: Model) -> cluster.LoadBalancingPolicy:
    r = model.routing
    cfg = ClientSideWeightedRoundRobin(
        blackout_period=_s(r.orca_blackout_s),
        weight_expiration_period=_s(r.orca_weight_expiration_s),
        weight_update_period=_s(r.orca_weight_update_s),
        metric_names_for_computing_utilization=list(ORCA_UTILIZATION_METRICS),
    )
    return _policy("envoy.load_balancing_policies.client_side_weighted_round_robin", cfg)


def build_clusters(model: Model) -> list[cluster.Cluster]:
    """Every cluster of a model, in the order of `cluster_names`."""
    out = [build_cluster(model)]
    if model.routing.session_header:
        out.append(build_cluster(model, affinity=True))
    return out


def build_cluster(model: Model, affinity: bool = False) -> cluster.Cluster:
    """The model's cluster. Depends on model-level settings only, never on endpoints.

    `affinity`: the session cluster, Maglev over the same replicas (consistent
    hashing moves only the sessions of a replica that leaves).
    """
    r = model.routing
    name = affinity_cluster_name(model.name) if affinity else cluster_name(model.name)
    policy: dict[str, object] = {}
    if affinity:
        policy["lb_policy"] = cluster.ClusterLbPolicy.MAGLEV
    elif r.load_balancing == "orca":
        policy["load_balancing_policy"] = _orca_policy(model)
    else:
        policy["load_balancing_policy"] = _least_request_policy(model)
    return cluster.Cluster(
        name=name,
        type=cluster.ClusterDiscoveryType.EDS,
        eds_cluster_config=cluster.ClusterEdsClusterConfig(eds_config=_ADS, service_name=name),
        connect_timeout=_s(r.connect_timeout_s),
        **policy,  # type: ignore[arg-type]
        # With the default 50% panic threshold a cluster whose only host is DRAINING or
        # ejected still gets traffic; at 0 Envoy answers 503 (UH) instead.
        common_lb_config=cluster.ClusterCommonLbConfig(
            healthy_panic_threshold=type_v3.Percent(value=0.0),
            # Envoy batches health-only changes for 1 s by default before workers see
            # them: a new replica would answer 503 for up to a second after it passed
            # its first check, and a dead one keep traffic as long (measured).
            update_merge_window=_s(0),
        ),
        outlier_detection=cluster.OutlierDetection(
            consecutive_5xx=r.outlier_consecutive_5xx,
            consecutive_gateway_failure=r.outlier_consecutive_gateway_failure,
            enforcing_consecutive_5xx=100,
            enforcing_consecutive_gateway_failure=100,
            interval=_s(r.outlier_interval_s),
            base_ejection_time=_s(r.outlier_base_ejection_s),
            max_ejection_percent=r.outlier_max_ejection_percent,
            # Envoy's default lets one passing /health check un-eject a host, but an
            # engine can pass /health while failing requests: the ejection must last.
            successful_active_health_check_uneject_host=False,
        ),
        health_checks=[
            core.HealthCheck(
                timeout=_s(r.health_check_timeout_s),
                interval=_s(r.health_check_interval_s),
                # Default no-traffic interval is 60 s: an idle model would notice a
                # dead engine only after a minute.
                no_traffic_interval=_s(r.health_check_interval_s),
                unhealthy_threshold=r.health_check_unhealthy_threshold,
                healthy_threshold=r.health_check_healthy_threshold,
                http_health_check=core.HealthCheckHttpHealthCheck(path=r.health_check_path),
            )
        ],
        circuit_breakers=cluster.CircuitBreakers(
            thresholds=[
                cluster.CircuitBreakersThresholds(
                    max_connections=r.max_connections,
                    max_pending_requests=r.max_pending_requests,
                    max_requests=r.max_requests,
                    max_retries=r.max_retries,
                )
            ]
        ),
        track_cluster_stats=cluster.TrackClusterStats(per_endpoint_stats=True),
        # With health checks on, Envoy otherwise keeps a host removed from EDS for as
        # long as it passes them: a fenced or stopped replica would keep traffic.
        ignore_health_on_host_removal=True,
    )


def build_load_assignment(
    name: str, endpoints: Iterable[Endpoint]
) -> endpoint.ClusterLoadAssignment:
    """The cluster's endpoints, sorted; draining ones go out as DRAINING.

    The session cluster gets no load weights: a weight change would rebuild its
    Maglev table and move sessions that have no reason to move.
    """
    weighted = not name.endswith(AFFINITY_SUFFIX)
    lb: list[endpoint.LbEndpoint] = []
    for ep in sorted(endpoints, key=lambda e: (e.host, e.port, e.replica_id)):
        lb.append(
            endpoint.LbEndpoint(
                endpoint=endpoint.Endpoint(
                    address=core.Address(
                        socket_address=core.SocketAddress(address=ep.host, port_value=ep.port)
                    )
                ),
                health_status=(
                    core.HealthStatus.DRAINING if ep.draining else core.HealthStatus.UNKNOWN
                ),
                load_balancing_weight=ep.weight if weighted else None,
            )
        )
    localities = [endpoint.LocalityLbEndpoints(lb_endpoints=lb)] if lb else []
    return endpoint.ClusterLoadAssignment(cluster_name=name, endpoints=localities)


# --------------------------------------------------------------------------- listener


def _error_mapper(flags: list[str], status: int, message: str, code: str) -> hcm.ResponseMapper:
    return hcm.ResponseMapper(
        filter=accesslog.AccessLogFilter(
            response_flag_filter=accesslog.ResponseFlagFilter(flags=flags)
        ),
        status_code=status,
        body_format_override=openai_error(message, "server_error", code),
    )


def _local_reply_config() -> hcm.LocalReplyConfig:
    """Envoy's own replies (no upstream, overflow, timeouts, 413) as OpenAI JSON."""
    model = f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{METADATA_KEY})%"
    too_large = hcm.ResponseMapper(
        filter=accesslog.AccessLogFilter(
            status_code_filter=accesslog.StatusCodeFilter(
                comparison=accesslog.ComparisonFilter(
                    op=accesslog.ComparisonFilterOp.EQ,
                    # A RuntimeUInt32 here needs a non-empty runtime key.
                    value=core.RuntimeUInt32(default_value=413, runtime_key="llmgw.status_413"),
                )
            )
        ),
        body_format_override=openai_error(
            "Request body too large for the gateway", "invalid_request_error", "request_too_large"
        ),
    )
    return hcm.LocalReplyConfig(
        mappers=[
            _error_mapper(
                ["UH"], 503, f"No healthy replica of model '{model}' is available",
                "no_healthy_upstream",
            ),
            _error_mapper(
                ["UF", "URX", "UC"], 503, f"Replicas of model '{model}' could not be reached",
                "upstream_unavailable",
            ),
            _error_mapper(
                ["UO"], 503, f"Model '{model}' is over its concurrency limit", "overloaded"
            ),
            _error_mapper(["UT", "SI"], 504, f"Model '{model}' timed out", "timeout"),
            _error_mapper(["NR"], 404, "No route for this request", "not_found"),
            too_large,
        ]
    )


def build_listener(catalog: Catalog) -> listener.Listener:
    lc = catalog.listener
    j2m_cfg = j2m.JsonToMetadata(
        request_rules=j2m.JsonToMetadataMatchRules(
            rules=[
                j2m.JsonToMetadataRule(
                    selectors=[j2m.JsonToMetadataSelector(key=METADATA_KEY)],
                    on_present=j2m.JsonToMetadataKeyValuePair(
                        metadata_namespace=METADATA_NAMESPACE,
                        key=METADATA_KEY,
                        type=j2m.JsonToMetadataValueType.STRING,
                    ),
                    on_missing=j2m.JsonToMetadataKeyValuePair(
                        metadata_namespace=METADATA_NAMESPACE,
                        key=METADATA_KEY,
                        value=Value(string_value=MISSING_MODEL),
                        type=j2m.JsonToMetadataValueType.STRING,
                    ),
                    on_error=j2m.JsonToMetadataKeyValuePair(
                        metadata_namespace=METADATA_NAMESPACE,
                        key=METADATA_KEY,
                        value=Value(string_value=INVALID_BODY),
                        type=j2m.JsonToMetadataValueType.STRING,
                    ),
                )
            ],
            allow_empty_content_type=True,
            # Without a regex, "application/json; charset=utf-8" counts as an error.
            allow_content_types_regex=matcher.RegexMatcher(regex=r"application/json(;.*)?"),
        )
    )
    manager = hcm.HttpConnectionManager(
        stat_prefix="llmgw",
        codec_type=hcm.HttpConnectionManagerCodecType.AUTO,
        rds=hcm.Rds(config_source=_ADS, route_config_name=ROUTE_CONFIG_NAME),
        http_filters=[
            hcm.HttpFilter(
                name="envoy.filters.http.json_to_metadata", typed_config=Any.pack(j2m_cfg)
            ),
            hcm.HttpFilter(
                name="envoy.filters.http.router", typed_config=Any.pack(router.Router())
            ),
        ],
        local_reply_config=_local_reply_config(),
        # Requests are bounded by stream idle time only: generations can be long.
        stream_idle_timeout=_s(300),
        request_timeout=_s(0),
    )
    return listener.Listener(
        name=LISTENER_NAME,
        address=core.Address(
            socket_address=core.SocketAddress(address=lc.address, port_value=lc.port)
        ),
        # With reuse_port a second Envoy on the same port silently shares it.
        enable_reuse_port=False,
        per_connection_buffer_limit_bytes=lc.max_request_bytes,
        filter_chains=[
            listener.FilterChain(
                filters=[
                    listener.Filter(
                        name="envoy.filters.network.http_connection_manager",
                        typed_config=Any.pack(manager),
                    )
                ]
            )
        ],
    )


# --------------------------------------------------------------------------- routes


def _model_match(value: str, header: str | None = None) -> route.RouteMatch:
    return route.RouteMatch(
        prefix="/v1/",
        headers=[route.HeaderMatcher(name=header, present_match=True)] if header else [],
        dynamic_metadata=[
            matcher.MetadataMatcher(
                filter=METADATA_NAMESPACE,
                path=[matcher.MetadataMatcherPathSegment(key=METADATA_KEY)],
                value=matcher.ValueMatcher(string_match=matcher.StringMatcher(exact=value)),
            )
        ],
    )


def _json_direct(status: int, fmt: core.SubstitutionFormatString) -> route.DirectResponseAction:
    return route.DirectResponseAction(status=status, body_format=fmt)


def models_list_body(catalog: Catalog) -> str:
    """GET /v1/models as OpenAI lists it: every name and alias, sorted."""
    data = []
    for m in sorted(catalog.models, key=lambda m: m.name):
        for n in m.names:
            data.append({"id": n, "object": "model", "owned_by": "llmgw", "root": m.name})
    return json.dumps({"object": "list", "data": data}, separators=(",", ":"))


def _orca_headers(m: Model) -> dict[str, object]:
    """ORCA models: ask the engine for a load report, keep it from the client."""
    if m.routing.load_balancing != "orca":
        return {}
    return {
        "request_headers_to_add": [core.HeaderValueOption(
            header=core.HeaderValue(key=ORCA_FORMAT_HEADER, value="TEXT"),
            append_action=core.HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD)],
        "response_headers_to_remove": [ORCA_REPORT_HEADER],
    }


def _model_action(m: Model, cluster: str) -> route.RouteAction:
    r = m.routing
    retry_on = "connect-failure,refused-stream,reset"
    if r.retry_on_503:
        retry_on += ",retriable-status-codes"
    return route.RouteAction(
        cluster=cluster,
        # 0 disables the whole-request timeout: a long stream is never cut.
        timeout=_s(0),
        idle_timeout=_s(r.stream_idle_timeout_s),
        retry_policy=route.RetryPolicy(
            retry_on=retry_on,
            num_retries=r.num_retries,
            retriable_status_codes=[503] if r.retry_on_503 else [],
            per_try_idle_timeout=_s(r.per_try_idle_timeout_s),
            retry_host_predicate=[
                route.RetryPolicyRetryHostPredicate(
                    name="envoy.retry_host_predicates.previous_hosts",
                    typed_config=Any.pack(previous_hosts.PreviousHostsPredicate()),
                )
            ],
            host_selection_retry_max_attempts=5,
        ),
    )


def build_routes(catalog: Catalog) -> route.RouteConfiguration:
    routes: list[route.Route] = [
        route.Route(
            name="models-list",
            match=route.RouteMatch(path="/v1/models"),
            direct_response=route.DirectResponseAction(
                status=200, body=core.DataSource(inline_string=models_list_body(catalog))
            ),
            response_headers_to_add=[
                core.HeaderValueOption(
                    header=core.HeaderValue(key="content-type", value="application/json"),
                    append_action=core.HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
                )
            ],
        )
    ]
    for m in sorted(catalog.models, key=lambda m: m.name):
        action = _model_action(m, cluster_name(m.name))
        session = m.routing.session_header
        if session:
            sticky = _model_action(m, affinity_cluster_name(m.name))
            sticky.hash_policy = [route.RouteActionHashPolicy(
                header=route.RouteActionHashPolicyHeader(header_name=session))]
        for n in m.names:
            if session:
                # Requests with the session header hash to one replica; the route
                # comes first so it wins over the load-balanced one.
                routes.append(route.Route(name=f"model:{n}:session",
                                          match=_model_match(n, session), route=sticky))
            routes.append(route.Route(name=f"model:{n}", match=_model_match(n), route=action,
                                      **_orca_headers(m)))  # type: ignore[arg-type]
    routes += [
        route.Route(
            name="missing-model",
            match=_model_match(MISSING_MODEL),
            direct_response=_json_direct(
                400,
                openai_error(
                    "The request body must be a JSON object with a 'model' field",
                    "invalid_request_error",
                    "missing_model",
                ),
            ),
        ),
        route.Route(
            name="invalid-body",
            match=_model_match(INVALID_BODY),
            direct_response=_json_direct(
                400,
                # json_to_metadata refuses both: a hint saves a `curl -d` user a search.
                openai_error(
                    "The request body is not valid JSON, or was not sent with "
                    "content-type: application/json",
                    "invalid_request_error", "invalid_json",
                ),
            ),
        ),
        route.Route(
            name="unknown-model",
            match=route.RouteMatch(prefix="/v1/"),
            direct_response=_json_direct(
                404,
                openai_error(
                    f"The model '%DYNAMIC_METADATA({METADATA_NAMESPACE}:{METADATA_KEY})%' "
                    "does not exist",
                    "invalid_request_error",
                    "model_not_found",
                ),
            ),
        ),
        route.Route(
            name="unknown-path",
            match=route.RouteMatch(prefix="/"),
            direct_response=_json_direct(
                404,
                openai_error(
                    "Unknown path '%REQ(:PATH)%'", "invalid_request_error", "unknown_url"
                ),
            ),
        ),
    ]
    return route.RouteConfiguration(
        name=ROUTE_CONFIG_NAME,
        # Envoy's default cap of 4 KiB on direct responses is too small for the
        # /v1/models list of a large catalog (seen NACKed at 100 models).
        max_direct_response_body_size_bytes=MAX_MODELS_LIST_BYTES,
        virtual_hosts=[route.VirtualHost(name="llmgw", domains=["*"], routes=routes)],
    )
