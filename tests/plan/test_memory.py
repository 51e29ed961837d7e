"""The dry run's memory plan: parameter counts from a model's dimensions, each role's share of its
device, the shared device's peak, a total rebuilt from the lines above it with a margin the
measured peaks justify, and a warning naming the keys when a device would not hold it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.config.derived import uses_reference
from ppo_trainer.plan import memory as memory_plan
from ppo_trainer.plan.memory import GIB, KNOWN_DIMS, MEMORY_MARGIN, PROCESS_BASELINE, Dims, activation_bytes, model_dims

PERFORMANCE_MD = Path(__file__).resolve().parents[2] / "docs" / "performance.md"


def test_parameter_counts_match_the_published_models():
    assert KNOWN_DIMS["embedded:smollm2-135m-instruct"].params == 134_515_008
    assert KNOWN_DIMS["Qwen/Qwen2.5-0.5B-Instruct"].params == 494_032_768


def test_dimensions_come_from_config_json_where_the_model_is_on_disk(tiny_model_dir):
    import json

    from transformers import AutoModelForCausalLM

    dims = model_dims(str(tiny_model_dir))
    assert isinstance(dims, Dims) and dims.hidden == json.loads((tiny_model_dir / "config.json").read_text())["hidden_size"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert dims.params == sum(p.numel() for p in model.parameters())
    assert model_dims("random:tiny") == dims


def test_a_model_whose_config_is_nowhere_here_is_unknown_with_the_reason(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "nor in the Hugging Face cache" in model_dims("someone/not-downloaded-7b")
    lines = memory_plan.memory_plan(compose(["model.path=someone/not-downloaded-7b"]), True)
    assert any(line.startswith("  unknown: model.path:") for line in lines)


def test_activations_by_hand():
    """2 layers, hidden 4, intermediate 8, 1 head of 4 (kv 1): 8*4 + 4*8 + 2*4 = 72 elements a token
    and layer; eager attention over 10 keys adds 2 * 1 * 10."""
    dims = Dims(hidden=4, layers=2, heads=1, kv_heads=1, head_dim=4, intermediate=8, vocab=10, tied=True)
    assert activation_bytes(dims, 100, 10, 2, False, "sdpa") == 2 * 100 * 72 * 2
    assert activation_bytes(dims, 100, 10, 2, False, "eager") == 2 * 100 * 92 * 2
    assert activation_bytes(dims, 100, 10, 2, True, "sdpa") == 2 * 100 * 4 * 2 + 100 * 72 * 2


def test_a_shared_device_holds_what_stays_plus_the_busiest_phase():
    cfg = compose(["+experiment=gsm8k_cpu", "model.dtype=float32", "critic.dtype=float32"])
    lines = memory_plan.memory_plan(cfg, uses_reference(cfg))
    actor = memory_plan.trainer_line("actor", cfg, KNOWN_DIMS["embedded:smollm2-135m-instruct"], 1)
    critic = memory_plan.trainer_line("critic", cfg, KNOWN_DIMS["embedded:smollm2-135m-instruct"], 1)
    rollout = memory_plan.rollout_line(cfg, KNOWN_DIMS["embedded:smollm2-135m-instruct"], None)
    stays = sum(v for line in (actor, critic) for k, v in line.parts.items() if k not in memory_plan.TRANSIENT)
    busiest = max(sum(line.parts.get(k, 0) for k in memory_plan.TRANSIENT) for line in (actor, critic))
    expected = (stays + busiest + rollout.total + PROCESS_BASELINE) * (1 + MEMORY_MARGIN)
    total = next(line for line in lines if line.startswith("  total"))
    assert total.startswith(f"  total        {expected / GIB:.2f} GiB per device")
    assert rollout.parts["weights"] == 2 * 4 * 134_515_008  # the CPU build keeps two float32 copies


def test_a_lora_critic_holds_its_base_and_the_states_of_its_adapters_and_value_head():
    """SmolLM2's 7 projections a layer at rank 8: 8 x (1152 + 768 + 768 + 1152 + 3 x 2112) x 30 layers
    = 2,442,240 adapter parameters, + 577 of the value head: float32 weights, gradients, AdamW moments."""
    from ppo_trainer.plan.dry_run import describe_plan

    dims = KNOWN_DIMS["embedded:smollm2-135m-instruct"]
    full = compose(["+experiment=gsm8k_cpu", "critic.dtype=float32"])
    lora = compose(["+experiment=gsm8k_cpu", "critic.dtype=float32", "critic.lora.rank=8"])
    full_line, lora_line = (memory_plan.trainer_line("critic", cfg, dims, 1) for cfg in (full, lora))
    trained = 2_442_240 + 577
    assert memory_plan.trainable_params("critic", lora.critic.lora, dims) == trained
    assert lora_line.parts["weights"] == 4 * dims.params + 4 * trained
    assert (lora_line.parts["gradients"], lora_line.parts["optimizer"]) == (4 * trained, 8 * trained)
    assert lora_line.total == full_line.total - 12 * dims.params + 16 * trained  # 16 -> 4 bytes a base parameter
    critic_line = next(line for line in describe_plan(lora, []).splitlines() if line.startswith("critic:    "))
    assert f"(LoRA rank 8, value head in full, lr {lora.critic.optim.lr}," in critic_line


def test_a_plan_over_the_device_warns_naming_the_keys(monkeypatch):
    monkeypatch.setattr(memory_plan, "device_memory", lambda cfg: (8 * GIB, "NVIDIA test card"))
    cfg = compose(["+experiment=gsm8k"])
    lines = memory_plan.memory_plan(cfg, uses_reference(cfg))
    assert "  device memory: 8.00 GiB (NVIDIA test card)" in lines
    (warning,) = [line for line in lines if line.startswith("WARNING")]
    assert "algorithm.ppo_micro_batch_tokens" in warning and "sampler.vllm.kv_cache_gb" in warning
    monkeypatch.setattr(memory_plan, "device_memory", lambda cfg: (80 * GIB, "NVIDIA H100"))
    assert not [line for line in memory_plan.memory_plan(cfg, True) if line.startswith("WARNING")]


@pytest.mark.parametrize("experiment", ["smoke", "gsm8k_cpu", "gsm8k"])
def test_the_dry_run_prints_the_memory_plan(experiment):
    from ppo_trainer.plan.dry_run import describe_plan

    text = describe_plan(compose([f"+experiment={experiment}"]), [])
    section = text.split("# memory plan")[1]
    for role in ("actor", "critic", "rollout", "roles", "margin", "total"):
        assert f"\n  {role}" in section


def test_the_gpu_recipe_fits_memory_as_the_plan_needs():
    """Critic checkpointing on (16k-token micro-batches), a KV cache sized in bytes for a step, and
    validation decoding as long as training, over the whole set in one call."""
    cfg = compose(["+experiment=gsm8k"])
    assert cfg.model.gradient_checkpointing and cfg.critic.gradient_checkpointing
    assert cfg.sampler.vllm.kv_cache_gb == 4 and cfg.sampler.vllm.gpu_memory_utilization is None
    assert cfg.eval.max_new_tokens == cfg.sampler.max_new_tokens == 512 and cfg.eval.batch_size >= 1319


def test_vllm_memory_is_sized_one_way_only():
    from ppo_trainer.config.schema import ConfigError

    with pytest.raises(ConfigError, match="kv_cache_gb' and sampler.vllm.gpu_memory_utilization are both set"):
        compose(["sampler=vllm", "sampler.vllm.kv_cache_gb=2", "sampler.vllm.gpu_memory_utilization=0.4"])
    with pytest.raises(ConfigError, match="unknown config key 'sampler.vllm.cpu_kv_cache_gb'.*kv_cache_gb"):
        compose(["sampler=vllm", "sampler.vllm.cpu_kv_cache_gb=1"])


def numbers(line: str) -> list[float]:
    """The GiB figures of a plan line, in order."""
    return [float(x) for x in re.findall(r"\d+\.\d\d", line)]


def plan_lines(*overrides: str) -> dict[str, str]:
    cfg = compose(list(overrides))
    return {line.split()[0]: line for line in memory_plan.memory_plan(cfg, uses_reference(cfg)) if line.startswith("  ")}


@pytest.mark.parametrize("experiment", ["smoke", "gsm8k_cpu"])
def test_on_a_cpu_the_total_is_the_roles_plus_the_process_plus_the_margin_each_on_its_own_line(experiment):
    lines = plan_lines(f"+experiment={experiment}")
    roles, process, margin, total = (numbers(lines[name])[0] for name in ("roles", "process", "margin", "total"))
    assert process == PROCESS_BASELINE / GIB
    assert margin == pytest.approx(MEMORY_MARGIN * (roles + process), abs=0.01)
    assert total == pytest.approx(roles + process + margin, abs=0.015)
    assert lines["total"].endswith(f"= roles {roles:.2f} + process {process:.2f} + margin {margin:.2f}")
    kept, busiest, rollout = numbers(lines["roles"])[1:]
    assert roles == pytest.approx(kept + busiest + rollout, abs=0.015)
    assert rollout == numbers(lines["rollout"])[0]


def test_the_gsm8k_cpu_total_by_hand():
    """What stays 1.86 (LoRA actor 0.29 + 0.04 + 0.07, critic 0.50 + 1.00) + the critic's update 1.72
    (gradients 0.50, gathered 0.06, activations 1.16 of a 1152-token micro-batch whose rows are up to
    128 + 4 x 64 tokens) + the rollout 1.10 = 4.69; + 0.60 = 5.29; x 1.25."""
    lines = plan_lines("+experiment=gsm8k_cpu")
    assert numbers(lines["roles"]) == [4.69, 1.86, 1.72, 1.10]
    assert numbers(lines["total"]) == [6.61, 4.69, 0.60, 1.32]


def test_with_vllm_asleep_on_a_shared_gpu_the_roles_take_the_larger_of_training_and_the_rollout():
    lines = plan_lines("+experiment=gsm8k", "devices=colocated")
    roles, kept, training, rollout = numbers(lines["roles"])
    assert roles == pytest.approx(kept + max(training, rollout), abs=0.015)
    assert "process" not in lines  # the process lives in host memory, not on the GPU
    assert numbers(lines["total"])[0] == pytest.approx(roles * (1 + MEMORY_MARGIN), abs=0.015)


def test_each_role_on_its_own_devices_gets_its_line_plus_the_margin():
    lines = plan_lines("+experiment=gsm8k", "devices=multi_gpu")
    for role in ("actor", "critic", "rollout"):
        line_total = numbers(lines[role])[0]
        share = re.search(rf"{role} (\d+\.\d\d) \+ (\d+\.\d\d) = (\d+\.\d\d)", lines["total"])
        assert [float(x) for x in share.groups()] == pytest.approx(
            [line_total, line_total * MEMORY_MARGIN, line_total * (1 + MEMORY_MARGIN)], abs=0.015)


def test_the_margin_covers_the_resident_peaks_measured_against_the_plan_in_docs_performance():
    """docs/performance.md's table: the plan with the process and the peak resident set, per recipe."""
    section = PERFORMANCE_MD.read_text().split("## The memory plan against measured peaks")[1].split("\n## ")[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and "%" in line]
    assert len(rows) == 2
    for row in rows:
        with_process, resident = float(row[4]), float(row[5])
        assert with_process * (1 + MEMORY_MARGIN) >= resident, row[0]


def test_a_tensor_parallel_rollout_line_is_one_shard_of_its_replica():
    """Qwen2.5-0.5B in bf16, 2 GPUs a replica: each holds half the weights and one of the 2 KV heads;
    the KV cache (sampler.vllm.kv_cache_gb) and the runtime are each rank's own."""
    one = numbers(plan_lines("+experiment=gsm8k", "devices=multi_gpu_one_node")["rollout"])
    two_line = plan_lines("+experiment=gsm8k", "devices=multi_gpu_one_node", "sampler.vllm.tensor_parallel_size=2")[
        "rollout"]
    two = numbers(two_line)
    assert two[1] == pytest.approx(one[1] / 2, abs=0.01)  # weights
    assert two[2:4] == one[2:4] == [4.00, 0.50]  # KV cache, runtime
    assert two[-1] == pytest.approx(one[-1] / 2, abs=0.01)  # the KV a step needs, per shard
    assert "one of a replica's 2 shards" in two_line


def test_kv_heads_fewer_than_the_ranks_are_copied_not_split():
    """8 query heads and 2 KV heads on 4 ranks: each rank keeps one whole KV head (vLLM copies them), as on 2."""
    dims = Dims(hidden=512, layers=4, heads=8, kv_heads=2, head_dim=64, intermediate=1024, vocab=1000, tied=True)
    needed = {k: memory_plan.rollout_line(compose(["+experiment=gsm8k", "devices=multi_gpu",
                                                   f"sampler.vllm.tensor_parallel_size={k}"]), dims, None).note
              for k in (1, 2, 4)}
    per_shard = {k: numbers(note.split("need ")[1])[0] for k, note in needed.items()}
    assert per_shard[4] == per_shard[2] == pytest.approx(per_shard[1] / 2, abs=0.01)
