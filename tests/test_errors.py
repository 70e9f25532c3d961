"""The one error table (`art.errors.WIRE`): every class in it survives `to_wire` then `from_wire`
with its class, message and fields, and what the server sends is what the table says."""

import json

import pytest

from art.errors import (WIRE, ArtValueError, BackendError, BackendUnavailableError, ContextLengthError, JudgeError,
                        StepConflictError, TrajectoryError, from_wire, to_wire)


def example(cls: type) -> Exception:
    if issubclass(cls, ArtValueError):
        return cls("bad field", field="messages[0].content")
    if issubclass(cls, StepConflictError):
        return cls("elsewhere", expected_step=3, current_step=4)
    if issubclass(cls, BackendUnavailableError):
        exc = cls("restarting")
        exc.retry_after = 7
        return exc
    return cls(f"a {cls.__name__}")


@pytest.mark.parametrize("cls", list(WIRE), ids=lambda cls: cls.__name__)
def test_every_class_in_the_table_round_trips(cls):
    exc = example(cls)
    body = json.loads(json.dumps(to_wire(exc)))  # as it travels: plain JSON
    status, code = WIRE[cls].status, WIRE[cls].code
    assert body["status"] == status and body["code"] == code and body["type"] == WIRE[cls].type
    back = from_wire(body["status"], body)
    assert type(back) is cls and str(back) == str(exc)
    for field in ("field", "expected_step", "current_step", "retry_after"):
        assert getattr(back, field, None) == getattr(exc, field, None)


def test_subclasses_outside_the_table_travel_as_their_nearest_row():
    assert to_wire(TrajectoryError("empty group", field="trajectory_groups"))["status"] == 400
    assert type(from_wire(400, to_wire(TrajectoryError("x")))) is ArtValueError
    assert type(from_wire(400, to_wire(ContextLengthError("long")))) is ContextLengthError
    judged = to_wire(JudgeError("no usable answer"))  # any other ArtError: a 500 with its message
    assert judged["status"] == 500 and type(from_wire(500, judged)) is BackendError


@pytest.mark.parametrize("status, body, cls", [
    (503, {"message": "a proxy's 503"}, BackendUnavailableError),
    (409, {"message": "unknown code", "code": "other"}, ArtValueError),
    (422, {"message": "x", "param": "name"}, ArtValueError),
    (404, {"message": "no route"}, BackendError),
    (502, {}, BackendError),
])
def test_a_status_no_row_claims_falls_back_by_its_kind(status, body, cls):
    assert type(from_wire(status, body)) is cls
