"""The reward server client against real loopback servers that misbehave: raw per-row values, rows
a server failed itself, malformed and cut-short answers, a trickle, 429, redirects, proxies, a
non-ASCII token, URL credentials, the start probe, and a second Ctrl-C while a request hangs."""

from __future__ import annotations

import base64
import json
import math
import os
import shutil
import ssl
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.rewards.remote import RemoteRewardClient, url_problem

REPO = Path(__file__).resolve().parents[2]


def rows(n: int) -> dict[str, list]:
    return {"query": [f"q{i} r{i}" for i in range(n)], "prompts": [f"q{i} " for i in range(n)],
            "labels": [str(i) for i in range(n)]}


@dataclass
class Seen:
    """One request a test server received: its method, path (absolute through a proxy), raw
    Authorization bytes (None when absent) and JSON body (None for a GET)."""

    method: str
    path: str
    authorization: bytes | None
    body: Any


@dataclass
class Server:
    url: str
    seen: list[Seen] = field(default_factory=list)


@contextmanager
def serving(respond: Callable[[BaseHTTPRequestHandler, Seen], None],
            tls: tuple[Path, Path] | None = None) -> Iterator[Server]:
    """A server on a free 127.0.0.1 port whose `respond(handler, request)` answers GETs and POSTs alike;
    over TLS with `tls` (certificate, key)."""
    server_seen: list[Seen] = []

    class Handler(BaseHTTPRequestHandler):
        def handle_one(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            auth = self.headers.get("Authorization")
            request = Seen(self.command, self.path, None if auth is None else auth.encode("latin-1"), body)
            server_seen.append(request)
            respond(self, request)

        do_GET = do_POST = handle_one  # noqa: N815

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield Server(f"{'https' if tls else 'http'}://127.0.0.1:{httpd.server_address[1]}/get_reward", server_seen)
    finally:
        httpd.shutdown()
        httpd.server_close()


def reply(handler: BaseHTTPRequestHandler, status: int, payload: Any, **headers: str) -> None:
    """Answer `payload` (bytes as they are, else JSON, NaN and Infinity allowed) with `headers`."""
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    handler.send_response(status)
    for name, value in {"Content-Type": "application/json", **headers}.items():
        handler.send_header(name.replace("_", "-"), value)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def answering(payload: Any) -> Callable[[BaseHTTPRequestHandler, Seen], None]:
    return lambda handler, request: reply(handler, 200, payload)


def test_each_rows_value_reaches_the_scores_exactly_as_the_server_sent_it():
    """NaN, Infinity, true, "0.5", null and a nested list are the scorer's to refuse, row by row
    (base commit: TypeError out of score(), float(None) and float([1.0]))."""
    sent = b'{"rewards": [NaN, Infinity, true, "0.5", null, [1.0], 2]}'
    with serving(answering(sent)) as server:
        out = RemoteRewardClient(server.url, retries=0).score(rows(7))
    assert math.isnan(out.rewards[0]) and out.rewards[1:] == [math.inf, True, "0.5", None, [1.0], 2]
    assert out.rewards[2] is True and out.failures == [None] * 7


def test_extras_keep_none_as_missing_and_ignore_an_entry_that_is_not_a_list():
    """ppo-serve-reward answers null for a row without the extra (base commit: TypeError out of score())."""
    sent = {"rewards": [1, 2, 3], "extra_logs": {"acc": [1, None, 0], "pred": ["7", None, "x"], "note": "one value"}}
    with serving(answering(sent)) as server:
        out = RemoteRewardClient(server.url, retries=0).score(rows(3))
    assert out.rewards == [1, 2, 3] and out.extras == {"acc": [1, None, 0], "pred": ["7", None, "x"]}


def test_a_row_the_server_failed_fails_alone_and_says_why():
    """The protocol agreed with ppo-serve-reward (base commit: TypeError out of score(), float(None))."""
    sent = {"rewards": [1.0, None, 3.0], "errors": [None, "judge crashed", ""], "extra_logs": {"acc": [1, 0, 1]}}
    with serving(answering(sent)) as server:
        out = RemoteRewardClient(server.url, retries=0).score(rows(3))
    assert out.rewards == [1.0, None, 3.0] and out.extras == {"acc": [1, None, 1]}
    assert [f and str(f) for f in out.failures] == [None, f"{server.url}: the server failed row: judge crashed", None]
    assert not out.failures[1].timed_out


MALFORMED = {
    "rewards null": (b'{"rewards": null}', '"rewards" is None, not a list of 3 values'),
    "rewards nested in one list": (b'{"rewards": [[1, 2, 3]]}', '"rewards" has 1 values for 3 rows'),
    "rewards a string": (b'{"rewards": "abc"}', "\"rewards\" is 'abc', not a list of 3 values"),
    "an extra of the wrong length": (b'{"rewards": [1, 2, 3], "extra_logs": {"acc": [1]}}',
                                     '"extra_logs"."acc" has 1 values for 3 rows'),
    "extra_logs not an object": (b'{"rewards": [1, 2, 3], "extra_logs": [1, 2, 3]}',
                                 '"extra_logs" is [1, 2, 3], not an object of named lists'),
    "errors not a list": (b'{"rewards": [1, 2, 3], "errors": "boom"}', "\"errors\" is 'boom', not a list of 3 values"),
    "no rewards key": (b'{"scores": [1, 2, 3]}', 'expected {"rewards": [...]} or a list'),
    "not JSON": (b"<html>502 Bad Gateway</html>", "Expecting value"),
    "deeply nested": (b"[" * 100_000 + b"]" * 100_000, "not a reward list"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_answer_fails_each_row_of_its_request_naming_the_url(name):
    """Base commit: "rewards null", "extra_logs not an object" and "deeply nested" raised out of score()
    (TypeError, TypeError, RecursionError); "errors not a list" was scored (no "errors" was read); the
    others failed with other messages ("3 rewards for 3 rows" for an extra of the wrong length)."""
    body, reason = MALFORMED[name]
    with serving(answering(body)) as server:
        out = RemoteRewardClient(server.url, retries=2, backoff_s=0.01).score(rows(3))
    assert out.rewards == [None] * 3 and out.extras == {} and len(server.seen) == 1, "not retried"
    message = str(out.failures[0])
    assert message.startswith(f"{server.url} answered something that is not a reward list: ") and reason in message
    assert out.failures == [out.failures[0]] * 3 and not out.failures[0].timed_out


def cut_short(handler: BaseHTTPRequestHandler, request: Seen) -> None:
    handler.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                        b'{"rewards": [1')
    handler.close_connection = True


def test_a_body_cut_short_is_retried_then_fails_its_rows_naming_the_url():
    """Base commit: http.client.IncompleteRead out of score()."""
    with serving(cut_short) as server:
        out = RemoteRewardClient(server.url, retries=2, backoff_s=0.01).score(rows(3))
    assert out.rewards == [None] * 3 and len(server.seen) == 3
    assert str(out.failures[0]) == f"{server.url}: IncompleteRead(14 bytes read, 86 more expected) (after 2 retries)"


def trickle(where: str) -> Callable[[BaseHTTPRequestHandler, Seen], None]:
    """A server that sends its status line, then its headers or its body one byte every 0.1 s (6 s in all)."""
    body = json.dumps({"rewards": [1, 2, 3], "pad": "x" * 29}).encode()
    head = b"Content-Length: %d\r\n" % len(body)
    slow, before, after = {"headers": (b"X-Slow: " + b"x" * 50 + b"\r\n", b"", head + b"\r\n" + body),
                           "body": (body, head + b"\r\n", b"")}[where]

    def respond(handler: BaseHTTPRequestHandler, request: Seen) -> None:
        try:
            handler.wfile.write(b"HTTP/1.1 200 OK\r\n" + before)
            for i in range(len(slow)):
                handler.wfile.write(slow[i : i + 1])
                time.sleep(0.1)
            handler.wfile.write(after)
        except OSError:
            pass  # the client hung up, as it should
    return respond


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_trickling_server_fails_its_request_within_the_timeout(where):
    """Base commit: each byte arrived within the socket timeout, so the request took the trickle's
    whole 6 s and then succeeded."""
    with serving(trickle(where)) as server:
        start = time.monotonic()
        out = RemoteRewardClient(server.url, timeout_s=1.0, retries=2).score(rows(3))
        elapsed = time.monotonic() - start
    assert 1.0 <= elapsed < 1.8
    assert len(server.seen) == 1, "timed out once, not retried"
    assert out.rewards == [None] * 3 and all(f.timed_out for f in out.failures)
    assert str(out.failures[0]) == f"{server.url} did not answer within reward.remote.timeout_s=1 s"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_https_checks_the_certificate_and_ends_a_trickle_at_the_deadline(certificate, monkeypatch):
    with serving(trickle("body"), tls=certificate) as server:
        assert "the TLS handshake failed ([SSL: CERTIFICATE_VERIFY_FAILED]" in url_problem(server.url)
        monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))
        assert url_problem(server.url) is None
        start = time.monotonic()
        out = RemoteRewardClient(server.url, timeout_s=1.0, retries=2).score(rows(3))
        assert 1.0 <= time.monotonic() - start < 1.8
    assert all(f.timed_out for f in out.failures) and [s.method for s in server.seen] == ["GET", "POST"]


def test_a_429_is_retried_after_its_retry_after_seconds():
    """Base commit: a 429 failed at once, like any 4xx."""
    def busy_once(handler, request):
        if len(server.seen) == 1:
            reply(handler, 429, {"error": "slow down"}, Retry_After="1")
        else:
            reply(handler, 200, [0.5] * len(request.body["query"]))

    with serving(busy_once) as server:
        start = time.monotonic()
        out = RemoteRewardClient(server.url, retries=1, backoff_s=0.01).score(rows(3))
        elapsed = time.monotonic() - start
    assert out.rewards == [0.5] * 3 and out.failures == [None] * 3 and len(server.seen) == 2
    assert 1.0 <= elapsed < 1.8, "waited Retry-After's second, not the 0.01 s backoff"


def test_a_wait_that_would_pass_the_deadline_is_not_taken():
    with serving(lambda h, r: reply(h, 429, {"error": "come back tomorrow"}, Retry_After="3600")) as server:
        start = time.monotonic()
        out = RemoteRewardClient(server.url, timeout_s=5, retries=3).score(rows(1))
        assert time.monotonic() - start < 1.0 and len(server.seen) == 1
    assert str(out.failures[0]) == (f'{server.url} answered HTTP 429: {{"error": "come back tomorrow"}}; not retried: '
                                    "waiting 3600 s would pass reward.remote.timeout_s=5 s")


def test_a_redirect_is_refused_naming_its_location_and_the_token_never_reaches_it():
    """Base commit: urllib followed the 302 (as a GET) with the Authorization header to the other server."""
    refusal = "refused (the token would go along); set reward.remote.url to the address that answers"
    with serving(answering([1.0])) as elsewhere:
        with serving(lambda h, r: reply(h, 302, b"", Location=elsewhere.url)) as server:
            out = RemoteRewardClient(server.url, token="s3cret", retries=2, backoff_s=0.01).score(rows(1))
            assert elsewhere.seen == [] and len(server.seen) == 1, "not followed, not retried"
            problem = url_problem(server.url, "s3cret")
    assert elsewhere.seen == [] and [s.method for s in server.seen] == ["POST", "GET"]
    assert str(out.failures[0]) == f"{server.url} answered HTTP 302, a redirect to {elsewhere.url}: {refusal}"
    assert problem == f"reward.remote.url={server.url} answered HTTP 302, a redirect to {elsewhere.url}: {refusal}"


@pytest.fixture
def proxy_env(monkeypatch):
    """A recording proxy on 127.0.0.1 named by $http_proxy (it answers every row 9.0 itself)."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "no_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with serving(lambda h, r: reply(h, 200, [9.0] * len((r.body or {}).get("query", [])))) as proxy:
        monkeypatch.setenv("http_proxy", proxy.url.removesuffix("/get_reward"))
        yield proxy


def test_the_environments_proxy_is_never_contacted_by_default(proxy_env):
    """Base commit: urllib's default opener sent the request, token and all, through $http_proxy."""
    with serving(answering([1.0, 2.0])) as server:
        out = RemoteRewardClient(server.url, token="s3cret").score(rows(2))
        assert proxy_env.seen == [] and out.rewards == [1.0, 2.0]
        assert url_problem(server.url, "s3cret") is None
    assert proxy_env.seen == [] and [s.method for s in server.seen] == ["POST", "GET"]


def test_use_proxy_sends_requests_and_the_probe_through_the_environments_proxy(proxy_env):
    with serving(answering([1.0, 2.0])) as server:
        out = RemoteRewardClient(server.url, use_proxy=True).score(rows(2))
        assert url_problem(server.url, use_proxy=True) is None
    assert out.rewards == [9.0, 9.0] and server.seen == []
    assert [(s.method, s.path) for s in proxy_env.seen] == [("POST", server.url), ("GET", server.url)]


def test_a_non_ascii_token_is_sent_as_its_utf8_bytes():
    """Base commit: http.client encoded the header as latin-1: UnicodeEncodeError out of score()."""
    with serving(answering([1.0])) as server:
        out = RemoteRewardClient(server.url, token="jeton-été-✓").score(rows(1))
    assert out.rewards == [1.0] and server.seen[0].authorization == "Bearer jeton-été-✓".encode()


def test_credentials_in_the_url_are_sent_as_basic_auth_and_masked_in_every_message():
    """Base commit: http.client took 'user:pa55@127.0.0.1' for a host ("nonnumeric port") and the
    failure named the password."""
    with serving(lambda h, r: reply(h, 500, {"error": "down"})) as server:
        url = server.url.replace("http://", "http://user:pa55@")
        out = RemoteRewardClient(url, retries=0).score(rows(1))
    assert server.seen[0].authorization == b"Basic " + base64.b64encode(b"user:pa55")
    masked = server.url.replace("http://", "http://***@")
    assert str(out.failures[0]) == f'{masked} answered HTTP 500: {{"error": "down"}}'


def token_required(handler: BaseHTTPRequestHandler, request: Seen) -> None:
    """An OpenRLHF-like server: 401 without the right token, 405 to a GET, scores to a POST."""
    if request.authorization != b"Bearer right":
        reply(handler, 401, {"error": "unauthorized"})
    elif request.method == "GET":
        reply(handler, 405, {"detail": "Method Not Allowed"})
    else:
        reply(handler, 200, [1.0] * len(request.body["query"]))


def test_the_probe_refuses_a_wrong_token_naming_the_key_and_takes_a_405_as_reachable():
    """Base commit: the probe was a TCP connect, blind to the token (url_problem took none)."""
    with serving(token_required) as server:
        wrong, missing, right = (url_problem(server.url, token) for token in ("wrong", None, "right"))
    assert wrong == (f"reward.remote.url={server.url} answered HTTP 401 to the token sent: set reward.remote.token "
                     "(or $PPO_REWARD_TOKEN, which keeps it off the command line) to the server's token")
    assert missing == (f"reward.remote.url={server.url} answered HTTP 401 to no token: set reward.remote.token "
                       "(or $PPO_REWARD_TOKEN, which keeps it off the command line) to the server's token")
    assert right is None and {s.method for s in server.seen} == {"GET"}


def test_ppo_train_stops_on_a_wrong_token_before_any_model_loads_and_posts_nothing(tmp_path, capsys, monkeypatch):
    """Base commit: the TCP probe passed, and the run went on to load its models."""
    from ppo_trainer.cli import train_main

    monkeypatch.setattr("ppo_trainer.workers.group.build_groups", pytest.fail)
    monkeypatch.setenv("PPO_REWARD_TOKEN", "wrong")
    monkeypatch.chdir(tmp_path)
    with serving(token_required) as server, pytest.raises(SystemExit) as exit_info:
        train_main(["+experiment=smoke", f"reward.remote.url={server.url}", f"trainer.output_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    assert "answered HTTP 401 to the token sent: set reward.remote.token" in capsys.readouterr().err
    assert [s.method for s in server.seen] == ["GET"]


CHILD = """
import signal, sys, time
from ppo_trainer.rewards.remote import RemoteRewardClient

def interrupt(*_):
    print(time.time(), flush=True)
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, interrupt)
signal.setitimer(signal.ITIMER_REAL, 0.5)
RemoteRewardClient(sys.argv[1], timeout_s=8, retries=0).score({"query": ["q r"], "prompts": ["q "]})
"""


def test_a_second_ctrl_c_leaves_score_and_the_process_while_a_request_hangs():
    """Base commit: the thread pool joined the hanging request: the process ended 8 s later, at the timeout."""
    release = threading.Event()
    with serving(lambda h, r: release.wait(20)) as server:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        child = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), server.url], capture_output=True,
                               text=True, env=env, timeout=30)
        ended = time.time()
        release.set()
    assert "KeyboardInterrupt" in child.stderr and child.returncode != 0
    assert ended - float(child.stdout.split()[0]) < 1.0


def test_reward_remote_timeout_s_bounds_requests_and_reward_timeout_s_only_functions():
    """Base commit: requests were bounded by reward.timeout_s (60 s when unset), which needs reward
    workers; reward.remote.timeout_s did not exist."""
    from ppo_trainer.config.schema import ConfigError
    from ppo_trainer.rewards.scoring import build_training_scorer

    remote = ["+experiment=smoke", "reward.remote.url=http://127.0.0.1:9/get_reward"]
    cfg = compose([*remote, "reward.remote.timeout_s=7.5", "reward.remote.use_proxy=true", "reward.num_workers=1",
                   "reward.timeout_s=3"])
    client = build_training_scorer(cfg, None).parts[0].scorer.client
    assert (client.timeout_s, client.use_proxy) == (7.5, True)
    assert compose(remote).reward.remote.timeout_s == 60.0
    with pytest.raises(ConfigError, match=r"'reward.timeout_s' bounds reward functions only, and reward.fn and "
                                          r"eval.reward_fn are null: nothing would use it; to bound the reward "
                                          r"server.s requests, set reward.remote.timeout_s=3.0 instead"):
        compose([*remote, "reward.fn=null", "reward.num_workers=1", "reward.timeout_s=3"])
    with pytest.raises(ConfigError, match=r"'reward.remote.timeout_s' must be > 0, got 0"):
        compose([*remote, "reward.remote.timeout_s=0"])


def test_a_servers_timeouts_are_counted_without_reward_timeout_s():
    from ppo_trainer.config import metric_names
    from ppo_trainer.rewards.scoring import Scores, reward_metrics

    cfg = compose(["+experiment=smoke", "reward.fn=null", "reward.remote.url=http://127.0.0.1:9/get_reward",
                   "reward.on_error=zero"])
    assert reward_metrics(Scores([0.0, 0.0], [{}, {}], errors=2, timeouts=1), cfg.reward)["reward/timeouts"] == 1
    assert "reward/timeouts" in metric_names.produced(cfg, uses_reference=True)
