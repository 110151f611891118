"""forgeflow: tasks."""
