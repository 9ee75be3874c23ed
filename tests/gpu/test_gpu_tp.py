"""TVM's disco with our NCCL library on one GPU: a ``ThreadedSession`` of one worker, ``init_ccl("nccl", 0)``
served by ``runtime.disco.nccl.*`` of mqa_byoc, disco's collectives (Python API and a compiled Relax
function of ``R.ccl.*``), and a decoder library built with ``tensor_parallel_shards=1`` run through the
session, against the same library run directly and an fp32 CPU reference. Several GPUs are needed for
N > 1 (NCCL takes one GPU per rank); the CPU tests (tests/test_tp_sharding.py) check the shards' numerics.
Artifacts: ``python tools/gpu/build_tp.py``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

import gpu_common

ARTIFACTS = Path(os.environ.get("MQA_BYOC_GPU_TP_ARTIFACTS", gpu_common.ROOT / ".gpu-artifacts" / "tp"))
MANIFEST = json.loads((ARTIFACTS / "manifest.json").read_text()) if (ARTIFACTS / "manifest.json").is_file() else None
TIMED_STEPS = 30
FATBIN_STATS = {"hits": 0, "misses": 0, "miss_compile_s": 0.0}


def _record(rt, key, value):
    """Into the run's results (MQA_BYOC_GPU_RESULTS), and printed at once (a worker that aborts the
    process takes the results file with it)."""
    rt.results.setdefault("tp", {})[key] = value
    print("tp result", key, json.dumps(value), flush=True)


@pytest.fixture(scope="module")
def sess(rt):
    if MANIFEST is None:
        pytest.skip(f"no artifacts in {ARTIFACTS}: run `python tools/gpu/build_tp.py` on the build machine")
    from mqa_byoc.testing.fatbin_cache import serve_fatbins

    from mqa_byoc import tp

    with serve_fatbins(str(ARTIFACTS / "fatbins"), FATBIN_STATS):
        lib = tp.load_disco_nccl(ARTIFACTS / MANIFEST["nccl_library"], build=False)
        assert lib is not None, "this TVM has an NCCL CCL of its own"
        s = tp.disco().ThreadedSession(1)
        t0 = time.time()
        s.init_ccl("nccl", 0)  # asynchronous: the worker runs init_ccl_per_worker
        s.sync_worker_0()
        _record(rt, "init_ccl_s", round(time.time() - t0, 3))
        yield s
        s.shutdown()


def _on_worker(sess, name, *args):
    return sess.call_packed(sess.get_global_func(name), *args).debug_get_from_remote(0)


@pytest.mark.gpu
def test_init_ccl_with_our_library(rt, sess):
    dev = _on_worker(sess, "runtime.disco.device")  # init_ccl_per_worker made cuda:0 the worker's device
    assert "cuda" in str(dev).lower() and "0" in str(dev), dev
    version = _on_worker(sess, "mqa_byoc.disco_nccl.nccl_version")
    assert version >= 21800  # ncclCommSplit
    _record(rt, "nccl_version_on_worker", int(version))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_collectives_through_the_session(rt, sess, dtype):
    tvm = rt.tvm
    if dtype == "bfloat16":
        import ml_dtypes

        x = np.random.default_rng(0).standard_normal((4, 64)).astype(ml_dtypes.bfloat16)
    else:
        x = np.random.default_rng(0).standard_normal((4, 64)).astype(dtype)
    host = tvm.runtime.tensor(x)
    src = sess.copy_to_worker_0(host)
    checks = {}
    for op in ("sum", "avg", "max", "min", "prod"):
        dst = sess.empty(x.shape, dtype)
        sess.allreduce(src, dst, op=op)
        checks[f"allreduce_{op}"] = dst
    dst = sess.empty(x.shape, dtype)
    sess.allgather(src, dst)
    checks["allgather"] = dst
    checks["broadcast"] = sess.broadcast(host)
    checks["scatter"] = sess.scatter(tvm.runtime.tensor(np.ascontiguousarray(x[None])))  # (workers, ...)
    dst = sess.empty(x.shape, dtype)
    sess.gather_to_worker0(src, dst)
    checks["gather_to_worker0"] = dst
    sess.sync_worker_0()  # runtime.disco.nccl.sync_worker
    for name, ref in checks.items():
        out = tvm.runtime.empty(x.shape, dtype)
        sess.copy_from_worker_0(out, ref)
        sess.sync_worker_0()
        np.testing.assert_array_equal(out.numpy().astype(np.float32), x.astype(np.float32), err_msg=name)
    _record(rt, f"collectives_{dtype}", sorted(checks))


@pytest.mark.gpu
def test_compiled_collectives(rt, sess):
    tvm = rt.tvm
    mod = sess.load_vm_module(str(ARTIFACTS / MANIFEST["ccl"]))
    x = np.random.default_rng(1).standard_normal((4, 64)).astype("float16")
    res = mod["main"](sess.copy_to_worker_0(tvm.runtime.tensor(x)))
    sess.sync_worker_0()
    outs = res.debug_get_from_remote(0)
    assert len(outs) == 4
    for o in outs:  # allreduce sum, avg, allgather, broadcast_from_worker0 over one worker: x
        np.testing.assert_array_equal(o.numpy(), x)
    _record(rt, "compiled_collectives", ["allreduce sum", "allreduce avg", "allgather", "broadcast_from_worker0"])


def _weights(side):
    from types import SimpleNamespace

    from mqa_byoc.models.llama import random_params

    spec = [SimpleNamespace(name=n, shape=tuple(s), dtype=d) for n, s, d in side["params"]]
    return random_params(spec, seed=MANIFEST["seed"])


@pytest.mark.gpu
def test_decoder_library_through_disco(rt, sess):
    tvm = rt.tvm
    from tvm.runtime.vm import VirtualMachine

    from mqa_byoc.sidecar import read_sidecar

    path = str(ARTIFACTS / MANIFEST["decoder"])
    side = read_sidecar(path)
    assert side["tensor_parallel_shards"] == 1 and side["offloaded"] == {"flash_attn.attention_mqa": 4}
    inputs = np.load(ARTIFACTS / "inputs.npz")
    weights = _weights(side)
    getitem = sess.get_global_func("vm.builtin.tuple_getitem")

    # through the session: weights and tokens copied to worker 0, the VM module loaded there
    dmod = sess.load_vm_module(path)
    from mqa_byoc.tp import scatter_shards
    from mqa_byoc.tp.sharding import ShardPlan

    plan = ShardPlan(side["num_heads"], side["num_kv_heads"], side["head_dim"], side["intermediate_size"], 1)
    names = [n for n, _, _ in side["params"]]
    dparams = scatter_shards(sess, names, weights, plan)  # cut weights scattered, the rest broadcast
    ids, nxt = (sess.copy_to_worker_0(tvm.runtime.tensor(inputs[k])) for k in ("ids", "nxt"))
    pre = dmod["prefill"](ids, *dparams)
    caches = sess.call_packed(getitem, pre, 1)
    dec = dmod["decode"](nxt, caches, *dparams)
    sess.sync_worker_0()
    got_pre = pre.debug_get_from_remote(0)[0].numpy()
    got_dec = dec.debug_get_from_remote(0)[0].numpy()

    # the same library directly, on this thread
    vm = VirtualMachine(tvm.runtime.load_module(path), tvm.cuda(0))
    params = [tvm.runtime.tensor(w, tvm.cuda(0)) for w in weights]
    want_pre, want_caches = vm["prefill"](tvm.runtime.tensor(inputs["ids"], tvm.cuda(0)), *params)
    want_dec, _ = vm["decode"](tvm.runtime.tensor(inputs["nxt"], tvm.cuda(0)), want_caches, *params)
    np.testing.assert_array_equal(got_pre, want_pre.numpy())
    np.testing.assert_array_equal(got_dec, want_dec.numpy())

    # and the fp32 CPU reference of the same weights
    errs = {}
    for name, got, ref in (("prefill", got_pre, inputs["ref_prefill"]), ("decode", got_dec, inputs["ref_decode"])):
        err = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-6))
        assert err < 2e-2, (name, err)
        assert int(got.argmax()) == int(ref.argmax()) or np.sort(ref.ravel())[-1] - np.sort(ref.ravel())[-2] < 1e-2
        errs[name] = round(err, 6)

    # decode step time through the session vs directly (one worker; the ratio is the session's cost)
    def timed(step):
        step()
        t0 = time.perf_counter()
        for _ in range(TIMED_STEPS):
            step()
        return (time.perf_counter() - t0) / TIMED_STEPS * 1e6

    d_nxt = tvm.runtime.tensor(inputs["nxt"], tvm.cuda(0))
    direct_us = timed(lambda: (vm["decode"](d_nxt, want_caches, *params), tvm.cuda(0).sync()))
    disco_us = timed(lambda: (dmod["decode"](nxt, caches, *dparams), sess.sync_worker_0()))
    _record(rt, "decoder", {
        "library": MANIFEST["decoder"], "heads": [MANIFEST["config"]["num_heads"], MANIFEST["config"]["num_kv_heads"]],
        "max_rel_err_vs_fp32_cpu": errs, "disco_equals_direct": True,
        "decode_step_us": {"direct": round(direct_us, 1), "disco_1_worker": round(disco_us, 1),
                           "ratio": round(disco_us / direct_us, 3)},
        "fatbins": FATBIN_STATS})
