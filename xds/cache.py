"""The snapshot cache: the one current snapshot, and a way to wait for a newer one.

Owns nothing of the protocol. Writers (the publisher) replace the snapshot; each ADS
stream waits for a newer generation and diffs it against what its Envoy holds. A
snapshot whose versions equal the current one is not a change: watchers are not woken.
"""

from __future__ import annotations

import asyncio
import logging

from xds.snapshot import InconsistentSnapshot, Snapshot

log = logging.getLogger("llmgw.xds.cache")


class SnapshotCache:
    def __init__(self) -> None:
        self._snapshot: Snapshot | None = None
        self._generation = 0
        self._changed = asyncio.Event()

    @property
    def snapshot(self) -> Snapshot | None:
        return self._snapshot

    @property
    def generation(self) -> int:
        """Rises by one for every snapshot that differs from the one before."""
        return self._generation

    def set_snapshot(self, snap: Snapshot) -> bool:
        """Publish `snap` if it is consistent and differs; return whether it changed."""
        try:
            snap.check()
        except InconsistentSnapshot as e:
            log.error("refused inconsistent snapshot, keeping the last good one: %s", e)
            raise
        old = self._snapshot
        if old is not None and dict(old.versions) == dict(snap.versions):
            return False
        self._snapshot = snap
        self._generation += 1
        # Wake every waiter, then arm a fresh event for the next change.
        self._changed.set()
        self._changed = asyncio.Event()
        return True

    async def wait_newer(self, generation: int) -> int:
        """Return once the generation is above `generation`; return the new one."""
        while self._generation <= generation:
            await self._changed.wait()
        return self._generation
