// CHESS selection driven through a backend (a GPU through chess_cuda.h, or
// the host emulation of CUDA) and compared with ChessIndex / select_batch on
// the same keys: a batch of requests of mixed lengths (empty, a partial
// page, exactly one page, a single grid, many grids), keys appended layer by
// layer over several steps, the page table compared after every step. Keys
// are small multiples of 36, so that every mean and dot product is exact in
// float and page sets must be identical (HEX's ties apart, none here).
//
// A backend provides alloc/put/get (as in flow.h) and chess_append(batch,
// keys, stride, offset, width, indptr, before), chess_select(batch, tokens, table).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvcal/runtime/chess.h"
#include "kvcal/runtime/chess_cuda.h"

namespace kvcal::runtime::chess_flow {

namespace kc = kvcal::runtime::cuda;

// A preset with pages of `page` tokens, `chunk` pages per chunk and `grid`
// chunks per grid.
inline ChessOptions options(const char* preset, std::int64_t page, std::int64_t chunk, std::int64_t grid) {
  ChessOptions o = chess_preset(preset);
  o.page_size = page;
  o.chunk_pages = chunk;
  o.grid_chunks = grid;
  return o;
}

template <class Backend>
void run(Backend& be, const ChessOptions& o, std::int32_t layers, std::int32_t width,
         const std::vector<std::int32_t>& prefill, int steps) {
  SCOPED_TRACE("page " + std::to_string(o.page_size) + " chunk " + std::to_string(o.chunk_pages) + " grid " +
               std::to_string(o.grid_chunks));
  const std::int32_t D = layers * width, R = static_cast<std::int32_t>(prefill.size());
  std::int32_t longest = 0;
  for (const std::int32_t n : prefill) longest = std::max(longest, n + steps);
  const std::int32_t max_pages = std::max<std::int32_t>(1, static_cast<std::int32_t>(longest / o.page_size));
  const std::size_t bytes = kc::chess_batch_bytes(R, D, max_pages, o);
  auto mem = be.alloc(bytes);  // zeroed
  const kc::ChessDeviceBatch b = kc::chess_batch(mem.p, bytes, R, D, max_pages, o);
  auto indptr_d = be.alloc((R + 1) * 4), indices_d = be.alloc(static_cast<std::size_t>(R) * (max_pages + 1) * 4),
       last_d = be.alloc(R * 4), tokens_d = be.alloc(R * 4), before_d = be.alloc(R * 4), tip_d = be.alloc((R + 1) * 4);
  const kc::ChessPageTable table{static_cast<std::int32_t*>(indptr_d.p), static_cast<std::int32_t*>(indices_d.p),
                                 static_cast<std::int32_t*>(last_d.p)};
  std::vector<ChessIndex> ref;
  for (int r = 0; r < R; ++r) ref.emplace_back(D, o);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(R), 0);
  std::mt19937_64 rng(17);
  std::uniform_int_distribution<int> val(-5, 5);
  for (int step = 0; step <= steps; ++step) {
    std::vector<std::int32_t> indptr{0}, counts;
    for (int r = 0; r < R; ++r) {
      counts.push_back(step == 0 ? prefill[static_cast<std::size_t>(r)] : (r % 2 == 0 || step % 3 == 0 ? 1 : 0));
      indptr.push_back(indptr.back() + counts.back());
    }
    const std::int32_t rows = indptr.back();
    std::vector<half_bits> keys(static_cast<std::size_t>(std::max(rows, 1)) * D);
    std::vector<float> fkeys(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
      fkeys[i] = static_cast<float>(36 * val(rng));
      keys[i] = float_to_half(fkeys[i]);
    }
    for (int r = 0; r < R; ++r)
      ref[static_cast<std::size_t>(r)].append(fkeys.data() + static_cast<std::size_t>(indptr[r]) * D,
                                              counts[static_cast<std::size_t>(r)], D);
    auto keys_d = be.alloc(keys.size() * 2);
    be.put(keys_d.p, keys.data(), keys.size() * 2);
    be.put(tip_d.p, indptr.data(), indptr.size() * 4);
    be.put(before_d.p, tokens.data(), tokens.size() * 4);
    for (std::int32_t l = 0; l < layers; ++l)  // one call per layer: its slice of every token's D values
      be.chess_append(b, static_cast<const half_bits*>(keys_d.p) + l * width, D, l * width, width,
                      static_cast<const std::int32_t*>(tip_d.p), static_cast<const std::int32_t*>(before_d.p));
    for (int r = 0; r < R; ++r) tokens[static_cast<std::size_t>(r)] += counts[static_cast<std::size_t>(r)];
    be.put(tokens_d.p, tokens.data(), tokens.size() * 4);
    be.chess_select(b, static_cast<const std::int32_t*>(tokens_d.p), table);
    std::vector<const ChessIndex*> reqs;
    for (const auto& c : ref) reqs.push_back(&c);
    const PageTable want = select_batch(reqs);
    std::vector<std::int32_t> indptr_got(static_cast<std::size_t>(R + 1)), last_got(static_cast<std::size_t>(R));
    be.get(indptr_got.data(), indptr_d.p, indptr_got.size() * 4);
    be.get(last_got.data(), last_d.p, last_got.size() * 4);
    ASSERT_EQ(indptr_got, want.indptr) << "step " << step;
    std::vector<std::int32_t> indices_got(static_cast<std::size_t>(indptr_got.back()));
    be.get(indices_got.data(), indices_d.p, indices_got.size() * 4);
    ASSERT_EQ(indices_got, want.indices) << "step " << step;
    ASSERT_EQ(last_got, want.last_page_len) << "step " << step;
  }
}

// A store of requests holding `lengths` tokens of D-dimensional keys from
// gen() (rounded to binary16), appended in one call from token 0, beside
// ChessIndex on the same keys (ref), with a page table to select into.
template <class Backend>
struct Filled {
  using Buffer = decltype(std::declval<Backend&>().alloc(0));
  Backend& be;
  const ChessOptions o;
  const std::int32_t D, R, max_pages;
  const std::vector<std::int32_t> lengths;
  std::vector<std::int32_t> indptr{0};
  const std::size_t bytes;
  Buffer mem;
  const kc::ChessDeviceBatch b;
  Buffer keys_d, ip, before, tok, t_ip, t_idx, t_last;
  const kc::ChessPageTable table;
  std::vector<ChessIndex> ref;

  template <class Gen>
  Filled(Backend& backend, const ChessOptions& opt, std::int32_t dim, std::vector<std::int32_t> lens,
         std::int32_t pages, Gen gen)
      : be(backend),
        o(opt),
        D(dim),
        R(static_cast<std::int32_t>(lens.size())),
        max_pages(pages),
        lengths(std::move(lens)),
        bytes(kc::chess_batch_bytes(R, D, max_pages, o)),
        mem(be.alloc(bytes)),
        b(kc::chess_batch(mem.p, bytes, R, D, max_pages, o)),
        keys_d(be.alloc(static_cast<std::size_t>(total()) * D * 2)),
        ip(be.alloc((R + 1) * 4)),
        before(be.alloc(R * 4)),
        tok(be.alloc(R * 4)),
        t_ip(be.alloc((R + 1) * 4)),
        t_idx(be.alloc(static_cast<std::size_t>(R) * (max_pages + 1) * 4)),
        t_last(be.alloc(R * 4)),
        table{static_cast<std::int32_t*>(t_ip.p), static_cast<std::int32_t*>(t_idx.p),
              static_cast<std::int32_t*>(t_last.p)} {
    for (const std::int32_t n : lengths) indptr.push_back(indptr.back() + n);
    be.put(ip.p, indptr.data(), indptr.size() * 4);
    append(gen);
  }
  std::int32_t total() const {
    std::int32_t t = 0;
    for (const std::int32_t n : lengths) t += n;
    return t;
  }
  // Keys from gen for every request, appended from token 0; ref rebuilt on them.
  template <class Gen>
  void append(Gen gen) {
    std::vector<half_bits> keys(static_cast<std::size_t>(indptr.back()) * D);
    std::vector<float> fkeys(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
      keys[i] = float_to_half(gen());
      fkeys[i] = half_to_float(keys[i]);
    }
    ref.clear();
    for (int r = 0; r < R; ++r) {
      ref.emplace_back(D, o);
      ref.back().append(fkeys.data() + static_cast<std::size_t>(indptr[static_cast<std::size_t>(r)]) * D,
                        lengths[static_cast<std::size_t>(r)], D);
    }
    const std::vector<std::int32_t> zeros(static_cast<std::size_t>(R), 0);
    be.put(keys_d.p, keys.data(), keys.size() * 2);
    be.put(before.p, zeros.data(), R * 4);
    be.chess_append(b, static_cast<const half_bits*>(keys_d.p), D, 0, D, static_cast<const std::int32_t*>(ip.p),
                    static_cast<const std::int32_t*>(before.p));
  }
  // chess_select at `tokens` per request, the table read back.
  PageTable select(const std::vector<std::int32_t>& tokens) {
    be.put(tok.p, tokens.data(), R * 4);
    be.chess_select(b, static_cast<const std::int32_t*>(tok.p), table);
    PageTable got;
    got.indptr.resize(static_cast<std::size_t>(R) + 1);
    got.last_page_len.resize(static_cast<std::size_t>(R));
    be.get(got.indptr.data(), t_ip.p, got.indptr.size() * 4);
    be.get(got.last_page_len.data(), t_last.p, got.last_page_len.size() * 4);
    got.indices.resize(static_cast<std::size_t>(got.indptr.back()));
    be.get(got.indices.data(), t_idx.p, got.indices.size() * 4);
    return got;
  }
  // select_batch over ref.
  PageTable want() const {
    std::vector<const ChessIndex*> reqs;
    for (const auto& c : ref) reqs.push_back(&c);
    return select_batch(reqs);
  }
};

// Real-valued keys: the summaries (page, chunk and grid vectors) equal
// ChessIndex's bit for bit (the same double sums, the same roundings); the
// backend's scores are float dot products summed in another order than the
// CPU's, so they are compared with double products of the CPU's vectors and
// anchor within 4 * D * 2^-24 * sum |a_i v_i| (a float sum's error bound),
// and the page table equals the hierarchical rule applied on the host to the
// backend's own scores (so a flipped page can only come from a score within
// that bound of a level's threshold).
// D: 96 (the score kernel's float4 tail only), 1030 (not a multiple of 4:
// its scalar loop), 2052 (its unrolled loop twice, then the tail).
template <class Backend>
void real_keys(Backend& be, std::int32_t D) {
  SCOPED_TRACE("D " + std::to_string(D));
  const ChessOptions o = options("moderate", 8, 3, 2);
  std::mt19937_64 rng(31);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Filled<Backend> f(be, o, D, {7, 8 * 13 + 3, 8 * 40}, 40, [&] { return nd(rng); });
  const std::int32_t R = f.R, max_pages = f.max_pages;
  const kc::ChessDeviceBatch& b = f.b;
  const PageTable table = f.select(f.lengths);
  const std::int64_t rows = std::int64_t{b.max_grids} + b.max_chunks + b.max_pages;
  std::vector<float> pages(static_cast<std::size_t>(R) * max_pages * D),
      chunks(static_cast<std::size_t>(R) * b.max_chunks * D), grids(static_cast<std::size_t>(R) * b.max_grids * D),
      scores(static_cast<std::size_t>(R * rows));
  be.get(pages.data(), b.pages, pages.size() * 4);
  be.get(chunks.data(), b.chunks, chunks.size() * 4);
  be.get(grids.data(), b.grids, grids.size() * 4);
  be.get(scores.data(), b.scores, scores.size() * 4);
  const std::vector<std::int32_t>& got_ip = table.indptr;
  const std::vector<std::int32_t>& got = table.indices;
  for (int r = 0; r < R; ++r) {
    const ChessIndex& c = f.ref[static_cast<std::size_t>(r)];
    const std::int64_t P = c.pages(), C = c.chunks(), G = c.grids();
    const auto row_eq = [&](const float* dev, std::int64_t ref_row) {
      return std::equal(dev, dev + D, c.store() + ref_row * D);
    };
    for (std::int64_t p = 0; p < P; ++p)
      ASSERT_TRUE(row_eq(pages.data() + (static_cast<std::int64_t>(r) * max_pages + p) * D, c.page_row(p)))
          << r << " page " << p;
    for (std::int64_t q = 0; q < C; ++q)
      ASSERT_TRUE(row_eq(chunks.data() + (static_cast<std::int64_t>(r) * b.max_chunks + q) * D, c.chunk_row(q)))
          << "chunk " << q;
    for (std::int64_t g = 0; g < G; ++g)
      ASSERT_TRUE(row_eq(grids.data() + (static_cast<std::int64_t>(r) * b.max_grids + g) * D, c.grid_row(g)))
          << "grid " << g;
    std::vector<std::int32_t> want;
    if (P > 0) {
      const std::vector<float> a = c.anchor();
      const float* s = scores.data() + r * rows;
      const auto check = [&](float dev, std::int64_t ref_row) {
        double exact = 0, mag = 0;
        for (std::int32_t i = 0; i < D; ++i) {
          exact += double(a[static_cast<std::size_t>(i)]) * c.store()[ref_row * D + i];
          mag += std::abs(double(a[static_cast<std::size_t>(i)]) * c.store()[ref_row * D + i]);
        }
        ASSERT_LE(std::abs(dev - exact), 4.0 * D * std::ldexp(1.0, -24) * mag + 1e-30);
      };
      std::vector<std::int32_t> cg, pc;
      for (std::int64_t q = 0; q < C; ++q) cg.push_back(static_cast<std::int32_t>(q / o.grid_chunks));
      for (std::int64_t p = 0; p < P; ++p) pc.push_back(static_cast<std::int32_t>(p / o.chunk_pages));
      std::vector<std::uint8_t> gm(static_cast<std::size_t>(G)), cm(static_cast<std::size_t>(C)),
          pm(static_cast<std::size_t>(P));
      hierarchical_select(s, G, s + b.max_grids, cg.data(), C, s + b.max_grids + b.max_chunks, pc.data(), P, o.rho_grid,
                          o.rho_chunk, o.rho_page, gm.data(), cm.data(), pm.data());
      // Units whose parent is inactive are not scored (0: the rule zeroes them).
      for (std::int64_t g = 0; g < G; ++g) check(s[g], c.grid_row(g));
      std::int64_t skipped = 0;
      for (std::int64_t q = 0; q < C; ++q) {
        if (gm[static_cast<std::size_t>(q / o.grid_chunks)]) {
          check(s[b.max_grids + q], c.chunk_row(q));
        } else {
          ++skipped;
          ASSERT_EQ(s[b.max_grids + q], 0.0f) << "chunk " << q;
        }
      }
      for (std::int64_t p = 0; p < P; ++p) {
        if (cm[static_cast<std::size_t>(p / o.chunk_pages)]) {
          check(s[b.max_grids + b.max_chunks + p], c.page_row(p));
        } else {
          ++skipped;
          ASSERT_EQ(s[b.max_grids + b.max_chunks + p], 0.0f) << "page " << p;
        }
      }
      if (P == 40) {  // the long request leaves units out
        EXPECT_GT(skipped, 0) << "request " << r;
      }
      for (std::int64_t p = 0; p < P; ++p)
        if (pm[static_cast<std::size_t>(p)] || p < o.sink_pages || p >= P - o.recent_pages)
          want.push_back(static_cast<std::int32_t>(p));
    }
    if (c.tokens() % o.page_size) want.push_back(static_cast<std::int32_t>(P));
    const std::vector<std::int32_t> dev(got.begin() + got_ip[static_cast<std::size_t>(r)],
                                        got.begin() + got_ip[static_cast<std::size_t>(r) + 1]);
    ASSERT_EQ(dev, want) << "request " << r;
  }
}

// The kept selection (chess_cuda.h): reused while a request's complete pages
// stay as they are, recomputed after chess_invalidate. The store's page
// vectors are overwritten behind chess_append's back (zeros), so that a
// reused selection and a recomputed one tell themselves apart: the first is
// still ChessIndex's, the second selects every page (all scores 0, so every
// level's threshold is 0 and every active unit passes it).
template <class Backend>
void kept(Backend& be) {
  const ChessOptions o = options("moderate", 4, 4, 2);
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<int> val(-5, 5);
  const auto gen = [&] { return static_cast<float>(36 * val(rng)); };
  Filled<Backend> f(be, o, 16, {130, 61}, 40, gen);  // 32 pages + 2, 15 pages + 1
  const std::int32_t D = f.D, R = f.R;
  const std::vector<std::int32_t>& lengths = f.lengths;
  const kc::ChessDeviceBatch& b = f.b;
  const auto select = [&](const std::vector<std::int32_t>& tokens) { return f.select(tokens); };
  const PageTable want = f.want();
  const PageTable first = select(lengths);
  ASSERT_EQ(first.indptr, want.indptr);
  ASSERT_EQ(first.indices, want.indices);
  ASSERT_EQ(first.last_page_len, want.last_page_len);
  // Every page vector zeroed without chess_append: the kept selections hold.
  const std::vector<float> zero_pages(static_cast<std::size_t>(R) * b.max_pages * D, 0.0f);
  be.put(b.pages, zero_pages.data(), zero_pages.size() * 4);
  const PageTable again = select(lengths);
  EXPECT_EQ(again.indices, want.indices);
  // Without its partial page (tokens rounded down to whole pages, the same
  // complete pages): the same selection less the partial page.
  std::vector<std::int32_t> whole;
  for (const std::int32_t n : lengths) whole.push_back(n - n % o.page_size);
  const PageTable trimmed = select(whole);
  for (int r = 0; r < R; ++r) {
    const std::int32_t n0 = want.indptr[static_cast<std::size_t>(r)], n1 = want.indptr[static_cast<std::size_t>(r) + 1];
    const std::vector<std::int32_t> w(want.indices.begin() + n0, want.indices.begin() + n1 - 1),
        g(trimmed.indices.begin() + trimmed.indptr[static_cast<std::size_t>(r)],
          trimmed.indices.begin() + trimmed.indptr[static_cast<std::size_t>(r) + 1]);
    EXPECT_EQ(g, w) << "request " << r;
    EXPECT_EQ(trimmed.last_page_len[static_cast<std::size_t>(r)], o.page_size);
  }
  // The slots reused for new sequences of the same lengths: summaries and
  // sums zeroed (the kept selections left as they are), other keys appended;
  // the pages they complete drop the kept selections.
  const auto zero = [&](auto* p, std::size_t n) {
    const std::vector<std::uint8_t> z(n * sizeof(*p), 0);
    be.put(p, z.data(), z.size());
  };
  const auto R_ = static_cast<std::size_t>(R), D_ = static_cast<std::size_t>(D);
  zero(b.pages, R_ * b.max_pages * D_);
  zero(b.chunks, R_ * b.max_chunks * D_);
  zero(b.grids, R_ * b.max_grids * D_);
  zero(b.page_sum, R_ * D_);
  zero(b.chunk_acc, R_ * D_);
  zero(b.grid_acc, R_ * D_);
  f.append(gen);
  const PageTable want2 = f.want();
  ASSERT_NE(want2.indices, want.indices);  // the check below tells a kept selection from a new one
  EXPECT_EQ(select(lengths).indices, want2.indices);
  // Forgotten: recomputed from zeroed pages, every page selected; the CPU's
  // selection is a strict subset of them.
  zero(b.pages, R_ * b.max_pages * D_);
  be.chess_invalidate(b);
  const PageTable fresh = select(lengths);
  std::vector<std::int32_t> all;
  for (const std::int32_t n : lengths) {
    for (std::int32_t p = 0; p < n / o.page_size; ++p) all.push_back(p);
    if (n % o.page_size) all.push_back(n / o.page_size);
  }
  EXPECT_EQ(fresh.indices, all);
  EXPECT_LT(want.indices.size(), all.size());
}

template <class Backend>
void batch(Backend& be) {
  const ChessOptions o = options("moderate", 4, 4, 2);
  // Requests: empty, a partial page, one page, one grid, several grids.
  run(be, o, 2, 16, {0, 3, 4, 24, 130}, 9);
  ChessOptions a = options("aggressive", 2, 2, 2);
  a.sink_pages = 2;
  a.recent_pages = 1;
  run(be, a, 3, 8, {5, 64, 1}, 6);
  for (const std::int32_t D : {96, 1030, 2052}) real_keys(be, D);
}

}  // namespace kvcal::runtime::chess_flow
