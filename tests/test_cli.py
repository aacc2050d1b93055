"""The `deepinfer` command as a user runs it (subprocesses, real entry points)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "deepinfer.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=120)


def test_version():
    out = run("--version")
    assert out.returncode == 0 and out.stdout.startswith("deepinfer ")


@pytest.mark.slow
def test_plugins_json_lists_distribution_and_version():
    out = run("plugins", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout) if r["group"] == "deepinfer.accelerators"}
    assert {"cpu", "nvidia", "ascend"} <= set(rows)
    assert rows["cpu"]["distribution"] == "deepinfer" and rows["cpu"]["version"]


def test_doctor_cpu_usable_others_with_reasons():
    out = run("doctor", env={"DEEPINFER_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.split()}
    assert " yes " in lines["cpu"]
    assert " no " in lines["nvidia"] and ("CUDA" in lines["nvidia"] or "GPU" in lines["nvidia"])
    assert " no " in lines["ascend"] and "torch_npu" in lines["ascend"]
    assert "selected: cpu" in out.stdout


@pytest.mark.slow
def test_doctor_shows_the_layout_a_command_would_use():
    out = run("doctor", "--ep", "4", env={"DEEPINFER_ACCELERATOR": "cpu", "WORLD_SIZE": "2", "RANK": "1"})
    assert out.returncode == 0, out.stderr
    assert "layout: ep=4 dp=4 cp=1 (world size 4, 2 nodes); this node runs ranks [2, 3]" in out.stdout
    assert "  rank 3: host CPU, " in out.stdout
    out = run("doctor", "--ep", "3", "--dp", "2", env={"DEEPINFER_ACCELERATOR": "cpu"})
    assert out.returncode == 1 and "layout: refused" in out.stderr and "divisible by --ep 3" in out.stderr
    out = run("doctor", "--cp", "2", env={"DEEPINFER_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr
    assert "layout: ep=1 dp=1 cp=2 (world size 2); this node runs ranks [0, 1]" in out.stdout
    assert "CP rank i takes chunks i and 3-i" in out.stdout
    out = run("doctor", "--ep", "4", "--cp", "6", "--dp", "2", env={"DEEPINFER_ACCELERATOR": "cpu"})
    assert out.returncode == 1 and "a CP group would straddle two EP groups" in out.stderr


@pytest.mark.slow
def test_doctor_shows_each_ranks_ep_and_cp_group():
    out = run("doctor", "--ep", "2", "--dp", "4", env={"DEEPINFER_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr
    assert "expert-parallel groups: [0..1], [2..3]" in out.stdout and "context-parallel groups" not in out.stdout
    lines = {line.split(":")[0].strip(): line for line in out.stdout.splitlines() if line.startswith("  rank ")}
    assert lines["rank 2"].endswith("(--threads_per_rank); EP group 1 [2..3], EP rank 0; no CP group (cp 1)")
    out = run("doctor", "--ep", "4", "--cp", "2", "--dp", "2", env={"DEEPINFER_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr
    assert "expert-parallel groups: [0..3]\ncontext-parallel groups: [0..1], [2..3]" in out.stdout
    assert "(--threads_per_rank); EP group 0 [0..3], EP rank 3; CP group 1 [2..3], CP rank 1\n" in out.stdout
    out = run("doctor", "--ep", "2", "--cp", "4", env={"DEEPINFER_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr
    assert "layout: ep=2 dp=1 cp=4 (world size 4)" in out.stdout
    assert "expert-parallel groups: [0..1], [2..3]\ncontext-parallel groups: [0..3]" in out.stdout


@pytest.mark.slow
def test_doctor_ascend_fails_with_reason_and_fix():
    out = run("doctor", env={"DEEPINFER_ACCELERATOR": "ascend"})
    assert out.returncode != 0
    assert "not usable" in out.stderr and "torch_npu" in out.stderr and "DEEPINFER_ACCELERATOR=<name>" in out.stderr


@pytest.mark.parametrize("name", ["tpu9000"])
@pytest.mark.slow
def test_doctor_unknown_lists_installed(name):
    out = run("doctor", env={"DEEPINFER_ACCELERATOR": name})
    assert out.returncode != 0
    assert f"'{name}' is not installed" in out.stderr and "cpu" in out.stderr


@pytest.mark.slow
def test_make_model_help_shows_the_families_flags_and_unknown_family_lists_choices(tmp_path):
    out = run("make-model", "--help")
    assert out.returncode == 0 and "--family" in out.stdout and "--no-mtp" in out.stdout  # default: v4's flags
    out = run("make-model", str(tmp_path / "x"), "--family", "nope")
    assert out.returncode == 2 and not (tmp_path / "x").exists()
    assert "unknown model family 'nope'" in out.stderr and "deepseek_v4 (alias v4)" in out.stderr


@pytest.mark.slow
def test_plugins_lists_model_family_entry_points(fake_distribution):
    root = fake_distribution("acme-models", "1.0", {"deepinfer.model_families": {"acme_lm": "acme_lm_mod"}},
                             {"acme_lm_mod": "raise ImportError('listing must not import me')\n"})
    out = run("plugins", "--json", env={"PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout) if r["group"] == "deepinfer.model_families"}
    assert rows["acme_lm"]["distribution"] == "acme-models" and rows["acme_lm"]["value"] == "acme_lm_mod"
