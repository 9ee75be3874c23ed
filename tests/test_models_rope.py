"""The decoder's split of the fused qkv projection and RoPE as one TIR kernel (``mqa_byoc.models.rope``):
the same values as the Relax-op form (split, reshapes, ``x * cos + rotate_half(x) * sin``) on the CPU,
element for element in float16 and float32, at long positions and symbolic offsets; one CUDA kernel where
the ops form builds five; and what it takes off a decode step of the in-place decoder's CUDA build.
CPU only (the CUDA builds are source, not run)."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402
from tvm.relax.frontend import nn  # noqa: E402
from tvm.relax.frontend.nn import spec  # noqa: E402

from mqa_byoc.models import rope  # noqa: E402

H, HKV, D, THETA = 8, 2, 64, 500000.0


def _module(fused: bool, dtype: str, heads=(H, HKV, D)):
    h, hkv, d = heads

    class Split(nn.Module):
        def forward(self, qkv, past):
            offset = past.shape[0]  # a symbolic position, as the decoders' cached length
            if fused:
                return rope.split_rope(qkv, offset, h, hkv, d, THETA)
            return rope.rope_ops(qkv, rope.rope_tables(offset, qkv.shape[1], d, THETA, dtype), h, hkv, d)

    mod, _ = Split().export_tvm({"forward": {"qkv": spec.Tensor(["b", "s", (h + 2 * hkv) * d], dtype),
                                             "past": spec.Tensor(["p"], "int8")}})
    return mod


def _run(mod, x, offset):
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    out = vm["forward"](tvm.runtime.tensor(x), tvm.runtime.tensor(np.zeros(offset, "int8")))
    return [o.numpy() for o in out]


def _numpy_rope(x, offset, heads=(H, HKV, D)):
    """RoPE of q and k in float64 from float32 angles (positions times inverse frequencies, rounded to
    float32 as the graph computes them: at 16k the angle's own rounding is ~1e-3), v as it is."""
    h, hkv, d = heads
    b, s, _ = x.shape
    x = x.astype(np.float64).reshape(b, s, h + 2 * hkv, d)
    angle = np.arange(offset, offset + s, dtype=np.float32)[:, None] * rope.inv_freq(d, THETA)[None, :]
    angle = angle.astype(np.float64)
    angle = np.concatenate([angle, angle], axis=-1)[None, :, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    y = x * np.cos(angle) + rot * np.sin(angle)
    return y[:, :, :h], y[:, :, h:h + hkv], x[:, :, h + hkv:]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("batch,seq,offset", [(1, 1, 16383), (2, 5, 0), (1, 3, 2047), (3, 4, 4093)])
def test_kernel_equals_the_ops_form(dtype, batch, seq, offset):
    x = np.random.default_rng(offset + seq).standard_normal((batch, seq, (H + 2 * HKV) * D)).astype(dtype)
    got = _run(_module(True, dtype), x, offset)
    want = _run(_module(False, dtype), x, offset)
    for g, w, shape in zip(got, want, [(batch, seq, n, D) for n in (H, HKV, HKV)]):
        assert g.shape == w.shape == shape
        np.testing.assert_array_equal(g, w)  # the same roundings, element for element
    # and both are RoPE: against float64 within the dtype's rounding of cos, sin, products and sum
    tol = {"float16": 8e-3, "float32": 2e-5}[dtype] * float(np.abs(x).max())
    for g, r in zip(got, _numpy_rope(x, offset)):
        np.testing.assert_allclose(g.astype(np.float64), r, rtol=0, atol=tol)
    np.testing.assert_array_equal(got[2], x.reshape(batch, seq, H + 2 * HKV, D)[:, :, H + HKV:])


def test_kernel_in_bfloat16_is_rope():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.random.default_rng(1).standard_normal((1, 2, (H + 2 * HKV) * D)).astype(ml_dtypes.bfloat16)
    got = _run(_module(True, "bfloat16"), x, 4095)
    for g, r in zip(got, _numpy_rope(x.astype(np.float32), 4095)):
        np.testing.assert_allclose(g.astype(np.float64), r, rtol=0, atol=0.08 * float(np.abs(r).max()))


def test_odd_head_dim_is_refused():
    with pytest.raises(ValueError, match="even head dim"):
        rope.split_rope_func(4, 2, 63, "float16")


def _cuda_kernels(mod):
    """Names of the CUDA kernels in ``mod``'s build (TVM 0.27 keeps them as source: no nvcc, no GPU)."""
    from mqa_byoc.compiler.pipeline import cuda_decoder_pipeline

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    ex = tvm.compile(mod, target=target, relax_pipeline=cuda_decoder_pipeline(target))
    names = set()

    def walk(m):
        try:
            names.update(re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(", m.inspect_source()))
        except Exception:  # modules without source (the host's)
            pass
        for i in m.imports:
            walk(i)

    walk(ex.mod)
    return names



def test_one_cuda_kernel_where_the_ops_form_builds_several():
    fused = _cuda_kernels(_module(True, "float16"))
    ops = _cuda_kernels(_module(False, "float16"))
    assert fused == {"split_rope_kernel"}, fused
    # three for the split (one per output), one RoPE each for q and k, and the cos / sin tables' own
    assert len([n for n in ops if n.startswith("split_kernel")]) == 3, sorted(ops)
    assert len([n for n in ops if "negative" in n]) == 2, sorted(ops)
    assert {n for n in ops if "_cos_" in n or "_sin_" in n} == {"fused_tir_cos_cast_kernel", "fused_tir_sin_cast_kernel"}


def _launches(mod, target) -> Counter:
    """Kernel launches of one call of ``mod``'s decode through TVM's CUDA pipeline, by kernel: each TIR
    function the lowered decode calls launches its kernels (``<name>_kernel``, ``<name>_kernel_1``, ...
    in the CUDA source: dlight's fallback gives a function of several output blocks one kernel each)."""
    from mqa_byoc.compiler.pipeline import cuda_decoder_pipeline

    with target:
        lowered = cuda_decoder_pipeline(target)(mod)
    kernels = _cuda_kernels(mod)
    launches = Counter()
    for block in lowered["decode"].body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and isinstance(v.op, relax.GlobalVar):
                for k in kernels:
                    if re.fullmatch(rf"{re.escape(v.op.name_hint)}_kernel(_\d+)?", k):
                        launches[k] += 1
    return launches


def test_inplace_decode_step_launches_fewer_kernels():
    """The in-place decoder's decode through TVM's CUDA pipeline: one split_rope launch a layer where the
    ops form launched three split kernels and two RoPE kernels a layer and three for the cos / sin tables."""
    from mqa_byoc.models.llama import build_decoder
    from mqa_byoc.models.presets import scaled

    cfg = scaled("codellama-34b", num_layers=2, vocab_size=64, hidden_size=128, intermediate_size=64)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    fused, ops = (_launches(build_decoder(cfg, kv_cache="inplace", functions=("decode",), fused_rope=f)[0], target)
                  for f in (True, False))
    assert fused["split_rope_kernel"] == cfg.num_layers
    assert sum(n.startswith("split_kernel") for n in ops.elements()) == 3 * cfg.num_layers, ops
    assert not [n for n in fused if n.startswith("split_kernel") or "negative" in n or "_cos_" in n], fused
    assert sum(ops.values()) - sum(fused.values()) == 4 * cfg.num_layers + 3, (ops, fused)
