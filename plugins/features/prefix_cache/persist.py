"""Keeping the prefix store on disk (`dir`): one file per block, checksummed and versioned.

A file `<key>.dipc` holds one node: a magic line, a JSON header line (format, the store's
identity, the node's key, parent and depth, the payload's length and SHA-256) and the payload
(`torch.save` of the node's tensors, read back with `weights_only=True`: plain tensors only).
The identity hashes everything the state depends on besides the tokens: the engine version, the
back end, the model's files (config.json in full; each weight file's name, size and its first and
last MiB), the model options, the dtype, the cache layout (tensor names, shapes, dtypes, owners,
ring sizes) and the block length. It also seeds the chain of keys, so two models' blocks never
share a file name. A file that is truncated, fails its checksum, or carries another identity is
ignored with a warning that names it; a file whose parent block is missing is ignored silently
(its prefix could never be reached).

The store is loaded at engine start (oldest files first, so the newest are the most recently used)
and written at shutdown: new blocks are written (to a temporary name, then renamed), and the files
of blocks this store evicted are removed, so the directory holds what the store held.
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

from deepinfer.models.interface import CacheLayout

from .store import Node, PrefixStore

logger = logging.getLogger("deepinfer")

FORMAT = 1
MAGIC = b"DEEPINFER-PREFIX-CACHE\n"
SUFFIX = ".dipc"
_EDGE = 1 << 20  # bytes of each weight file's head and tail that the identity reads


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


class DiskStore:
    def __init__(self, directory: str | os.PathLike, identity_hex: str):
        self.dir = Path(directory)
        self.identity = identity_hex
        self.on_disk: set[bytes] = set()  # keys whose file this store wrote or read
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"prefix cache directory {self.dir} cannot be created ({e}); give a writable "
                             f"--prefix-cache-dir / DEEPINFER_PREFIX_CACHE_DIR") from e

    def _file(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}{SUFFIX}"

    def load(self, store: PrefixStore) -> int:
        """Add the directory's valid blocks to `store`; returns how many."""
        found: list[tuple[int, float, Node]] = []
        for f in self.dir.glob(f"*{SUFFIX}"):
            try:
                node = self._read(f)
            except (OSError, ValueError, RuntimeError, EOFError, KeyError, TypeError) as e:
                logger.warning("prefix cache: ignoring %s: %s", f, e)
                continue
            if node is not None:
                found.append((node.depth, f.stat().st_mtime, node))
        added: list[tuple[float, Node]] = []
        for _, mtime, node in sorted(found, key=lambda x: x[0]):  # a parent before its children
            if node.parent is not None and node.parent not in store.nodes:
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

    def _read(self, f: Path) -> Node | None:
        data = f.read_bytes()
        if not data.startswith(MAGIC):
            raise ValueError("not a deepinfer prefix-cache file (bad magic)")
        end = data.find(b"\n", len(MAGIC))
        if end < 0:
            raise ValueError("truncated header")
        header = json.loads(data[len(MAGIC):end])
        if header.get("format") != FORMAT:
            raise ValueError(f"format {header.get('format')} is not this engine's {FORMAT}")
        if header.get("identity") != self.identity:
            raise ValueError("it was written for another model, engine version, back end, dtype or cache layout")
        payload = data[end + 1:]
        if len(payload) != header["payload_bytes"] or hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
            raise ValueError("checksum mismatch (corrupt or truncated)")
        key = bytes.fromhex(header["key"])
        if f.name != f"{key.hex()}{SUFFIX}":
            raise ValueError("its name does not match the key it holds")
        body = torch.load(io.BytesIO(payload), weights_only=True)
        parent = bytes.fromhex(header["parent"]) if header["parent"] is not None else None
        return Node(key, parent, int(header["depth"]), body["entries"], body["slot"])

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
            header = {"format": FORMAT, "identity": self.identity, "key": key.hex(),
                      "parent": node.parent.hex() if node.parent is not None else None, "depth": node.depth,
                      "payload_bytes": len(payload), "payload_sha256": hashlib.sha256(payload).hexdigest()}
            tmp = self._file(key).with_suffix(".tmp")
            tmp.write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + payload)
            os.replace(tmp, self._file(key))
            self.on_disk.add(key)
            node.dirty = False
