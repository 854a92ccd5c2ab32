"""Errors by type: a status is looked up along the exception's MRO (api/errors.py), so
a subclass needs no entry; an exception no domain error names is a bug (500, logged),
never a 400; each domain error is one class wherever it is raised."""

from __future__ import annotations

import asyncio
import logging

from bitserve.api.errors import STATUS, is_bug, reason_of, status_of, to_openai
from bitserve.batching.batcher import QueueFull
from bitserve.inference import InvalidRequest, Overloaded
from bitserve.llm.sampling_params import SamplingError
from bitserve.llm.scheduler import RequestTooLong
from bitserve.server.errors import handle


def test_a_subclass_takes_its_nearest_base_in_the_mro():
    class Mine(QueueFull):
        pass

    assert Mine not in STATUS
    assert status_of(Mine("m", 2)) == 429 and reason_of(Mine("m", 2)) == "rejected"
    assert status_of(RequestTooLong("too long")) == 400  # an InvalidRequest


def test_a_value_error_is_a_bug_not_a_400():
    for bug in (ValueError("oops"), KeyError("k"), TypeError("t")):
        assert status_of(bug) == 500 and is_bug(bug)
    assert to_openai(ValueError("oops")).kind == "internal_error"
    assert not is_bug(InvalidRequest("x")) and status_of(SamplingError("top_p", "no")) == 400


def test_one_class_each_wherever_it_is_raised():
    from bitserve.backends import llm
    from bitserve.diffusion import engine

    assert llm.Overloaded is engine.Overloaded is Overloaded
    assert status_of(Overloaded("full", 3)) == 429
    assert to_openai(Overloaded("full", 3)).headers == {"Retry-After": "3"}
    error = to_openai(RequestTooLong("long"))
    assert (error.status, error.code) == (400, "context_length_exceeded")


def test_a_bug_is_answered_500_and_logged(caplog):
    class Url:
        path = "/x"

    class Req:
        url = Url()

    async def broken(request):
        raise ValueError("a bug")

    with caplog.at_level(logging.ERROR, logger="bitserve.server"):
        response = asyncio.run(handle(broken)(Req()))
    assert response.status_code == 500
    assert any(r.exc_info and "a bug" in str(r.exc_info[1]) for r in caplog.records)
