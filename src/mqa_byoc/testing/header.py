"""The header every run JSON starts with: what ran, when, where."""

from __future__ import annotations

import datetime
import functools
import sys


def gpu_info(torch) -> dict:
    """GPU name and arch, torch and its CUDA (device 0), and the GPU's limits (HBM TB/s, dense fp16
    TFLOP/s: :func:`~mqa_byoc.runtime.gpu_limits.this_gpu_limits`), which a run's ratios are taken against."""
    from ..runtime.gpu_limits import this_gpu_limits

    props = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(0), "sm": f"sm_{props.major}{props.minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda, "limits": this_gpu_limits(torch).as_dict()}


def hbm_bytes_per_s(header: dict | None = None) -> float:
    """The HBM bandwidth (bytes/s) a run's bytes limits are taken at: that of ``header`` (a run's
    :func:`run_header`; an older record without limits: its GPU's, :func:`~mqa_byoc.runtime.gpu_limits.record_limits`),
    else this GPU's."""
    from ..runtime.gpu_limits import record_limits

    return (record_limits(header).hbm_tbps if header is not None else _this_gpu_hbm_tbps()) * 1e12


@functools.cache
def _this_gpu_hbm_tbps() -> float:
    from ..runtime.gpu_limits import this_gpu_limits

    return this_gpu_limits().hbm_tbps


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


def row_gpu(torch) -> dict:
    """What a benchmark's rows record of the GPU they ran on: ``gpu`` (its name) and ``hbm_tbps`` (its HBM
    bandwidth, at which their bytes limits are taken)."""
    from ..runtime.gpu_limits import this_gpu_limits

    return {"gpu": torch.cuda.get_device_name(0), "hbm_tbps": this_gpu_limits(torch).hbm_tbps}


def rows_gpu(rows: list[dict]) -> tuple[str, float]:
    """The GPU name and HBM TB/s of a run's rows (:func:`row_gpu`); rows that record none were measured
    on an H200."""
    from ..runtime.gpu_limits import DEFAULT

    first = rows[0] if rows else {}
    return first.get("gpu", DEFAULT.gpu), first.get("hbm_tbps", DEFAULT.hbm_tbps)
