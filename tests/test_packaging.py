"""The wheel works on its own: build it, install it into a fresh virtual environment together
with the third-party test plugin, and use both there exactly as a user would."""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def sh(*cmd, env=None, check=True, cwd=None) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    if check and out.returncode != 0:
        raise AssertionError(f"{cmd} failed:\n{out.stdout}\n{out.stderr}")
    return out


def source_copy(project: Path, dest: Path) -> Path:
    """A copy of `project` to build from: pip builds in the folder it is given, and setuptools leaves
    build/ and *.egg-info there (never in the source tree)."""
    shutil.copytree(project, dest, ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__",
                                                                 "tests"))
    return dest


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    projects = (REPO, REPO / "tests" / "plugins" / "acme")
    before = {project: sorted(project.iterdir()) for project in projects}
    for project in projects:
        source = source_copy(project, tmp / "src" / project.name)
        sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, source,
           cwd=tmp)
    assert {project: sorted(project.iterdir()) for project in projects} == before  # nothing left in the source tree
    wheels = sorted(dist.glob("*.whl"))
    assert {w.name.split("-")[0] for w in wheels} == {"deepinfer", "deepinfer_acme"}
    venv = tmp / "venv"
    sh(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / "bin" / "python"
    target = Path(sh(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    # Dependencies (torch, pydantic, ...) come from this environment through a plain path entry;
    # .pth files of this environment (such as an editable deepinfer) are deliberately not run.
    (target / "_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    sh(sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", *wheels)
    return venv


def venv_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_") and k != "PYTHONPATH"}
    env.update(extra)
    return env


def test_installed_from_wheel_not_from_source(fresh_venv):
    out = sh(fresh_venv / "bin" / "python", "-c", "import deepinfer, deepinfer_plugins.cpu as c; print(deepinfer.__file__, c.__file__)",
             env=venv_env(), cwd=fresh_venv)
    assert str(fresh_venv) in out.stdout and str(REPO / "core") not in out.stdout


def test_plugins_lists_third_party(fresh_venv):
    out = sh(fresh_venv / "bin" / "deepinfer", "plugins", "--json", env=venv_env())
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["acme"]["distribution"] == "deepinfer-acme" and rows["acme"]["version"] == "2.3.1"
    assert rows["cpu"]["distribution"] == "deepinfer"


def test_third_party_selectable(fresh_venv):
    out = sh(fresh_venv / "bin" / "deepinfer", "doctor", env=venv_env(DEEPINFER_ACCELERATOR="acme"))
    assert "selected: acme (DEEPINFER_ACCELERATOR)" in out.stdout


def test_third_party_version_mismatch(fresh_venv):
    out = sh(fresh_venv / "bin" / "deepinfer", "doctor", env=venv_env(DEEPINFER_ACCELERATOR="acme-legacy"), check=False)
    assert out.returncode != 0
    assert "interface version 0.3" in out.stderr and "deepinfer-acme 2.3.1" in out.stderr


def test_third_party_hardware_absent(fresh_venv):
    out = sh(fresh_venv / "bin" / "deepinfer", "doctor",
             env=venv_env(DEEPINFER_ACCELERATOR="acme", ACME_DEVICE_PRESENT="0"), check=False)
    assert out.returncode != 0 and "no Acme device found" in out.stderr


def test_third_party_passes_conformance(fresh_venv, tmp_path):
    report = tmp_path / "acme.json"
    out = sh(fresh_venv / "bin" / "deepinfer", "conformance", "acme", f"--conformance-report={report}",
             env=venv_env(), check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:]
    assert json.loads(report.read_text())["summary"]["failed"] == 0


def test_demo_runs_from_the_wheel(fresh_venv, tmp_path):
    """make-model and generate, installed from the wheel, on the acme third-party back end."""
    model = tmp_path / "tiny"
    sh(fresh_venv / "bin" / "deepinfer", "make-model", model, "--size", "tiny", env=venv_env())
    out = sh(fresh_venv / "bin" / "deepinfer", "generate", "--model", model, "--prompt", "Hello world",
             "--max-tokens", "6", "--ignore-eos", "--json", env=venv_env(DEEPINFER_ACCELERATOR="acme"), cwd=tmp_path)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert rows, out.stdout + out.stderr
    assert len(rows[0]["token_ids"]) == 6 and rows[0]["finish_reason"] == "length"


def test_wheel_metadata_says_beta(fresh_venv):
    """The seeds' 0.1.0 is "Development Status :: 4 - Beta"; the installed wheel's metadata says so."""
    code = ("import importlib.metadata as m; d = m.metadata('deepinfer'); "
            "print(d['Version']); print('\\n'.join(d.get_all('Classifier')))")
    out = sh(fresh_venv / "bin" / "python", "-c", code, env=venv_env(), cwd=fresh_venv).stdout.splitlines()
    assert out[0] == "0.1.0"
    assert [c for c in out[1:] if c.startswith("Development Status")] == ["Development Status :: 4 - Beta"]


def test_the_benchmark_library_ships_in_the_wheel(fresh_venv, tmp_path):
    """deepinfer.benchmarks (what examples/benchmark.py and the races import) comes with the wheel, and
    its record tools work there."""
    code = ("import deepinfer.benchmarks as b; from deepinfer.benchmarks import ab, results, timing, workloads; "
            "print(b.__file__); s = timing.Spread.of(timing.ratios([3.0, 4.0], [2.0, 2.0])); print(s.text())")
    out = sh(fresh_venv / "bin" / "python", "-c", code, env=venv_env(), cwd=tmp_path).stdout.splitlines()
    assert str(fresh_venv) in out[0] and str(REPO / "core") not in out[0]
    assert out[1] == "1.75x (1.50-2.00)"
