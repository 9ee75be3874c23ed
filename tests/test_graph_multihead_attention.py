"""``torch.nn.MultiheadAttention`` (and the encoder / decoder layers built on it) exported with
``torch.export``, imported with plain ``from_exported_program`` and cast by ``ToMixedPrecision``.

Its functional form works sequence-first whatever ``batch_first`` says: the projections are (S, B, E), each
reshaped to (S, B*H, D) with the heads folded into the batch, transposed to (B*H, S, D) and viewed as
(B, H, S, D) before SDPA's decomposition. The analysis reads such an operand as (S, B, H, D) and the
rewrite transposes it to (B, S, H, D) for the kernels (a copy TVM makes: the kernels read batch-first
operands only). Offloaded, it gives the module's output; with ``need_weights=True`` (the module's default)
TVM still computes the probabilities it returns. A padding mask stays on TVM with the reason."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mqa_byoc import offload_report, partition_for_cutlass  # noqa: E402
from mqa_byoc.testing import graphs as G  # noqa: E402

E, H, S, B = 128, 4, 12, 2
D = E // H


class SelfAttention(torch.nn.Module):
    def __init__(self, batch_first, need_weights=False, causal=False, padding=False):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(E, H, batch_first=batch_first)
        self.need_weights, self.causal, self.padding = need_weights, causal, padding

    def forward(self, x):
        kw = {}
        if self.causal:
            kw["attn_mask"] = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1 if self.attn.batch_first else 0])
        if self.padding:
            kw["key_padding_mask"] = x[..., 0] > 1.0 if self.attn.batch_first else (x[..., 0] > 1.0).T
        return self.attn(x, x, x, need_weights=self.need_weights, **kw)[0]


class CrossAttention(torch.nn.Module):
    """Queries of one sequence against keys and values of another (an encoder's output), with their own
    key / value widths (``kdim``, ``vdim``: separate projections instead of the packed one)."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(E, H, kdim=96, vdim=80, batch_first=True)

    def forward(self, x, memory_k, memory_v):
        return self.attn(x, memory_k, memory_v, need_weights=False)[0]


def _peaked(model):
    """The query projection scaled up, so that a wrong scale or a wrong head pairing moves the output
    beyond the tolerance (with the default init the probabilities are nearly uniform)."""
    with torch.no_grad():
        if model.attn._qkv_same_embed_dim:
            model.attn.in_proj_weight[:E] *= 4
        else:
            model.attn.q_proj_weight *= 4
    return model


def _input(batch_first, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((B, S, E) if batch_first else (S, B, E), generator=g)


def _check_offloaded(mod, model, inputs, causal=None, reference_only=False):
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.causal) == (H, H, D, causal)
    assert "Q, K, V are sequence-first" in site.note and "transposed to batch-first" in site.note
    assert site.scale == pytest.approx(D ** -0.5, rel=1e-3)
    out = partition_for_cutlass(mod)
    assert G.composites(out) == ["flash_attn.attention"]
    assert G.count_ops(out, "relax.nn.softmax") == 0
    with torch.no_grad():
        want = model(*inputs).numpy()
    # reference_only: TVM 0.27 cannot build the unrewritten graph for the CPU (legalizing the R.full of
    # torch's causal mask fails), so the rewritten one is compared with the module alone
    got = G.rewritten_on_cpu(mod, [x.numpy() for x in inputs], reference=want if reference_only else None)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    return site


@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
def test_multihead_attention_is_offloaded(batch_first):
    torch.manual_seed(0)
    model = _peaked(SelfAttention(batch_first).eval())
    x = _input(batch_first)
    _check_offloaded(G.import_torch(model, (x,)), model, (x,))


def test_multihead_attention_with_causal_mask_is_offloaded_causal():
    torch.manual_seed(1)
    model = _peaked(SelfAttention(True, causal=True).eval())
    x = _input(True, seed=1)
    _check_offloaded(G.import_torch(model, (x,)), model, (x,), causal="BottomRight", reference_only=True)


def test_multihead_cross_attention_with_own_key_and_value_widths_is_offloaded():
    torch.manual_seed(2)
    model = _peaked(CrossAttention().eval())
    g = torch.Generator().manual_seed(2)
    x, mk, mv = torch.randn(B, S, E, generator=g), torch.randn(B, 20, 96, generator=g), torch.randn(B, 20, 80, generator=g)
    _check_offloaded(G.import_torch(model, (x, mk, mv)), model, (x, mk, mv))


def test_transformer_encoder_layer_attention_is_offloaded():
    torch.manual_seed(3)
    layer = torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=256, dropout=0.0, batch_first=True).eval()
    with torch.no_grad():
        layer.self_attn.in_proj_weight[:E] *= 4
    x = _input(True, seed=3)
    mod = G.import_torch(layer, (x,))
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim) == (H, H, D)
    with torch.no_grad():
        want = layer(x).numpy()
    np.testing.assert_allclose(G.rewritten_on_cpu(mod, [x.numpy()]), want, rtol=2e-2, atol=2e-2)


def test_multihead_attention_returning_its_weights_is_offloaded_and_keeps_the_weights():
    """With ``need_weights=True`` the module also returns the probabilities averaged over the heads: the
    output's attention is offloaded and TVM still computes the probabilities for that second output."""
    torch.manual_seed(4)
    model = _peaked(SelfAttention(True, need_weights=True).eval())

    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner.attn(x, x, x, need_weights=True)

    both = Both().eval()
    x = _input(True, seed=4)
    mod = G.import_torch(both, (x,))
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    out = partition_for_cutlass(mod)
    assert G.composites(out) == ["flash_attn.attention"]
    assert G.count_ops(out, "relax.nn.softmax") == 1  # the weights' own
    from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
    from mqa_byoc.compiler.partition import canonicalize_attention
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(relax.build(LegalizeGroupedAttention()(canonicalize_attention(mod)), target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x.numpy()))
    with torch.no_grad():
        want_out, want_weights = both(x)
    np.testing.assert_allclose(got[0].numpy(), want_out.numpy(), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(got[1].numpy(), want_weights.numpy(), rtol=2e-2, atol=2e-2)


def test_multihead_attention_with_padding_mask_stays_on_tvm_with_the_reason():
    model = SelfAttention(True, padding=True).eval()
    x = _input(True)
    mod = G.import_torch(model, (x,))
    sites = offload_report(mod)
    assert sites and not any(s.offloaded for s in sites)
    assert all(s.reason for s in sites)
    assert "mask depends on the runtime input" in sites[0].reason
    assert G.composites(partition_for_cutlass(mod)) == []


class SeqFirstSinks(torch.nn.Module):
    """GPT-OSS's attention sinks (a learned logit per head in each row's softmax) on sequence-first operands
    viewed the way nn.MultiheadAttention views them: no kernel of ours takes that combination."""

    def __init__(self):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(H))

    def forward(self, q, k, v):
        n, b, _ = q.shape
        q, k, v = (x.view(x.shape[0], b * H, D).transpose(0, 1).view(b, H, x.shape[0], D) for x in (q, k, v))
        s = q @ k.transpose(-1, -2) * D ** -0.5
        s = torch.cat([s, self.sinks.view(1, H, 1, 1).expand(b, H, n, 1)], dim=-1)
        p = (s - s.max(-1, keepdim=True).values).softmax(-1)[..., :-1]
        return (p @ v).permute(2, 0, 1, 3).reshape(n, b, E)


def test_sinks_on_sequence_first_operands_stay_on_tvm_naming_the_layout():
    model = SeqFirstSinks().eval()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(S, B, E, generator=g) for _ in range(3))
    mod = G.import_torch(model, (q, k, v))
    (site,) = offload_report(mod)
    assert not site.offloaded
    assert "sequence-first" in site.reason and "sinks" in site.reason, site.reason
    assert G.composites(partition_for_cutlass(mod)) == []


class BatchFirstSinks(SeqFirstSinks):
    """The same sinks chain on batch-first operands: ToMixedPrecision binds one cast of the concatenated
    logits for the row max and another for the subtraction; the shift is still read as the row's own."""

    def forward(self, q, k, v):
        b, n, _ = q.shape
        q, k, v = (x.view(b, x.shape[1], H, D).transpose(1, 2) for x in (q, k, v))
        s = q @ k.transpose(-1, -2) * D ** -0.5
        s = torch.cat([s, self.sinks.view(1, H, 1, 1).expand(b, H, n, 1)], dim=-1)
        p = (s - s.max(-1, keepdim=True).values).softmax(-1)[..., :-1]
        return (p @ v).transpose(1, 2).reshape(b, n, E)


def test_sinks_with_a_cast_per_reader_are_offloaded():
    torch.manual_seed(6)
    model = BatchFirstSinks().eval()
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(B, S, E, generator=g) for _ in range(3))
    q = q * 4  # peaked: a wrong scale or sink weight moves the output
    mod = G.import_torch(model, (q, k, v))
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert site.composite == "flash_attn.attention_sink"
    with torch.no_grad():
        want = model(q, k, v).numpy()
    np.testing.assert_allclose(G.rewritten_on_cpu(mod, [q.numpy(), k.numpy(), v.numpy()]), want, rtol=2e-2, atol=2e-2)


def test_transformer_decoder_layer_self_and_cross_attention_are_offloaded():
    """``nn.TransformerDecoderLayer``: causal self-attention (torch's square subsequent mask) and
    cross-attention over an encoder's memory of another length, both offloaded."""
    torch.manual_seed(7)
    layer = torch.nn.TransformerDecoderLayer(E, H, dim_feedforward=256, dropout=0.0, batch_first=True).eval()
    with torch.no_grad():
        layer.self_attn.in_proj_weight[:E] *= 4
        layer.multihead_attn.in_proj_weight[:E] *= 4

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x, memory):
            mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            return self.layer(x, memory, tgt_mask=mask, tgt_is_causal=True)

    model = Decoder().eval()
    g = torch.Generator().manual_seed(7)
    x, memory = torch.randn(B, S, E, generator=g), torch.randn(B, 20, E, generator=g)
    mod = G.import_torch(model, (x, memory))
    sites = offload_report(mod)
    assert [(s.offloaded, s.causal, s.num_q_heads, s.num_kv_heads) for s in sites] == [
        (True, "BottomRight", H, H), (True, None, H, H)], [s.reason for s in sites]
    assert G.composites(partition_for_cutlass(mod)) == ["flash_attn.attention"] * 2
    with torch.no_grad():
        want = model(x, memory).numpy()
    # TVM 0.27 cannot build the unrewritten graph for the CPU (the R.full of the causal mask)
    got = G.rewritten_on_cpu(mod, [x.numpy(), memory.numpy()], reference=want)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_multihead_attention_with_symbolic_batch_and_length_is_offloaded():
    """Exported with a dynamic batch and sequence length: the heads folded into the symbolic batch still
    split off the projection's width (B*H / B proves to H)."""
    torch.manual_seed(8)
    model = _peaked(SelfAttention(True).eval())
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=512)
    mod = G.import_torch(model, (_input(True),), dynamic_shapes=({0: batch, 1: seq},))
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim) == (H, H, D)
    x = torch.randn(3, 17, E, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(G.rewritten_on_cpu(mod, [x.numpy()]), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("extra", ["add_bias_kv", "add_zero_attn"])
def test_multihead_attention_with_appended_key_rows_is_offloaded(extra):
    """``add_bias_kv`` appends a learned K/V row to the (S, B, E) projections, ``add_zero_attn`` a zero row
    to the (B*H, S, D) ones (read through the (B, H, S + 1, D) view the module makes of them)."""
    torch.manual_seed(9)
    attn = torch.nn.MultiheadAttention(E, H, batch_first=True, **{extra: True}).eval()
    with torch.no_grad():
        attn.in_proj_weight[:E] *= 4

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    model = Module().eval()
    x = _input(True, seed=9)
    mod = G.import_torch(model, (x,))
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.causal) == (H, H, D, None)
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(G.rewritten_on_cpu(mod, [x.numpy()]), want, rtol=2e-2, atol=2e-2)
