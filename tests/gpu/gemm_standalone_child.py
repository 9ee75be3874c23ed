"""Run one GEMM function of a cuBLASLt library in a process where torch and mqa_byoc cannot be imported.

``python3 gemm_standalone_child.py LIBRARY INPUTS.npz FUNCTION OUT.npy RESULT.json`` (started by
test_gpu_gemm.py). Only tvm.runtime, numpy and ml_dtypes are used; RESULT gets any error and what was
imported.
"""

import importlib.abc
import sys

BLOCKED = ("torch", "mqa_byoc")
ATTEMPTS = []


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in BLOCKED:
            ATTEMPTS.append(fullname)
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked)", name=fullname)
        return None


sys.meta_path.insert(0, _Blocker())

import json  # noqa: E402
import traceback  # noqa: E402


def main(lib_path, inputs_path, function, out_path, result_path):
    result = {"error": None}
    try:
        import numpy as np

        from native_standalone_child import prepare_runtime  # the runtime kit's set-up, without mqa_byoc

        prepare_runtime()
        import ml_dtypes
        import tvm
        import tvm.runtime.vm

        data = np.load(inputs_path)
        meta = json.loads(str(data["__meta__"]))[function]
        dev = tvm.cuda(0)
        vm = tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(lib_path), dev)
        args = [tvm.runtime.tensor(data[f"{function}.{i}"].astype(ml_dtypes.bfloat16) if dt == "bfloat16"
                                   else data[f"{function}.{i}"], dev) for i, dt in enumerate(meta["dtypes"])]
        out = vm[function](*args).numpy()
        np.save(out_path, np.asarray(out).astype("float32"))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        result["error"] = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
    result["blocked_import_attempts"] = ATTEMPTS
    result["imported_blocked"] = sorted(n for n in sys.modules if n.partition(".")[0] in BLOCKED)
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)
    return 1 if result["error"] else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:6]))
