"""CPU checks of the GPU harness itself (no GPU needed; they run where the full TVM and torch are).

- the fp32 PyTorch reference of the GPU runner (``gpu_common.torch_reference``), fed with the
  manifest's layouts, equals TVM's own CPU build of the unpartitioned graph for cases with BNSH inputs,
  a BNSH output and a (B, S, H*D) output, chunked causal and symbolic lengths;
- the artifact manifests, where built, are consistent (shapes, layouts, files, function names).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import gpu_common as gc
from mqa_byoc.testing import attention_cases as ac
from mqa_byoc.testing import gpu_manifest as gi

HERE = Path(__file__).resolve().parent
CPU_CASES = [
    "bnsh_gqa_bf16_noncausal",  # BNSH in and out
    "hf_gqa_f16_causal",  # BNSH in, (B, S, H*D) out
    "mlc4d_gqa_bf16_add_chunked",  # BSNH in, (B, S, H*D) out, bottom-right causal with S_q < S_kv
    "mlc4d_gqa_bf16_add_chunked_mask_past",  # a chunked mask (blocks of 64), queries from inside a block
    "fewer_mqa_f16_decode_sym",  # symbolic S_kv, H_kv = 1
    "bsh_f16_causal_chunked",  # (B, S, D) in and out, one head
    "onnx_gqa_f16_causal_chunked",  # TVM's ONNX frontend, BNSH in and out, bottom-right causal with S_q < S_kv
    "nn_reshape_broadcast_gqa_f16_causal_sym",  # relax.frontend.nn's spelling, TopLeft, symbolic S
    "sink_gptoss_f16_hdim64_window_chunked",  # attention sinks (float32), a window, S_q < S_kv
    "multihead_seq_first_f16_noncausal_cross",  # (S, B, H*D) in and out, sequence first, S_q < S_kv
    "sink_gqa_bf16_causal_prefill_sinks_bf16",  # attention sinks in the model's dtype
    "sinkout_granite_f16_hdim64_window_chunked",  # the sinks applied after attention (GraniteSWA)
    "einsum_bshd_gqa_f16_causal_chunked",  # torch.einsum through torch.export, BSNH, float32 result
    "einsum_bhsd_gqa_f16_causal_prefill",  # the same, BNSH
    "einsum_palm_mqa_f16_causal_prefill",  # PaLM-style multi-query einsum: K/V (B, S, D), heads folded into rows
    "grouped5d_gqa_bf16_noncausal",  # the query viewed as (B, H_kv, G, S, D), no K/V expansion op
    "mla_f16_d128_dv64_causal_prefill",  # V's head dim smaller than Q/K's
    "mla_f16_d64_dv32_noncausal_sym",  # the same, symbolic S
]


def _full_tvm_and_torch():
    if not gc.full_tvm():
        pytest.skip("needs the full TVM (tvm.relax): this is a runtime-only TVM")
    return pytest.importorskip("torch", reason="needs torch (CPU is enough)")


@pytest.mark.parametrize("name", CPU_CASES)
def test_torch_reference_matches_tvm_on_cpu(name):
    torch = _full_tvm_and_torch()
    import tvm

    from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention

    case = ac.case(name)
    mod = ac.build_graph(case)
    inputs, output = ac.describe_io(case, mod)
    m = {"case": {"name": case.name}, "seed": 0, "inputs": inputs, "output": output, "attention": case.attention()}
    arrays = gi.make_inputs(m)
    ex = tvm.compile(LegalizeGroupedAttention()(mod), target="llvm")
    vm = tvm.runtime.vm.VirtualMachine(ex, tvm.cpu())
    args = []
    for spec, arr in zip(inputs, arrays):
        if spec["dtype"] == "bfloat16":
            args.append(tvm.runtime.empty(arr.shape, "bfloat16", tvm.cpu()).copyfrom(arr))
        else:
            args.append(tvm.runtime.tensor(arr, tvm.cpu()))
    got = vm["main"](*args).numpy()
    got = gi.as_float32(got.view(np.uint16), "bfloat16") if output["dtype"] == "bfloat16" else got.astype(np.float32)
    want = gc.torch_reference(torch, m, gc.torch_inputs(torch, m, "cpu")).numpy()
    assert got.shape == want.shape == tuple(output["shape"])
    tol = 1e-1 if output["dtype"] == "bfloat16" else 3e-2  # TVM computes in the input dtype
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_mask_conventions():
    torch = pytest.importorskip("torch", reason="needs torch (CPU is enough)")
    keep = gc.attention_mask(torch, 2, 5, "BottomRight", None)
    assert keep.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    keep = gc.attention_mask(torch, 2, 5, "TopLeft", None)
    assert keep.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    keep = gc.attention_mask(torch, 3, 6, "BottomRight", 2)  # w keys including the diagonal
    assert keep.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]
    keep = gc.attention_mask(torch, 1, 6, None, 3)  # decode with a window
    assert keep.tolist() == [[0, 0, 0, 1, 1, 1]]


def test_layout_round_trip():
    torch = pytest.importorskip("torch", reason="needs torch (CPU is enough)")
    x = torch.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    assert torch.equal(gc.to_bsnh(x, "BNSH"), x.permute(0, 2, 1, 3))
    assert gc.to_bsnh(x, "BSNH") is x
    assert torch.equal(gc.to_bsnh(x[:, :, 0], "BSH"), x[:, :, :1])  # (B, S, D) is one head
    sbe = x.permute(1, 0, 2, 3).reshape(3, 2, 4 * 5)  # (S, B, H*D): sequence first, heads merged
    assert torch.equal(gc.to_bsnh(sbe, "SBE", heads=4), x)


def test_bfloat16_rounding():
    x = np.array([1.0, 1.00390625, 1.0078125, -2.5, 3.1415927, 1e-3], dtype=np.float32)
    bits = gi.float32_to_bfloat16_bits(x)
    back = gi.bfloat16_bits_to_float32(bits)
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: nearest even is 1
    assert back.tolist()[:4] == [1.0, 1.0, 1.0078125, -2.5]
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0**-8)


@pytest.mark.skipif(not gc.MANIFESTS, reason=gc.no_artifacts_reason())
def test_manifests_are_consistent():
    problems = []
    for m in gc.MANIFESTS:
        name = m["case"]["name"]
        if m.get("format") != gi.MANIFEST_FORMAT:
            problems.append(f"{name}: manifest format {m.get('format')}, expected {gi.MANIFEST_FORMAT}: rebuild")
            continue
        stale = gc.stale_case_reason(m)
        if stale:
            problems.append(stale)
        att, out = m["attention"], m["output"]
        for spec in m["inputs"]:
            if spec["layout"] == "H":  # attention sinks: one logit per query head
                if not att.get("sinks") or spec["shape"] != [att["num_q_heads"]]:
                    problems.append(f"{name}: input {spec} vs attention {att}")
                continue
            heads = att["num_q_heads"] if spec["name"] == "q" else att["num_kv_heads"]
            shape = spec["shape"][:2] + [1] + spec["shape"][2:] if spec["layout"] == "BSH" else spec["shape"]
            if spec["layout"] == "SBE":  # (S, B, H*D): sequence first, the heads merged
                shape = [spec["shape"][1], spec["shape"][0], heads, spec["shape"][2] // heads]
            hax = 1 if spec["layout"] == "BNSH" else 2
            head_dim = att.get("head_dim_v", att["head_dim"]) if spec["name"] == "v" else att["head_dim"]
            if len(shape) != 4 or shape[hax] != heads or shape[3] != head_dim:
                problems.append(f"{name}: input {spec} vs attention {att}")
        b, sq, h, d = out["batch"], out["seq_q"], att["num_q_heads"], att.get("head_dim_v", att["head_dim"])
        want = [b, sq, h * d] if out["heads_merged"] else ([b, sq, h, d] if out["layout"] == "BSNH" else [b, h, sq, d])
        if out["layout"] == "SBE":
            want = [sq, b, h * d]
        if out["shape"] != want:
            problems.append(f"{name}: output {out}, expected shape {want}")
        if ("reference" in m["modules"]) != (m["reference"]["kind"] == "tvm"):
            problems.append(f"{name}: reference module vs {m['reference']}")
        if att["window"] is None and not att.get("sinks") and "reference" not in m["modules"]:
            problems.append(f"{name}: no TVM reference although TVM can lower it")
        for key in m["modules"]:
            path = gi.module_path(m, key)
            if not os.path.isfile(path):
                problems.append(f"{name}: {key} -> {path} missing")
        for key in ("mqa_native", "nomqa_native"):
            if key in m["modules"] and gi.function_name(m, key) == "main":
                problems.append(f"{name}: {key} is in a bundle but has no function name")
        built, skipped = gc.providers_of(m)
        if "python" not in built:
            problems.append(f"{name}: no python-provider variants")
    assert not problems, "\n".join(problems)


def test_standalone_child_on_cpu(tmp_path):
    """The child of test_native_standalone.py, on a CPU build of two cases (fp16 BNSH, bf16 (B, S, H*D)):
    torch and mqa_byoc stay unimportable in it, and its outputs equal the fp32 reference."""
    import json
    import subprocess

    torch = _full_tvm_and_torch()
    import tvm
    from tvm import relax

    from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention

    funcs, calls, manifests = {}, [], {}
    for name in ("fewer_mqa_f16_decode_sym", "mlc4d_gqa_bf16_add_chunked"):
        case = ac.case(name)
        mod = LegalizeGroupedAttention()(ac.build_graph(case))
        inputs, output = ac.describe_io(case, mod)
        m = {"case": {"name": name}, "seed": 3, "inputs": inputs, "output": output, "attention": case.attention()}
        (tmp_path / f"{name}.json").write_text(json.dumps(m))
        manifests[name] = m
        funcs[relax.GlobalVar(name)] = mod["main"].with_attr("global_symbol", name)
        calls.append({"manifest": str(tmp_path / f"{name}.json"), "function": name,
                      "out": str(tmp_path / f"{name}.npy")})
    tvm.compile(tvm.IRModule(funcs), target="llvm").export_library(str(tmp_path / "lib.so"))
    job = {"library": str(tmp_path / "lib.so"), "result": str(tmp_path / "result.json"), "calls": calls,
           "device": "cpu"}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k != "TVM_USE_RUNTIME_LIB"}
    proc = subprocess.run([sys.executable, str(HERE / "native_standalone_child.py"), str(tmp_path / "job.json")],
                          capture_output=True, text=True, env=env, timeout=600)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["error"] is None and proc.returncode == 0, result["error"] or proc.stderr[-3000:]
    assert not result["imported_blocked"] and "torch" not in result["modules"], result
    for name, m in manifests.items():
        got = np.load(tmp_path / f"{name}.npy")
        want = gc.torch_reference(torch, m, gc.torch_inputs(torch, m, "cpu")).numpy()
        tol = 1e-1 if m["output"]["dtype"] == "bfloat16" else 3e-2
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_stale_case_definitions_are_named():
    """A manifest records its case's definition; the GPU tests fail on one built from another definition."""
    case = ac.case("fewer_gqa_f16_causal_chunked")
    m = {"case": case.as_dict()}
    assert gc.stale_case_reason(m) is None
    older = {k: v for k, v in case.as_dict().items() if k != "tolerance"}  # written before the field existed
    assert gc.stale_case_reason({"case": older}) is None
    changed = dict(case.as_dict(), kwargs=dict(case.kwargs, s=65))
    assert "another definition" in gc.stale_case_reason({"case": changed})
    assert "does not define" in gc.stale_case_reason({"case": dict(case.as_dict(), name="gone")})
