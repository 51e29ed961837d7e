"""sampler.multi_turn.env: the class checked when the config loads, an OpenRLHF environment ported by
its import, sync and async styles, what reset and step return read as OpenRLHF reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppo_trainer.agents import AgentInstanceBase, Episodes, ResetOutcome, load_environment
from ppo_trainer.agents.environment import init_keywords, read_step, reset_observation
from ppo_trainer.config.schema import ConfigError, MultiTurnConfig
from ppo_trainer.models.tiny import build_tiny_tokenizer

OPENRLHF_AGENT = f"{Path(__file__).parent / 'openrlhf_agent.py'}:AgentInstance"

ENVIRONMENTS = '''
from ppo_trainer.agents import AgentInstanceBase

class NoStep(AgentInstanceBase):
    pass

class Plain:
    def reset(self, states):
        return states

class NeedsConfig(AgentInstanceBase):
    def __init__(self, config, label=None):
        pass

    async def step(self, states):
        return {}

class BadReset:
    reset = 3

    def step(self, states):
        return {}

def factory():
    return None
'''


@pytest.fixture
def envs(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENVIRONMENTS)
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.mark.parametrize(("name", "problem"), [
    ("NoStep", "NoStep has no step method"),
    ("Plain", "Plain has no step method"),
    ("NeedsConfig", "NeedsConfig.__init__ requires 'config', which the trainer cannot pass (it passes only "
                    "data_source, label, extra_info, to an __init__ that names them)"),
    ("BadReset", "BadReset.reset is not a method"),
    ("factory", "it is a function, not a class"),
    ("Missing", "{path} has no class 'Missing'"),
])
def test_a_bad_environment_class_is_a_config_error_naming_the_key_and_what_is_missing(envs, name, problem):
    ref = f"{envs}:{name}"
    with pytest.raises(ConfigError) as error:
        load_environment(ref)
    assert str(error.value).startswith(f"'sampler.multi_turn.env' is {ref!r}, but {problem.format(path=envs)}")


def test_an_environment_reference_without_a_class_name_says_the_expected_form():
    with pytest.raises(ConfigError, match="expected 'module:class' or 'path/to/file.py:class', e.g. "
                                          "my_env.py:AgentInstance"):
        load_environment("my_env.py")


def test_an_openrlhf_environment_with_its_import_changed_runs_its_episodes(tokenizer):
    env_cls = load_environment(OPENRLHF_AGENT)
    episodes = Episodes(MultiTurnConfig(max_observation_tokens=100), tokenizer, env_cls, [],
                        sampling_params={"temperature": 1.0, "max_tokens": 8})
    assert episodes.reset(["p0", "p1"], [4, 5], ["a", "b"], [None, None]) == [ResetOutcome(), ResetOutcome()]
    first = episodes.step([0, 1], ["it is 4", "it is 6"], ["p0", "p1"])
    assert [(o.reward, o.done, o.end_reason) for o in first] == [(1.0, True, "env_done"), (0.0, False, None)]
    assert first[0].extra_logs == {"turn": 1.0, "scores": 1.0}  # numbers only: "note" dropped
    assert first[1].observation_ids == tokenizer("\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>"
                                                 "assistant\n", add_special_tokens=False)["input_ids"]
    assert first[1].messages == [{"role": "environment", "content": "\n<|im_start|>user\nWrong, try again.<|im_end|>\n"
                                                                    "<|im_start|>assistant\n"}]
    assert first[1].sampling_params == {"temperature": 1.0, "max_tokens": 8}  # the dict it was shown, passed back
    second = episodes.step([1], ["still 6"], ["p1 it is 6 ..."])
    assert [(o.reward, o.done, o.end_reason, o.observation_ids) for o in second] == [(0.0, True, "env_done", [])]
    episodes.close()


def test_the_base_keeps_openrlhf_s_defaults():
    import asyncio

    states = {"observation": "p", "label": 1}
    assert asyncio.run(AgentInstanceBase().reset(states)) is states
    with pytest.raises(NotImplementedError):
        asyncio.run(AgentInstanceBase(1, x=2).step(states))


def test_an_environment_gets_the_row_s_fields_its_init_names_and_nothing_through_kwargs_alone():
    class Named:
        def __init__(self, extra_info, label=None, other=1):
            pass

    class Anything:
        def __init__(self, *args, **kwargs):
            pass

    row = {"data_source": "gsm8k", "label": "4", "extra_info": {"interaction_kwargs": {"name": "x"}}}
    assert init_keywords(Named, row) == {"label": "4", "extra_info": {"interaction_kwargs": {"name": "x"}}}
    assert init_keywords(Anything, row) == {}


def test_what_reset_returns_is_the_new_prompt_only_when_it_differs():
    assert reset_observation({"observation": "p"}, "p") is None
    assert reset_observation(None, "p") is None
    assert reset_observation({"observation": "p!", "label": 1}, "p") == "p!"
    with pytest.raises(ValueError, match="reset returned str 'p'; expected a dict with the prompt text under "
                                         "'observation'"):
        reset_observation("p", "p")


def test_a_step_result_is_read_with_openrlhf_s_defaults_and_known_sampling_keys_only():
    full = read_step({"rewards": torch.tensor(0.5), "environment_feedback": "fb", "done": torch.tensor(True),
                      "scores": 2, "extra_logs": {"a": torch.tensor(3), "b": "x", "c": float("nan")},
                      "sampling_params": {"temperature": 0.5, "top_k": torch.tensor(5), "seed": 3, "stop": ["x"]}})
    assert (full.reward, full.feedback, full.done) == (0.5, "fb", True)
    assert full.extra_logs == {"a": 3.0, "scores": 2.0}
    assert full.sampling_params == {"temperature": 0.5, "top_k": 5}
    empty = read_step({})
    assert (empty.reward, empty.feedback, empty.done, empty.extra_logs, empty.sampling_params) == (0.0, "", False, {},
                                                                                                   None)
    assert read_step({"sampling_params": object()}).sampling_params is None  # vLLM's SamplingParams: ignored


@pytest.mark.parametrize(("value", "message"), [
    ([1.0], "step returned list [1.0]; expected a dict"),
    ({"rewards": "1"}, "step returned rewards=str '1'; expected a finite number or a 0-d tensor"),
    ({"rewards": torch.tensor([1.0, 2.0])}, "step returned rewards=Tensor"),
    ({"rewards": float("inf")}, "step returned rewards=float inf"),
    ({"environment_feedback": None}, "step returned environment_feedback=NoneType None; expected text"),
    ({"done": "yes"}, "step returned done=str 'yes'; expected a bool"),
])
def test_an_unreadable_step_result_is_a_value_error_naming_the_field(value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_step(value)


def test_any_class_with_a_step_is_an_environment_and_without_reset_its_episode_starts_from_the_prompt(tokenizer):
    class Echo:
        def __init__(self, label):
            self.label = label

        def step(self, states):
            return {"rewards": float(states["action_text"] == str(self.label)), "done": True}

    episodes = Episodes(MultiTurnConfig(), tokenizer, Echo, [])
    assert episodes.reset(["p"], [4], [None], [None]) == [ResetOutcome()]
    outcome, = episodes.step([0], ["4"], ["p"])
    assert (outcome.reward, outcome.done, outcome.end_reason, outcome.observation_ids) == (1.0, True, "env_done", [])
    episodes.close()
