"""ART's module path for the local backend: `from art.local.backend import LocalBackend`.

The class is `art.backends.local.LocalBackend` itself (one class, three import paths: this,
`art.local` and `art.LocalBackend`)."""

from art.backends.local import LocalBackend

__all__ = ["LocalBackend"]
