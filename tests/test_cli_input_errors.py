"""The bad-input table: every case exits 2 with one line naming the key, file or row, before any
model is loaded (`build_groups` is made to fail the test if reached)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("no_model_loading")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD_ROWS = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(8)]

# (overrides, fragment of the message)
STATIC_CASES = [
    (["gae.gama=0.9"], "gae.gama"),
    (["trainer.resume_allow=[data.train_batchsize]"], "trainer.resume_allow"),
    (["+gae.gama=0.9"], "gae.gama"),
    (["+trainer.typo=1"], "trainer.typo"),
    (["sampler=nope"], "sampler=nope"),
    (["+experiment=nope"], "experiment=nope"),
    (["gae.lam=abc"], "gae.lam"),
    (["sampler.n=1.5"], "sampler.n"),
    (["trainer.total_steps=ten"], "trainer.total_steps"),
    (["algorithm.ppo_mini_batch_size=3"], "algorithm.ppo_mini_batch_size"),
    (["model.optim.lr=0"], "model.optim.lr"),
    (["sampler.n=0"], "sampler.n"),
    (["algorithm.clip_ratio_high=1.2"], "algorithm.clip_ratio_high"),
    (["gae.gamma=2"], "gae.gamma"),
    (["sampler.temperature=0"], "sampler.temperature"),
    (["algorithm.ppo_micro_batch_tokens=8"], "algorithm.ppo_micro_batch_tokens"),
    (["critic.lora.rank=-1"], "critic.lora.rank"),
    (["+critic.lora.rank=8"], "critic.lora"),
    (["devices.actor.num_devices=2"], "devices.actor.num_devices"),
    (["model.dtype=fp8"], "model.dtype"),
    (["trainer.loggers=[console,foo]"], "trainer.loggers"),
    (["data.train_files=[x.jsonl]"], "data.train_files: file not found: x.jsonl"),
    (["data.train_files=[a.jsonl,b.jsonl]", "data.train_weights=[1]"], "data.train_weights"),
    (["data.overlong_prompts=truncate"], "data.overlong_prompts"),
    (["eval.n=4", "eval.temperature=0"], "eval.n"),
    (["data.use_chat_template=false", "data.chat_template_kwargs={enable_thinking:false}"],
     "data.chat_template_kwargs"),
    (["gae.kl_ctrl=adaptive", "gae.kl_coef=0"], "gae.kl_coef"),
    (["trainer.objective=val/acc"], "trainer.objective"),
    (["trainer.worker_timeout_s=0"], "trainer.worker_timeout_s"),
    (["eval.max_new_tokens=0"], "eval.max_new_tokens"),
    (["sampler.generate_batch_size=0"], "sampler.generate_batch_size"),
    (["model.optim.weight_decay=-0.1"], "model.optim.weight_decay"),
    (["model.optim.eps=0"], "model.optim.eps"),
    (["data.arithmetic.train_size=0"], "data.arithmetic.train_size"),
    (["devices.ray.num_cpus=0"], "devices.ray.num_cpus"),
    (["trainer.experiment_name=a/b"], "trainer.experiment_name"),
    (["reward.format_score=1.0"], "reward.format_score"),
    (["trainer.collective_timeout_s=0"], "trainer.collective_timeout_s"),
    (["sampler.vllm.tensor_parallel_size=2"], "'sampler.vllm.tensor_parallel_size' is 2 with sampler=hf"),
    (["sampler.vllm.tensor_parallel_size=4", "sampler=vllm"],
     "'sampler.vllm.tensor_parallel_size' is 4 with devices.backend=local"),
    (["sampler.vllm.tensor_parallel_size=8", "sampler=vllm", "devices.backend=ray", "devices.colocate=true"],
     "'sampler.vllm.tensor_parallel_size' is 8 with devices.colocate=true"),
    (["sampler.vllm.tensor_parallel_size=16", "sampler=vllm", "devices=multi_gpu", "devices.rollout.num_devices=16"],
     "'sampler.vllm.tensor_parallel_size' (16) exceeds devices.devices_per_node (8)"),
]


@pytest.mark.parametrize("overrides,fragment", STATIC_CASES, ids=[c[0][0] for c in STATIC_CASES])
def test_static_config_errors(ppo_train_error, overrides, fragment):
    assert fragment in ppo_train_error(*overrides)


def test_missing_model_path(ppo_train_error):
    assert "/no/such/model" in ppo_train_error("model.path=/no/such/model")


def test_files_source_without_train_files(ppo_train_error, tmp_path):
    rows = write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)
    line = ppo_train_error("data.source=files", f"data.val_files={rows}")
    assert "data.train_files is empty; data.source=files needs jsonl or parquet files" in line


def test_missing_data_file(ppo_train_error):
    line = ppo_train_error("data.source=files", "data.train_files=/no/such/train.jsonl")
    assert "data.train_files" in line and "/no/such/train.jsonl" in line


def test_malformed_jsonl_row_names_file_and_line(ppo_train_error, tmp_path, monkeypatch):
    # As on a fresh machine after other tests: the tiny model is built inside the captured run
    # (empty model cache), with transformers already imported and its progress bars on.
    from transformers.utils import logging as hf_logging

    monkeypatch.setenv("PPO_TRAINER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hf_logging, "_tqdm_active", True)
    bad = write_jsonl(tmp_path / "bad.jsonl", [*GOOD_ROWS[:2], "{not json", *GOOD_ROWS[2:]])
    line = ppo_train_error("data.source=files", f"data.train_files={bad}", f"data.val_files={bad}")
    assert f"{bad}:3" in line


def test_non_utf8_jsonl_line_names_file_and_line(ppo_train_error, tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b"".join(json.dumps(row).encode() + b"\n" for row in GOOD_ROWS[:3])
                    + '{"question": "Caf\u00e9?", "answer": "#### 1"}\n'.encode("latin-1"))
    line = ppo_train_error(f"data.train_files={bad}")
    assert f"{bad}:4: not UTF-8 text" in line and "data.bad_rows=skip" in line


def test_corrupt_parquet_names_the_file(ppo_train_error, tmp_path):
    bad = tmp_path / "cut.parquet"
    bad.write_bytes(b"PAR1\x15\x04truncated")
    line = ppo_train_error(f"data.val_files={bad}")
    assert f"{bad}: not a readable parquet file" in line


def test_missing_column_names_the_key(ppo_train_error, tmp_path):
    rows = write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)
    line = ppo_train_error("data.source=files", f"data.train_files={rows}", f"data.val_files={rows}",
                   "data.prompt_key=problem")
    assert "problem" in line and f"{rows}:1" in line


def test_empty_dataset_after_length_filter(ppo_train_error):
    line = ppo_train_error("data.max_prompt_length=8", "algorithm.ppo_micro_batch_tokens=64", "sampler.max_new_tokens=8")
    assert "data.max_prompt_length" in line


def test_device_request_larger_than_the_machine(ppo_train_error):
    assert "GPU" in ppo_train_error("devices=gpu")


def test_vllm_sampler_without_vllm_installed(ppo_train_error, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert "pip install" in ppo_train_error("sampler=vllm")


def test_reward_function_that_does_not_exist(ppo_train_error):
    assert "reward.fn" in ppo_train_error("reward.fn=no_such_module:score")


def test_output_dir_of_another_model(ppo_train_error, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("model:\n  path: some/other-model\n")
    (out / "checkpoints").mkdir()
    line = ppo_train_error(f"trainer.output_dir={out}")
    assert "some/other-model" in line and "trainer.output_dir" in line


def test_corrupt_resume_state(ppo_train_error, tmp_path):
    out = tmp_path / "run"
    step = out / "checkpoints" / "global_step_2"
    (step / "state").mkdir(parents=True)
    (step / "state" / "trainer.json").write_text("{truncated")
    (out / "checkpoints" / "latest").write_text("global_step_2\n")
    assert "corrupt resume state" in ppo_train_error(f"trainer.output_dir={out}")


def test_latest_naming_a_missing_checkpoint(ppo_train_error, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("global_step_9\n")
    assert "global_step_9" in ppo_train_error(f"trainer.output_dir={out}")


def test_resume_from_a_folder_that_is_not_a_checkpoint(ppo_train_error, tmp_path):
    assert "trainer.resume" in ppo_train_error(f"trainer.resume={tmp_path}")


def test_reward_module_that_fails_at_import(ppo_train_error, tmp_path, monkeypatch):
    (tmp_path / "broken_reward.py").write_text("import json\nCONFIG = json.loads('{not json')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = ppo_train_error("reward.fn=broken_reward:score")
    assert "reward.fn" in line and "importing module 'broken_reward' failed: JSONDecodeError" in line


def test_a_reward_signature_that_matches_none_stops_before_the_models(ppo_train_error, tmp_path):
    (tmp_path / "batch_reward.py").write_text("def compute_score(data_sources, solution_strs, ground_truths):\n"
                                              "    return [0.0] * len(solution_strs)\n")
    line = ppo_train_error(f"reward.fn={tmp_path}/batch_reward.py:compute_score", "reward.num_workers=2")
    assert line.startswith(f"ppo-train: config error: 'reward.fn' is '{tmp_path}/batch_reward.py:compute_score' "
                           "(reward.batched=false), but its parameters (data_sources, solution_strs, ground_truths) "
                           "match no per-row signature (a batch function: set reward.batched=true); accepted: ")


def test_format_score_for_a_reward_without_the_parameter_stops_before_the_models(ppo_train_error, tmp_path):
    (tmp_path / "plain_reward.py").write_text("def reward(response, ground_truth):\n    return 0.0\n")
    line = ppo_train_error("reward.fn=plain_reward.py:reward", "reward.format_score=0.1")
    assert (f"'reward.format_score' is 0.1, but reward.fn {tmp_path / 'plain_reward.py'}:reward has no 'format_score' "
            "parameter") in line  # the file as the run saves it: absolute


def test_a_logger_that_is_not_installed(ppo_train_error, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    line = ppo_train_error("trainer.loggers=[console,wandb]")
    assert "trainer.loggers has wandb" in line and "pip install wandb" in line


def test_a_ray_address_where_nothing_answers(ppo_train_error):
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = ppo_train_error("devices.backend=ray", f"devices.ray.address=127.0.0.1:{port}")
    assert f"devices.ray.address=127.0.0.1:{port}: no Ray cluster answers there" in line and "ray start" in line


def test_a_model_folder_without_a_tokenizer(ppo_train_error, tmp_path, tiny_model_dir):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    for name in bare.iterdir():
        if "token" in name.name or name.suffix in (".jinja", ".txt", ".model"):
            name.unlink()
    line = ppo_train_error(f"model.path={bare}")
    assert f"model.path='{bare}': its tokenizer cannot be loaded" in line


def test_a_previous_runs_config_that_cannot_be_read(ppo_train_error, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("model: [unclosed\n")
    line = ppo_train_error(f"trainer.output_dir={out}")
    assert "config.yaml that cannot be read" in line and "trainer.resume=never" in line


def test_a_checkpoints_config_that_cannot_be_read(ppo_train_error, tmp_path):
    out = tmp_path / "run"
    state = out / "checkpoints" / "global_step_2" / "state"
    (state / "actor").mkdir(parents=True)
    (state / "critic").mkdir()
    (state / "trainer.json").write_text('{"step": 2, "loader": {}, "kl_ctrl": {}}')
    import torch

    torch.save({"torch": torch.get_rng_state()}, state / "rng.pt")
    (state / "config.yaml").write_text("\x00\x01 not yaml: [")
    (out / "checkpoints" / "latest").write_text("global_step_2\n")
    assert "corrupt resume state" in ppo_train_error(f"trainer.output_dir={out}")


def test_a_critic_started_from_a_model_with_another_vocabulary(ppo_train_error):
    """The tiny reward model numbers its characters otherwise than the tiny policy."""
    line = ppo_train_error("critic.path=random:tiny-reward")
    assert "critic.path='random:tiny-reward' has another vocabulary than model.path" in line


def test_expandable_segments_with_a_sleeping_vllm(ppo_train_error, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    line = ppo_train_error("sampler=vllm", "devices.accelerator=cuda", "devices.colocate=true")
    assert "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True" in line and "devices.colocate=false" in line


@pytest.mark.parametrize("dry_run", ["true", "false"])
def test_rollout_devices_not_a_multiple_of_the_tensor_parallel_size_stop_a_dry_run_and_a_real_run(ppo_train_error,
                                                                                                 dry_run):
    """Both keys named; the dry run refuses it too (once it accepted what the Ray backend then failed on, issue 42)."""
    line = ppo_train_error("sampler=vllm", "devices=multi_gpu", "sampler.vllm.tensor_parallel_size=2",
                           "devices.rollout.num_devices=3", f"trainer.dry_run={dry_run}")
    assert line == ("ppo-train: config error: 'devices.rollout.num_devices' (3) must be a multiple of "
                    "sampler.vllm.tensor_parallel_size (2): each rollout replica is one vLLM engine on 2 devices")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM's absence is reported first")
def test_a_tensor_parallel_size_that_does_not_split_the_models_heads_stops_before_any_model_loads(ppo_train_error):
    """The smoke model (random:tiny) has 2 attention heads and 2 key-value heads: 4 ranks cannot share them."""
    line = ppo_train_error("sampler=vllm", "devices.backend=ray", "devices.accelerator=cpu", "devices.colocate=false",
                           "devices.rollout.num_devices=4", "sampler.vllm.tensor_parallel_size=4")
    assert line == ("ppo-train: config error: sampler.vllm.tensor_parallel_size=4 does not split model.path's 2 "
                    "attention heads and 2 key-value heads evenly over a replica's 4 ranks; the sizes that do: 1, 2")


def test_a_launcher_that_starts_one_copy_per_rank(ppo_train_error, monkeypatch):
    """torchrun --nproc-per-node=2 ppo-train ...: without the check, each copy would be a run of its own."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    line = ppo_train_error()
    assert line.startswith("ppo-train: config error: WORLD_SIZE=2 and RANK=1 are set: a launcher (torchrun, a "
                           "Kubeflow PyTorchJob) started this command once per rank")
