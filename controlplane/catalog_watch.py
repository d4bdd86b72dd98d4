"""Hot reload of the catalog file: a valid edit applies, an invalid one is refused.

Owns watching the file (watchfiles, on its directory, so editors that replace the file
are seen) and deciding what to do with each new version: apply it through a callback,
or log exactly what is wrong and keep the last good catalog in force.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from watchfiles import awatch

from controlplane.catalog import Catalog, CatalogError, load_catalog
from controlplane.metrics import CATALOG_RELOADS

log = logging.getLogger("llmgw.catalog")


class CatalogWatcher:
    def __init__(self, path: Path, apply: Callable[[Catalog], None]) -> None:
        self.path = path.resolve()
        self.apply = apply
        self.applied = 0
        self.refused = 0
        self.last_error = ""

    def reload(self) -> bool:
        """Load the file now; apply it if valid. Returns whether it applied."""
        try:
            cat = load_catalog(self.path)
        except CatalogError as e:
            self.refused += 1
            CATALOG_RELOADS.labels("refused").inc()
            self.last_error = str(e)
            log.error("catalog change refused, keeping the last good catalog:\n%s", e)
            return False
        self.apply(cat)
        self.applied += 1
        CATALOG_RELOADS.labels("applied").inc()
        self.last_error = ""
        log.info("catalog reloaded from %s: %d models", self.path, len(cat.models))
        return True

    async def run(self) -> None:
        async for changes in awatch(self.path.parent, debounce=200, step=50):
            # Paths come under the (already resolved) directory watched.
            if any(Path(p) == self.path for _, p in changes):
                self.reload()
