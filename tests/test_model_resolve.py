"""What runs when no model is named: DEEPINFER_HF_MODEL_DIR, else the seeds' default id from the local
Hugging Face cache, else the embedded default model (a random DeepSeek-V4.1 built once). Never the network."""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest

from deepinfer.models import resolve
from deepinfer.models.resolve import DEFAULT_HF_MODEL_ID, resolve_model

REPO_DIR = "models--deepseek-ai--DeepSeek-V4.1-Flash-1017"


@pytest.fixture
def hub(tmp_path, clean_env):
    """An empty local Hugging Face cache (the real one is never looked at)."""
    path = tmp_path / "hub"
    path.mkdir()
    clean_env.setenv("HF_HUB_CACHE", str(path))
    return path


def _cache(hub: Path, checkpoint: Path, revision: str = "0123abc", ref: bool = True) -> Path:
    """`checkpoint` as the cached snapshot of the seeds' default id (the hub's layout)."""
    repo = hub / REPO_DIR
    snapshot = repo / "snapshots" / revision
    shutil.copytree(checkpoint, snapshot)
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_the_default_id_is_the_seeds():
    assert DEFAULT_HF_MODEL_ID == "deepseek-ai/DeepSeek-V4.1-Flash-1017"


def test_no_model_uses_the_default_id_when_the_cache_holds_it(tiny_v41, hub, tmp_path, clean_env):
    clean_env.setattr(resolve, "ensure_default_model", lambda: pytest.fail("the embedded default was built"))
    snapshot = _cache(hub, tiny_v41)
    resolved = resolve_model(None)
    assert (resolved.path, resolved.source, resolved.name) == (snapshot, "hf-cache", DEFAULT_HF_MODEL_ID)
    assert not resolved.is_default
    assert resolve_model(DEFAULT_HF_MODEL_ID).path == snapshot  # named explicitly: the same snapshot
    # DEEPINFER_HF_MODEL_DIR replaces the default, the cached one included; an explicit model beats both
    other = tmp_path / "other"
    shutil.copytree(tiny_v41, other)
    clean_env.setenv("DEEPINFER_HF_MODEL_DIR", str(other))
    assert (resolve_model(None).path, resolve_model(None).source) == (other.resolve(), "env")
    assert resolve_model(str(tiny_v41)).path == tiny_v41.resolve()


def test_a_cache_without_refs_uses_its_snapshot(tiny_v41, hub):
    snapshot = _cache(hub, tiny_v41, revision="fedcba9", ref=False)
    assert resolve_model(None).path == snapshot


def test_a_partial_default_in_the_cache_falls_back_with_a_warning(hub, tmp_path, clean_env, caplog):
    (hub / REPO_DIR / "snapshots" / "0123abc").mkdir(parents=True)  # a download that never got config.json
    clean_env.setattr(resolve, "ensure_default_model", lambda: tmp_path)
    with caplog.at_level(logging.WARNING, logger="deepinfer.models.resolve"):
        resolved = resolve_model(None)
    assert resolved.is_default and resolved.path == tmp_path
    assert "unusable copy of deepseek-ai/DeepSeek-V4.1-Flash-1017" in caplog.text
    assert "no snapshot has config.json" in caplog.text


def test_the_default_id_not_in_the_cache_says_how_to_get_it(hub):
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(DEFAULT_HF_MODEL_ID)
    message = str(err.value)
    assert "not in the local Hugging Face cache" in message and "never downloads" in message
    assert "huggingface-cli download deepseek-ai/DeepSeek-V4.1-Flash-1017" in message
    assert ("snapshot_download('deepseek-ai/DeepSeek-V4.1-Flash-1017', "
            "local_dir='/models/DeepSeek-V4.1-Flash-1017')") in message
    assert "DEEPINFER_HF_MODEL_DIR=/models/DeepSeek-V4.1-Flash-1017" in message
    with pytest.raises(FileNotFoundError) as err:  # another id: DEEPINFER_HF_MODEL_DIR would not apply
        resolve_model("org/other")
    assert "huggingface-cli download org/other" in str(err.value) and "DEEPINFER_HF_MODEL_DIR" not in str(err.value)


@pytest.mark.slow
def test_default_model_is_a_v41_created_once(hub, tmp_path, clean_env):
    from deepinfer.models.deepseek_v41.demo_model import MARKER_FILE, marker
    from deepinfer.models.registry import load_model_checkpoint
    from deepinfer.tokenizer import load_tokenizer

    clean_env.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "models" / "demo-v41"
    target.mkdir(parents=True)  # a stale one (another demo file's marker) is replaced
    (target / MARKER_FILE).write_text(json.dumps({**marker(), "sha256": "0" * 64}))
    umask = os.umask(0o002)  # a user-private-group umask: plain writes would be group-writable
    try:
        first = resolve_model(None)
    finally:
        os.umask(umask)
    assert first.is_default and first.path == target and first.name == "demo-v41"
    # a private store: folders 0700, files 0600
    assert stat.S_IMODE(os.stat(target.parent).st_mode) == 0o700
    for path in [target, *target.rglob("*")]:
        assert stat.S_IMODE(os.lstat(path).st_mode) == (0o700 if path.is_dir() else 0o600), path
    assert json.loads((target / MARKER_FILE).read_text()) == marker()
    stamp = (first.path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(None).path == first.path
    assert (first.path / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
    assert not list(target.parent.glob(".demo-v41-*"))  # no temporary folder left behind
    family, config, tensors = load_model_checkpoint(first.path, "auto")
    assert family.model_type == "deepseek_v41" and config.vocab_size == 129280
    assert {"sliding", "full", "reindex", "reuse"} <= set(config.layer_roles) and config.engram_layer_ids
    # the seeds' model speculates with its own DSpark drafter: the default brings one
    assert config.num_nextn_predict_layers > 0
    assert {name.split(".")[1] for name in tensors if name.startswith("mtp.")} == {
        str(i) for i in range(config.num_nextn_predict_layers)}
    assert load_tokenizer(first.path, vocab_size=config.vocab_size).encode("<think>") == [128821]


def _earlier_default(cache: Path) -> Path:
    """A current default model as earlier versions left it under DEEPINFER_CACHE_DIR=cache: folders
    0755, files 0644 (a marker and a stand-in weights file: nothing here loads it)."""
    from deepinfer.models.deepseek_v41.demo_model import MARKER_FILE, marker

    target = cache / "models" / "demo-v41"
    (target / "tokenizer").mkdir(parents=True)
    (target / MARKER_FILE).write_text(json.dumps(marker()))
    (target / "model.safetensors").write_bytes(b"weights")
    (target / "tokenizer" / "tokenizer.json").write_text("{}")
    for path in [cache / "models", *target.parent.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return target


def test_an_earlier_versions_default_model_keeps_working(hub, tmp_path, clean_env):
    clean_env.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    target = _earlier_default(tmp_path / "cache")
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(None).path == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp  # used as it is, not rebuilt
    assert stat.S_IMODE(os.stat(target.parent).st_mode) == 0o700  # its folder tightened


SPOILED = {
    "weights writable by everyone": lambda t: os.chmod(t / "model.safetensors", 0o666),
    "tokenizer folder writable by its group": lambda t: os.chmod(t / "tokenizer", 0o775),
    "weights a symlink": lambda t: ((t / "model.safetensors").unlink(),
                                    (t / "model.safetensors").symlink_to(t.parent.parent / "planted")),
    "model of another user": lambda t: os.chown(t, 65534, 65534),
}


@pytest.mark.parametrize("how", list(SPOILED))
def test_a_default_model_others_could_have_changed_is_refused(hub, tmp_path, clean_env, how):
    from deepinfer.private_store import StoreError

    if how == "model of another user" and os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    clean_env.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    target = _earlier_default(tmp_path / "cache")
    (tmp_path / "cache" / "planted").write_bytes(b"other weights")
    SPOILED[how](target)
    with pytest.raises(StoreError) as err:
        resolve_model(None)
    message = str(err.value)
    assert "default model" in message and f"rm -r {target}" in message and "DEEPINFER_CACHE_DIR" in message
    assert (target / "model.safetensors").exists() or (target / "model.safetensors").is_symlink()  # left alone


@pytest.mark.parametrize("what", ["/dev/null", "a file"])
def test_a_cache_dir_that_is_not_a_directory_names_the_variable(hub, tmp_path, clean_env, what):
    from deepinfer.private_store import StoreError

    path = Path(what) if what.startswith("/") else tmp_path / "file"
    if what == "a file":
        path.write_text("not a folder")
    clean_env.setenv("DEEPINFER_CACHE_DIR", str(path))
    with pytest.raises(StoreError) as err:
        resolve_model(None)
    message = str(err.value)
    assert f"{path} is " in message and "not a directory" in message
    assert "point DEEPINFER_CACHE_DIR at a directory of yours" in message
