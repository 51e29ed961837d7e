"""What of a config is secret, and the masked copy a run writes or prints (config.yaml, each
checkpoint, W&B and MLflow parameters, the dry run, messages that name a URL)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

_SECRET = re.compile(r"(?i)(token|secret|password|api[_-]?key)")


def mask_secrets(value: Any, key: str = "") -> Any:
    """Replace values under keys that look like credentials with '***', and the credentials of any
    URL (`redact_url`), in dicts and lists, recursively: what a run writes or prints of its config."""
    if isinstance(value, dict):
        return {k: mask_secrets(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_secrets(v, key) for v in value]
    if isinstance(value, str) and value and _SECRET.search(key) and not key.endswith(("_tokens", "_length")):
        return "***"
    return redact_url(value) if isinstance(value, str) else value


def mask_argument(arg: str) -> str:
    """A command-line argument as a run records it (command.txt): `key=VALUE` with a secret-looking
    key as `key=***`, a URL's credentials masked (`mask_secrets`' rules for one override)."""
    key, sep, value = arg.partition("=")
    return f"{key}{sep}{mask_secrets(value, key.lstrip('+'))}" if sep else redact_url(arg)


def has_credentials(url: str) -> bool:
    """Whether `url` carries userinfo (`user:password@` or `token@` before its host)."""
    try:
        return "@" in urlsplit(url).netloc
    except ValueError:  # not a URL urllib can split (e.g. "http://[::1"): nothing to mask in it
        return False


def redact_url(url: str) -> str:
    """`url` with the credentials of its userinfo shown as "***" (https://***@host/path): a URL may
    carry a password, and error messages and saved configs name the URL. Other text is returned as is."""
    if not has_credentials(url):
        return url
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))
