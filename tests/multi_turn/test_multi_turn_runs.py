"""Multi-turn runs end to end on the smoke experiment with an environment written as an OpenRLHF
agent file (only its import changed): what a step logs and records, the rewards on their turns,
an exact resume, and the config errors that come before any model loads (exit 2, naming the key)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppo_trainer.config import metric_names
from ppo_trainer.config.composition import compose
from ppo_trainer.trainer import run_training

# An OpenRLHF agent file (`--train.agent_func_path`) with `from openrlhf.utils.agent import
# AgentInstanceBase` changed to ppo-trainer's: async methods, a 0-d tensor reward, feedback appended
# verbatim, sampling_params for the next turn, extra_logs.
OPENRLHF_AGENT = '''
import torch
from ppo_trainer.agents import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.step_idx += 1
        done = self.step_idx >= 2
        return {
            "rewards": torch.tensor(0.25 * self.step_idx),
            "scores": torch.tensor(0.25 * self.step_idx),
            "environment_feedback": "" if done else "\\nTry again: ",
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"dummy_scores": torch.tensor(float(self.step_idx))},
        }
'''
RUN = ["+experiment=smoke", "trainer.loggers=[jsonl]", "trainer.total_steps=4", "trainer.save_every=2",
       "sampler.multi_turn.max_turns=2", "algorithm.entropy_coef=0.01"]


def read_metrics(output_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def agent_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("agent") / "agent_func.py"
    path.write_text(OPENRLHF_AGENT)
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, agent_file) -> Path:
    out = tmp_path_factory.mktemp("multi_turn")
    run_training(compose([*RUN, f"sampler.multi_turn.env={agent_file}:AgentInstance", f"trainer.output_dir={out}"]))
    return out


def test_every_step_logs_the_episodes_and_the_environments_rewards_count(uninterrupted):
    metrics = read_metrics(uninterrupted)
    cfg = compose([*RUN, "sampler.multi_turn.env=x.py:A"])
    for step in (1, 2, 3, 4):
        m = metrics[step]
        assert set(metric_names.MULTI_TURN) <= set(m), step
        # the tiny random model never ends a turn early here: two turns, the environment says done
        assert m["num_turns/mean"] == 2.0 and m["multi_turn/end/env_done"] == 1.0, step
        assert m["multi_turn/env/dummy_scores"] == 1.5 and m["multi_turn/env/scores"] == 0.375
        assert m["multi_turn/observation_tokens/mean"] > 0
        # 0.25 + 0.5 from the environment; the math reward gives the random model 0
        assert m["critic/score/mean"] == pytest.approx(0.75)
    assert {k for k in metrics[4] if not metric_names.PATTERNS[-1].fullmatch(k)} - {"step"} <= \
        metric_names.produced(cfg, True) | {k for k in metrics[4] if k.startswith("val/")}


def test_samples_and_validation_records_hold_each_conversation_as_turns(uninterrupted):
    sample = json.loads((uninterrupted / "samples.jsonl").read_text().splitlines()[-1])
    roles = [turn["role"] for turn in sample["turns"]]
    assert roles == ["assistant", "environment", "assistant"]
    assert [t.get("reward") for t in sample["turns"] if t["role"] == "assistant"] == [0.25, 0.5]
    assert sample["turns"][1]["content"] == "\nTry again: "
    assert sample["response"] == "".join(turn["content"] for turn in sample["turns"])  # the whole block
    row = json.loads((uninterrupted / "val_generations" / "step_4.jsonl").read_text().splitlines()[0])
    assert [turn["role"] for turn in row["turns"]] == ["assistant", "environment", "assistant"]
    assert row["score"] == pytest.approx(0.75)  # validation adds the environment's rewards too


def test_a_resumed_multi_turn_run_equals_the_uninterrupted_one(uninterrupted, agent_file, tmp_path,
                                                               assert_resumed_like):
    run = [*RUN, f"sampler.multi_turn.env={agent_file}:AgentInstance", f"trainer.output_dir={tmp_path}"]
    run_training(compose([*run, "trainer.stop_after_steps=2"]))
    run_training(compose(run))  # the same command resumes
    assert_resumed_like(uninterrupted, tmp_path, (3, 4))


def test_a_resume_with_another_environment_is_refused(uninterrupted, tmp_path, capsys):
    import shutil

    from ppo_trainer.cli import train_main

    shutil.copytree(uninterrupted, tmp_path / "run")
    with pytest.raises(SystemExit) as exit_info:
        train_main([*RUN, "sampler.multi_turn.env=ppo_trainer.agents.tasks:RevealDigit",
                    f"trainer.output_dir={tmp_path / 'run'}", "trainer.total_steps=5"])
    assert exit_info.value.code == 2
    assert "sampler.multi_turn.env" in capsys.readouterr().err


BAD_ENV = '''
class NoStep:
    def reset(self, states):
        return states
'''
BAD_TOOL = '''
def lookup(key):
    return key
'''


@pytest.mark.usefixtures("no_model_loading")
def test_an_environment_without_step_exits_2_naming_the_key(ppo_train_error, tmp_path):
    (tmp_path / "envs.py").write_text(BAD_ENV)
    line = ppo_train_error(f"sampler.multi_turn.env={tmp_path / 'envs.py'}:NoStep")
    assert "sampler.multi_turn.env" in line and "step" in line


@pytest.mark.usefixtures("no_model_loading")
def test_a_tool_without_type_hints_or_docstring_exits_2_naming_the_key(ppo_train_error, tmp_path):
    (tmp_path / "tools.py").write_text(BAD_TOOL)
    line = ppo_train_error(f"sampler.multi_turn.tools=[{tmp_path / 'tools.py'}:lookup]")
    assert "sampler.multi_turn.tools" in line and "lookup" in line


@pytest.mark.usefixtures("no_model_loading")
@pytest.mark.parametrize(("overrides", "named"), [
    (["sampler.multi_turn.tools=[calculator]", "data.use_chat_template=false"], "data.use_chat_template=true"),
    (["sampler.multi_turn.env=ppo_trainer.agents.tasks:RevealDigit", "sampler.multi_turn.max_response_tokens=8"],
     "sampler.multi_turn.max_response_tokens"),
    (["sampler.multi_turn.tools=[calculator,calculator]"], "twice"),
])
def test_impossible_multi_turn_settings_exit_2_naming_the_key(ppo_train_error, overrides, named):
    assert named in ppo_train_error(*overrides)
