"""forgeflow: flows."""
