"""forgeflow: diagnosis."""
