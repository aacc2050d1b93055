"""The prefix_cache feature: a hit gives the tokens of a miss (fp32), LRU eviction, persistence.

The tiny checkpoints have a sliding window of 8 and compression rates 4 and 16 (DeepSeek-V4) or 1
and 2 (V4.1), so a 70-token shared prefix with 16-token blocks crosses the window many times and
covers several entries of every rate; the cache's first hit restores 64 tokens of state.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import shutil
import stat

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.interface import BlockGroup, CacheLayout, StateTensor, allocate_cache_tensors

from conftest import TINY_SEED

BLOCK = 16
VOCAB = 512
_rng = random.Random(0)
SHARED = [_rng.randrange(3, VOCAB) for _ in range(70)]
P1 = SHARED + [_rng.randrange(3, VOCAB) for _ in range(5)]  # 75 tokens
P2 = SHARED + [_rng.randrange(3, VOCAB) for _ in range(9)]  # shares 70 with P1: a hit of 64
P3 = SHARED[:20] + [_rng.randrange(3, VOCAB) for _ in range(30)]  # shares 20 with P1, inside P1's first chunk
P4 = SHARED[:20] + [_rng.randrange(3, VOCAB) for _ in range(25)]  # shares 20 with P3: a hit of 16
OTHER = [_rng.randrange(3, VOCAB) for _ in range(60)]  # nothing in common
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpts(tiny_v4, tiny_v41, tmp_path_factory):
    from deepinfer.models.deepseek_v4.make_model import make_model as make_v4

    other = make_v4(tmp_path_factory.mktemp("prefix") / "v4b", "tiny", seed=TINY_SEED + 1)
    return {"v4": str(tiny_v4), "v4_other": str(other), "v41": str(tiny_v41)}  # all fp32


def _llm(path: str, prefix: dict | None, **kw) -> LLM:
    features = {} if prefix is None else {"prefix_cache": {"block_tokens": BLOCK, **prefix}}
    return LLM(model=path, accelerator="cpu", dtype="float32", max_model_len=256, max_num_seqs=4,
               features=features, **kw)


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], float]]:
    """One generate call per prompt (in order, so later prompts can hit earlier ones' blocks)."""
    outs = []
    for p in prompts:
        o = llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0]
        assert o.error is None, o.error
        outs.append((o.outputs[0].token_ids, o.outputs[0].cumulative_logprob))
    return outs


@pytest.fixture(scope="module")
def reference(ckpts):
    """Tokens and cumulative logprobs without the prefix cache, per family."""
    out = {}
    for family in ("v4", "v41"):
        with _llm(ckpts[family], None) as llm:
            out[family] = dict(zip(("p1", "p2", "p3", "p4", "other"), _run(llm, [P1, P2, P3, P4, OTHER])))
    return out


def _same(got, want, exact: bool = False) -> None:
    assert got[0] == want[0]
    assert got[1] == want[1] if exact else abs(got[1] - want[1]) < 1e-4


@pytest.mark.parametrize("family,async_pipeline", [("v4", False), ("v4", True), ("v41", False)])
def test_hit_gives_the_tokens_of_a_miss(ckpts, reference, family, async_pipeline):
    ref = reference[family]
    with _llm(ckpts[family], {}, async_pipeline=async_pipeline) as llm:
        p1, p2, p3, p4, p1_again = _run(llm, [P1, P2, P3, P4, P1])
        stats = llm.stats()["prefix_cache"]
    _same(p1, ref["p1"])  # a miss (chunked at 64 instead of one chunk: the same tokens)
    _same(p2, ref["p2"])  # a hit of 64 tokens past the window and 16 + 4 compressed entries
    # P3 shares block 1 with P1, but P1 left no state there (inside its first chunk): a miss whose
    # first chunk ends at 16 and snapshots it, so that P4 (diverging after 20 tokens) hits 16
    _same(p3, ref["p3"])
    _same(p4, ref["p4"])
    _same(p1_again, p1, exact=True)  # a hit restores exactly the state the miss computed
    assert stats["hits"] == 3 and stats["misses"] == 2
    assert stats["prefill_tokens_saved"] == 64 + 16 + 64  # P1 again: 74 may be reused, 64 are cached
    assert stats["prefill_tokens_total"] == len(P1) + len(P2) + len(P3) + len(P4) + len(P1)


def test_generated_tokens_are_cached_for_the_next_turn(ckpts, reference):
    """A follow-up turn (prompt = previous prompt + answer + more) hits the blocks its decode left."""
    with _llm(ckpts["v4"], {}) as llm:
        (answer, _), = _run(llm, [P1])
        follow = P1 + answer + OTHER[:10]  # 75 + 12 + 10 = 97 tokens: blocks up to 80 hold the answer
        with _llm(ckpts["v4"], None) as plain:
            want = _run(plain, [follow])[0]
        got = _run(llm, [follow])[0]
        stats = llm.stats()["prefix_cache"]
    _same(got, want)
    assert stats["prefill_tokens_saved"] == 80  # decode snapshotted at 80 (prompt 75 + 5 generated)


def test_eviction_under_a_tiny_budget(ckpts, reference):
    with _llm(ckpts["v4"], {"capacity_mb": 0.04}) as llm:  # about two blocks with their slot state
        outs = _run(llm, [P1, OTHER, P1])
        stats = llm.stats()["prefix_cache"]
    for got, key in zip(outs, ("p1", "other", "p1")):
        _same(got, reference["v4"][key])
    assert stats["evictions"] > 0
    assert stats["bytes_used"] <= stats["bytes_capacity"]
    assert stats["hits"] == 0  # P1's blocks were evicted for OTHER's


def _toy_store(capacity_bytes: int):
    from deepinfer_plugins.features.prefix_cache.store import PrefixStore

    layout = CacheLayout(slot_tensors=(StateTensor("ring", (4,), torch.float32, (0,)),),
                         block_groups=(BlockGroup("c2", 2, (StateTensor("e", (1,), torch.float32, (0,)),)),),
                         max_rollback=0)
    tensors = allocate_cache_tensors(layout, num_slots=2, num_blocks={"c2": 8}, block_size=2, device="cpu")
    return PrefixStore(layout, block_tokens=4, capacity_bytes=capacity_bytes), tensors


def _capture(store, tensors, tokens: list[int], value: float) -> None:
    tensors.slot["ring"][0, 0] = value
    tensors.blocks["c2"]["e"][0, :, 0] = value + torch.arange(16.0)
    cap = store.capture(tokens, len(tokens))
    cap.copy(tensors, 0, {"c2": [0, 1, 2, 3]})
    cap.commit(tokens)


def test_lru_eviction_order():
    """Each node: 2 entries (8 B) + at the leaf a 16 B ring. Capacity for two 2-block chains."""
    store, tensors = _toy_store(capacity_bytes=2 * (8 + 8 + 16))
    a, b, c = [1] * 8, [2] * 8, [3] * 8
    _capture(store, tensors, a, 10.0)
    _capture(store, tensors, b, 20.0)
    assert store.lookup(a, 8).num_tokens == 8  # touch A: B is now the least recently used
    _capture(store, tensors, c, 30.0)
    assert store.lookup(b, 8) is None
    assert store.lookup(a, 8) is not None and store.lookup(c, 8) is not None
    assert store.stats().evictions == 2 and store.bytes_used <= store.capacity_bytes
    hit = store.lookup(c + [9], 8)  # restore C's state into slot 1 and other blocks
    hit.restore(tensors, 1, {"c2": [7, 6, 5, 4]})
    assert tensors.slot["ring"][0, 1].tolist() == [30.0] * 4
    assert tensors.blocks["c2"]["e"][0, [14, 15, 12, 13], 0].tolist() == [30.0, 31.0, 32.0, 33.0]
    assert store.lookup(c, 7).num_tokens == 0  # block 1 of C has no slot state: nothing to restore


def test_lookup_needs_slot_state_and_stops_at_max_tokens():
    store, tensors = _toy_store(capacity_bytes=1 << 20)
    _capture(store, tensors, [5] * 8, 1.0)  # nodes for blocks 1 and 2; slot state at 8 only
    shared = store.lookup([5] * 8, 7)  # block 2 is too long; block 1 is known but has no slot state
    assert (shared.num_tokens, shared.split_at) == (0, 4)  # nothing to restore; worth a snapshot at 4
    assert (store.lookup([5] * 9, 8).num_tokens, store.lookup([5] * 9, 8).split_at) == (8, 0)
    assert store.lookup([6] * 8, 8) is None  # nothing in common


def test_persisted_cache_reloads_after_restart(ckpts, reference, tmp_path, caplog):
    d = tmp_path / "pc"
    with _llm(ckpts["v4"], {"dir": str(d)}) as llm:
        _run(llm, [P1])
    files = sorted(d.glob("*.dipc"))
    assert files  # written at shutdown
    with _llm(ckpts["v4"], {"dir": str(d)}) as llm:
        got = _run(llm, [P2])[0]
        stats = llm.stats()["prefix_cache"]
    _same(got, reference["v4"]["p2"])
    assert stats["hits"] == 1 and stats["prefill_tokens_saved"] == 64

    # the same directory for another model (other weights, same config): every file is ignored
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        with _llm(ckpts["v4_other"], {"dir": str(d)}) as llm:
            _run(llm, [P2])
            assert llm.stats()["prefix_cache"]["hits"] == 0
    mismatched = [r.getMessage() for r in caplog.records if "another model" in r.getMessage()]
    assert len(mismatched) >= len(files)


def test_corrupt_cache_file_is_ignored_with_a_warning(ckpts, reference, tmp_path, caplog):
    d = tmp_path / "pc"
    with _llm(ckpts["v4"], {"dir": str(d)}) as llm:
        _run(llm, [P1])
    files = sorted(d.glob("*.dipc"), key=lambda f: f.stat().st_size)
    flipped, truncated = files[-1], files[0]  # the largest holds the slot state at 64 (and 80)
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-7])
    (d / "garbage.dipc").write_bytes(b"not a cache file")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        with _llm(ckpts["v4"], {"dir": str(d)}) as llm:
            got = _run(llm, [P2])[0]
    _same(got, reference["v4"]["p2"])
    warned = "\n".join(r.getMessage() for r in caplog.records)
    for f in (flipped, truncated, d / "garbage.dipc"):
        assert str(f) in warned
    assert "checksum" in warned and "bad magic" in warned


def test_off_by_default_changes_nothing(ckpts, reference):
    chunks = {}
    for name, prefix in (("off", None), ("on", {})):
        with _llm(ckpts["v4"], prefix, max_num_batched_tokens=50) as llm:
            seen = []
            schedule = llm.engine.scheduler.schedule

            def recording(schedule=schedule, seen=seen):
                out = schedule()
                seen += [s.query_len for s in out.scheduled if s.query_len > 1]
                return out
            llm.engine.scheduler.schedule = recording
            _same(_run(llm, [P1])[0], reference["v4"]["p1"])
            chunks[name] = seen
            if prefix is None:
                assert llm.engine.cache.prefix_cache is None and llm.stats()["prefix_cache"] is None
                assert "prefix_cache" not in llm.engine.features.configs
    assert chunks["off"] == [50, 25]  # the token budget alone decides
    assert chunks["on"] == [48, 16, 11]  # chunks end on block boundaries: 48, 64, then the rest


def test_refused_with_bounded_replay_and_bad_block_tokens(ckpts):
    from deepinfer.plugins import PluginError

    with pytest.raises(ValueError, match="not a multiple of the compression ratios"):
        _llm(ckpts["v4"], {"block_tokens": 6})
    with pytest.raises(PluginError, match="prefix_cache"):
        LLM(model=ckpts["v41"], accelerator="cpu", dtype="float32", max_model_len=64,
            features={"prefix_cache": {}, "swa_replay": {}})


def test_serve_flags_and_metrics(ckpts):
    """`deepinfer serve --prefix-cache...` enables the feature; /metrics reports its counters."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("deepseek_recipe")
    httpx = pytest.importorskip("httpx2")

    from deepinfer.entrypoints.serve import build_parser, build_server, prefix_cache_features
    from deepinfer.server.protocol import ServerSettings
    from server_harness import running_server

    assert prefix_cache_features(build_parser().parse_args([])) is None
    assert prefix_cache_features(build_parser().parse_args(["--prefix-cache"])) == {"prefix_cache": {}}
    args = build_parser().parse_args(["--prefix-cache-dir", "/tmp/x", "--prefix-cache-mb", "8"])
    assert prefix_cache_features(args) == {"prefix_cache": {"dir": "/tmp/x", "capacity_mb": 8.0}}

    app, front = build_server(ServerSettings(), model=ckpts["v4"], accelerator="cpu", dtype="float32",
                              max_model_len=256, async_pipeline=False,
                              features={"prefix_cache": {"block_tokens": BLOCK}})
    with running_server(app, front) as url:
        for prompt in (P1, P2):
            r = httpx.post(url + "/v1/completions", json={"model": os.path.basename(ckpts["v4"]), "prompt": prompt,
                                                          "max_tokens": 4, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
        metrics = {}
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith("deepinfer_prefix_cache"):
                name, value = line.rsplit(" ", 1)
                metrics[name] = float(value)
    assert metrics["deepinfer_prefix_cache_hits"] == 1 and metrics["deepinfer_prefix_cache_misses"] == 1
    assert metrics["deepinfer_prefix_cache_prefill_tokens_saved"] == 64


@pytest.mark.parametrize("family", ["v4", "v41"])
@pytest.mark.slow
def test_hit_is_bitwise_a_miss_with_batch_invariant_kernels(ckpts, family):
    """With the batch-invariant kernels a prefill chunk's numbers do not depend on where it starts
    or what it is batched with, so a hit's logits are the very bits of a miss's (bf16 included)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=VOCAB)

    def traces(prefix):
        features = {"batch_invariant": {}, **({"prefix_cache": {"block_tokens": BLOCK}} if prefix else {})}
        with LLM(model=ckpts[family], accelerator="cpu", dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                 features=features) as llm:
            outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in (P1, P2, P1)]
            if prefix:
                assert llm.stats()["prefix_cache"]["hits"] == 2
        return [[sorted((t, e.logprob) for t, e in step.items()) for step in o.outputs[0].logprobs] for o in outs]

    assert traces(prefix=True) == traces(prefix=False)


def test_environment_variable_enables_it_with_the_default_block(ckpts, monkeypatch):
    monkeypatch.setenv("DEEPINFER_PREFIX_CACHE", "1")
    with LLM(model=ckpts["v4"], accelerator="cpu", dtype="float32", max_model_len=256) as llm:
        prefix = llm.engine.cache.prefix_cache
        assert prefix is not None
        assert prefix.block_tokens == 128  # the smallest multiple of the rates 4 and 16 that is >= 128
    monkeypatch.setenv("DEEPINFER_PREFIX_CACHE", "0")
    with LLM(model=ckpts["v4"], accelerator="cpu", dtype="float32", max_model_len=256) as llm:
        assert llm.engine.cache.prefix_cache is None


@pytest.mark.slow
def test_preempted_requests_resume_from_their_own_snapshots(ckpts):
    """A preempted request recomputes prompt + generated tokens; with the cache it restores the
    snapshot its own decode left, and its tokens stay those of an engine without the cache."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(40 + i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    # blocks of 2 entries (8 and 32 tokens): the pool runs out while the requests decode
    common = dict(model=ckpts["v4"], accelerator="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
                  block_size=2, max_num_batched_tokens=256)
    with LLM(**common) as probe:
        per_request = probe.build_info.pool.bytes_per_max_request
    tokens = {}
    for on in (False, True):
        features = {"prefix_cache": {"block_tokens": BLOCK}} if on else {}
        with LLM(**common, cache_memory_gb=2.5 * per_request / 2**30, features=features) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens[on] = [o.outputs[0].token_ids for o in outs]
            assert llm.stats()["num_preemptions"] > 0
            if on:
                stats = llm.stats()["prefix_cache"]
                assert stats["hits"] == llm.stats()["num_preemptions"]  # each readmission restores
                assert stats["prefill_tokens_saved"] > 0
    assert tokens[True] == tokens[False]


# -- the persistence folder is a private store; a bad file is skipped, never restored -------------

IDENTITY = "ab" * 32


def _toy_disk(directory) -> tuple:
    """A toy store of one 2-block chain (slot state at its end) saved to `directory`."""
    from deepinfer_plugins.features.prefix_cache.persist import DiskStore

    store, tensors = _toy_store(capacity_bytes=1 << 20)
    _capture(store, tensors, [1] * 8, 10.0)
    DiskStore(directory, IDENTITY).save(store)
    return store


def _reload(directory) -> tuple:
    from deepinfer_plugins.features.prefix_cache.persist import DiskStore

    store, _ = _toy_store(capacity_bytes=1 << 20)
    return DiskStore(directory, IDENTITY).load(store), store


def _split(f) -> tuple[dict, bytes]:
    from deepinfer_plugins.features.prefix_cache.persist import MAGIC

    data = f.read_bytes()
    end = data.index(b"\n", len(MAGIC))
    return json.loads(data[len(MAGIC):end]), data[end + 1:]


def _resign(f, body=None, header=None, payload: bytes | None = None) -> None:
    """Rewrite a cache file as whoever can write the folder could: a changed body (or raw payload)
    under a matching checksum, or a changed header line."""
    from deepinfer_plugins.features.prefix_cache.persist import MAGIC

    head, old = _split(f)
    if body is not None:
        tensors = torch.load(io.BytesIO(old), weights_only=True)
        body(tensors)
        buf = io.BytesIO()
        torch.save(tensors, buf)
        payload = buf.getvalue()
    payload = old if payload is None else payload
    head.update(payload_bytes=len(payload), payload_sha256=hashlib.sha256(payload).hexdigest())
    line = json.dumps(head).encode() if header is None else header(head)
    f.write_bytes(MAGIC + line + b"\n" + payload)


def _leaf(directory):
    """The file of the block that holds slot state (the chain's last)."""
    [leaf] = [f for f in directory.glob("*.dipc") if _split(f)[0]["depth"] == 2]
    return leaf


def _set(path: str, value):
    def change(body):
        *outer, last = path.split("/")
        holder = body
        for key in outer:
            holder = holder[key]
        if value is None:
            del holder[last]
        else:
            holder[last] = value(holder.get(last))
    return change


BAD_BLOCKS = {
    "wrong shape": dict(body=_set("slot/ring", lambda t: torch.zeros(1, 5))),
    "wrong dtype": dict(body=_set("slot/ring", lambda t: t.double())),
    "extra tensor": dict(body=_set("slot/extra", lambda t: torch.zeros(1, 4))),
    "missing group": dict(body=_set("entries/c2", None)),
    "entries of another length": dict(body=_set("entries/c2/e", lambda t: torch.cat([t, t], dim=1))),
    "NaN": dict(body=_set("slot/ring", lambda t: t.fill_(float("nan")))),
    "not tensors": dict(body=_set("slot/ring", lambda t: [1.0, 2.0])),
    "header list": dict(header=lambda head: b"[1, 2]"),
    "header string": dict(header=lambda head: b'"depth"'),
    "header null": dict(header=lambda head: b"null"),
    "depth Infinity": dict(header=lambda head: json.dumps(head).replace('"depth": 2', '"depth": Infinity').encode()),
    "garbage payload": dict(payload=b"garbage that is no torch.save archive"),
}


@pytest.mark.parametrize("bad", list(BAD_BLOCKS))
def test_a_block_that_does_not_fit_the_layout_is_skipped_with_a_warning(tmp_path, caplog, bad):
    d = tmp_path / "pc"
    _toy_disk(d)
    leaf = _leaf(d)
    _resign(leaf, **BAD_BLOCKS[bad])
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        loaded, store = _reload(d)
    assert loaded == 1 and all(node.slot is None for node in store.nodes.values())  # the first block only
    [warning] = [r.getMessage() for r in caplog.records if "prefix cache" in r.getMessage()]
    assert str(leaf) in warning


def test_a_block_whose_depth_does_not_follow_its_parent_is_not_loaded(tmp_path):
    d = tmp_path / "pc"
    _toy_disk(d)
    _resign(_leaf(d), header=lambda head: json.dumps({**head, "depth": 7}).encode())
    assert _reload(d)[0] == 1


def test_persisted_files_are_private(tmp_path):
    d = tmp_path / "pc"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)  # as earlier versions made it: others could read every cached state
    _toy_disk(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    files = sorted(os.listdir(d))
    assert len(files) == 2 and all(f.endswith(".dipc") for f in files)  # no temporary file left
    assert all(stat.S_IMODE(os.stat(d / f).st_mode) == 0o600 for f in files)
    assert _reload(d)[0] == 2


def test_saving_never_writes_through_a_planted_symlink(tmp_path):
    """Block keys are predictable from any file's header: a link planted under a block's final or
    temporary name must not make the engine overwrite the file it points to."""
    from deepinfer_plugins.features.prefix_cache.persist import DiskStore

    store, tensors = _toy_store(capacity_bytes=1 << 20)
    _capture(store, tensors, [1] * 8, 10.0)
    d = tmp_path / "pc"
    disk = DiskStore(d, IDENTITY)
    victims = []
    for i, key in enumerate(store.nodes):
        for name in (f"{key.hex()}.tmp", f"{key.hex()}.dipc"):
            victim = tmp_path / f"victim-{i}-{name[-4:]}"
            victim.write_bytes(b"precious")
            (d / name).symlink_to(victim)
            victims.append(victim)
    disk.save(store)
    assert all(v.read_bytes() == b"precious" for v in victims)
    assert not any((d / f"{key.hex()}.dipc").is_symlink() for key in store.nodes)
    assert _reload(d)[0] == 2


@pytest.mark.parametrize("bits", [0o777, 0o770], ids=oct)
def test_a_folder_others_can_write_is_refused(tmp_path, bits):
    from deepinfer.private_store import StoreError
    from deepinfer_plugins.features.prefix_cache.persist import DiskStore

    d = tmp_path / "pc"
    d.mkdir()
    os.chmod(d, bits)
    with pytest.raises(StoreError) as err:
        DiskStore(d, IDENTITY)
    assert str(d) in str(err.value) and "DEEPINFER_PREFIX_CACHE_DIR" in str(err.value)
    assert "chmod 700" in str(err.value)


def test_a_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    from deepinfer.private_store import StoreError
    from deepinfer_plugins.features.prefix_cache.persist import DiskStore

    d = tmp_path / "pc"
    _toy_disk(d)
    me = os.getuid()
    if me == 0:
        os.chown(d, 65534, 65534)  # nobody
    else:
        monkeypatch.setattr(os, "getuid", lambda: me + 1)
    with pytest.raises(StoreError, match="owned by"):
        DiskStore(d, IDENTITY)


def test_a_fifo_a_symlink_or_an_oversized_file_named_like_a_block_is_skipped(tmp_path, caplog, no_hang):
    d = tmp_path / "pc"
    _toy_disk(d)
    (d / "link.dipc").symlink_to(_leaf(d))
    os.mkfifo(d / "fifo.dipc")  # opened for reading, it would wait for a writer forever
    store, _ = _toy_store(capacity_bytes=1 << 20)
    with open(d / "huge.dipc", "wb") as f:
        f.truncate(store.max_block_bytes + (2 << 20))
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        assert _reload(d)[0] == 2
    for name, why in (("fifo.dipc", "FIFO"), ("link.dipc", ""), ("huge.dipc", "more than")):
        [warning] = [r.getMessage() for r in caplog.records if str(d / name) in r.getMessage()]
        assert why in warning


@pytest.fixture(scope="module")
def persisted_p1(ckpts, tmp_path_factory):
    """The folder a V4 engine persisted after serving P1."""
    d = tmp_path_factory.mktemp("persisted") / "pc"
    with _llm(ckpts["v4"], {"dir": str(d)}) as llm:
        _run(llm, [P1])
    return d


@pytest.mark.parametrize("bad", ["wrong shape", "NaN"])
def test_a_bad_block_on_disk_is_skipped_not_restored(ckpts, reference, persisted_p1, tmp_path, caplog, bad):
    """Re-signed with a tensor of the wrong shape, it used to load and fail the first step that hit
    it (the whole generate() call; in the server, the engine loop); with NaN it was restored and
    changed the outputs."""
    d = tmp_path / "pc"
    shutil.copytree(persisted_p1, d)
    largest = max(d.glob("*.dipc"), key=lambda f: f.stat().st_size)  # holds the slot state at 64

    def spoil(body):
        name, t = next(iter(body["slot"].items()))
        body["slot"][name] = t[..., :-1].clone() if bad == "wrong shape" else t.fill_(float("nan"))

    _resign(largest, body=spoil)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        with _llm(ckpts["v4"], {"dir": str(d)}) as llm:
            got = _run(llm, [P2])[0]
    _same(got, reference["v4"]["p2"])
    assert any(str(largest) in r.getMessage() for r in caplog.records)
