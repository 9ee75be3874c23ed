"""A native-provider library runs with TVM's runtime only: no Python provider, no torch.

For each native library in the artifacts (``tools/gpu/build_forms.py --native``), a fresh subprocess
(``native_standalone_child.py``) in which ``torch`` and ``mqa_byoc`` cannot be imported (a
``sys.meta_path`` finder installed before anything else is imported makes them ModuleNotFoundError) loads it with
``tvm.runtime.load_module`` + ``tvm.runtime.vm.VirtualMachine`` (after the runtime kit's set-up module ``tvm_runtime_kit``),
feeds every case function in it the manifest's inputs (numpy, from the seed; copied to the GPU with
``tvm.runtime.tensor``) and writes the outputs as ``.npy``. This test then compares each with the
python provider's output of the same case variant in this process (both FA2: nearly equal) and with
the fp32 PyTorch reference. The subprocesses are started with the session's runtime (``rt`` in
conftest.py), in parallel, while this process loads its own libraries.

Skips, with the reason shown, without a CUDA GPU or without native artifacts.
"""

from __future__ import annotations

import re

import os

import numpy as np
import pytest

import gpu_common as gc
from mqa_byoc.testing import attention_cases
from mqa_byoc.testing import gpu_manifest as gi

pytestmark = pytest.mark.gpu

# Tolerances: the case's (mqa_byoc.testing.attention_cases); "same_kernel" where both sides run FA2
# (ours, compiled from flash-attn 2.8.3, vs the python provider's backend).
LIBRARIES = gc.native_libraries()


def _params():
    if LIBRARIES:
        root = str(gc.ARTIFACTS)
        return [pytest.param(path, id=os.path.relpath(path, root)) for path in sorted(LIBRARIES)]
    if not gc.MANIFESTS:
        reason = gc.no_artifacts_reason()
    else:
        whys = sorted({why for m in gc.MANIFESTS for why in gc.providers_of(m)[1].values()})
        reason = "no native libraries in the artifacts (build with `tools/gpu/build_forms.py --native`)" + (
            f": {whys[0]}" if whys else "")
    return [pytest.param(None, id="no-native-artifacts", marks=pytest.mark.skip(reason=reason))]


@pytest.mark.parametrize("library", _params())
def test_native_library_runs_without_torch_or_mqa_byoc(rt, library):
    if rt.standalone is None:  # the session did not expect this test (e.g. selected by -k later)
        rt.standalone = gc.StandaloneRuns(LIBRARIES)
    result, log, seconds, rc = rt.standalone.result(library)
    assert result is not None, f"child wrote no result (exit {rc}):\n{log[-4000:]}"
    assert result["error"] is None, f"child failed (exit {rc}): {result['error']}\n{log[-4000:]}"
    assert rc == 0, log[-4000:]
    assert not result["imported_blocked"], f"child imported {result['imported_blocked']}"
    assert "torch" not in result["modules"] and "mqa_byoc" not in result["modules"]
    record = rt.results.setdefault(f"standalone:{os.path.relpath(library, gc.ARTIFACTS)}", {})
    record.update(seconds=seconds, load_seconds=result.get("load_seconds"),
                  blocked_import_attempts=sorted(set(result["blocked_import_attempts"])), max_abs_err={})

    torch = rt.torch
    failures = []
    for m, key in LIBRARIES[library]:
        fn = gi.function_name(m, key)
        tols = attention_cases.case(m["case"]["name"]).tolerances()
        native = torch.from_numpy(np.load(result["outputs"][fn]["out"]))
        python = rt.run(m, re.sub(r"_(native|hopper)$", "_python", key)).float().cpu()
        fp32 = gc.torch_reference(torch, m, rt.case_inputs(m)).cpu()
        errs = {"vs_python_provider": gc.max_err(native, python), "vs_fp32": gc.max_err(native, fp32)}
        record["max_abs_err"][fn] = errs
        # the python provider runs FA2: the native provider's kernel, not FA4's (hopper)
        same = tols["same_kernel"] if key.endswith("_native") else tols["fp32"]
        for name, want, tol in (("python provider", python, same), ("fp32 torch", fp32, tols["fp32"])):
            if native.shape != want.shape:
                failures.append(f"{fn}: shape {tuple(native.shape)} vs {name} {tuple(want.shape)}")
            elif not torch.allclose(native, want, **tol):
                failures.append(f"{fn}: differs from the {name} output by up to {gc.max_err(native, want):.3g} "
                                f"(tolerance {tol})")
    assert not failures, "\n".join(failures)
