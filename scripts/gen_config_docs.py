"""docs/config.md, generated from the schema (ppo_trainer/config/schema.py): every key with its type, default,
allowed values and meaning, grouped by config group, with the group's options in configs/.

    python scripts/gen_config_docs.py           # rewrites docs/config.md
    python scripts/gen_config_docs.py --check   # exit 1 if docs/config.md is stale

A key's meaning is its comment in the schema: the comment lines just above the field plus the comment
after it on its line; its allowed values are its `Rule` (the field's metadata). A section's introduction
is the comment on its `class` line. A default is the one the section's parent gives it (critic.optim.lr
is 1e-5, model.optim.lr 1e-6: one class, two defaults)."""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import tokenize
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from omegaconf import OmegaConf

from ppo_trainer.config import schema as config
from ppo_trainer.config.schema import CONFIG_DIR, CONFIG_NAME, PPOConfig, group_options

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
COMMAND = "python scripts/gen_config_docs.py"


def schema_comments(source: str) -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """({class: its `class` line's comment}, {(class, field): the field's comment}) of a schema's source."""
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, alone on its line)
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            comments[row] = (tok.string.lstrip("#").strip(), not lines[row - 1][:col].strip())
    classes, keys = {}, {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        text, alone = comments.get(node.lineno, ("", True))
        classes[node.name] = "" if alone else text
        for item in node.body:
            if not isinstance(item, ast.AnnAssign):
                continue
            above, row = [], item.lineno - 1
            while row in comments and comments[row][1]:
                above.insert(0, comments[row][0])
                row -= 1
            after = [comments[r][0] for r in range(item.lineno, item.end_lineno + 1) if r in comments and not comments[r][1]]
            keys[(node.name, item.target.id)] = " ".join(above + after)
    return classes, keys


def type_name(hint: Any) -> str:
    """`int`, `list[str]`, `float or null` for a field's type hint."""
    args = get_args(hint)
    if get_origin(hint) is Union and type(None) in args:
        return " or ".join(type_name(a) for a in args if a is not type(None)) + " or null"
    if get_origin(hint) in (list, dict):
        return f"{get_origin(hint).__name__}[{', '.join(type_name(a) for a in args)}]"
    return "any" if hint is Any else hint.__name__


def default_text(value: Any) -> str:
    """A default as it is written in YAML (null, true, [a, b])."""
    if value is None or isinstance(value, (bool, list, dict)):
        return json.dumps(value).replace('"', "")
    return f'"{value}"' if value == "" else str(value)


def sentence(text: str) -> str:
    return text[0].upper() + text[1:] + ("" if text.endswith(".") else ".")


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def allowed_text(f: Any, hint: Any) -> str:
    """A field's allowed values (its `Rule`), "" for none: `constant, cosine`, `>= 0`, `each > 0`."""
    rule = f.metadata.get("rule")
    if rule is None:
        return ""
    if get_origin(hint) is not list:
        return rule.describe()
    if rule.length:
        return f"{rule.length} values {rule.describe()}"
    return f"each {'one of ' if rule.allowed else ''}{rule.describe()}"


def section(node: Any, key: str, classes: dict[str, str], keys: dict[tuple[str, str], str]) -> list[str]:
    """Markdown of one schema section at dotted `key`, `node` its default instance: a table of its plain
    fields, then its nested sections."""
    schema = type(node)
    hints = get_type_hints(schema)
    out = [f"### `{key}`", ""] if "." in key else []
    if "." in key and classes[schema.__name__]:
        out += [sentence(classes[schema.__name__]), ""]
    out += ["| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
    nested = []
    for f in fields(schema):
        if is_dataclass(hints[f.name]):
            nested.append((getattr(node, f.name), f"{key}.{f.name}"))
            continue
        meaning = keys[(schema.__name__, f.name)]
        if not meaning:
            raise SystemExit(f"ppo_trainer/config/schema.py: {schema.__name__}.{f.name} has no comment saying what it means; "
                             "add one after the field (or on the lines just above it)")
        default, allowed = cell(default_text(getattr(node, f.name))), cell(allowed_text(f, hints[f.name]))
        out.append(f"| `{key}.{f.name}` | {type_name(hints[f.name])} | `{default}` | {allowed} | {cell(meaning)} |")
    out.append("")
    for child, child_key in nested:
        out += section(child, child_key, classes, keys)
    return out


def render() -> str:
    """The whole of docs/config.md."""
    classes, keys = schema_comments(Path(config.__file__).read_text())
    picked = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / f"{CONFIG_NAME}.yaml").defaults)
    defaults = {k: v for entry in picked if isinstance(entry, dict) for k, v in entry.items()}
    out = [
        f"<!-- Generated from ppo_trainer/config/schema.py by scripts/gen_config_docs.py; do not edit: run `{COMMAND}`. -->",
        "# Config reference",
        "",
        "Every key of `ppo-train`, with its default and allowed values in the schema (`ppo_trainer/config/schema.py`; "
        "a value outside them stops the run with exit code 2 and one line naming the key; `or null` in the type: "
        "null is allowed too). A group option (`group=option`, a file `configs/<group>/<option>.yaml`) sets only "
        "what differs from these defaults; `configs/ppo.yaml` picks the option of each group that has options used "
        "when none is given; the other sections are set by their keys. Any key can be set on the command line "
        "(`ppo-train gae.lam=0.95`). Batch sizes count prompts (x `sampler.n` sequences), lengths count tokens.",
        "",
        f"Recipes (`+experiment=NAME`, configs/experiment/): {', '.join(f'`{o}`' for o in group_options('experiment'))}.",
        f"Sweeps (`--multirun +sweep=NAME`, configs/sweep/): {', '.join(f'`{o}`' for o in group_options('sweep'))}.",
        "",
    ]
    root = PPOConfig()
    for f in fields(PPOConfig):
        node = getattr(root, f.name)
        options = ", ".join(f"`{o}`" + (" (default)" if o == defaults.get(f.name) else "")
                            for o in group_options(f.name))
        out += [f"## `{f.name}`", ""]
        if classes[type(node).__name__]:
            out += [sentence(classes[type(node).__name__]), ""]
        if options:
            out += [f"Options (`{f.name}=OPTION`, configs/{f.name}/): {options}.", ""]
        out += section(node, f.name, classes, keys)
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md differs from the schema")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            sys.exit(f"docs/config.md is stale: run `{COMMAND}`")
        return
    DOC.write_text(text)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
