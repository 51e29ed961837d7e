"""Safe defaults: no remote code unless asked, credentials masked in saved and printed configs."""

from __future__ import annotations

from ppo_trainer.config.composition import compose
from ppo_trainer.config.secrets import mask_secrets
from ppo_trainer.plan.dry_run import describe_plan


def test_remote_code_is_off_by_default():
    assert compose([]).model.trust_remote_code is False


def test_values_under_credential_like_keys_are_masked():
    config = {"logging": {"wandb_api_key": "abc123", "hf_token": "hf_xyz", "password": "p"},
              "sampler": {"max_new_tokens": 64}, "data": {"max_prompt_length": 8}, "name": "run"}
    masked = mask_secrets(config)
    assert masked["logging"] == {"wandb_api_key": "***", "hf_token": "***", "password": "***"}
    assert masked["sampler"] == {"max_new_tokens": 64} and masked["name"] == "run"


def test_ray_started_by_us_binds_loopback_without_dashboard():
    from ppo_trainer.workers.accelerators import detect
    from ppo_trainer.workers.cluster.placement import ray_init_kwargs

    cfg = compose(["devices.backend=ray"])
    kwargs = ray_init_kwargs(cfg, detect("cpu"))
    assert kwargs.get("include_dashboard") is False
    assert kwargs["_node_ip_address"] == "127.0.0.1"


def test_dry_run_plan_prints_the_config():
    assert "# resolved config" in describe_plan(compose([]), [])


def test_the_ray_floor_excludes_the_dashboard_rce_versions():
    """ray < 2.52 executes code sent to its dashboard (CVE-2025-62593)."""
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert "ray>=2.52" in project["dependencies"]


def test_the_tokenizer_runs_remote_code_only_when_the_model_does(monkeypatch, tiny_model_dir):
    from transformers import AutoTokenizer

    from ppo_trainer.models.loading import load_tokenizer

    seen = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda path, **kwargs: seen.append(kwargs["trust_remote_code"]) or real(path, **kwargs))
    load_tokenizer(tiny_model_dir)
    load_tokenizer(tiny_model_dir, trust_remote_code=True)
    assert seen == [False, True]
