"""`ppo-serve-reward`: a reward function or a reward model served over HTTP in OpenRLHF's remote
reward protocol (`rewards/remote.py` is the client), so that a run's `reward.remote.url`, or
OpenRLHF, can score on another machine (a judge on its own GPU, a sandbox that runs code).

Handler threads read, check and answer requests concurrently; one scoring thread owns the scorer
(`ScoringQueue`: a function pool and a model are not thread-safe). Every read of a request is
bounded by one deadline and its body by a size cap, so a client cannot stall a thread or exhaust
memory. What a request means and how its rows are scored and answered: `rewards/serving.py`."""

from __future__ import annotations

import argparse
import contextlib
import hmac
import io
import ipaddress
import json
import logging
import queue
import re
import signal
import socket
import sys
import threading
import time
from collections import Counter
from concurrent.futures import CancelledError, Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator, Optional

from ppo_trainer.config.schema import ConfigError
from ppo_trainer.rewards.calling import RewardError
from ppo_trainer.rewards.remote import bearer_token
from ppo_trainer.rewards.serving import Answer, RequestError, Score, function_scorer, model_scorer, read_request

log = logging.getLogger("ppo_trainer")

MAX_BODY_MB = 64.0
SOCKET_TIMEOUT_S = 60.0
LINGER_S = 2.0  # how long a refused request's unread body is drained before the connection closes


class ScoringQueue:
    """One thread that owns the scorer and scores requests in arrival order: a function pool and a
    model are not thread-safe, and a pool's replacement workers die with the thread that started
    them (rewards/pool.py), so a handler thread must never score. `close` cancels the requests still
    waiting, lets the one being scored finish, then closes the scorer in its own thread."""

    def __init__(self, score: Score):
        self.score = score
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="ppo-serve-reward scoring", daemon=True)
        self.thread.start()

    def submit(self, request: dict[str, list]) -> Future:
        """The future answer of `request` (cancelled when the queue is closed)."""
        future: Future = Future()
        with self.lock:
            if self.closed:
                future.cancel()
            else:
                self.jobs.put((request, future))
        return future

    def _run(self) -> None:
        try:
            while (job := self.jobs.get()) is not None:
                request, future = job
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(self.score(request))
                    except BaseException as e:  # noqa: BLE001  (a SystemExit from a function must not end this thread)
                        future.set_exception(e)
        finally:
            close = getattr(self.score, "close", None)
            if close is not None:
                close()

    def close(self) -> None:
        """Idempotent; waits for the request being scored (a second Ctrl-C stops the wait)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            waiting = []
            while True:
                try:
                    waiting.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            self.jobs.put(None)
        for _, future in waiting:
            future.cancel()
        self.thread.join()


class _DeadlineReader(io.RawIOBase):
    """A connection's bytes, every read bounded by what is left of one deadline (--socket-timeout-s
    from the connection's start): a per-read timeout alone lets a client that sends a byte now and
    then hold the thread forever. TimeoutError when it passes."""

    def __init__(self, sock: socket.socket, timeout_s: float):
        self.sock, self.deadline = sock, time.monotonic() + timeout_s

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive within --socket-timeout-s")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class RewardHandler(BaseHTTPRequestHandler):
    """One connection (HTTP/1.0: one request): POST any path scores, GET answers {"ok": true}."""

    server: "RewardServer"
    server_version, sys_version = "ppo-serve-reward", ""  # the Server header names no Python version

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.socket_timeout_s)  # for writing the answer
        self.rfile.close()  # the plain reader: replaced by one bound by the deadline
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self.server.socket_timeout_s))

    def do_GET(self) -> None:  # noqa: N802
        if self._authorised():
            self._answer(200, {"ok": True})

    def do_POST(self) -> None:  # noqa: N802
        started = time.monotonic()
        if not self._authorised():
            return
        size = self._body_size()
        if size is None:
            return
        try:
            body = self.rfile.read(size)
        except TimeoutError:
            self._refuse(408, f"the body did not arrive within --socket-timeout-s={self.server.socket_timeout_s:g} s")
            return
        try:
            if len(body) < size:
                raise RequestError(f"the body ended after {len(body)} of its {size} bytes")
            request = read_request(body)
        except RequestError as e:
            self._refuse(400, str(e))
            return
        with self.server.answering():
            self._score(request, started)

    def _score(self, request: dict[str, list], started: float) -> None:
        """Waits for the scoring thread's answer and sends it: 500 naming the exception's type (only) if
        scoring failed, 503 if the server closed before the request's turn."""
        try:
            answer = self.server.scoring.submit(request).result()
        except CancelledError:
            self._refuse(503, "the server is shutting down")
            return
        except BaseException as e:  # noqa: BLE001  (the client is told, the server serves on)
            log.error("ppo-serve-reward: %s: scoring %d rows failed: %s", self.client_address[0], len(request["query"]),
                      type(e).__name__)
            self._answer(500, {"error": f"scoring failed ({type(e).__name__}); see the server's log"})
            return
        # logged before the answer is sent, so that a client that has its answer also finds the line
        self.server.record(self.client_address[0], len(request["query"]), time.monotonic() - started, answer)
        self._answer(200, answer.payload())

    def _authorised(self) -> bool:
        """Whether the request carries the token (compared as bytes: the client sends the UTF-8 of
        "Bearer <token>", and http.server hands header bytes over decoded as latin-1); 401 if not."""
        expected = self.server.authorization
        given = self.headers.get("Authorization", "").encode("latin-1", "replace")
        if expected is None or hmac.compare_digest(given, expected):
            return True
        self._refuse(401, "missing or wrong bearer token (Authorization: Bearer <token>, in UTF-8)", unread=True)
        return False

    def _body_size(self) -> Optional[int]:
        """The body's length, or None once a refusal is answered, before reading a byte of it: 411
        without a Content-Length (or chunked), 400 for one that is no byte count, 413 over the cap."""
        values = self.headers.get_all("Content-Length") or []
        if not values or "Transfer-Encoding" in self.headers:
            self._refuse(411, "send the body with a Content-Length (chunked bodies are not accepted)", unread=True)
            return None
        value = values[0].strip()
        if len(set(values)) > 1 or not (value.isascii() and value.isdigit()):
            self._refuse(400, "the Content-Length header must be one byte count", unread=True)
            return None
        if int(value) > self.server.max_body_bytes:
            self._refuse(413, f"a body of {int(value)} bytes is over --max-body-mb={self.server.max_body_mb:g} "
                              f"({self.server.max_body_bytes} bytes); send fewer rows per request", unread=True)
            return None
        return int(value)

    def _answer(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, allow_nan=False).encode()
        self.connection.settimeout(self.server.socket_timeout_s)  # the deadline's last moments were for reading
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _refuse(self, status: int, reason: str, unread: bool = False) -> None:
        """Answers `status` with `reason` and logs it. `unread`: the body was left unread, so it is
        drained for up to LINGER_S (closing a socket with unread bytes resets it, and the client
        could lose the answer: nginx's lingering close)."""
        self._answer(status, {"error": reason})
        log.info("ppo-serve-reward: %s: refused %d: %s", self.client_address[0], status, reason)
        if not unread:
            return
        self.close_connection = True
        deadline = time.monotonic() + LINGER_S
        try:
            self.connection.shutdown(socket.SHUT_WR)
            while (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                if not self.connection.recv(1 << 16):
                    break
        except OSError:  # the client closed or reset first; a timeout ends the drain
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("ppo-serve-reward: " + format, *args)


class RewardServer(ThreadingHTTPServer):
    """The HTTP server around a `Score`: handler threads (`RewardHandler`) feed one `ScoringQueue`.
    `server_close()` also closes the queue and the scorer."""

    request_queue_size = 64  # connections waiting to be accepted: a burst of clients is not turned away

    def __init__(self, score: Score, host: str, port: int, token: Optional[str], max_body_mb: float,
                 socket_timeout_s: float):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.authorization = f"Bearer {token}".encode("utf-8", "surrogateescape") if token else None
        self.max_body_mb, self.max_body_bytes = max_body_mb, int(max_body_mb * 2**20)
        self.socket_timeout_s = socket_timeout_s
        self.totals: Counter = Counter()
        self.totals_lock = threading.Lock()
        self.in_flight = 0  # requests handed to scoring and not yet answered
        self.settled = threading.Condition()
        try:
            super().__init__((host, port), RewardHandler)
        except BaseException:
            getattr(score, "close", lambda: None)()
            raise
        self.scoring = ScoringQueue(score)
        warning = exposure_warning(self.server_address[0], token)
        if warning:
            log.warning(warning)

    def record(self, client: str, rows: int, seconds: float, answer: Answer) -> None:
        """Counts a served request and logs its line: rows, seconds, failed rows by reason; never data."""
        failed = sum(answer.failures.values())
        with self.totals_lock:
            self.totals.update(requests=1, rows=rows, failed=failed)
        line = f"ppo-serve-reward: {client}: {rows} rows in {seconds:.2f} s"
        if failed:
            reasons = "; ".join(f"{count} {reason}" for reason, count in answer.failures.items())
            scored_zero = ", scored 0 (--on-error zero)" if all(e is None for e in answer.errors) else ""
            line += f", {failed} failed ({reasons}){scored_zero}"
        log.info(line)

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """Counts a request as in flight from its submission until its answer is sent."""
        with self.settled:
            self.in_flight += 1
        try:
            yield
        finally:
            with self.settled:
                self.in_flight -= 1
                self.settled.notify_all()

    def summary(self) -> str:
        requests = self.totals["requests"]
        return (f"ppo-serve-reward: stopped after {requests} request{'' if requests == 1 else 's'}, "
                f"{self.totals['rows']} rows ({self.totals['failed']} failed)")

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that broke (reset, timed out while answering): one line, not a traceback."""
        log.warning("ppo-serve-reward: %s: the connection failed (%s)", client_address[0], sys.exc_info()[0].__name__)

    def server_close(self) -> None:
        """Stops listening, closes the scoring queue (the request being scored finishes), then waits
        until its answer is sent (a send is bounded by --socket-timeout-s), so the totals hold it."""
        super().server_close()
        self.scoring.close()
        with self.settled:
            self.settled.wait_for(lambda: self.in_flight == 0, timeout=self.socket_timeout_s)


def make_server(score: Score, host: str = "127.0.0.1", port: int = 5000, token: Optional[str] = None, *,
                max_body_mb: float = MAX_BODY_MB, socket_timeout_s: float = SOCKET_TIMEOUT_S) -> RewardServer:
    """The server around `score`, bound (`serve_forever()` runs it); it owns `score` from here on:
    it closes it when closed, or when binding fails."""
    return RewardServer(score, host, port, token, max_body_mb, socket_timeout_s)


def exposure_warning(host: str, token: Optional[str]) -> Optional[str]:
    """The warning for a server bound to the address `host` without a token where others can reach
    it: any address but loopback (0.0.0.0 and :: are every interface); None otherwise."""
    try:
        loopback = ipaddress.ip_address(host.partition("%")[0]).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if token or loopback:
        return None
    return (f"ppo-serve-reward: WARNING: listening on {host} without a token: anyone who can reach this port can make "
            "it run the function (or model) on what they send; use --token (or $PPO_REWARD_TOKEN), or --host 127.0.0.1")


DESCRIPTION = """\
Serves a reward function (--fn) or a reward model (--model) over HTTP in OpenRLHF's remote reward
protocol, for ppo-train's reward.remote.url (or OpenRLHF) on this or another machine.

Request: POST (any path; OpenRLHF posts to /get_reward) a JSON object, one value per query:
  {"query": [prompt + response, ...], "prompts": [prompt, ...], "labels": [ground truth, ...],
   "data_sources": [...], "extra_infos": [...], "messages": [the prompt's chat turns, ...]}
"query" is required, the rest optional (a function's response is the query less its prompt).
Answer (200):
  {"rewards": [r, ...], "scores": [the same], "extra_logs": {name: [number or null, ...]},
   "errors": [null, or why the row failed, ...]}
A row fails alone (the function raises, times out or returns no finite number; the model gives a
non-finite score): --on-error fail answers its reward null and the reason in "errors"; --on-error
zero answers 0.0 (for clients that know no "errors", e.g. OpenRLHF's). Refused: 401 (token), 411
or 400 (Content-Length), 413 (over --max-body-mb), 408 (slower than --socket-timeout-s), 400 (not
such an object), 500 (scoring itself failed). No error quotes the request or an exception's text.
GET answers {"ok": true}."""

EPILOG = """\
Security: the server runs the function on whatever is sent to it. It listens on 127.0.0.1 (this
machine only) unless --host says otherwise; anyone who can reach the port can make it run the
function, so on any other address give a token ($PPO_REWARD_TOKEN keeps it out of `ps`; clients
send reward.remote.token or $PPO_REWARD_TOKEN) and a firewall. It warns when it listens elsewhere
without one.

Example:
  export PPO_REWARD_TOKEN=s3cret
  ppo-serve-reward --fn my_rewards.py:compute_score --num-workers 4 --timeout-s 10 --port 5000
  ppo-train +experiment=gsm8k_cpu reward.fn=null reward.remote.url=http://127.0.0.1:5000/get_reward"""


def _above_zero(value: str) -> float:
    if not re.fullmatch(r"\d*\.?\d+|\d+\.", value) or float(value) <= 0:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {value!r}")
    return float(value)


def _count(value: str) -> int:
    if not (value.isascii() and value.isdigit()):
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {value!r}")
    return int(value)


def _port(value: str) -> int:
    if _count(value) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number, 0 to 65535, got {value!r}")
    return int(value)


def parser() -> argparse.ArgumentParser:
    """ppo-serve-reward's options; its --help is the server's manual (protocol, defaults, security)."""
    p = argparse.ArgumentParser(prog="ppo-serve-reward", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--fn", help="module:function or path/to/file.py:function (any reward.fn signature)")
    what.add_argument("--model", help="a reward model: a sequence classifier with one label (a folder or hub name)")
    p.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                   help="the address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 or :: every "
                        "interface)")
    p.add_argument("--port", type=_port, default=5000, metavar="N",
                   help="the port (default 5000; 0: a free one, logged)")
    p.add_argument("--token", help="a bearer token every request must carry (default $PPO_REWARD_TOKEN; neither: "
                                   "no token)")
    p.add_argument("--on-error", choices=("fail", "zero"), default="fail",
                   help="a failed row: fail answers null and its reason in errors; zero answers 0.0 (default fail)")
    p.add_argument("--max-body-mb", type=_above_zero, default=MAX_BODY_MB, metavar="MIB",
                   help=f"the largest request body, in MiB (default {MAX_BODY_MB:g}); larger ones get 413")
    p.add_argument("--socket-timeout-s", type=_above_zero, default=SOCKET_TIMEOUT_S, metavar="SECONDS",
                   help=f"a connection must deliver its whole request within this (default {SOCKET_TIMEOUT_S:g}); "
                        "an idle or trickling one is closed")
    p.add_argument("--batched", action="store_true",
                   help="--fn is called once per request (reward.batched; default: once per row)")
    p.add_argument("--num-workers", type=_count, default=0, metavar="N",
                   help="--fn: processes calling it concurrently (default 0: in the server's scoring thread)")
    p.add_argument("--timeout-s", type=_above_zero, default=None, metavar="SECONDS",
                   help="--fn: a bound on each call (default none: unbounded); it needs a worker process, so one "
                        "starts when --num-workers is 0")
    p.add_argument("--dtype", default="auto", help="--model: auto, bfloat16, float32 or float16 (default auto)")
    p.add_argument("--device", default="cpu", help="--model: cpu or cuda (default cpu)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="--model: run the model folder's code (default off)")
    return p


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the server as Ctrl-C does


def main(argv: Optional[list[str]] = None) -> None:
    """ppo-serve-reward: builds the scorer, serves until Ctrl-C or SIGTERM, then closes it and logs the
    totals. A bad --fn or --model, or an address it cannot listen on, exits 2 with one line."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    token = bearer_token(args.token)
    try:
        score = (function_scorer(args.fn, args.num_workers, args.timeout_s, args.batched, args.on_error) if args.fn
                 else model_scorer(args.model, args.dtype, args.device, args.trust_remote_code, args.on_error))
    except (ConfigError, RewardError, ValueError, OSError) as e:
        print(f"ppo-serve-reward: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        server = make_server(score, args.host, args.port, token, max_body_mb=args.max_body_mb,
                             socket_timeout_s=args.socket_timeout_s)
    except OSError as e:
        print(f"ppo-serve-reward: cannot listen on {args.host}:{args.port} ({e.strerror or e}); choose another --port "
              "or --host", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGTERM, _interrupt)
    host = f"[{args.host}]" if ":" in args.host else args.host
    log.info("ppo-serve-reward: serving %s on http://%s:%d/get_reward%s", args.fn or args.model, host,
             server.server_address[1], " (bearer token required)" if token else "")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        log.info("ppo-serve-reward: stopping: the request being scored finishes (Ctrl-C again: at once)")
    try:
        server.server_close()
    except KeyboardInterrupt:
        log.info("ppo-serve-reward: stopped without waiting for the request being scored")
    log.info(server.summary())


if __name__ == "__main__":
    main()
