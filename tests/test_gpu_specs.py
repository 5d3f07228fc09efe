"""Issue 18 item 4: the GPU type comes from an exact table of device names, never a substring."""
from __future__ import annotations

import types

import pytest
import torch
import yaml
from builders import ROOT

from pipeline.errors import PipelineError
from pipeline.planning.compute import GPU_NAMES, GPU_SPECS, GPU_TYPE_ALIASES, HBM_BYTES_PER_S, PEAK_FLOPS, gpu_type_of


@pytest.mark.parametrize("name, gpu, bf16, hbm", [
    ("NVIDIA H100 80GB HBM3", "H100-SXM", 989e12, 3.35e12),
    ("NVIDIA H100 PCIe", "H100-PCIe", 756e12, 2.0e12),       # was mapped to SXM's 989 / 3.35 by "H100" in name
    ("NVIDIA H100 NVL", "H100-NVL", 835.5e12, 3.9e12),
    ("NVIDIA H200", "H200", 989e12, 4.8e12),
    ("NVIDIA GH200 480GB", "GH200", 989e12, 4.0e12),         # "H200" in "GH200": was H200's 4.8 TB/s
    ("NVIDIA A100-SXM4-40GB", "A100-40GB", 312e12, 1.555e12),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB", 312e12, 2.039e12),
    ("NVIDIA L40S", "L40S", 362.05e12, 0.864e12),
])
def test_device_names_map_exactly(name, gpu, bf16, hbm):
    assert gpu_type_of(name) == gpu
    assert PEAK_FLOPS[gpu]["bf16"] == bf16 and HBM_BYTES_PER_S[gpu] == hbm


@pytest.mark.parametrize("name", ["NVIDIA H800", "H100", "NVIDIA GH200", "Tesla V100-SXM2-16GB"])
def test_unknown_names_are_refused_with_the_known_ones(name):
    with pytest.raises(PipelineError, match="unknown GPU") as e:
        gpu_type_of(name)
    assert all(n in str(e.value) for n in GPU_NAMES)


def test_schema_lists_every_type_and_the_aliases():
    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    enum = schema["properties"]["hardware"]["properties"]["gpu_type"]["enum"]
    assert set(enum) == set(GPU_SPECS) | set(GPU_TYPE_ALIASES) | {"cpu"} == set(PEAK_FLOPS)
    assert PEAK_FLOPS["H100"] == PEAK_FLOPS["H100-SXM"] and PEAK_FLOPS["A100"] == PEAK_FLOPS["A100-80GB"]


def test_bench_reads_the_type_from_the_device_properties(monkeypatch):
    """The CUDA branch on CPU: the bench keys its peak from get_device_properties(...).name."""
    from pipeline.bench import throughput as step

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(name="NVIDIA GH200 480GB"))
    name = step.device_name(torch.device("cuda", 0))
    assert step.gpu_type(name) == "GH200"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(name="NVIDIA H20"))
    with pytest.raises(PipelineError, match="unknown GPU 'NVIDIA H20'"):
        step.gpu_type(step.device_name(torch.device("cuda", 0)))


def test_trainer_warns_when_the_gpu_is_not_the_configured_type(monkeypatch, caplog):
    from pipeline.training import train

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(name="NVIDIA H100 PCIe"))
    train.check_gpu_type({"hardware": {"gpu_type": "H100"}}, torch.device("cuda", 0))
    assert "hardware.gpu_type: H100-PCIe" in caplog.text
    caplog.clear()
    sxm = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: sxm)
    train.check_gpu_type({"hardware": {"gpu_type": "H100"}}, torch.device("cuda", 0))
    assert not caplog.text
