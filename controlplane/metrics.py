"""Control-plane metrics for Prometheus, read from immutable views at scrape time.

Owns the fleet gauges (nodes by state, replicas by model and state, GPUs used and free),
the engine-load gauges (each replica's polled load and published weight), and the
counters of the reconciler, the load poller, the weights and the autoscaler. One
collector serves every control plane in the process (tests run several), so metric
names are registered once.
"""

from __future__ import annotations

import weakref
from collections import Counter as Tally
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from controlplane.runtime import ControlPlane

RECONCILER_ACTIONS = Counter("llmgw_reconciler_actions", "Actions the reconciler took",
                             ["action", "model"])
CATALOG_RELOADS = Counter("llmgw_catalog_reloads", "Catalog file reloads", ["result"])
LOAD_SCRAPES = Counter("llmgw_load_scrapes", "Engine /metrics scrapes by the load poller",
                       ["model", "result"])
WEIGHT_UPDATES = Counter("llmgw_load_weight_updates",
                         "Load-weight updates sent to Envoy (endpoint-only)", ["model"])
AUTOSCALE_DECISIONS = Counter("llmgw_autoscale_decisions", "Autoscaler decisions",
                              ["model", "direction"])

_planes: weakref.WeakSet[ControlPlane] = weakref.WeakSet()


class _FleetCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        nodes = GaugeMetricFamily("llmgw_nodes", "Nodes by lifecycle state", labels=["state"])
        replicas = GaugeMetricFamily("llmgw_replicas", "Replicas by model and state",
                                     labels=["model", "state"])
        gpus = GaugeMetricFamily("llmgw_gpus", "GPUs by node and use", labels=["node", "use"])
        endpoints = GaugeMetricFamily("llmgw_published_endpoints",
                                      "Endpoints published to Envoy per model", labels=["model"])
        load = GaugeMetricFamily("llmgw_replica_load",
                                 "Last polled engine load (running, waiting, kv_usage)",
                                 labels=["model", "replica", "measure"])
        weights = GaugeMetricFamily("llmgw_load_weight",
                                    "Load weight published to Envoy (absent: equal weights)",
                                    labels=["model", "replica"])
        node_states: Tally[str] = Tally()
        rep: Tally[tuple[str, str]] = Tally()
        for cp in list(_planes):
            view = cp.inventory.view()
            for n in view.nodes:
                node_states[str(n.state)] += 1
                used = len(n.used_gpus)
                gpus.add_metric([n.name, "used"], used)
                gpus.add_metric([n.name, "free"], len(n.gpus) - used)
                for r in n.replicas:
                    rep[(r.model, str(r.state))] += 1
            for model, eps in cp.publisher.endpoints().items():
                endpoints.add_metric([model], len(eps))
            for rl in (cp.load.view.values() if cp.load is not None else ()):
                if rl.ok:
                    for measure, v in (("running", rl.running), ("waiting", rl.waiting),
                                       ("kv_usage", rl.kv_usage)):
                        load.add_metric([rl.model, rl.address, measure], v)
            for model, ws in cp.publisher.weights().items():
                for address, w in ws.items():
                    weights.add_metric([model, address], w)
        for state, count in sorted(node_states.items()):
            nodes.add_metric([state], count)
        for (model, state), count in sorted(rep.items()):
            replicas.add_metric([model, state], count)
        yield from (nodes, replicas, gpus, endpoints, load, weights)


REGISTRY.register(_FleetCollector())


def track(cp: ControlPlane) -> None:
    _planes.add(cp)
