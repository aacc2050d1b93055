"""Turn a `--model_name` (or none) into a local checkpoint directory. Never uses the network.

Rules (the seeds' examples/_config.py behaviour, without downloads):

* an existing local directory is used directly (it must hold `config.json`);
* a Hugging Face id (`org/name`) is looked up in the local Hugging Face cache only
  (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`, layout
  `models--org--name/snapshots/<revision>/`); if it is not there, the error says how to download it;
* no model: `DEEPINFER_HF_MODEL_DIR` if set (it replaces only the *default* model, never an explicit
  one); else `deepseek-ai/DeepSeek-V4.1-Flash-1017` (`DEFAULT_HF_MODEL_ID`, the seeds' default) when
  the local Hugging Face cache holds it; else the embedded default model, the trained demo model (a
  small DeepSeek-V4.1 with its DSpark drafter, trained on Shakespeare's plays; shipped compact in the
  package, `deepinfer.models.deepseek_v41.demo_model`) expanded on first use into
  `$DEEPINFER_CACHE_DIR/models/demo-v41` (default `~/.cache/deepinfer/...`), a private store (see
  `ensure_default_model`), and reused.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from deepinfer import envs
from deepinfer.models.common.files import regular_file
from deepinfer.private_store import PrivateDir, cache_root

logger = logging.getLogger(__name__)

#: the seeds' default checkpoint, used without a model when the local Hugging Face cache holds it
DEFAULT_HF_MODEL_ID = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
#: the embedded default model: the trained demo model, expanded from the package's compact file
DEFAULT_MODEL_NAME = "demo-v41"
CONFIG_FILE = "config.json"
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # local directory holding config.json and the weights
    source: str  # "local", "hf-cache" (named, or the default id found in the cache), "env" or "default"
    name: str  # what the user asked for (or the default's name)

    @property
    def is_default(self) -> bool:
        """True when the embedded default (demo) model is used (callers should say so)."""
        return self.source == "default"


def _require_config(path: Path, how: str) -> Path:
    if not regular_file(path / CONFIG_FILE, "the checkpoint's config.json"):  # a FIFO or a folder: said so
        raise FileNotFoundError(
            f"HF checkpoint requires config.json: {path / CONFIG_FILE} does not exist ({how}). Point it at "
            f"the folder that holds config.json and the *.safetensors files, or finish the download.")
    return path


def hf_hub_cache_dir() -> Path:
    """The Hugging Face hub cache folder, following huggingface_hub's environment variables."""
    # HF's own variables, not deepinfer's: read directly (envs.py documents DEEPINFER_* only).
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def _download_hint(model_id: str) -> str:
    folder = "/models/" + model_id.rsplit("/", 1)[-1]
    return (f"deepinfer never downloads. Download it first, into the Hugging Face cache (`huggingface-cli download "
            f"{model_id}`) or into a folder of your choice (`python -c \"from huggingface_hub import "
            f"snapshot_download; snapshot_download('{model_id}', local_dir='{folder}')\"`), then pass that "
            f"folder (--model_name {folder})"
            + (f" or point DEEPINFER_HF_MODEL_DIR at it (export DEEPINFER_HF_MODEL_DIR={folder}; it replaces the "
               f"default model, so leave --model_name out)" if model_id == DEFAULT_HF_MODEL_ID else "")
            + ".")


def find_in_hf_cache(model_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of `model_id` in the local hub cache (FileNotFoundError if absent)."""
    cache = hf_hub_cache_dir()
    repo = cache / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        raise FileNotFoundError(
            f"model {model_id!r} is not a local directory and is not in the local Hugging Face cache "
            f"(looked for {repo}). {_download_hint(model_id)}")
    wanted = revision or "main"
    ref = repo / "refs" / wanted
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip()
    elif revision is not None:
        candidate = snapshots / revision
    else:  # no refs/main (e.g. copied caches): the most recently written snapshot with a config
        with_config = [p for p in snapshots.iterdir() if (p / CONFIG_FILE).is_file()]
        if not with_config:
            raise FileNotFoundError(f"model {model_id!r} is in the Hugging Face cache ({repo}) but no snapshot has "
                                    f"config.json (incomplete download?). {_download_hint(model_id)}")
        candidate = max(with_config, key=lambda p: p.stat().st_mtime)
    if not candidate.is_dir():
        raise FileNotFoundError(f"revision {wanted!r} of {model_id!r} is not in the local Hugging Face cache "
                                f"({candidate} is missing). {_download_hint(model_id)}")
    return _require_config(candidate, f"Hugging Face cache snapshot of {model_id}")


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def _models_dir() -> PrivateDir:
    return PrivateDir(default_model_dir().parent, "default model folder",
                      "replace the weights and tokenizer this engine loads")


def _is_current_default(path: Path) -> bool:
    from deepinfer.models.deepseek_v41.demo_model import MARKER_FILE, marker

    try:
        found = json.loads((path / MARKER_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(found, dict) and all(found.get(k) == v for k, v in marker().items())


def ensure_default_model() -> Path:
    """The embedded default model's directory, expanding the package's compact demo model on first
    use (a few seconds; its checksum is verified first).

    It lives in a private store (`deepinfer.private_store`): `$DEEPINFER_CACHE_DIR/models` is
    created 0700 (an existing one of this user's is tightened to 0700), and the model is written
    to a temporary folder next to its final place (folders 0700, files 0600) and renamed, so
    concurrent processes never see a half-written checkpoint; a stale one (another demo model file)
    is replaced. An existing model folder, or anything in it, that
    is a symlink, is not this user's or is writable by group or others is refused (StoreError)
    rather than rebuilt in place: someone else could have changed its weights, deleting their
    files may not even be possible, and the user should know that someone else could write there.
    """
    from deepinfer.models.deepseek_v41 import demo_model

    models = _models_dir()
    folder = models.ensure()
    target = folder / DEFAULT_MODEL_NAME
    if os.path.lexists(target):
        models.check_tree(target, f"remove the model (`rm -r {target}`) so that it is rebuilt privately")
        if _is_current_default(target):
            return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=folder))
    try:
        demo_model.expand_shipped(tmp)
        _make_private(tmp)
        if target.exists() and not _is_current_default(target):
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not _is_current_default(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_private(top: Path) -> None:
    """Folders 0700 and files 0600 under `top`, whatever the umask gave them."""
    top.chmod(0o700)
    for folder, dirs, files in os.walk(top):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o700)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o600)


def resolve_model(model_name: str | os.PathLike | None = None) -> ResolvedModel:
    """Local directory for `model_name` (see the module docstring for the rules)."""
    if model_name is not None and str(model_name).strip() != "":
        name = str(model_name)
        path = Path(name).expanduser()
        if path.is_dir():
            return ResolvedModel(_require_config(path.resolve(), f"--model_name {name}"), "local", name)
        id_part, _, revision = name.partition("@")
        if _HF_ID.match(id_part) and not name.startswith((".", "/", "~")):
            return ResolvedModel(find_in_hf_cache(id_part, revision or None), "hf-cache", name)
        raise FileNotFoundError(f"model {name!r} is neither an existing directory nor a Hugging Face id "
                                f"(org/name); give the folder that holds config.json and the weights")
    env_dir = envs.get("DEEPINFER_HF_MODEL_DIR")
    if env_dir:
        path = Path(env_dir).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"DEEPINFER_HF_MODEL_DIR={env_dir} is not a directory; point it at the "
                                    f"folder that holds config.json and the weights, or unset it")
        return ResolvedModel(_require_config(path.resolve(), "from DEEPINFER_HF_MODEL_DIR"), "env", env_dir)
    cached = _default_from_hf_cache()
    if cached is not None:
        return ResolvedModel(cached, "hf-cache", DEFAULT_HF_MODEL_ID)
    return ResolvedModel(ensure_default_model(), "default", DEFAULT_MODEL_NAME)


def _default_from_hf_cache() -> Path | None:
    """`DEFAULT_HF_MODEL_ID`'s snapshot when the local Hugging Face cache holds a complete one (with
    config.json), else None. A partial one (no usable snapshot) is named in a warning and skipped."""
    repo = hf_hub_cache_dir() / ("models--" + DEFAULT_HF_MODEL_ID.replace("/", "--"))
    if not repo.is_dir():
        return None
    try:
        return find_in_hf_cache(DEFAULT_HF_MODEL_ID)
    except FileNotFoundError as e:
        logger.warning("the local Hugging Face cache has an unusable copy of %s, so the embedded default model is "
                       "used instead: %s", DEFAULT_HF_MODEL_ID, e)
        return None
