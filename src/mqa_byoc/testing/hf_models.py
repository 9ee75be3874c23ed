"""The random-weight HF decoders of the HF GPU tests, defined once: each model's config (:class:`HFModel`,
:data:`MODELS`), its weights from a seed (:func:`build_models`) and the PyTorch eager reference run through
the same wrapper ``import_hf`` exports (:func:`eager`).

``tools/gpu/build_hf.py`` (and ``build_hf_standard.py``) build libraries and references from them;
``tests/gpu/test_hf_reference_cpu.py`` rebuilds a model from its manifest and checks the stored
weights and references. Needs torch and transformers (CPU is enough).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np

SCORE_STD = 2.5  # std of q.k / sqrt(D) for unit-RMS inputs: q/k projection std = sqrt(SCORE_STD / hidden)
INIT_STD = 0.02  # build_hf_model's default

@dataclass(frozen=True)
class HFModel:
    name: str
    kind: str  # "llama" | "mistral"
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    layers: int
    window: int | None
    rope_theta: float
    batch: int
    seq_len: int
    note: str

    def config(self):
        from mqa_byoc.models import hf

        return hf.make_hf_config(self.kind, hidden_size=self.hidden, num_heads=self.heads,
                                 num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                                 intermediate_size=self.intermediate, vocab_size=self.vocab,
                                 num_layers=self.layers, rope_theta=self.rope_theta, sliding_window=self.window,
                                 attn_implementation="eager")


MODELS = [
    HFModel("llama3_gqa", "llama", heads=32, kv_heads=8, head_dim=128, hidden=256, intermediate=512, vocab=1024,
            layers=2, window=None, rope_theta=500000.0, batch=2, seq_len=256,
            note="Llama-3-8B attention (32 query heads, 8 K/V heads, head dim 128), small hidden/MLP/vocab"),
    HFModel("mistral_mqa_window", "mistral", heads=32, kv_heads=1, head_dim=128, hidden=128, intermediate=256,
            vocab=1024, layers=2, window=64, rope_theta=10000.0, batch=2, seq_len=256,
            note="Mistral architecture with MQA (1 K/V head) and a 64-token sliding window"),
]


def build_models(spec: HFModel, seed: int):
    """(fp16 model, float32 copy with the same fp16-rounded weights, q/k projection std)."""
    import torch

    from mqa_byoc.models import hf

    m16 = hf.build_hf_model(spec.config(), dtype="float16", seed=seed, std=INIT_STD)
    qk_std = math.sqrt(SCORE_STD / spec.hidden)
    with torch.no_grad():
        for name, p in m16.named_parameters():
            if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                p.copy_((p.float() * (qk_std / INIT_STD)).to(p.dtype))
    m32 = copy.deepcopy(m16).float()
    return m16, m32, qk_std


def eager(model, mode: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """``model`` run by import_hf's own export wrapper (so exactly the exported function), float32
    numpy outputs: ``[logits, k_0, v_0, ...]``."""
    import torch

    from mqa_byoc.models import hf

    wrapper = hf.export_wrapper(model, mode, model.config.num_hidden_layers, True).eval()
    dt = next(model.parameters()).dtype
    args = [torch.from_numpy(np.ascontiguousarray(inputs[0]))]
    args += [torch.from_numpy(np.ascontiguousarray(a)).to(dt) for a in inputs[1:]]
    with torch.no_grad():
        out = wrapper(*args)
    return [o.float().numpy() for o in out]


def eager_deterministic(model, mode, inputs) -> list[np.ndarray]:
    a, b = eager(model, mode, inputs), eager(model, mode, inputs)
    if not all(np.array_equal(x, y) for x, y in zip(a, b)):
        raise RuntimeError(f"{mode}: two eager runs of the same model on the same inputs differ")
    return a
