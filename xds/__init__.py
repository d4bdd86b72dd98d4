"""Envoy xDS: translation to Envoy resources, snapshots, cache and the ADS server."""

from xds import message_validation

message_validation.install()
