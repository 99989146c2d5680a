"""The kvcal Python package against the kvcal CLI and independent NumPy
computations: masks byte-identical to `kvcal mask-gen`, profiles and
calibrations equal to the CLI's files, the runtime's attention against NumPy,
zero-copy promises, and bad input.

Run by ctest (python.package) with PYTHONPATH at the build tree's package and
KVCAL_CLI naming the kvcal binary.
"""

import math
import os
import shutil
import subprocess
import sys
import threading

import h5py
import numpy as np
import pytest

import kvcal

CLI = os.environ.get("KVCAL_CLI", "kvcal")
SRC = os.environ.get("KVCAL_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
DUMP = os.path.join(SRC, "data", "smollm2_attention.h5")


def run_cli(*args):
    r = subprocess.run([CLI, "-q", *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, f"kvcal {' '.join(map(str, args))}: {r.stderr}"
    return r.stdout


def h5_masks(path):
    """{id: (indptr bytes, indices bytes, attrs)} of a mask file, read with h5py."""
    out = {}
    with h5py.File(path, "r") as f:
        for mid, g in f["masks"].items():
            out[mid] = (g["indptr"][()].tobytes(), g["indices"][()].tobytes(), dict(g.attrs))
    return out


# ---------------------------------------------------------------- masks

MASK_CASES = [
    (dict(rows=96, cols=128, sparsity=0.03125), ["--rows", 96, "--cols", 128, "--sparsity", 0.03125]),
    (dict(rows=96, cols=128, row_degree=4, method="lift", seed=5),
     ["--rows", 96, "--cols", 128, "--row-degree", 4, "--method", "lift", "--seed", 5]),
    (dict(rows=96, cols=128, row_degree=4, count=3, seed=7),
     ["--rows", 96, "--cols", 128, "--row-degree", 4, "--count", 3, "--seed", 7]),
    (dict(rows=96, cols=128, row_degree=6, seed=3), ["--rows", 96, "--cols", 128, "--row-degree", 6, "--seed", 3]),
    (dict(method="lps", lps_p=3, lps_q=13, lift_to=4368, count=2),
     ["--method", "lps", "--lps-p", 3, "--lps-q", 13, "--lift-to", 4368, "--count", 2]),
    (dict(method="lps", lps_p=5, lps_q=13, construction="incidence", transpose=True),
     ["--method", "lps", "--lps-p", 5, "--lps-q", 13, "--construction", "incidence", "--transpose"]),
]


@pytest.mark.parametrize("kwargs,cli_args", MASK_CASES)
def test_generate_masks_byte_identical_to_cli(tmp_path, kwargs, cli_args):
    cli_file = tmp_path / "cli.h5"
    run_cli("mask-gen", *cli_args, "--out", cli_file)
    records = kvcal.generate_masks(**kwargs)
    py_file = tmp_path / "py.h5"
    kvcal.write_masks(str(py_file), records)
    cli, py = h5_masks(cli_file), h5_masks(py_file)
    assert sorted(cli) == sorted(py) == [r.id for r in records]
    for mid in cli:
        assert cli[mid][0] == py[mid][0], f"{mid}: indptr differs"
        assert cli[mid][1] == py[mid][1], f"{mid}: indices differs"
        for key, value in cli[mid][2].items():  # every stored claim equal
            assert np.array_equal(np.asarray(value), np.asarray(py[mid][2][key])), f"{mid}: attribute {key}"
    # The returned arrays are those written.
    for r in records:
        assert r.indptr.tobytes() == cli[r.id][0] and r.indices.tobytes() == cli[r.id][1]


def test_read_masks_and_certify_match_the_cli_file(tmp_path):
    path = tmp_path / "m.h5"
    run_cli("mask-gen", "--rows", 96, "--cols", 128, "--row-degree", 4, "--count", 2, "--out", path)
    f = kvcal.read_masks(str(path))
    assert f.format_version == 1 and len(f.masks) == 2
    stored = h5_masks(path)
    for r in f.masks:
        assert r.indptr.tobytes() == stored[r.id][0] and r.indices.tobytes() == stored[r.id][1]
        c = kvcal.certify(r.rows, r.cols, r.indptr, r.indices)
        attrs = stored[r.id][2]
        assert c.ramanujan and c.kind == "exact"
        assert c.sigma2 == pytest.approx(float(attrs["sigma2"]), abs=1e-9)
        assert c.ramanujan_bound == pytest.approx(float(attrs["ramanujan_bound"]), abs=1e-12)
        # Independent: the singular values of the dense matrix.
        dense = np.zeros((r.rows, r.cols))
        for i in range(r.rows):
            dense[i, r.indices[r.indptr[i]:r.indptr[i + 1]]] = 1
        s = np.linalg.svd(dense, compute_uv=False)
        assert c.sigma1 == pytest.approx(s[0], rel=1e-9)
        assert c.sigma2 == pytest.approx(s[1], rel=1e-7)
        assert kvcal.verify(r).ok


def test_verify_finds_a_false_claim(tmp_path):
    (r,) = kvcal.generate_masks(96, 128, row_degree=4)
    indices = r.indices.copy()
    row0 = indices[:4].copy()
    indices[0] = next(c for c in range(128) if c not in row0 and c < row0[1])  # row 0 keeps other channels
    indices[:4] = np.sort(indices[:4])
    lie = kvcal.MaskRecord(r.rows, r.cols, r.indptr, indices, r.certificate)
    v = kvcal.verify(lie)
    assert not v.ok and v.false_claims


def test_mask_views_share_memory():
    (r,) = kvcal.generate_masks(96, 128, row_degree=4)
    assert np.shares_memory(r.indptr, r.indptr) and np.shares_memory(r.indices, r.indices)
    assert not r.indices.flags.writeable
    m = kvcal.Mask(r.rows, r.cols, r.indptr, r.indices)
    assert np.shares_memory(m.indices, m.indices)
    assert np.array_equal(m.indices, r.indices)


# ---------------------------------------------------------------- profiles, calibrations


def test_profile_heads_equals_the_cli_file(tmp_path):
    cli_file = tmp_path / "cli.h5"
    run_cli("profile-heads", DUMP, "--topk-frac", 0.1, "--out", cli_file)
    out = tmp_path / "py.h5"
    p = kvcal.profile_heads([DUMP], topk_frac=0.1, out=str(out))
    assert (p.layers, p.kv_heads, p.q_heads) == (30, 3, 9)
    with h5py.File(cli_file, "r") as c, h5py.File(out, "r") as w:
        for name, arr in [("stability", p.stability), ("similarity", p.similarity), ("budget_ratio", p.budget_ratio),
                          ("role", p.role), ("pivot", p.pivot), ("pairwise_overlap", p.pairwise)]:
            assert np.array_equal(c["heads"][name][()], arr), name
            assert np.array_equal(c["heads"][name][()], w["heads"][name][()]), name
        for key in ("tau_stable", "tau_sim", "tau_drift", "budget", "topk_frac", "pool_kernel", "drift_window"):
            if key in c.attrs:
                assert np.array_equal(c.attrs[key], w.attrs[key]), key
    # The CLI's defaults: the same call without arguments equals the CLI without options.
    run_cli("profile-heads", DUMP, "--out", tmp_path / "d.h5")
    d = kvcal.profile_heads([DUMP])
    with h5py.File(tmp_path / "d.h5", "r") as c:
        assert np.array_equal(c["heads"]["stability"][()], d.stability)
        assert np.array_equal(c["heads"]["role"][()], d.role)


def test_calibrate_entropy_equals_the_cli_file(tmp_path):
    cli_file = tmp_path / "cli.h5"
    run_cli("calibrate-entropy", DUMP, "--page-size", 16, "--percentile", 90, "--rule", "or", "--out", cli_file)
    out = tmp_path / "py.h5"
    c = kvcal.calibrate_entropy([DUMP], page_size=16, percentile=90, rule="or", out=str(out))
    with h5py.File(cli_file, "r") as f:
        assert c.entropy_threshold == f.attrs["entropy_threshold"]
        assert c.varentropy_threshold == f.attrs["varentropy_threshold"]
        assert c.trigger_rate == f.attrs["trigger_rate"]
        assert c.num_pages == f.attrs["num_pages"] and c.num_tokens == f.attrs["num_tokens"]
        for name in ("page_entropy", "page_varentropy", "entropy_edges", "varentropy_edges", "histogram"):
            assert np.array_equal(f[name][()], getattr(c, name)), name
    # Independent: NumPy's percentile of the page statistics.
    assert c.entropy_threshold == pytest.approx(np.percentile(c.page_entropy, 90), rel=1e-12)
    assert c.varentropy_threshold == pytest.approx(np.percentile(c.page_varentropy, 90), rel=1e-12)
    with h5py.File(out, "r") as f:
        assert f.attrs["format"] == b"kvcal.entropy_calibration" or f.attrs["format"] == "kvcal.entropy_calibration"


# ---------------------------------------------------------------- bundle and mask cache


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("bundle")
    run_cli("mask-gen", "--rows", 96, "--cols", 64, "--row-degree", 4, "--method", "lift", "--out", d / "m.h5")
    run_cli("profile-heads", DUMP, "--topk-frac", 0.1, "--out", d / "h.h5")
    run_cli("calibrate-entropy", DUMP, "--page-size", 16, "--out", d / "e.h5")
    run_cli("bundle", "--model", "SmolLM2-135M", "--masks", d / "m.h5", "--heads", d / "h.h5", "--entropy",
            d / "e.h5", "--out", d / "b.kvcal.h5")
    return d


def test_bundle_open_matches_its_parts(bundle_path):
    b = kvcal.Bundle.open(str(bundle_path / "b.kvcal.h5"))
    assert b.model == "SmolLM2-135M"
    (stored,) = h5_masks(bundle_path / "m.h5").values()
    (m,) = b.masks
    assert m.indptr.tobytes() == stored[0] and m.indices.tobytes() == stored[1]
    assert b.find_mask(96, 64, 4 / 64) is not None and b.find_mask(96, 128, 1 / 32) is None
    with h5py.File(bundle_path / "h.h5", "r") as h:
        assert np.array_equal(b.heads.stability, h["heads"]["stability"][()])
        assert np.array_equal(b.heads.role, h["heads"]["role"][()])
        assert np.array_equal(b.heads.budget_ratio, h["heads"]["budget_ratio"][()])
    with h5py.File(bundle_path / "e.h5", "r") as e:
        assert b.entropy.entropy == e.attrs["entropy_threshold"]
        assert b.entropy.varentropy == e.attrs["varentropy_threshold"]
        assert b.entropy.page_size == 16
    # A plan from the bundle: l_i = round(budget_ratio * context), full heads keep the context (closed form).
    plan = kvcal.make_hetero_plan(b.heads, 1000)
    ratio = np.asarray(b.heads.budget_ratio, dtype=np.float64)
    full = np.isin(b.heads.role, [2, 3])
    assert np.array_equal(plan.full.astype(bool), full)
    expect = np.where(full, 1000, np.clip(np.floor(ratio * 1000 + 0.5), 1, 1000)).astype(np.int64)
    assert np.array_equal(plan.budget, expect)
    assert plan.l_base == round(expect[~full].sum() / (~full).sum())
    b.close()
    assert b.closed
    with pytest.raises(ValueError, match="closed"):
        b.masks


def test_mask_cache_uses_the_bundle_then_generates(bundle_path):
    b = kvcal.Bundle.open(str(bundle_path / "b.kvcal.h5"))
    mc = kvcal.MaskCache()
    mc.attach(b)
    m1 = mc.get(96, 64, 4 / 64)
    assert m1.source.startswith("bundle:")
    m2 = mc.get(96, 64, 4 / 64)
    assert np.array_equal(m1.indices, m2.indices)
    m3 = mc.get(96, 128, 1 / 32)
    assert m3.source.startswith("generated:") and m3.ramanujan
    s = mc.stats
    assert (s["hits"], s["misses"], s["from_bundle"], s["generated"]) == (1, 2, 1, 1)
    # The certificate of the generated mask, checked independently.
    dense = np.zeros((96, 128))
    for i in range(96):
        dense[i, m3.indices[m3.indptr[i]:m3.indptr[i + 1]]] = 1
    assert np.linalg.svd(dense, compute_uv=False)[1] <= m3.ramanujan_bound + 1e-9
    b.close()  # the cache keeps what it needs
    assert mc.get(96, 64, 4 / 64).rows == 96


# ---------------------------------------------------------------- HEX and H2O caches


def numpy_attention(q, k, v, scale, group):
    """softmax(scale q K^T) V per query head; query head j reads KV head j // group. float64."""
    out, probs = [], []
    for j in range(q.shape[0]):
        kk, vv = k[j // group].astype(np.float64), v[j // group].astype(np.float64)
        s = scale * (kk @ q[j].astype(np.float64))
        p = np.exp(s - s.max())
        p /= p.sum()
        out.append(p @ vv)
        probs.append(p)
    return np.array(out), np.array(probs)


def random_kv(rng, heads, n, dim):
    return (rng.standard_normal((heads, n, dim)).astype(np.float16),
            rng.standard_normal((heads, n, dim)).astype(np.float16))


def test_fp16_attention_equals_numpy():
    rng = np.random.default_rng(1)
    k, v = random_kv(rng, 3, 150, 64)
    c = kvcal.HexLayerCache(3, 64, "fp16", block=96)
    c.append(k[:, :100], v[:, :100])
    c.append(k[:, 100:], v[:, 100:])
    q = rng.standard_normal((9, 64)).astype(np.float32)
    out, probs = c.attend(q, return_probs=True)
    ref, ref_p = numpy_attention(q, k, v, 1 / 8, 3)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5)  # float32 accumulation over 150 tokens
    np.testing.assert_allclose(probs, ref_p, rtol=0, atol=1e-6)
    assert c.bytes() == c.fp16_bytes() == 150 * 64 * 2 * 2 * 3


@pytest.mark.parametrize("method", ["kcvt4", "kcvt2", "h2o3", "expander4", "hex4", "hex2"])
def test_compressed_attention_equals_numpy_on_the_decoded_cache(method):
    rng = np.random.default_rng(2)
    H, D, N = 3, 64, 250
    k, v = random_kv(rng, H, N, D)
    (rec,) = kvcal.generate_masks(96, 64, row_degree=4, method="lift", seed=3)
    c = kvcal.HexLayerCache(H, D, method, kvcal.Mask(96, 64, rec.indptr, rec.indices))
    c.observe(rng.random((9, N)).astype(np.float32))
    c.append(k, v)
    assert c.tokens == N and c.compressed_tokens == 192
    kd, vd = c.dequantize()
    assert kd.shape == (H, 192, D)
    # Keys and values the cache attends to: the decoded blocks, then the fp16 residual.
    kk = np.concatenate([kd, k[:, 192:].astype(np.float32)], axis=1)
    vv = np.concatenate([vd, v[:, 192:].astype(np.float32)], axis=1)
    q = rng.standard_normal((9, D)).astype(np.float32)
    out, probs = c.attend(q, return_probs=True)
    ref, ref_p = numpy_attention(q, kk, vv, 1 / 8, 3)
    np.testing.assert_allclose(out, ref, rtol=0, atol=5e-5)  # scores on codes vs decoded floats: rounding only
    np.testing.assert_allclose(probs, ref_p, rtol=0, atol=1e-5)
    # The decoded cache is close to the input: quantization error bounded by the bits.
    bits = int(method[-1])
    err = np.abs(kd - k[:, :192].astype(np.float32)).max()
    assert err <= (k.max() - k.min()) / (2**bits - 1)
    assert c.bytes() < c.fp16_bytes()


@pytest.mark.parametrize("method", ["kcvt4", "kcvt3", "hex4", "hex2"])
@pytest.mark.parametrize("dot,levels,practical", [("int14", 8191, 0.01), ("int8", 127, 0.5)])
def test_integer_decode_is_the_float_decode_within_its_bound(method, dot, levels, practical):
    rng = np.random.default_rng(4)
    H, D, N = 3, 64, 250
    k, v = random_kv(rng, H, N, D)
    (rec,) = kvcal.generate_masks(96, 64, row_degree=4, method="lift", seed=3)
    mask = kvcal.Mask(96, 64, rec.indptr, rec.indices)
    obs = rng.random((9, N)).astype(np.float32)
    caches = [kvcal.HexLayerCache(H, D, m, mask) for m in (method, method + "@" + dot)]
    for c in caches:
        c.observe(obs)
        c.append(k, v)
    assert caches[0].bytes() == caches[1].bytes()
    kd, _ = caches[0].dequantize()
    kd1, _ = caches[1].dequantize()
    np.testing.assert_array_equal(kd, kd1)  # the same compressed blocks; only decode differs
    q = rng.standard_normal((9, D)).astype(np.float32)
    out, probs = caches[0].attend(q, return_probs=True)
    out_i, probs_i = caches[1].attend(q, return_probs=True)
    # Per block the query weights q_c delta_c are rounded to steps of s = max|q_c delta_c| / levels: a score
    # (scaled by 1/8) moves by at most s / 2 * (2^bits - 1) * D / 8 (hex.h); bound it through the decoded keys.
    bits = int(method[-1])
    s = np.abs(q).max() * (np.abs(kd).max() * 2) / (2**bits - 1) / levels
    score_bound = s / 2 * (2**bits - 1) * D / 8
    assert 0 < np.abs(probs - probs_i).max() <= 2 * score_bound * 1.01  # |d softmax| <= 2 max|d score|
    # Values: per block, weights p_t delta_t rounded to steps of max_t(p_t delta_t) / levels move a channel by at most
    # max_t p_t * max|v| * (96 tokens) / levels; plus what the moved weights carry (||dp||_1 <= 2 max|d score|).
    vmax = np.abs(v).max()
    block_max = probs[:, :192].reshape(9, 2, 96).max(axis=2).sum(axis=1)
    bound = block_max * vmax * 96 / levels + 2 * score_bound * 1.01 * vmax + 1e-5
    assert (np.abs(out_i - out).max(axis=1) <= bound).all()
    # In practice far below the bound, and below what quantization itself costs against plain attention: int14 by
    # two orders of magnitude (0.1-0.4% of it here), int8 (64 times the steps) by a factor of 3 or more (5-32%).
    exact, _ = numpy_attention(q, k.astype(np.float32), v.astype(np.float32), 1 / 8, 3)
    assert np.abs(out_i - out).max() <= practical * np.abs(out - exact).max()


def test_kcvt_bytes_closed_form():
    rng = np.random.default_rng(3)
    H, D, N, B = 2, 64, 300, 96
    k, v = random_kv(rng, H, N, D)
    c = kvcal.HexLayerCache(H, D, "kcvt4", block=B)
    c.append(k, v)
    blocks, residual = N // B, N % B
    # Per block and head: 4-bit codes of K and V, per-channel key parameters
    # (2 x fp16 per channel), per-token value parameters (2 x fp16 per token).
    per_block = 2 * B * D * 4 // 8 + D * 4 + B * 4
    assert c.bytes() == H * (blocks * per_block + residual * D * 2 * 2)


def test_h2o_evict_keeps_its_budget_and_equals_numpy():
    rng = np.random.default_rng(4)
    H, Hq, D, N = 3, 9, 64, 120
    k, v = random_kv(rng, H, N, D)
    c = kvcal.H2OEvictCache(H, Hq, D, 1.0)
    c.append(k, v)
    q = rng.standard_normal((Hq, D)).astype(np.float32)
    ref, _ = numpy_attention(q, k, v, 1 / 8, 3)
    np.testing.assert_allclose(c.attend(q), ref, rtol=0, atol=2e-5)
    half = kvcal.H2OEvictCache(H, Hq, D, 0.5)
    half.observe(rng.random((Hq, N)).astype(np.float32))
    half.append(k, v)
    limit = math.ceil(0.5 * N)
    assert [half.kept(h) for h in range(H)] == [limit] * H
    assert half.bytes() == H * limit * D * 2 * 2 and half.fp16_bytes() == H * N * D * 2 * 2
    out, probs = half.attend(q, return_probs=True)
    assert ((probs > 0).sum(axis=1) == limit).all()  # evicted tokens get no weight


def test_attend_writes_into_out_without_copy_and_reads_torch_style_views():
    rng = np.random.default_rng(5)
    k, v = random_kv(rng, 3, 40, 64)
    c = kvcal.HexLayerCache(3, 64, "fp16")
    # Inputs with strides: a [heads, tokens, dim] view of a [tokens, heads, dim] buffer is read in place.
    kt, vt = np.ascontiguousarray(k.transpose(1, 0, 2)), np.ascontiguousarray(v.transpose(1, 0, 2))
    c.append(kt.transpose(1, 0, 2), vt.transpose(1, 0, 2))
    q = rng.standard_normal((9, 64)).astype(np.float32)
    buf = np.zeros((9, 64), np.float32)
    got = c.attend(q, out=buf)
    assert got is buf and np.shares_memory(got, buf)
    np.testing.assert_allclose(buf, numpy_attention(q, k, v, 1 / 8, 3)[0], rtol=0, atol=2e-5)


def test_torch_tensors_through_dlpack():
    if os.environ.get("KVCAL_SANITIZED"):
        pytest.skip("torch is not loaded under the preloaded sanitizer runtimes")
    torch = pytest.importorskip("torch", reason="torch is not installed")
    rng = np.random.default_rng(6)
    k, v = random_kv(rng, 3, 30, 64)
    c = kvcal.HexLayerCache(3, 64, "fp16")
    c.append(torch.from_numpy(k), torch.from_numpy(v))
    q = torch.randn(9, 64)
    out = torch.zeros(9, 64)
    got = c.attend(q, out=out)
    assert got is out
    np.testing.assert_allclose(out.numpy(), numpy_attention(q.numpy(), k, v, 1 / 8, 3)[0], atol=2e-5)
    with pytest.raises(TypeError, match="dtype"):
        c.append(torch.from_numpy(k).to(torch.bfloat16), torch.from_numpy(v).to(torch.bfloat16))


def test_caches_release_the_gil_and_stay_consistent_across_threads():
    rng = np.random.default_rng(7)
    k, v = random_kv(rng, 3, 400, 64)
    q = rng.standard_normal((9, 64)).astype(np.float32)
    serial = kvcal.HexLayerCache(3, 64, "kcvt4")
    serial.append(k, v)
    expect = serial.attend(q)
    results = []

    def work():
        c = kvcal.HexLayerCache(3, 64, "kcvt4")
        for i in range(0, 400, 50):
            c.append(k[:, i:i + 50], v[:, i:i + 50])
        results.append(c.attend(q))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    for r in results:  # appended in pieces or at once: same blocks
        np.testing.assert_array_equal(r, expect)


# ---------------------------------------------------------------- CHESS and HeteroCache


def test_chess_index_summaries_and_selection():
    rng = np.random.default_rng(8)
    dim, B = 48, 8
    keys = rng.standard_normal((200, dim)).astype(np.float32)
    idx = kvcal.ChessIndex(dim, page_size=B, chunk_pages=2, grid_chunks=2)
    idx.append(keys[:77])
    idx.append(keys[77:])
    assert idx.tokens == 200 and idx.pages == 25
    store = idx.summaries()
    for p in (0, 7, 24):  # a page vector is the mean of its keys (CHESS Eq. 1)
        np.testing.assert_allclose(store[idx.page_row(p)], keys[p * B:(p + 1) * B].mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(idx.anchor(), keys[23 * B:25 * B].mean(axis=0), rtol=1e-5, atol=1e-6)
    sel = idx.select()
    assert sel.dtype == np.int32 and np.all(np.diff(sel) > 0)
    assert {0, 23, 24} <= set(sel.tolist())  # the sink page and the recent pages
    other = kvcal.ChessIndex(dim, page_size=B, chunk_pages=2, grid_chunks=2)
    other.append(keys[:45])
    indptr, indices, last = kvcal.select_batch([idx, other])
    assert indptr.tolist() == [0, len(sel), len(sel) + len(other.select()) + 1]
    assert indices[:len(sel)].tolist() == sel.tolist()
    assert indices[-1] == 5 and last.tolist() == [B, 45 - 5 * B]  # the partial last page


def test_reselection_trigger_against_numpy():
    rng = np.random.default_rng(9)
    ent, var = rng.random(64) * 3, rng.random(64) * 5
    t = kvcal.ReselectionTrigger(1.5, 2.5, page_size=16)
    fired = [t.push(float(e), float(x)) for e, x in zip(ent, var)]
    pages_e, pages_v = ent.reshape(4, 16).mean(axis=1), var.reshape(4, 16).mean(axis=1)
    expect = (pages_e > 1.5) & (pages_v > 2.5)
    assert [fired[16 * i + 15] for i in range(4)] == expect.tolist()
    assert sum(fired) == t.triggered == expect.sum() and t.pages == 4


def test_drift_monitor_against_numpy():
    rng = np.random.default_rng(10)
    L, W, tau = 5, 3, 0.6
    mon = kvcal.DriftMonitor(L, W, tau)
    pre = rng.random(50).astype(np.float32)
    mon.init(pre)
    base = set(np.argsort(-pre, kind="stable")[:L].tolist())
    assert set(mon.base.tolist()) == base
    overlaps = []
    for step in range(W):
        a = rng.random(51 + step).astype(np.float32)
        s = mon.step(a)
        o = len(base & set(np.argsort(-a, kind="stable")[:L].tolist())) / L
        overlaps.append(o)
        assert s.overlap == pytest.approx(o)
    assert s.checked and s.median == pytest.approx(np.median(overlaps)) and s.drift == (np.median(overlaps) < tau)


# ---------------------------------------------------------------- bad input


def test_method_names():
    assert kvcal.is_hex_method("hex4@int14") and kvcal.is_hex_method("kcvt2@float32") and kvcal.is_hex_method("fp16")
    assert kvcal.is_hex_method("kcvt2@int8")
    for bad in ("fp16@int14", "fp16@int8", "hex4@int4", "hex5", "hex4@"):
        assert not kvcal.is_hex_method(bad)
        with pytest.raises(ValueError, match="@" if "@" in bad else "unknown method"):
            kvcal.HexLayerCache(1, 64, bad)


def test_bad_arrays_are_type_or_value_errors():
    c = kvcal.HexLayerCache(3, 64, "fp16")
    good = np.zeros((3, 4, 64), np.float16)
    with pytest.raises(TypeError, match="float16"):
        c.append(good.astype(np.float32), good)
    with pytest.raises(TypeError, match="int16"):
        c.append(good.view(np.int16), good)
    with pytest.raises(ValueError, match="dimension 0"):
        c.append(np.zeros((2, 4, 64), np.float16), np.zeros((2, 4, 64), np.float16))
    with pytest.raises(ValueError, match="dimension"):
        c.append(np.zeros((3, 4), np.float16), np.zeros((3, 4), np.float16))
    wide = np.zeros((3, 4, 128), np.float16)
    with pytest.raises(ValueError, match="contiguous"):
        c.append(wide[:, :, ::2], wide[:, :, ::2])
    with pytest.raises(ValueError, match="negative"):
        c.append(good[:, ::-1], good[:, ::-1])
    with pytest.raises(ValueError, match="same strides"):
        c.append(good, np.ascontiguousarray(good.transpose(1, 0, 2)).transpose(1, 0, 2))
    with pytest.raises(ValueError, match="tokens"):
        c.append(good, good[:, :3])
    with pytest.raises(TypeError):
        c.append([[1.0]], good)
    c.append(good, good)
    with pytest.raises(ValueError, match="contiguous"):
        c.attend(np.zeros((9, 128), np.float32)[:, ::2])
    with pytest.raises(ValueError, match="dimension 1"):
        c.attend(np.zeros((9, 32), np.float32))
    with pytest.raises(TypeError):
        c.attend(np.zeros((9, 64), np.float32), out=np.zeros((9, 64), np.float32)[::1].view(np.int32))
    ro = np.zeros((9, 64), np.float32)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="writable"):
        c.attend(np.zeros((9, 64), np.float32), out=ro)
    with pytest.raises(kvcal.Error, match="multiple of KV heads"):
        c.attend(np.zeros((4, 64), np.float32))


def test_non_finite_values_are_rejected_with_the_runtime_message():
    c = kvcal.HexLayerCache(1, 64, "kcvt4", block=4)
    k = np.ones((1, 4, 64), np.float16)
    k[0, 2, 5] = np.nan
    with pytest.raises(kvcal.Error, match="finite"):
        c.append(k, np.ones_like(k))
    assert c.tokens == 0  # strong guarantee: unchanged
    with pytest.raises(kvcal.Error, match="non-finite attention"):
        c.observe(np.array([[1.0, np.inf]], np.float32))
    h = kvcal.H2OEvictCache(1, 1, 64, 0.5)
    with pytest.raises(kvcal.Error, match="non-finite"):
        h.observe(np.array([[np.nan]], np.float32))
    idx = kvcal.ChessIndex(8, page_size=4)
    with pytest.raises(kvcal.Error):
        idx.append(np.full((2, 8), np.nan, np.float32))
    with pytest.raises(kvcal.Error):
        kvcal.ReselectionTrigger(np.nan, 1.0)
    with pytest.raises(ValueError, match="finite"):
        kvcal.HexLayerCache(1, 64, "fp16").attend(np.zeros((1, 64), np.float32), scale=float("nan"))


def test_impossible_parameters():
    with pytest.raises(kvcal.Error, match="row degree|degree"):
        kvcal.generate_masks(96, 128, row_degree=200)
    with pytest.raises(kvcal.Error, match="lift"):
        kvcal.generate_masks(96, 100, row_degree=3, method="lift")
    with pytest.raises(kvcal.Error, match="prime"):
        kvcal.generate_masks(method="lps", lps_p=4, lps_q=13)
    with pytest.raises(kvcal.Error, match="one of"):
        kvcal.generate_masks(96, 128, row_degree=4, sparsity=0.5)
    with pytest.raises(kvcal.Error, match="unknown method"):
        kvcal.generate_masks(96, 128, row_degree=4, method="magic")
    with pytest.raises(kvcal.Error, match="no certified Ramanujan"):
        kvcal.generate_masks(32, 64, row_degree=2, method="lift", tries=2)
    with pytest.raises(ValueError, match="max_failure_probability"):
        kvcal.generate_masks(96, 128, row_degree=4, max_failure_probability=2)
    with pytest.raises(kvcal.Error, match="unknown method"):
        kvcal.HexLayerCache(3, 64, "hex9")
    with pytest.raises(kvcal.Error, match="mask"):
        kvcal.HexLayerCache(3, 64, "hex4")  # the expander needs a mask
    with pytest.raises(kvcal.Error, match="budget"):
        kvcal.H2OEvictCache(3, 9, 64, 0.0)
    with pytest.raises(kvcal.Error):
        kvcal.ChessIndex(8, preset="reckless")
    with pytest.raises(ValueError, match="mode"):
        kvcal.HexLayerCache(3, 64, "fp16", mode="sometimes")
    with pytest.raises(kvcal.Error, match="drift monitor"):
        kvcal.DriftMonitor(0, 3, 0.5)
    with pytest.raises(ValueError, match="threads"):
        kvcal.profile_heads([DUMP], threads=-1)
    with pytest.raises(kvcal.Error, match="gqa|mean"):
        kvcal.profile_heads([DUMP], gqa="median")
    with pytest.raises(ValueError, match="indptr"):
        kvcal.certify(96, 128, np.zeros(5, np.int64), np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="well-formed"):
        kvcal.certify(2, 4, np.array([0, 2, 4]), np.array([1, 0, 2, 3], np.int32))


def test_files_missing_unwritable_or_corrupt(tmp_path, bundle_path):
    with pytest.raises(OSError, match="no such file"):
        kvcal.read_masks(str(tmp_path / "none.h5"))
    with pytest.raises(OSError, match="no such file"):
        kvcal.profile_heads([str(tmp_path / "none.h5")])
    (r,) = kvcal.generate_masks(96, 128, row_degree=4)
    with pytest.raises(OSError):
        kvcal.write_masks(str(tmp_path / "no_dir" / "m.h5"), [r])
    with pytest.raises(OSError):
        kvcal.calibrate_entropy([DUMP], out=str(tmp_path))  # a directory
    assert not list(tmp_path.glob("**/*.h5"))  # nothing half-written
    with pytest.raises(OSError, match="no such file"):
        kvcal.Bundle.open(str(tmp_path / "none.h5"))
    # Corrupt bundles: truncated, bytes flipped in the middle, not HDF5 at all.
    src = bundle_path / "b.kvcal.h5"
    data = src.read_bytes()
    (tmp_path / "trunc.h5").write_bytes(data[: len(data) // 2])
    flipped = bytearray(data)
    for i in range(len(data) // 2, len(data) // 2 + 64):
        flipped[i] ^= 0xFF
    (tmp_path / "flip.h5").write_bytes(bytes(flipped))
    (tmp_path / "text.h5").write_text("not a bundle\n")
    shutil.copy(bundle_path / "m.h5", tmp_path / "masks_only.h5")  # a valid file of another kind
    for name in ("trunc.h5", "flip.h5", "text.h5", "masks_only.h5"):
        with pytest.raises(kvcal.Error) as e:
            kvcal.Bundle.open(str(tmp_path / name))
        assert str(e.value) and "\n" not in str(e.value).strip(), name
    with pytest.raises(kvcal.Error):
        kvcal.read_masks(str(tmp_path / "text.h5"))


def test_library_messages_survive(tmp_path):
    with pytest.raises(kvcal.Error) as e:
        kvcal.generate_masks(96, 100, row_degree=3, method="lift")
    assert "mask 96x100 with row degree 3" in str(e.value)
    assert issubclass(kvcal.Error, ValueError)


# ---- kvcal.eval_model: what runs without torch (statistics, arguments); the model run is test_eval_model.py
def test_eval_model_statistics_closed_forms():
    import kvcal.eval_model as em

    rng = np.random.default_rng(3)
    x = rng.gamma(2.0, 1.5, size=4 * 64)
    idx = em.bootstrap_index(len(em.block_means(x, 64)), 500, 1)
    assert em.block_means(x, 64).shape == (8,)
    np.testing.assert_allclose(em.block_means(x, 64), x.reshape(8, 32).mean(axis=1))
    ppl, lo, hi = em.ppl_interval(x, 64, idx)
    assert ppl == pytest.approx(np.exp(x.mean())) and lo <= ppl <= hi
    # A constant per-token difference c: the change is exactly 100 (e^c - 1) %, with no spread.
    d, dlo, dhi = em.paired_delta(x + 0.01, x, 64, idx)
    assert d == pytest.approx(100 * np.expm1(0.01)) and dlo == pytest.approx(d) and dhi == pytest.approx(d)
    # The identical method: zero change.
    assert em.paired_delta(x, x, 64, idx) == (0.0, 0.0, 0.0)
    # Spearman: perfectly monotone, reversed, and a hand-ranked case (ranks 1,3,2,4 vs 1,2,3,4: 1 - 6*2/(4*15)).
    assert em.spearman([1, 2, 3, 4], [10, 20, 30, 400]) == pytest.approx(1.0)
    assert em.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert em.spearman([1, 3, 2, 4], [1, 2, 3, 4]) == pytest.approx(0.8)
    assert em.answer_matches(" 12345. Remember", "12345") and not em.answer_matches(" 1234 5", "12345")


def test_eval_model_cli_help_and_bad_arguments(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvcal.eval_model", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--quick" in r.stdout and "examples:" in r.stdout
    for args, message in ((["--methods", "fp16,nosuch"], "unknown method 'nosuch'"),
                          (["--methods", "hetero"], "eval-fidelity"),
                          (["--windows", "0"], "--windows must be at least 1"),
                          (["--methods", "fp16", "--texts", "nosuchtext"], "unknown text")):
        r = subprocess.run([sys.executable, "-m", "kvcal.eval_model", "--out-dir", str(tmp_path / "o"), *args],
                           capture_output=True, text=True)
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("eval_model: error:") and message in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "o").exists()
