"""Poller-driven load weights: from replica loads to EDS load_balancing_weight.

Owns the weight function and the hysteresis that decides when a model's weights
are worth an update. The function (documented in the README):

    weight = 100 * queue * kv * speed, clamped to [5, 100]
      queue = 1 / (1 + waiting)                  each queued request halves, thirds, ...
      kv    = 1 if kv_usage <= 0.8 else max(0.1, (1 - kv_usage) / 0.2)
      speed = min(1, best_ttft / ttft)           this replica's recent time to first
                                                 token against the model's fastest

so a saturated, queueing or slow replica gets less new traffic, and no replica is ever
cut off (5 of 100 at worst: health checks and outlier detection decide that). The
inputs are smoothed (EWMA) and a model's weights are pushed only when one of them
moves by more than `band` (relative) and at most every `min_interval_s`, so a noisy
metric does not push every second. Weights are sent as endpoint-only updates;
Envoy's least-request keeps working on top of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from controlplane.load_poller import LoadView, ReplicaLoad

log = logging.getLogger("llmgw.weights")

W_MAX = 100
W_MIN = 5


def replica_weight(load: ReplicaLoad, best_ttft: float | None) -> float:
    """The unrounded weight of one replica (see the module docstring)."""
    queue = 1.0 / (1.0 + max(0.0, load.waiting))
    kv = 1.0 if load.kv_usage <= 0.8 else max(0.1, (1.0 - load.kv_usage) / 0.2)
    speed = 1.0
    if best_ttft is not None and load.ttft_s is not None and load.ttft_s > 0:
        speed = max(0.1, min(1.0, best_ttft / load.ttft_s))
    return min(float(W_MAX), max(float(W_MIN), W_MAX * queue * kv * speed))


@dataclass
class _ModelState:
    smooth: dict[str, float] = field(default_factory=dict)
    ttft: dict[str, float] = field(default_factory=dict)
    published: dict[str, int] = field(default_factory=dict)
    pushed_at: float = float("-inf")


class LoadWeights:
    """Turns each new load view into `publish(model, weights)` calls, with hysteresis."""

    def __init__(self, publish: Callable[[str, Mapping[str, int]], object], *,
                 band: float = 0.25, min_interval_s: float = 2.0, alpha: float = 0.5,
                 enabled: Callable[[str], bool] = lambda _m: True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._publish = publish
        self.band = band
        self.min_interval_s = min_interval_s
        self.alpha = alpha
        self._enabled = enabled
        self.clock = clock
        self._models: dict[str, _ModelState] = {}
        self.pushes = 0

    def published(self) -> dict[str, dict[str, int]]:
        return {m: dict(s.published) for m, s in self._models.items() if s.published}

    def __call__(self, view: LoadView) -> None:
        by_model: dict[str, list[ReplicaLoad]] = {}
        for r in view.values():
            by_model.setdefault(r.model, []).append(r)
        for model in set(self._models) - set(by_model):
            self._drop(model)
        for model, loads in by_model.items():
            if not self._enabled(model):
                self._drop(model)
                continue
            self._update(model, loads)

    def _drop(self, model: str) -> None:
        st = self._models.pop(model, None)
        if st is not None and st.published:
            self._publish(model, {})

    def _update(self, model: str, loads: list[ReplicaLoad]) -> None:
        st = self._models.setdefault(model, _ModelState())
        live = {r.address for r in loads}
        for gone in set(st.smooth) - live:
            st.smooth.pop(gone)
            st.ttft.pop(gone, None)
        for r in loads:
            # A replica that finished nothing since the last scrape keeps its last TTFT.
            if r.ttft_s is not None:
                st.ttft[r.address] = r.ttft_s
        best = min(st.ttft.values(), default=None)
        for r in loads:
            if not r.ok:
                continue  # no news: its smoothed weight stays
            ttft = st.ttft.get(r.address)
            w = replica_weight(ReplicaLoad(r.model, r.address, r.at, running=r.running,
                                           waiting=r.waiting, kv_usage=r.kv_usage,
                                           ttft_s=ttft), best)
            old = st.smooth.get(r.address)
            st.smooth[r.address] = w if old is None else old + self.alpha * (w - old)
        target = {a: max(W_MIN, min(W_MAX, round(w))) for a, w in st.smooth.items()}
        if len(set(target.values())) <= 1:
            target = {}  # all equal: Envoy's plain least-request, nothing to send
        if not self._moved(st.published, target):
            return
        now = self.clock()
        if now - st.pushed_at < self.min_interval_s:
            return
        st.published, st.pushed_at = target, now
        self.pushes += 1
        log.info("load weights of %s: %s", model,
                 ", ".join(f"{a}={w}" for a, w in sorted(target.items())) or "equal")
        self._publish(model, target)

    def _moved(self, old: Mapping[str, int], new: Mapping[str, int]) -> bool:
        if set(old) != set(new):
            return True
        return any(abs(new[a] - w) > self.band * w for a, w in old.items())
