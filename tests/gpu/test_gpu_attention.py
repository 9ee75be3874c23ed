"""GPU A/B test of the graph-form cases of ``mqa_byoc.testing.attention_cases`` (each case defined
there once: graph, expected offload, tolerances), built by ``tools/gpu/build_forms.py`` (see README.md).

Runs with a runtime-only TVM (``tvm.relax`` absent): loads each case's libraries with
``tvm.runtime.load_module`` + ``tvm.runtime.vm.VirtualMachine``, feeds the same random inputs
(``mqa_byoc.testing.gpu_manifest.make_inputs``) and checks, per case and provider (python; native and hopper when built):

- ``mqa=True`` and ``mqa=False`` outputs match the unpartitioned TVM reference (where TVM can lower
  the graph: not for sliding windows) and an fp32 PyTorch reference built from the manifest (inputs
  in BSNH or BNSH, output BSNH, BNSH or (B, S, H*D); query head h uses K/V head h // (H / H_kv);
  causal bottom-right; scale; window);
- with ``torch.profiler`` (CUPTI): the ``mqa=True`` run launches no K/V expansion kernel (TVM kernel
  names carry the op names: repeat, broadcast_to, tile, concat, expand_dims) and no TVM copy kernel
  (native provider: no copy at all), while the ``mqa=False`` run launches the expansion kernels.

Skips, with the reason shown, when there are no artifacts or no CUDA GPU. Environment:
``MQA_BYOC_GPU_RESULTS=<file.json>`` also writes per-case errors, kernel names and timings;
``MQA_BYOC_GPU_LOAD_JOBS=N`` loads (and so nvcc-compiles) the libraries N at a time up front (default 8;
1 = lazily); ``MQA_BYOC_GPU_ARTIFACTS=<dir>`` reads the artifacts from elsewhere than ``.gpu-artifacts/tests``.
"""

from __future__ import annotations

import re

import pytest

import gpu_common as gc
from mqa_byoc.testing import attention_cases
from mqa_byoc.testing.cupti import is_attention_kernel

pytestmark = pytest.mark.gpu

EXPANSION = re.compile(r"repeat|broadcast|tile|concat|expand", re.IGNORECASE)
COPY = re.compile(r"copy|memcpy", re.IGNORECASE)


def _params():
    params = []
    for m in gc.MANIFESTS:
        stale = gc.stale_case_reason(m)
        if stale:  # artifacts of another definition of the case: fail, naming the rebuild
            params.append(pytest.param(m, None, id=f"{m['case']['name']}-stale"))
            continue
        built, skipped = gc.providers_of(m)
        for p in built:
            params.append(pytest.param(m, p, id=f"{m['case']['name']}-{p}"))
        for p, why in sorted(skipped.items()):
            params.append(pytest.param(m, p, id=f"{m['case']['name']}-{p}",
                                       marks=pytest.mark.skip(reason=f"{p} variants not built: {why}")))
    if not params:
        params.append(pytest.param(None, None, id="no-artifacts",
                                   marks=pytest.mark.skip(reason=gc.no_artifacts_reason())))
    return params


PARAMS = _params()


def _case(m) -> attention_cases.Case:
    stale = gc.stale_case_reason(m)
    if stale:
        pytest.fail(stale)
    return attention_cases.case(m["case"]["name"])


@pytest.mark.parametrize("m, provider", PARAMS)
def test_outputs_match_reference(rt, m, provider):
    tol = _case(m).tolerances()
    torch = rt.torch
    fp32 = gc.torch_reference(torch, m, rt.case_inputs(m))
    mqa = rt.run(m, f"mqa_{provider}")
    nomqa = rt.run(m, f"nomqa_{provider}")
    ref = rt.run(m, "reference") if "reference" in m["modules"] else None
    errs = {"mqa_vs_fp32": gc.max_err(mqa, fp32), "nomqa_vs_fp32": gc.max_err(nomqa, fp32),
            "mqa_vs_nomqa": gc.max_err(mqa, nomqa)}
    checks = [
        ("mqa=True vs fp32 torch", mqa, fp32, tol["fp32"]),
        ("mqa=False vs fp32 torch", nomqa, fp32, tol["fp32"]),
        ("mqa=True vs mqa=False", mqa, nomqa, tol["fp32"]),
    ]
    if ref is not None:
        errs.update(reference_vs_fp32=gc.max_err(ref, fp32), mqa_vs_reference=gc.max_err(mqa, ref),
                    nomqa_vs_reference=gc.max_err(nomqa, ref))
        checks += [
            ("mqa=True vs TVM reference", mqa, ref, tol["tvm_reference"]),
            ("mqa=False vs TVM reference", nomqa, ref, tol["tvm_reference"]),
            ("TVM reference vs fp32 torch", ref, fp32, tol["tvm_reference"]),
        ]
    record = rt.record(m, provider)
    record["max_abs_err"] = errs
    record["reference"] = m["reference"]["kind"]
    want = tuple(m["output"]["shape"])
    shapes = {"mqa": tuple(mqa.shape), "nomqa": tuple(nomqa.shape), "fp32": tuple(fp32.shape)}
    if ref is not None:
        shapes["reference"] = tuple(ref.shape)
    assert all(s == want for s in shapes.values()), f"output shapes {shapes}, manifest says {want}"
    assert torch.isfinite(mqa.float()).all() and torch.isfinite(nomqa.float()).all()
    for name, got, expected, tol in checks:
        torch.testing.assert_close(got.float(), expected.float(), **tol,
                                   msg=lambda s, n=name: f"{n} ({m['case']['name']}, {provider}, errs {errs}): {s}")


@pytest.mark.parametrize("m, provider", PARAMS)
def test_mqa_launches_no_kv_expansion(rt, m, provider):
    case = _case(m)
    try:
        mqa = rt.kernels(m, f"mqa_{provider}")
        nomqa = rt.kernels(m, f"nomqa_{provider}")
    except Exception as err:  # noqa: BLE001 - CUPTI may be unavailable
        pytest.skip(f"torch.profiler (CUPTI) could not record kernels: {type(err).__name__}: {err}")
    record = rt.record(m, provider)
    record["kernels"] = {"mqa": mqa, "nomqa": nomqa}
    record["time_us"] = {"mqa": rt.time_us(m, f"mqa_{provider}"), "nomqa": rt.time_us(m, f"nomqa_{provider}")}
    backend = rt.providers.active_backend().name if provider == "python" else "native"
    if backend == "torch" and m["attention"].get("softcap"):
        pytest.skip("python provider, torch backend: soft-capped attention runs as plain PyTorch ops (PyTorch's FA2 "
                    "has no soft-capping), not an attention kernel of ours; its numerics are checked above")
    for variant, kernels in (("mqa", mqa), ("nomqa", nomqa)):
        # hopper: FA4's sm90 kernel runs every call it can (built with kernel_options hopper_fa4="always", tools/gpu/bundle.py)
        if m.get("fa4_expected", {}).get(f"{variant}_{provider}"):
            assert any("FlashAttentionForwardSm90" in n for n in kernels), \
                f"hopper provider, {variant}: no FA4 sm90 kernel launched: {kernels}"
    record["backend"] = backend

    assert mqa, "no CUDA activity recorded for the mqa=True run"
    assert any(is_attention_kernel(n) for n in mqa), f"no attention kernel of ours in the mqa=True run: {mqa}"
    expansions = [n for n in mqa if EXPANSION.search(n)]
    if m["attention"].get("chunk"):  # a chunked mask's blocks: their outputs concatenated, not K/V
        expansions = [n for n in expansions if "concatenate" not in n]
    assert not expansions, f"mqa=True launched K/V expansion kernels: {expansions}"
    # TVM's kernels are named after their PrimFunc (no C++ namespace): none may copy.
    tvm_kernels = [n for n in mqa if "::" not in n and not n.lower().startswith(("memcpy", "memset"))]
    tvm_copies = [n for n in tvm_kernels if COPY.search(n)]
    assert not tvm_copies, f"mqa=True launched TVM copy kernels: {tvm_copies}"
    if backend == "native":
        copies = [n for n in mqa if COPY.search(n)]
        assert not copies, f"mqa=True with the native provider copied: {copies}"
    # The torch / flash_attn backends copy Q/O, never K/V: the result into TVM's output buffer (ATen
    # has no out= variant of _flash_attention_forward) and, for grouped decode, FA2's own reshape of the
    # swapped output. Those are recorded in the results, not asserted.

    assert any(is_attention_kernel(n) for n in nomqa), f"no attention kernel of ours in the mqa=False run: {nomqa}"
    if case.nomqa_expands_kv:
        assert any(EXPANSION.search(n) for n in nomqa), f"mqa=False launched no K/V expansion kernel: {nomqa}"
