"""What every benchmark shares: where it was measured, and how its results are written."""
from __future__ import annotations

import json
import os

from engine.machine import machine_info  # noqa: F401  (re-exported for the benchmarks)


def save(result: dict, json_path: str | None, plot_path: str | None, plot) -> None:
    """Write a benchmark's JSON and PNG where asked."""
    if json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if plot_path:
        os.makedirs(os.path.dirname(plot_path) or ".", exist_ok=True)
        plot(result, plot_path)
