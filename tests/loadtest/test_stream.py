"""Server-sent events are split and timed wherever the network cuts them."""

from __future__ import annotations

from bitserve.loadtest.stream import Result, StreamReader

STREAM = (
    b'data: {"choices":[{"text":"a"}]}\n\n'
    b'data: {"choices":[{"text":""}]}\n\n'
    b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n'
    b'data: {"choices":[{"text":"c"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n'
    b"data: [DONE]\n\n"
)


def test_events_cut_anywhere_give_the_same_timing():
    for cut in range(1, len(STREAM)):
        reader = StreamReader(start=10.0)
        reader.feed(STREAM[:cut], 10.5)
        reader.feed(STREAM[cut:], 11.0)
        result = Result(start=10.0, latency=1.0, prompt_len=5)
        reader.finish(result)
        assert result.ok and result.output_len == 3 and result.prompt_len == 7
        assert len(result.itl) == 2 and result.ttft in (0.5, 1.0)


def test_error_event_and_empty_stream_are_errors():
    reader = StreamReader(start=0.0)
    reader.feed(b'data: {"error":{"message":"boom"}}\n\n', 0.1)
    result = Result(start=0.0)
    reader.finish(result)
    assert result.error == "stream_error"
    result = Result(start=0.0)
    StreamReader(start=0.0).finish(result)
    assert result.error == "no_tokens"
