"""The recording side of trajectory capture (`art.capture`): one `Recorder` per open trajectory
scope, which turns each finished call (a whole answer, or a stream's bytes once it ends) into an
exchange and the chat turn it stands for; the registry the HTTP hooks (`art.capture_hooks`) find
the active one in; and reading a request's API and JSON body off the wire."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from .exchange_turns import NotATurn, chat_turn
from .exchanges import Endpoint, IncompleteExchange, build_exchange, endpoint_of
from .trajectories import Trajectory, add_turn
from .trajectory_scopes import current_scope

log = logging.getLogger(__name__)

WHAT = {
    "chat_completions": "a chat completion",
    "completions": "a completion",
    "responses": "a response",
    "messages": "a message",
}
"""How each API's call is named in notes."""


class Recorder:
    """One open scope's recording. Calls may finish on other threads (sync clients), hence the lock."""

    def __init__(self, trajectory: Trajectory) -> None:
        self.trajectory = trajectory
        self.lock = threading.Lock()
        self.open: set[PendingAnswer] = set()

    def note(self, message: str) -> None:
        with self.lock:
            self.trajectory.log(message)
        log.debug("capture: %s", message)

    def flush(self) -> None:
        for pending in list(self.open):
            pending.finish()

    def record(
        self,
        endpoint: Endpoint,
        request: dict[str, Any],
        content_type: str,
        body: bytes | Callable[[], bytes],
        started: datetime,
    ) -> None:
        """Add the call to `exchanges` and its turn to the history it extends. Never raises: the
        agent's call has succeeded whatever happens here."""
        what = WHAT[endpoint]
        try:
            _, exchange = build_exchange(
                endpoint,
                request,
                body() if callable(body) else body,
                start_time=started,
                end_time=datetime.now(),
                content_type=content_type,
            )
        except IncompleteExchange as exc:
            self.note(f"{exc}; not recorded")
            return
        except Exception as exc:  # a capture problem must not fail the agent's call
            self.note(
                f"{what}'s answer could not be read ({type(exc).__name__}: {str(exc).splitlines()[0]}); not recorded"
            )
            return
        try:
            turn = chat_turn(exchange)
        except (NotATurn, ValueError) as exc:
            turn = None
            self.note(f"{what} is recorded in exchanges but trains nothing ({str(exc).splitlines()[0]})")
        with self.lock:
            self.trajectory.exchanges.add(exchange)
            if turn is not None:
                for note in turn.notes:
                    self.trajectory.log(note)
                add_turn(self.trajectory, turn)


def read_request(method: str, path: str, content: Any) -> tuple[Endpoint, dict[str, Any]] | None:
    """The API and JSON body of a call worth recording, else None."""
    if method.upper() != "POST" or content is None:
        return None
    try:
        body = json.loads(content) if not isinstance(content, Mapping) else dict(content)
    except Exception:  # a streamed upload (not read yet) or not JSON: not a call we can read
        return None
    if not isinstance(body, dict):
        return None
    endpoint = endpoint_of(path, body)
    return (endpoint, body) if endpoint is not None else None


class PendingAnswer:
    """A streamed answer being read: its bytes are kept until it ends or closes."""

    def __init__(
        self,
        recorder: Recorder,
        endpoint: Endpoint,
        request: dict,
        content_type: str,
        started: datetime,
        decode: Callable[[bytes], bytes] = lambda raw: raw,
    ) -> None:
        self.recorder, self.endpoint, self.request = recorder, endpoint, request
        self.content_type, self.started, self.decode = content_type, started, decode
        self.parts: list[bytes] = []
        self.done = False
        recorder.open.add(self)

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        self.recorder.open.discard(self)
        self.recorder.record(
            self.endpoint, self.request, self.content_type, lambda: self.decode(b"".join(self.parts)), self.started
        )


def failed_call(recorder: Recorder, endpoint: Endpoint, status: int) -> bool:
    if 200 <= status < 300:
        return False
    recorder.note(f"{WHAT[endpoint]} failed with HTTP {status}; not recorded")
    return True


_RECORDERS: dict[int, Recorder] = {}
_RECORDERS_LOCK = threading.Lock()


def open_recorder(trajectory: Trajectory) -> None:
    """A scope opened on `trajectory`: calls made inside it are recorded into it."""
    with _RECORDERS_LOCK:
        _RECORDERS.setdefault(id(trajectory), Recorder(trajectory))


def close_recorder(trajectory: Trajectory) -> None:
    """Its scope closed: streams left open count with what they carried in full."""
    with _RECORDERS_LOCK:
        recorder = _RECORDERS.pop(id(trajectory), None)
    if recorder is not None:
        recorder.flush()


def _recorder_of(trajectory: Trajectory | None) -> Recorder | None:
    if trajectory is None:
        return None
    with _RECORDERS_LOCK:
        return _RECORDERS.get(id(trajectory))


def active_recorder() -> Recorder | None:
    """The recorder of the trajectory scope open in this context, if any."""
    return _recorder_of(current_scope())
