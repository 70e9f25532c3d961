"""Trajectories -> token sequences -> advantages -> loss -> optimizer step."""

# `art.training.audit` is the token audit's module (and CLI); its function is `art.training.audit.audit`.
