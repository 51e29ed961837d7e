"""docs/config.md is generated from the schema (scripts/gen_config_docs.py) and kept up to date."""

from __future__ import annotations

import pytest

from ppo_trainer.config.schema import schema_keys


@pytest.fixture(scope="module")
def gen_config_docs(load_script):
    return load_script("gen_config_docs")


def test_docs_config_md_matches_the_schema(gen_config_docs):
    assert gen_config_docs.DOC.read_text() == gen_config_docs.render(), (
        f"docs/config.md is stale: run `{gen_config_docs.COMMAND}` and commit the result")


def test_every_schema_key_has_a_row(gen_config_docs):
    rows = {line.split("`")[1] for line in gen_config_docs.render().splitlines() if line.startswith("| `")}
    leaves = {key for key in schema_keys() 
              if not any(k.startswith(key + ".") for k in schema_keys())}
    assert rows == leaves


def test_a_fields_meaning_is_the_comment_above_it_and_the_one_after_it(gen_config_docs):
    source = "class ToyConfig:\n    # spans the line below\n    a: int = 1\n    b: int = 2  # says b\n    c: int = 3\n"
    _, keys = gen_config_docs.schema_comments(source)
    assert keys == {("ToyConfig", "a"): "spans the line below", ("ToyConfig", "b"): "says b", ("ToyConfig", "c"): ""}


def rows(text: str) -> dict[str, list[str]]:
    """{key: [type, default, allowed, meaning]} of the reference's tables."""
    return {cells[0].strip("` "): [c.strip() for c in cells[1:]]
            for cells in (line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| `"))}


def test_each_key_shows_its_default_and_allowed_values(gen_config_docs):
    table = rows(gen_config_docs.render())
    assert table["model.optim.lr"][:3] == ["float", "`1e-06`", "> 0"]
    assert table["critic.optim.lr"][:3] == ["float", "`1e-05`", "> 0"]  # one class, the critic's own default
    assert table["critic.optim.schedule"][2] == "constant, cosine"
    assert table["model.optim.betas"][2] == "2 values in [0, 1)"
    assert table["gae.lam"][2] == "in [0, 1]"
    assert table["reward.timeout_s"][:3] == ["float or null", "`null`", "> 0"]
    assert table["trainer.loggers"][2] == "each one of console, jsonl, tensorboard, wandb, mlflow"
    assert table["data.train_weights"][2] == "each > 0"
    assert table["algorithm.loss_agg_mode"][2] == "token-mean, seq-mean-token-mean, seq-mean-token-sum"
    assert table["model.path"][2] == ""  # no rule: any string


def test_only_the_groups_with_options_list_them(gen_config_docs):
    text = gen_config_docs.render()
    listed = [line.split("`")[1].split("=")[0] for line in text.splitlines() if line.startswith("Options (`")]
    assert listed == ["model", "sampler", "devices", "data"]
