"""forgeflow: evalsuite."""
