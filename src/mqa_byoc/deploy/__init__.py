"""Cross-compiling: compile where TVM's compiler is, run where the GPU is.

TVM's compiler library is most of the ``apache-tvm`` wheel (about 260 MB); a machine that only loads
and runs exported libraries needs TVM's runtime alone. ``mqa-byoc runtime-kit --out DIR``
(:func:`write_runtime_kit`) writes a folder to copy there:

- :mod:`.runtime_kit`: writes the kit (on the compile machine; no ``tvm.relax`` import);
- :mod:`.tvm_runtime_kit`: the set-up module the kit carries (stands alone: no ``mqa_byoc`` import);
  import it before loading a library with the runtime-only TVM.
"""

from __future__ import annotations

import importlib

from .runtime_kit import KIT_MODULE, RuntimeKit, runtime_copy_ignored, write_runtime_kit

__all__ = ["KIT_MODULE", "RuntimeKit", "prepare_runtime", "runtime_copy_ignored", "write_runtime_kit"]


def prepare_runtime():
    """Run the kit's set-up (CUDA backend of a runtime-only TVM, nvcc hook) before a library is loaded.

    Imports the kit's ``tvm_runtime_kit`` where it is on ``sys.path`` (after ``source KIT/setup.sh``),
    else this package's copy of the same file: any runtime-only TVM on the path is prepared.

    Returns
    -------
    module
        The set-up module imported.
    """
    try:
        return importlib.import_module(KIT_MODULE)
    except ModuleNotFoundError as err:
        if err.name != KIT_MODULE:
            raise
    return importlib.import_module(f"{__name__}.{KIT_MODULE}")
