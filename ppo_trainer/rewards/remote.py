"""Reward servers (`reward.remote.*`): OpenRLHF's remote reward protocol over HTTP, so an OpenRLHF
reward server and `ppo-serve-reward` answer alike.

A request is a POST of JSON `{"query": [prompt + response], "prompts": [prompt], "labels":
[ground truth], "data_sources": [...], "extra_infos": [...], "messages": [the prompt's chat turns]}`
(the last three are ours: OpenRLHF's servers ignore keys they do not know). The answer is
`{"rewards": [...]}`, optionally with `"scores"` and `"extra_logs": {name: [...]}`, or a bare list.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit

REQUEST_KEYS = ("query", "prompts", "labels", "data_sources", "extra_infos", "messages")


class RemoteRewardError(RuntimeError):
    """A batch the server did not score; `timed_out` tells a stall from a failure."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


@dataclass
class RemoteScores:
    """Per row: the reward (None where its batch failed, `failures` says why), and named extras."""

    rewards: list[Optional[float]]
    extras: dict[str, list[Optional[float]]] = field(default_factory=dict)
    failures: list[Optional[RemoteRewardError]] = field(default_factory=list)


TOKEN_ENV = "PPO_REWARD_TOKEN"


def bearer_token(configured: Optional[str]) -> Optional[str]:
    """The token requests carry: `reward.remote.token` when set, else $PPO_REWARD_TOKEN (which keeps it
    out of command lines and saved configs); None for neither."""
    return configured or os.environ.get(TOKEN_ENV) or None


def url_problem(url: str, timeout_s: float = 5.0) -> Optional[str]:
    """Why nothing answers at `url` (a TCP connect to its host and port), or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"reward.remote.url={url}: not an http(s) URL (e.g. http://127.0.0.1:5000/get_reward)"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        return (f"reward.remote.url={url}: nothing answers at {parts.hostname}:{port} ({e.strerror or e}); start the "
                "server (ppo-serve-reward, or OpenRLHF's serve_rm) or fix the URL")
    return None


def parse_answer(answer: Any, rows: int) -> tuple[list[float], dict[str, list[float]]]:
    """(rewards, extras) of a server's answer for `rows` rows; ValueError when it is malformed."""
    if isinstance(answer, list):
        rewards, extras = answer, {}
    elif isinstance(answer, dict) and "rewards" in answer:
        rewards, extras = answer["rewards"], dict(answer.get("extra_logs") or {})
    else:
        raise ValueError(f"expected {{\"rewards\": [...]}} or a list, got {str(answer)[:200]}")
    if len(rewards) != rows or any(len(v) != rows for v in extras.values() if isinstance(v, list)):
        raise ValueError(f"{len(rewards)} rewards for {rows} rows")
    return [float(r) for r in rewards], {k: [float(x) for x in v] for k, v in extras.items() if isinstance(v, list)}


class RemoteRewardClient:
    """Scores rows on a reward server: batches of `batch_size` rows, `concurrency` requests at a
    time, each bounded by `timeout_s`; a connection error or a 5xx answer is retried `retries` times
    with doubling waits from `backoff_s`; a timeout is not retried (the server is busy: a retry would
    queue the same work behind it)."""

    def __init__(self, url: str, *, token: Optional[str] = None, batch_size: int = 64, concurrency: int = 4,
                 timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 1.0) -> None:
        self.url, self.token, self.batch_size, self.concurrency = url, token, batch_size, concurrency
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s

    def score(self, rows: dict[str, Sequence[Any]]) -> RemoteScores:
        """`rows`: `REQUEST_KEYS` -> one value per row (`query` and `prompts` required)."""
        n = len(rows["query"])
        starts = list(range(0, n, self.batch_size))
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(starts)))) as pool:
            answers = list(pool.map(lambda s: self._batch({k: list(v[s : s + self.batch_size])
                                                           for k, v in rows.items()}), starts))
        out = RemoteScores(rewards=[], failures=[])
        names = sorted({name for answer in answers if not isinstance(answer, RemoteRewardError) for name in answer[1]})
        out.extras = {name: [] for name in names}
        for start, answer in zip(starts, answers):
            size = min(self.batch_size, n - start)
            failed = isinstance(answer, RemoteRewardError)
            out.rewards += [None] * size if failed else answer[0]
            out.failures += [answer if failed else None] * size
            for name in names:
                out.extras[name] += [None] * size if failed or name not in answer[1] else answer[1][name]
        return out

    def _batch(self, payload: dict[str, list]) -> Any:
        """(rewards, extras) of one request, or the RemoteRewardError that ended its tries."""
        body = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        wait = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return parse_answer(json.loads(response.read()), len(payload["query"]))
            except urllib.error.HTTPError as e:
                error = RemoteRewardError(f"{self.url} answered HTTP {e.code}: {e.read()[:200].decode(errors='replace')}")
                if e.code < 500:
                    return error  # the request itself is wrong: a retry gets the same answer
            except TimeoutError:  # socket.timeout is TimeoutError
                return RemoteRewardError(f"{self.url} did not answer within reward.timeout_s={self.timeout_s:g} s",
                                         timed_out=True)
            except (urllib.error.URLError, ConnectionError) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, TimeoutError):
                    return RemoteRewardError(f"{self.url} did not answer within reward.timeout_s={self.timeout_s:g} s",
                                             timed_out=True)
                error = RemoteRewardError(f"{self.url}: {reason}")
            except (ValueError, json.JSONDecodeError) as e:
                return RemoteRewardError(f"{self.url} answered something that is not a reward list: {e}")
            if attempt < self.retries:
                time.sleep(wait)
                wait *= 2
        return RemoteRewardError(f"{error} (after {self.retries} retries)")
