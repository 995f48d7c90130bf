"""What every benchmark shares: where it was measured, and how its results are written."""
from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata

import torch


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
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


def save(result: dict, json_path: str | None, plot_path: str | None, plot) -> None:
    """Write a benchmark's JSON and PNG where asked."""
    if json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if plot_path:
        os.makedirs(os.path.dirname(plot_path) or ".", exist_ok=True)
        plot(result, plot_path)
