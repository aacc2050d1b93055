"""The cpu back end's `decode_block` (plugins/cpu/decode_block.py): a V4 decoder block of a one-token decode
step as its C calls prepared once gives the bits of the same block run module by module (every layer type,
hash routing, windows completing, the indexer's picks), and a step or block it does not take runs module
by module."""
from __future__ import annotations

import pytest
import torch

from deepinfer_plugins.cpu import decode_block, native
from deepinfer_plugins.cpu.native import binding
from deepinfer_plugins.cpu.native.compressor import _COMPRESS_STORE
from model_harness import Runner, build_hf_model, build_our_model


@pytest.fixture
def fused_runs(monkeypatch) -> list[int]:
    """The block indices (by runner) of every step a block ran as its prepared calls."""
    runs, run = [], decode_block.DecodeBlockRunner.run

    def counted(self, *args):
        out = run(self, *args)
        if out is not None:
            runs.append(id(self))
        return out
    monkeypatch.setattr(decode_block.DecodeBlockRunner, "run", counted)
    return runs


def _models(dtype=torch.bfloat16):
    hf = build_hf_model()
    fused, modules = build_our_model(hf, dtype=dtype), build_our_model(hf, dtype=dtype)
    if fused.blocks[0].attn.accel.native_library is None:
        pytest.fail("the native library did not build; see the warning logged by deepinfer_plugins.cpu.native")
    modules.ops.decode_block = lambda *args: None  # module by module
    return fused, modules


def test_blocks_decode_the_same_bits(fused_runs):
    """One sequence decodes 44 steps past its prompt (the CSA windows complete every 4 tokens, the HCA ones
    every 16, the sliding window is 8): the logits of every step equal those of the model run module by
    module, and from the steps the packed copies exist every block runs as its calls."""
    fused, modules = _models()
    runners = [Runner(m, num_slots=4) for m in (fused, modules)]
    for r in runners:
        r.add("a")
    outs = [r.step({"a": list(range(1, 20))}) for r in runners]
    steps = 44
    for step in range(steps):
        token = int(outs[0]["a"][-1].argmax())
        outs = [r.step({"a": [token]}) for r in runners]
        assert torch.equal(outs[0]["a"], outs[1]["a"]), f"decode step {step}"
    if fused.blocks[0].attn.accel.native_amx:  # the composed ops run AMX tiles, which the calls do not take
        assert not fused_runs
        return
    per_block = {}
    for key in fused_runs:
        per_block[key] = per_block.get(key, 0) + 1
    assert len(per_block) == len(fused.blocks)  # sliding, CSA and HCA blocks, hash-routed ones among them
    assert min(per_block.values()) >= steps - 4  # all but the steps before the packed copies exist


def test_steps_of_several_tokens_and_a_new_cache_run_as_before(fused_runs):
    """Steps of two sequences and a prefill run module by module; a cache bound again gets new calls (the
    old ones address the old cache), with the same bits as module by module."""
    fused, modules = _models()
    for attempt in range(2):  # the second binds a new cache to the same model
        runners = [Runner(m, num_slots=4, seed=attempt) for m in (fused, modules)]
        for r in runners:
            r.add("a")
            r.add("b")
        outs = [r.step({"a": list(range(1, 12)), "b": list(range(3, 9))}) for r in runners]
        for step in range(6):
            chunks = {k: [int(outs[0][k][-1].argmax())] for k in outs[0] if k == "a" or step < 3}  # then "a" alone
            outs = [r.step(chunks) for r in runners]
            for k in chunks:
                assert torch.equal(outs[0][k], outs[1][k]), f"attempt {attempt}, step {step}, sequence {k}"
        assert bool(fused_runs) != fused.blocks[0].attn.accel.native_amx  # one-sequence steps: the prepared calls
        runners_now = [r for _, _, by_size in fused.blocks[0].attn.accel._decode_runners.values()
                       for r in by_size.values()]
        if attempt == 0:
            first = runners_now  # held: ids stay theirs
            fused_runs.clear()
    assert not any(a is b for a in first for b in runners_now)  # every block's calls made again for the new cache


def test_decode_batches_run_as_their_calls_with_the_same_bits(fused_runs, monkeypatch):
    """16 sequences at ragged contexts decode together (one token each): the blocks, prepared for 16 tokens,
    give the logits of the blocks run module by module; a batch the calls do not take runs module by module
    on both sides."""
    sizes = []
    build = decode_block.DecodeBlockRunner.build
    monkeypatch.setattr(decode_block.DecodeBlockRunner, "build",
                        lambda self, *a: sizes.append(self.T) or build(self, *a))
    fused, modules = _models()
    runners = [Runner(m, num_slots=16) for m in (fused, modules)]
    lengths = [3 + 5 * i for i in range(16)]  # ragged contexts across the compression boundaries
    for r in runners:
        for i in range(16):
            r.add(i)
        r.step({i: [(7 * i + j) % 500 + 1 for j in range(lengths[i])] for i in range(16)})
    tokens = {i: [i + 1] for i in range(16)}
    for step in range(6):
        outs = [r.step(tokens) for r in runners]
        for i in range(16):
            assert torch.equal(outs[0][i], outs[1][i]), f"sequence {i}, decode step {step}"
        tokens = {i: [int(outs[0][i][-1].argmax())] for i in range(16)}
    kernels = fused.blocks[0].attn.accel
    low, high = kernels._packed_gemm_rows
    if not kernels.native_amx and max(low, 16) <= 16 <= high:  # the composed ops' 16-row C calls
        assert fused_runs and set(sizes) == {16}


def test_the_calls_follow_torchs_thread_count(fused_runs):
    """A thread count set between steps reaches the prepared calls (the composed ops read it every call)."""
    fused, _ = _models()
    r = Runner(fused, num_slots=2)
    r.add("a")
    out = r.step({"a": list(range(1, 12))})
    before = torch.get_num_threads()
    try:
        for n in (before, 1, before):
            torch.set_num_threads(n)
            for _ in range(3):
                out = r.step({"a": [int(out["a"][-1].argmax())]})
            runners = [x for _, _, by_size in fused.blocks[0].attn.accel._decode_runners.values()
                       for x in by_size.values() if x]
            assert runners and all(call.arguments[call.index("num_threads")] == n
                                   for x in runners for call in x.calls if "num_threads" in call.names)
    finally:
        torch.set_num_threads(before)
    assert bool(fused_runs) != fused.blocks[0].attn.accel.native_amx  # AMX: module by module


def test_a_float32_model_runs_module_by_module(fused_runs):
    fused, _ = _models(torch.float32)
    r = Runner(fused, num_slots=2)
    r.add("a")
    out = r.step({"a": [1, 2, 3]})
    for _ in range(3):
        out = r.step({"a": [int(out["a"][-1].argmax())]})
    assert not fused_runs
    assert all(v is False for v in fused.blocks[0].attn.accel._decode_runners.values())  # the blocks, for good


def test_a_prepared_call_takes_exactly_its_arguments():
    library = native.active_library()
    if library is None:
        pytest.fail("the native library did not build")
    names = list(_COMPRESS_STORE.arguments)
    with pytest.raises(TypeError, match="compress_store"):
        binding.PreparedCall(library, _COMPRESS_STORE, {n: 0 for n in names[1:]})
    call = binding.PreparedCall(library, _COMPRESS_STORE, {n: 0 for n in names})
    assert call.index("ring_row") == names.index("ring_row") and len(call.arguments) == len(names)


def test_weights_kept_quantised_decode_the_same_tokens(tmp_path, clean_env, fused_runs):
    """FP4 experts and FP8 attention weights kept quantised (`DEEPINFER_CPU_QUANTIZED_WEIGHTS=1`): the blocks
    run as the `*_quant` calls and give the tokens and log-probabilities of the blocks run module by module."""
    from deepinfer import LLM
    from deepinfer.models.deepseek_v4.make_model import make_model
    from deepinfer.sampling_params import SamplingParams

    # experts 128 wide: the shared expert's w1 and w3 whole FP8 blocks (a mixed pair runs module by module)
    path = make_model(tmp_path / "v4", "tiny", seed=3, quantize="fp4-experts", moe_intermediate_size=128)
    clean_env.setenv("DEEPINFER_CPU_QUANTIZED_WEIGHTS", "1")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)

    def generate(blocks: str) -> list:
        clean_env.setenv("DEEPINFER_CPU_DECODE_BLOCKS", blocks)
        llm = LLM(model=str(path), accelerator="cpu", dtype="bfloat16", max_model_len=64, max_num_seqs=1)
        try:
            out = llm.generate([{"prompt_token_ids": [5, 17, 42, 99, 7]}], params, use_tqdm=False)[0].outputs[0]
        finally:
            llm.shutdown()
        return [out.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in out.logprobs]]

    fused = generate("1")
    if native.amx_usable(native.active_library()):  # a bf16 wo_a would run on AMX tiles: module by module
        assert not fused_runs
    else:
        assert len(set(fused_runs)) == 6 and len(fused_runs) >= 6 * 18  # every block, nearly every step
    assert generate("0") == fused
