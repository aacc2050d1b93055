"""Back-end discovery and selection: every error path of docs/architecture.md ("Selecting a back end"), end to end."""
from __future__ import annotations

import pytest

from deepinfer import plugins
from deepinfer.accelerator.interface import INTERFACE_VERSION, Accelerator, SmallOps
from deepinfer.plugins import PluginError, discover, select_accelerator_class

BROKEN_MODULE = """
import this_module_does_not_exist_anywhere
"""

FAKE_MODULE = """
from deepinfer.accelerator.interface import ProbeResult
from deepinfer_plugins.cpu import CpuAccelerator

class Absent(CpuAccelerator):
    name = "absent"
    @classmethod
    def probe(cls):
        return ProbeResult(usable=False, reason="no Frobnicator card on the PCI bus")

class Old(CpuAccelerator):
    name = "old"
    interface_version = "0.1"

class Present(CpuAccelerator):
    name = "present"
    @classmethod
    def probe(cls):
        return ProbeResult(usable=True, reason="frobnicator ready")

NotAnAccelerator = object()
"""


def test_in_tree_plugins_are_listed_without_import():
    found = discover(plugins.ACCELERATOR_GROUP)
    for name in ("cpu", "nvidia", "ascend"):
        assert name in found, f"{name} not registered"
        assert found[name][0].distribution == "deepinfer"


def test_cpu_is_selected_by_name(clean_env):
    clean_env.setenv("DEEPINFER_ACCELERATOR", "cpu")
    cls = select_accelerator_class()
    assert cls.name == "cpu"
    caps = cls().capabilities()
    assert caps.device_type == "cpu" and caps.token_bitmask


def test_unknown_name_lists_installed(clean_env):
    with pytest.raises(PluginError) as e:
        select_accelerator_class("tpu9000")
    msg = str(e.value)
    assert "'tpu9000' is not installed" in msg
    for name in ("cpu", "nvidia", "ascend"):
        assert name in msg
    assert "pip install" in msg


def test_import_failure_names_plugin_distribution_and_cause(fake_distribution):
    fake_distribution("frob-broken", "1.2.3", {"deepinfer.accelerators": {"broken": "frob_broken:X"}},
                      {"frob_broken": BROKEN_MODULE})
    with pytest.raises(PluginError) as e:
        select_accelerator_class("broken")
    msg = str(e.value)
    assert "'broken'" in msg and "frob-broken 1.2.3" in msg and "this_module_does_not_exist_anywhere" in msg
    assert isinstance(e.value.__cause__, ModuleNotFoundError)


def test_interface_version_mismatch_names_both_versions(fake_distribution):
    fake_distribution("frob", "0.9", {"deepinfer.accelerators": {"old": "frob_mod:Old"}}, {"frob_mod": FAKE_MODULE})
    with pytest.raises(PluginError) as e:
        select_accelerator_class("old")
    assert "0.1" in str(e.value) and INTERFACE_VERSION in str(e.value)


def test_hardware_absent_gives_reason_and_how_to_choose(fake_distribution):
    fake_distribution("frob", "0.9", {"deepinfer.accelerators": {"absent": "frob_mod:Absent"}}, {"frob_mod": FAKE_MODULE})
    with pytest.raises(PluginError) as e:
        select_accelerator_class("absent")
    msg = str(e.value)
    assert "no Frobnicator card" in msg and "DEEPINFER_ACCELERATOR=<name>" in msg and "cpu" in msg


def test_entry_point_must_name_an_accelerator(fake_distribution):
    fake_distribution("frob", "0.9", {"deepinfer.accelerators": {"weird": "frob_mod:NotAnAccelerator"}},
                      {"frob_mod": FAKE_MODULE})
    with pytest.raises(PluginError, match="subclass"):
        select_accelerator_class("weird")


def test_unset_selects_the_one_usable_accelerator(fake_distribution, clean_env):
    fake_distribution("frob", "0.9", {"deepinfer.accelerators": {"present": "frob_mod:Present"}}, {"frob_mod": FAKE_MODULE})
    assert select_accelerator_class().name == "present"


def test_unset_falls_back_to_cpu_with_warning(clean_env, caplog):
    with caplog.at_level("WARNING", logger="deepinfer"):
        assert select_accelerator_class().name == "cpu"
    assert "using the cpu back end" in caplog.text


def test_same_name_from_two_distributions_is_an_error(fake_distribution):
    fake_distribution("frob-a", "1.0", {"deepinfer.accelerators": {"twin": "frob_mod:Present"}}, {"frob_mod": FAKE_MODULE})
    fake_distribution("frob-b", "1.0", {"deepinfer.accelerators": {"twin": "frob_mod:Present"}}, {})
    with pytest.raises(PluginError, match="several distributions"):
        select_accelerator_class("twin")


def test_signature_is_checked_when_the_class_is_defined():
    with pytest.raises(TypeError, match="rms_norm"):
        class Bad(SmallOps):  # noqa: F841 - definition is the test
            def rms_norm(self, x, w, epsilon):
                return x


def test_collectives_written_before_sub_groups_still_define_and_run_one_group_layouts():
    """Interface 2.3 added `group`: a plugin of an older minor leaves it out of its collectives. Its
    class defines, a layout whose EP group is the whole world calls it without `group`, and a
    layout of several groups is refused before any process starts, naming what is missing."""
    import torch

    from deepinfer.accelerator.interface import Collectives
    from deepinfer.parallel.groups import GroupCollectives, check_subgroups, supports_subgroups
    from deepinfer.parallel.layout import ParallelConfigError, ParallelLayout
    from deepinfer_plugins.cpu import CpuAccelerator

    class Older(Collectives):
        def init_process_group(self, rank, world_size, init_method):
            pass

        def all_reduce(self, tensor):
            return tensor

        def all_gather(self, tensor):
            return torch.cat([tensor, tensor])

        def all_to_all(self, tensor, input_splits, output_splits):
            return tensor

    from deepinfer_plugins.ascend950 import AscendAccelerator
    from deepinfer_plugins.nvidia_sm100 import NvidiaAccelerator

    assert not supports_subgroups(Older)
    assert all(supports_subgroups(cls) for cls in (CpuAccelerator, NvidiaAccelerator, AscendAccelerator))
    world = GroupCollectives(Older(), range(2), 1)
    assert world.all_gather(torch.ones(1)).tolist() == [1.0, 1.0] and (world.rank, world.size) == (1, 2)
    check_subgroups(ParallelLayout(ep=2, dp=2), Older, "older")
    with pytest.raises(ParallelConfigError, match=r"ep=2 dp=4 cp=1.*several expert- or context-parallel groups"
                                                  r".*older back end does not implement Collectives.new_group"):
        check_subgroups(ParallelLayout(ep=2, dp=4), Older, "older")
    with pytest.raises(TypeError, match="all_gather"):  # a present parameter must still match
        class Renamed(Collectives):  # noqa: F841 - definition is the test
            def all_gather(self, tensor, grp=None):
                return tensor


def test_probes_of_absent_hardware_are_clear():
    from deepinfer_plugins.ascend950 import AscendAccelerator
    from deepinfer_plugins.nvidia_sm100 import NvidiaAccelerator

    nv = NvidiaAccelerator.probe()
    assert not nv.usable and ("CUDA build" in nv.reason or "GPU" in nv.reason)
    asc = AscendAccelerator.probe()
    assert not asc.usable and "torch_npu" in asc.reason


def test_accelerator_is_abstract():
    with pytest.raises(TypeError):
        Accelerator()


def test_doctor_lists_the_features_and_every_variable(clean_env, capsys):
    import re

    from deepinfer.cli import main

    clean_env.setenv("DEEPINFER_ACCELERATOR", "cpu")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^structured_output +on +regex / JSON-schema", out, re.M)
    assert re.search(r"^dspark +off +speculative decoding", out, re.M)
    assert "DEEPINFER_ACCELERATOR: Back end to use" in out
    assert "DEEPINFER_USE_NEXTN_DECODE: feature dspark: Maximum speculative draft length" in out
