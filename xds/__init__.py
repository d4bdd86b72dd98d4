"""Envoy xDS: translation to Envoy resources, snapshots, cache and the ADS server."""
