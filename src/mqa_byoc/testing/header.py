"""The header every run JSON starts with: what ran, when, where."""

from __future__ import annotations

import datetime
import sys


def gpu_info(torch) -> dict:
    """GPU name and arch, torch and its CUDA (device 0)."""
    props = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(0), "sm": f"sm_{props.major}{props.minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda}


def run_header(command: str | None = None, **extra) -> dict:
    """``command`` (default: this process's argv), ``date`` (UTC, ISO), then :func:`gpu_info`
    and ``extra``.

    Returns
    -------
    dict
        The header; a run adds its own fields and records after it.
    """
    import torch

    return {"command": command or " ".join(sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **gpu_info(torch), **extra}
