"""Run native-provider libraries in a process where torch and mqa_byoc cannot be imported.

Started by ``test_native_standalone.py`` as ``python3 native_standalone_child.py JOB.json``. JOB lists
one library and the calls to make: ``{"library": path, "result": path, "calls": [{"manifest": path,
"function": name, "out": path.npy}]}`` (and ``"device": "cpu"`` for the CPU self-test). Only ``tvm_runtime_kit``
(the runtime kit's set-up: tvm + tvm_ffi), ``tvm.runtime``, numpy (and ml_dtypes for bfloat16, if present) are used. Each output is written as float32 ``.npy``;
RESULT gets what was imported and any error.
"""

import importlib.abc
import sys

# hopper libraries: nor the CuTe DSL (cutlass) or flash-attn-4 (flash_attn) that compiled their FA4 objects
BLOCKED = ("torch", "mqa_byoc", "cutlass", "flash_attn")
ATTEMPTS = []


class _Blocker(importlib.abc.MetaPathFinder):
    """Makes ``torch`` and ``mqa_byoc`` (and their submodules) unimportable."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in BLOCKED:
            ATTEMPTS.append(fullname)
            # as if not installed (tvm_ffi itself tries `import torch` and goes on without it)
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked: the native library must run "
                                      "without it)", name=fullname)
        return None


sys.meta_path.insert(0, _Blocker())
_PRELOADED = sorted(n for n in sys.modules if n.partition(".")[0] in BLOCKED)

import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402


def _tvm_tensor(tvm, arr, dtype, dev):
    if dtype != "bfloat16":
        return tvm.runtime.tensor(arr, dev)
    try:
        import ml_dtypes

        return tvm.runtime.tensor(arr.view(ml_dtypes.bfloat16), dev)
    except ImportError:  # copyfrom takes the uint16 bit patterns as they are
        return tvm.runtime.empty(arr.shape, "bfloat16", dev).copyfrom(arr)


def _to_float32(np, out, dtype):
    arr = out.numpy()
    if dtype == "bfloat16":
        return (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def load_by_path(name, *parts):
    """The checkout's ``src/mqa_byoc/<parts>`` file imported as the top-level module ``name``, without the
    mqa_byoc package (blocked here): for the package's files that import nothing of it."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "mqa_byoc", *parts)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def prepare_runtime() -> str:
    """The runtime kit's set-up module (CUDA backend, nvcc hook), imported without the mqa_byoc package:
    the kit's own ``tvm_runtime_kit`` when on the path, else the checkout's copy of that file."""
    try:
        import tvm_runtime_kit
    except ModuleNotFoundError as err:
        if err.name != "tvm_runtime_kit":
            raise
        tvm_runtime_kit = load_by_path("tvm_runtime_kit", "deploy", "tvm_runtime_kit.py")
    return tvm_runtime_kit.__file__


def main(job_path):
    with open(job_path) as f:
        job = json.load(f)
    result = {"library": job["library"], "preloaded_blocked": _PRELOADED, "outputs": {}, "error": None}
    try:
        if _PRELOADED:
            raise RuntimeError(f"already imported before the blocker was installed: {_PRELOADED}")
        import numpy as np

        result["runtime_setup"] = prepare_runtime() if os.environ.get("TVM_USE_RUNTIME_LIB") == "1" else None
        import tvm
        import tvm.runtime.vm

        gpu_inputs = load_by_path("gpu_manifest", "testing", "gpu_manifest.py")

        dev = tvm.cuda(0) if job.get("device", "cuda") == "cuda" else tvm.cpu(0)  # cpu: self-test only
        if not dev.exist:
            raise RuntimeError(f"no {job.get('device', 'cuda')} device visible to TVM")
        t0 = time.time()
        lib = tvm.runtime.load_module(job["library"])
        vm = tvm.runtime.vm.VirtualMachine(lib, dev)
        result["load_seconds"] = time.time() - t0
        for call in job["calls"]:
            with open(call["manifest"]) as f:
                m = json.load(f)
            args = [_tvm_tensor(tvm, arr, spec["dtype"], dev)
                    for spec, arr in zip(m["inputs"], gpu_inputs.make_inputs(m))]
            out = vm[call["function"]](*args)
            arr = _to_float32(np, out, m["output"]["dtype"])
            np.save(call["out"], arr)
            result["outputs"][call["function"]] = {"out": call["out"], "shape": list(arr.shape)}
        result["tvm"] = tvm.__file__
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        result["error"] = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
    result["blocked_import_attempts"] = ATTEMPTS
    result["imported_blocked"] = sorted(n for n in sys.modules if n.partition(".")[0] in BLOCKED)
    result["modules"] = sorted({n.partition(".")[0] for n in sys.modules if not n.startswith("_")})
    with open(job["result"], "w") as f:
        json.dump(result, f, indent=2)
    return 1 if result["error"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
