"""Multi-turn rollouts: the episode loop against a scripted environment (budgets, end reasons,
resets, sampling overrides, seeds), the rollout layout it builds, its metrics, and, on both real
samplers, that the sampler's logprobs of the policy's tokens are those of a full forward over the
whole episode."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import torch

from ppo_trainer.config.schema import MultiTurnConfig
from ppo_trainer.rollout import HFSampler, MultiTurnSampler, multi_turn_metrics, prompts_to_batch
from ppo_trainer.rollout.base import Completion, RowSampling

from .conftest import load_model, reference_logprobs, sampler_config


@dataclass
class Turn:
    """A stand-in for `agents.TurnOutcome`."""

    observation_ids: list[int] = field(default_factory=list)
    observation_cut: bool = False
    messages: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    end_reason: Optional[str] = None
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    extra_logs: dict[str, float] = field(default_factory=dict)
    sampling_params: Optional[dict] = None


@dataclass
class Reset:
    """A stand-in for `agents.ResetOutcome`."""

    observation: Optional[str] = None
    error: Optional[str] = None
    timeout: bool = False


class ScriptedEpisodes:
    """A stand-in for `agents.Episodes`: `script(row, turn, action_text)` gives each step's Turn;
    every call is recorded."""

    def __init__(self, script: Callable[[int, int, str], Turn], resets: Optional[list[Reset]] = None) -> None:
        self.script, self.resets = script, resets
        self.turn_of: dict[int, int] = {}
        self.reset_calls: list[tuple] = []
        self.step_calls: list[tuple] = []
        self.closed = False

    def reset(self, prompts, labels, data_sources, extra_infos):
        self.reset_calls.append((prompts, labels, data_sources, extra_infos))
        return self.resets or [Reset() for _ in prompts]

    def step(self, indices, action_texts, observation_texts, closed=None):
        self.step_calls.append((list(indices), list(action_texts), list(observation_texts)))
        self.closed_calls = getattr(self, "closed_calls", []) + [list(closed or [])]
        turns = []
        for row, text in zip(indices, action_texts):
            turn = self.turn_of.get(row, 0)
            self.turn_of[row] = turn + 1
            turns.append(self.script(row, turn, text))
        return turns

    def close(self):
        self.closed = True


class ScriptedSampler:
    """An inner sampler whose every action is ACTION_TOKENS (cut to the row's max_new_tokens:
    then not stopped), logprob -0.5 each; records each call's contexts, seeds and settings."""

    ACTION_TOKENS = [60, 61, 2]
    pad_id = 2
    eos_ids = [2]

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.synced = 0

    def complete(self, contexts, seeds, settings, greedy=False):
        self.calls.append(([list(c) for c in contexts], list(seeds), list(settings), greedy))
        out = []
        for setting in settings:
            ids = self.ACTION_TOKENS[: setting.max_new_tokens]
            out.append(Completion(ids, [-0.5] * len(ids), len(ids) == len(self.ACTION_TOKENS), "a" * len(ids)))
        return out

    def finish_weight_sync(self):
        self.synced += 1


class LabellingSampler(ScriptedSampler):
    """A partial rollouts' inner sampler: each action's tokens carry the policy version it holds, which
    a push between turns raises (here: every `complete` call is one push later)."""

    version = 3

    def complete(self, contexts, seeds, settings, greedy=False):
        actions = super().complete(contexts, seeds, settings, greedy)
        self.version += 1
        return [dataclasses.replace(a, versions=[self.version - 1] * len(a.token_ids)) for a in actions]

    def set_policy_version(self, version):
        self.version = version


class CharTokenizer:
    """Token i <-> character chr(i); ids 1 and 2 are special tokens (2: EOS and pad)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i in (1, 2)))

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def multi_turn(script, *, resets=None, inner=None, tokenizer=None, max_new_tokens=12, **multi_turn_cfg):
    """A MultiTurnSampler around `inner` (a ScriptedSampler by default) with sampler.multi_turn
    `multi_turn_cfg`; returns it and its ScriptedEpisodes."""
    episodes = ScriptedEpisodes(script, resets)
    cfg = sampler_config(max_new_tokens=max_new_tokens, multi_turn=MultiTurnConfig(tools=["calculator"],
                                                                                   **multi_turn_cfg))
    sampler = MultiTurnSampler(inner or ScriptedSampler(), cfg, tokenizer or CharTokenizer(), lambda: episodes)
    return sampler, episodes


def two_prompts(**fields: Any):
    return prompts_to_batch([[10, 11, 12], [13]], pad_id=2, ground_truth=["g0", "g1"], **fields)


OBSERVATION = [40, 41]


def answer_then_finish(row, turn, text):
    """Turn 0: a tool result (2 tokens), reward 0.5; turn 1: done, reward 1."""
    if turn == 0:
        return Turn(OBSERVATION, messages=[{"role": "tool", "content": "()"}], reward=0.5, tool_calls=1,
                    extra_logs={"hits": float(row)})
    return Turn(reward=1.0, done=True, end_reason="env_done", messages=[{"role": "environment", "content": "ok"}])


def test_actions_and_observations_share_one_response_block_with_observations_out_of_the_mask():
    sampler, episodes = multi_turn(answer_then_finish)
    out = sampler.generate(two_prompts(), 1, seed=0)
    P = 3
    assert out.prompt_length == P and out.response_length == 8
    assert out.response_ids.tolist() == [[60, 61, 2, 40, 41, 60, 61, 2]] * 2
    assert out.response_mask.tolist() == [[1, 1, 1, 0, 0, 1, 1, 1]] * 2
    assert out.attention_mask.tolist() == [[1, 1, 1] + [1] * 8, [0, 0, 1] + [1] * 8]  # observations attended
    assert out.position_ids.tolist() == [list(range(11)), [0, 0] + list(range(9))]  # counting on through them
    assert out.sample_logprobs.tolist() == [[-0.5, -0.5, -0.5, 0, 0, -0.5, -0.5, -0.5]] * 2
    assert out.turn_rewards.tolist() == [[0, 0, 0.5, 0, 0, 0, 0, 1.0]] * 2  # on each action's last token
    assert out.truncated.tolist() == [False, False]
    assert out.response_text == ["aaa()aaa"] * 2  # the whole block, observations decoded
    assert out.episodes[1] == {
        "turns": [{"role": "assistant", "content": "aaa", "reward": 0.5}, {"role": "tool", "content": "()"},
                  {"role": "assistant", "content": "aaa", "reward": 1.0}, {"role": "environment", "content": "ok"}],
        "num_turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0, "observation_tokens": 2,
        "end": "env_done", "extra_logs": {"hits": 1.0}}
    assert out.ground_truth == ["g0", "g1"] and episodes.closed


def test_with_partial_rollouts_each_action_keeps_its_versions_and_observations_carry_none():
    inner = LabellingSampler()
    sampler, _ = multi_turn(answer_then_finish, inner=inner)
    out = sampler.generate(two_prompts(), 1, seed=0)
    assert out.token_version.tolist() == [[3, 3, 3, 0, 0, 4, 4, 4]] * 2  # the second turn after a push
    sampler.set_policy_version(9)  # the label reaches the inner engine
    assert inner.version == 9
    assert multi_turn(answer_then_finish)[0].generate(two_prompts(), 1, seed=0).token_version is None


def test_each_turn_continues_the_whole_episode_and_the_environment_sees_the_text_before_the_action():
    inner = ScriptedSampler()
    sampler, episodes = multi_turn(answer_then_finish, inner=inner)
    sampler.generate(two_prompts(), 1, seed=0)
    assert [c[0] for c in inner.calls] == [[[10, 11, 12], [13]],
                                           [[10, 11, 12, 60, 61, 2, 40, 41], [13, 60, 61, 2, 40, 41]]]
    (prompts, labels, _, _), = episodes.reset_calls
    assert prompts == ["\n\x0b\x0c", "\r"] and labels == ["g0", "g1"]
    assert episodes.step_calls[1] == ([0, 1], ["aaa", "aaa"], ["\n\x0b\x0c<=\x02()", "\r<=\x02()"])


def test_n_episodes_per_prompt_are_adjacent_rows_and_draw_their_own_seeds():
    inner = ScriptedSampler()
    sampler, episodes = multi_turn(answer_then_finish, inner=inner)
    out = sampler.generate(two_prompts(), 2, seed=5)
    assert out.ground_truth == ["g0", "g0", "g1", "g1"]
    assert episodes.reset_calls[0][1] == ["g0", "g0", "g1", "g1"]
    seeds = [s for call in inner.calls for s in call[1]]
    assert len(set(seeds)) == 8  # 4 rows x 2 turns
    again = ScriptedSampler()
    multi_turn(answer_then_finish, inner=again)[0].generate(two_prompts(), 2, seed=5)
    assert [c[1] for c in again.calls] == [c[1] for c in inner.calls]


def never_done(row, turn, text):
    return Turn([40] * 5, reward=0.25)


def test_an_episode_ends_after_max_turns_and_its_last_observation_stays_out_of_the_block():
    sampler, _ = multi_turn(never_done, max_turns=2, max_response_tokens=100)
    out = sampler.generate(two_prompts(), 1, seed=0)
    assert out.response_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]
    assert [e["end"] for e in out.episodes] == ["max_turns"] * 2
    assert not out.truncated.any()


def test_the_response_budget_caps_each_action_and_cuts_the_observation_that_does_not_fit():
    """Budget 10: action 3, observation 5, then an action of the 2 tokens left (not stopped:
    truncated), whose observation has no room."""
    inner = ScriptedSampler()
    sampler, _ = multi_turn(never_done, inner=inner, max_turns=5, max_response_tokens=10)
    out = sampler.generate(two_prompts(), 1, seed=0)
    assert [s.max_new_tokens for s in inner.calls[1][2]] == [2, 2]
    assert out.response_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 1, 1]
    assert [e["end"] for e in out.episodes] == ["max_response_tokens"] * 2 and out.truncated.all()
    assert out.turn_rewards[0].tolist() == [0, 0, 0.25, 0, 0, 0, 0, 0, 0, 0.25]

    sampler, _ = multi_turn(never_done, max_turns=5, max_response_tokens=6)  # room for 3 of the 5 tokens
    out = sampler.generate(two_prompts(), 1, seed=0)
    assert out.response_ids[0].tolist() == [60, 61, 2, 40, 40, 40] and out.response_mask[0].tolist() == [1, 1, 1, 0, 0, 0]
    assert out.episodes[0]["end"] == "max_response_tokens" and out.episodes[0]["observation_tokens"] == 3


def test_without_max_response_tokens_the_budget_is_max_turns_times_action_and_observation():
    """3 x (4 + 1) = 15 tokens: action 3, observation 5, action 3, then 4 of the 5 observation tokens."""
    sampler, _ = multi_turn(never_done, max_new_tokens=4, max_turns=3, max_observation_tokens=1)
    out = sampler.generate(two_prompts(), 1, seed=0)
    assert out.response_length == 15 and out.response_mask[0].tolist() == [1] * 3 + [0] * 5 + [1] * 3 + [0] * 4
    assert out.episodes[0]["end"] == "max_response_tokens"


def ended_by_the_policy(row, turn, text):
    if row == 0:
        return Turn(done=True, end_reason="no_tool_call")
    return Turn(OBSERVATION, tool_calls=2, tool_errors=1, tool_timeouts=1, extra_logs={"score": 2.0 * turn})


def test_episodes_that_end_early_stop_generating_while_the_others_go_on():
    inner = ScriptedSampler()
    sampler, episodes = multi_turn(ended_by_the_policy, inner=inner, max_turns=3, max_response_tokens=50)
    out = sampler.generate(two_prompts(), 1, seed=0)
    assert [len(c[0]) for c in inner.calls] == [2, 1, 1]
    assert [call[0] for call in episodes.step_calls] == [[0, 1], [1], [1]]
    assert out.response_mask[0].tolist() == [1, 1, 1] + [0] * 10
    assert [e["end"] for e in out.episodes] == ["no_tool_call", "max_turns"]
    metrics = multi_turn_metrics(out)
    assert metrics == {
        "num_turns/mean": 2.0, "num_turns/max": 3.0, "num_turns/min": 1.0, "multi_turn/tool_calls/mean": 3.0,
        "multi_turn/tool_errors": 3.0, "multi_turn/tool_timeouts": 3.0, "multi_turn/observation_tokens/mean": 2.0,
        "multi_turn/end/env_done": 0.0, "multi_turn/end/no_tool_call": 0.5, "multi_turn/end/env_error": 0.0,
        "multi_turn/end/max_turns": 0.5,
        "multi_turn/end/max_response_tokens": 0.0, "multi_turn/env/score": 2.0}


def test_the_environments_sampling_params_set_the_next_turn_and_greedy_reaches_the_sampler():
    def script(row, turn, text):
        return Turn(OBSERVATION, sampling_params={"temperature": 0.3, "max_tokens": 2, "top_k": 5} if row else None)

    inner = ScriptedSampler()
    sampler, _ = multi_turn(script, inner=inner, max_turns=2, max_response_tokens=50)
    sampler.generate(two_prompts(), 1, seed=0, greedy=True, temperature=0.9)
    assert inner.calls[0][2] == [RowSampling(12, 0.9)] * 2
    assert inner.calls[1][2] == [RowSampling(12, 0.9), RowSampling(2, 0.3, None, 5)]
    assert all(call[3] for call in inner.calls)


def test_a_reset_that_returns_text_replaces_that_rows_prompt():
    resets = [Reset("ABCDE", error="reset raised"), Reset()]
    inner = ScriptedSampler()
    sampler, _ = multi_turn(answer_then_finish, resets=resets, inner=inner)
    out = sampler.generate(two_prompts(), 1, seed=0)
    assert out.prompt_length == 5
    assert out.input_ids[:, :5].tolist() == [[65, 66, 67, 68, 69], [2, 2, 2, 2, 13]]
    assert out.position_ids[1, :7].tolist() == [0, 0, 0, 0, 0, 1, 2]
    assert inner.calls[0][0] == [[65, 66, 67, 68, 69], [13]]
    assert out.episodes[0]["tool_errors"] == 1


def test_the_environments_are_closed_when_a_turn_fails():
    def broken(row, turn, text):
        raise RuntimeError("boom")

    sampler, episodes = multi_turn(broken)
    with pytest.raises(RuntimeError, match="boom"):
        sampler.generate(two_prompts(), 1, seed=0)
    assert episodes.closed


def test_weight_sync_goes_to_the_inner_sampler():
    inner = ScriptedSampler()
    sampler, _ = multi_turn(answer_then_finish, inner=inner)
    sampler.finish_weight_sync()
    assert inner.synced == 1


# --- real samplers: the policy's logprobs over a whole episode -------------------------------------


def tool_answer(tokenizer) -> Callable[[int, int, str], Turn]:
    """Every turn but the third answers with a chat-formatted tool message of varying length."""
    def script(row, turn, text):
        if turn == 2:
            return Turn(done=True, end_reason="no_tool_call", reward=1.0)
        body = f"{tokenizer.eos_token}\n<|im_start|>tool\n{'7' * (row + turn + 1)}{tokenizer.eos_token}\n" \
               "<|im_start|>assistant\n"
        return Turn(tokenizer(body, add_special_tokens=False)["input_ids"], reward=0.5)
    return script


@pytest.fixture(params=["hf", "vllm"])
def inner_sampler(request, eos_model_dir, eos_state):
    if request.param == "hf":
        return HFSampler(eos_model_dir, sampler_config(temperature=0.8), batch_size=3)
    engine = request.getfixturevalue("vllm_sampler")
    engine.load_weight_bucket(eos_state)
    engine.finish_weight_sync()
    engine.cfg = sampler_config(temperature=0.8)
    return engine


def test_the_samplers_logprobs_of_every_action_equal_a_full_forward_over_the_episode(inner_sampler, prompts, tokenizer,
                                                                                   eos_model_dir):
    """The rollout correction's premise: each turn's context is exactly the episode so far, so the
    policy's logprobs over the assembled rows (observations attended) are the sampler's."""
    cfg = dataclasses.replace(inner_sampler.cfg, multi_turn=MultiTurnConfig(tools=["calculator"], max_turns=3,
                                                                            max_response_tokens=60))
    episodes = ScriptedEpisodes(tool_answer(tokenizer))
    sampler = MultiTurnSampler(inner_sampler, cfg, tokenizer, lambda: episodes)
    out = sampler.generate(prompts, 2, seed=1)
    observations = (out.response_mask == 0) & (out.attention_mask[:, out.prompt_length :] == 1)
    assert observations.any() and max(e["num_turns"] for e in out.episodes) == 3
    expected = reference_logprobs(load_model(eos_model_dir), out, temperature=0.8)
    mask = out.response_mask.bool()
    assert (expected[mask] - out.sample_logprobs[mask]).abs().max() < 1e-4
    assert not out.sample_logprobs[~mask].any()
    again = MultiTurnSampler(inner_sampler, cfg, tokenizer, lambda: ScriptedEpisodes(tool_answer(tokenizer)))
    assert torch.equal(again.generate(prompts, 2, seed=1).input_ids, out.input_ids)


def test_vllm_reuses_the_previous_turns_blocks(vllm_sampler, tokenizer, monkeypatch):
    """A context of more than one KV block: its next turn's request finds the block cached."""
    block = vllm_sampler.llm.llm_engine.vllm_config.cache_config.block_size
    cached: list[list[int]] = []
    generate = vllm_sampler.llm.generate

    def spy(*args, **kwargs):
        outputs = generate(*args, **kwargs)
        cached.append([o.num_cached_tokens for o in outputs])
        return outputs

    monkeypatch.setattr(vllm_sampler.llm, "generate", spy)
    prompt = tokenizer("1 + 2 = ? " * (block // 10 + 1), add_special_tokens=False)["input_ids"][: block + 4]
    first = vllm_sampler.complete([prompt], [0], [RowSampling(4)])[0]
    vllm_sampler.complete([prompt + first.token_ids + [5, 6]], [1], [RowSampling(4)])
    assert cached == [[0], [block]]


def test_build_sampler_wraps_the_engine_when_an_environment_or_tools_answer(tiny_model_dir, monkeypatch):
    import ppo_trainer.rollout as rollout

    made = []
    monkeypatch.setattr(rollout, "episodes_factory",
                        lambda cfg, tokenizer, chat_template_kwargs=None: made.append((cfg, tokenizer)) or list)
    plain = rollout.build_sampler(sampler_config(name="hf"), tiny_model_dir)
    assert isinstance(plain, HFSampler) and made == []
    cfg = sampler_config(name="hf", multi_turn=MultiTurnConfig(env="envs.py:Game"))
    wrapped = rollout.build_sampler(cfg, tiny_model_dir)
    assert isinstance(wrapped, MultiTurnSampler) and isinstance(wrapped.inner, HFSampler)
    assert made == [(cfg, wrapped.inner.tokenizer)] and wrapped.tokenizer is wrapped.inner.tokenizer


def test_a_multi_turn_vllm_engine_holds_the_prompt_and_the_whole_response_block(monkeypatch):
    import ppo_trainer.rollout as rollout

    class Engine:
        def __init__(self, model_dir, cfg, **kwargs):
            self.max_model_len, self.pad_id, self.eos_ids = kwargs["max_model_len"], 0, [0]
            self.llm = self

        def get_tokenizer(self):
            return "tokenizer"

    monkeypatch.setattr(rollout, "VllmSampler", Engine)
    monkeypatch.setattr(rollout, "episodes_factory", lambda cfg, tokenizer, chat_template_kwargs=None: list)
    cfg = sampler_config(name="vllm", max_new_tokens=10,
                         multi_turn=MultiTurnConfig(tools=["calculator"], max_turns=2, max_observation_tokens=5))
    sampler = rollout.build_sampler(cfg, "model", max_prompt_length=50)
    assert sampler.inner.max_model_len == 50 + 2 * (10 + 5) and sampler.tokenizer == "tokenizer"
    assert rollout.build_sampler(dataclasses.replace(cfg, multi_turn=MultiTurnConfig()), "model",
                                 max_prompt_length=50).max_model_len == 60
