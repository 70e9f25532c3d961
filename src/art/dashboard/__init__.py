"""A local web page to watch runs: reward and metric curves, samples, trained tokens.

It reads the run folders under a storage root (`art.storage.layout`) and needs no account or
internet: `art dashboard --path .art` serves it alone, and `art serve` mounts it at
/dashboard behind its API key. `dashboard_router(root)` is the FastAPI router both use.
"""

from art.dashboard.routes import dashboard_router

__all__ = ["dashboard_router"]
