"""Poller-driven load weights: from replica loads to EDS load_balancing_weight.

Owns the weight function and the hysteresis that decides when a model's weights
are worth an update. The function (documented in the README):

    weight = 100 * speed * queue * kv, clamped to [5, 100]
      speed = decode_tps / fastest decode_tps    tokens/s per running sequence, against
                                                 the model's fastest replica
      queue = 1 / (1 + waiting / max(1, running))  queue measured in batches
      kv    = 1 if kv_usage <= 0.8 else max(0.1, (1 - kv_usage) / 0.2)

so a slow, queueing or saturated replica gets less new traffic, and no replica is ever
cut off (5 of 100 at worst: health checks and outlier detection decide that). Speed is
a capacity estimate that changes slowly; the queue and KV terms react to pressure.
Envoy's least-request (in-flight counts, bias 2) keeps short-term balance on top, so
the weights only have to carry what Envoy cannot see: how fast each replica works. The
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

from controlplane.load_poller import LoadView, ReplicaLoad, by_model
from controlplane.metrics import WEIGHT_UPDATES

log = logging.getLogger("llmgw.weights")

W_MAX = 100
W_MIN = 5


def replica_weight(load: ReplicaLoad, decode_tps: float | None,
                   fastest_tps: float | None) -> float:
    """The unrounded weight of one replica (see the module docstring)."""
    queue = 1.0 / (1.0 + max(0.0, load.waiting) / max(1.0, load.running))
    kv = 1.0 if load.kv_usage <= 0.8 else max(0.1, (1.0 - load.kv_usage) / 0.2)
    speed = 1.0
    if decode_tps is not None and fastest_tps:
        speed = max(0.0, min(1.0, decode_tps / fastest_tps))
    return min(float(W_MAX), max(float(W_MIN), W_MAX * speed * queue * kv))


@dataclass
class _ModelState:
    smooth: dict[str, float] = field(default_factory=dict)
    tps: dict[str, float] = field(default_factory=dict)
    published: dict[str, int] = field(default_factory=dict)
    pushed_at: float = float("-inf")


class LoadWeights:
    """Turns each new load view into `publish(model, weights)` calls, with hysteresis."""

    def __init__(self, publish: Callable[[str, Mapping[str, int]], object], *,
                 band: float = 0.1, min_interval_s: float = 2.0, alpha: float = 0.5,
                 enabled: Callable[[str], bool] = lambda _m: True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._publish = publish
        self.band = band
        self.min_interval_s = min_interval_s
        self.alpha = alpha
        self._enabled = enabled
        self.clock = clock
        self._models: dict[str, _ModelState] = {}

    def published(self) -> dict[str, dict[str, int]]:
        return {m: dict(s.published) for m, s in self._models.items() if s.published}

    def __call__(self, view: LoadView) -> None:
        # Failed scrapes stay in: such a replica keeps its smoothed weight.
        grouped = by_model(view)
        for model in set(self._models) - set(grouped):
            self._drop(model)
        for model, loads in grouped.items():
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
            st.tps.pop(gone, None)
        for r in loads:
            # A replica that decoded nothing since the last scrape keeps its last rate.
            if r.decode_tps is not None:
                old_tps = st.tps.get(r.address)
                st.tps[r.address] = (r.decode_tps if old_tps is None
                                     else old_tps + self.alpha * (r.decode_tps - old_tps))
        fastest = max(st.tps.values(), default=None)
        for r in loads:
            if not r.ok:
                continue  # no news: its smoothed weight stays
            w = replica_weight(r, st.tps.get(r.address), fastest)
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
        log.info("load weights of %s: %s", model,
                 ", ".join(f"{a}={w}" for a, w in sorted(target.items())) or "equal")
        WEIGHT_UPDATES.labels(model).inc()
        self._publish(model, target)

    def _moved(self, old: Mapping[str, int], new: Mapping[str, int]) -> bool:
        if set(old) != set(new):
            return True
        return any(abs(new[a] - w) > self.band * w for a, w in old.items())
