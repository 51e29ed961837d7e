"""The environment of a multi-turn rollout (`sampler.multi_turn.env`): a class in OpenRLHF's
`AgentInstanceBase` shape, one instance per episode. What is checked when the config loads (the
class, its methods, its constructor's parameters), how an instance is built (sync or async
`__init__`, keywords it names), and how what `reset` and `step` return is read.

`reset(states)` gets {"observation": prompt text, "label": ground truth} and returns a dict whose
"observation" is the prompt the episode starts from (OpenRLHF's default returns `states`: the prompt
unchanged). `step(states)` gets {"observation_text", "action_text", "label", "sampling_params"} and
returns {"rewards": number or 0-d tensor, "environment_feedback": text appended verbatim as the
next observation, "done": bool, optional "scores", "extra_logs" and "sampling_params"}.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ppo_trainer.config.schema import ConfigError
from ppo_trainer.rewards.calling import import_attribute, number_value, plain_value

# keywords an environment's __init__ receives when it names them as parameters (the row's fields)
INIT_KEYWORDS = ("data_source", "label", "extra_info")
# sampling settings a step may change for the episode's next turn (others are ignored)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens")


class AgentInstanceBase:
    """The base of an environment, with OpenRLHF's defaults: an OpenRLHF agent file runs once its
    `from openrlhf.utils.agent import AgentInstanceBase` becomes
    `from ppo_trainer.agents import AgentInstanceBase`. Its `__init__` may be `async def` (as in
    some OpenRLHF examples); the trainer awaits it. `reset` and `step` may be sync or async."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        """The episode starts from the prompt unchanged."""
        return states

    async def step(self, states: dict, **kwargs: Any) -> dict:
        raise NotImplementedError("AgentInstance.step is not implemented")


def load_environment(ref: str, key: str = "sampler.multi_turn.env") -> type:
    """The environment class `ref` names ("module:Class" or "path/to/file.py:Class"), checked before
    any model loads: a class, with a `step` of its own, a callable `reset` if it has one, and an
    `__init__` the trainer can call (no required parameters other than `INIT_KEYWORDS`).
    ConfigError naming `key` and what is wrong otherwise."""
    try:
        cls = import_attribute(ref, "class", "my_env.py:AgentInstance")
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"'{key}' is {ref!r}, but {e}") from None
    problem = _class_problem(cls)
    if problem:
        raise ConfigError(f"'{key}' is {ref!r}, but {problem}; an environment is a class with reset(states) and "
                          "step(states) (OpenRLHF's AgentInstanceBase; see docs/multi-turn.md)")
    return cls


def _class_problem(cls: Any) -> str:
    """What keeps `cls` from being an environment class, or ""."""
    if not inspect.isclass(cls):
        return f"it is a {type(cls).__name__}, not a class"
    step = getattr(cls, "step", None)
    if not callable(step) or step is AgentInstanceBase.step:
        return f"{cls.__name__} has no step method"
    if not callable(getattr(cls, "reset", AgentInstanceBase.reset)):
        return f"{cls.__name__}.reset is not a method"
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # a constructor written in C: called without arguments
        return ""
    required = [n for i, (n, p) in enumerate(params.items())
                if i > 0 and p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and n not in INIT_KEYWORDS]
    if required:
        return (f"{cls.__name__}.__init__ requires {', '.join(map(repr, required))}, which the trainer cannot pass "
                f"(it passes only {', '.join(INIT_KEYWORDS)}, to an __init__ that names them)")
    return ""


def init_keywords(cls: type, row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's fields (`INIT_KEYWORDS`) that `cls.__init__` names as parameters; **kwargs alone
    does not ask for them (it may pass them on to a parent that takes none)."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return {}
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {name: row[name] for name in INIT_KEYWORDS if name in named}


def open_instance(cls: type, keywords: dict[str, Any], prompt: str, label: Any,
                  resolve: Callable[[Any], Any]) -> tuple[Any, Any]:
    """(instance, what its reset returned, None without a reset): `cls` built with `keywords` (an
    async __init__ awaited through `resolve`), then reset with the prompt and label. Runs in a call's thread."""
    if inspect.iscoroutinefunction(cls.__init__):
        instance = cls.__new__(cls)
        resolve(instance.__init__(**keywords))
    else:
        instance = cls(**keywords)
    reset = getattr(instance, "reset", None)  # optional outside AgentInstanceBase: the prompt unchanged
    return instance, None if reset is None else resolve(reset({"observation": prompt, "label": label}))


def reset_observation(value: Any, prompt: str) -> Optional[str]:
    """The prompt text reset chose: None when unchanged (or reset returned None), else its
    "observation". ValueError for anything else."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("observation"), str):
        raise ValueError(f"reset returned {_shown(value)}; expected a dict with the prompt text under 'observation'")
    return None if value["observation"] == prompt else value["observation"]


@dataclass(frozen=True)
class StepResult:
    """What one `step` returned, read: the reward, the feedback text, done, the numbers to log (the
    step's "scores" among them) and the sampling settings for the next turn (known keys only)."""

    reward: float
    feedback: str
    done: bool
    extra_logs: dict[str, float]
    sampling_params: Optional[dict[str, Any]]


def read_step(value: Any) -> StepResult:
    """`step`'s dict read as OpenRLHF's executor reads it, with its defaults for what is absent
    ("rewards" 0, no feedback, not done). ValueError naming the field when one has the wrong type."""
    if not isinstance(value, Mapping):
        raise ValueError(f"step returned {_shown(value)}; expected a dict with 'rewards', 'environment_feedback' "
                         "and 'done'")
    reward = number_value(value.get("rewards", 0.0))
    if reward is None or not math.isfinite(reward):
        raise ValueError(f"step returned rewards={_shown(value.get('rewards'))}; expected a finite number "
                         "or a 0-d tensor")
    feedback = value.get("environment_feedback", "")
    if not isinstance(feedback, str):
        raise ValueError(f"step returned environment_feedback={_shown(feedback)}; expected text")
    done = plain_value(value.get("done", False))
    if not isinstance(done, (bool, int)):
        raise ValueError(f"step returned done={_shown(done)}; expected a bool")
    logs = dict(value.get("extra_logs") or {}) if isinstance(value.get("extra_logs"), Mapping) else {}
    if "scores" in value:
        logs["scores"] = value["scores"]
    return StepResult(reward, feedback, bool(done), numbers(logs), sampling_params(value.get("sampling_params")))


def sampling_params(value: Any) -> Optional[dict[str, Any]]:
    """The known sampling keys (`SAMPLING_KEYS`) of a dict, numbers only; None for anything else
    (vLLM's SamplingParams object of an OpenRLHF step is not read: it is ignored)."""
    if not isinstance(value, Mapping):
        return None
    kept = {k: plain_value(value[k]) for k in SAMPLING_KEYS if number_value(value.get(k)) is not None}
    return kept or None


def numbers(values: Mapping[Any, Any]) -> dict[str, float]:
    """The entries whose value is a number (bool, int, float, a numpy or 0-d tensor scalar), as
    floats; the rest dropped (a metric is a number)."""
    out = {}
    for name, value in values.items():
        number = number_value(value)
        if number is not None and math.isfinite(number):
            out[str(name)] = number
    return out


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.60}"
