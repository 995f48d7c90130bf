"""Where a measurement was taken: the machine, the CPU's vector ISA, the library versions. Every
benchmark's result file and `vkv profile-mapping` carry this."""
from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

import torch

import ext


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_isa() -> dict:
    """The CPU's model and the vector ISA features that decide vkv's paths."""
    flags = ext.cpu_flags()
    # (a virtual machine's model name may say only "AMD EPYC": family 23 is Zen 1-2, 25 Zen 3-4)
    family, model = ext.cpu_field("cpu family"), ext.cpu_field("model")
    return {"cpu_model": ext.cpu_model(), "cpu_family_model": "unknown" if "unknown" in (family, model) else f"{family}/{model}",
            "isa": [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx_vnni",
                                "avx_ne_convert", "amx_bf16", "amx_int8") if f in flags],
            "kernel_isa": ext.kernel_isa()[0], "native_bf16_gemm": ext.bf16_gemm()[0]}


def machine_info() -> dict:
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        **cpu_isa(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": _version("numpy"),
        "transformers": _version("transformers"),
        "cuda_python": _version("cuda-python") or _version("cuda-bindings"),
        "gpu": None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda_runtime"] = torch.version.cuda
        info["cuda_driver"] = _driver_version()
    return info


def _driver_version() -> str | None:
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None
    err, version = cu.cuDriverGetVersion()
    return f"{version // 1000}.{version % 1000 // 10}" if err == cu.CUresult.CUDA_SUCCESS else None
