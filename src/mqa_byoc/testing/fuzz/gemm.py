"""Random GEMM graphs for the matmul offload: draw, build, check.

A graph is a chain of 1 to 3 matmul sites (:class:`GemmSpec`), each drawn over what users' graphs hold:
fp16, bf16, float32 and int8 operands; a float32 ``out_dtype`` and ``ToMixedPrecision``'s cast back; 1-D
to 4-D activations with static and symbolic rows; weights as parameters, constants, computed, or cast from a float32
parameter, stored (K, N) or (N, K) behind ``permute_dims`` (with or without explicit axes); batched
weights whose batch axes equal the activation's or broadcast; biases of every broadcastable shape, added
on either side; relu, gelu, gelu_tanh, silu; residuals of the output's shape or broadcast; K and N
aligned or not; a matmul result the graph also returns; the graph as written, or after TVM's
``FuseTransposeMatmul`` or ``LegalizeOps`` (a user's pipeline run before the partition).

:func:`check_gemm_graph` checks one graph:

- ``unseen``: every matmul appears in ``gemm_report`` once (after lowering, as many sites as matmuls);
- ``report``: an offloaded site runs on cuBLASLt with no reason, one left on TVM has a reason, and the
  report's N, K and type are the graph's;
- ``eligibility``: a site is offloaded exactly when the library can take it (fp16/bf16 operands,
  K and N static multiples of 8, batch axes equal), independently of the analysis' own checks;
- ``codegen``: every offloaded function is read by the codegen and emits its C++;
- ``library``: the partitioned graph, with each offloaded function replaced by a model of the
  cuBLASLt call the codegen makes (fp32 accumulation of the compact (M, K) x (K, N) product, the bias
  as a vector of N, the epilogue, C = the residual as compact (M, N), one rounding to the output type),
  computes on llvm what the unpartitioned graph does. A bias or residual the library would read with
  the wrong shape fails here.
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

SYM_SIZES = {"n": 3, "m": 2}
_FLOATS = ("float16", "bfloat16")


@dataclass(frozen=True)
class GemmSiteSpec:
    dtype: str  # the operands' type
    k: int
    n: int
    out_dtype: str | None = None  # the matmul's out_dtype (None: the operands')
    cast: str | None = None  # R.astype of the result (after the epilogue)
    weight: str = "param"  # "param", "const", "cast" (astype of a float32 parameter), "computed" (w * 0.5)
    transposed: str | None = None  # None: w (K, N); "default": permute_dims(w); "axes": explicit axes
    batch: tuple = ()  # the weight's batch axes (ints or symbol names); () a 2-D weight
    bias: tuple | None = None  # the bias' shape ("N" for the site's N)
    bias_first: bool = False
    activation: str | None = None
    residual: tuple | None = None  # the residual's shape ("N" for N, "R" for the output's shape)
    residual_first: bool = False
    returns_matmul: bool = False  # the matmul's result is an output of the graph too
    chained: bool = False  # x is the previous site's output


@dataclass(frozen=True)
class GemmSpec:
    rows: tuple  # x's axes before K (ints or symbol names)
    sites: tuple  # GemmSiteSpec
    pipeline: str = "none"  # what runs before the partition: "none", "fuse_transpose_matmul", "legalize"


PIPELINES = ("none", "fuse_transpose_matmul", "legalize")


def lower(mod, pipeline: str):
    """``mod`` after the TVM passes a user's pipeline may run before partitioning."""
    from tvm import relax

    if pipeline == "fuse_transpose_matmul":
        return relax.transform.FuseTransposeMatmul()(mod)
    if pipeline == "legalize":
        return relax.transform.LegalizeOps()(mod)
    return mod


# ----------------------------------------------------------------------------- drawing
def _pick(rng: random.Random, weighted):
    items, weights = zip(*weighted)
    return rng.choices(items, weights)[0]


def _draw_site(rng: random.Random, rows: tuple, prev: GemmSiteSpec | None) -> GemmSiteSpec:
    chained = prev is not None and rng.random() < 0.7 and not prev.returns_matmul
    if chained:
        dtype = prev.cast or prev.out_dtype or prev.dtype
        k = prev.n
    else:
        dtype = _pick(rng, [("float16", 55), ("bfloat16", 25), ("float32", 12), ("int8", 8)])
        k = _pick(rng, [(16, 3), (32, 3), (64, 3), (24, 2), (12, 1), (20, 1), (7, 1)])
    n = _pick(rng, [(16, 3), (32, 3), (48, 2), (24, 2), (12, 1), (36, 1), (5, 1)])
    out_dtype = cast = None
    if dtype in _FLOATS and rng.random() < 0.3:
        out_dtype = "float32"
        cast = _pick(rng, [(None, 2), (dtype, 5), ("float16" if dtype == "bfloat16" else "bfloat16", 1)])
    weight = _pick(rng, [("param", 6), ("const", 2 if dtype != "bfloat16" else 0),
                         ("cast", 1 if dtype in _FLOATS else 0), ("computed", 1)])
    transposed = _pick(rng, [(None, 4), ("default", 5), ("axes", 1)])
    batch = ()
    if len(rows) >= 2 and rng.random() < 0.2:
        lead = rows[:-1]
        batch = _pick(rng, [(tuple(lead), 4), (tuple(1 for _ in lead), 1), (tuple(lead[1:]), 1)])
        if not batch:
            batch = tuple(lead)
        weight = "param"
    out_rank = len(rows) + 1
    bias = None
    if rng.random() < 0.45:
        bias = _pick(rng, [(("N",), 6), ((1, "N"), 2), ((1, 1, "N"), 1 if out_rank >= 3 else 0),
                           ((1, 1, 1, "N"), 1), ((1,), 1), (("R",), 1)])
    activation = None
    if (out_dtype or dtype) != "int8" and rng.random() < (0.4 if bias else 0.15):
        activation = _pick(rng, [("relu", 2), ("gelu_tanh", 2), ("gelu", 1), ("silu", 2)])
    residual = None
    if rng.random() < 0.3:
        residual = _pick(rng, [(("R",), 6), ((1, "N"), 2), (("N",), 1)])
    return GemmSiteSpec(dtype, k, n, out_dtype, cast, weight, transposed, batch, bias, rng.random() < 0.5,
                        activation, residual, rng.random() < 0.5, rng.random() < 0.1, chained)


def draw_gemm_graph(rng: random.Random) -> GemmSpec:
    rank = _pick(rng, [(0, 1), (1, 5), (2, 4), (3, 1)])
    rows = tuple(_pick(rng, [(1, 2), (2, 2), (3, 1), (5, 1), ("n", 3), ("m", 1)]) for _ in range(rank))
    if len(set(d for d in rows if isinstance(d, str))) < sum(isinstance(d, str) for d in rows):
        rows = tuple(d if not isinstance(d, str) or d not in rows[:i] else 2 for i, d in enumerate(rows))
    sites, prev = [], None
    for _ in range(_pick(rng, [(1, 4), (2, 3), (3, 2)])):
        prev = _draw_site(rng, rows, prev)
        sites.append(prev)
    return GemmSpec(rows, tuple(sites), _pick(rng, list(zip(PIPELINES, (7, 2, 1)))))


def draw(seed: int, index: int) -> GemmSpec:
    return draw_gemm_graph(random.Random(seed * 1_000_003 + index))


# ----------------------------------------------------------------------------- building
@dataclass
class GemmGraph:
    mod: object
    specs: list  # (name, shape, dtype) of main's parameters
    matmuls: list  # the matmul variables' names, in site order
    x_rows: list  # each site's x: its axes before K


def broadcast(a: tuple, b: tuple) -> tuple:
    """NumPy's broadcast of two shapes of ints and symbol names (equal names are equal axes)."""
    a, b = tuple(a), tuple(b)
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise ValueError(f"shapes {a} and {b} do not broadcast")
    return tuple(out)


def matmul_shape(rows: tuple, batch: tuple, n: int) -> tuple:
    """The shape of x (*rows, K) @ w (*batch, K, N)."""
    if not rows:
        return (*batch, n)
    return (*broadcast(rows[:-1], batch), rows[-1], n)


def _site_shape(shape, n, current):
    if shape == ("R",):
        return tuple(current)
    return tuple(n if d == "N" else d for d in shape)


def build_gemm_module(spec: GemmSpec, seed: int = 0) -> GemmGraph:
    """``main`` of the spec's sites: every operand a parameter but constant weights (drawn with ``seed``)."""
    from tvm import relax, tirx

    from ...compiler.graph.lowered_matmul import transpose_axes
    from ..gemm_graphs import ACTIVATION_OPS

    rng = np.random.default_rng(seed)
    syms: dict = {}
    params, specs, matmuls, outputs = [], [], [], []

    def param(name, shape, dtype):
        dims = [syms.setdefault(d, tirx.Var(d, "int64")) if isinstance(d, str) else d for d in shape]
        v = relax.Var(name, relax.TensorType(dims, dtype))
        params.append(v)
        specs.append((name, tuple(shape), dtype))
        return v

    # operands first (the signature), then the graph
    ops, x_rows = [], []
    shape = None
    for i, s in enumerate(spec.sites):
        xi = None if (s.chained and i) else param("x" if not i else f"x{i}", (*spec.rows, s.k), s.dtype)
        x_rows.append(tuple(spec.rows if xi is not None else shape[:-1]))
        w_shape = (*s.batch, *((s.n, s.k) if s.transposed else (s.k, s.n)))
        if s.weight == "const":
            data = (rng.standard_normal(w_shape) * 0.1).astype("float16")
            data = rng.integers(-3, 4, w_shape).astype("int8") if s.dtype == "int8" else data.astype(s.dtype)
            w = relax.const(data)
        else:
            w = param(f"w{i}", w_shape, "float32" if s.weight == "cast" else s.dtype)
        shape = matmul_shape(x_rows[-1], s.batch, s.n)
        typ = s.out_dtype or s.dtype
        b = r = None
        if s.bias:
            b = param(f"b{i}", _site_shape(s.bias, s.n, shape), typ)
            shape = broadcast(shape, _site_shape(s.bias, s.n, shape))
        if s.residual:
            r = param(f"r{i}", _site_shape(s.residual, s.n, shape), typ)
            shape = broadcast(shape, _site_shape(s.residual, s.n, shape))
        ops.append((xi, w, b, r))

    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            y = None
            for i, (s, (xi, w, b, r)) in enumerate(zip(spec.sites, ops)):
                if xi is not None and y is not None:
                    outputs.append(y)  # the previous site's result, not read by this one, is an output
                xi = y if xi is None else xi
                nb = len(s.batch)
                if s.weight == "cast":
                    w = bb.emit(relax.op.astype(w, s.dtype), name_hint=f"wc{i}")
                elif s.weight == "computed":
                    w = bb.emit(relax.op.multiply(w, relax.const(0.5 if s.dtype != "int8" else 1, s.dtype)),
                                name_hint=f"wm{i}")
                if s.transposed:  # "axes": spelled out even where the default reversal is the same
                    axes = transpose_axes(nb + 2) if s.transposed == "default" else list(range(nb)) + [nb + 1, nb]
                    w = bb.emit(relax.op.permute_dims(w, axes), name_hint=f"wt{i}")
                y = mm = bb.emit(relax.op.matmul(xi, w, out_dtype=s.out_dtype), name_hint=f"mm{i}")
                matmuls.append(f"mm{i}")
                if b is not None:
                    y = bb.emit(relax.op.add(b, y) if s.bias_first else relax.op.add(y, b))
                if s.activation:
                    y = bb.emit(ACTIVATION_OPS[s.activation](y))
                if r is not None:
                    y = bb.emit(relax.op.add(r, y) if s.residual_first else relax.op.add(y, r))
                if s.cast:
                    y = bb.emit(relax.op.astype(y, s.cast))
                if s.returns_matmul:
                    outputs.append(mm)
            outs = [*outputs, y]
            out = bb.emit_output(relax.Tuple(outs) if len(outs) > 1 else outs[0])
        bb.emit_func_output(out)
    return GemmGraph(bb.get(), specs, matmuls, x_rows)


# ----------------------------------------------------------------------------- checking
@dataclass(frozen=True)
class GemmViolation:
    invariant: str
    message: str


@dataclass
class GemmResult:
    sites: int = 0
    offloaded: int = 0
    reasons: Counter = field(default_factory=Counter)
    composites: Counter = field(default_factory=Counter)  # offloaded sites by composite and pipeline
    violations: list = field(default_factory=list)


def reason_kind(reason: str | None) -> str:
    """A reason with its shapes and sizes left out: what kind of rejection it is."""
    text = re.sub(r"\([^()]*\)", "(..)", (reason or "").split(":")[0])
    return re.sub(r"\b\d+\b", "#", text)


def expected_offload(s: GemmSiteSpec, rows: tuple) -> bool | None:
    """Whether cuBLASLt can take the site ``s`` of x (*rows, K) (None: either is right), from the spec alone."""
    if s.dtype not in _FLOATS or s.k % 8 or s.n % 8:
        return False
    if s.batch:
        if len(rows) != len(s.batch) + 1:
            return False  # a batched weight of another rank than x: broadcast batch axes
        return tuple(rows[:-1]) == tuple(s.batch)  # else broadcast batch axes
    if not rows:
        return None  # a 1-D x
    return True


def draw_arrays(specs, seed: int = 0) -> list:
    """Inputs for ``specs``: normal floats (weights scaled by 1/sqrt of their rows), int8 in [-3, 3]."""
    rng = np.random.default_rng(seed)
    out = []
    for name, shape, dtype in specs:
        shape = [SYM_SIZES.get(d, d) if isinstance(d, str) else d for d in shape]
        if dtype == "int8":
            out.append(rng.integers(-3, 4, shape).astype("int8"))
            continue
        a = rng.standard_normal(shape) * (1 / np.sqrt(max(shape[-1], shape[-2] if len(shape) > 1 else 1))
                                         if name.startswith("w") else 1.0)
        if dtype == "bfloat16":
            import ml_dtypes

            out.append(a.astype(ml_dtypes.bfloat16))
        else:
            out.append(a.astype(dtype))
    return out


def library_model(func, site):
    """A Relax function of ``func``'s signature computing what the codegen's cuBLASLt call does."""
    from tvm import relax

    from ...compiler.graph.lowered_matmul import transpose_axes

    params = [relax.Var(p.name, p.ty) for p in func.params]
    bb = relax.BlockBuilder()
    with bb.function("model", params):
        with bb.dataflow():
            f32 = "float32"
            x = bb.emit(relax.op.astype(params[site.x], f32))
            w = bb.emit(relax.op.astype(params[site.weight], f32))
            if site.transposed:
                w = bb.emit(relax.op.permute_dims(w, transpose_axes(len(w.ty.shape.values))))
            y = bb.emit(relax.op.matmul(x, w))
            if site.bias is not None:  # cuBLASLt's bias epilogue: a vector of N added to every row
                y = bb.emit(relax.op.add(y, relax.op.reshape(relax.op.astype(params[site.bias], f32), [site.n])))
            if site.activation == "relu":
                y = bb.emit(relax.op.nn.relu(y))
            elif site.activation == "gelu_tanh":
                y = bb.emit(relax.op.nn.gelu_tanh(y))
            elif site.activation is not None:
                raise ValueError(f"no model of the activation {site.activation}")
            if site.residual is not None:  # C: read as the compact output
                r = bb.emit(relax.op.astype(params[site.residual], f32))
                y = bb.emit(relax.op.add(y, relax.op.reshape(r, y.ty.shape)))
            ret = func.ret_ty
            y = bb.emit(relax.op.astype(y, ret.dtype))
            y = bb.emit(relax.op.reshape(y, ret.shape))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()["model"].without_attr("global_symbol")


_TOL = {"float16": 3e-2, "bfloat16": 1e-1}


def check_gemm_graph(spec: GemmSpec, seed: int = 0, numerics: bool = True) -> GemmResult:
    import mqa_byoc
    from tvm import relax

    from ...compiler.codegen.cublaslt import emit_gemm_source, find_gemm_site
    from ...compiler.graph.gemm import gemm_report
    from ...contract import GEMM_CODEGEN
    from ..gemm_graphs import run_llvm_outputs

    res = GemmResult()
    bad = res.violations.append
    built = build_gemm_module(spec, seed)
    lowered = lower(built.mod, spec.pipeline)
    report = gemm_report(lowered)
    res.sites = len(report)
    if len(report) != len(built.matmuls):
        bad(GemmViolation("unseen", f"{len(report)} report entries for {len(built.matmuls)} matmuls"))
    if spec.pipeline == "none":  # the sites by name; after lowering, by their order
        by_name = Counter(r.output for r in report)
        for name in built.matmuls:
            if by_name[name] != 1:
                bad(GemmViolation("unseen", f"{name} appears {by_name[name]} times in gemm_report"))
        order = [built.matmuls.index(r.output) if r.output in built.matmuls else None for r in report]
    else:
        order = list(range(len(report)))
    for r, i in zip(report, order):
        if i is None or i >= len(spec.sites):
            continue
        s = spec.sites[i]
        if r.offloaded:
            res.offloaded += 1
            res.composites[f"{r.composite}{' batched' if r.batch else ''} ({spec.pipeline})"] += 1
            if r.runs_on != "cuBLASLt" or r.reason:
                bad(GemmViolation("report", f"{r.output}: offloaded but runs on {r.runs_on}, reason {r.reason!r}"))
            if (r.n, r.k, r.dtype) != (s.n, s.k, s.dtype):
                bad(GemmViolation("report", f"{r.output}: reported N, K, type {(r.n, r.k, r.dtype)}, "
                                            f"the graph's {(s.n, s.k, s.dtype)}"))
        else:
            res.reasons[reason_kind(r.reason)] += 1
            if r.runs_on != "TVM" or not r.reason:
                bad(GemmViolation("report", f"{r.output}: on TVM without a reason ({r.runs_on}, {r.reason!r})"))
        want = expected_offload(s, built.x_rows[i])
        if want is not None and want != r.offloaded:
            bad(GemmViolation("eligibility", f"{r.output}: offloaded={r.offloaded}, expected {want} "
                                             f"(reason: {r.reason})"))
    if spec.pipeline != "none":  # read back, each site is offloaded as in the graph as written
        written = {built.matmuls.index(r.output): r for r in gemm_report(built.mod) if r.output in built.matmuls}
        for i, r in enumerate(report):
            w = written.get(i)
            if w is not None and (r.offloaded, r.composite, bool(r.batch)) != (w.offloaded, w.composite, bool(w.batch)):
                bad(GemmViolation("lowering", f"site {i}: after {spec.pipeline} {r.composite or r.reason!r}, as "
                                              f"written {w.composite or w.reason!r}"))
    part = mqa_byoc.partition_for_cutlass(lowered)  # each offloaded function replaced by its model below
    for gv, func in part.functions.items():
        if not (isinstance(func, relax.Function) and func.attrs is not None
                and str(func.attrs.get("Codegen", "")) == GEMM_CODEGEN):
            continue
        try:
            site = find_gemm_site(func)
            emit_gemm_source(site)
        except Exception as err:  # noqa: BLE001 (any failure is the finding)
            bad(GemmViolation("codegen", f"{gv.name_hint}: {type(err).__name__}: {err}"))
            continue
        try:
            part[gv] = library_model(func, site)
        except Exception as err:  # noqa: BLE001
            bad(GemmViolation("library", f"{gv.name_hint}: the library's reading of its operands fails: "
                                         f"{type(err).__name__}: {str(err).splitlines()[0]}"))
    if numerics and res.offloaded and not any(v.invariant in ("codegen", "library") for v in res.violations):
        arrays = draw_arrays(built.specs, seed)
        want = run_llvm_outputs(built.mod, arrays)
        try:
            got = run_llvm_outputs(part, arrays)
        except Exception as err:  # noqa: BLE001
            bad(GemmViolation("library", f"the library model fails: {type(err).__name__}: {str(err).splitlines()[0]}"))
            return res
        types = {s.dtype for s in spec.sites} & set(_TOL)
        tol = max((_TOL[t] for t in types), default=1e-3)
        for j, (a, b) in enumerate(zip(got, want)):
            if a.shape != b.shape or not np.allclose(a, b, rtol=tol, atol=tol):
                err = np.abs(a - b).max() if a.shape == b.shape else f"shapes {a.shape} {b.shape}"
                bad(GemmViolation("library", f"output {j}: max |diff| {err} against the unpartitioned graph"))
    return res


def run(graphs: int, seed: int, numerics: bool = True, progress=None) -> dict:
    """``graphs`` graphs of ``seed``: sites, offloaded, reasons and violations (with the spec of each)."""
    t0 = time.time()
    total = GemmResult()
    found = []
    for i in range(graphs):
        spec = draw(seed, i)
        try:
            res = check_gemm_graph(spec, seed=i, numerics=numerics)
        except Exception as err:  # noqa: BLE001 (a crash is a finding too)
            res = GemmResult(violations=[GemmViolation("crash", f"{type(err).__name__}: {str(err).splitlines()[0]}")])
        total.sites += res.sites
        total.offloaded += res.offloaded
        total.reasons.update(res.reasons)
        total.composites.update(res.composites)
        for v in res.violations:
            found.append({"graph": i, "invariant": v.invariant, "message": v.message, "spec": repr(spec)})
        if progress:
            progress(i, res)
    return {"graphs": graphs, "seed": seed, "sites": total.sites, "offloaded": total.offloaded,
            "reasons": dict(total.reasons.most_common()), "composites": dict(sorted(total.composites.items())),
            "violations": found,
            "seconds": round(time.time() - t0, 1)}


def summary_text(summary: dict) -> str:
    lines = [f"{summary['graphs']} graphs (seed {summary['seed']}), {summary['sites']} GEMM sites, "
             f"{summary['offloaded']} offloaded, {len(summary['violations'])} violations, {summary['seconds']} s",
             "left on TVM:"]
    lines += [f"  {n:5d}  {reason}" for reason, n in summary["reasons"].items()]
    lines.append("offloaded (composite, pipeline):")
    lines += [f"  {n:5d}  {name}" for name, n in summary["composites"].items()]
    for v in summary["violations"]:
        lines.append(f"graph {v['graph']} [{v['invariant']}] {v['message']}\n    {v['spec']}")
    return "\n".join(lines)
