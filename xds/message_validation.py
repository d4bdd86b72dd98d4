"""Cached pydantic validators for betterproto2 messages.

betterproto2 0.9.1 re-validates a pydantic message every time it is serialized or
parsed, and builds a fresh `pydantic_core.SchemaValidator` from the class's schema
to do it. Building the validator is most of the cost of serializing an Envoy
resource (py-spy on bench/xds_push.py at 10 000 endpoints: 1287 of 1983 samples
under `Message.__bytes__` were in `_validate`). The schema is fixed per class, so we
build each validator once and keep the check itself: the same fields are validated
the same way, only the rebuild is gone.

`install()` is idempotent and is called when the `xds` package is imported (every
process that builds or parses Envoy messages, and the agent protocol, imports it).
"""

from __future__ import annotations

from typing import Any

import betterproto2
import pydantic_core

_validators: dict[type, pydantic_core.SchemaValidator] = {}
_original = betterproto2.Message._validate


def _cached_validate(self: betterproto2.Message) -> None:
    cls = type(self)
    validator = _validators.get(cls)
    if validator is None:
        schema: Any = cls.__pydantic_core_schema__  # type: ignore[attr-defined]
        validator = _validators[cls] = pydantic_core.SchemaValidator(schema)
    values = self.__dict__.copy()
    del values["_unknown_fields"]
    validator.validate_python(values)


def install() -> None:
    """Route betterproto2's per-message validation through the cache."""
    if betterproto2.Message._validate is _original:
        betterproto2.Message._validate = _cached_validate  # type: ignore[method-assign]
