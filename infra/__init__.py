"""forgeflow: infra."""
