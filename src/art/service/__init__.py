"""The backend's core: the service API (`api`) and its in-process implementation.

- `api`: the `Service` protocol and what crosses it (torch-free; the client side imports it).
- `local`: `LocalService`, the protocol over models loaded in this process.
- `build`: loading one trainable model as a `LoadedModel` (`loaded`).
- `update`: a weight update as one transaction (step, checkpoint, probe, publish, roll back).
- `probe`: the weight-sync probe; `settings`: a model's internal config; `watchdog`: stuck loops.
"""

from art.service.api import (
    ModelKey,
    ModelSpec,
    Progress,
    Service,
    TrainEvent,
    TrainResult,
    resolve_train_options,
)

__all__ = ["ModelKey", "ModelSpec", "Progress", "Service", "TrainEvent", "TrainResult", "resolve_train_options"]
