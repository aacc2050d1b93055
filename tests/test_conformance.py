"""The conformance kit passes for the CPU reference and catches a broken back end."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def run_kit(name: str, report, extra_path: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "deepinfer.cli", "conformance", name,
                           f"--conformance-report={report}"], capture_output=True, text=True, env=env, timeout=600)


def test_cpu_passes_every_level(tmp_path):
    out = run_kit("cpu", tmp_path / "cpu.json")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    report = json.loads((tmp_path / "cpu.json").read_text())
    assert report["summary"]["failed"] == 0 and report["summary"]["passed"] >= 15
    levels = {r["level"] for r in report["tests"].values()}
    assert {0, 1, 2, 3, 4, 5} <= levels


BROKEN = '''
import torch
from deepinfer_plugins.cpu import CpuAccelerator

class WrongNorm(CpuAccelerator):
    name = "wrongnorm"
    def rms_norm(self, x, weight, eps):  # forgets the weight: numerically wrong
        return super().rms_norm(x, None, eps)
'''


def test_kit_fails_a_numerically_wrong_back_end(tmp_path, fake_distribution):
    root = fake_distribution("wrong-norm", "0.1", {"deepinfer.accelerators": {"wrongnorm": "wrong_norm_mod:WrongNorm"}},
                             {"wrong_norm_mod": BROKEN})
    out = run_kit("wrongnorm", tmp_path / "w.json", extra_path=str(root))
    assert out.returncode != 0
    report = json.loads((tmp_path / "w.json").read_text())
    assert report["tests"]["test_rms_norm"]["outcome"] == "failed"
    assert report["tests"]["test_linear"]["outcome"] == "passed"
