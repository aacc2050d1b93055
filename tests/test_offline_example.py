"""examples/offline_inference.py (the seeds' user surface) and `deepinfer generate`."""
from __future__ import annotations

import os
import re
import sys

import pytest

from example_modules import EXAMPLES, load_example

LINE = re.compile(r"^DP 0; INPUT: (.*); OUTPUT: (.*); output_tokens=(\d+); accept_rate=(n/a|\d+\.\d+); "
                  r"decode_ppl=(n/a|\d+\.\d{3})$")


@pytest.fixture(scope="module")
def example():
    return load_example("offline_inference.py")


@pytest.fixture(scope="module")
def launch():
    return load_example("_launch.py")


@pytest.fixture(autouse=True)
def isolated():
    """One torch thread (two on two busy cores can be 10x slower; these tests measure nothing), and
    the environment restored afterwards (the example sets the seeds' DEEPINFER_* defaults for
    installed features)."""
    import os

    import torch

    before, saved = torch.get_num_threads(), dict(os.environ)
    for key in [k for k in os.environ if k.startswith("DEEPINFER_")]:
        del os.environ[key]
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def tiny_model(tiny_v4) -> str:
    """The tiny DeepSeek-V4 (it has an MTP block, so the seeds' speculative decoding runs on it)."""
    return str(tiny_v4)


@pytest.fixture(scope="module")
def v41_model(tiny_v41) -> str:
    """The tiny DeepSeek-V4.1 (its DSpark head is not supported: no speculative decoding)."""
    return str(tiny_v41)


@pytest.fixture
def empty_hub(tmp_path, monkeypatch):
    """An empty local Hugging Face cache: the seeds' default id is not found, whatever the real cache holds."""
    (tmp_path / "hub").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


# -------------------------------------------------------------------- --ep / --dp / --cp rules


def test_dp_defaults_to_ep_over_cp(launch):
    assert launch.resolve_parallel(8, None, 1, "nvidia", env={}).dp == 8
    seeds_cp = launch.resolve_parallel(2, None, 8, "nvidia", env={})  # the seeds' --ep 2 --cp 8
    assert (seeds_cp.dp, seeds_cp.world_size, len(seeds_cp.ep_groups())) == (1, 8, 4)  # dp = max(2 // 8, 1)
    with pytest.raises(launch.ParallelConfigError, match=r"ep 4 and cp 6 a CP group would straddle"):
        launch.resolve_parallel(4, 2, 6, "nvidia", env={})
    assert launch.resolve_parallel(8, None, 8, "nvidia", env={}).world_size == 8  # dp 1: one CP and EP group


def test_world_size_must_be_divisible_by_ep(launch):
    with pytest.raises(launch.ParallelConfigError, match=r"dp x cp = 3 x 1 = 3 must be divisible by --ep 2"):
        launch.resolve_parallel(2, 3, 1, "cpu", env={})
    with pytest.raises(launch.ParallelConfigError, match=r"--cp 0 must be >= 1"):
        launch.resolve_parallel(1, None, 0, "cpu", env={})


def test_cpu_defaults_to_one_and_accelerators_to_eight(launch):
    sizes = launch.resolve_parallel(None, None, 1, "cpu", env={})
    assert (sizes.ep, sizes.dp, sizes.cp, sizes.world_size) == (1, 1, 1, 1)
    assert launch.resolve_parallel(None, None, 1, "nvidia", env={}).ep == 8


def test_nodes_split_the_dp_ranks(launch):
    with pytest.raises(launch.ParallelConfigError, match=r"dp=3 must be divisible by the number of nodes WORLD_SIZE=2"):
        launch.resolve_parallel(1, 3, 1, "cpu", env={"WORLD_SIZE": "2"})
    with pytest.raises(launch.ParallelConfigError, match=r"RANK=2 must be smaller than WORLD_SIZE=2"):
        launch.resolve_parallel(1, 2, 1, "cpu", env={"WORLD_SIZE": "2", "RANK": "2"})


def test_invalid_sizes_exit_with_a_message(example, capsys):
    assert example.main(["--ep", "2", "--dp", "3"]) == 2
    assert "must be divisible by --ep 2" in capsys.readouterr().err


def test_help_lists_the_seed_flags(example, capsys):
    with pytest.raises(SystemExit) as done:
        example.parse_args(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model_name", "--ep", "--dp", "--cp", "--long_context", "--check_structured_output",
                 "--sampler_force_topk", "--disable_eplb"):
        assert flag in text


# ------------------------------------------------------------------------------- output lines


def test_output_line_format(example, tiny_model, capsys):
    assert example.main(["--model_name", tiny_model]) == 0
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    samples = [m for m in map(LINE.match, out) if m]
    assert len(samples) == 4, out
    prompts = [s[0] for s in load_example("_prompts.py").SAMPLES]
    for match, prompt in zip(samples, prompts):
        assert match.group(1) == prompt
        assert 1 <= int(match.group(3)) <= 32
        assert match.group(4) != "n/a"  # a V4 checkpoint with MTP: the seeds' speculative decoding is on
    assert "speculative decoding is off" not in captured.err
    assert out[0].startswith("Model: ")
    # every line that starts like a sample line is one (the summary goes to stderr)
    assert [line for line in out if line.startswith("DP ")] == [m.group(0) for m in samples]


def test_long_context_on_a_short_model_is_one_error_before_anything_runs(example, tiny_model, capsys):
    """The tiny model holds 512 positions: --long_context (16,389 + 4,096 tokens per sample) is
    refused with one message and a non-zero status, before any engine is built."""
    assert example.main(["--model_name", tiny_model, "--long_context"]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: --long_context needs 20,485 tokens per sample"), errors
    assert "Traceback" not in captured.err
    assert "512" in errors[0] and "without --long_context" in errors[0]
    assert "DP " not in captured.out and "Model:" not in captured.out


def test_a_failed_sample_makes_the_exit_status_non_zero(example, tiny_model, monkeypatch, capsys):
    """Should a sample still fail in the engine (here: the check above skipped), its line says why and
    the example exits 1 with one summary line, instead of 0."""
    monkeypatch.setattr(example, "check_long_context", lambda *args: None)
    assert example.main(["--model_name", tiny_model, "--long_context"]) == 1
    captured = capsys.readouterr()
    assert len([line for line in captured.out.splitlines() if line.startswith("DP 0;")]) == 4
    assert "error: 4 of 4 samples failed" in captured.err


def _run_example(script: str, *args: str, **env: str):
    import subprocess

    clean = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          env={**clean, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env}, timeout=300)


@pytest.mark.parametrize("script", ["offline_inference.py", "benchmark.py"])
@pytest.mark.parametrize("accelerator, reason", [("nvidia", "is not a CUDA build"),
                                                 ("ascend", "torch_npu is not installed")])
@pytest.mark.slow
def test_an_unusable_back_end_is_one_error_line(script, accelerator, reason, tiny_model):
    """The seeds' DEEPINFER_ACCELERATOR=nvidia|ascend on a machine without that hardware (here: a CPU
    build of torch, no torch_npu): one `error:` line with the reason and the fix, no traceback."""
    out = _run_example(script, "--model_name", tiny_model, DEEPINFER_ACCELERATOR=accelerator)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    [line] = [line for line in out.stderr.splitlines() if line.startswith("error")]
    assert line.startswith(f"error: accelerator '{accelerator}' is not usable on this machine") and reason in line
    assert "DEEPINFER_ACCELERATOR=<name>" in line


@pytest.mark.slow
def test_a_refusal_in_every_rank_is_one_error_not_a_traceback(tiny_model):
    """Two ranks (one process each) whose engines refuse to start (the batch_invariant feature on a
    back end without the capability): the launch ends with the engine's message, not a rank's traceback."""
    out = _run_example("offline_inference.py", "--model_name", tiny_model, "--ep", "1", "--dp", "2",
                       "--threads_per_rank", "1", DEEPINFER_ACCELERATOR="cpu", DEEPINFER_CPU_NATIVE="0",
                       DEEPINFER_BATCH_INVARIANT="1")
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    [line] = [line for line in out.stderr.splitlines() if line.startswith("error")]
    assert line == "error: invalid feature combination:"
    assert "needs the back-end capability 'batch_invariant'" in out.stderr


SEED_FEATURES = """
from pydantic import BaseModel
import deepinfer
from deepinfer.envs import EnvVar
from deepinfer.features import FeatureSpec


class EplbConfig(BaseModel):
    num_extra_experts: int = 0


class Eplb:
    @staticmethod
    @deepinfer.hookimpl
    def deepinfer_feature_spec():
        return FeatureSpec(name="eplb", config_model=EplbConfig, hooks=(), env_vars=(
            EnvVar("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "redundant experts", field="num_extra_experts", kind=int),))

"""


def test_seed_env_defaults_only_for_installed_features(example, fake_distribution, clean_env):
    import deepinfer.plugins as plugins

    # the seeds' eplb feature, from a third party, next to the in-tree dspark and batch_invariant
    fake_distribution("seed-features", "1.0", {"deepinfer.features": {"eplb": "seed_features:Eplb"}},
                      {"seed_features": SEED_FEATURES})
    applied = example.apply_seed_env_defaults("cpu", disable_eplb=True)
    assert applied == {"DEEPINFER_USE_NEXTN_DECODE": "5"}  # batch_invariant: NVIDIA only; eplb disabled
    clean_env.setenv("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "8")
    # applied only where the back end declares the capability (else the feature would refuse)
    assert example.apply_seed_env_defaults("nvidia", disable_eplb=False, declares_batch_invariant=lambda: False) == {}
    assert example.apply_seed_env_defaults("nvidia", disable_eplb=False) == {}
    assert example.apply_seed_env_defaults("nvidia", disable_eplb=False,
                                           declares_batch_invariant=lambda: True) == {"DEEPINFER_BATCH_INVARIANT": "1"}
    for var in ("DEEPINFER_USE_NEXTN_DECODE", "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "DEEPINFER_BATCH_INVARIANT"):
        clean_env.delenv(var)
    clean_env.setattr(plugins, "discover", lambda group: {})  # no feature installed: nothing declares them
    assert example.apply_seed_env_defaults("nvidia", disable_eplb=False, declares_batch_invariant=lambda: True) == {}


def test_speculation_default_is_skipped_for_a_model_that_cannot_draft(example, capsys):
    asked = []

    def cannot_draft():
        asked.append(1)
        return "no draft head here"

    assert "DEEPINFER_USE_NEXTN_DECODE" not in example.apply_seed_env_defaults("cpu", False, cannot_draft)
    assert "DEEPINFER_USE_NEXTN_DECODE" not in os.environ
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "speculative decoding is off for this model" in err and "no draft head here" in err
    assert example.apply_seed_env_defaults("cpu", False, lambda: None) == {"DEEPINFER_USE_NEXTN_DECODE": "5"}
    # the user's own setting is never second-guessed (and the model is not even looked at)
    assert example.apply_seed_env_defaults("cpu", False, cannot_draft) == {} and len(asked) == 1


def test_drafter_unsupported_comes_from_the_model_class(example, tiny_model, v41_model, monkeypatch):
    from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM

    assert example.drafter_unsupported(v41_model) == DeepseekV41ForCausalLM.drafter_unsupported
    assert "DSpark" in DeepseekV41ForCausalLM.drafter_unsupported
    assert example.drafter_unsupported(tiny_model) is None
    assert example.drafter_unsupported("/no/such/checkpoint") is None  # the engine reports that one
    monkeypatch.setattr(DeepseekV41ForCausalLM, "drafter_unsupported", None)  # a V4.1 that could draft
    assert example.drafter_unsupported(v41_model) is None


def test_a_v41_checkpoint_with_its_dspark_drafter_can_draft(example, tmp_path):
    from deepinfer.models.deepseek_v41.make_model import make_model

    with_head = make_model(tmp_path / "with-head", size="tiny", seed=0, with_dspark=True)
    assert example.drafter_unsupported(str(with_head)) is None


def test_v41_runs_without_speculation_unless_asked(example, v41_model, capsys):
    os.environ["DEEPINFER_USE_NEXTN_DECODE"] = "5"  # asked for explicitly: the drafter's clear error
    assert example.main(["--model_name", v41_model]) == 1
    captured = capsys.readouterr()
    assert re.search(r"^error: speculative decoding on DeepSeek-V4.1 needs its own DSpark draft head.*"
                     r"this checkpoint has none", captured.err, re.M), captured.err
    assert not LINE.search(captured.out)


def test_one_line_escapes_newlines(example):
    assert example.one_line("a\nb\\c") == "a\\nb\\\\c"
    assert example.one_line("x\x13y\u2028z\tw é中") == "x\\x13y\\u2028z\\tw é中"
    assert example.one_line("x" * 10, limit=4) == "xxxx...[6 more chars]"


#: common words of Shakespeare's plays (and of English): the README's main job must print some
ENGLISH_WORDS = frozenset("""the and of to a i you my that in is not with me it be your his this for he but
have thou thy thee so will what her all do no shall by we our lord him are as on if good now sir o love king
come more well they or let she at from there would then here how man was am upon like them their us an
""".split())


def english_words(text: str) -> list[str]:
    return [w for w in re.findall(r"[a-z]+", text.lower()) if w in ENGLISH_WORDS]


@pytest.mark.slow
def test_default_model_is_used_and_announced(example, tmp_path, monkeypatch, empty_hub, capsys):
    """The embedded default (the trained demo DeepSeek-V4.1 with its DSpark drafter and an untrained
    image tower) end to end, the README's main job: four text and two image samples, speculating as
    the seeds' default says, its drafts accepted, and every sample continuing in English (at least 4
    words of ENGLISH_WORDS in each 32-token output)."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    assert example.main([]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "embedded default model" in out and str(tmp_path / "models" / "demo-v41") in out
    samples = [m for m in map(LINE.match, out.splitlines()) if m]
    assert len(samples) == 6 and all(m.group(4) != "n/a" for m in samples)
    assert sum(m.group(1).startswith("[image ") for m in samples) == 2  # it has a (random) tower
    assert "speculative decoding is off" not in captured.err
    assert max(float(m.group(4)) for m in samples) > 0.1, "the trained drafter's drafts are never accepted"
    for m in samples:
        assert len(english_words(m.group(2))) >= 4, f"no English in the demo model's output: {m.group(2)!r}"


@pytest.mark.slow
def test_the_seeds_default_id_is_used_from_the_local_cache(example, v41_model, tmp_path, monkeypatch, capsys):
    import shutil

    snapshot = tmp_path / "hub" / "models--deepseek-ai--DeepSeek-V4.1-Flash-1017" / "snapshots" / "0123abc"
    shutil.copytree(v41_model, snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    assert example.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"Model: {snapshot}"
    assert len([line for line in out if LINE.match(line)]) == 4
    assert not (tmp_path / "cache" / "models").exists()  # the embedded default was not built


# ----------------------------------------------------------------------------- deepinfer generate


def test_deepinfer_generate(tiny_model, capsys):
    from deepinfer.cli import main

    assert main(["generate", "--model", tiny_model, "--prompt", "Hello", "--max-tokens", "5", "--no-async"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"\[finish_reason=(stop|length); output_tokens=\d+; decode_ppl=\d+\.\d{3}\]", out[-1])


def test_deepinfer_generate_reports_a_bad_prompt(tiny_model, capsys):
    from deepinfer.cli import main

    assert main(["generate", "--model", tiny_model, "--prompt", "", "--prompt", "ok", "--json",
                 "--max-tokens", "3"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert '"finish_reason": "error"' in lines[0] and "empty" in lines[0]
    assert '"error": null' in lines[1]


def test_deepinfer_generate_rejects_bad_sampling_values(tiny_model, capsys):
    from deepinfer.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--model", tiny_model, "--prompt", "x", "--top-p", "0"])
    assert "SamplingParams.top_p" in capsys.readouterr().err


# ------------------------------------------------------------------------------- image samples


@pytest.fixture(scope="module")
def v41_vision_model(tmp_path_factory):
    """A tiny DeepSeek-V4.1 with its (tiny) vision tower."""
    from deepinfer.models.deepseek_v41.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("v41-vision") / "ckpt", size="tiny", seed=0, with_vision=True))


def test_image_samples_run_on_a_model_with_a_tower(example, v41_vision_model, capsys):
    pytest.importorskip("PIL")
    from deepinfer import LLM

    assert example.main(["--model_name", v41_vision_model, "--greedy", "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    samples = [m for m in map(LINE.match, captured.out.splitlines()) if m]
    prompts = load_example("_prompts.py")
    assert len(samples) == len(prompts.SAMPLES) + len(prompts.IMAGE_SAMPLES) == 6, captured.out
    shown = [m.group(1) for m in samples[4:]]
    assert shown == [f"[image {name}] {question}" for name, question, _ in prompts.IMAGE_SAMPLES]
    assert "image samples are skipped" not in captured.err
    # the sample's tokens are those of the same image prompt sent to LLM.generate directly
    with LLM(model=v41_vision_model, accelerator="cpu", dtype="float32") as llm:
        assert llm.image_input_unsupported is None and llm.image_placeholder == "<｜image｜>"
        image_prompts, params, _ = prompts.prepare_image_prompts(llm.image_placeholder, greedy=True)
        outs = llm.generate(image_prompts, params, use_tqdm=False)
    for out, line in zip(outs, samples[4:]):
        assert out.error is None, out.error
        assert example.one_line(out.outputs[0].text) == line.group(2)
        assert len(out.prompt_token_ids) > 40  # the span is in the prompt, not one placeholder token


def test_image_samples_are_skipped_with_the_reason_on_a_text_model(example, v41_model, capsys):
    assert example.main(["--model_name", v41_model]) == 0
    captured = capsys.readouterr()
    assert len([line for line in captured.out.splitlines() if LINE.match(line)]) == 4
    assert re.search(r"^note: the 2 image samples are skipped: .*vision", captured.err, re.M), captured.err


def test_the_sample_pictures_are_the_drawing_scripts(tmp_path):
    """examples/images/*.{jpeg,png} are what draw_images.py draws (ours, reproducible)."""
    pytest.importorskip("PIL")
    from PIL import Image, ImageChops

    from example_modules import load_file

    draw = load_file(EXAMPLES / "images" / "draw_images.py", "example_draw_images")
    fresh = draw.main(tmp_path)
    for path in fresh:
        shipped = EXAMPLES / "images" / path.name
        assert shipped.stat().st_size < 64 * 1024
        with Image.open(shipped) as a, Image.open(path) as b:
            assert a.size == b.size
            diff = ImageChops.difference(a.convert("RGB"), b.convert("RGB")).getextrema()
            assert max(hi for _, hi in diff) <= (0 if path.suffix == ".png" else 8), (path.name, diff)


def test_image_samples_run_under_context_parallelism(example):
    """The samples are built under --cp (tests/test_context_parallel.py checks what they print)."""
    pytest.importorskip("PIL")
    from types import SimpleNamespace

    llm = SimpleNamespace(image_input_unsupported=None, image_placeholder="<｜image｜>")
    prompts, params, shown, note = example.image_samples(llm, example.parse_args(["--cp", "2"]))
    assert len(prompts) == len(params) == len(shown) == 2 and note is None
