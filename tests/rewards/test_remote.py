"""The remote reward client against servers on 127.0.0.1 that answer, fail, stall or are down."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator

import pytest

from ppo_trainer.rewards.remote import Answer, RemoteRewardClient, parse_answer, url_problem

ROWS = {"query": [f"q{i} r{i}" for i in range(5)], "prompts": [f"q{i} " for i in range(5)],
        "labels": [str(i) for i in range(5)]}


def serve(respond: Callable[[dict, BaseHTTPRequestHandler], None]) -> Iterator[tuple[str, list]]:
    """A server on a free 127.0.0.1 port; `respond(request, handler)` answers; yields (url, requests seen)."""
    seen: list = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((body, self.headers.get("Authorization")))
            respond(body, self)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/get_reward", seen
    finally:
        server.shutdown()
        server.server_close()


def answer(handler, status: int, payload) -> None:
    data = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


@pytest.fixture
def scoring_server():
    yield from serve(lambda body, h: answer(h, 200, {"rewards": [float(q[1]) for q in body["query"]],
                                                     "extra_logs": {"len": [len(q) for q in body["query"]]}}))


def test_rows_are_scored_in_batches_with_extras_and_the_bearer_token(scoring_server):
    url, seen = scoring_server
    out = RemoteRewardClient(url, token="s3cret", batch_size=2, concurrency=2).score(ROWS)
    assert out.rewards == [0.0, 1.0, 2.0, 3.0, 4.0] and out.extras == {"len": [5.0] * 5}
    assert out.failures == [None] * 5
    assert sorted(len(body["query"]) for body, _ in seen) == [1, 2, 2]
    assert {auth for _, auth in seen} == {"Bearer s3cret"}
    assert seen[0][0]["labels"][0] in ROWS["labels"]


def test_a_server_error_is_retried_with_backoff_then_reported(monkeypatch):
    calls = []

    def flaky(body, handler):
        calls.append(time.monotonic())
        if len(calls) < 3:
            answer(handler, 500, {"error": "overloaded"})
        else:
            answer(handler, 200, [1.0] * len(body["query"]))

    for url, _ in serve(flaky):
        out = RemoteRewardClient(url, batch_size=8, retries=3, backoff_s=0.05).score(ROWS)
        assert out.rewards == [1.0] * 5 and len(calls) == 3
        assert calls[1] - calls[0] >= 0.05 and calls[2] - calls[1] >= 0.1  # waits of 0.05 s, then doubled
    calls.clear()
    for url, _ in serve(lambda body, h: answer(h, 500, {"error": "down for good"})):
        out = RemoteRewardClient(url, batch_size=8, retries=2, backoff_s=0.01).score(ROWS)
        assert out.rewards == [None] * 5
        assert "HTTP 500" in str(out.failures[0]) and "after 2 retries" in str(out.failures[0])


def test_a_stalled_server_times_out_without_retrying():
    calls = []

    def stall(body, handler):
        calls.append(1)
        time.sleep(3)
        answer(handler, 200, [0.0] * len(body["query"]))

    for url, _ in serve(stall):
        start = time.monotonic()
        out = RemoteRewardClient(url, batch_size=8, timeout_s=0.5, retries=3).score(ROWS)
        assert time.monotonic() - start < 2.5
        assert out.rewards == [None] * 5 and all(f.timed_out for f in out.failures) and len(calls) == 1


def test_a_server_that_is_down_is_named_by_the_probe_and_fails_the_rows():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/get_reward"
    assert "nothing answers at 127.0.0.1" in url_problem(url)
    assert "not an http(s) URL" in url_problem("127.0.0.1:5000")
    out = RemoteRewardClient(url, retries=1, backoff_s=0.01).score(ROWS)
    assert out.rewards == [None] * 5 and not out.failures[0].timed_out


def test_answers_in_both_forms_and_malformed_ones():
    assert parse_answer([1, 2], 2) == Answer([1, 2], {}, [None, None])
    assert parse_answer({"rewards": [1], "scores": [0.5], "extra_logs": {"acc": [1]}}, 1) == Answer([1], {"acc": [1]},
                                                                                                    [None])
    for bad in ({"scores": [1]}, [1, 2, 3], "nope"):
        with pytest.raises(ValueError):
            parse_answer(bad, 2)
