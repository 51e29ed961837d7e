"""The local paths a config names, made absolute once when a run starts, before config.yaml is
written: a run folder then names its data, its reward function's file and its models wherever it
is read from (`ppo-eval` from another folder, Ray workers started in another folder), and a resume
compares a path typed relative with the absolute one saved (`absolute_paths` on both sides)."""

from __future__ import annotations

import os
from typing import Any

from omegaconf import OmegaConf

from ppo_trainer.config.trust import CODE_KEYS, code_refs, function_file

FILE_LIST_KEYS = ("data.train_files", "data.val_files")
# A model key's value is a path only where that folder exists: a hub name, embedded: and random: stay.
MODEL_KEYS = ("model.path", "critic.path", "reward.model.path")


def absolute(path: str) -> str:
    """`path` absolute against the working folder, `~` expanded, symbolic links kept as named."""
    return os.path.abspath(os.path.expanduser(path))


def absolute_paths(cfg: Any) -> Any:
    """`cfg` with every local path made absolute in place (and returned): the data files, the file of
    each code key's references (`trust.CODE_KEYS`: reward.fn, eval.reward_fn, the environment, the tools) and a model key naming a folder that
    exists here. A relative path is read against the working folder, as the run reads it."""
    for key in FILE_LIST_KEYS:
        files = OmegaConf.select(cfg, key)
        if files:
            OmegaConf.update(cfg, key, [absolute(str(f)) for f in files], merge=False)
    for key in CODE_KEYS:
        value = OmegaConf.select(cfg, key)
        if not any(function_file(ref) for ref in code_refs(value)):
            continue
        refs = [ref if function_file(ref) is None else f"{absolute(function_file(ref))}:{ref.rpartition(':')[2]}"
                for ref in code_refs(value)]
        OmegaConf.update(cfg, key, refs if OmegaConf.is_list(value) else refs[0], merge=False)
    for key in MODEL_KEYS:
        path = OmegaConf.select(cfg, key)
        if path and os.path.isdir(os.path.expanduser(path)):
            OmegaConf.update(cfg, key, absolute(path), merge=False)
    return cfg
