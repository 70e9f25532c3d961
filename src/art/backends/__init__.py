"""Backends: where a registered model is served and trained."""
