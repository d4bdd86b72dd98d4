"""The autoscaler: a model's replica target from its engines' load.

Owns the scaling rule of `Autoscale` in the catalog (see there), the per-model timers
behind "sustained" and the cool-down, and the record of every decision with its
reason. It only computes a target: the reconciler holds it within
[min_replicas, max_replicas] and does the starting and draining. One step at a time:
no new step while the last one has not landed (serving replicas != target).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from controlplane.catalog import Catalog, Model
from controlplane.load_poller import LoadView, ReplicaLoad, by_model
from controlplane.metrics import AUTOSCALE_DECISIONS

log = logging.getLogger("llmgw.autoscaler")


@dataclass(frozen=True)
class ScaleDecision:
    model: str
    at: float  # wall-clock seconds
    from_replicas: int
    to_replicas: int
    reason: str


@dataclass
class _Timers:
    up_since: float | None = None
    down_since: float | None = None
    changed_at: float = float("-inf")


class Autoscaler:
    def __init__(self, catalog: Callable[[], Catalog],
                 targets: Callable[[], Mapping[str, int]],
                 apply: Callable[[str, int], None], *,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, keep: int = 100) -> None:
        self._catalog = catalog
        self._targets = targets
        self._apply = apply
        self.clock = clock
        self.wall = wall
        self._timers: dict[str, _Timers] = {}
        self.decisions: deque[ScaleDecision] = deque(maxlen=keep)

    def __call__(self, view: LoadView) -> None:
        serving = by_model(view, ok_only=True)
        targets = self._targets()
        for m in self._catalog().models:
            if m.autoscale is None:
                self._timers.pop(m.name, None)
                continue
            target = targets.get(m.name, m.min_replicas)
            self.observe(m, target, serving.get(m.name, []))

    def observe(self, m: Model, target: int, loads: list[ReplicaLoad]) -> ScaleDecision | None:
        cfg = m.autoscale
        assert cfg is not None
        now = self.clock()
        t = self._timers.setdefault(m.name, _Timers())
        serving = len(loads)
        if serving == 0 or serving != target:
            # Nothing to judge, or the last step is still landing: start over after it.
            t.up_since = t.down_since = None
            return None
        waiting = sum(r.waiting for r in loads) / serving
        kv = max(r.kv_usage for r in loads)
        busy = sum(r.running + r.waiting for r in loads) / serving
        up = waiting >= cfg.up_waiting_per_replica or kv >= cfg.up_kv_usage
        down = busy <= cfg.down_load_per_replica
        t.up_since = (t.up_since if t.up_since is not None else now) if up else None
        t.down_since = (t.down_since if t.down_since is not None else now) if down else None
        if now - t.changed_at < cfg.cooldown_s:
            return None
        if up and target < m.max_replicas and now - (t.up_since or now) >= cfg.up_after_s:
            what = (f"queue {waiting:.1f} per replica >= {cfg.up_waiting_per_replica:g}"
                    if waiting >= cfg.up_waiting_per_replica
                    else f"KV cache {kv:.0%} >= {cfg.up_kv_usage:.0%}")
            return self._decide(m, t, target, target + 1, f"{what} for {cfg.up_after_s:g} s")
        if down and target > m.min_replicas and now - (t.down_since or now) >= cfg.down_after_s:
            return self._decide(m, t, target, target - 1,
                                f"load {busy:.2f} per replica <= {cfg.down_load_per_replica:g}"
                                f" for {cfg.down_after_s:g} s")
        return None

    def _decide(self, m: Model, t: _Timers, old: int, new: int, reason: str) -> ScaleDecision:
        t.changed_at = self.clock()
        t.up_since = t.down_since = None
        d = ScaleDecision(m.name, self.wall(), old, new, reason)
        self.decisions.append(d)
        log.info("autoscale %s: %d -> %d replicas (%s)", m.name, old, new, reason)
        AUTOSCALE_DECISIONS.labels(m.name, "up" if new > old else "down").inc()
        self._apply(m.name, new)
        return d
