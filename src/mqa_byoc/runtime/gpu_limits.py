"""The limits a GPU's kernels are measured against: its HBM bandwidth and its dense fp16/bf16 tensor rate.

A GEMM table or a decoder benchmark says how close a kernel comes to the bytes it must move or the FLOPs
it must do; that needs the limits of the GPU it ran on, not of one GPU for all. :func:`limits_for` finds
them from a GPU's name (NVIDIA's data-sheet figures for the data-center GPUs: SXM, PCIe and NVL parts
differ), :func:`device_limits` for the GPU of this process from the CUDA driver: the name first, and for
a GPU not in the table the driver's own figures (bandwidth: memory clock x bus width x 2, the double data
rate; tensor rate: SMs x clock x the dense fp16 FLOPs an SM of its architecture does per clock). The
``source`` of every :class:`GpuLimits` says which.

Run time and report only: no TVM, no torch (the driver through ctypes).
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class GpuLimits:
    """``hbm_tbps`` (TB/s) and ``dense_tflops`` (fp16/bf16 tensor cores, fp32 accumulation, no sparsity)
    of ``gpu``; ``source``: where they come from (``data sheet``, ``CUDA driver``, ``given``, or
    ``assumed``: a record that names no GPU)."""

    gpu: str
    hbm_tbps: float
    dense_tflops: float
    source: str

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        whose = "given" if self.source == "given" else f"{self.gpu}; {self.source}"
        return f"{self.hbm_tbps:g} TB/s, {self.dense_tflops:.0f} TFLOP/s dense ({whose})"


#: (name pattern, HBM TB/s, dense fp16 TFLOP/s); the first match wins, so a part's specific names come
#: before its family's
DATA_SHEET: tuple[tuple[str, float, float], ...] = (
    (r"H200 NVL", 4.8, 835.0),
    (r"GH200.*(144|HBM3e)", 4.9, 989.0),
    (r"GH200", 4.0, 989.0),
    (r"H200", 4.8, 989.0),
    (r"H100 NVL", 3.9, 835.0),
    (r"H100 PCIe", 2.0, 756.0),
    (r"H800 PCIe", 2.0, 756.0),
    (r"H100|H800", 3.35, 989.0),  # SXM5 80GB ("NVIDIA H100 80GB HBM3")
    (r"H20\b", 4.0, 148.0),
    (r"B200", 8.0, 2250.0),
    (r"A100.*80GB.*PCIe|A100 80GB PCIe", 1.935, 312.0),
    (r"A100.*80GB|A800.*80GB", 2.039, 312.0),
    (r"A100|A800", 1.555, 312.0),  # 40GB
    (r"L40S", 0.864, 362.0),
    (r"L40\b", 0.864, 181.0),
    (r"\bL4\b", 0.3, 121.0),
    (r"\bA10\b", 0.6, 125.0),
)

#: the GPU this project's committed results were measured on, for records that name none
DEFAULT = GpuLimits("NVIDIA H200", 4.8, 989.0, "assumed: the record names no GPU")

#: dense fp16 tensor-core FLOPs per SM per clock, by compute capability (fp32 accumulation)
_FLOPS_PER_SM_CLOCK = {(8, 0): 2048, (8, 6): 1024, (8, 7): 1024, (8, 9): 1024, (9, 0): 4096, (10, 0): 8192}


def limits_for(gpu: str | None) -> GpuLimits | None:
    """The data sheet's limits of the GPU named ``gpu`` (as the driver or torch names it), ``None`` for a
    GPU not in :data:`DATA_SHEET`."""
    if not gpu:
        return None
    for pattern, tbps, tflops in DATA_SHEET:
        if re.search(pattern, gpu, re.IGNORECASE):
            return GpuLimits(gpu, tbps, tflops, "data sheet")
    return None


def record_limits(record: dict) -> GpuLimits:
    """The limits a recorded run is measured against: its own ``limits`` (written since runs record them),
    else those of the GPU it names, else :data:`DEFAULT` (saying so in ``source``)."""
    got = record.get("limits") or {}
    if "hbm_tbps" in got and "dense_tflops" in got:
        return GpuLimits(got.get("gpu", record.get("gpu") or "?"), float(got["hbm_tbps"]),
                         float(got["dense_tflops"]), got.get("source", "recorded"))
    return limits_for(record.get("gpu")) or DEFAULT


def given(hbm_tbps: float, dense_tflops: float, gpu: str = "given") -> GpuLimits:
    """Limits the user names (``--limits TBPS,TFLOPS``)."""
    if hbm_tbps <= 0 or dense_tflops <= 0:
        raise ValueError(f"limits must be positive, got {hbm_tbps} TB/s and {dense_tflops} TFLOP/s")
    return GpuLimits(gpu, float(hbm_tbps), float(dense_tflops), "given")


class DriverError(RuntimeError):
    """The CUDA driver could not be opened or asked (no GPU, no driver)."""


def _driver():
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        if lib.cuInit(0) != 0:
            raise DriverError(f"cuInit failed in {name}: no usable CUDA device")
        return lib
    raise DriverError("no CUDA driver library (libcuda.so.1) on this machine")


# CUdevice_attribute values (cuda.h)
_ATTR = {"clock_khz": 13, "sms": 16, "memory_clock_khz": 36, "bus_width_bits": 37, "major": 75, "minor": 76}


def driver_properties(ordinal: int = 0) -> dict:
    """What the CUDA driver says of device ``ordinal``: its name and the attributes the limits are derived
    from (an attribute the driver does not report is left out)."""
    lib = _driver()
    dev = ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        raise DriverError(f"no CUDA device {ordinal}")
    buf = ctypes.create_string_buffer(256)
    lib.cuDeviceGetName(buf, 256, dev)
    out = {"name": buf.value.decode(errors="replace")}
    for key, attr in _ATTR.items():
        v = ctypes.c_int()
        if lib.cuDeviceGetAttribute(ctypes.byref(v), attr, dev) == 0 and (v.value > 0 or key == "minor"):
            out[key] = v.value
    return out


def derived_limits(props: dict) -> GpuLimits | None:
    """Limits from the driver's figures (:func:`driver_properties`), ``None`` where one is missing or the
    architecture's tensor rate is not known here."""
    need = ("memory_clock_khz", "bus_width_bits", "sms", "clock_khz", "major", "minor")
    per_clock = _FLOPS_PER_SM_CLOCK.get((props.get("major"), props.get("minor")))
    if per_clock is None or any(k not in props for k in need):
        return None
    tbps = 2 * props["memory_clock_khz"] * 1e3 * props["bus_width_bits"] / 8 / 1e12
    tflops = props["sms"] * props["clock_khz"] * 1e3 * per_clock / 1e12
    return GpuLimits(props["name"], round(tbps, 3), round(tflops, 1), "CUDA driver")


def device_limits(ordinal: int = 0) -> GpuLimits:
    """The limits of this process's GPU ``ordinal``: the data sheet's for its name, else the driver's
    figures. Raises :class:`DriverError` when neither is known, naming what to pass instead."""
    props = driver_properties(ordinal)
    found = limits_for(props["name"]) or derived_limits(props)
    if found is None:
        raise DriverError(f"no limits known for {props['name']} (compute capability "
                          f"{props.get('major')}.{props.get('minor')}): pass them, e.g. --limits 3.35,989")
    return found


def this_gpu_limits(torch=None) -> GpuLimits:
    """:func:`device_limits` of device 0; where the driver cannot be asked, the data sheet's for the name
    ``torch`` gives (when passed), else :data:`DEFAULT`, saying so in ``source``."""
    try:
        return device_limits()
    except DriverError as e:
        name = torch.cuda.get_device_name(0) if torch is not None else None
        return limits_for(name) or replace(DEFAULT, gpu=name or "unknown GPU", source=f"assumed, the H200's: {e}")
