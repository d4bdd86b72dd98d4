"""The cached betterproto2 validator keeps validating, only faster."""

from __future__ import annotations

import pydantic
import pytest
from envoy_data_plane.envoy.config.endpoint.v3 import ClusterLoadAssignment

import xds  # noqa: F401  (installs the cache)
from xds import message_validation


def test_cache_is_installed_and_still_rejects_bad_fields() -> None:
    import betterproto2

    assert betterproto2.Message._validate is message_validation._cached_validate
    ok = ClusterLoadAssignment(cluster_name="m")
    assert bytes(ok) == bytes(ClusterLoadAssignment(cluster_name="m"))
    assert ClusterLoadAssignment.parse(bytes(ok)).cluster_name == "m"
    assert ClusterLoadAssignment in message_validation._validators
    bad = ClusterLoadAssignment(cluster_name="m")
    # pydantic does not re-check on assignment; serialization must.
    object.__setattr__(bad, "cluster_name", ["not", "a", "string"])
    with pytest.raises(pydantic.ValidationError):
        bytes(bad)


def test_install_is_idempotent() -> None:
    import betterproto2

    message_validation.install()
    message_validation.install()
    assert betterproto2.Message._validate is message_validation._cached_validate
