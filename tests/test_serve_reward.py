"""ppo-serve-reward over real HTTP on 127.0.0.1: the body cap, socket timeouts, one scoring thread
behind concurrent handlers, per-row failures (`--on-error`), strict JSON answers, nothing of the
request or of an exception's text in an error, UTF-8 tokens, `--timeout-s` alone, the bind warning,
`--help`, and a clean SIGTERM."""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from ppo_trainer import serve_reward
from ppo_trainer.rewards.serving import function_scorer, model_scorer
from ppo_trainer.serve_reward import main, make_server

REPO = Path(__file__).resolve().parents[1]

JUDGE = """
import math, threading, time

active, lock = 0, threading.Lock()


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global active
    if ground_truth == "raise":
        raise ValueError(f"cannot read {solution_str!r}")  # quotes the row: must not reach an answer
    if ground_truth in ("nan", "inf"):
        return float(ground_truth)
    if ground_truth == "text":
        return "0.5"
    if ground_truth == "bool":
        return True
    if ground_truth == "slow":
        time.sleep(8)
    with lock:
        active += 1
        peak = active
    time.sleep(0.05)
    with lock:
        active -= 1
    extras = {"peak": float(peak), "thread": float(threading.get_ident()), "pred": solution_str}
    if ground_truth == "extras":
        extras.update(maybe=None, bad=math.nan)
    else:
        extras.update(maybe=1.5, bad=2.0)
    return {"score": 1.0, **extras}
"""


@pytest.fixture
def judge(tmp_path) -> str:
    (tmp_path / "judge.py").write_text(JUDGE)
    return f"{tmp_path / 'judge.py'}:compute_score"


@pytest.fixture
def served():
    """make_server(...) around a score on a free 127.0.0.1 port, served from a thread; yields a starter
    that returns (host, port); every server is shut down and closed afterwards."""
    servers = []

    def start(score: Any, **options: Any) -> tuple[str, int]:
        server = make_server(score, "127.0.0.1", 0, **options)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return "127.0.0.1", server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def request(address: tuple[str, int], body: Any = None, *, method: str = "POST", headers: Optional[dict] = None,
            timeout: float = 30.0) -> tuple[int, bytes]:
    """(status, raw body) of one real HTTP request; a dict `body` is sent as JSON."""
    connection = http.client.HTTPConnection(*address, timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    connection.request(method, "/get_reward", body=data,
                       headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    out = response.status, response.read()
    connection.close()
    return out


def strict_json(raw: bytes) -> Any:
    """The body parsed as strict JSON: NaN and Infinity (which Python's json writes by default) refused."""
    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(raw, parse_constant=refuse)


def raw_exchange(address: tuple[str, int], data: bytes, timeout: float = 10.0) -> bytes:
    """Sends `data` on a fresh connection and reads until the server closes it (b"" if it answers nothing)."""
    with socket.create_connection(address, timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


ROWS = {"query": ["Q: 1? 1", "Q: 2? 2"], "prompts": ["Q: 1? ", "Q: 2? "], "labels": ["1", "2"]}


# --- the body cap


def test_a_content_length_over_the_cap_is_answered_413_without_reading_the_body(served, judge):
    address = served(function_scorer(judge))
    started = time.monotonic()
    answer = raw_exchange(address, b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n")
    assert answer.startswith(b"HTTP/1.0 413 "), answer[:200]
    assert b"--max-body-mb" in answer and time.monotonic() - started < 5


def test_a_body_over_a_smaller_cap_is_413_and_under_it_is_scored(served, judge):
    address = served(function_scorer(judge), max_body_mb=0.001)  # 1048 bytes
    assert request(address, {**ROWS, "padding": "x" * 2000})[0] == 413
    assert request(address, ROWS)[0] == 200


def test_a_missing_or_invalid_content_length_is_411_or_400_at_once(served, judge):
    address = served(function_scorer(judge))
    missing = raw_exchange(address, b"POST /get_reward HTTP/1.1\r\nHost: x\r\n\r\n")
    chunked = raw_exchange(address, b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                    b"5\r\nhello\r\n0\r\n\r\n")
    invalid = raw_exchange(address, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
    assert missing.startswith(b"HTTP/1.0 411 ") and chunked.startswith(b"HTTP/1.0 411 ")
    assert invalid.startswith(b"HTTP/1.0 400 ") and b"Content-Length" in invalid


# --- socket timeouts


def handler_threads() -> int:
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def test_an_idle_connection_is_closed_and_its_thread_ends(served, judge):
    address = served(function_scorer(judge), socket_timeout_s=0.5)
    started = time.monotonic()
    with socket.create_connection(address, timeout=10) as idle:
        assert idle.recv(1) == b"", "the server closes a connection that sends nothing"
    assert time.monotonic() - started < 5
    deadline = time.monotonic() + 5
    while handler_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert handler_threads() == 0


def test_a_trickling_client_is_answered_408_at_the_socket_timeout(served, judge):
    address = served(function_scorer(judge), socket_timeout_s=1.0)
    started = time.monotonic()
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(100):  # a byte every 0.1 s until the server answers: each read is quick, the whole never ends
            s.sendall(b" ")
            if select.select([s], [], [], 0.1)[0]:
                break
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.0 408 ") and time.monotonic() - started < 5


# --- concurrency: handlers in parallel, one scoring thread


def test_four_requests_at_once_are_all_answered_by_one_scoring_thread(served, judge):
    address = served(function_scorer(judge))
    answers: list = [None] * 4

    def ask(i: int) -> None:
        answers[i] = request(address, ROWS)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    bodies = [strict_json(raw) for status, raw in answers if status == 200]
    assert len(bodies) == 4 and all(b["rewards"] == [1.0, 1.0] for b in bodies)
    assert max(p for b in bodies for p in b["extra_logs"]["peak"]) == 1.0, "the function never ran twice at once"
    assert len({t for b in bodies for t in b["extra_logs"]["thread"]}) == 1, "one thread owns the scorer"


# --- per-row failures and what an answer holds


def test_a_failed_row_fails_alone_with_a_reason_that_quotes_no_data(served, judge):
    address = served(function_scorer(judge))
    labels = ["1", "raise", "nan", "inf", "text", "bool"]
    rows = {"query": [f"Q: SECRET-{i} a" for i in range(6)], "prompts": ["Q: "] * 6, "labels": labels}
    status, raw = request(address, rows)
    assert status == 200 and b"SECRET" not in raw
    answer = strict_json(raw)
    assert answer["rewards"] == [1.0, None, None, None, None, None] and answer["scores"] == answer["rewards"]
    invalid = "the reward function returned no valid score (a finite number, or a dict with one under 'score')"
    assert answer["errors"] == [None, "the reward function raised ValueError", invalid, invalid, invalid, invalid]


def test_on_error_zero_scores_a_failed_row_0_and_the_log_line_counts_it(served, judge, caplog):
    caplog.set_level(logging.INFO, logger="ppo_trainer")
    address = served(function_scorer(judge, on_error="zero"))
    status, raw = request(address, {"query": ["a SECRET", "b"], "labels": ["raise", "1"]})
    assert status == 200 and strict_json(raw)["rewards"] == [0.0, 1.0] and strict_json(raw)["errors"] == [None, None]
    line = next(r.getMessage() for r in caplog.records if "rows in" in r.getMessage())
    assert "2 rows in" in line and "1 failed" in line and "raised ValueError" in line and "scored 0" in line
    assert "SECRET" not in caplog.text


def test_extra_logs_hold_numbers_or_null_and_the_answer_is_strict_json(served, judge):
    address = served(function_scorer(judge))
    status, raw = request(address, {"query": ["a", "b", "c"], "labels": ["1", "extras", "raise"]})
    logs = strict_json(raw)["extra_logs"]
    assert status == 200 and set(logs) == {"peak", "thread", "maybe", "bad"}, "text extras (pred) are left out"
    assert logs["maybe"] == [1.5, None, None] and logs["bad"] == [2.0, None, None]


def test_a_reward_models_non_finite_score_fails_its_row(served, monkeypatch):
    class Engine:
        def __init__(self, path, **options):
            pass

        def score_plain(self, texts):
            return FakeTensor([1.0, math.nan, math.inf][: len(texts)])

    class FakeTensor(list):
        def tolist(self):
            return list(self)

    monkeypatch.setattr("ppo_trainer.engine.reward_model.RewardModelEngine", Engine)
    monkeypatch.setattr("ppo_trainer.models.loading.resolve_model_path", lambda path: path)
    monkeypatch.setattr("ppo_trainer.models.loading.model_path_problem", lambda path, key: None)
    status, raw = request(served(model_scorer("a-model")), {"query": ["x", "y", "z"]})
    answer = strict_json(raw)
    assert status == 200 and answer["rewards"] == [1.0, None, None]
    assert answer["errors"] == [None, "the reward model gave no finite score", "the reward model gave no finite score"]


def test_a_scoring_crash_is_a_500_that_names_the_type_but_not_the_text(served, caplog):
    def broken(request):
        raise RuntimeError(f"the judge choked on {request['query'][0]}")

    status, raw = request(served(broken), {"query": ["SECRET-ROW"]})
    assert status == 500 and b"RuntimeError" in raw and b"SECRET" not in raw and b"choked" not in raw
    assert "RuntimeError" in caplog.text and "SECRET" not in caplog.text


def test_a_malformed_request_is_a_400_that_names_the_key_and_echoes_nothing(served, judge):
    address = served(function_scorer(judge))
    short = request(address, {"query": ["SECRET a", "SECRET b"], "labels": ["1"]})
    nested = request(address, b"[" * 100000 + b"]" * 100000)
    not_text = request(address, {"query": [["SECRET"]]})
    assert short[0] == 400 and b'\\"labels\\" has 1 values for 2 queries' in short[1] and b"SECRET" not in short[1]
    assert nested[0] == 400 and not_text[0] == 400 and b"SECRET" not in not_text[1]


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_an_ipv6_address_is_served(judge):
    server = make_server(function_scorer(judge), "::1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        status, raw = request(("::1", server.server_address[1]), ROWS)
    finally:
        server.shutdown()
        server.server_close()
    assert status == 200 and strict_json(raw)["rewards"] == [1.0, 1.0]


# --- the token


def test_a_non_ascii_token_is_compared_as_utf8_bytes(served, judge):
    token = "clé-ünïcode"
    address = served(function_scorer(judge), token=token)
    right = {"Authorization": f"Bearer {token}".encode()}
    status, raw = request(address, ROWS, headers=right)
    assert status == 200 and strict_json(raw)["rewards"] == [1.0, 1.0]
    assert request(address, ROWS, headers={"Authorization": "Bearer cle-unicode".encode()})[0] == 401
    assert request(address, method="GET", headers=right) == (200, b'{"ok": true}')
    assert request(address, method="GET")[0] == 401


# --- --timeout-s alone, the bind warning, --help


def test_timeout_without_workers_starts_one_worker_and_says_so(served, judge, caplog):
    caplog.set_level(logging.INFO, logger="ppo_trainer")
    score = function_scorer(judge, timeout_s=1.0)
    assert "--timeout-s needs a worker process: starting one (--num-workers 1)" in caplog.text
    started = time.monotonic()
    status, raw = request(served(score), {"query": ["a", "b"], "labels": ["1", "slow"]})
    answer = strict_json(raw)
    assert status == 200 and answer["rewards"] == [1.0, None] and time.monotonic() - started < 6
    assert answer["errors"][1] == "the reward function did not return within --timeout-s=1 s"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "10.1.2.3"])
def test_a_non_loopback_bind_without_a_token_is_warned_about(host):
    warning = serve_reward.exposure_warning(host, token=None)
    assert warning is not None and host in warning and "--token" in warning
    assert "run the function" in warning and serve_reward.exposure_warning(host, token="t") is None


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "::1"])
def test_a_loopback_bind_is_not_warned_about(host):
    assert serve_reward.exposure_warning(host, token=None) is None


def test_help_gives_the_protocol_every_option_with_its_default_and_an_example(capsys, monkeypatch):
    monkeypatch.setenv("PPO_REWARD_TOKEN", "from-the-env")
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines where the terminal's width says
    assert exit_info.value.code == 0 and "from-the-env" not in text
    for part in ('"query"', '"prompts"', '"labels"', '"rewards"', '"extra_logs"', '"errors"', "Example",
                 "--max-body-mb", "default 64", "--socket-timeout-s", "default 60", "--on-error",
                 "default fail", "--port", "default 5000", "--host", "default 127.0.0.1", "--timeout-s",
                 "--num-workers", "default 0", "PPO_REWARD_TOKEN", "anyone who can reach"):
        assert part in text, part


def test_an_option_out_of_range_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--fn", "x.py:f", "--max-body-mb", "0"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "argument --max-body-mb: must be a number above 0, got '0'" in err


# --- shutdown


def test_sigterm_shuts_down_cleanly_with_a_summary_line_and_the_token_from_the_environment(judge, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PPO_REWARD_TOKEN": "tök-from-env"}
    process = subprocess.Popen([sys.executable, "-m", "ppo_trainer.serve_reward", "--fn", judge, "--num-workers", "1",
                                "--port", "0"], stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        lines = []
        while not any("serving" in line for line in lines):
            line = process.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        port = int(lines[-1].split("http://127.0.0.1:")[1].split("/")[0])
        assert request(("127.0.0.1", port), ROWS)[0] == 401
        assert request(("127.0.0.1", port), ROWS, headers={"Authorization": "Bearer tök-from-env".encode()})[0] == 200
        process.send_signal(signal.SIGTERM)
        rest = process.communicate(timeout=30)[1]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, rest
    assert "stopped after 1 request, 2 rows (0 failed)" in rest and "tök" not in "".join(lines) + rest
