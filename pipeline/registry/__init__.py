"""The registry phase: register the export in MLflow's model registry and move the champion alias."""
