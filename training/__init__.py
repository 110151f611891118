"""forgeflow: training."""
