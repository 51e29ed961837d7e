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
