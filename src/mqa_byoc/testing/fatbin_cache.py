"""TVM 0.27 keeps the CUDA of an exported library as source and compiles it when the library is
loaded. :func:`precompile_cuda` compiles it here into fatbins keyed by the source's hash;
:func:`serve_fatbins` hands them to TVM's compile hook on the GPU machine (anything else goes to
the compiler registered before, e.g. the runtime-only kit's nvcc hook)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time

from mqa_byoc.testing.cuda_compile import cuda_compile_hook, fatbin_cache_key

def _cuda_sources(executable):
    mod = getattr(executable, "mod", executable)
    seen, keep, stack, out = set(), [], [mod], []
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        keep.append(m)  # keep the wrappers alive: ids of freed ones are reused
        if m.kind == "cuda":
            # format "cuda" is the stored code itself, what the loader hands tvm_callback_cuda_compile
            for fmt in ("cuda", ""):
                try:
                    src = m.inspect_source(fmt)
                except Exception:  # noqa: BLE001
                    continue
                if src:
                    out.append(src)
                    break
        stack.extend(m.imports)
    return out

def precompile_cuda(executable, cache_dir, arch, nice=10):
    """Compile the CUDA source TVM keeps in ``executable`` (TVM 0.27 stores it and JIT-compiles at load)
    into fatbins under ``cache_dir``, keyed by the source's hash; ``run`` serves them to TVM's
    ``tvm_callback_cuda_compile`` (:func:`serve_fatbins`), falling back to the compiler registered before."""
    os.makedirs(cache_dir, exist_ok=True)
    done = []
    for code in _cuda_sources(executable):
        key = fatbin_cache_key(code, arch)
        out = os.path.join(cache_dir, key + ".fatbin")
        if not os.path.exists(out):
            with tempfile.TemporaryDirectory() as tmp:
                src = os.path.join(tmp, "k.cu")
                with open(src, "w") as f:
                    f.write(code)
                t0 = time.time()
                cmd = ["nice", "-n", str(nice), "nvcc", "--fatbin", "-O3", f"-arch={arch}", "-w", "-o", out + ".tmp", src]
                subprocess.run(cmd, check=True)
                os.replace(out + ".tmp", out)
                print(f"  nvcc {key}: {time.time() - t0:.0f} s, {os.path.getsize(out) / 1e6:.2f} MB", flush=True)
        done.append(key)
    return done


def serve_fatbins(cache_dir, stats):
    """Context manager: TVM's load-time CUDA compile served from ``cache_dir`` (hits / misses and the
    seconds spent compiling misses counted in ``stats``), the previous hook restored on exit."""
    import tvm

    major, minor = tvm.cuda(0).compute_version.split(".")
    arch = f"sm_{major}{minor}"

    def make(previous):
        def compile_cuda(code, *rest):
            path = os.path.join(cache_dir, fatbin_cache_key(str(code), arch) + ".fatbin")
            if os.path.exists(path):
                stats["hits"] += 1
                with open(path, "rb") as f:
                    return bytearray(f.read())
            stats["misses"] += 1
            if previous is None:
                raise RuntimeError("no CUDA compiler registered (run with --setup MODULE for a runtime-only TVM)")
            t0 = time.time()
            out = previous(code, *rest)
            stats["miss_compile_s"] += time.time() - t0
            return out

        return compile_cuda

    return cuda_compile_hook(make)
