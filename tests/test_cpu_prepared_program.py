"""The cpu back end's prepared programs (plugins/cpu/program.py): a V4 decode step's program with its C calls
bound once gives the bits of the same program run call by call (every layer type, hash routing, windows
completing, the indexer's picks), for one sequence and for decode batches; a new cache gets new calls; a call
whose inputs do not fit its binding runs as the composed op."""
from __future__ import annotations

import pytest
import torch

from deepinfer_plugins.cpu import native, program
from deepinfer_plugins.cpu.native import binding
from deepinfer_plugins.cpu.native.compressor import _COMPRESS_STORE
from model_harness import Runner, build_hf_model, build_our_model

#: the V4 decode program's calls the cpu back end binds
BOUND_OPS = {"ops.hc_pre_norm", "ops.hc_post_pre_norm", "ops.attention_projections", "ops.compress_store",
             "ops.decode_attention_output", "kernels.moe_sublayer"}


def _models(dtype=torch.bfloat16):
    hf = build_hf_model()
    prepared, eager = build_our_model(hf, dtype=dtype), build_our_model(hf, dtype=dtype)
    if prepared.accel.native_library is None:
        pytest.fail("the native library did not build; see the warning logged by deepinfer_plugins.cpu.native")
    eager.accel.prepared_programs = False  # the same program, call by call
    return prepared, eager


def bound_ops(prepared: program.PreparedProgram) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in prepared.steps:
        if s.binding is not None:
            counts[s.call.op] = counts.get(s.call.op, 0) + 1
    return counts


def test_decode_steps_give_the_bits_of_the_program_run_call_by_call(prepared_runs):
    """One sequence decodes 44 steps past its prompt (the CSA windows complete every 4 tokens, the HCA ones
    every 16, the sliding window is 8): the logits of every step equal those of the program run call by
    call, and once the packed copies exist every mHC site, attention and MoE of every block is a C call."""
    prepared, eager = _models()
    runners = [Runner(m, num_slots=4) for m in (prepared, eager)]
    for r in runners:
        r.add("a")
    outs = [r.step({"a": list(range(1, 20))}) for r in runners]
    for step in range(44):
        token = int(outs[0]["a"][-1].argmax())
        outs = [r.step({"a": [token]}) for r in runners]
        assert torch.equal(outs[0]["a"], outs[1]["a"]), f"decode step {step}"
    assert len(prepared_runs) == 44 and len(set(map(id, prepared_runs))) == 1  # one program, for one token
    if prepared.accel.native_amx:  # the composed ops run AMX tiles, which the calls do not take
        return
    blocks, csa_hca = len(prepared.blocks), sum(t != "sliding" for t in prepared.config.layer_types)
    csa = sum(t == "csa" for t in prepared.config.layer_types)
    assert bound_ops(prepared_runs[-1]) == {
        "ops.hc_pre_norm": 1, "ops.hc_post_pre_norm": 2 * blocks - 1, "ops.attention_projections": blocks,
        "ops.compress_store": csa_hca + csa, "ops.decode_attention_output": blocks, "kernels.moe_sublayer": blocks}


def test_steps_of_several_sequences_and_a_new_cache(prepared_runs):
    """Steps of two sequences and a prefill; a cache bound again gets new programs (the old ones address the
    old cache), with the same bits as call by call."""
    prepared, eager = _models()
    first = None
    for attempt in range(2):  # the second binds a new cache to the same model
        runners = [Runner(m, num_slots=4, seed=attempt) for m in (prepared, eager)]
        for r in runners:
            r.add("a")
            r.add("b")
        outs = [r.step({"a": list(range(1, 12)), "b": list(range(3, 9))}) for r in runners]
        for step in range(6):
            chunks = {k: [int(outs[0][k][-1].argmax())] for k in outs[0] if k == "a" or step < 3}  # then "a" alone
            outs = [r.step(chunks) for r in runners]
            for k in chunks:
                assert torch.equal(outs[0][k], outs[1][k]), f"attempt {attempt}, step {step}, sequence {k}"
        programs = {id(p): p for p in prepared_runs}
        assert {p.program.key for p in programs.values()} == {("decode", 2), ("decode", 1)}
        if attempt == 0:
            first = list(programs.values())  # held: ids stay theirs
            prepared_runs.clear()
    assert not any(a is b for a in first for b in prepared_runs)  # new programs for the new cache


def test_decode_batches_give_the_bits_of_the_program_run_call_by_call(prepared_runs):
    """16 sequences at ragged contexts decode together (one token each): the program prepared for 16 tokens
    gives the logits of the program run call by call."""
    prepared, eager = _models()
    runners = [Runner(m, num_slots=16) for m in (prepared, eager)]
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
    assert {p.program.key for p in prepared_runs} == {("decode", 16)}
    if prepared.accel.native_amx:  # the composed ops run AMX tiles, which the calls do not take
        return
    # the portable tier (no register tiles, a one-row GEMV) runs a batch's products in torch: only the
    # mHC sites are C calls of the composed ops, and only they are bound
    multi_row_products = prepared.accel.tuning.packed_gemm_rows != (0, 0)
    want = BOUND_OPS if multi_row_products else {"ops.hc_pre_norm", "ops.hc_post_pre_norm"}
    assert bound_ops(prepared_runs[-1]).keys() == want


def test_a_call_whose_inputs_do_not_fit_runs_as_the_composed_op(prepared_runs, monkeypatch):
    """Inputs a bound call cannot take on some step (here: every masks argument refused) run that call as the
    composed op, its results in the call's buffers: the bits stay those of the program run call by call."""
    prepared, eager = _models()
    refused = []
    bind = program.AttentionOutput.bind

    def refusing_masks(self, k, a, choices):
        out = bind(self, k, a, choices)
        if out is not None:
            out.patches["masks"] = lambda call, value: refused.append(1) and False
        return out
    monkeypatch.setattr(program.AttentionOutput, "bind", refusing_masks)
    runners = [Runner(m, num_slots=2) for m in (prepared, eager)]
    for r in runners:
        r.add("a")
    outs = [r.step({"a": list(range(1, 12))}) for r in runners]
    for step in range(8):
        outs = [r.step({"a": [int(outs[0]["a"][-1].argmax())]}) for r in runners]
        assert torch.equal(outs[0]["a"], outs[1]["a"]), f"decode step {step}"
    assert prepared_runs and (refused or prepared.accel.native_amx)


def test_the_calls_follow_torchs_thread_count(prepared_runs):
    """A thread count set between steps reaches the bound calls (the composed ops read it every call)."""
    prepared, _ = _models()
    r = Runner(prepared, num_slots=2)
    r.add("a")
    out = r.step({"a": list(range(1, 12))})
    before = torch.get_num_threads()
    try:
        for n in (before, 1, before):
            torch.set_num_threads(n)
            for _ in range(3):
                out = r.step({"a": [int(out["a"][-1].argmax())]})
            calls = [s.binding.call for s in prepared_runs[-1].steps if s.binding is not None]
            assert calls and all(c.arguments[c.index("num_threads")] == n for c in calls if "num_threads" in c.names)
    finally:
        torch.set_num_threads(before)


def test_the_kernel_choices_are_asked_once(prepared_runs, monkeypatch):
    """The packed copies are made at load, so the calls' kernel choices are asked once, when the program is
    bound at its first step: the later steps ask none, with the call-by-call bits at every step."""
    prepared, eager = _models()
    asked = []
    choices = program.MoESublayer.choices
    monkeypatch.setattr(program.MoESublayer, "choices", lambda self, k, a: asked.append(1) or choices(self, k, a))
    runners = [Runner(m, num_slots=2) for m in (prepared, eager)]
    for r in runners:
        r.add("a")
    outs = [r.step({"a": list(range(1, 12))}) for r in runners]
    per_step = []
    for step in range(6):
        before = len(asked)
        outs = [r.step({"a": [int(outs[0]["a"][-1].argmax())]}) for r in runners]
        assert torch.equal(outs[0]["a"], outs[1]["a"]), f"decode step {step}"
        per_step.append(len(asked) - before)
    assert per_step[0] >= len(prepared.blocks) and per_step[1:] == [0] * 5, per_step


def test_a_float32_model_binds_only_what_the_composed_ops_run_in_c(prepared_runs):
    """fp32 (the reference dtype): the mHC sites are C calls either way and are bound; the attention and MoE
    calls, which the composed ops run in torch for fp32, run as those ops. The same bits as call by call."""
    prepared, eager = _models(torch.float32)
    runners = [Runner(m, num_slots=2) for m in (prepared, eager)]
    for r in runners:
        r.add("a")
    outs = [r.step({"a": [1, 2, 3]}) for r in runners]
    for step in range(5):
        outs = [r.step({"a": [int(outs[0]["a"][-1].argmax())]}) for r in runners]
        assert torch.equal(outs[0]["a"], outs[1]["a"]), f"decode step {step}"
    assert set(bound_ops(prepared_runs[-1])) == {"ops.hc_pre_norm", "ops.hc_post_pre_norm"}


def test_switched_off_or_batch_invariant_runs_the_program_eagerly(clean_env):
    from deepinfer_plugins.cpu.accelerator import CpuAccelerator

    clean_env.setenv("DEEPINFER_CPU_DECODE_BLOCKS", "0")
    off = CpuAccelerator()
    clean_env.delenv("DEEPINFER_CPU_DECODE_BLOCKS")
    on = CpuAccelerator()
    if on.native_library is None:
        pytest.fail("the native library did not build")
    from deepinfer.program import Builder

    b = Builder({"kernels": on})
    prog = b.build((b.input("x"),))
    assert off.prepare_program(prog) is None and isinstance(on.prepare_program(prog), program.PreparedProgram)
    on.set_batch_invariant(True)
    assert on.prepare_program(prog) is None


def test_a_prepared_call_takes_exactly_its_arguments():
    library = native.active_library()
    if library is None:
        pytest.fail("the native library did not build")
    names = list(_COMPRESS_STORE.arguments)
    with pytest.raises(TypeError, match="compress_store"):
        binding.PreparedCall(library, _COMPRESS_STORE, {n: 0 for n in names[1:]})
    call = binding.PreparedCall(library, _COMPRESS_STORE, {n: 0 for n in names})
    assert call.index("ring_row") == names.index("ring_row") and len(call.arguments) == len(names)


def test_kernel_signatures_are_read_from_the_c_definitions():
    """Each kernel's ctypes prototype comes from its C definition: scalars by type, pointers as void *, a
    returned string as char *, a parameter named like a Python keyword with a trailing underscore; a name
    without a definition is refused."""
    import ctypes

    result, arguments = binding.signature("kv_store")
    assert result is ctypes.c_int and list(arguments) == ["x", "x_stride", "dtype", "N", "C", "fmt", "cache", "n",
                                                          "dest"]
    assert arguments["x"] is ctypes.c_void_p and arguments["x_stride"] is ctypes.c_long
    assert arguments["dtype"] is ctypes.c_int and arguments["dest"] is ctypes.c_void_p
    assert binding.signature("gemv_tier") == (ctypes.c_char_p, {})
    assert binding.signature("fp4_linear")[1]["in_"] is ctypes.c_long  # C's `long in`
    assert binding.signature("rms_norm")[0] is None  # void
    with pytest.raises(LookupError, match="no_such_kernel"):
        binding.signature("no_such_kernel")
    assert {k.name for k in binding.KERNELS} >= {"kv_store", "attention_output", "moe_layer_quant"}


def test_weights_kept_quantised_decode_the_same_tokens(tmp_path, clean_env, prepared_runs):
    """FP4 experts and FP8 attention weights kept quantised (`DEEPINFER_CPU_QUANTIZED_WEIGHTS=1`): the program
    binds the `*_quant` calls and gives the tokens and log-probabilities of the program run call by call."""
    from deepinfer.models.deepseek_v4.make_model import make_model

    # experts 128 wide: the shared expert's w1 and w3 whole FP8 blocks (a mixed pair runs as the composed op)
    path = make_model(tmp_path / "v4", "tiny", seed=3, quantize="fp4-experts", moe_intermediate_size=128)
    assert greedy_quantised(path, clean_env, prepared=True) == greedy_quantised(path, clean_env, prepared=False)
    bound = bound_ops(prepared_runs[-1])  # one token a step: AMX tiles or not, every call's products are C's
    assert bound.keys() == BOUND_OPS and bound["ops.attention_projections"] == 6


def greedy_quantised(path, env, prepared: bool) -> list:
    """24 greedy tokens and their top-5 log-probabilities from `path` in bf16 with weights kept quantised
    (`DEEPINFER_CPU_QUANTIZED_WEIGHTS=1`), prepared programs on or off (`env`: the clean_env fixture)."""
    from deepinfer import LLM
    from deepinfer.sampling_params import SamplingParams

    env.setenv("DEEPINFER_CPU_QUANTIZED_WEIGHTS", "1")
    env.setenv("DEEPINFER_CPU_DECODE_BLOCKS", "1" if prepared else "0")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    llm = LLM(model=str(path), accelerator="cpu", dtype="bfloat16", max_model_len=64, max_num_seqs=1)
    try:
        out = llm.generate([{"prompt_token_ids": [5, 17, 42, 99, 7]}], params, use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    return [out.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in out.logprobs]]
