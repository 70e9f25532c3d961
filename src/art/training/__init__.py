"""Trajectories -> token sequences -> advantages -> loss -> optimizer step."""

from art.training.audit import audit

__all__ = ["audit"]
