"""Prove that a mask in an explicit attention chain is a causal (or sliding-window) mask.

FA2 computes only position masks: none, causal (bottom-right aligned) and a sliding window. A mask
tensor in the graph is offloaded only when it is built from shapes alone (constants, arange,
comparisons, call_tir of shape-only PrimFuncs, ...): we evaluate its sub-graph on the CPU at compile
time and compare it element by element with FA2's mask. With symbolic lengths the sub-graph is
evaluated at several sample lengths: a few small ones, plus lengths around every integer constant
in the sub-graph (a mask built from positions can only change shape where a length crosses one of
its constants, e.g. a sliding window of 4096 shows only beyond 4096 keys). A mask that depends on a
runtime input (a padding mask, a bias) is rejected.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.ir.expr import Constant

from mqa_byoc.compiler.graph.trace import Bindings, op_name

# A masked logit must vanish after softmax. FA2 masks to exactly zero weight; a graph's mask gives
# exp(masked - rowmax), which is 0 in float32 once masked - rowmax < -104: at or below this bound
# whenever some visible logit of the row is above -1900 (a softmax whose every logit is below that is
# degenerate). Low enough for fp16's finfo.min (-65504) applied before a 1/sqrt(D) scale, D <= 256.
MASKED_LOGIT_BOUND = -2048.0
_SAMPLE_LENGTHS = (1, 2, 5, 16, 37)
# integer constants up to this are treated as possible length thresholds
_MAX_THRESHOLD = 1 << 24
# the largest mask (S_q x S_kv elements) evaluated at compile time: a square prompt of 16384 positions (Llama 4's
# chunked layers split prompts beyond 8192); such a mask took ~5 s and ~3 GB to evaluate on one CPU core
MAX_SAMPLE_ELEMENTS = 1 << 28


class MaskError(Exception):
    """The mask is not something FA2 computes; the message is the user-facing reason."""


@dataclass(frozen=True)
class MaskKind:
    causal: bool
    window: int | None  # w keys including the diagonal, bottom-right aligned
    # chunked attention (Llama 4's chunked layers): causal within blocks of ``chunk`` key positions (query
    # row i at position i + S_kv - S_q); the rewrite runs one causal attention a block. None: not chunked
    chunk: int | None = None


NO_MASK = MaskKind(False, None)


def classify_allowed(allowed: np.ndarray) -> MaskKind:
    """Classify a boolean (S_q, S_kv) visibility matrix as FA2 mask parameters."""
    s_q, s_kv = allowed.shape
    if allowed.all():
        return NO_MASK
    if not allowed.any(axis=1).all():
        raise MaskError("the mask hides every key from some query row (FA2 returns zeros there)")
    causal = MaskKind(True, None)
    if np.array_equal(allowed, mask_allows(causal, s_q, s_kv)):
        return causal
    if s_q != s_kv and np.array_equal(allowed, np.tri(s_q, s_kv, dtype=bool)):
        raise MaskError("top-left aligned causal mask with S_q != S_kv (FA2's causal is bottom-right)")
    # a window of w keys shows w keys in its widest row
    window = MaskKind(True, int(allowed.sum(axis=1).max()))
    if np.array_equal(allowed, mask_allows(window, s_q, s_kv)):
        return window
    for chunk in _chunk_candidates(allowed):
        chunked = MaskKind(True, None, chunk)
        if np.array_equal(allowed, mask_allows(chunked, s_q, s_kv)):
            return chunked
    raise MaskError("the mask is not a causal, sliding-window or chunked mask")


def _chunk_candidates(allowed: np.ndarray) -> list[int]:
    """The block sizes a chunked mask equal to ``allowed`` could have, smallest first: a row's first visible
    key is the start of its block, a multiple of the size, and no row sees more keys than a block holds (the
    caller compares each candidate's mask with ``allowed``)."""
    starts = allowed.argmax(axis=1)
    starts = starts[starts > 0]
    if not starts.size:  # every row in the first block: a causal mask, not told apart from a chunked one
        return []
    g, widest = int(np.gcd.reduce(starts)), int(allowed.sum(axis=1).max())
    small = [d for d in range(1, math.isqrt(g) + 1) if g % d == 0]
    return sorted(c for c in {*small, *(g // d for d in small)} if c >= widest)


def _chunked_allows(chunk: int, s_q: int, s_kv: int) -> np.ndarray:
    """Causal attention within blocks of ``chunk`` positions (the queries the last s_q positions)."""
    i = np.arange(s_q)[:, None] + (s_kv - s_q)
    j = np.arange(s_kv)[None, :]
    return (j <= i) & (j // chunk == i // chunk)


def mask_allows(kind: MaskKind, s_q: int, s_kv: int) -> np.ndarray:
    """FA2's visibility matrix for ``kind`` (bottom-right aligned causal, window of w keys)."""
    if not kind.causal:
        return np.ones((s_q, s_kv), dtype=bool)
    if kind.chunk is not None:
        return _chunked_allows(kind.chunk, s_q, s_kv)
    i = np.arange(s_q)[:, None]
    j = np.arange(s_kv)[None, :]
    diag = i + (s_kv - s_q)
    allowed = j <= diag
    if kind.window is not None:
        allowed &= j > diag - kind.window
    return allowed


def classify_samples(samples: list[np.ndarray]) -> MaskKind:
    """The one FA2 mask equal to every sampled visibility matrix.

    A sample may fit several kinds (with S_q = 1 a causal mask hides nothing; below its width a
    window is plain causal): the candidates are the kinds each sample classifies as, and the answer
    is the simplest candidate that matches every sample.
    """
    if not samples:
        raise MaskError("no sample sequence lengths with S_q <= S_kv to check the mask at")
    candidates = {classify_allowed(a) for a in samples}
    order = sorted(candidates, key=lambda k: (k.causal, k.chunk is not None, k.window is not None, k.window or 0,
                                              k.chunk or 0))
    for kind in order:
        if all(np.array_equal(a, mask_allows(kind, *a.shape)) for a in samples):
            return kind
    raise MaskError("the mask is not the same causal/window mask at every sequence length")


class MaskEvaluator:
    """Evaluates shape-only sub-graphs of one module, with a cache per mask variable."""

    def __init__(self, mod: tvm.IRModule):
        self.mod = mod
        self._cache = {}

    def evaluate(self, expr, bindings: Bindings, sym_values: dict) -> np.ndarray:
        """Value of ``expr`` with symbolic variables bound to ``sym_values``."""
        if isinstance(expr, Constant):
            return expr.value.numpy()
        key = (expr, tuple(sorted((str(v), int(x)) for v, x in sym_values.items())))
        if key not in self._cache:
            self._cache[key] = self._run(expr, bindings, sym_values)
        return self._cache[key]

    def thresholds(self, expr, bindings: Bindings) -> set[int]:
        """Integer constants of ``expr``'s sub-graph (call arguments, scalar constants, and the
        PrimFuncs it calls): the lengths where a position mask can change shape."""
        found, seen, stack = set(), set(), [expr]

        def add(value):
            value = abs(int(value))
            if 1 < value <= _MAX_THRESHOLD:
                found.add(value)

        def scan_prim(node):
            if isinstance(node, tirx.IntImm) and not str(node.ty).startswith("bool"):
                add(node.value)

        while stack:
            e = stack.pop()
            if isinstance(e, tirx.IntImm):
                scan_prim(e)
                continue
            if isinstance(e, Constant):
                arr = e.value.numpy()
                if arr.size == 1 and arr.dtype.kind in "iu":
                    add(arr.reshape(-1)[0])
                continue
            if isinstance(e, tvm.ir.GlobalVar):
                func = self.mod.functions.get(e) if e in self.mod.functions else None
                if isinstance(func, tirx.PrimFunc):
                    for value in _prim_func_ints(func):
                        add(value)
                continue
            if isinstance(e, relax.Var):
                if e in seen or _is_symbolic_var(e, bindings) or e in bindings.params:
                    continue
                seen.add(e)
                b = bindings.binding.get(e)
                if b is not None:
                    stack.append(b.value)
                continue
            if isinstance(e, relax.Call):
                stack.extend(e.args)
                if isinstance(e.op, tvm.ir.GlobalVar):
                    stack.append(e.op)
            elif isinstance(e, relax.ShapeExpr):
                stack.extend(e.values)
            elif isinstance(e, (relax.Tuple, relax.TupleGetItem)):
                stack.extend(_children(e))
            else:  # a PrimExpr (arange bounds such as past_len + 1)
                relax.analysis.post_order_visit(e, scan_prim)
        return found

    def subgraph(self, expr, bindings: Bindings) -> list:
        """The bound vars ``expr`` is computed from, in order; a MaskError names a runtime input."""
        if isinstance(expr, Constant):
            return []
        needed, order = set(), []

        def visit(e):
            if isinstance(e, relax.Var):
                if _is_symbolic_var(e, bindings):
                    return  # a shape variable used as a value (arange bounds): bound through the shape parameter
                if e in bindings.weights:
                    raise MaskError(_learned_mask_reason(expr, bindings, e))
                if e in bindings.params:
                    raise MaskError(f"the mask depends on the runtime input '{e.name}': the kernels take causal and "
                                    "sliding-window masks they can read off the graph (for a padding mask, pass the "
                                    "sequences unpadded, as R.nn.attention_var_len, or one at a time)")
                b = bindings.binding.get(e)
                value = b.value if b is not None else None
                if value is None:
                    raise MaskError(f"the mask comes from '{e.name}', which is not a binding")
                if e in needed:
                    return
                needed.add(e)
                for sub in _children(value):
                    visit(sub)
                order.append(e)
            elif isinstance(e, relax.Tuple):
                for f in e.fields:
                    visit(f)

        visit(expr)
        return order

    def _function(self, expr, bindings: Bindings):
        """(the mask's sub-graph as a function of one shape parameter, its symbolic variables in order)."""
        key = (expr, "function")
        if key in self._cache:
            return self._cache[key]
        order = self.subgraph(expr, bindings)
        if len(order) > 200:
            raise MaskError("the mask sub-graph is too large to evaluate at compile time")
        block_bindings, scan_inputs = _buildable([bindings.binding[v] for v in order])
        # the function returns the mask and the inputs of the bool scans (checked all False below)
        result = relax.Tuple([expr, *scan_inputs])
        out = relax.Var("mask_value", result.ty)
        block_bindings.append(relax.VarBinding(out, result))
        if any(isinstance(v, relax.DataflowVar) for v in order):
            blocks = [relax.DataflowBlock(block_bindings)]
        else:
            blocks = [relax.BindingBlock(block_bindings)]
        body = relax.SeqExpr(blocks, out)
        free = sorted(relax.analysis.free_symbolic_vars(relax.Function([], body, ret_ty=out.ty)), key=str)
        # the symbolic variables enter through one shape parameter, so one build serves every sample
        shape_param = relax.Var("lengths", relax.ShapeType(free))
        func = relax.Function([shape_param], body, ret_ty=out.ty).with_attr("global_symbol", "mask_main")
        self._cache[key] = (func, free)
        return func, free

    def other_vars(self, expr, bindings: Bindings, lengths) -> list:
        """The symbolic variables of ``expr``'s sub-graph besides the sequence lengths' (``lengths``): a
        batch size, or a length the mask's positions are computed from (HF's sliding-window cache: key
        positions from ``max(past - window + 1, 0)`` over a static count of keys). The mask must be the same
        for every value of them, so the analysis samples them too."""
        if isinstance(expr, Constant):
            return []
        _, free = self._function(expr, bindings)
        return [v for v in free if v not in lengths]

    def _run(self, expr, bindings: Bindings, sym_values):
        func, free = self._function(expr, bindings)
        values = [int(sym_values.get(v, 2)) for v in free]  # every var is sampled (lengths and others); 2: a fallback
        key = (expr, "vm")
        if key not in self._cache:
            try:
                self._cache[key] = self._build(func)
            except Exception as err:  # noqa: BLE001 - tried again per sample below
                self._cache[key] = err
        try:
            if isinstance(self._cache[key], Exception):
                # Shapes the graph left unknown (or symbolic ones TVM cannot lower): bound to the
                # sample, every shape is static and inferred again
                static = func.bind_symbolic_vars(dict(zip(free, values)))
                static = relax.Function([], static.body, ret_ty=static.body.ty).with_attr(
                    "global_symbol", "mask_main")
                result = self._build(static)["mask_main"]()
            else:
                result = self._cache[key]["mask_main"](tvm.runtime.ShapeTuple(values))
            mask, *scanned = (x.numpy() for x in result)
        except Exception as err:  # noqa: BLE001 - any failure means "cannot prove"
            raise MaskError(_not_evaluated(err)) from None
        if any(x.any() for x in scanned):
            raise MaskError("the mask takes a cumulative sum of a bool tensor that is not all False "
                            "(TVM's PyTorch frontend types torch's int64 cumsum of bools as bool)")
        return mask

    def _build(self, func):
        mod = tvm.IRModule({"mask_main": func})
        for gv, f in self.mod.functions.items():
            if isinstance(f, tirx.PrimFunc):
                mod[gv] = f
        return relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())


def _not_evaluated(err) -> str:
    first = (str(err).strip().splitlines() or [""])[-1].strip()[:160]
    detail = f": {first}" if first else ""
    return f"the mask could not be evaluated at compile time ({type(err).__name__}{detail})"


def _buildable(block_bindings):
    """The mask's bindings rewritten around what TVM's frontend emits and its lowering cannot build,
    and the inputs of the bool scans: a ``cumsum`` of bools into bool is computed in int32; bools are
    compared as int8; a binary op whose operand shapes are equal but not provably so (min/max of
    lengths) gets them equal by a runtime-checked match_cast; strided_slice axes become positive.

    TVM's PyTorch frontend keeps the dtype of ``torch.cumsum`` on bools as bool (torch sums in
    int64), which LLVM cannot compile; HF's packed-sequence detection (``use_cache=False``) puts one
    into every causal mask. A bool cumsum has no single meaning, but every reading of it (a sum cast
    to bool, a running OR, a sum mod 2) maps an all-False input to all False, and that is the input
    HF's mask has for positions 0..S-1: the caller checks that the inputs it returns are all False.
    """
    out, scanned = [], []
    for b in block_bindings:
        value = b.value if isinstance(b, relax.VarBinding) else None
        if op_name(value) == "relax.cumsum" and str(value.args[0].ty.dtype) == "bool" and \
                str(b.var.ty.dtype) == "bool":
            x = value.args[0]
            xs = x
            if x.ty.shape is None and x.ty.ndim >= 0:
                # TVM lowers a scan only with a known (possibly symbolic) shape: name the dims
                dims = [tirx.Var(f"{b.var.name}_n{i}", "int64") for i in range(x.ty.ndim)]
                xs = relax.Var(f"{b.var.name}_in", relax.TensorType(dims, "bool"))
                out.append(relax.MatchCast(xs, x, xs.ty))
            axis = value.attrs.axis
            if axis is not None and x.ty.ndim > 0:
                axis = int(axis) % x.ty.ndim  # the scan lowering takes no negative axis
            summed = relax.op.cumsum(relax.op.astype(xs, "int32"), axis, "int32", value.attrs.exclusive)
            b = relax.VarBinding(b.var, relax.op.astype(summed, "bool"))
            scanned.append(x)
        elif op_name(value) in _COMPARISONS and all(str(a.ty.dtype) == "bool" for a in value.args):
            # LLVM codegen compares bools as floats ("fcmp ... i1"): compare them as int8
            a, c = (relax.op.astype(x, "int8") for x in value.args)
            b = relax.VarBinding(b.var, relax.Call(value.op, [a, c], value.attrs))
        elif op_name(value) in _BINARY and b.var.ty.shape is None and _same_rank_shaped(value.args):
            # the frontend's shapes are equal but not provably (min/max of lengths): LegalizeOps skips
            # an op whose output shape is unknown, so say they are equal (the VM checks it)
            first, other = value.args
            cast = relax.Var(f"{b.var.name}_rhs", relax.TensorType(first.ty.shape, other.ty.dtype))
            out.append(relax.MatchCast(cast, other, cast.ty))
            b = relax.VarBinding(b.var, relax.Call(value.op, [first, cast], value.attrs))
        elif op_name(value) in ("relax.full", "relax.full_like") and _infinite_constant(value.args[1]):
            # TVM 0.27's lowering of full() fails on an infinite fill (torch.full((s, s), -inf).triu(1), a
            # causal mask): the dtype's finite extreme of the same sign is as masked (below the bound)
            fill = value.args[1].value.numpy()
            finite = np.nan_to_num(fill, posinf=np.finfo(fill.dtype).max, neginf=np.finfo(fill.dtype).min)
            b = relax.VarBinding(b.var, relax.Call(value.op, [value.args[0], relax.const(finite, str(fill.dtype)),
                                                              *value.args[2:]], value.attrs))
        elif op_name(value) == "relax.strided_slice" and value.args[0].ty.ndim > 0 and \
                isinstance(value.args[1], relax.Tuple):
            # the dynamic strided_slice lowering takes no negative axis
            ndim = value.args[0].ty.ndim
            axes = [int(a.value) % ndim for a in value.args[1].fields]
            b = relax.VarBinding(b.var, relax.Call(value.op, [value.args[0], relax.Tuple(
                [tirx.IntImm("int64", a) for a in axes]), *value.args[2:]], value.attrs))
        out.append(b)
    return out, scanned


def _infinite_constant(expr) -> bool:
    if not isinstance(expr, Constant):
        return False
    data = expr.value.numpy()
    return data.dtype.kind == "f" and bool(np.isinf(data).any())


def _same_rank_shaped(args) -> bool:
    return all(isinstance(a.ty, relax.TensorType) and a.ty.shape is not None for a in args) and \
        len({a.ty.ndim for a in args}) == 1


_BINARY = ("relax.add", "relax.subtract", "relax.multiply", "relax.equal", "relax.not_equal",
           "relax.less", "relax.less_equal", "relax.greater", "relax.greater_equal", "relax.bitwise_and",
           "relax.logical_and")
_COMPARISONS = ("relax.equal", "relax.not_equal", "relax.less", "relax.less_equal", "relax.greater",
                "relax.greater_equal")


def _prim_func_ints(func) -> list[int]:
    # TVM 0.27's wheel exposes no Python visitor over TIR statements; its JSON form lists every IntImm
    nodes = json.loads(tvm.ir.save_json(func))["nodes"]
    return [nodes[n["data"]["value"]]["data"] for n in nodes if n.get("type") == "ir.IntImm"]


def _is_symbolic_var(e, bindings: Bindings) -> bool:
    # TVM 0.27 has one Var class for Relax and TIR variables; a TIR one is a bare PrimType leaf
    return isinstance(e.ty, tvm.ir.PrimType) and e not in bindings.binding and e not in bindings.params


#: ops that pick keys by value: a mask built through one selects per query (sparse attention's top-k)
_SELECTIONS = frozenset({"relax.topk", "relax.argsort", "relax.sort", "relax.argmax", "relax.scatter_elements",
                         "relax.scatter_nd", "relax.gather_elements", "relax.one_hot"})


#: of those, the ones that read values at computed positions: alone they gather a bias (a relative-position
#: table indexed by distance), they select no keys
_READS = frozenset({"relax.gather_elements"})


def _learned_mask_reason(expr, bindings: Bindings, first) -> str:
    """Why a mask computed from model weights stays: the weight nearest to the mask (not the first one a
    depth-first walk meets, often a norm of the hidden states) and the ops that select keys by value (sparse
    attention), or, where the only such op gathers, that it reads a bias per position."""
    nearest, selections, seen, frontier = None, [], set(), [expr]
    while frontier and nearest is None:
        nxt = []
        for e in frontier:
            if not isinstance(e, relax.Var):
                nxt += _children(e)  # a tuple of masks
                continue
            if e in seen:
                continue
            seen.add(e)
            if e in bindings.weights:
                nearest = e
                break
            b = bindings.binding.get(e)
            if b is None:
                continue
            name = op_name(b.value)
            if name in _SELECTIONS and name not in selections:
                selections.append(name)
            nxt += list(_children(b.value))
        frontier = nxt
    weight = (first if nearest is None else nearest).name
    if selections and all(n in _READS for n in selections):
        reads = ", ".join(n.replace("relax.", "R.") for n in selections)
        return (f"the mask is a learned score bias read per query and key position ({reads}) from values computed "
                f"with the model weight '{weight}' (e.g. a relative-position bias conditioned on the hidden states, "
                "data-dependent): the kernels take causal and sliding-window masks they can read off the graph")
    if selections:
        return (f"the mask selects keys by value ({', '.join(n.replace('relax.', 'R.') for n in selections)}) from "
                f"scores computed with the model weight '{weight}' (sparse attention, data-dependent): the kernels "
                "take causal and sliding-window masks they can read off the graph")
    return (f"the mask is computed from the model weight '{weight}' (a learned score bias, data-dependent): the "
            "kernels take causal and sliding-window masks they can read off the graph")


def _children(value):
    if isinstance(value, relax.Call):
        return list(value.args)
    if isinstance(value, relax.Tuple):
        return list(value.fields)
    if isinstance(value, relax.TupleGetItem):
        return [value.tuple_value]
    if isinstance(value, relax.Var):
        return [value]
    return []


def sample_bindings(sym_vars, thresholds=(), lower=None) -> list[dict]:
    """Concrete values for the symbolic variables: a handful of small combinations, and around each
    threshold ``c`` (see :meth:`MaskEvaluator.thresholds`) the values c - 1 and c + 2 given to each
    variable alone (the others 1), and c + 2 to all of them at once. ``lower``: {name: lower bound} (the
    function's ``tir_var_lower_bound``, torch.export's range): values below it are raised to it, and the
    bound itself is sampled; the graph holds from there on only (a sliding-window decode whose past length
    torch.export bounds below by the window)."""
    sym_vars = sorted(set(sym_vars), key=lambda v: v.name)
    if not sym_vars:
        return [{}]
    combos = itertools.product(_SAMPLE_LENGTHS, repeat=len(sym_vars))
    picked = list(itertools.islice(combos, 0, None, max(1, len(_SAMPLE_LENGTHS) ** len(sym_vars) // 8)))
    for c in sorted(thresholds):
        # just below and just above (a window of c keys shows from c + 1 keys on)
        for value in (c - 1, c + 2):
            for var in sym_vars:
                picked.append(tuple(value if v is var else 1 for v in sym_vars))
        if len(sym_vars) > 1:
            picked.append((c + 2,) * len(sym_vars))
    lows = [(lower or {}).get(v.name) for v in sym_vars]
    if any(lo is not None for lo in lows):
        for i, lo in enumerate(lows):
            if lo is not None:
                picked.append(tuple(lo if j == i else 1 for j in range(len(lows))))
        picked = [tuple(x if lo is None else max(x, lo) for x, lo in zip(p, lows)) for p in picked]
    unique = list(dict.fromkeys(picked))
    return [dict(zip(sym_vars, c)) for c in unique]


def combine_samples(lengths: list[dict], others: list[dict]) -> list[dict]:
    """The samples of the sequence lengths' variables each joined with one of the other variables' (taken in
    turn, every one of either list used at least once): the lengths keep their own combinations, and the mask
    is still checked at every sampled value of the others."""
    n = max(len(lengths), len(others))
    return [{**lengths[i % len(lengths)], **others[i % len(others)]} for i in range(n)]


def allowed_from_mask(kind: str, value: np.ndarray, s_q: int, s_kv: int, post_scale: float) -> np.ndarray:
    """Visibility matrix of a mask operand, one (S_q, S_kv) slice shared by every batch and head.

    kind: "add" (additive mask), "min" (minimum(scores, mask): a large value keeps the score),
    "where-keep" (where(cond, scores, fill): True keeps), "where-drop" (where(cond, fill, scores)).
    """
    value = np.asarray(value)
    # one slice per leading index (batch, heads; a grouped view's two head axes)
    slices = value.reshape((-1,) + value.shape[-2:]) if value.ndim >= 2 else value.reshape((1, 1, -1))
    # compare the slices the mask really has (not its broadcast): masks reach 10^8 elements here
    first = slices[0]
    if not all(np.array_equal(x, first) for x in slices[1:]):
        raise MaskError("the mask differs between batches or heads (a padding mask, or a bias such as ALiBi's "
                        "per-head slopes: the kernels are built without ALiBi)")
    try:
        first = np.broadcast_to(first, (s_q, s_kv))
    except ValueError:
        raise MaskError(f"the mask of shape {value.shape} does not broadcast to ({s_q}, {s_kv})") from None
    if kind in ("where-keep", "where-drop"):
        allowed = first.astype(bool)
        return allowed if kind == "where-keep" else ~allowed
    if kind == "add":
        visible = first == 0
    elif kind == "min":
        visible = first >= np.finfo(np.float16).max
    else:
        raise AssertionError(kind)
    # hidden: value * post_scale <= MASKED_LOGIT_BOUND, without a float64 copy of the mask
    if post_scale > 0:
        hidden = _compare(first, MASKED_LOGIT_BOUND / post_scale, below=True)
    elif post_scale < 0:
        hidden = _compare(first, MASKED_LOGIT_BOUND / post_scale, below=False)
    else:
        hidden = np.zeros(first.shape, dtype=bool)
    if not (visible | hidden).all():
        raise MaskError("the mask holds values that are neither 0 nor a large negative number (a bias)")
    return np.ascontiguousarray(visible)


def _compare(values: np.ndarray, threshold: float, below: bool) -> np.ndarray:
    """values <= threshold (``below``) or >= threshold, in the values' own dtype (no float64 copy):
    a threshold past the dtype's finite range is met by every value or only by one infinity."""
    if values.dtype.kind == "f" and abs(threshold) > float(np.finfo(values.dtype).max):
        if (threshold > 0) == below:  # e.g. <= +huge: every value
            return np.ones(values.shape, dtype=bool)
        return np.isneginf(values) if below else np.isposinf(values)
    return values <= threshold if below else values >= threshold
