"""launch_overlap (kernel option): our decode kernels and CUTLASS's GEMV entries may be launched as
programmatic dependents, so each must wait for the previous kernel (``griddepcontrol.wait``) before it
reads or writes global memory. Checked on their sm_90 PTX: in every kernel entry the wait comes before the
first global access; the GEMV's L2 prefetch (no operand read) may come before it. The launches' attribute
is checked on the GPU (tests/gpu: the decode kernel's and the GEMM tests run with it)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from mqa_byoc.compiler import kernel_options
from mqa_byoc.kernels import gemv
from mqa_byoc.kernels.toolchain import find_nvcc
from mqa_byoc.kernels import paths

#: state spaces whose accesses before the wait are allowed (kernel parameters, the CTA's own memory)
LOCAL_SPACES = (".param", ".shared", ".local", ".const")


def _first_global_access(body: str) -> int:
    """Offset of the first instruction that may touch global memory (a load, store, atomic or async copy,
    generic addressing included), -1 when none; the L2 prefetch reads no operand and is not one."""
    offset = 0
    for line in body.splitlines(keepends=True):
        op = re.sub(r"^@!?%?\w+\s+", "", line.strip()).split(" ")[0].split("\t")[0]
        if (op.startswith(("ld.", "st.", "atom.", "red.", "cp.async.")) and not op.startswith("cp.async.bulk.prefetch")
                and not any(space in op for space in LOCAL_SPACES)):
            return offset
        offset += len(line)
    return -1


def _nvcc():
    try:
        return find_nvcc()
    except Exception as e:  # noqa: BLE001 - the reason is shown
        pytest.skip(f"no nvcc: {e}")


def _entries(ptx: str) -> dict[str, str]:
    """Kernel entry name -> its body."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\n\}\n", ptx, re.S):
        out[m.group(1)] = m.group(2)
    return out


def _ptx(tmp_path, source, *flags):
    out = tmp_path / (source.stem + ".ptx")
    subprocess.run([_nvcc(), "-ptx", "-arch=compute_90", "-std=c++17", "-O3", *flags, f"-I{paths.NATIVE_DIR}",
                    str(source), "-o", str(out)], check=True, capture_output=True)
    return out.read_text()


def _check_waits_first(body: str, name: str, prefetch: bool):
    wait = body.find("griddepcontrol.wait")
    assert wait >= 0, f"{name}: no griddepcontrol.wait"
    first = _first_global_access(body)
    assert first > wait, f"{name}: {body[first:first + 60].strip()!r} before the wait"
    trigger = body.find("griddepcontrol.launch_dependents")
    assert trigger > wait, f"{name}: the next kernel may start before this one waited"
    before = body.find("cp.async.bulk.prefetch.L2")
    assert (0 <= before < wait) == prefetch, f"{name}: L2 prefetch before the wait: {before}"


def test_option_values_and_default():
    assert list(kernel_options.CHOICES["launch_overlap"]) == ["off", "pdl", "prefetch"]
    assert kernel_options.KernelOptions().launch_overlap == "off"
    assert kernel_options.KernelOptions.of("launch_overlap=prefetch").codes()[-1] == 2


def test_gemv_entries_wait_before_reading(tmp_path):
    try:
        include = gemv.cutlass_include_dir()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    ptx = _ptx(tmp_path, paths.GEMV_SOURCE, "-DNDEBUG", f"-I{include}")
    entries = {n: b for n, b in _entries(ptx).items() if n.startswith("mqa_byoc_gemv_")}
    assert len(entries) >= 8, sorted(entries)  # fp16 and bf16 of every configuration
    for name, body in entries.items():
        _check_waits_first(body, name, prefetch=True)


def test_decode_kernels_wait_before_reading(tmp_path):
    ptx = _ptx(tmp_path, paths.NATIVE_DIR / "gqa_decode.cu")
    entries = _entries(ptx)
    kinds = {k: [n for n in entries if k in n] for k in ("gqa_decode_kernel", "gqa_decode_shared_kernel",
                                                          "gqa_decode_split_merge_kernel")}
    assert all(kinds.values()), {k: len(v) for k, v in kinds.items()}
    for name, body in entries.items():
        if "gqa_decode" in name:
            _check_waits_first(body, name, prefetch=False)
