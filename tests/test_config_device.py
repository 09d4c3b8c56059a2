"""Device options: validated with the field and its limit named, before any model work; dtype="auto" is
bfloat16 on a GPU, and on a CPU with native bf16 or quantized weights (the CLI flags:
tests/entrypoints/cli/test_args.py)."""

from __future__ import annotations

import pytest
import torch

from vlite.config import DeviceConfig, ModelConfig, resolve_dtype_name
from vlite.engine.arg_utils import EngineArgs

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")


@pytest.mark.parametrize("kwargs,field", [(dict(device="tpu"), "device"), (dict(device="CUDA"), "device"),
                                          (dict(gpu_memory_utilization=0), "gpu_memory_utilization"),
                                          (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
                                          (dict(gpu_memory_utilization=True), "gpu_memory_utilization")])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DeviceConfig(**kwargs)


def test_resolve_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert DeviceConfig("auto").resolve() == "cpu"
    assert DeviceConfig("cpu").resolve() == "cpu"
    with pytest.raises(ValueError, match="device='cuda' but torch sees no GPU"):
        DeviceConfig("cuda").resolve()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert DeviceConfig("auto").resolve() == "cuda"


def test_auto_dtype_is_bfloat16_on_gpu():
    assert resolve_dtype_name(ModelConfig(dtype="auto"), "cuda") == "bfloat16"
    assert resolve_dtype_name(ModelConfig(dtype="float32"), "cuda") == "float32"
    assert resolve_dtype_name(ModelConfig(dtype="auto"), "cpu") == ModelConfig().torch_dtype_name


def test_auto_dtype_on_a_cpu_without_bf16(monkeypatch):
    """Quantized weights run on the integer kernels, which quantize activations to int8 from either
    dtype: bf16 there (no residual rows, half the KV cache). A dense model stays float32 (a dense
    bf16 GEMM without native bf16 is emulated), as does the torch path without the kernels."""
    from vlite.engine.arg_utils import _on_integer_kernels
    from vlite.model_loader import ResolvedModel, resolve_model

    assert resolve_dtype_name(ModelConfig(dtype="auto"), "cpu", integer_kernels=True) == "bfloat16"
    assert resolve_dtype_name(ModelConfig(dtype="float32"), "cpu", integer_kernels=True) == "float32"
    monkeypatch.setenv("VLITE_CPU_ISA", "avx2")
    assert resolve_dtype_name(ModelConfig(dtype="auto"), "cpu") == "float32"
    default = resolve_model(None)  # the Q4_1 GGUF
    assert _on_integer_kernels(default, None) and _on_integer_kernels(default, "int4")
    assert not _on_integer_kernels(default, "none")
    folder = ResolvedModel("dense", default.path)  # weights from a Hugging Face folder: dense
    assert not _on_integer_kernels(folder, None) and _on_integer_kernels(folder, "int8")
    monkeypatch.setenv("VLITE_CPU_KERNELS", "0")
    assert not _on_integer_kernels(default, None)


def _no_model_load(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the model was resolved before the device was validated")

    monkeypatch.setattr("vlite.engine.arg_utils.resolve_model", fail)


@no_gpu
def test_cuda_without_gpu_fails_before_any_work(monkeypatch):
    _no_model_load(monkeypatch)
    with pytest.raises(ValueError, match="device='cuda'"):
        EngineArgs(device="cuda").create_engine_config()
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(gpu_memory_utilization=2.0).create_engine_config()


def test_cpu_quantization_on_cuda_is_refused_before_any_work(monkeypatch):
    _no_model_load(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="quantization='int8' runs vlite's CPU kernels only"):
        EngineArgs(device="cuda", quantization="int8").create_engine_config()
    with pytest.raises(ValueError, match="speculative_config runs on the CPU only"):
        EngineArgs(device="cuda", speculative_config={"num_speculative_tokens": 2}).create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size / data_parallel_size > 1 run CPU worker processes"):
        EngineArgs(device="cuda", tensor_parallel_size=2).create_engine_config()


def test_num_threads_from_flag_or_environment(monkeypatch):
    """--threads / VLITE_NUM_THREADS: a positive count, checked before any work; the flag wins."""
    from vlite.config import NUM_THREADS_ENV, DeviceConfig
    from vlite.entrypoints import cli
    from vlite.entrypoints.cli.args import engine_args_from_cli

    monkeypatch.delenv(NUM_THREADS_ENV, raising=False)
    assert DeviceConfig().num_threads is None
    monkeypatch.setenv(NUM_THREADS_ENV, "3")
    assert DeviceConfig().num_threads == 3
    assert DeviceConfig(num_threads=1).num_threads == 1
    monkeypatch.setenv(NUM_THREADS_ENV, "many")
    with pytest.raises(ValueError, match="VLITE_NUM_THREADS must be a positive integer"):
        DeviceConfig()
    monkeypatch.delenv(NUM_THREADS_ENV)
    with pytest.raises(ValueError, match="num_threads must be a positive integer"):
        DeviceConfig(num_threads=0)
    ns = cli.build_parser().parse_args(["generate", "hi", "--threads", "2"])
    assert engine_args_from_cli(ns).num_threads == 2
