"""The grid rule of our grouped-query decode kernel (native/gqa_decode.cu, host side): every key in a
split, no empty split, at most one wave of CTAs, the scratch it sizes; refusals of what it cannot serve.
The support object compiled by nvcc, called through ctypes (no GPU needed)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from mqa_byoc import kernels as K
from mqa_byoc.kernels.decode_rule import decode_kernel_serves, rows_per_cta
from mqa_byoc.testing.decode_kernel import DecodeArgs, DecodePlan, set_plan_argtypes

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or not K.nvcc_available(), reason="needs g++ and nvcc")
SMS = 132  # the H200's
#: co-resident clusters of n = 1..16 blocks of the cluster kernel on the H200 per (head dim, M tiles a warp)
#: (head dim 128, and 64 with two or three tiles: one CTA per SM; 64 with one: two), as
#: mqa_byoc_decode_cluster_capacity reported it there (fp16, contiguous and paged alike)
H200_CAPACITY = {(128, 1): [132, 66, 39, 30, 22, 17, 15, 15, 9, 7, 7, 7, 7, 7, 7, 7],
                 (64, 1): [264, 132, 79, 62, 47, 39, 32, 30, 23, 21, 16, 16, 14, 14, 14, 14],
                 (64, 2): [132, 66, 39, 30, 22, 17, 15, 15, 9, 7, 7, 7, 7, 7, 7, 7],
                 (64, 3): [132, 66, 39, 30, 22, 17, 15, 15, 9, 7, 7, 7, 7, 7, 7, 7]}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    from mqa_byoc.kernels.build import static_cudart, support_object

    out = tmp_path_factory.mktemp("decode") / "decode_host.so"
    subprocess.run(["g++", "-shared", "-o", str(out), str(support_object("sm_90", None)), *static_cudart("sm_90")],
                   check=True)
    lib = ctypes.CDLL(str(out))
    set_plan_argtypes(lib)
    return lib


def _plan(lib, *, heads=64, heads_k=8, dim=128, batch=1, seqlen=4096, window_left=-1, pages=None, clusters=True):
    a = DecodeArgs()
    a.softmax_scale = dim ** -0.5
    a.batch, a.num_heads, a.num_heads_k, a.head_dim, a.seqlen_k = batch, heads, heads_k, dim, seqlen
    a.window_left = window_left
    if pages is not None:  # (nnz_pages, page_size): only the counts matter to the plan
        a.page_values, a.nnz_pages, a.page_size = 1, *pages
    p = DecodePlan()
    key = (dim, rows_per_cta(dim) // 16)
    cap = (ctypes.c_int * 16)(*H200_CAPACITY[key]) if clusters and key in H200_CAPACITY else None
    return lib.mqa_byoc_decode_make_plan(ctypes.byref(a), 0, SMS, cap, ctypes.byref(p)), p


@pytest.mark.parametrize("heads,heads_k,dim", [(64, 8, 128), (32, 8, 128), (16, 16, 128), (71, 1, 64), (40, 2, 64),
                                               (48, 1, 128)])
@pytest.mark.parametrize("seqlen", [1, 100, 1024, 4096, 16384, 32768, 131072, 1_000_000])
@pytest.mark.parametrize("clusters", [True, False])
def test_contiguous_plan_covers_every_key_in_one_wave(lib, heads, heads_k, dim, seqlen, clusters):
    rc, p = _plan(lib, heads=heads, heads_k=heads_k, dim=dim, seqlen=seqlen, clusters=clusters)
    assert rc == 0
    rows = rows_per_cta(dim)
    assert p.row_tiles * 16 == rows == lib.mqa_byoc_decode_rows_per_cta(dim) == 16  # the measured rule
    assert p.row_groups == -(-(heads // heads_k) // rows)
    # 4 warps a CTA for splits of at most two tiles a warp of 8, each warp at least one tile
    assert p.warps == (4 if p.keys_per_split <= 256 else 8)
    assert p.keys_per_split % (16 * p.warps) == 0 and p.splits * p.keys_per_split >= seqlen
    assert (p.splits - 1) * p.keys_per_split < seqlen  # no split without keys
    slots = heads_k * p.row_groups
    assert p.splits <= 32 and slots * p.splits <= max(SMS, slots)  # one wave (one CTA per SM)
    if clusters and 1 < p.splits <= 16:  # a cluster's worth: every slot's cluster co-resident
        assert H200_CAPACITY[dim, p.row_tiles][p.splits - 1] >= slots
    per_split = slots * p.splits * rows
    assert p.workspace_bytes == ((per_split * dim + per_split) * 4 if p.splits > 1 else 0)
    assert p.counters == (slots if p.splits > 1 else 0)


@pytest.mark.parametrize("heads,heads_k,dim,seqlen,batch,splits", [
    (64, 8, 128, 2048, 1, 8), (64, 8, 128, 32768, 1, 8),  # 8 slots: clusters of 8 fill half the GPU
    (71, 1, 64, 16384, 1, 16), (71, 1, 64, 32768, 1, 26),  # Falcon: 5 row groups x 16 (two CTAs per SM), then 26
    (71, 1, 64, 1024, 1, 16),  # 4-warp CTAs: splits of 64 keys (8 warps: at least 128)
    (32, 4, 128, 16384, 1, 16), (32, 4, 128, 32768, 1, 32),  # clusters of 16 in 4 GPCs: up to ~1630 keys a split
    (8, 1, 128, 8192, 1, 16), (8, 1, 128, 16384, 1, 32),  # one slot: a cluster of 16 up to ~890 keys a split
    (48, 1, 128, 16384, 1, 16), (48, 1, 128, 32768, 1, 32),  # three slots: up to ~1380
    (32, 1, 64, 16384, 1, 16), (32, 1, 64, 32768, 1, 32),  # two slots: up to ~1140
    (64, 8, 128, 4096, 2, 4), (64, 8, 128, 4096, 4, 2), (32, 8, 128, 100, 1, 1)])
def test_plan_sizes_splits_for_the_cluster_merge(lib, heads, heads_k, dim, seqlen, batch, splits):
    """Where the splits merging in a cluster pays (make_plan's rule), the plan makes a cluster's worth."""
    rc, p = _plan(lib, heads=heads, heads_k=heads_k, dim=dim, batch=batch, seqlen=seqlen)
    assert rc == 0 and p.splits == splits and p.merge == 0  # MQA_BYOC_DECODE_MERGE_AUTO
    rc, q = _plan(lib, heads=heads, heads_k=heads_k, dim=dim, batch=batch, seqlen=seqlen, clusters=False)
    target = min(32, max(1, SMS // (batch * heads_k * p.row_groups)))
    assert rc == 0 and q.splits == -(-seqlen // _split_keys(seqlen, target))


def _split_keys(seqlen, target):
    """The workspace plan's split: a target share of the keys in whole tiles of 8 warps (128 keys), or of
    4 warps (64) where that is at most 256 keys and the sequence needs more than one split."""
    def whole(unit):
        return -(-max(-(-seqlen // target), unit) // unit) * unit
    kps = whole(128)
    return whole(64) if kps <= 256 and kps < seqlen else kps


def test_window_limits_the_split_count(lib):
    _, full = _plan(lib, seqlen=32768)
    rc, win = _plan(lib, seqlen=32768, window_left=100)
    assert rc == 0 and full.splits > 1 and win.splits == 1 and win.workspace_bytes == 0


@pytest.mark.parametrize("batch,pages,page", [(8, 8 * 64, 256), (32, 32 * 16, 128), (4, 4 * 8, 128), (64, 64 * 128, 16)])
def test_paged_grid_covers_twice_a_typical_sequence(lib, batch, pages, page):
    """On pages the plan cannot see the lengths: its grid covers twice a typical sequence (an even share of
    the pages) at its split size (a sequence of up to twice the mean keeps it), not the longest one the
    pages could hold (all of them: a grid mostly of CTAs without keys); the kernel cuts a longer sequence
    into larger splits. The scratch is the grid's."""
    rc, p = _plan(lib, batch=batch, seqlen=0, pages=(pages, page))
    typical = pages * page // batch
    assert rc == 0 and p.splits == -(-2 * typical // p.keys_per_split)
    assert p.splits * p.keys_per_split < pages * page  # not the longest possible sequence's
    slots = batch * 8 * p.row_groups
    assert p.workspace_bytes == slots * p.splits * 16 * (128 + 1) * 4 and p.counters == slots


@pytest.mark.parametrize("batch,seqlen", [(4, 2048), (8, 2048), (8, 16384), (16, 2048), (32, 2048), (64, 4096)])
def test_paged_plan_takes_the_contiguous_split_in_twice_its_grid(lib, batch, seqlen):
    """Pages of sequences that all hold `seqlen` keys against the same K/V contiguous (lengths known): the
    same split size, in a grid of twice a sequence's keys (on pages a sequence may be longer than the mean);
    one sequence on pages (its length known) gets the contiguous plan."""
    _, c = _plan(lib, batch=batch, seqlen=seqlen)
    _, p = _plan(lib, batch=batch, seqlen=0, pages=(batch * seqlen // 128, 128))
    assert p.keys_per_split == c.keys_per_split and p.splits == -(-2 * seqlen // c.keys_per_split)
    _, c1 = _plan(lib, batch=1, seqlen=seqlen)
    _, p1 = _plan(lib, batch=1, seqlen=0, pages=(seqlen // 128, 128))
    assert (p1.splits, p1.keys_per_split) == (c1.splits, c1.keys_per_split)


def test_plan_for_a_given_grid(lib):
    """plan_grid (the benchmark's sweep of grids): the split size and grid asked for, the scratch for that
    grid; refused past the merging CTA's 128 splits, or for no splits."""
    a = DecodeArgs()
    a.softmax_scale = 128 ** -0.5
    a.batch, a.num_heads, a.num_heads_k, a.head_dim, a.seqlen_k, a.window_left = 4, 64, 8, 128, 0, -1
    a.page_values, a.nnz_pages, a.page_size = 1, 4 * 16, 128  # 4 sequences of 2k keys on average
    p = DecodePlan()
    assert lib.mqa_byoc_decode_plan_grid(ctypes.byref(a), 1024, 4, 0, ctypes.byref(p)) == 0
    assert (p.splits, p.keys_per_split, p.counters) == (4, 1024, 4 * 8)
    assert p.workspace_bytes == 4 * 8 * 4 * 16 * (128 + 1) * 4
    assert lib.mqa_byoc_decode_plan_split(ctypes.byref(a), 1024, 0, ctypes.byref(p)) == 0 and p.splits == 2
    assert lib.mqa_byoc_decode_plan_grid(ctypes.byref(a), 1024, 129, 0, ctypes.byref(p)) == 2
    assert lib.mqa_byoc_decode_plan_grid(ctypes.byref(a), 1024, 0, 0, ctypes.byref(p)) == 2


@pytest.mark.parametrize("heads,heads_k,dim,batch", [(64, 8, 96, 1), (64, 8, 256, 1), (10, 4, 128, 1), (64, 8, 128, 0)])
def test_refuses_what_it_cannot_serve(lib, heads, heads_k, dim, batch):
    assert lib.mqa_byoc_decode_supported(dim, heads, heads_k) == int(dim in (64, 128) and heads % heads_k == 0)
    assert _plan(lib, heads=heads, heads_k=heads_k, dim=dim, batch=batch)[0] == 2


@pytest.mark.parametrize("dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("heads,heads_k", [(64, 8), (32, 8), (16, 1), (32, 1), (33, 1), (71, 1), (12, 4), (10, 4)])
def test_offload_reports_rule_is_the_kernels(lib, dim, heads, heads_k):
    """decode_kernel_serves (offload_report's) == the kernel plans the call (every group size, in 16-row CTAs)."""
    rc, p = _plan(lib, heads=heads, heads_k=heads_k, dim=dim)
    assert decode_kernel_serves(dim, heads, heads_k) == (rc == 0)


def test_plan_for_a_given_split_size(lib):
    """plan_split (the benchmark's sweep) with make_plan's split size gives make_plan's plan; it refuses a
    size that is not whole warps' tiles or that makes more splits than the merging CTA holds."""
    a = DecodeArgs()
    a.softmax_scale = 128 ** -0.5
    a.batch, a.num_heads, a.num_heads_k, a.head_dim, a.seqlen_k, a.window_left = 1, 64, 8, 128, 32768, -1
    made, again = DecodePlan(), DecodePlan()
    cap = (ctypes.c_int * 16)(*H200_CAPACITY[128, 1])
    assert lib.mqa_byoc_decode_make_plan(ctypes.byref(a), 0, SMS, cap, ctypes.byref(made)) == 0
    assert made.overlap == 1  # launched as a programmatic dependent unless the library's options say off
    assert lib.mqa_byoc_decode_plan_split(ctypes.byref(a), made.keys_per_split, 0, ctypes.byref(again)) == 0
    fields = [f for f, _ in DecodePlan._fields_]
    assert [getattr(again, f) for f in fields] == [getattr(made, f) for f in fields]
    assert lib.mqa_byoc_decode_plan_split(ctypes.byref(a), 512, 0, ctypes.byref(again)) == 0 and again.splits == 64
    assert lib.mqa_byoc_decode_plan_split(ctypes.byref(a), 100, 0, ctypes.byref(again)) == 2  # not 16-key tiles
    assert lib.mqa_byoc_decode_plan_split(ctypes.byref(a), 128, 0, ctypes.byref(again)) == 2  # 256 splits
    for scale in (0.0, -0.125, float("inf"), float("nan")):  # the running max needs a positive scale
        a.softmax_scale = scale
        assert lib.mqa_byoc_decode_make_plan(ctypes.byref(a), 0, SMS, cap, ctypes.byref(again)) == 2, scale


@pytest.mark.parametrize("heads,heads_k,dim,tiles,ok", [
    (71, 1, 64, 1, True), (71, 1, 64, 2, True), (71, 1, 64, 3, True), (71, 1, 64, 4, False),
    (16, 1, 64, 2, True), (8, 1, 64, 2, False),  # RowsAsN (at most 8 rows) has one tile
    (71, 1, 128, 1, True), (71, 1, 128, 2, False)])  # head dim 128: one tile
def test_plan_for_given_row_tiles(lib, heads, heads_k, dim, tiles, ok):
    """make_plan and plan_split for a given number of M tiles a warp (a benchmark's sweep): CTAs of 16 x tiles
    query rows and the scratch for them, refused where no kernel carries that many. The packaged object
    compiles one tile a warp (more were measured no faster), so it refuses 2 and 3 too; the kernel's own
    build for its tests and benchmarks (-DMQA_BYOC_DECODE_ROW_TILES=3) serves them on the GPU."""
    assert lib.mqa_byoc_decode_max_row_tiles() == 1
    ok = ok and tiles <= 1
    a = DecodeArgs()
    a.softmax_scale = dim ** -0.5
    a.batch, a.num_heads, a.num_heads_k, a.head_dim, a.seqlen_k, a.window_left = 2, heads, heads_k, dim, 4096, -1
    p, q = DecodePlan(), DecodePlan()
    rc = lib.mqa_byoc_decode_make_plan(ctypes.byref(a), tiles, SMS, None, ctypes.byref(p))
    assert rc == (0 if ok else 2)
    assert lib.mqa_byoc_decode_plan_split(ctypes.byref(a), 512, tiles, ctypes.byref(q)) == rc
    if ok:
        for plan in (p, q):
            assert plan.row_tiles == tiles and plan.row_groups == -(-(heads // heads_k) // (16 * tiles))
            rows = 2 * plan.row_groups * plan.splits * 16 * tiles  # batch x row groups x splits x rows a CTA
            assert plan.workspace_bytes == (rows * (dim + 1) * 4 if plan.splits > 1 else 0)


def _shared_layout(heads, heads_k):
    group = heads // heads_k
    warps = min(8, -(-group // 16))
    return warps, -(-group // (16 * warps))


def _rule_takes_shared(heads, heads_k, batch, tile_pages):
    """The rule's SharedTiles threshold: groups of more than 16 at head dim 64, from 12 slots (sequences x
    K/V heads x row groups) for CTAs of 4 row tiles or more (8 on pages: packed splits, 4 for CTAs of 5 row
    tiles); for fewer from
    48, or from 16 where they run two key groups (at most 2 row tiles) on pages of a multiple of 64 keys."""
    warps, row_groups = _shared_layout(heads, heads_k)
    least = ((4 if warps == 5 else 8) if tile_pages else 12) if warps >= 4 else 16 if warps <= 2 and tile_pages else 48
    return heads // heads_k > 16 and batch * heads_k * row_groups >= least


@pytest.mark.parametrize("heads,heads_k", [(71, 1), (40, 2), (17, 1), (48, 1), (128, 1), (200, 1), (64, 8)])
@pytest.mark.parametrize("batch", [1, 8, 11, 12, 15, 16, 23, 24, 32, 48, 64, 256])
@pytest.mark.parametrize("paged", [False, True])
def test_shared_tiles_plan(lib, heads, heads_k, batch, paged):
    """The rule takes SharedTiles at head dim 64 for groups of more than 16 from 12 slots (sequences x K/V
    heads x row groups) on (8 on pages for CTAs of 4 row tiles or more), for CTAs of fewer than 4 row tiles
    from 48 (16 with two key groups on pages of 256): the group's row tiles as the
    warps of a CTA (at most 8, then row groups; up to 2 of them in two key groups: twice the warps), at
    most 16 splits a slot (a cluster's worth) of whole 64-key tiles and at least 256 keys, about the CTAs
    the SMs hold (16 warps an SM), and their scratch; otherwise the classic blocks. On pages, where the
    slots' splits would not merge in clusters of at most 16, and for CTAs of 4 row tiles or more always:
    packed splits (shared_tiles 2) instead."""
    seqlen = 16384
    pages = (batch * seqlen // 256, 256) if paged else None
    rc, p = _plan(lib, heads=heads, heads_k=heads_k, dim=64, batch=batch, seqlen=0 if paged else seqlen, pages=pages)
    assert rc == 0
    warps, row_groups = _shared_layout(heads, heads_k)
    slots = batch * heads_k * row_groups
    shared = _rule_takes_shared(heads, heads_k, batch, paged)
    ctas_per_sm = min(16 // warps, 4)  # 16 warps, and about 50 KB of shared memory a CTA
    if not shared:
        assert p.shared_tiles == 0 and p.row_tiles == 1 and p.warps in (4, 8)
        return
    cap = H200_CAPACITY[(64, 1)]
    target = min(16, max(1, ctas_per_sm * SMS // slots))
    cluster = max((n for n in (2, 4, 8, 16) if cap[n - 1] >= slots), default=0)
    target = max(target, cluster)
    clustered = warps < 4 and 1 < target <= 16 and cap[target - 1] >= slots
    assert p.warps == warps * (2 if warps <= 2 else 1) and p.row_groups == row_groups and p.row_tiles == 1
    if paged and not clustered:
        _assert_packed(p, heads_k, batch, warps, row_groups, ctas_per_sm)
        return
    assert p.shared_tiles == 1
    assert p.keys_per_split % 64 == 0 and p.keys_per_split >= 256 and 1 <= p.splits <= 16
    assert slots * p.splits <= max(slots, ctas_per_sm * SMS)
    assert p.splits * p.keys_per_split >= seqlen or paged  # (a sequence longer than typical cuts bigger splits)
    rows = 16 * warps
    per_split = slots * p.splits * rows
    # the partials, their LSEs and each slot's (first partial, splits) for the merge kernel; no counters
    assert p.workspace_bytes == ((per_split * 64 + per_split) * 4 + slots * 8 if p.splits > 1 else 0)
    assert p.counters == 0


def _assert_packed(p, heads_k, batch, warps, row_groups, ctas_per_sm):
    """A packed SharedTiles plan: the grid's x the CTAs the SMs hold per (K/V head, row group) (CTAs of 5 row
    tiles: at most two an SM up to 32 sequences), at least one a sequence; splits of at least 256 keys (128 for CTAs of 5
    row tiles; the kernel sizes them); one partial a CTA in the scratch
    and a (first partial, splits) pair a slot, merged by the merge kernel (no arrival counters)."""
    # Falcon's 71 rows: splits of 128 keys at least, two CTAs an SM (not the three it holds) up to 32 sequences
    # (the tests' pages are of whole 64-key tiles)
    wide = warps == 5
    grid = max((min(ctas_per_sm, 2) if wide and batch <= 32 else ctas_per_sm) * SMS // (heads_k * row_groups), batch)
    rows = 16 * warps
    assert p.shared_tiles == 2 and p.splits == grid and p.keys_per_split == (128 if wide else 256) and p.merge == 1
    assert p.warps == warps * (2 if warps <= 2 else 1)  # two key groups up to 2 row tiles
    assert p.o_part_floats == heads_k * row_groups * grid * rows * 64
    assert p.workspace_bytes == (heads_k * row_groups * grid * rows * 65) * 4 + batch * heads_k * row_groups * 8
    assert p.counters == 0


@pytest.mark.parametrize("heads,heads_k", [(71, 1), (40, 2), (200, 1)])
@pytest.mark.parametrize("batch", [16, 24, 32, 64, 1000, 12288, 12289])
def test_packed_splits_plan(lib, heads, heads_k, batch):
    """Without the clusters' capacity (no cluster merge possible) every paged SharedTiles call whose
    lengths fit the kernel's main buffer (12288 sequences) gets packed splits, whatever the lengths; past
    that, and on contiguous K/V, the per-sequence splits."""
    warps, row_groups = _shared_layout(heads, heads_k)
    for seqlen in (64, 16384):
        rc, p = _plan(lib, heads=heads, heads_k=heads_k, dim=64, batch=batch, pages=(batch * seqlen // 64, 64),
                      seqlen=0, clusters=False)
        assert rc == 0
        if not _rule_takes_shared(heads, heads_k, batch, True):
            assert p.shared_tiles == 0
        elif batch <= 12288:
            _assert_packed(p, heads_k, batch, warps, row_groups, min(16 // warps, 4))
        else:
            assert p.shared_tiles == 1
        rc, p = _plan(lib, heads=heads, heads_k=heads_k, dim=64, batch=batch, seqlen=seqlen, clusters=False)
        assert rc == 0 and p.shared_tiles == int(_rule_takes_shared(heads, heads_k, batch, False))


def test_launch_refuses_a_packed_plan_it_cannot_run(lib):
    """mqa_byoc_decode_launch checks a packed plan before it launches anything: more sequences than the
    main buffer holds, fewer CTAs than sequences or splits below one tile (2), a cluster merge (4)."""
    rc, p = _plan(lib, heads=71, heads_k=1, dim=64, batch=32, pages=(32 * 64, 256), seqlen=0, clusters=False)
    assert rc == 0 and p.shared_tiles == 2
    a = DecodeArgs()
    a.softmax_scale = 0.125
    a.batch, a.num_heads, a.num_heads_k, a.head_dim, a.window_left = 32, 71, 1, 64, -1
    a.page_values, a.nnz_pages, a.page_size = 1, 32 * 64, 256
    p.counters = 0  # (no counters: nothing asked of a GPU before the checks)
    launch = lib.mqa_byoc_decode_launch
    for field, value, rc in (("splits", 31, 2), ("keys_per_split", 0, 2), ("merge", 2, 4)):
        q = DecodePlan.from_buffer_copy(p)
        setattr(q, field, value)
        assert launch(ctypes.byref(a), ctypes.byref(q), None, 0, None) == rc, field
    a.batch = 12289
    q = DecodePlan.from_buffer_copy(p)
    q.splits = 20000
    assert launch(ctypes.byref(a), ctypes.byref(q), None, 0, None) == 2


def test_shared_tiles_asked_for(lib):
    """row_tiles MQA_BYOC_DECODE_SHARED_TILES (-1): SharedTiles at any batch where it serves the call (head
    dim 64, groups of more than 16), refused elsewhere; plan_split with whole 64-key tiles only."""
    a = DecodeArgs()
    a.softmax_scale = 0.125
    a.batch, a.num_heads, a.num_heads_k, a.head_dim, a.seqlen_k, a.window_left = 1, 71, 1, 64, 4096, -1
    p = DecodePlan()
    assert lib.mqa_byoc_decode_make_plan(ctypes.byref(a), -1, SMS, None, ctypes.byref(p)) == 0
    assert p.shared_tiles == 1 and p.warps == 5 and p.row_groups == 1
    assert lib.mqa_byoc_decode_plan_split(ctypes.byref(a), 512, -1, ctypes.byref(p)) == 0
    assert p.shared_tiles == 1 and p.splits == 8 and p.keys_per_split == 512
    assert lib.mqa_byoc_decode_plan_split(ctypes.byref(a), 64, -1, ctypes.byref(p)) == 0 and p.splits == 64
    assert lib.mqa_byoc_decode_plan_split(ctypes.byref(a), 80, -1, ctypes.byref(p)) == 2  # not whole 64-key tiles
    for heads, heads_k, dim in ((64, 8, 64), (16, 1, 64), (71, 1, 128)):
        a.num_heads, a.num_heads_k, a.head_dim = heads, heads_k, dim
        assert lib.mqa_byoc_decode_make_plan(ctypes.byref(a), -1, SMS, None, ctypes.byref(p)) == 2
        assert lib.mqa_byoc_decode_plan_split(ctypes.byref(a), 512, -1, ctypes.byref(p)) == 2


@pytest.mark.parametrize("batch,shared", [(8, 0), (23, 0), (24, 2)])
def test_key_group_threshold_keeps_48_slots_on_small_pages(lib, batch, shared):
    """On pages of 16 (a tile's rows from several pages) the rule takes SharedTiles for 2 row tiles from
    48 slots as before two key groups, and then with two key groups."""
    rc, p = _plan(lib, heads=40, heads_k=2, dim=64, batch=batch, seqlen=0, pages=(batch * 16384 // 16, 16))
    assert rc == 0 and p.shared_tiles == shared
    if shared:
        assert p.warps == 4


@pytest.mark.parametrize("batch,page,ctas_per_sm", [(4, 256, 2), (32, 256, 2), (33, 256, 3), (64, 256, 3),
                                                    (4, 16, 2), (8, 16, 2), (9, 16, 3), (32, 16, 3)])
def test_packed_grid_of_five_row_tiles(lib, batch, page, ctas_per_sm):
    """Falcon's 71/1/64 on pages: packed splits from 4 sequences, splits of at least 128 keys, over two CTAs
    an SM up to 32 sequences on pages of whole 64-key tiles and up to 8 on others, else the three an SM holds."""
    rc, p = _plan(lib, heads=71, heads_k=1, dim=64, batch=batch, seqlen=0, pages=(batch * 16384 // page, page))
    assert rc == 0
    assert (p.shared_tiles, p.splits, p.keys_per_split) == (2, max(ctas_per_sm * SMS, batch), 128)
    for few in (1, 2, 3):  # the classic blocks below 4 sequences
        rc, p = _plan(lib, heads=71, heads_k=1, dim=64, batch=few, seqlen=0, pages=(few * 16384 // page, page))
        assert rc == 0 and p.shared_tiles == 0
