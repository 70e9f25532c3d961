"""ART's `art.backend` module path: `from art.backend import Backend` (ART's client of its
HTTP server, the class its backends share). Here that is `art.RemoteBackend`, as `art.Backend`."""

from art.backends.remote import RemoteBackend as Backend

__all__ = ["Backend"]
