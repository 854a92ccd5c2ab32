"""Refusing a request under overload before it costs anything (issue 35).

An LLM whose waiting queue is full refuses a request with 429 and Retry-After
(`LLMService.admit`). On the normal path that check comes after the route has read,
parsed and validated the body (v2: and tokenized the prompt); under a burst of hundreds
of requests the last refusal waited behind the parsing of all the requests ahead of it
(p99 near a second). Here the same check runs first: `refusal` is called by the HTTP
protocol (connections.py) before the request's ASGI task exists, and by the ASGI app
ahead of the router (`screen`) for what the protocol let through or when the app is
served another way (tests over ASGI):

- v2 infer (`/v2/models/{model}[/versions/{v}]/infer`): the model is in the path, so a
  refusal goes out before the body is read at all;
- OpenAI generation (`/v1/chat/completions`, `/v1/completions`): the model is in the
  body, found by a lookup of one key, without validation: the protocol has the whole
  body of up to 64 KiB; the ASGI app only its first chunk (a body in several chunks
  goes the normal way there).

It refuses what the normal path would refuse (the same `admit` call). A generation the
protocol lets through holds a place in its LLM's queue (`door`) until its ASGI task
starts, where the place is given back and the app takes its own (openai.py's `_held`,
v2's `process`) in the same step of the event loop. A burst's requests are screened in a
pass of the loop before any of their tasks runs: without those places, every request of
a pass was let through while the queue had room, and those past its size were refused
later by the app's own check (`screen`, then the route), each as an ASGI task behind the
parsing of the ones admitted ahead of it. A place held at the door for a request the app
then refuses for another reason (a 400) may refuse one more request of the same pass.
Models with a traffic policy (canary or shadow) are left to the normal path, which
routes them. gRPC's servicer calls `check` before parsing.

Request bodies are admitted here too, on every route: one past `max_body` gets 413 before
it is read (a chunked one as soon as it grows past it), and the bytes of the bodies being
served at once are bounded by `body_memory` (503 with Retry-After past it): many large
bodies at once are refused, not an out-of-memory.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import orjson
from starlette.responses import Response

from bitserve.inference import Overloaded
from bitserve.repository.version import ModelVersion
from bitserve.rollout.policy import VERSION_HEADER
from bitserve.server.connections import DOOR, FIRST_CHUNK_LIMIT
from bitserve.server.errors import APIError, BodyTooLarge, openai_body, v2_body
from bitserve.server.record import Record
from bitserve.server.state import ServerState

V2_INFER = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
OPENAI_GENERATE = frozenset({"/v1/chat/completions", "/v1/completions"})
VERSION_KEY = VERSION_HEADER.lower().encode("latin-1")


def check(version: ModelVersion) -> None:
    """Raise Overloaded when `version` is an LLM whose waiting queue is full."""
    if version.serves("generate"):
        version.serving("generate").admit(0)


class Admission:
    """Serve one HTTP request through the app unless it is refused here."""

    def __init__(self, state: ServerState):
        self.state = state
        self.max_body = state.options.max_body
        self.body_memory = state.options.body_memory or 4 * self.max_body
        self.bodies = 0  # bytes of the bodies admitted and not yet done
        self._responses: dict[tuple, Response] = {}  # refusals by message (_response)

    async def __call__(self, app: Any, scope: dict, receive: Any, send: Any) -> None:
        held = scope.pop(DOOR, None)
        if held is not None:  # the app takes its own place before its next await
            held.release()
        length = _content_length(scope)
        if length is None:  # chunked: counted as it arrives
            size = [0]
            receive = self._counted(receive, size)
        else:
            size = [length]
            if (refusal := self._body_refusal(length)) is not None:
                await _shaped(scope, refusal)(scope, receive, send)
                return
            self.bodies += length
        try:
            receive = await self.screen(scope, receive, send)
            if receive is not None:
                await app(scope, receive, send)
        finally:
            self.bodies -= size[0]

    def _body_refusal(self, length: int) -> Exception | None:
        if length > self.max_body:
            return BodyTooLarge(f"request body of {length} bytes exceeds {self.max_body}")
        if length and self.bodies + length > self.body_memory:
            message = (
                f"{self.bodies} bytes of request bodies are being served; "
                f"{length} more would pass {self.body_memory} (--max-body-memory)"
            )
            return APIError(503, message, "service_unavailable", headers={"Retry-After": "1"})
        return None

    def _counted(self, receive: Any, size: list[int]) -> Any:
        async def counted() -> dict:
            message = await receive()
            more = len(message.get("body", b""))
            if more:
                if (refusal := self._body_refusal(size[0] + more)) is not None:
                    raise refusal
                size[0] += more
                self.bodies += more
            return message

        return counted

    async def screen(self, scope: dict, receive: Any, send: Any) -> Any:
        """None when the request was refused here (its response sent), else the
        `receive` the app reads the request through."""
        if self.needs_body(scope):
            first = await receive()
            receive = _replay(first, receive)
            if first.get("more_body") or len(first.get("body", b"")) > FIRST_CHUNK_LIMIT:
                return receive
            refusal = self.refusal(scope, first.get("body", b""))
        else:
            refusal = self.refusal(scope, None)
        if refusal is None:
            return receive
        await refusal(scope, receive, send)
        return None

    def needs_body(self, scope: dict) -> bool:
        """Whether `refusal` needs the request's body (OpenAI's model is in it) and may
        wait for it: declared up to FIRST_CHUNK_LIMIT, or chunked (a larger body goes
        the normal way, its 413 at once when past `max_body`)."""
        if scope["method"] != "POST" or scope["path"] not in OPENAI_GENERATE:
            return False
        length = _content_length(scope)
        return length is None or length <= FIRST_CHUNK_LIMIT

    def refusal(self, scope: dict, body: bytes | None) -> Response | None:
        """The response that refuses this request now, or None to serve it. `body`: the
        whole body when `needs_body` (None: not at hand, let it through). Synchronous, for
        the protocol layer too (connections.py), before any task or ASGI cycle exists."""
        return self._screened(scope, body)[0]

    def door(self, scope: dict, body: bytes | None) -> Response | None:
        """`refusal`, for the protocol layer: a generation let through holds a place in
        its LLM's queue (in `scope`) until its ASGI task starts (`__call__`)."""
        refusal, version = self._screened(scope, body)
        if refusal is None and version is not None and version.serves("generate"):
            with contextlib.suppress(Overloaded):  # not raised: `_screened` found room
                scope[DOOR] = version.serving("generate").hold()
        return refusal

    def _screened(self, scope: dict, body: bytes | None) -> tuple[Response | None, Any]:
        """(`refusal`'s answer, the version it looked at, if any)."""
        if scope["method"] != "POST" or self.state.draining:
            return None, None
        path = scope["path"]
        if path in OPENAI_GENERATE:
            if body is None:
                return None, None
            try:
                model = orjson.loads(body).get("model")
            except (orjson.JSONDecodeError, AttributeError):
                return None, None  # the route says what is wrong with it
            version = self._version(model, None) if isinstance(model, str) else None
            if version is not None and (refused := _refusal(version)) is not None:
                return self._response(openai_body, refused), version
            return None, version
        if (m := V2_INFER.fullmatch(path)) is not None:
            pinned = m[2] or _header(scope, VERSION_KEY)
            version = self._version(m[1], pinned)
            if version is not None and (refused := _refusal(version)) is not None:
                Record(self.state, version, None).close(refused)  # counted as the v2 path does
                return self._response(v2_body, refused), version
            return None, version
        return None, None

    def _response(self, shape: Any, refused: Overloaded) -> Response:
        """The refusal's response, built once per distinct message (a burst's refusals
        say the same thing: the queue is as full for the last as for the first)."""
        key = (shape, str(refused), refused.retry_after)
        response = self._responses.get(key)
        if response is None:
            if len(self._responses) >= 64:  # messages carry queue counts: a few at a time
                self._responses.clear()
            response = self._responses[key] = shape(refused)
        return response

    def _version(self, model: str, pinned: str | None) -> ModelVersion | None:
        """The version a request for `model` reaches, when it is found without routing
        (None: unknown, not loaded, or under a traffic policy: the route decides)."""
        entry = self.state.repository.models.get(model)
        if entry is None or entry.lazy():
            return None
        if pinned is None and self.state.rollout.get(entry) is not None:
            return None
        try:
            return self.state.repository.get(model, pinned)
        except Exception:  # not found, unavailable: the route answers it
            return None


def _refusal(version: ModelVersion) -> Overloaded | None:
    try:
        check(version)
    except Overloaded as refusal:
        # without its traceback: the traceback holds this frame, whose local holds the
        # exception, a cycle that only the garbage collector frees. A burst's refusals
        # left thousands of frames to it, and its young collections on the event loop
        # took 2-11 ms each, in the middle of the burst.
        return refusal.with_traceback(None)
    return None


def _shaped(scope: dict, refusal: Exception) -> Any:
    """The refusal as a response in the protocol's shape: OpenAI's under /v1/, else v2's."""
    return openai_body(refusal) if scope["path"].startswith("/v1/") else v2_body(refusal)


def _content_length(scope: dict) -> int | None:
    """The declared body length; 0 for none, None for a chunked body."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
        if name == b"transfer-encoding":
            return None
    return 0


def _header(scope: dict, key: bytes) -> str | None:
    for name, value in scope["headers"]:
        if name == key:
            return value.decode("latin-1")
    return None


def _replay(first: dict, receive: Any) -> Any:
    """`receive` that hands out `first` again before reading on."""
    pending = [first]

    async def replayed() -> dict:
        return pending.pop() if pending else await receive()

    return replayed
