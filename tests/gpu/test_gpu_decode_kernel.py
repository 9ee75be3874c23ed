"""The grouped-query decode kernel (native/gqa_decode.cu) alone, against fp32 attention, on the GPU:
contiguous and paged K/V, fp16/bf16, head dims 64/128, GQA and MQA groupings, one split and many (the
fused combine: through a thread-block cluster's shared memory and through the workspace), warps of 1-3
16-row M tiles (groups of more than 16), SharedTiles (a group's row tiles as one CTA's warps), strided query/output rows, sliding window, empty and ragged
sequences, repeated calls (the arrival counters reset). Needs torch with CUDA and nvcc; no TVM."""
from __future__ import annotations

import math

import pytest

import gpu_common

pytestmark = pytest.mark.gpu

if gpu_common.skip_reason():
    pytest.skip(gpu_common.skip_reason(), allow_module_level=True)

import torch  # noqa: E402

from mqa_byoc.testing import decode_kernel as dk  # noqa: E402

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _contiguous_case(batch, heads, heads_k, dim, seqlen, dtype, window_left=-1, strided=False, seed=0,
                     merge="auto", row_tiles=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if strided:  # q and out as row slices of wider buffers (a fused qkv output, an (B, H*D + pad) output)
        qbuf = torch.randn(batch, heads + 2 * heads_k, dim, generator=gen, device="cuda").to(dtype)
        q = qbuf[:, :heads]
        obuf = torch.zeros(batch, heads + 3, dim, dtype=dtype, device="cuda")
        out = obuf[:, 1:heads + 1]
    else:
        q = torch.randn(batch, heads, dim, generator=gen, device="cuda").to(dtype)
        out = torch.zeros(batch, heads, dim, dtype=dtype, device="cuda")
    # the in-place cache's layout: (B, capacity, H_kv, D), only the first seqlen rows valid
    cap = seqlen + 37
    k = (torch.randn(batch, cap, heads_k, dim, generator=gen, device="cuda") * 2).to(dtype)
    v = torch.randn(batch, cap, heads_k, dim, generator=gen, device="cuda").to(dtype)
    lse = torch.zeros(batch, heads, dtype=torch.float32, device="cuda")
    call = dk.Decode(q, k, v, out, lse, k_stride=k.stride()[:3], v_stride=v.stride()[:3], seqlen_k=seqlen,
                     num_heads_k=heads_k, window_left=window_left, merge=merge, row_tiles=row_tiles)
    ref_o, ref_lse = dk.reference(q, k, v, [seqlen] * batch, heads_k, window_left=window_left)
    return call, out, lse, ref_o, ref_lse


def _check(out, lse, ref_o, ref_lse, dtype):
    err = (out.float() - ref_o).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref_o.abs().max().item()), f"max |out - fp32| = {err}"
    lerr = (lse - ref_lse).abs().max().item()
    assert lerr <= 1e-2, f"max |lse - fp32| = {lerr}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads,heads_k,dim", [(64, 8, 128), (32, 8, 128), (71, 1, 64), (8, 1, 64), (16, 16, 128),
                                               (40, 2, 64)])
@pytest.mark.parametrize("seqlen", [1, 17, 64, 1000, 4096, 16411])
def test_contiguous(dtype, heads, heads_k, dim, seqlen):
    call, out, lse, ref_o, ref_lse = _contiguous_case(1, heads, heads_k, dim, seqlen, dtype)
    call()
    torch.cuda.synchronize()
    _check(out, lse, ref_o, ref_lse, dtype)


@pytest.mark.parametrize("merge", ["global", "cluster"])
@pytest.mark.parametrize("heads,heads_k,dim,seqlen", [(64, 8, 128, 1000), (64, 8, 128, 4096), (32, 8, 128, 16411),
                                                      (71, 1, 64, 2000), (40, 2, 64, 2048)])
def test_each_merge(merge, heads, heads_k, dim, seqlen):
    """Both ways of merging the splits, forced (the plan's AUTO picks the cluster where it fits)."""
    call, out, lse, ref_o, ref_lse = _contiguous_case(1, heads, heads_k, dim, seqlen, torch.bfloat16, merge=merge)
    assert 1 < call.plan.splits <= 16, call.plan.splits  # a cluster holds them
    for _ in range(2):
        out.zero_()
        call()
    torch.cuda.synchronize()
    _check(out, lse, ref_o, ref_lse, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("row_tiles", [1, 2, 3])
@pytest.mark.parametrize("heads,heads_k", [(71, 1), (40, 1), (48, 2)])
@pytest.mark.parametrize("seqlen,merge", [(100, "auto"), (2000, "global"), (2000, "cluster"), (16411, "auto")])
def test_row_tiles(dtype, row_tiles, heads, heads_k, seqlen, merge):
    """Warps of 1-3 M tiles of 16 query rows (head dim 64): CTAs of 16-48 rows, where the group's last CTA
    has tiles past it (71 rows in 48 + 23, 40 in 32 + 8, 24 in 32); one split (100 keys), a few merged in a
    cluster or through the workspace, many (16k keys); two sequences."""
    call, out, lse, ref_o, ref_lse = _contiguous_case(2, heads, heads_k, 64, seqlen, dtype, merge=merge,
                                                      row_tiles=row_tiles)
    group = heads // heads_k
    assert call.plan.row_tiles == row_tiles and call.plan.row_groups == -(-group // (16 * row_tiles))
    assert (call.plan.splits == 1) == (seqlen == 100), call.plan.splits
    for _ in range(2):
        out.zero_()
        call()
    torch.cuda.synchronize()
    _check(out, lse, ref_o, ref_lse, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads,heads_k", [(71, 1), (40, 2), (17, 1), (128, 1), (200, 1), (96, 2)])
@pytest.mark.parametrize("seqlen,merge,window_left", [(1, "auto", -1), (50, "auto", -1), (1000, "global", -1),
                                                      (1000, "cluster", -1), (16411, "auto", -1),
                                                      (5000, "auto", 300)])
def test_shared_tiles(dtype, heads, heads_k, seqlen, merge, window_left):
    """SharedTiles (groups of more than 16 at head dim 64) asked for at a small batch: the group's 16-row
    tiles as the warps of one CTA (2-8 warps; 200 rows: two row groups, the second with warps past the
    group), 64-key tiles loaded together (one K/V head: rows D apart; two: the general load), a last
    tile part-filled; one split, a few merged in a cluster or through the workspace, 64 cut by each
    sequence itself, a window that starts inside a tile; three sequences, repeated calls."""
    call, out, lse, ref_o, ref_lse = _contiguous_case(3, heads, heads_k, 64, seqlen, dtype, window_left,
                                                      merge=merge, row_tiles=dk.SHARED_TILES)
    group = heads // heads_k
    row_tiles = min(8, -(-group // 16))
    assert call.plan.shared_tiles == 1 and call.plan.warps == row_tiles * (2 if row_tiles <= 2 else 1)  # key groups
    assert call.plan.row_groups == -(-group // (16 * row_tiles))
    assert (call.plan.splits == 1) == (seqlen <= 256), call.plan.splits
    for _ in range(2):
        out.zero_()
        call()
    torch.cuda.synchronize()
    _check(out, lse, ref_o, ref_lse, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads,heads_k", [(71, 1), (40, 2), (17, 1), (96, 2)])
@pytest.mark.parametrize("batch,seqlen,merge,window_left", [(3, 50, "auto", -1), (3, 1000, "global", -1),
                                                            (3, 1000, "cluster", -1), (3, 16411, "auto", -1),
                                                            (3, 5000, "auto", 300), (9, 3001, "auto", -1)])
def test_shared_tiles_key_groups(dtype, heads, heads_k, batch, seqlen, merge, window_left):
    """SharedTiles with two key groups (twice the row tiles' warps, each group on one of a tile's two
    32-key steps, their shares weighted by the block's softmax): a last tile whose second step is empty
    or part-filled, one split, merged in a cluster or through the workspace, a window."""
    call, out, lse, ref_o, ref_lse = _contiguous_case(batch, heads, heads_k, 64, seqlen, dtype, window_left,
                                                      merge=merge, row_tiles=dk.SHARED_TILES)
    call.set_key_groups(2)
    assert call.plan.warps == 2 * -(-(heads // heads_k) // 16)
    for _ in range(2):
        out.zero_()
        call()
    torch.cuda.synchronize()
    _check(out, lse, ref_o, ref_lse, dtype)


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("packed", [False, True])
def test_paged_shared_tiles_key_groups(page_size, packed):
    """Two key groups on TVM's pages, with per-sequence and packed splits (empty, one-key, ragged sequences)."""
    _paged_case(torch.float16, page_size, 71, 1, 64, "global" if packed else "auto",
                [0, 1, page_size, 5000, 777, 2 * page_size + 3, 12000, 31], row_tiles=dk.SHARED_TILES,
                key_groups=2, packed=packed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("lengths", [[16384, 5000, 1, 1024], [0, 777, 12000, 31, 16384, 2 * 256 + 3]])
def test_packed_splits_by_the_rule_from_four_sequences(dtype, lengths):
    """Falcon's 71/1/64 on pages of 256 and 16: the rule takes packed SharedTiles splits from 4 sequences on
    (two CTAs an SM, splits of at least 128 keys); empty, one-key and ragged sequences right."""
    for page in (256, 16):  # two CTAs an SM up to 32 sequences on pages of 64-key tiles, up to 8 on others
        call = _paged_case(dtype, page, 71, 1, 64, "auto", lengths)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert (call.plan.shared_tiles, call.plan.splits, call.plan.keys_per_split) == (2, 2 * sms, 128)


def test_key_groups_past_five_row_tiles_are_refused():
    """Two key groups of 8 row tiles would not fit the kernel's main buffer: the launch refuses the plan."""
    call, *_ = _contiguous_case(1, 128, 1, 64, 1000, torch.float16, row_tiles=dk.SHARED_TILES)
    call.set_key_groups(2)
    with pytest.raises(AssertionError, match="launch rc=2"):
        call()


@pytest.mark.parametrize("heads,heads_k,batch,shared", [(71, 1, 1, 0), (71, 1, 8, 0), (71, 1, 11, 0), (71, 1, 12, 1),
                                                        (71, 1, 16, 1), (71, 1, 32, 1), (71, 1, 64, 1), (40, 2, 16, 0),
                                                        (40, 2, 23, 0), (40, 2, 24, 1)])
def test_shared_tiles_by_the_rule(heads, heads_k, batch, shared):
    """The plan's rule takes SharedTiles from 12 slots (sequences x K/V heads x row groups) on, from 48
    on contiguous K/V where a CTA has fewer than 4 row tiles (40/2/64: 2; on pages of a multiple of 64 keys
    from 16, the plan tests); the output is right either way."""
    call, out, lse, ref_o, ref_lse = _contiguous_case(batch, heads, heads_k, 64, 3000, torch.float16)
    assert call.plan.shared_tiles == shared
    call()
    torch.cuda.synchronize()
    _check(out, lse, ref_o, ref_lse, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("page_size", [16, 48, 64, 128, 256])
@pytest.mark.parametrize("heads,heads_k", [(71, 1), (40, 2)])
@pytest.mark.parametrize("merge", ["auto", "global"])
def test_paged_shared_tiles(dtype, page_size, heads, heads_k, merge):
    """SharedTiles on TVM's pages: tiles within one page (pages of a multiple of 64: one lookup a tile),
    across pages (16, 48: a lookup a row), empty, one-key and ragged sequences."""
    _paged_case(dtype, page_size, heads, heads_k, 64, merge, [0, 1, page_size, 5000, 777, 2 * page_size + 3,
                                                             12000, 31], row_tiles=dk.SHARED_TILES)


@pytest.mark.parametrize("merge", ["global", "auto"])
@pytest.mark.parametrize("keys_per_split", [16, 48, 144, 1008])
def test_split_sizes_in_tiles(keys_per_split, merge):
    """Splits of any whole number of 16-key tiles: warps with one tile more than others, warps without
    any (16 and 48 keys: only the first warps stream), 21 splits or more (past a cluster: the workspace)."""
    call, out, lse, ref_o, ref_lse = _contiguous_case(2, 71, 1, 64, 1000, torch.float16, merge=merge)
    call.set_keys_per_split(keys_per_split)
    assert call.plan.splits == -(-1000 // keys_per_split)
    call()
    torch.cuda.synchronize()
    _check(out, lse, ref_o, ref_lse, torch.float16)


@pytest.mark.parametrize("merge", ["cluster", "global"])
@pytest.mark.parametrize("keys_per_split,warps", [(64, 4), (256, 4), (272, 8), (512, 8)])
@pytest.mark.parametrize("heads,heads_k,dim", [(64, 8, 128), (48, 1, 128), (71, 1, 64), (8, 1, 64)])
def test_blocks_of_4_and_8_warps(heads, heads_k, dim, keys_per_split, warps, merge):
    """Splits of at most 256 keys run in 4-warp CTAs, longer ones in 8-warp CTAs: both, in both
    orientations and head dims, merged in a cluster (up to 15 splits) and through the workspace."""
    call, out, lse, ref_o, ref_lse = _contiguous_case(1, heads, heads_k, dim, 900, torch.float16, merge=merge)
    call.set_keys_per_split(keys_per_split)
    assert call.plan.warps == warps and call.plan.splits == -(-900 // keys_per_split)
    call()
    torch.cuda.synchronize()
    _check(out, lse, ref_o, ref_lse, torch.float16)


@pytest.mark.parametrize("merge", ["global", "auto"])
@pytest.mark.parametrize("window_left", [0, 100, 5000])
@pytest.mark.parametrize("strided", [False, True])
def test_batch_window_strided_repeat(window_left, strided, merge):
    call, out, lse, ref_o, ref_lse = _contiguous_case(3, 32, 8, 128, 3000, torch.float16, window_left, strided,
                                                      merge=merge)
    for _ in range(3):  # the arrival counters must be back at zero after each call
        out.zero_()
        call()
    torch.cuda.synchronize()
    assert call.plan.splits > 1 or window_left < 200
    _check(out, lse, ref_o, ref_lse, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("page_size", [16, 128, 256])
@pytest.mark.parametrize("heads,heads_k,dim", [(64, 8, 128), (71, 1, 64), (40, 1, 64)])
@pytest.mark.parametrize("merge", ["auto", "global"])
def test_paged(dtype, page_size, heads, heads_k, dim, merge):
    _paged_case(dtype, page_size, heads, heads_k, dim, merge, [0, 1, page_size, 5000, 777, 2 * page_size + 3, 12000, 31])


@pytest.mark.parametrize("page_size,length", [(128, 301), (128, 302), (128, 1000), (128, 4100), (256, 300)])
@pytest.mark.parametrize("merge", ["cluster", "global"])
def test_paged_one_sequence(page_size, length, merge):
    """One sequence (a serving loop's batch 1): few splits, merged in a cluster or through the workspace;
    (256, 300): the grid, sized by the pages, has a split past the sequence's end (an empty partial)."""
    _paged_case(torch.float16, page_size, 64, 8, 128, merge, [length])


@pytest.mark.parametrize("lengths", [[40000] + [10] * 31, [3000] * 30 + [0, 50000], [2048] * 32])
@pytest.mark.parametrize("heads,heads_k,dim", [(64, 8, 128), (48, 1, 128), (8, 1, 64)])
@pytest.mark.parametrize("merge", ["auto", "global"])
def test_paged_sequence_longer_than_the_grid(lengths, heads, heads_k, dim, merge):
    """The classic blocks' grid on pages covers a typical sequence (an even share of the pages), not the
    longest the pages could hold: a longer sequence cuts its keys into the grid's splits, larger ones."""
    call = _paged_case(torch.float16, 128, heads, heads_k, dim, merge, lengths)
    assert call.plan.shared_tiles == 0
    if max(lengths) > 2 * sum(lengths) / len(lengths):  # beyond what the grid covers
        assert call.plan.splits * call.plan.keys_per_split < max(lengths), (call.plan.splits, call.plan.keys_per_split)


def _mixed_lengths(batch, seed, longest=16384):
    gen = torch.Generator().manual_seed(seed)
    return [longest, 1] + torch.randint(0, longest, (batch - 2,), generator=gen).tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("page_size", [16, 48, 256])
@pytest.mark.parametrize("heads,heads_k,batch", [(71, 1, 40), (40, 2, 33), (200, 1, 24), (71, 1, 300)])
def test_paged_packed_splits(dtype, page_size, heads, heads_k, batch):
    """SharedTiles' packed splits (the rule's plan on pages where a slot's splits would not merge in a
    cluster): a split size for the batch, found by each CTA from the lengths, each sequence cut into
    its own number of splits of even size (whole tiles), CTAs numbered across the sequences (a prefix sum over more than one warp's
    32 sequences), one and two K/V heads, two row groups (200 rows), many short sequences (300: a CTA a
    sequence at least), empty and one-key sequences, pages within and across tiles."""
    lengths = _mixed_lengths(batch, seed=batch, longest=6000 if batch > 100 else 16384)
    lengths[3] = 0
    call = _paged_case(dtype, page_size, heads, heads_k, 64, "auto", lengths)
    assert call.plan.shared_tiles == 2, (call.plan.shared_tiles, call.plan.splits)
    assert call.plan.splits >= batch


@pytest.mark.parametrize("batch,shared", [(3, 0), (4, 2), (7, 2), (8, 2), (12, 2), (16, 2)])
def test_paged_packed_splits_by_the_rule(batch, shared):
    """On pages, Falcon's 71 query heads (CTAs of 5 row tiles) take SharedTiles' packed splits from 4
    sequences on, also where the slots' splits would fit co-resident clusters (12 and 16), and the
    classic blocks below; mixed lengths with an empty sequence, the splits merged by the merge kernel."""
    lengths = _mixed_lengths(batch, seed=batch)
    lengths[-1] = 0
    call = _paged_case(torch.float16, 256, 71, 1, 64, "auto", lengths)
    assert call.plan.shared_tiles == shared


@pytest.mark.parametrize("n", [20, 32, 40])
@pytest.mark.parametrize("kind", ["one-long", "all-empty", "short-and-very-long"])
def test_paged_packed_splits_extremes(kind, n):
    """Packed splits where one sequence holds nearly every key (its splits bounded by the merge's weights:
    larger splits), where none has a key (zero outputs, the empty LSE), and where the split size grows
    past the first guess (one-key sequences beside 300k keys); 20 and 32 sequences (one warp finds the
    CTAs' work) and 40 (the whole CTA does)."""
    lengths = {"one-long": [100_000] + [40] * (n - 1), "all-empty": [0] * n,
               "short-and-very-long": [1] * (n - 1) + [300_000]}[kind]
    call = _paged_case(torch.float16, 256, 71, 1, 64, "auto", lengths)
    assert call.plan.shared_tiles == 2


@pytest.mark.parametrize("window_left", [0, 700, 5000])
def test_paged_packed_splits_window(window_left):
    """Packed splits count and cut only the keys in a sliding window."""
    call = _paged_case(torch.bfloat16, 128, 71, 1, 64, "auto", _mixed_lengths(32, seed=3), window_left=window_left)
    assert call.plan.shared_tiles == 2


@pytest.mark.parametrize("row_tiles", [1, 2, 3])
@pytest.mark.parametrize("merge", ["cluster", "global"])
def test_paged_row_tiles(row_tiles, merge):
    """Falcon's 71 query heads on pages in CTAs of 16, 32 or 48 rows; one sequence of a few splits
    (merged in a cluster or through the workspace)."""
    _paged_case(torch.bfloat16, 256, 71, 1, 64, merge, [3000], row_tiles=row_tiles)


@pytest.mark.parametrize("lengths", [[4100], [12000, 300], [40000] + [10] * 31])
@pytest.mark.parametrize("heads,heads_k,dim,page_size", [(64, 8, 128, 128), (71, 1, 64, 256)])
@pytest.mark.parametrize("merge", ["auto", "global"])
def test_paged_page_list_past_entry_0(lengths, heads, heads_k, dim, page_size, merge):
    """The first sequence's pages start past entry 0 of the page list (a view into a larger table, the
    entries before it other pages): every sequence's pages are read from its own offset; classic blocks
    and SharedTiles (71/1/64), one sequence, two, and a long one beside 31 short ones."""
    _paged_case(torch.float16, page_size, heads, heads_k, dim, merge, lengths, first_entry=37)


def _paged_case(dtype, page_size, heads, heads_k, dim, merge, lengths, row_tiles=0, window_left=-1, key_groups=1,
                packed=False, lib=None, first_entry=0):
    gen = torch.Generator(device="cuda").manual_seed(1)
    batch = len(lengths)
    n_pages = [math.ceil(n / page_size) for n in lengths]
    pool = sum(n_pages) + 5
    # TVM's page layout (page, 2, H_kv, page_size, D), pages handed out in a shuffled order
    pages = torch.randn(pool, 2, heads_k, page_size, dim, generator=gen, device="cuda").to(dtype)
    perm = torch.randperm(pool, generator=torch.Generator().manual_seed(2))[: sum(n_pages)]
    indptr = torch.tensor([0] + list(torch.tensor(n_pages).cumsum(0)), dtype=torch.int32, device="cuda")
    # where no page is in use, one entry no sequence's indptr covers: an empty tensor's null pointer would
    # read as contiguous K/V (TVM's page table is a buffer)
    values = (perm if len(perm) else torch.zeros(1, dtype=torch.int64)).to(torch.int32).cuda()
    if first_entry:  # entries before the first sequence's: pages no sequence uses
        unused = torch.tensor(sorted(set(range(pool)) - set(perm.tolist())), dtype=torch.int32, device="cuda")
        values = torch.cat([unused.repeat(first_entry // len(unused) + 1)[:first_entry], values])
        indptr = indptr + first_entry
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(lengths, n_pages)],
                        dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dim, generator=gen, device="cuda").to(dtype)
    out = torch.full((batch, heads, dim), 7.0, dtype=dtype, device="cuda")
    lse = torch.zeros(batch, heads, dtype=torch.float32, device="cuda")
    kview, vview = pages[:, 0], pages[:, 1]  # (page, H_kv, P, D)
    stride = (kview.stride(0), kview.stride(2), kview.stride(1))  # (page, row in page, head)
    call = dk.Decode(q, kview, vview, out, lse, k_stride=stride, v_stride=stride, seqlen_k=0, num_heads_k=heads_k,
                     pages=(indptr, values, last, page_size), merge=merge, row_tiles=row_tiles,
                     window_left=window_left, lib=lib)
    if packed:  # packed splits, as the rule makes them for many sequences (a grid of a few CTAs a sequence)
        call.set_packed()
    if key_groups != 1:
        call.set_key_groups(key_groups)
    call()
    call()
    torch.cuda.synchronize()
    ks, vs = [], []
    for b in range(batch):
        ids = values[indptr[b]:indptr[b + 1]].long()
        kb = pages[ids, 0].permute(0, 2, 1, 3).reshape(-1, heads_k, dim)[: lengths[b]]
        vb = pages[ids, 1].permute(0, 2, 1, 3).reshape(-1, heads_k, dim)[: lengths[b]]
        ks.append(kb)
        vs.append(vb)
    ref_o, ref_lse = dk.reference(q, ks, vs, lengths, heads_k, window_left=window_left)
    _check(out, lse, ref_o, ref_lse, dtype)
    return call


@pytest.mark.parametrize("vectors", [1, 5, 4096 + 3, 1 << 20])
@pytest.mark.parametrize("blocks,threads", [(1, 32), (7, 256), (264, 1024)])
def test_read_floor_reads_every_vector(vectors, blocks, threads):
    """The benchmark's read floor (testing/read_floor.cu) is a floor only if its kernel loads every 16-byte
    vector: a buffer of zeros with the kernel's marker word in one vector (first, last, middle) makes the
    thread that loads it write the marker; a buffer without the marker writes nothing."""
    from mqa_byoc.testing import read_floor

    marker = 0x9E3779B9 - (1 << 32)  # as an int32
    for where in sorted({0, vectors // 2, vectors - 1}):
        buf = torch.zeros(vectors, 4, dtype=torch.int32, device="cuda")
        buf[where, 2] = marker
        call = read_floor.reader([buf], blocks, threads)
        call()
        torch.cuda.synchronize()
        assert call.keep[1].item() == marker, f"vector {where} of {vectors} was not read"
    call = read_floor.reader([torch.zeros(vectors, 4, dtype=torch.int32, device="cuda")], blocks, threads)
    call()
    torch.cuda.synchronize()
    assert call.keep[1].item() == 0


def test_the_kernels_own_build_carries_three_row_tiles():
    """The build these tests use compiles 1-3 M tiles a warp (the packaged libraries one)."""
    assert dk.library().mqa_byoc_decode_max_row_tiles() == dk.ROW_TILES == 3


def _stamped(call, lib, ctas):
    """One call of ``call`` (a stamped build ``lib``) with a phase buffer of ``ctas`` CTAs: that its output
    equals the one without a buffer, to the bit; the CTAs' words (dk.PHASE_WORDS each) and the buffer."""
    out = call.keep[3]
    plain = out.clone()
    buf = torch.zeros(ctas * dk.PHASE_WORDS, dtype=torch.int64, device="cuda")
    dk.set_phase_buffer(lib, buf)
    call()
    torch.cuda.synchronize()
    dk.set_phase_buffer(lib, None)
    assert torch.equal(out, plain)
    return buf.view(ctas, dk.PHASE_WORDS).cpu().tolist(), buf


def _assert_in_order(w):
    """A CTA's seven timestamps and seven clocks, each in order."""
    assert w[0] <= w[1] <= w[2] <= w[3] <= w[4] <= w[5] <= w[6], w[:7]
    assert w[8] <= w[9] <= w[10] <= w[11] <= w[12] <= w[13] <= w[14], w[8:15]


def test_phase_timestamps():
    """A build with the phase timestamps (benchmarks/decode_phases.py's) computes the same attention (against
    fp32 without a buffer, then to the bit with one), and every CTA with keys stamps its seven points in
    order; with no buffer set it writes nothing."""
    lib = dk.library(phases=True)
    lengths = [2048, 300, 0]
    call = _paged_case(torch.float16, 128, 64, 8, 128, "auto", lengths, lib=lib)
    out = call.keep[3]
    plain = out.clone()
    words, buf = _stamped(call, lib, call.plan.splits * 8 * len(lengths) * call.plan.row_groups)
    full = [w for w in words if all(w[:7])]

    def splits(n):  # the kernel's cut of n keys into at most the grid's splits (a sequence without keys: none)
        per_cta = -(-n // (call.plan.splits * 16)) * 16
        return -(-n // max(call.plan.keys_per_split, per_cta))

    assert len(full) == sum(splits(n) for n in lengths) * 8 * call.plan.row_groups, (len(full), call.plan.splits)
    for w in full:
        _assert_in_order(w)
    buf.zero_()  # no buffer set since the call above: nothing lands in it
    call()
    torch.cuda.synchronize()
    assert not buf.any().item() and torch.equal(out, plain)


def test_phase_timestamps_shared_tiles():
    """SharedTiles' packed splits in the stamped build (Falcon's 71 query heads, 8 sequences on pages of 256,
    one of them empty): the same attention as without a buffer, to the bit; every CTA that landed a tile
    stamps all seven points in order (an empty sequence's CTA lands none), at least one a sequence with keys,
    and none past the grid."""
    lib = dk.library(phases=True)
    lengths = [9000, 300, 0, 1000, 2048, 5, 700, 4000]
    call = _paged_case(torch.float16, 256, 71, 1, 64, "auto", lengths, lib=lib)
    assert call.plan.shared_tiles == 2
    ctas = call.plan.splits * call.plan.row_groups  # the packed grid: (splits, K/V heads x row groups, 1)
    words, _ = _stamped(call, lib, ctas)
    landed = [w for w in words if w[3]]
    assert len(landed) >= sum(1 for n in lengths if n) and len(landed) <= ctas
    for w in landed:
        assert all(w[:7]), w[:7]
        _assert_in_order(w)
    # splits of whole 64-key tiles: every landed CTA streams tiles of its own, so no more CTAs than tiles
    assert len(landed) <= sum(-(-n // 64) for n in lengths)


def test_paged_packed_splits_many_slots():
    """More (sequence, K/V head, row group) slots than a grid dimension holds (65535): 4200 sequences of 16
    K/V heads of 17 query heads each at head dim 64, packed splits, their merge kernel's grid over (rows,
    K/V head and row group, sequence)."""
    lengths = torch.randint(1, 200, (4200,), generator=torch.Generator().manual_seed(5)).tolist()
    call = _paged_case(torch.float16, 64, 272, 16, 64, "auto", lengths)
    assert call.plan.shared_tiles == 2 and len(lengths) * 16 * call.plan.row_groups > 65535


@pytest.mark.parametrize("batch,heads,heads_k,dim,seqlen,merge,row_tiles", [
    (1, 64, 8, 128, 16411, "auto", 0),        # classic blocks, splits merged in a cluster
    (2, 64, 8, 128, 4096, "global", 0),       # classic blocks, the last CTA merges through the workspace
    (16, 71, 1, 64, 3000, "global", dk.SHARED_TILES),  # SharedTiles and its merge kernel
])
def test_programmatic_dependent_launches_read_the_previous_calls_output(batch, heads, heads_k, dim, seqlen, merge,
                                                                        row_tiles):
    """Launched as programmatic dependents (the plan's overlap, as a library built with launch_overlap on
    launches them): a call whose query is the previous call's output, queued right behind it, waits for it
    (its blocks may start early); repeated, so the arrival counters and the workspace are reused too."""
    first, out1, lse1, ref_o1, ref_lse1 = _contiguous_case(batch, heads, heads_k, dim, seqlen, torch.float16,
                                                           merge=merge, row_tiles=row_tiles, seed=1)
    first = dk.Decode(*first.keep[:5], k_stride=first.keep[1].stride()[:3], v_stride=first.keep[2].stride()[:3],
                      seqlen_k=seqlen, num_heads_k=heads_k, merge=merge, row_tiles=row_tiles, overlap=True)
    gen = torch.Generator(device="cuda").manual_seed(2)
    k2 = (torch.randn(batch, seqlen, heads_k, dim, generator=gen, device="cuda") * 2).half()
    v2 = torch.randn(batch, seqlen, heads_k, dim, generator=gen, device="cuda").half()
    out2 = torch.zeros_like(out1)
    lse2 = torch.zeros_like(lse1)
    second = dk.Decode(out1, k2, v2, out2, lse2, k_stride=k2.stride()[:3], v_stride=v2.stride()[:3], seqlen_k=seqlen,
                       num_heads_k=heads_k, merge=merge, row_tiles=row_tiles, overlap=True)
    assert first.plan.overlap == 1 and second.plan.overlap == 1
    for _ in range(3):
        out1.zero_()  # a plain kernel before the pair: the first call then waits for nothing of its own
        first()
        second()
    torch.cuda.synchronize()
    _check(out1, lse1, ref_o1, ref_lse1, torch.float16)
    ref_o2, ref_lse2 = dk.reference(out1, k2, v2, [seqlen] * batch, heads_k)
    _check(out2, lse2, ref_o2, ref_lse2, torch.float16)
