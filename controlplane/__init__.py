"""llmgw control plane: catalog, fleet state, publishing to Envoy, and the CLI."""
