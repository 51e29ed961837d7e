"""`ppo-serve-reward`: a reward function or a reward model served over HTTP in OpenRLHF's remote
reward protocol (`rewards/remote.py`), so that a run's `reward.remote.url`, or OpenRLHF, can score
on another machine (a judge on its own GPU, a sandbox that runs code).

    ppo-serve-reward --fn path/to/reward.py:compute_score --port 5000
    ppo-serve-reward --model path/to/reward-model --port 5000 --token "$REWARD_TOKEN"

It binds 127.0.0.1 unless --host says otherwise. With --token (or PPO_REWARD_TOKEN) a request
must carry `Authorization: Bearer <token>`. POST any path (OpenRLHF's clients post to
/get_reward); GET answers {"ok": true} for health checks."""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

log = logging.getLogger("ppo_trainer")

Score = Callable[[dict[str, list]], dict[str, Any]]  # a request's JSON -> the answer's JSON


def function_scorer(fn: str, num_workers: int = 0, timeout_s: Optional[float] = None, batched: bool = False) -> Score:
    """Scores rows with the reward function `fn` (any signature `reward.fn` takes): each response is
    its query less its prompt; labels are the ground truths."""
    from ppo_trainer.config.schema import RewardConfig
    from ppo_trainer.rewards.calling import RewardInput
    from ppo_trainer.rewards.scoring import build_scorer

    cfg = OmegaConf.structured(RewardConfig(fn=fn, num_workers=num_workers, timeout_s=timeout_s, batched=batched))
    scorer = build_scorer(cfg)

    def score(request: dict[str, list]) -> dict[str, Any]:
        queries, n = request["query"], len(request["query"])
        prompts = request.get("prompts") or [""] * n
        column = {key: request.get(key) or [None] * n for key in ("labels", "data_sources", "extra_infos", "messages")}
        rows = [RewardInput(q[len(p):] if q.startswith(p) else q, column["labels"][i], column["data_sources"][i] or "remote",
                            column["extra_infos"][i], p, column["messages"][i] or ())
                for i, (q, p) in enumerate(zip(queries, prompts))]
        scores = scorer.score(rows)
        names = sorted({k for extras in scores.extras for k, v in extras.items() if isinstance(v, float)})
        extra_logs = {k: [extras.get(k) if isinstance(extras.get(k), float) else None for extras in scores.extras]
                      for k in names}
        return {"rewards": scores.values, "scores": scores.values, "extra_logs": extra_logs}

    return score


def model_scorer(path: str, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False) -> Score:
    """Scores rows with a reward model: the prompt's chat turns and the response in the model's own
    template when the request carries `messages` (a ppo-train client does), else each query's text as
    it comes (OpenRLHF's clients send the conversation rendered)."""
    from ppo_trainer.engine.reward_model import RewardModelEngine
    from ppo_trainer.models.loading import resolve_model_path

    engine = RewardModelEngine(resolve_model_path(path), dtype=dtype, device=device, trust_remote_code=trust_remote_code)

    def score(request: dict[str, list]) -> dict[str, Any]:
        queries = request["query"]
        prompts = request.get("prompts") or [""] * len(queries)
        messages = request.get("messages")
        if messages and all(messages):
            responses = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
            values = engine.score_texts(messages, responses).tolist()
        else:
            values = engine.score_plain(queries).tolist()
        return {"rewards": values, "scores": values}

    return score


def make_server(score: Score, host: str = "127.0.0.1", port: int = 5000,
                token: Optional[str] = None) -> ThreadingHTTPServer:
    """The HTTP server around `score` (one request scored at a time: a function pool and a model are
    not shared between threads); `serve_forever()` runs it."""
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authorised(self) -> bool:
            if not token:
                return True
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given, f"Bearer {token}"):
                return True
            self._answer(401, {"error": "missing or wrong bearer token (Authorization: Bearer ...)"})
            return False

        def do_GET(self) -> None:  # noqa: N802
            if self._authorised():
                self._answer(200, {"ok": True})

        def do_POST(self) -> None:  # noqa: N802
            if not self._authorised():
                return
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if not isinstance(request, dict) or not isinstance(request.get("query"), list):
                    raise ValueError('expected a JSON object with "query": [texts]')
            except (ValueError, json.JSONDecodeError) as e:
                self._answer(400, {"error": str(e)})
                return
            try:
                with lock:
                    answer = score(request)
            except Exception as e:  # noqa: BLE001  (the client reports it, the server serves on)
                log.error("ppo-serve-reward: %s: %s", type(e).__name__, e)
                self._answer(500, {"error": f"{type(e).__name__}: {e}"})
                return
            self._answer(200, answer)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("ppo-serve-reward: " + format, *args)

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="ppo-serve-reward", description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--fn", help="module:function or path/to/file.py:function (any reward.fn signature)")
    what.add_argument("--model", help="a reward model: a sequence classifier with one label")
    parser.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--token", default=os.environ.get("PPO_REWARD_TOKEN"),
                        help="a bearer token every request must carry (default $PPO_REWARD_TOKEN)")
    parser.add_argument("--batched", action="store_true", help="--fn is called once per request (reward.batched)")
    parser.add_argument("--num-workers", type=int, default=0, help="--fn: processes scoring rows concurrently")
    parser.add_argument("--timeout-s", type=float, default=None, help="--fn: a bound on each call (needs workers)")
    parser.add_argument("--dtype", default="auto", help="--model: auto, bfloat16, float32 or float16")
    parser.add_argument("--device", default="cpu", help="--model: cpu or cuda")
    parser.add_argument("--trust-remote-code", action="store_true", help="--model: run the model folder's code")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from ppo_trainer.config.schema import ConfigError

    try:
        score = (function_scorer(args.fn, args.num_workers, args.timeout_s, args.batched) if args.fn
                 else model_scorer(args.model, args.dtype, args.device, args.trust_remote_code))
        server = make_server(score, args.host, args.port, args.token)
    except (ConfigError, OSError, ValueError) as e:
        print(f"ppo-serve-reward: {e}", file=sys.stderr)
        sys.exit(2)
    what = args.fn or args.model
    log.info("ppo-serve-reward: serving %s on http://%s:%d/get_reward%s", what, args.host, server.server_address[1],
             " (bearer token required)" if args.token else "")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
