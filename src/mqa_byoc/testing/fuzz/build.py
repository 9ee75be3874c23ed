"""A ``GraphSpec`` as a Relax module, its random inputs, and a NumPy reference of every site.

The module's function ``main`` takes the query of every site (``q{i}``), the K/V of every group
(``k{g}``/``v{g}``, or ``kp{g}``/``kn{g}``/``vp{g}``/``vn{g}`` for a KV-cache concat) and any runtime
mask or bias (``m{i}``), and returns the tuple of site outputs. Each site's attention result is bound
to ``root{i}`` (the ``R.nn.attention`` call or the chain's last matmul), the name ``offload_report``
gives as ``output``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.ir.expr import Constant
from tvm.relax import op as R

from ..graphs import sink_output_scale
from .gen import GraphSpec, KVGroup, Site

try:
    import ml_dtypes

    _NP_DTYPE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
except ImportError:  # pragma: no cover - ml_dtypes comes with TVM
    _NP_DTYPE = {"float16": np.float16, "float32": np.float32}


def np_dtype(dtype):
    return _NP_DTYPE[dtype]


def rounded(value: float, dtype: str) -> float:
    """``value`` as the graph holds it in ``dtype``."""
    return float(np.asarray(value, dtype=np.float32).astype(np_dtype(dtype)).astype(np.float64))


def lowest(dtype):
    return float(np.finfo(np.float16).min) if dtype == "float16" else float(
        np.finfo(np.float32).min) if dtype == "float32" else float(ml_dtypes.finfo(ml_dtypes.bfloat16).min)


def highest(dtype):
    return -lowest(dtype)


def fill_value(site: Site, dtype: str) -> float:
    return lowest(dtype) if site.fill == "min" else float("-inf")


def _const(value, dtype):
    return relax.const(np.asarray(value, dtype=np_dtype(dtype)))


def _shape(layout, b, s, n, d):
    return {"BSNH": [b, s, n, d], "BNSH": [b, n, s, d], "SBNH": [s, b, n, d]}[layout]



def _unit_axis(x, axis, expand):
    """A size-1 axis inserted at ``axis``: ``expand_dims`` ("hf", TVM's torch frontend) or a ``reshape``
    ("hf_reshape", relax.frontend.nn code and ONNX's Unsqueeze lowered to a reshape)."""
    if expand == "hf":
        return R.expand_dims(x, axis=[axis])
    shape = list(x.ty.shape.values)
    return R.reshape(x, shape[:axis] + [1] + shape[axis:])

class Built:
    """The module plus what the reference needs."""

    def __init__(self, spec: GraphSpec):
        self.spec = spec
        self.syms = {}
        self.params = []  # relax.Var, in order
        self.mod = None

    def sym(self, name):
        if name not in self.syms:
            self.syms[name] = tirx.Var(name, "int64")
        return self.syms[name]

    def dim(self, x):
        return self.sym(x) if isinstance(x, str) else x

    # lengths of a group / a site, as PrimExprs
    def s_kv(self, g: KVGroup):
        return {"static": g.s_kv, "same": self.sym("n"), "indep": self.sym("m"),
                "concat": self.sym("p") + self.sym("n"), "concat1": self.sym("p") + 1}[g.lengths]

    def s_q(self, site: Site):
        return self.dim(site.s_q)


def build_module(spec: GraphSpec) -> Built:
    out = Built(spec)
    b = out.dim(spec.batch)
    bb = relax.BlockBuilder()
    qs = []
    for i, site in enumerate(spec.sites):
        g = spec.groups[site.group]
        if site.form == "varlen":  # (1, total, H, D): the sequences concatenated
            qs.append(relax.Var(f"q{i}", relax.TensorType([1, out.s_q(site), site.h, g.d], g.dtype)))
            continue
        qs.append(relax.Var(f"q{i}", relax.TensorType(_shape(site.q_layout, b, out.s_q(site), site.h, g.d), g.dtype)))
    kv_params = {}
    for gi, g in enumerate(spec.groups):
        for name, layout in (("k", g.k_layout), ("v", g.v_layout)):
            if g.lengths in ("concat", "concat1"):
                new = out.sym("n") if g.lengths == "concat" else 1
                past = relax.Var(f"{name}p{gi}", relax.TensorType(_shape(layout, b, out.sym("p"), g.hkv, g.d), g.dtype))
                cur = relax.Var(f"{name}n{gi}", relax.TensorType(_shape(layout, b, new, g.hkv, g.d), g.dtype))
                kv_params[(gi, name)] = (past, cur)
            else:
                kv_params[(gi, name)] = (relax.Var(f"{name}{gi}", relax.TensorType(
                    _shape(layout, b, out.s_kv(g), g.hkv, g.d), g.dtype)),)
    extra = {}
    for i, site in enumerate(spec.sites):
        g = spec.groups[site.group]
        sq, skv = out.s_q(site), out.s_kv(g)
        if site.form == "varlen":
            # own K/V (B = 1, total lengths) and the sequence starts / max lengths, int32
            total_kv = g.s_kv if g.lengths == "static" else out.sym("m")
            kv_ty = relax.TensorType([1, total_kv, g.hkv, g.d], g.dtype)
            nseq = out.dim(spec.batch)
            extra[i] = (relax.Var(f"kvl{i}", kv_ty), relax.Var(f"vvl{i}", kv_ty),
                        relax.Var(f"ssq{i}", relax.TensorType([nseq + 1], "int32")),
                        relax.Var(f"msq{i}", relax.TensorType([], "int32")),
                        relax.Var(f"ssk{i}", relax.TensorType([nseq + 1], "int32")),
                        relax.Var(f"msk{i}", relax.TensorType([], "int32")))
        elif site.mask_op == "runtime_mask":
            extra[i] = relax.Var(f"m{i}", relax.TensorType([b, 1, sq, skv], "bool"))
        elif site.mask_op == "runtime_bias":
            extra[i] = relax.Var(f"m{i}", relax.TensorType([b, 1, sq, skv], g.dtype))
    flat = [p for i in sorted(extra) for p in (extra[i] if isinstance(extra[i], tuple) else (extra[i],))]
    sinks = {i: relax.Var(f"s{i}", relax.TensorType([site.h], site.sinks_dtype))
             for i, site in enumerate(spec.sites) if site.score_mod == "sinks"}
    out.params = qs + [p for ps in kv_params.values() for p in ps] + flat + [sinks[i] for i in sorted(sinks)]
    with bb.function("main", out.params):
        with bb.dataflow() if spec.dataflow else contextlib.nullcontext():
            kv = {}
            for (gi, name), ps in kv_params.items():
                g = spec.groups[gi]
                layout = g.k_layout if name == "k" else g.v_layout
                kv[(gi, name)] = ps[0] if len(ps) == 1 else bb.emit(R.concat(list(ps), axis=1 if layout == "BSNH" else 2))
            emitter = _SiteEmitter(bb, out, b, kv)
            emitter.sinks = sinks
            results = [emitter.emit(i, site, qs[i], extra.get(i)) for i, site in enumerate(spec.sites)]
            res = relax.Tuple(results) if len(results) > 1 else results[0]
            res = bb.emit_output(res) if spec.dataflow else bb.emit(res)
        bb.emit_func_output(res)
    out.mod = bb.get()
    return out


class _SiteEmitter:
    def __init__(self, bb, built, b, kv):
        self.bb, self.built, self.b, self.kv = bb, built, b, kv
        self.cache = {}

    def expanded(self, gi, name, expand, h):
        g = self.built.spec.groups[gi]
        layout = g.k_layout if name == "k" else g.v_layout
        key = (gi, name, expand, h)
        if g.share_expansion and key in self.cache:
            return self.cache[key]
        x = self.kv[(gi, name)]
        bb, r, ax = self.bb, h // g.hkv, 2 if layout == "BSNH" else 1
        shape = list(x.ty.shape.values)
        if expand == "repeat" and r > 1:
            x = bb.emit(R.repeat(x, r, axis=ax))
        elif expand == "tile" and r > 1:
            reps = [1, 1, 1, 1]
            reps[ax] = r
            x = bb.emit(R.tile(x, reps))
        elif expand == "broadcast" and r > 1:
            shape[ax] = h
            x = bb.emit(R.broadcast_to(x, shape))
        elif expand in ("hf", "hf_reshape") and r > 1:
            s5 = shape[:ax + 1] + [r] + shape[ax + 1:]
            e = bb.emit(_unit_axis(x, ax + 1, expand))
            e = bb.emit(R.broadcast_to(e, s5))
            shape[ax] = h
            x = bb.emit(R.reshape(e, shape))
        self.cache[key] = x
        return x

    @staticmethod
    def _swap(bb, x):
        return bb.emit(R.permute_dims(x, [0, 2, 1, 3]))

    def _swap_stored(self, layout, site, g, q, k, v):
        """q, k, v with those stored in ``layout`` swapped to the other of BSNH / BNSH (a sequence-first
        query transposed to the other one)."""
        if site.q_layout == "SBNH":
            q = self.bb.emit(R.permute_dims(q, [1, 0, 2, 3] if layout == "BNSH" else [1, 2, 0, 3]))
        q = self._swap(self.bb, q) if site.q_layout == layout else q
        k = self._swap(self.bb, k) if g.k_layout == layout else k
        v = self._swap(self.bb, v) if g.v_layout == layout else v
        return q, k, v

    def emit(self, i, site: Site, q, extra):
        spec = self.built.spec
        g = spec.groups[site.group]
        bb = self.bb
        if site.form == "varlen":
            return self._varlen(i, site, g, q, extra)
        kexp = "none" if site.expand == "matmul_bcast" else site.expand
        k = self.expanded(site.group, "k", kexp, site.h)
        v = self.expanded(site.group, "v", kexp, site.h)
        if site.form == "fused":
            o = self._fused(i, site, g, q, k, v, extra)  # BSNH
            bsnh = True
        else:
            o = self._chain(i, site, g, q, k, v, extra)  # BNSH
            bsnh = False
        sq = self.built.s_q(site)
        if site.out_layout == "BNSH":
            return self._swap(bb, o) if bsnh else o
        if not bsnh:
            o = self._swap(bb, o)
        if site.out_layout == "merged":
            o = bb.emit(R.reshape(o, [self.b, sq, site.h * g.d]))
        return o

    def _fused(self, i, site, g, q, k, v, extra):
        bb = self.bb
        q, k, v = self._swap_stored("BNSH", site, g, q, k, v)
        if site.q_prescale is not None:
            q = bb.emit(R.multiply(q, _const(site.q_prescale, g.dtype)))
        causal = site.causal if not site.window_without_causal else None
        call = R.nn.attention(q, k, v, bias=extra, scale=site.scale, causal_mask=causal, window_size=site.window)
        return bb.emit(call, name_hint=f"root{i}")

    def _varlen(self, i, site, g, q, extra):
        """``R.nn.attention_var_len`` on K/V expanded in BSNH (B = 1: the sequences concatenated)."""
        kvl, vvl, ssq, msq, ssk, msk = extra
        k = self._expand_bsnh(kvl, site.expand, g.hkv, site.h)
        v = self._expand_bsnh(vvl, site.expand, g.hkv, site.h)
        call = R.nn.attention_var_len(q, k, v, ssq, msq, ssk, msk, scale=site.scale,
                                      causal_mask=site.causal, window_size=site.window)
        return self.bb.emit(call, name_hint=f"root{i}")

    def _expand_bsnh(self, x, expand, hkv, h):
        bb, r = self.bb, h // hkv
        shape = list(x.ty.shape.values)
        if r == 1 or expand in ("none", "matmul_bcast"):
            return x
        if expand == "tile":
            return bb.emit(R.tile(x, [1, 1, r, 1]))
        if expand == "broadcast":
            return bb.emit(R.broadcast_to(x, shape[:2] + [h] + shape[3:]))
        if expand in ("hf", "hf_reshape"):
            e = bb.emit(R.broadcast_to(bb.emit(_unit_axis(x, 3, expand)), shape[:3] + [r] + shape[3:]))
            return bb.emit(R.reshape(e, shape[:2] + [h] + shape[3:]))
        return bb.emit(R.repeat(x, r, axis=2))

    def _chain(self, i, site, g, q, k, v, extra):
        bb, b = self.bb, self.b
        dt = g.dtype
        sq, skv = self.built.s_q(site), self.built.s_kv(g)
        h, d = site.h, g.d
        q, k, v = self._swap_stored("BSNH", site, g, q, k, v)
        three = site.form == "chain3d"
        if three:
            q = bb.emit(R.reshape(q, [b * h, sq, d]))
            k = bb.emit(R.reshape(k, [b * h, skv, d]))
            v = bb.emit(R.reshape(v, [b * h, skv, d]))
            sc = bb.emit(R.matmul(q, bb.emit(R.permute_dims(k, [0, 2, 1]))))
        else:
            sc = bb.emit(R.matmul(q, bb.emit(R.permute_dims(k, [0, 1, 3, 2]))))

        def scale(x):
            if site.scale_op == "multiply":
                value = site.scale
                op = R.multiply
            else:
                value = 1.0 / site.scale
                op = R.divide
            c = bb.emit(R.astype(relax.const(value, "float32"), dt)) if site.scale_cast else _const(value, dt)
            return bb.emit(op(x, c))

        def mask(x):
            if site.mask_op == "none":
                return x
            # a runtime mask / bias is (B, 1, S_q, S_kv): the 3-D scores take it through their 4-D view
            reshaped = three and (site.mask_dims == 4 or site.mask_op in ("runtime_mask", "runtime_bias", "const_bias"))
            if reshaped:
                x = bb.emit(R.reshape(x, [b, h, sq, skv]))
            x = self._mask(i, site, dt, x, sq, skv, extra)
            if reshaped:
                x = bb.emit(R.reshape(x, [b * h, sq, skv]))
            return x

        capped_first = site.score_mod == "softcap" and softcap_before_mask(site)
        if site.mask_first:
            sc = scale(mask(sc))
        elif capped_first:  # Gemma 2: scale, soft-cap, then the mask
            sc = mask(self._score_mod(i, site, scale(sc), sq))
        else:
            sc = mask(scale(sc))
        f32 = site.softmax_f32 and dt != "float32"
        x = bb.emit(R.astype(sc, "float32")) if f32 else sc
        if not capped_first:
            x = self._score_mod(i, site, x, sq)
        p = bb.emit(R.nn.softmax(x, axis=-1))
        if site.score_mod == "sinks" and site.sink_at == "logits":  # drop the sink column
            p = bb.emit(R.strided_slice(p, axes=[3], begin=[0], end=[-1]))
        if site.row_guard != "none":
            p = self._row_guard(site, bb.emit(R.astype(sc, "float32")) if f32 else sc, p)
        if f32:
            p = bb.emit(R.astype(p, dt))
        o = bb.emit(R.matmul(p, v), name_hint=f"root{i}")
        if three:
            o = bb.emit(R.reshape(o, [b, h, sq, d]))
        if site.score_mod == "sinks" and site.sink_at == "output":
            o = self._sink_output(i, site, x, o)
        return o

    def _sink_output(self, i, site, logits, o):
        """``o * sigmoid(logsumexp(logits) - sink)`` in float32, cast back; the multiply is the site's root
        when it is offloaded."""
        bb, f32 = self.bb, "float32"
        scale = sink_output_scale(bb, logits, self.sinks[i], site.h)
        out = bb.emit(R.multiply(bb.emit(R.astype(o, f32)), scale), name_hint=f"root{i}_sink")
        return bb.emit(R.astype(out, str(o.ty.dtype)))

    def _score_mod(self, i, site, x, sq):
        """The logits with ``site.score_mod`` applied (see ``Site``)."""
        bb = self.bb
        dt = str(x.ty.dtype)
        if site.score_mod == "softcap":
            return bb.emit(R.multiply(bb.emit(R.tanh(bb.emit(R.divide(x, _const(30.0, dt))))), _const(30.0, dt)))
        if site.score_mod == "unknown":
            return bb.emit(R.sin(x))
        if site.score_mod != "sinks" or site.sink_at == "output":
            return x
        col = bb.emit(R.broadcast_to(bb.emit(R.reshape(self.sinks[i], [1, site.h, 1, 1])), [self.b, site.h, sq, 1]))
        if str(col.ty.dtype) != dt:
            col = bb.emit(R.astype(col, dt))
        x = bb.emit(R.concat([x, col], axis=-1))
        return bb.emit(R.subtract(x, bb.emit(R.max(x, axis=-1, keepdims=True))))

    def _row_guard(self, site, scores, p):
        """where(cond, 0, p): torch's safe-softmax guard (not(any(not(scores == -inf))), with `any` as
        TVM's frontend spells it: a max over int8), or "any": rows with any -inf score; "probs":
        where(not(scores == -inf), p, 0), the probabilities masked after the softmax."""
        bb = self.bb
        eq = bb.emit(R.equal(scores, _const(float("-inf"), str(scores.ty.dtype))))
        if site.row_guard == "probs":
            return bb.emit(R.where(bb.emit(R.logical_not(eq)), p, bb.emit(R.full_like(p, _const(0.0, str(p.ty.dtype))))))

        def any_row(x):
            m = bb.emit(R.max(bb.emit(R.astype(x, "int8")), axis=[-1], keepdims=True))
            return bb.emit(R.astype(m, "bool"))

        if site.row_guard == "safe":
            cond = bb.emit(R.logical_not(any_row(bb.emit(R.logical_not(eq)))))
        else:
            cond = any_row(eq)
        return bb.emit(R.where(cond, bb.emit(R.full_like(p, _const(0.0, str(p.ty.dtype)))), p))

    def _mask(self, i, site, dt, x, sq, skv, extra):
        bb = self.bb
        fill = fill_value(site, dt)
        if site.mask_op == "runtime_mask":
            return bb.emit(R.where(extra, x, _const(fill, dt)))
        if site.mask_op == "runtime_bias":
            return bb.emit(R.add(x, extra))
        if site.mask_op == "const_bias":
            rng = np.random.default_rng(1234 + i)
            bias = (rng.standard_normal((1, 1, int(sq), int(skv))) * 0.5).astype(np_dtype(dt))
            return bb.emit(R.add(x, relax.const(bias)))
        cond = self._cond(site, sq, skv)
        if site.mask_op == "where":
            if site.where_drop:
                return bb.emit(R.where(bb.emit(R.logical_not(cond)), _const(fill, dt), x))
            return bb.emit(R.where(cond, x, _const(fill, dt)))
        if site.mask_op == "add":
            m = self._select(cond, 0.0, fill, dt)
            return bb.emit(R.add(x, m))
        if site.mask_op == "minmax":
            x = bb.emit(R.maximum(x, _const(lowest(dt), dt)))
            m = self._select(cond, highest(dt), fill, dt)
            return bb.emit(R.minimum(x, m))
        raise AssertionError(site.mask_op)

    def _select(self, cond, yes, no, dt):
        if isinstance(cond, Constant):
            return relax.const(np.where(cond.value.numpy(), yes, no).astype(np_dtype(dt)))
        return self.bb.emit(R.where(cond, _const(yes, dt), _const(no, dt)))

    def _cond(self, site, sq, skv):
        """Visible (True) where key j may be seen by query i: bottom-right causal (TopLeft from
        positions 0..S_q), optionally a window of ``site.window`` keys."""
        bb = self.bb
        if site.mask_src == "const":
            return relax.const(allowed_np(site, int(sq), int(skv)))
        kpos = bb.emit(R.arange(0, skv, 1, "int64"))
        if site.causal == "TopLeft":
            qpos = bb.emit(R.arange(0, sq, 1, "int64"))
        else:
            qpos = bb.emit(R.arange(skv - sq, skv, 1, "int64"))
        qcol = bb.emit(R.reshape(qpos, [sq, 1]))
        cond = bb.emit(R.less_equal(kpos, qcol))
        if site.window is not None:
            lo = bb.emit(R.subtract(qcol, relax.const(site.window, "int64")))
            cond = bb.emit(R.logical_and(cond, bb.emit(R.greater(kpos, lo))))
        if site.chunk is not None:  # the query's block of positions (Llama 4: position // chunk size)
            block = relax.const(site.chunk, "int64")
            same = bb.emit(R.equal(bb.emit(R.floor_divide(kpos, block)), bb.emit(R.floor_divide(qcol, block))))
            cond = bb.emit(R.logical_and(cond, same))
        return cond


def allowed_np(site: Site, sq: int, skv: int) -> np.ndarray:
    """The visibility matrix the site's causal kind / window means (what the graph computes)."""
    i = np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    if site.causal is None and site.window is None:
        return np.ones((sq, skv), dtype=bool)
    if site.causal == "TopLeft":
        diag = i
    else:
        diag = i + (skv - sq)
    ok = j <= diag
    if site.window is not None:
        ok &= j > diag - site.window
    if site.chunk is not None:
        ok &= j // site.chunk == diag // site.chunk
    return ok


# ----------------------------------------------------------------------------- inputs and reference
def concrete(built: Built, rng) -> dict:
    """Run-time values of the symbolic lengths: S_q <= S_kv always (rows with no visible key are
    undefined and not compared anyway)."""
    values = {}
    n = int(rng.integers(1, 9))
    for name, var in built.syms.items():
        values[name] = {"n": n, "p": int(rng.integers(1, 7)), "m": n + int(rng.integers(0, 7)),
                        "b": int(rng.integers(1, 3))}[name]
    return values


def _eval_dim(x, values):
    if isinstance(x, tirx.IntImm):
        return int(x)
    from tvm.sym import Analyzer

    ana = Analyzer()
    for var in tirx.analysis.undefined_vars(x, []):
        ana.bind(var, values[var.name])
    return int(ana.simplify(x))


def make_inputs(built: Built, values: dict, rng) -> dict:
    out = {}
    for p in built.params:
        shape = [_eval_dim(x, values) for x in p.ty.shape.values]
        dt = str(p.ty.dtype)
        if dt == "bool":
            arr = rng.random(shape) < 0.7
        elif dt == "int32":  # var-len: sequence starts (cumsum, 0 first) and the longest sequence
            arr = _seq_info(built, p.name, values)
        else:
            arr = (rng.standard_normal(shape) * _input_std(built, p.name)).astype(np_dtype(dt))
        out[p.name] = arr
    return out


def _input_std(built, name):
    """0.7, and smaller for a query whose logits would be large (a scale of 1 over head dim 160):
    logits of standard deviation about 1.5 keep the half-precision graph within the tolerance."""
    if not (name.startswith("q") and name[1:].isdigit()):
        return 0.7
    site = built.spec.sites[int(name[1:])]
    d = built.spec.groups[site.group].d
    scale = abs(site.scale if site.scale is not None else d ** -0.5) * abs(site.q_prescale or 1.0)
    return min(0.7, 1.5 / max(scale * d ** 0.5 * 0.7, 1e-6))


def _seq_info(built, name, values):
    """Sequence starts splitting a var-len site's total length as evenly as possible, or its max."""
    i = int(name[3:])
    total = {p.name: p for p in built.params}[("q" if name[2] == "q" else "kvl") + str(i)].ty.shape.values[1]
    total = _eval_dim(total, values)
    nseq = _eval_dim(tirx.IntImm("int64", built.spec.batch) if isinstance(built.spec.batch, int)
                     else built.syms["b"], values)
    starts = np.array([total * j // nseq for j in range(nseq + 1)], dtype="int32")
    if name.startswith("ms"):
        return np.array(int(np.diff(starts).max()), dtype="int32")
    return starts


def _bsnh(x, layout):
    if layout == "SBNH":
        return x.transpose(1, 0, 2, 3)
    return x if layout == "BSNH" else x.transpose(0, 2, 1, 3)


def reference(built: Built, inputs: dict, values: dict) -> list:
    """Per site: the expected output (float64, the site's output layout; NaN where undefined:
    query rows that see no key), or None where the site has no defined meaning to check against."""
    spec = built.spec
    outs = []
    for i, site in enumerate(spec.sites):
        g = spec.groups[site.group]
        if site.form == "varlen" or site.window_without_causal:
            outs.append(None)
            continue
        f64 = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
        q = _bsnh(f64(inputs[f"q{i}"]), site.q_layout)
        kv = []
        for name, layout in (("k", g.k_layout), ("v", g.v_layout)):
            if g.lengths in ("concat", "concat1"):
                ax = 1 if layout == "BSNH" else 2
                x = np.concatenate([f64(inputs[f"{name}p{site.group}"]), f64(inputs[f"{name}n{site.group}"])], axis=ax)
            else:
                x = f64(inputs[f"{name}{site.group}"])
            kv.append(_bsnh(x, layout))
        k, v = kv
        b, sq, h, d = q.shape
        skv, hkv = k.shape[1], k.shape[2]
        if site.expand == "tile":
            idx = np.arange(h) % hkv
        elif h % hkv:
            outs.append(None)  # heads not a multiple: no meaning (rejected, left to TVM)
            continue
        else:
            idx = np.arange(h) // (h // hkv)
        k, v = k[:, :, idx], v[:, :, idx]
        qk = np.einsum("bihd,bjhd->bhij", q, k)
        allowed = np.broadcast_to(allowed_np(site, sq, skv), (b, h, sq, skv))
        add = np.zeros((b, h, sq, skv))
        if site.mask_op == "runtime_mask":
            allowed = allowed & np.broadcast_to(inputs[f"m{i}"], (b, h, sq, skv))
        elif site.mask_op == "runtime_bias":
            add = add + f64(inputs[f"m{i}"])
        elif site.mask_op == "const_bias":
            rng = np.random.default_rng(1234 + i)
            add = add + f64((rng.standard_normal((1, 1, sq, skv)) * 0.5).astype(np_dtype(g.dtype)))
        if site.form == "fused":
            s = site.scale if site.scale is not None else 1.0 / np.sqrt(d)
            if site.q_prescale is not None:
                s *= rounded(site.q_prescale, g.dtype)
            logits = qk * s + add
        else:
            c = rounded(site.scale, g.dtype)
            if site.scale_op == "divide":
                c = 1.0 / rounded(1.0 / site.scale, g.dtype)
            if site.mask_first:
                logits = (qk + add) * c
            elif site.score_mod == "softcap" and softcap_before_mask(site):
                logits = np.tanh(qk * c / 30.0) * 30.0 + add
            else:
                logits = qk * c + add
        if site.form == "fused" and site.causal == "BottomRight" and sq > skv:
            outs.append(None)  # TVM's own lowering aligns with |S_q - S_kv|: undefined, rejected
            continue
        logits = np.where(allowed, logits, -np.inf)
        if site.score_mod == "softcap" and not (site.form != "fused" and softcap_before_mask(site)):
            logits = np.tanh(logits / 30.0) * 30.0
        elif site.score_mod == "unknown":
            logits = np.sin(logits)
        elif site.score_mod == "sinks":
            col = np.broadcast_to(f64(inputs[f"s{i}"])[None, :, None, None], (b, h, sq, 1))
            logits = np.concatenate([logits, col], axis=-1)
        with np.errstate(invalid="ignore"):
            m = logits.max(axis=-1, keepdims=True)
            e = np.exp(logits - m)
            p = e / e.sum(axis=-1, keepdims=True)
        if site.score_mod == "sinks":
            p = p[..., :-1]
        if site.fill == "-inf" and site.mask_op not in ("none", "runtime_bias", "const_bias"):
            # masked scores are -inf in the graph: the row guards see them (a safe guard's rows stay
            # undefined, NaN, as a row that sees no key is)
            if site.row_guard == "any":
                p = np.where((~allowed).any(axis=-1, keepdims=True), 0.0, p)
            elif site.row_guard == "probs":
                p = np.where(~allowed, 0.0, p)
        o = np.einsum("bhij,bjhd->bihd", p, v)  # BSNH, NaN rows where nothing is visible
        if site.out_layout == "BNSH":
            o = o.transpose(0, 2, 1, 3)
        elif site.out_layout == "merged":
            o = o.reshape(b, sq, h * d)
        outs.append(o)
    return outs


def run_llvm(mod, built: Built, inputs: dict) -> list:
    ex = relax.build(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    args = [tvm.runtime.tensor(inputs[p.name]) for p in built.params]
    res = vm["main"](*args)
    if len(built.spec.sites) == 1:
        res = [res]
    return [np.asarray(r.numpy()).astype(np.float64) for r in res]


def softcap_before_mask(site) -> bool:
    """Whether a chain's soft-cap is applied to the scaled scores before its mask (Gemma 2's order)."""
    return site.softcap_first and not site.mask_first
