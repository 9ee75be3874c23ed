"""Build every GPU test artifact, one builder after the other (the build step of ``pytest tests/gpu``).

    python tools/gpu/build_all.py [--only forms decoders ...] [--skip hf ...] [--list]

Each builder runs in its own process with its defaults (``.gpu-artifacts/<name>``); ``forms`` is built
with ``--native --hopper``. The native libraries link FA2 kernels from the kernel cache or
``MQA_BYOC_KERNEL_DIR``; compile them first with ``mqa-byoc build-kernels`` (minutes per kernel file).
On a machine with the full TVM and a GPU, ``pytest tests/gpu`` then runs everything; elsewhere copy
``.gpu-artifacts`` and a runtime kit (``mqa-byoc runtime-kit``) to the GPU machine (docs/testing.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: name -> (the builder: a script of this folder or ``-m mqa_byoc.cli``, its arguments, the GPU tests
#: that read its artifacts)
BUILDERS = {
    "forms": ("build_forms.py", ["--native", "--hopper"], "test_gpu_attention.py, test_native_standalone.py"),
    "decoders": ("build_decoders.py", [], "test_gpu_decoder_masks.py"),
    "inplace": ("build_inplace.py", [], "test_gpu_inplace_decoder.py"),
    "varlen": ("build_varlen.py", [], "test_gpu_varlen.py"),
    "paged": ("build_paged.py", [], "test_gpu_paged.py"),
    "hf": ("build_hf.py", [], "test_gpu_hf_decoder.py"),
    "hf-standard": ("build_hf_standard.py", [], "test_gpu_hf_standard.py"),
    "hf-dynamic-decode": ("build_hf_dynamic_decode.py", [], "test_gpu_hf_dynamic_decode.py"),
    "profile-paged": ("-m mqa_byoc.cli", ["profile", "build", "--kv-cache", "paged", "--preset", "codellama-34b",
                                         "--layers", "2", "--vocab", "4096", "--hidden-size", "2048",
                                         "--intermediate-size", "4096", "--out", ".gpu-artifacts/profile-paged"],
                      "test_gpu_profile_paged.py"),
    "gemm": ("build_gemm.py", ["--no-bench"], "test_gpu_gemm.py"),
    "cpp-runtime": ("build_cpp_runtime.py", [], "test_gpu_cpp_runtime.py"),
    "tp": ("build_tp.py", [], "test_gpu_tp.py"),
}
ROOT = HERE.parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--only", nargs="*", choices=sorted(BUILDERS), help="build only these")
    ap.add_argument("--skip", nargs="*", default=[], choices=sorted(BUILDERS), help="do not build these")
    ap.add_argument("--list", action="store_true", help="print the builders and exit")
    args = ap.parse_args(argv)
    names = [n for n in (args.only or BUILDERS) if n not in args.skip]
    if args.list:
        for name, (script, extra, tests) in BUILDERS.items():
            print(f"{name:12s} {script} {' '.join(extra)}  ->  tests/gpu/{tests}")
        return 0
    failed = []
    for name in names:
        script, extra, _ = BUILDERS[name]
        t0 = time.time()
        head = script.split() if script.startswith("-m ") else [str(HERE / script)]
        print(f"== {name}: python {' '.join(head)} {' '.join(extra)}", flush=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        rc = subprocess.call([sys.executable, *head, *extra], cwd=ROOT, env=env)
        print(f"== {name}: exit {rc} ({time.time() - t0:.0f} s)", flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
