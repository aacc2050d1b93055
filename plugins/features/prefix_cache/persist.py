"""Keeping the prefix store on disk (`dir`): one file per block, checksummed and versioned.

A file `<key>.dipc` holds one node: a magic line, a JSON header line (format, the store's
identity, the node's key, parent and depth, the payload's length and SHA-256) and the payload
(`torch.save` of the node's tensors, read back with `weights_only=True`: plain tensors only).
The identity hashes everything the state depends on besides the tokens: the engine version, the
back end, the model's files (config.json in full; each weight file's name, size and its first and
last MiB), the model options, the dtype, the cache layout (tensor names, shapes, dtypes, owners,
ring sizes) and the block length. It also seeds the chain of keys, so two models' blocks never
share a file name.

The directory is a private store (`deepinfer.private_store`): created 0700 and refused unless it
is this user's and writable by nobody else; files are 0600, written under an exclusive temporary
name and renamed, and read only when they are regular files of this user within a size cap (so a
FIFO or a symlink planted there is skipped, never waited on or followed). The checksum catches
corruption (a torn write, a bad disk), not tampering: whoever can write the folder can re-sign a
file, and the folder's privacy is what keeps others out.

A file that is not a regular private file, is truncated, fails its checksum, carries another
identity or a malformed header, or whose tensors do not fit the engine's cache layout (names,
shapes, dtypes, finite values: `PrefixStore.check_block`) is skipped with a warning that names
it; a file whose parent block is missing is skipped silently (its prefix could never be reached).
A bad file never stops the engine from starting and is never restored into a step.

The store is loaded at engine start (oldest files first, so the newest are the most recently used)
and written at shutdown: new blocks are written, and the files of blocks this store evicted are
removed, so the directory holds what the store held.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepinfer.models.interface import CacheLayout
from deepinfer.private_store import PrivateDir, read_private, write_private

from .store import Node, PrefixStore

logger = logging.getLogger("deepinfer")

FORMAT = 1
MAGIC = b"DEEPINFER-PREFIX-CACHE\n"
SUFFIX = ".dipc"
_EDGE = 1 << 20  # bytes of each weight file's head and tail that the identity reads
_OVERHEAD = 1 << 20  # a file's bytes besides its tensors' (magic, header, torch.save's container): generous
_HEX_DIGEST = r"^[0-9a-f]{64}$"


def layout_signature(layout: CacheLayout) -> list[Any]:
    def tensor(t: Any) -> list[Any]:
        return [t.name, list(t.shape), str(t.dtype), list(t.owners), [list(p) for p in t.readers]]
    return [[tensor(t) for t in layout.slot_tensors],
            [[g.name, g.tokens_per_entry, [tensor(t) for t in g.tensors]] for g in layout.block_groups],
            layout.max_rollback]


def model_fingerprint(path: Path) -> str:
    """config.json in full, and each weight file's name, size, first and last MiB."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_EDGE))
            fh.seek(max(0, size - _EDGE))
            h.update(fh.read(_EDGE))
    return h.hexdigest()


def identity(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class Header(BaseModel):
    """A file's header line, checked field by field: it is read from disk."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    format: int
    identity: str
    key: str = Field(pattern=_HEX_DIGEST)
    parent: str | None = Field(pattern=_HEX_DIGEST)
    depth: int = Field(ge=1)
    payload_bytes: int = Field(ge=0)
    payload_sha256: str = Field(pattern=_HEX_DIGEST)


def _header(line: bytes) -> Header:
    parts = json.loads(line)
    if not isinstance(parts, dict):
        raise ValueError(f"its header is a JSON {type(parts).__name__}, not an object")
    if parts.get("format") != FORMAT:
        raise ValueError(f"format {parts.get('format')!r} is not this engine's {FORMAT}")
    try:
        return Header.model_validate(parts)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ValueError(f"bad header ({problems})") from None


class DiskStore:
    def __init__(self, directory: str | os.PathLike, identity_hex: str):
        self.dir = PrivateDir(directory, "prefix cache directory",
                              "read the cached model state of the prompts this engine served, or plant state that "
                              "changes its outputs", setting="--prefix-cache-dir / DEEPINFER_PREFIX_CACHE_DIR").ensure()
        self.identity = identity_hex
        self.on_disk: set[bytes] = set()  # keys whose file this store wrote or read

    def _file(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}{SUFFIX}"

    def load(self, store: PrefixStore) -> int:
        """Add the directory's valid blocks to `store`; returns how many."""
        found: list[tuple[int, float, Node]] = []
        max_bytes = store.max_block_bytes + _OVERHEAD
        for f in sorted(self.dir.glob(f"*{SUFFIX}")):
            try:
                node, mtime = self._read(f, store, max_bytes)
            # The file is input from disk: whatever reading, parsing or checking it raises (torch.load
            # alone raises half a dozen kinds), the block is skipped and the engine starts without it.
            except Exception as e:  # noqa: BLE001
                logger.warning("prefix cache: ignoring %s: %s", f, e)
                continue
            found.append((node.depth, mtime, node))
        added: list[tuple[float, Node]] = []
        for _, mtime, node in sorted(found, key=lambda x: x[0]):  # a parent before its children
            parent = store.nodes.get(node.parent) if node.parent is not None else None
            if node.parent is not None and (parent is None or parent.depth != node.depth - 1):
                continue  # its prefix could never be reached
            if node.key not in store.nodes:
                node.dirty = False
                store.add(node)
                self.on_disk.add(node.key)
                added.append((mtime, node))
        # recency as written: save() goes from least to most recently used (a child before its parent)
        for _, node in sorted(added, key=lambda x: (x[0], -x[1].depth)):
            store.nodes.move_to_end(node.key)
        store.trim()
        return len(added)

    def _read(self, f: Path, store: PrefixStore, max_bytes: int) -> tuple[Node, float]:
        data, st = read_private(f, max_bytes)
        if not data.startswith(MAGIC):
            raise ValueError("not a deepinfer prefix-cache file (bad magic)")
        end = data.find(b"\n", len(MAGIC))
        if end < 0:
            raise ValueError("truncated header")
        header = _header(data[len(MAGIC):end])
        if header.identity != self.identity:
            raise ValueError("it was written for another model, engine version, back end, dtype or cache layout")
        payload = data[end + 1:]
        if len(payload) != header.payload_bytes or hashlib.sha256(payload).hexdigest() != header.payload_sha256:
            raise ValueError("checksum mismatch (corrupt or truncated)")
        if f.name != f"{header.key}{SUFFIX}":
            raise ValueError("its name does not match the key it holds")
        if (header.parent is None) != (header.depth == 1):
            raise ValueError(f"depth {header.depth} does not fit its parent {header.parent}")
        body = torch.load(io.BytesIO(payload), weights_only=True)
        if not isinstance(body, dict) or set(body) != {"entries", "slot"}:
            raise ValueError("its payload is not a block's entries and slot state")
        node = Node(bytes.fromhex(header.key), bytes.fromhex(header.parent) if header.parent else None,
                    header.depth, body["entries"], body["slot"])
        store.check_block(node)
        return node, st.st_mtime

    def save(self, store: PrefixStore) -> None:
        """Write the blocks the directory lacks; remove the files of evicted blocks."""
        for key in list(self.on_disk - set(store.nodes)):
            self._file(key).unlink(missing_ok=True)
            self.on_disk.discard(key)
        for key, node in store.nodes.items():
            if not node.dirty:
                continue
            buf = io.BytesIO()
            torch.save({"entries": node.entries, "slot": node.slot}, buf)
            payload = buf.getvalue()
            header = Header(format=FORMAT, identity=self.identity, key=key.hex(),
                            parent=node.parent.hex() if node.parent is not None else None, depth=node.depth,
                            payload_bytes=len(payload), payload_sha256=hashlib.sha256(payload).hexdigest())
            write_private(self._file(key), MAGIC + header.model_dump_json().encode() + b"\n" + payload)
            self.on_disk.add(key)
            node.dirty = False
