"""ART's import path for the local backend: `from art.local import LocalBackend`."""

from art.backends.local import LocalBackend

__all__ = ["LocalBackend"]
