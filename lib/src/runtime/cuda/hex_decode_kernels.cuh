// The decode kernels: work items over pages, then the merge of splits. Included by hex_decode.cu and by the host
// emulation (tests/cuda/emulated_kernels.cpp); see kernels_common.cuh.
// Include after <cuda_runtime.h> (nvcc) or tests/cuda/cuda_emulation.h.
#pragma once

#include "runtime/cuda/kernels_common.cuh"

namespace kvcal::runtime::cuda::kernels {

constexpr int kDecodeThreads = 128;

// The codes of a packed row in order, read as 32-bit little-endian words
// (the row's length a multiple of 4 bytes: never reads past it).
struct CodeReader {
  const std::uint32_t* w;
  std::uint64_t buf = 0;
  int have = 0, bits;
  unsigned mask;
  __device__ CodeReader(const std::uint8_t* row, int b)
      : w(reinterpret_cast<const std::uint32_t*>(row)), bits(b), mask((1u << b) - 1u) {}
  __device__ unsigned next() {
    if (have < bits) {
      buf |= static_cast<std::uint64_t>(*w++) << have;
      have += 32;
    }
    const unsigned c = static_cast<unsigned>(buf) & mask;
    buf >>= bits;
    have -= bits;
    return c;
  }
};
constexpr int kMaxGroup = 8;
constexpr int kMaxHeadDim = 128;

__device__ inline float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ inline float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Dynamic shared memory of the decode kernel, in floats and ints.
struct DecodeShared {
  float *qs, *qd, *kmin, *acc, *p, *bias, *m, *l, *alpha;
  std::int32_t* tok;
  __host__ __device__ static std::size_t bytes(int group, int d, int nb) {
    return (static_cast<std::size_t>(3) * group * d + d + static_cast<std::size_t>(group) * nb + 4 * group) * 4 +
           static_cast<std::size_t>(nb) * 4;
  }
  __device__ DecodeShared(unsigned char* s, int group, int d, int nb) {
    float* f = reinterpret_cast<float*>(s);
    qs = f;
    qd = qs + group * d;
    kmin = qd + group * d;
    acc = kmin + d;
    p = acc + group * d;
    bias = p + group * nb;
    m = bias + group;
    l = m + group;
    alpha = l + group;
    tok = reinterpret_cast<std::int32_t*>(alpha + group);
  }
};

__global__ void __launch_bounds__(kDecodeThreads)
    hex_decode_kernel(HexDeviceLayer L, HexDecodeArgs A, const float* q, float scale, bool observe) {
  const HexPageGeometry g = L.geometry;
  const int H = L.kv_heads, d = g.head_dim, nb = g.block, QH = A.q_heads, G = QH / H;
  const int tid = threadIdx.x, nt = blockDim.x, warp = tid / 32, lane = tid % 32, warps = nt / 32;
  const HexDecodeItem item = A.items[blockIdx.x];
  const int i = item.request, h = item.head;
  const DecodeShared S(dynamic_shared(), G, d, nb);

  const float* qh = q + (static_cast<std::int64_t>(i) * QH + h * G) * d;
  for (int x = tid; x < G * d; x += nt) {
    S.qs[x] = scale * qh[x];
    S.acc[x] = 0.0f;
  }
  if (tid < G) {
    S.m[tid] = -INFINITY;
    S.l[tid] = 0.0f;
  }
  __syncthreads();
  const int R = item.with_residual ? A.residual_rows[i] : 0;
  const int units = item.blocks + (R > 0 ? 1 : 0);
  for (int u = 0; u < units; ++u) {
    const bool is_res = u == item.blocks;
    HexBlockView b;
    int n;
    if (!is_res) {
      const std::int32_t id = A.page_indices[A.page_indptr[i] + (item.first_block + u) * H + h];
      b = hex_page_view(g, L.pages + static_cast<std::int64_t>(id) * g.page_bytes(), L.mask);
      n = nb;
    } else {  // the residual rows: an all-kept fp16 block
      const std::uint8_t* base = L.residual + static_cast<std::int64_t>(A.residual_page[i]) * g.residual_bytes(H);
      b.tokens = b.kept_rows = R;
      b.head_dim = d;
      b.bits = 0;
      b.k_kept = reinterpret_cast<const half_bits*>(base) + static_cast<std::int64_t>(h) * nb * d;
      b.v_kept =
          reinterpret_cast<const half_bits*>(base + g.residual_rows_bytes(H)) + static_cast<std::int64_t>(h) * nb * d;
      n = R;
    }
    const bool coded = b.bits != 0 && b.quant_rows() > 0;
    const int d1 = b.bits != 0 ? b.mask_degree : 0;
    if (coded)
      for (int c = tid; c < d; c += nt) {
        const QuantParams pc = b.k_params[c];
        const float delta = half_to_float(pc.delta);
        S.kmin[c] = half_to_float(pc.min);
        for (int j = 0; j < G; ++j) S.qd[j * d + c] = S.qs[j * d + c] * delta;
      }
    // Each token: -(r + 1) for kept row r, else its quantized row.
    for (int t = tid; t < n; t += nt) {
      int info = -(t + 1);
      if (b.bits != 0) {
        int r = 0;
        while (r < b.kept_rows && b.kept_index[r] < t) ++r;
        info = r < b.kept_rows && b.kept_index[r] == t ? -(r + 1) : t - r;
      }
      S.tok[t] = info;
    }
    __syncthreads();
    if (coded)
      for (int j = warp; j < G; j += warps) {
        float s = 0.0f;
        for (int c = lane; c < d; c += 32) s += S.qs[j * d + c] * S.kmin[c];
        s = warp_sum(s);
        if (lane == 0) S.bias[j] = s;
      }
    __syncthreads();
    // Scores: one thread per token, the whole query group at once.
    for (int t = tid; t < n; t += nt) {
      float s[kMaxGroup];
      const int info = S.tok[t];
      if (info < 0) {
        const half_bits* row = b.k_kept + static_cast<std::int64_t>(-info - 1) * d;
        for (int j = 0; j < kMaxGroup; ++j) s[j] = 0.0f;
        for (int c = 0; c < d; ++c) {
          const float x = half_to_float(row[c]);
#pragma unroll
          for (int j = 0; j < kMaxGroup; ++j)
            if (j < G) s[j] += S.qs[j * d + c] * x;
        }
      } else {
        const std::uint8_t* row = b.k_codes + static_cast<std::int64_t>(info) * b.row_bytes;
        for (int j = 0; j < kMaxGroup; ++j) s[j] = j < G ? S.bias[j] : 0.0f;
        const auto add = [&](int c, unsigned code) {
          const float x = static_cast<float>(code);
#pragma unroll
          for (int j = 0; j < kMaxGroup; ++j)
            if (j < G) s[j] += S.qd[j * d + c] * x;
        };
        if (b.row_bytes % 4 == 0) {  // whole 32-bit words (rows start 4-byte aligned)
          CodeReader r(row, b.bits);
          for (int c = 0; c < d; ++c) add(c, r.next());
        } else {
          for (int c = 0; c < d; ++c) add(c, packed_code(row, c, b.bits));
        }
        for (int e = 0; e < d1; ++e) {  // expander entries: x replaces min_c
          const int c = b.mask_indices[t * d1 + e];
          const float x = half_to_float(b.k_sparse[static_cast<std::int64_t>(info) * d1 + e]) - S.kmin[c];
#pragma unroll
          for (int j = 0; j < kMaxGroup; ++j)
            if (j < G) s[j] += S.qs[j * d + c] * x;
        }
      }
      for (int j = 0; j < G; ++j) S.p[j * nb + t] = s[j];
      if (observe && is_res)
        for (int j = 0; j < G; ++j) A.res_scores[(static_cast<std::int64_t>(i) * QH + h * G + j) * nb + t] = s[j];
    }
    __syncthreads();
    // Online softmax: the running max, rescaling of what came before.
    for (int j = warp; j < G; j += warps) {
      float mx = -INFINITY;
      for (int t = lane; t < n; t += 32) mx = fmaxf(mx, S.p[j * nb + t]);
      mx = warp_max(mx);
      if (lane == 0) {
        const float nm = fmaxf(S.m[j], mx);
        S.alpha[j] = expf(S.m[j] - nm);
        S.m[j] = nm;
      }
    }
    __syncthreads();
    for (int x = tid; x < G * n; x += nt) {
      const int j = x / n, t = x % n;
      S.p[j * nb + t] = expf(S.p[j * nb + t] - S.m[j]);
    }
    for (int x = tid; x < G * d; x += nt) S.acc[x] *= S.alpha[x / d];
    __syncthreads();
    for (int j = warp; j < G; j += warps) {
      float s = 0.0f;
      for (int t = lane; t < n; t += 32) s += S.p[j * nb + t];
      s = warp_sum(s);
      if (lane == 0) S.l[j] = S.l[j] * S.alpha[j] + s;
    }
    // Values: one thread per channel, nt / d token lanes.
    const int lanes = nt / d, lt = tid / d, c = tid % d;
    if (lt < lanes) {
      float a[kMaxGroup];
      for (int j = 0; j < kMaxGroup; ++j) a[j] = 0.0f;
      for (int t = lt; t < n; t += lanes) {
        const int info = S.tok[t];
        float x;
        if (info < 0) {
          x = half_to_float(b.v_kept[static_cast<std::int64_t>(-info - 1) * d + c]);
        } else {
          const QuantParams vp = b.v_params[info];
          x = half_to_float(vp.min) +
              static_cast<float>(packed_code(b.v_codes + static_cast<std::int64_t>(info) * b.row_bytes, c, b.bits)) *
                  half_to_float(vp.delta);
        }
#pragma unroll
        for (int j = 0; j < kMaxGroup; ++j)
          if (j < G) a[j] += S.p[j * nb + t] * x;
      }
      for (int j = 0; j < G; ++j) atomicAdd(&S.acc[j * d + c], a[j]);
    }
    if (d1 > 0)
      for (int x = tid; x < n * d1; x += nt) {
        const int t = x / d1, e = x % d1, info = S.tok[t];
        if (info < 0) continue;
        const int ch = b.mask_indices[t * d1 + e];
        const float corr =
            half_to_float(b.v_sparse[static_cast<std::int64_t>(info) * d1 + e]) - half_to_float(b.v_params[info].min);
        for (int j = 0; j < G; ++j) atomicAdd(&S.acc[j * d + ch], S.p[j * nb + t] * corr);
      }
    __syncthreads();
  }
  const std::int64_t slot = A.split_indptr[i] + item.split;
  for (int x = tid; x < G * d; x += nt) A.part_acc[(slot * QH + h * G) * d + x] = S.acc[x];
  if (tid < G) {
    A.part_max[slot * QH + h * G + tid] = S.m[tid];
    A.part_sum[slot * QH + h * G + tid] = S.l[tid];
  }
}

__global__ void __launch_bounds__(kDecodeThreads)
    hex_merge_kernel(HexDeviceLayer L, HexDecodeArgs A, float* out, bool observe) {
  const HexPageGeometry g = L.geometry;
  const int H = L.kv_heads, d = g.head_dim, nb = g.block, QH = A.q_heads, G = QH / H;
  const int i = blockIdx.x / H, h = blockIdx.x % H, tid = threadIdx.x, nt = blockDim.x;
  const int s0 = A.split_indptr[i], s1 = A.split_indptr[i + 1];
  __shared__ float M[kMaxGroup], inv[kMaxGroup];
  if (tid < G) {
    const std::int64_t j = h * G + tid;
    float mx = -INFINITY;
    for (int s = s0; s < s1; ++s) mx = fmaxf(mx, A.part_max[s * QH + j]);
    float sum = 0.0f;
    for (int s = s0; s < s1; ++s) sum += A.part_sum[s * QH + j] * expf(A.part_max[s * QH + j] - mx);
    M[tid] = mx;
    inv[tid] = 1.0f / sum;
  }
  __syncthreads();
  for (int x = tid; x < G * d; x += nt) {
    const int jj = x / d, c = x % d;
    const std::int64_t j = h * G + jj;
    float o = 0.0f;
    for (int s = s0; s < s1; ++s) o += A.part_acc[(s * QH + j) * d + c] * expf(A.part_max[s * QH + j] - M[jj]);
    out[(static_cast<std::int64_t>(i) * QH + j) * d + c] = o * inv[jj];
  }
  if (!observe) return;
  const int R = A.residual_rows[i];
  float* sc =
      reinterpret_cast<float*>(L.residual + static_cast<std::int64_t>(A.residual_page[i]) * g.residual_bytes(H) +
                               2 * g.residual_rows_bytes(H)) +
      static_cast<std::int64_t>(h) * nb;
  for (int t = tid; t < R; t += nt) {
    float w = 0.0f;
    for (int jj = 0; jj < G; ++jj)
      w += expf(A.res_scores[(static_cast<std::int64_t>(i) * QH + h * G + jj) * nb + t] - M[jj]) * inv[jj];
    sc[t] += w;
  }
}

}  // namespace kvcal::runtime::cuda::kernels
