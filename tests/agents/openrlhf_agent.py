"""An environment written for OpenRLHF, in the shape of its multi-turn examples (async __init__ with
*args and **kwargs, async reset and step, tensors for rewards and scores, vLLM's sampling params
passed back), ported by changing its import and nothing else."""

import torch

from ppo_trainer.agents import AgentInstanceBase  # was: from openrlhf.utils.agent import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = 2

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}  # the prompt, unchanged

    async def step(self, states: dict, **kwargs):
        self.step_idx += 1
        correct = str(states["label"]) in states["action_text"]
        done = correct or self.step_idx >= self.max_steps
        feedback = "" if done else "\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n"
        return {
            "rewards": torch.tensor(1.0 if correct else 0.0),
            "scores": torch.tensor(1.0 if correct else 0.0),
            "environment_feedback": feedback,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"turn": torch.tensor(float(self.step_idx)), "note": "not a number"},
        }
