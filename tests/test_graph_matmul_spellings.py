"""Hand-written attention in a user's torch module, spelled the ways torch code spells it: the scale on Q
or on K before the product (multiplied or divided), ``torch.bmm`` / ``torch.baddbmm`` on (B*H, S, D) views,
``k.mT``, scores cast to float32 before the softmax, ``exp(log_softmax)``. Exported with ``torch.export``, imported with plain
``from_exported_program``, then ``ToMixedPrecision``: each is offloaded with the native K/V heads and the
model's scale, and the rewritten graph computes what the module does."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tvm  # noqa: E402

from mqa_byoc import offload_report, partition_for_cutlass  # noqa: E402
from mqa_byoc.testing import graphs as G  # noqa: E402

H, HKV, D = 8, 2, 32


class Spelled(torch.nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k, v):
        k, v = (x.repeat_interleave(H // HKV, dim=1) for x in (k, v))
        b, h, s_q, d = q.shape
        s_kv = k.shape[2]
        if self.spelling == "q / sqrt(d)":
            scores = (q / math.sqrt(d)) @ k.transpose(-1, -2)
        elif self.spelling == "k / sqrt(d)":
            scores = q @ (k / math.sqrt(d)).transpose(-1, -2)
        elif self.spelling == "q * d**-0.5":
            scores = (q * d ** -0.5) @ k.transpose(-1, -2)
        elif self.spelling == "baddbmm":
            scores = torch.baddbmm(torch.zeros(b * h, s_q, s_kv), q.reshape(b * h, s_q, d),
                                   k.reshape(b * h, s_kv, d).transpose(1, 2), beta=0.0, alpha=d ** -0.5)
            scores = scores.view(b, h, s_q, s_kv)
        elif self.spelling == "bmm":
            scores = torch.bmm(q.reshape(b * h, s_q, d), k.reshape(b * h, s_kv, d).transpose(1, 2))
            scores = scores.view(b, h, s_q, s_kv) / math.sqrt(d)
        elif self.spelling == "mT":
            scores = torch.matmul(q, k.mT) * d ** -0.5
        elif self.spelling == "float scores":
            scores = (q @ k.transpose(-1, -2)).float() * d ** -0.5
        elif self.spelling == "exp(log_softmax)":
            return torch.exp(torch.log_softmax(q @ k.transpose(-1, -2) * d ** -0.5, -1)) @ v
        return torch.softmax(scores, -1).to(v.dtype) @ v


@pytest.mark.parametrize("spelling", ["q / sqrt(d)", "k / sqrt(d)", "q * d**-0.5", "baddbmm", "bmm", "mT",
                                      "float scores", "exp(log_softmax)"])
def test_spellings_are_offloaded_with_native_heads_and_the_scale(spelling):
    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(2, H, 8, D, generator=gen), torch.randn(2, HKV, 8, D, generator=gen),
            torch.randn(2, HKV, 8, D, generator=gen))
    mod = G.import_torch(Spelled(spelling), args)
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    # the scale on Q or K is the kernel's softmax scale, K/V reach the kernel with their own heads
    assert (site.num_q_heads, site.num_kv_heads, site.expansion) == (H, HKV, "repeat")
    assert site.scale == pytest.approx(D ** -0.5, rel=1e-3)
    part = partition_for_cutlass(mod)
    assert G.composites(part) == ["flash_attn.attention_mqa"]
    assert G.count_ops(part, "relax.divide") + G.count_ops(part, "relax.multiply") == 0  # the scale went in
    got = G.rewritten_on_cpu(mod, [a.numpy() for a in args])
    np.testing.assert_allclose(got, Spelled(spelling)(*args).numpy(), rtol=2e-2, atol=2e-2)


def test_log_probabilities_read_elsewhere_stay():
    """exp(log_softmax) is read as the softmax only where the probabilities reach a matmul; a
    log_softmax whose exp reaches none (a loss, sampling) is left as it is."""
    from tvm.script import ir as I
    from tvm.script import relax as R

    from mqa_byoc.compiler.graph.log_softmax import ExpOfLogSoftmax

    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((2, 16), "float32")):
            with R.dataflow():
                lp = R.nn.log_softmax(x, axis=-1)
                p = R.exp(lp)
                y = R.sum(p, axis=[1])
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(ExpOfLogSoftmax()(Mod), Mod)
