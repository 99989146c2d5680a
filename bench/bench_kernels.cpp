// The HEX decode kernels alone, on one thread, over one block that stays in
// the L1/L2 caches: what each multiply-add path costs per code, apart from
// memory. Shapes are the decode benchmark's: 96 rows (a block), head dim 128.
//
//  kernel/scores/<dot>/<bits>/<group>: code_scores (float32) or
//    code_scores_int (int14: two limbs, int8: one) for a GQA group.
//  kernel/accumulate/<dot>/<bits>/<group>: code_accumulate(_int) likewise.
//  kernel/scores_tiles/..., kernel/accumulate_tiles/...: the integer kernels
//    over the layer cache's key and value tiles (see below).
//  kernel/quantize/<dot>: the fixed-point weights of one query's 128 weights.
//  kernel/scores_stream/<MiB>/<group>: code_scores_int (int8, 4 bits) over
//    consecutive blocks of codes, from L2, the L3 or memory (bytes/s: what
//    the kernel draws by itself).
//  kernel/key_weights/<group>: a block's key side before its codes are read
//    (int8) for a GQA group, as the decode makes it: key_weights_int8 where
//    the target has that pass; kernel/key_weights_steps/<group> the three
//    steps apart (its (delta, min) pairs converted from binary16,
//    key_weights and quantize_rows), the baseline.
//  kernel/widen3: a block's 3-bit rows widened to 4 bits, as the integer
//    kernels read them where they do not widen them in registers (the
//    int14 path, GQA groups above 1, and targets without the unrolled
//    kernels); kernel/widen3/memory/<ahead> the same from memory, and
//    kernel/copy3/memory a copy of those bytes.
//  kernel/run_entries/<group>: the fused per-token kernels of a HEX block's
//    expander entries, key and value side, for a GQA group;
//    kernel/run_entries/keys/<group> and kernel/run_entries/values/<group>
//    each side alone.
//  kernel/softmax: softmax_row over one query's 32K scores (the decode
//    benchmark's context; 128 KB, in the L2 cache), items = weights.
// items_per_second counts codes times queries (multiply-adds).
// KVCAL_BENCH_TARGET forces a SIMD target, KVCAL_AVX_VNNI=0/1 the VPDPBUSD
// integer kernels on AVX2 (AVX-VNNI) and AVX3 (AVX-512 VNNI; see
// force_target.h).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "force_target.h"
#include "kvcal/core/half.h"
#include "runtime/hex/entries_cpu.h"
#include "runtime/hex/kernels_cpu.h"
#include "runtime/hex/key_side.h"

namespace {

namespace d = kvcal::runtime::detail;
constexpr std::int64_t kRows = 96, kDim = 128;

struct Inputs {
  std::vector<std::uint8_t> codes;
  std::vector<float> w;
  std::vector<std::int8_t> w8;
  std::int64_t row_bytes;
  Inputs(int bits, std::int64_t group, std::int64_t n_weights, int limbs) {
    std::mt19937_64 rng(5);
    std::uniform_int_distribution<int> byte(0, 255), i8(-64, 63);
    std::normal_distribution<float> g(0.0f, 1.0f);
    row_bytes = kDim * bits / 8;
    codes.resize(static_cast<std::size_t>(kRows * row_bytes));
    for (auto& c : codes) c = static_cast<std::uint8_t>(byte(rng));
    w.resize(static_cast<std::size_t>(group * n_weights));
    for (auto& x : w) x = g(rng);
    w8.resize(static_cast<std::size_t>(group * n_weights * limbs));
    for (auto& x : w8) x = static_cast<std::int8_t>(i8(rng));
  }
};

int limbs_of(const std::string& dot) { return dot == "int14" ? 2 : 1; }

void scores(benchmark::State& state, const std::string& dot) {
  const int bits = static_cast<int>(state.range(0));
  const std::int64_t group = state.range(1);
  const int limbs = limbs_of(dot);
  Inputs in(bits, group, kDim, limbs);
  std::vector<float> out(static_cast<std::size_t>(group * kRows));
  std::vector<std::int32_t> iout(out.size());
  for (auto _ : state) {
    if (dot == "float32")
      d::code_scores(in.codes.data(), kRows, in.row_bytes, bits, kDim, in.w.data(), group, kDim, out.data(), kRows);
    else
      d::code_scores_int(in.codes.data(), kRows, in.row_bytes, bits, kDim, limbs, in.w8.data(), group, limbs * kDim,
                         iout.data(), kRows);
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(iout.data());
  }
  state.SetItemsProcessed(state.iterations() * kRows * kDim * group);
}

// The integer scores over key tiles (the layer cache's key layout with an
// integer dot): kernel/scores_tiles/<dot>/<bits>/<group>/<rows>, 96 rows (six
// whole tiles, as kernel/scores) or 94 (a HEX block's two kept tokens: five
// tiles and a last tile of 14 rows).
void scores_tiles(benchmark::State& state, const std::string& dot) {
  const int bits = static_cast<int>(state.range(0));
  const std::int64_t group = state.range(1), rows = state.range(2);
  const int limbs = limbs_of(dot);
  Inputs in(bits, group, kDim, limbs);
  std::vector<std::uint8_t> tiles(in.codes.size());
  d::rows_to_key_tiles(in.codes.data(), rows, in.row_bytes, bits, tiles.data());
  std::vector<std::int32_t> out(static_cast<std::size_t>(group * kRows));
  for (auto _ : state) {
    d::code_scores_int_tiles(tiles.data(), rows, in.row_bytes, bits, kDim, limbs, in.w8.data(), group, limbs * kDim,
                             out.data(), kRows);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * rows * kDim * group);
}

void accumulate(benchmark::State& state, const std::string& dot) {
  const int bits = static_cast<int>(state.range(0));
  const std::int64_t group = state.range(1);
  const int limbs = limbs_of(dot);
  Inputs in(bits, group, kRows, limbs);
  std::vector<float> acc(static_cast<std::size_t>(group * kDim));
  std::vector<std::int32_t> iacc(acc.size());
  for (auto _ : state) {
    if (dot == "float32")
      d::code_accumulate(in.codes.data(), kRows, in.row_bytes, bits, kDim, in.w.data(), group, kRows, acc.data(), kDim);
    else
      d::code_accumulate_int(in.codes.data(), kRows, in.row_bytes, bits, kDim, limbs, in.w8.data(), group,
                             limbs * kRows, iacc.data(), kDim);
    benchmark::DoNotOptimize(acc.data());
    benchmark::DoNotOptimize(iacc.data());
  }
  state.SetItemsProcessed(state.iterations() * kRows * kDim * group);
}

// The integer value sums over value tiles (the layer cache's value layout
// with an integer dot): kernel/accumulate_tiles/<dot>/<bits>/<group>/<rows>/
// <tiled>, 96 rows (24 whole groups) or 94 (a HEX block's two kept tokens:
// 23 groups and two rows), scaled into floats as the decode does it; tiled
// 0 is the same call over the rows, the baseline.
void accumulate_tiles(benchmark::State& state, const std::string& dot) {
  const int bits = static_cast<int>(state.range(0));
  const std::int64_t group = state.range(1), rows = state.range(2);
  const bool tiled = state.range(3) != 0;
  const int limbs = limbs_of(dot);
  // Where the decode keeps such values in rows (3 bits without VBMI, or
  // with two-limb weights), the tiled call would time the portable
  // reference, a path no decode takes.
  if (tiled && !d::value_tiles_layout(bits, kDim, limbs)) {
    state.SkipWithError(
        "the decode keeps these values in rows here (3-bit value tiles need VBMI and int8 weights): see <tiled> 0");
    return;
  }
  Inputs in(bits, group, rows, limbs);
  std::vector<std::uint8_t> tiles(in.codes.size());
  d::rows_to_value_tiles(in.codes.data(), rows, in.row_bytes, tiles.data());
  std::vector<float> acc(static_cast<std::size_t>(group * kDim)), ws(static_cast<std::size_t>(group), 0x1p-20f);
  std::vector<std::int32_t> scratch(acc.size());
  for (auto _ : state) {
    if (tiled)
      d::code_accumulate_int_tiles_scaled(tiles.data(), rows, in.row_bytes, bits, kDim, limbs, in.w8.data(), group,
                                          limbs * rows, ws.data(), acc.data(), kDim, scratch.data());
    else
      d::code_accumulate_int_scaled(in.codes.data(), rows, in.row_bytes, bits, kDim, limbs, in.w8.data(), group,
                                    limbs * rows, ws.data(), acc.data(), kDim, scratch.data());
    benchmark::DoNotOptimize(acc.data());
  }
  state.SetItemsProcessed(state.iterations() * rows * kDim * group);
}

// 3-bit rows widened to 4 bits.
void widen3(benchmark::State& state) {
  Inputs in(3, 1, kDim, 1);
  std::vector<std::uint8_t> wide(static_cast<std::size_t>(kRows * kDim / 2));
  for (auto _ : state) {
    d::widen_codes3(in.codes.data(), kRows, kDim, wide.data());
    benchmark::DoNotOptimize(wide.data());
  }
  state.SetItemsProcessed(state.iterations() * kRows * kDim);
}

// The same widening with the rows coming from memory: blocks 8 KiB apart
// (a block's codes among its other arrays, as in the decode's key stream)
// through 256 MiB, one block an iteration; range(0) = blocks ahead whose rows
// are requested before each (0: none). kernel/copy3/memory: a memcpy of the
// same bytes, the memory's own pace for such blocks.
struct ColdBlocks {
  static constexpr std::int64_t kStride = 8192, kBytes = std::int64_t{256} << 20;
  std::vector<std::uint8_t> buf = std::vector<std::uint8_t>(static_cast<std::size_t>(kBytes));
  std::int64_t blocks = kBytes / kStride, at = 0;
  ColdBlocks() {
    for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<std::uint8_t>((i * 2654435761u) >> 13);
  }
  const std::uint8_t* next() {
    const std::uint8_t* p = buf.data() + at * kStride;
    at = at + 1 == blocks ? 0 : at + 1;
    return p;
  }
  void request(std::int64_t ahead, std::int64_t bytes) const {
    const std::uint8_t* p = buf.data() + ((at + ahead) % blocks) * kStride;
    for (std::int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(p + x, 0, 3);
  }
};
void widen3_memory(benchmark::State& state) {
  const std::int64_t ahead = state.range(0), bytes = kRows * kDim * 3 / 8;
  ColdBlocks cold;
  std::vector<std::uint8_t> wide(static_cast<std::size_t>(kRows * kDim / 2));
  for (auto _ : state) {
    if (ahead > 0) cold.request(ahead, bytes);
    d::widen_codes3(cold.next(), kRows, kDim, wide.data());
    benchmark::DoNotOptimize(wide.data());
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}
void copy3_memory(benchmark::State& state) {
  const std::int64_t bytes = kRows * kDim * 3 / 8;
  ColdBlocks cold;
  std::vector<std::uint8_t> out(static_cast<std::size_t>(bytes));
  for (auto _ : state) {
    std::memcpy(out.data(), cold.next(), static_cast<std::size_t>(bytes));
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

// In place, round after round: the cost does not depend on the values.
void softmax(benchmark::State& state) {
  constexpr std::int64_t kTokens = 32768;
  std::vector<float> r(kTokens);
  std::mt19937_64 rng(9);
  std::normal_distribution<float> g(0.0f, 3.0f);
  for (auto& x : r) x = g(rng);
  for (auto _ : state) {
    d::softmax_row(r.data(), kTokens);
    benchmark::DoNotOptimize(r.data());
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
}

void quantize(benchmark::State& state, const std::string& dot) {
  Inputs in(4, 1, kDim, 2);
  std::vector<std::int8_t> w8(static_cast<std::size_t>(2 * kDim));
  for (auto _ : state) {
    const float s = dot == "int14" ? d::quantize_weights14(in.w.data(), kDim, w8.data())
                                   : d::quantize_weights8(in.w.data(), kDim, w8.data());
    benchmark::DoNotOptimize(s);
    benchmark::DoNotOptimize(w8.data());
  }
  state.SetItemsProcessed(state.iterations() * kDim);
}

// The key side of a block ahead of code_scores_int on the int8 path, as
// block_scores makes it: the 128 key groups' (delta, min) pairs from
// binary16, the code weights, mins, biases and largest weights per query
// (key_weights), then the weights in fixed point (quantize_rows). items =
// weights (channels times queries).
// kernel/key_weights_steps/<group>: the three steps apart, as block_scores
// makes them where key_weights_int8 does not take the block (the baseline
// of the fused pass). kernel/key_weights/<group>: as block_scores makes it
// (the fused pass where the target has one).
void key_weights_at(benchmark::State& state, bool fused) {
  const std::int64_t nq = state.range(0);
  std::mt19937_64 rng(9);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<kvcal::runtime::half_bits> params(2 * kDim);
  for (auto& p : params) p = kvcal::runtime::float_to_half(g(rng));
  std::vector<float> q(static_cast<std::size_t>(nq * kDim)), pf(2 * kDim), qd(q.size()), kmin(kDim),
      bias(static_cast<std::size_t>(nq)), amax(bias.size()), ws(bias.size()), tmp(2 * kDim);
  for (auto& x : q) x = g(rng);
  std::vector<std::int8_t> w8(q.size());
  const d::Slots sl = d::int_slots(4, kDim);
  for (auto _ : state) {
    if (fused && d::key_weights_int8(params.data(), q.data(), nq, kDim, 0.0884f, sl, w8.data(), ws.data(), kmin.data(),
                                     bias.data())) {
      benchmark::DoNotOptimize(w8.data());
      benchmark::DoNotOptimize(kmin.data());
      benchmark::DoNotOptimize(bias.data());
      continue;
    }
    kvcal::fp16::to_floats(params.data(), 2 * kDim, pf.data());
    d::key_weights(pf.data(), q.data(), nq, kDim, 0.0884f, sl, qd.data(), kmin.data(), bias.data(), amax.data(),
                   tmp.data());
    d::quantize_rows(1, qd.data(), nq, kDim, w8.data(), ws.data(), amax.data());
    benchmark::DoNotOptimize(w8.data());
    benchmark::DoNotOptimize(kmin.data());
    benchmark::DoNotOptimize(bias.data());
  }
  state.SetItemsProcessed(state.iterations() * nq * kDim);
}

// Integer scores of one query over a HEX block's rows:
// kernel/scores_rows/int8/<rows>/<bits>, 94 quantized rows (two kept tokens)
// against 96; 94 leave 14 rows past the unrolled steps (3 bits: 13 and the
// last row, which is never read in place).
void scores_rows(benchmark::State& state) {
  const std::int64_t rows = state.range(0);
  const int bits = static_cast<int>(state.range(1));
  Inputs in(bits, 1, kDim, 1);
  std::vector<std::int32_t> out(static_cast<std::size_t>(kRows));
  for (auto _ : state) {
    d::code_scores_int(in.codes.data(), rows, in.row_bytes, bits, kDim, 1, in.w8.data(), 1, kDim, out.data(), kRows);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * rows * kDim);
}

// code_scores_int (int8, 4 bits) over consecutive blocks of 94 rows whose
// codes lie 1.5 KiB apart, as in a head's key stream (where each block's
// parameters and expander entries lie between its codes and the next
// block's): kernel/scores_stream/<MiB>/<group> over range(0) MiB of codes,
// which stay in L2 (1), in the L3 (32 on a large-L3 host) or come from
// memory (512). bytes = codes read: what the kernel draws by itself, against
// bench_runtime's streaming_read/1.
void scores_stream(benchmark::State& state) {
  const std::int64_t mib = state.range(0), nq = state.range(1), rows = 94, gap = 1536;
  const std::int64_t rb = kDim / 2, stride = kRows * rb + gap;
  const std::int64_t blocks = (mib << 20) / stride;
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(blocks * stride));
  std::mt19937_64 rng(10);
  for (auto& c : codes) c = static_cast<std::uint8_t>(rng());
  std::vector<std::int8_t> w8(static_cast<std::size_t>(nq * kDim), 3);
  std::vector<std::int32_t> out(static_cast<std::size_t>(nq * kRows));
  for (auto _ : state) {
    for (std::int64_t b = 0; b < blocks; ++b)
      d::code_scores_int(codes.data() + b * stride, rows, rb, 4, kDim, 1, w8.data(), nq, kDim, out.data(), kRows);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * blocks * rows * rb);
}

// The expander entries of a HEX block (96 tokens, 4 entries each, the two
// kept tokens 30 and 64 splitting it into runs of 30, 33 and 31) turned
// into differences x - min, key side (a table of the key channels' mins,
// range(0) floats: 128 are held in registers on AVX-512 hosts, 129 are
// gathered) and value side.
void entry_diffs(benchmark::State& state) {
  const std::int64_t table = state.range(0), d1 = 4;
  std::mt19937_64 rng(6);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> mins(static_cast<std::size_t>(table)), params(2 * kRows),
      out(static_cast<std::size_t>(d1 * kRows));
  std::vector<std::int32_t> idx(static_cast<std::size_t>(kRows * d1));
  std::vector<kvcal::runtime::half_bits> x(idx.size());
  for (auto& v : mins) v = g(rng);
  for (auto& v : params) v = g(rng);
  for (auto& v : idx) v = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(kDim));
  for (auto& v : x) v = kvcal::runtime::float_to_half(g(rng));
  const std::int64_t runs[3][2] = {{0, 30}, {31, 33}, {65, 31}};  // (first token, length)
  for (auto _ : state) {
    std::int64_t q = 0;  // quantized row of the run's first token
    for (const auto& r : runs) {
      d::key_entry_diffs(mins.data(), table, idx.data() + r[0] * d1, x.data() + q * d1, r[1], d1, out.data() + r[0],
                         kRows);
      d::value_entry_diffs(params.data() + 2 * q, x.data() + q * d1, r[1], d1, out.data() + r[0], kRows);
      q += r[1];
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * 94 * d1);
}

// The fused run kernels of a HEX block for a GQA group of range(0) queries,
// over entry_diffs' block (96 tokens, 4 entries each, kept tokens 30 and 64,
// a key table of 128 mins): key_run_scores (bias, integer code part, entries) and
// value_run_weights (weights, bias sums, entry sums). items = tokens times
// queries.
// side: 3 both passes (kernel/run_entries), 1 the key pass alone
// (kernel/run_entries/keys), 2 the value pass alone (kernel/run_entries/values).
void run_entries(benchmark::State& state, int side) {
  const std::int64_t nq = state.range(0), d1 = 4, nqr = 94;
  std::mt19937_64 rng(8);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const auto normal = [&](std::int64_t n) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = g(rng);
    return v;
  };
  std::vector<float> mins = normal(kDim);
  for (auto& m : mins) m = kvcal::runtime::half_to_float(kvcal::runtime::float_to_half(m));  // binary16, as stored
  const std::vector<float> params = normal(2 * nqr), bias = normal(nq), w = normal(nq), a = normal(nq * d1 * kRows),
                           p = normal(nq * kRows);
  std::vector<float> out(static_cast<std::size_t>(nq * kRows)), a_out(static_cast<std::size_t>(nq * nqr)),
      y(static_cast<std::size_t>(nq * d1 * kRows)), base(static_cast<std::size_t>(nq)), amax(base.size());
  std::vector<std::int32_t> idx(static_cast<std::size_t>(d1 * kRows)), qi(static_cast<std::size_t>(nq * nqr));
  for (auto& v : idx) v = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(kDim));
  std::vector<std::uint16_t> idx16;  // as the decode passes them (KeyEntries)
  d::entry_channels16(idx.data(), kRows, kRows, d1, idx16);
  for (auto& v : qi) v = static_cast<std::int32_t>(rng() % 20000) - 10000;
  std::vector<kvcal::runtime::half_bits> x(static_cast<std::size_t>(nqr * d1));
  for (auto& v : x) v = kvcal::runtime::float_to_half(g(rng));
  const std::uint16_t kept[2] = {30, 64};  // runs of 30, 33 and 31 quantized tokens
  for (auto _ : state) {
    if (side & 1)
      d::key_run_scores(mins.data(), kDim, idx.data(), kRows, idx16.data(), x.data(), kept, 2, kRows, d1, nq,
                        bias.data(), w.data(), qi.data(), nullptr, nqr, a.data(), kRows, out.data(), kRows);
    if (side & 2)
      d::value_run_weights(params.data(), x.data(), kept, 2, kRows, d1, nq, p.data(), kRows, a_out.data(), nqr,
                           y.data(), kRows, base.data(), amax.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * nqr * nq);
}

int register_all() {
  kvcal::bench::force_target_from_env();  // KVCAL_BENCH_TARGET (force_target.h)
  const d::VnniKernels vnni = d::vnni_kernels();
  benchmark::AddCustomContext("simd_target",
                              std::string(d::kernel_target()) + (vnni == d::VnniKernels::kAvx2   ? "+AVX-VNNI"
                                                                 : vnni == d::VnniKernels::kAvx3 ? "+AVX512-VNNI"
                                                                                                 : ""));
  for (const char* dot : {"float32", "int14", "int8"}) {
    const std::string s(dot);
    using Fn = void (*)(benchmark::State&, const std::string&);
    for (const auto& [name, fn] : {std::pair<const char*, Fn>{"scores", scores}, {"accumulate", accumulate}}) {
      auto* b = benchmark::RegisterBenchmark(("kernel/" + std::string(name) + "/" + s).c_str(), fn, s);
      for (const int bits : {4, 3, 2})
        for (const int group : {1, 4}) b->Args({bits, group});
    }
    if (s != "float32") {
      benchmark::RegisterBenchmark(("kernel/quantize/" + s).c_str(), quantize, s);
      benchmark::RegisterBenchmark(("kernel/scores_tiles/" + s).c_str(), scores_tiles, s)
          ->ArgsProduct({{4, 3, 2}, {1, 4}, {96, 94}});
      benchmark::RegisterBenchmark(("kernel/accumulate_tiles/" + s).c_str(), accumulate_tiles, s)
          ->ArgsProduct({{4, 3, 2}, {1, 4}, {96, 94}, {1, 0}});
    }
  }
  benchmark::RegisterBenchmark("kernel/scores_stream", scores_stream)->ArgsProduct({{1, 32, 512}, {1, 4}});
  benchmark::RegisterBenchmark("kernel/key_weights", key_weights_at, true)->Arg(1)->Arg(4);
  benchmark::RegisterBenchmark("kernel/key_weights_steps", key_weights_at, false)->Arg(1)->Arg(4);
  benchmark::RegisterBenchmark("kernel/scores_rows/int8", scores_rows)->ArgsProduct({{94, 96}, {4, 3}});
  benchmark::RegisterBenchmark("kernel/entry_diffs", entry_diffs)->Arg(128)->Arg(129);
  benchmark::RegisterBenchmark("kernel/run_entries", run_entries, 3)->Arg(1)->Arg(4);
  benchmark::RegisterBenchmark("kernel/run_entries/keys", run_entries, 1)->Arg(1)->Arg(4);
  benchmark::RegisterBenchmark("kernel/run_entries/values", run_entries, 2)->Arg(1)->Arg(4);
  benchmark::RegisterBenchmark("kernel/widen3", widen3);
  benchmark::RegisterBenchmark("kernel/widen3/memory", widen3_memory)->Arg(0)->Arg(2);
  benchmark::RegisterBenchmark("kernel/copy3/memory", copy3_memory);
  benchmark::RegisterBenchmark("kernel/softmax", softmax);
  return 0;
}
const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
