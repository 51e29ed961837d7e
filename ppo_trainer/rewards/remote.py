"""Reward servers (`reward.remote.*`): OpenRLHF's remote reward protocol over HTTP, so an OpenRLHF
reward server and `ppo-serve-reward` answer alike.

A request is a POST of JSON `{"query": [prompt + response], "prompts": [prompt], "labels":
[ground truth], "data_sources": [...], "extra_infos": [...], "messages": [the prompt's chat turns]}`
(the last three are ours: OpenRLHF's servers ignore keys they do not know). The answer is
`{"rewards": [...]}`, optionally with `"scores"`, `"extra_logs": {name: [...]}` and `"errors":
[null or a reason, ...]` (ours: the rows the server failed itself), or a bare list.

The values are kept as the server sent them: whether a NaN, `true` or `"0.5"` is a score is the
scorer's one rule (`rewards.calling.finite_score`), which fails such a row, not the transport's.
Every request leaves through one opener (`build_opener`): it follows no redirect (the token would
go wherever a server points), takes the environment's proxies only when asked, and ends each
request at one deadline, from the connect to the answer's last byte, retries and their waits
included. Every way a request can fail becomes a `RemoteRewardError` on its rows, never an
exception out of `score`; messages show the URL through `redact_url`.
"""

from __future__ import annotations

import email.utils
import functools
import http.client
import io
import json
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, TypeVar, Union
from urllib.parse import urlsplit

from ppo_trainer.config.secrets import redact_url

REQUEST_KEYS = ("query", "prompts", "labels", "data_sources", "extra_infos", "messages")
TOKEN_ENV = "PPO_REWARD_TOKEN"
PROBE_TIMEOUT_S = 5.0  # the start probe's deadline: a server that is up answers a GET at once

T = TypeVar("T")


class RemoteRewardError(RuntimeError):
    """A row the server did not score (its request failed, or the server failed the row);
    `timed_out` tells a stall from a failure."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


@dataclass
class RemoteScores:
    """Per row, each value exactly as the server's JSON held it (a NaN, a bool, a string, a list
    included: the scorer judges them); None where the row failed (`failures` says why)."""

    rewards: list[Any]  # [B]
    extras: dict[str, list[Any]] = field(default_factory=dict)  # name -> [B]; None where missing or failed
    failures: list[Optional[RemoteRewardError]] = field(default_factory=list)  # [B]


@dataclass
class Answer:
    """One request's answer for its rows: values as sent, and the reason for each row the server
    failed itself (None for a row it scored)."""

    rewards: list[Any]
    extras: dict[str, list[Any]]
    errors: list[Optional[str]]


def bearer_token(configured: Optional[str]) -> Optional[str]:
    """The token requests carry: `reward.remote.token` when set, else $PPO_REWARD_TOKEN (which keeps it
    out of command lines and saved configs); None for neither."""
    return configured or os.environ.get(TOKEN_ENV) or None


def authorization(token: Optional[str]) -> Optional[bytes]:
    """The Authorization header, as bytes: "Bearer <token>" in UTF-8 (http.client would encode a str
    as latin-1, which breaks a non-ASCII token; ppo-serve-reward compares the bytes); None without
    a token. Credentials in a URL are refused by the config check, never sent."""
    return b"Bearer " + token.encode() if token else None


def time_left(deadline: float) -> float:
    """Seconds until `deadline` (time.monotonic()); TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's deadline passed")
    return left


class _DeadlineReader(io.RawIOBase):
    """A response's socket reads, each allowed only the time left before the request's deadline: a
    socket timeout alone bounds each read, so a server trickling a byte a second would never end."""

    def __init__(self, raw: io.RawIOBase, sock: Any, deadline: float):
        super().__init__()
        self._raw, self._sock, self._deadline = raw, sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(time_left(self._deadline))
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineResponse(http.client.HTTPResponse):
    """An HTTP response (status line, headers and body) read against the request's deadline."""

    def __init__(self, sock: Any, *args: Any, deadline: float, **kwargs: Any):
        super().__init__(sock, *args, **kwargs)
        self.fp = io.BufferedReader(_DeadlineReader(self.fp.detach(), sock, deadline))


class _DeadlineConnection(http.client.HTTPConnection):
    """A connection whose connect, sends and response all end at `deadline`."""

    def __init__(self, *args: Any, deadline: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.deadline = deadline
        self.response_class = functools.partial(_DeadlineResponse, deadline=deadline)

    def connect(self) -> None:
        self.timeout = time_left(self.deadline)
        super().connect()

    def send(self, data: Any) -> None:
        if self.sock is not None:
            self.sock.settimeout(time_left(self.deadline))
        super().send(data)


class _DeadlineHTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    """The same over TLS (the default context: certificates checked)."""


class _Request(urllib.request.Request):
    """A request that carries its deadline to the connection that sends it."""

    def __init__(self, url: str, *, deadline: float, **kwargs: Any):
        super().__init__(url, **kwargs)
        self.deadline = deadline


class _DeadlineHTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: _Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_DeadlineConnection, deadline=req.deadline), req)


class _DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req: _Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_DeadlineHTTPSConnection, deadline=req.deadline), req)


def build_opener(use_proxy: bool) -> urllib.request.OpenerDirector:
    """The one way requests and the probe leave: no redirect handler (a 3xx answer is an HTTPError,
    refused: the token would follow it anywhere), $http_proxy/$https_proxy (and $no_proxy) only
    with `use_proxy` (else straight to the URL: a proxy would see the token), deadlines as above."""
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.ProxyHandler(None if use_proxy else {}), urllib.request.UnknownHandler(),
                    _DeadlineHTTPHandler(), _DeadlineHTTPSHandler(), urllib.request.HTTPDefaultErrorHandler(),
                    urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


def refused_redirect(e: urllib.error.HTTPError) -> str:
    location = e.headers.get("Location")
    return (f"answered HTTP {e.code}, a redirect to {redact_url(location) if location else '(no Location)'}: refused "
            "(the token would go along); set reward.remote.url to the address that answers")


def retry_after_s(value: Optional[str]) -> Optional[float]:
    """The seconds a Retry-After header asks to wait (a number of seconds or an HTTP date); None when
    absent or unreadable."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def describe(e: Exception) -> str:
    """What went wrong with a connection: urllib's reason (e.g. "[Errno 111] Connection refused") or
    the exception's own text, else its type (RemoteDisconnected, IncompleteRead...)."""
    reason = getattr(e, "reason", e)
    return str(reason) or type(reason).__name__


def body_excerpt(e: urllib.error.HTTPError) -> str:
    """The first 200 bytes of an error answer's body, as text ("" when it cannot be read)."""
    try:
        return e.read(200).decode(errors="replace")
    except Exception:  # a body cut short or past the deadline: the status says enough
        return ""
    finally:
        e.close()


def url_problem(url: str, token: Optional[str] = None, *, use_proxy: bool = False,
                timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """Why requests to `url` cannot work, or None; asked before any model loads. An authenticated GET
    through the requests' opener (same proxies, no redirects; it never POSTs rows): a 401/403 names
    the token, a 3xx the redirect; any other HTTP answer (an OpenRLHF server answers a GET 404 or
    405) means a server listens."""
    shown = redact_url(url)
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        return f"reward.remote.url={shown}: not an http(s) URL (e.g. http://127.0.0.1:5000/get_reward)"
    auth = authorization(token)
    request = _Request(url, headers={"Authorization": auth} if auth else {}, method="GET",
                       deadline=time.monotonic() + timeout_s)
    try:
        build_opener(use_proxy).open(request, timeout=timeout_s).close()
    except urllib.error.HTTPError as e:
        e.close()
        if e.code in (401, 403):
            sent = "the token sent" if token else "the URL's credentials" if auth else "no token"
            return (f"reward.remote.url={shown} answered HTTP {e.code} to {sent}: set reward.remote.token (or "
                    "$PPO_REWARD_TOKEN, which keeps it off the command line) to the server's token")
        return f"reward.remote.url={shown} {refused_redirect(e)}" if 300 <= e.code < 400 else None
    except Exception as e:
        if isinstance(getattr(e, "reason", e), ssl.SSLError):
            return (f"reward.remote.url={shown}: the TLS handshake failed ({describe(e)}); give the server a "
                    "certificate this machine trusts (SSL_CERT_FILE may name a CA file) or fix the URL")
        return (f"reward.remote.url={shown}: nothing answers at {parts.hostname}:{port} ({describe(e)}); start the "
                "server (ppo-serve-reward, or OpenRLHF's serve_rm) or fix the URL")
    return None


def _list_of(value: Any, name: str, rows: int) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{name} is {value!r:.100}, not a list of {rows} values")
    if len(value) != rows:
        raise ValueError(f"{name} has {len(value)} values for {rows} rows")
    return value


def parse_answer(answer: Any, rows: int) -> Answer:
    """A server's answer for `rows` rows, each value as sent; an "extra_logs" entry that is not a
    list (OpenRLHF allows a scalar) is left out; ValueError naming what is malformed."""
    if isinstance(answer, list):
        answer = {"rewards": answer}
    if not isinstance(answer, dict) or "rewards" not in answer:
        raise ValueError(f'expected {{"rewards": [...]}} or a list, got {answer!r:.200}')
    logs, errors = answer.get("extra_logs"), answer.get("errors")
    if logs is not None and not isinstance(logs, dict):
        raise ValueError(f'"extra_logs" is {logs!r:.100}, not an object of named lists')
    extras = {str(name): _list_of(values, f'"extra_logs"."{name}"', rows)
              for name, values in (logs or {}).items() if isinstance(values, list)}
    reasons = [None] * rows if errors is None else _list_of(errors, '"errors"', rows)
    return Answer(_list_of(answer["rewards"], '"rewards"', rows), extras,
                  [reason if isinstance(reason, str) and reason else None for reason in reasons])


def in_daemon_threads(calls: Sequence[Callable[[], T]], concurrency: int) -> list[T]:
    """Each call's result, at most `concurrency` running at a time, on daemon threads: a
    KeyboardInterrupt in the caller (a second Ctrl-C) leaves at once, and the process exits without
    waiting for the requests in flight (a thread pool joins its workers first, up to a timeout)."""
    results: list[Any] = [None] * len(calls)
    gate = threading.BoundedSemaphore(concurrency)

    def run(index: int) -> None:
        with gate:
            results[index] = calls[index]()

    threads = [threading.Thread(target=run, args=(i,), name="reward-request", daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


class RemoteRewardClient:
    """Scores rows on a reward server: batches of `batch_size` rows, `concurrency` requests at a time,
    each ended at `timeout_s` after it starts. A connection failure (refused, reset, a body cut short)
    or a 5xx answer is retried `retries` times with doubling waits from `backoff_s`, a 429 after its
    Retry-After seconds when it gives them; a wait that would pass the deadline is not taken. Not
    retried: a timeout (the server is busy: a retry would queue the same work behind it), any other
    4xx, a redirect, an answer that is not a reward list (a retry gets the same)."""

    def __init__(self, url: str, *, token: Optional[str] = None, batch_size: int = 64, concurrency: int = 4,
                 timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 1.0, use_proxy: bool = False) -> None:
        self.url, self.shown, self.batch_size, self.concurrency = url, redact_url(url), batch_size, concurrency
        self.timeout_s, self.retries, self.backoff_s, self.use_proxy = timeout_s, retries, backoff_s, use_proxy
        auth = authorization(token)
        self._target, self._opener = url, build_opener(use_proxy)
        self._headers = {"Content-Type": "application/json", **({"Authorization": auth} if auth else {})}

    def score(self, rows: dict[str, Sequence[Any]]) -> RemoteScores:
        """`rows`: `REQUEST_KEYS` -> one value per row (`query` and `prompts` required)."""
        n, size = len(rows["query"]), self.batch_size
        starts = range(0, n, size)
        batches = [{key: list(values[s : s + size]) for key, values in rows.items()} for s in starts]
        answers = in_daemon_threads([functools.partial(self._request, batch) for batch in batches], self.concurrency)
        names = sorted({name for answer in answers if isinstance(answer, Answer) for name in answer.extras})
        out = RemoteScores(rewards=[], extras={name: [] for name in names}, failures=[])
        for start, answer in zip(starts, answers):
            for i in range(min(size, n - start)):
                failure = self._row_failure(answer, i)
                out.failures.append(failure)
                out.rewards.append(None if failure else answer.rewards[i])
                for name in names:
                    out.extras[name].append(None if failure or name not in answer.extras else answer.extras[name][i])
        return out

    def _row_failure(self, answer: Union[Answer, RemoteRewardError], i: int) -> Optional[RemoteRewardError]:
        """Why row `i` of a request was not scored: its request failed, or the server failed the row."""
        if isinstance(answer, RemoteRewardError):
            return answer
        reason = answer.errors[i]
        return None if reason is None else RemoteRewardError(f"{self.shown}: the server failed row: {reason}")

    def _request(self, payload: dict[str, list]) -> Union[Answer, RemoteRewardError]:
        """One batch's answer, or the RemoteRewardError that ended its tries."""
        deadline, wait = time.monotonic() + self.timeout_s, self.backoff_s
        try:
            body = json.dumps(payload).encode()
        except (TypeError, ValueError) as e:
            return RemoteRewardError(f"{self.shown}: the rows cannot be sent as JSON: {e}")
        for attempt in range(self.retries + 1):
            try:
                answer = self._post(body, deadline)
            except Exception as e:  # every way a request fails: the rows fail, the run decides (reward.on_error)
                error, pause = self._failure(e, deadline, wait)
            else:
                try:
                    return parse_answer(json.loads(answer), len(payload["query"]))
                except Exception as e:  # not JSON, too deeply nested, the wrong shape
                    return RemoteRewardError(f"{self.shown} answered something that is not a reward list: {e}")
            if pause is None:
                return error
            if attempt == self.retries:
                break
            if time.monotonic() + pause >= deadline:
                return RemoteRewardError(f"{error}; not retried: waiting {pause:g} s would pass "
                                         f"reward.remote.timeout_s={self.timeout_s:g} s")
            time.sleep(pause)
            wait *= 2
        return RemoteRewardError(f"{error} (after {self.retries} retries)") if self.retries else error

    def _post(self, body: bytes, deadline: float) -> bytes:
        request = _Request(self._target, data=body, headers=self._headers, method="POST", deadline=deadline)
        with self._opener.open(request, timeout=time_left(deadline)) as response:
            return response.read()

    def _failure(self, e: Exception, deadline: float, wait: float) -> tuple[RemoteRewardError, Optional[float]]:
        """The error an attempt ended with, and the seconds to wait before the next (None: no retry)."""
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError) \
                or time.monotonic() >= deadline:
            return RemoteRewardError(f"{self.shown} did not answer within reward.remote.timeout_s={self.timeout_s:g} s",
                                     timed_out=True), None
        if not isinstance(e, urllib.error.HTTPError):  # refused, reset, cut short: the connection, not the request
            return RemoteRewardError(f"{self.shown}: {describe(e)}"), wait
        if 300 <= e.code < 400:
            e.close()
            return RemoteRewardError(f"{self.shown} {refused_redirect(e)}"), None
        hint = "; check reward.remote.token (or $PPO_REWARD_TOKEN)" if e.code in (401, 403) else ""
        error = RemoteRewardError(f"{self.shown} answered HTTP {e.code}: {body_excerpt(e)}{hint}")
        if e.code == 429:
            after = retry_after_s(e.headers.get("Retry-After"))
            return error, wait if after is None else after
        return error, wait if e.code >= 500 else None
