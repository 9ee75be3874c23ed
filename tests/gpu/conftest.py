"""Fixtures of the GPU tests (tests/gpu): one TVM runtime per session, shared by the test files."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # gpu_common, the GPU tests' own helpers

import gpu_common  # noqa: E402

# The hopper provider's test libraries run FA4 on every call it can compute (not only prefill-sized
# ones), so that the small test shapes exercise the FA4 objects: tools/gpu/bundle.py builds them with
# the kernel option hopper_fa4="always" (compiled into the library; nothing to set here).


@pytest.fixture(scope="session")
def rt(request):
    reason = gpu_common.skip_reason()
    if reason:
        pytest.skip(reason)
    standalone = None
    libraries = gpu_common.native_libraries()
    if libraries and any("test_native_standalone" in item.nodeid for item in request.session.items):
        standalone = gpu_common.StandaloneRuns(libraries)  # in parallel with the loads below
    runtime = gpu_common.Runtime(pytest.fail)
    runtime.standalone = standalone
    runtime.results["_session"] = {"load_seconds": runtime.load_seconds, "libraries": len(runtime.libs)}
    yield runtime
    if standalone is not None:
        standalone.close()
    out = os.environ.get("MQA_BYOC_GPU_RESULTS")
    if out:
        Path(out).write_text(json.dumps(runtime.results, indent=2) + "\n")
