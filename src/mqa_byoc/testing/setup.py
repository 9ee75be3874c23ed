"""The run path's set-up hook: modules imported before TVM loads a library.

A runtime-only TVM may need preparing first (loading its CUDA backend, registering an nvcc hook for
the CUDA kept as source in exported libraries). The package does not know that kit; the command
names it: ``mqa-byoc profile run DIR --setup MODULE`` or ``MQA_BYOC_RUNTIME_SETUP=MODULE[,MODULE]``.
"""

from __future__ import annotations

import importlib
import os

SETUP_ENV = "MQA_BYOC_RUNTIME_SETUP"


def import_setup(modules=None) -> list[str]:
    """Import ``modules`` (names), else those of ``$MQA_BYOC_RUNTIME_SETUP`` (comma-separated).

    Returns
    -------
    list of str
        The modules imported, in order.
    """
    names = [m for m in (modules or os.environ.get(SETUP_ENV, "").split(",")) if m and m.strip()]
    for name in names:
        importlib.import_module(name.strip())
    return [n.strip() for n in names]
