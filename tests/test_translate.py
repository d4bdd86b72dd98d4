"""The pure parts: catalog validation, translation and snapshot consistency."""

from __future__ import annotations

import pytest
from envoy_data_plane.envoy.config.cluster.v3 import Cluster, ClusterLbPolicy
from envoy_data_plane.envoy.config.core.v3 import HealthStatus
from envoy_data_plane.envoy.config.endpoint.v3 import ClusterLoadAssignment
from envoy_data_plane.envoy.extensions.load_balancing_policies.least_request.v3 import (
    LeastRequest,
    LeastRequestSelectionMethod,
)

from controlplane.catalog import Catalog, CatalogError, Model, Routing, parse_catalog
from controlplane.endpoints import Endpoint
from xds.snapshot import (
    CLUSTER,
    ENDPOINT,
    ROUTE,
    InconsistentSnapshot,
    Resource,
    build_snapshot,
    make_snapshot,
)
from xds.translate import (
    affinity_cluster_name,
    build_cluster,
    build_clusters,
    build_load_assignment,
    build_routes,
    cluster_name,
)

CAT = """
models:
  - name: model-a
    aliases: [a, alpha]
  - name: org/model-b:q4
"""


def test_catalog_errors_name_file_model_and_field() -> None:
    with pytest.raises(CatalogError) as e:
        parse_catalog("models:\n  - name: x\n    routing: {num_retries: -1}\n", "cat.yaml")
    msg = str(e.value)
    assert "cat.yaml" in msg and "model 'x'" in msg and "routing.num_retries" in msg


def test_catalog_refuses_duplicate_names_and_aliases() -> None:
    with pytest.raises(CatalogError, match="already used by model 'a'"):
        parse_catalog("models:\n  - {name: a, aliases: [x]}\n  - {name: b, aliases: [x]}\n")
    with pytest.raises(CatalogError, match="not valid YAML"):
        parse_catalog("models: [", "bad.yaml")
    with pytest.raises(CatalogError, match="unknown_field"):
        parse_catalog("models:\n  - {name: a, unknown_field: 1}\n")


def test_cluster_names_are_safe_and_distinct() -> None:
    assert cluster_name("model-a") == "model-model-a"
    a, b = cluster_name("org/m"), cluster_name("org_m")
    assert a != b and "/" not in a


def test_translation_is_deterministic_and_cluster_ignores_endpoints() -> None:
    cat = parse_catalog(CAT)
    one = build_snapshot(cat, [Endpoint("model-a", "127.0.0.1", 1)])
    two = build_snapshot(cat, [Endpoint("model-a", "127.0.0.1", 2),
                               Endpoint("model-a", "127.0.0.1", 3, draining=True)])
    again = build_snapshot(cat, [Endpoint("model-a", "127.0.0.1", 1)])
    assert dict(one.versions) == dict(again.versions)
    for t in one.resources:
        for n, r in one.of_type(t).items():
            assert again.of_type(t)[n].body == r.body
    # Endpoints changed: only the endpoint type's version moves.
    diff = {t for t in one.versions if one.versions[t] != two.versions[t]}
    assert diff == {ENDPOINT}
    cla = ClusterLoadAssignment.parse(two.of_type(ENDPOINT)[cluster_name("model-a")].body)
    statuses = [lb.health_status for lb in cla.endpoints[0].lb_endpoints]
    assert statuses == [HealthStatus.UNKNOWN, HealthStatus.DRAINING]


def test_orca_and_session_clusters() -> None:
    m = Model(name="m", routing=Routing(load_balancing="orca", session_header="x-session-id"))
    main, session = (Cluster.parse(bytes(c)) for c in build_clusters(m))
    assert main.load_balancing_policy is not None
    ext = main.load_balancing_policy.policies[0].typed_extension_config
    assert ext is not None and ext.name.endswith("client_side_weighted_round_robin")
    assert session.name == affinity_cluster_name("m")
    assert session.lb_policy == ClusterLbPolicy.MAGLEV
    rc = build_routes(Catalog(models=(m,)))
    routes = {r.name: r for r in rc.virtual_hosts[0].routes}
    sticky, plain = routes["model:m:session"], routes["model:m"]
    assert sticky.route is not None and sticky.route.cluster == session.name
    assert sticky.route.hash_policy[0].header is not None
    assert sticky.route.hash_policy[0].header.header_name == "x-session-id"
    assert [r.name for r in rc.virtual_hosts[0].routes].index("model:m:session") < \
        [r.name for r in rc.virtual_hosts[0].routes].index("model:m")
    # ORCA: the engine is asked for its report, the client never sees it.
    assert plain.request_headers_to_add[0].header is not None
    assert plain.request_headers_to_add[0].header.key == "endpoint-load-metrics-format"
    assert plain.response_headers_to_remove == ["endpoint-load-metrics"]
    # The session cluster's assignment carries no load weights.
    eps = [Endpoint("m", "127.0.0.1", 1, weight=7)]
    assert build_load_assignment(session.name, eps).endpoints[0].lb_endpoints[0] \
        .load_balancing_weight is None
    assert build_load_assignment(main.name, eps).endpoints[0].lb_endpoints[0] \
        .load_balancing_weight == 7


def test_cluster_settings() -> None:
    cat = parse_catalog(CAT)
    c = Cluster.parse(bytes(build_cluster(cat.models[0])))
    # Least-request over every replica, through the typed policy (the enum cannot
    # say "full scan").
    assert c.load_balancing_policy is not None
    ext = c.load_balancing_policy.policies[0].typed_extension_config
    assert ext is not None and ext.name == "envoy.load_balancing_policies.least_request"
    assert ext.typed_config is not None
    lr = LeastRequest.parse(ext.typed_config.value)
    assert lr.selection_method == LeastRequestSelectionMethod.FULL_SCAN
    assert lr.active_request_bias is not None and lr.active_request_bias.default_value == 2.0
    assert c.outlier_detection is not None and c.outlier_detection.consecutive_5xx == 3
    assert c.health_checks[0].http_health_check is not None
    assert c.health_checks[0].http_health_check.path == "/health"
    assert c.circuit_breakers is not None and c.circuit_breakers.thresholds[0].max_requests
    assert c.common_lb_config is not None
    assert c.common_lb_config.healthy_panic_threshold is not None
    assert c.common_lb_config.healthy_panic_threshold.value == 0.0
    assert c.load_assignment is None  # endpoints travel alone, over EDS


def test_with_endpoints_touches_one_assignment() -> None:
    cat = parse_catalog(CAT)
    snap = build_snapshot(cat, [])
    nxt = snap.with_endpoints("model-a", [Endpoint("model-a", "127.0.0.1", 9)])
    changed = [n for n, r in nxt.of_type(ENDPOINT).items()
               if snap.of_type(ENDPOINT)[n].version != r.version]
    assert changed == [cluster_name("model-a")]
    assert nxt.of_type(CLUSTER) == snap.of_type(CLUSTER)
    with pytest.raises(InconsistentSnapshot):
        snap.with_endpoints("not-in-catalog", [])


def test_inconsistent_snapshots_are_refused() -> None:
    cat = parse_catalog(CAT)
    snap = build_snapshot(cat, [])
    res = {t: dict(snap.of_type(t)) for t in snap.resources}
    # A route naming a cluster that does not exist.
    with pytest.raises(InconsistentSnapshot, match="unknown clusters"):
        make_snapshot(res, cat, {"llmgw": frozenset({"model-ghost"})})
    # A cluster without its endpoints resource.
    no_eds = {**res, ENDPOINT: {}}
    with pytest.raises(InconsistentSnapshot, match="without endpoints"):
        make_snapshot(no_eds, cat, dict(snap.route_clusters))
    # A listener whose route config is missing.
    no_rds = {**res, ROUTE: {}}
    with pytest.raises(InconsistentSnapshot, match="route config"):
        make_snapshot(no_rds, cat, {})
    # Orphan endpoints.
    orphan = {**res, ENDPOINT: {**res[ENDPOINT], "model-x": Resource(ENDPOINT, "model-x", b"",
                                                                       "v")}}
    with pytest.raises(InconsistentSnapshot, match="unknown clusters"):
        make_snapshot(orphan, cat, dict(snap.route_clusters))


def test_models_list_has_names_and_aliases() -> None:
    import json

    from xds.translate import models_list_body

    body = json.loads(models_list_body(parse_catalog(CAT)))
    assert [d["id"] for d in body["data"]] == ["model-a", "a", "alpha", "org/model-b:q4"]


def test_catalog_change_reuses_unchanged_resources_and_matches_a_full_build() -> None:
    cat = parse_catalog(CAT)
    eps = [Endpoint("model-a", "127.0.0.1", 1), Endpoint("org/model-b:q4", "127.0.0.1", 2)]
    snap = build_snapshot(cat, eps)
    changed = parse_catalog(CAT.replace("[a, alpha]", "[a, alpha, al]").replace(
        "  - name: org/model-b:q4", "  - name: org/model-b:q4\n    routing: {num_retries: 5}"))
    fast = build_snapshot(changed, eps, same_endpoints_as=snap)
    full = build_snapshot(changed, eps)
    assert dict(fast.versions) == dict(full.versions)
    for t in full.resources:
        assert {n: r.body for n, r in fast.of_type(t).items()} == {
            n: r.body for n, r in full.of_type(t).items()}
    a = cluster_name("model-a")
    assert fast.of_type(CLUSTER)[a] is snap.of_type(CLUSTER)[a]  # reused, not rebuilt
