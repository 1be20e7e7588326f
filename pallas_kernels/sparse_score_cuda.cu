// The sparse decode step's page scoring from centroids (docs/design.md, section 3) as a CUDA C
// kernel behind an XLA FFI call; built and registered by pallas_kernels/sparse_score_cuda.py.
//
// Why CUDA C: the scoring reads one 256-byte centroid a page, scattered over the pool, and is
// bound by how many of those reads are in flight; the Pallas kernel, one tile load of its 64
// pages a program after the query's and the table's loads, reads them at 63-68% of the read
// ceiling (BENCHMARKS.md, kernel runs AK and AM). Here every 16 lanes score one page (16 bytes
// each), each thread issuing the loads of UNROLL pages before it uses any, one round a block;
// at 57 registers a thread, 4 blocks an SM keep 128 KB of reads in flight.
//
// Shapes: q [B, Hkv * G, 128] bf16, centroids [Hkv, N, 128] bf16, table [B, M] int32 (the
// physical page of each slot), lengths [B] int32 -> keys [B, Hkv, M] int32. Slot j of row b
// is eligible when 1 <= j < n - 2 (n = ceil(length / P): page 0 and the last two are always
// kept); its key is the order key of sum_d centroid[d] * qbar[d], qbar the mean of the KV
// head's G query heads, float32 products and sums; INT_MIN where not eligible. The key is
// the float's bits with a negative one's magnitude bits flipped, -0.0 as 0.0, so that int32
// order is the scores' order (sparrow_jax.attention.selection.order_key).
// Grid (ceil(M / SLOTS), Hkv, B): worker w (16 lanes) of a block takes slots w + WORKERS * i
// of its SLOTS; lane l of a worker holds dimensions 8 l .. 8 l + 7.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int D = 128, LANES = 16, DIMS = D / LANES, THREADS = 256;
constexpr int WORKERS = THREADS / LANES, UNROLL = 8, SLOTS = WORKERS * UNROLL;

__device__ __forceinline__ int order_key(float s) {
  const int bits = __float_as_int(s == 0.f ? 0.f : s);
  return bits < 0 ? bits ^ 0x7FFFFFFF : bits;
}

// 8 bf16 (one 16-byte word) as floats, added into x scaled by `scale`.
__device__ __forceinline__ void add_scaled(const uint4& w, float scale, float* x) {
  const __nv_bfloat162* pair = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pair[i]);
    x[2 * i] += scale * f.x;
    x[2 * i + 1] += scale * f.y;
  }
}

__device__ __forceinline__ float dot(const uint4& w, const float* x) {
  const __nv_bfloat162* pair = reinterpret_cast<const __nv_bfloat162*>(&w);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pair[i]);
    s += f.x * x[2 * i];
    s += f.y * x[2 * i + 1];
  }
  return s;
}

__device__ __forceinline__ uint4 load16(const __nv_bfloat16* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

__global__ void __launch_bounds__(THREADS)
    score_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ centroids,
                 const int* __restrict__ table, const int* __restrict__ lengths,
                 int* __restrict__ keys, int hkv, int group, int64_t n_pages, int m,
                 int page_size, int rounds) {
  const int b = blockIdx.z, h = blockIdx.y;
  const int lane = threadIdx.x % LANES, worker = threadIdx.x / LANES;
  const int* table_row = table + static_cast<int64_t>(b) * m;
  int* key_row = keys + (static_cast<int64_t>(b) * hkv + h) * m;
  const int first = blockIdx.x * rounds * SLOTS + worker;   // this thread's first slot
  // The loads that wait on nothing first, the table's before the queries' (whose sum waits on
  // them), so that the centroids' loads are a block's second wait, not its fourth.
  int phys[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int slot = first + u * WORKERS;
    phys[u] = slot < m ? table_row[slot] : 0;
  }
  const int n = (lengths[b] + page_size - 1) / page_size;
  float qbar[DIMS] = {};
  const __nv_bfloat16* q_head = q + (static_cast<int64_t>(b) * hkv + h) * group * D + DIMS * lane;
  for (int r = 0; r < group; ++r) add_scaled(load16(q_head + r * D), 1.f / group, qbar);
  const __nv_bfloat16* pages = centroids + h * n_pages * D + DIMS * lane;
  for (int r = 0; r < rounds && first - worker + r * SLOTS < m; ++r) {
    const int base = first + r * SLOTS;
    uint4 w[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int slot = base + u * WORKERS;
      if (slot >= n - 2 || slot < 1) phys[u] = -1;   // not eligible: not read
      if (phys[u] >= 0) w[u] = load16(pages + static_cast<int64_t>(phys[u]) * D);
    }
    // The next round's table entries while this round's centroids are on their way: a block
    // waits on one load a round, not two.
    int next[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int slot = base + SLOTS + u * WORKERS;
      next[u] = r + 1 < rounds && slot < m ? table_row[slot] : 0;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {   // every lane of the warp reaches the shuffles
      const int slot = base + u * WORKERS;
      float s = phys[u] >= 0 ? dot(w[u], qbar) : 0.f;
#pragma unroll
      for (int d = 1; d < LANES; d <<= 1) s += __shfl_xor_sync(0xffffffffu, s, d);
      if (lane == 0 && slot < m) key_row[slot] = phys[u] >= 0 ? order_key(s) : INT_MIN;
      phys[u] = next[u];
    }
  }
}

// Blocks of score_kernel resident on one SM of the current device, and its SM count.
cudaError_t residency(int* blocks_per_sm, int* sms) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, score_kernel, THREADS, 0);
  }
  return e;
}

ffi::Error Score(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer centroids,
                 ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
                 ffi::Result<ffi::Buffer<ffi::S32>> keys, int64_t page_size,
                 int64_t rounds) {
  auto qd = q.dimensions(), cd = centroids.dimensions(), td = table.dimensions();
  auto kd = keys->dimensions();
  if (q.element_type() != ffi::BF16 || centroids.element_type() != ffi::BF16 ||
      qd.size() != 3 || cd.size() != 3 || td.size() != 2 || kd.size() != 3 || qd[2] != D ||
      cd[2] != D || qd[1] % cd[0] != 0 || td[0] != qd[0] || lengths.dimensions()[0] != qd[0] ||
      kd[0] != qd[0] || kd[1] != cd[0] || kd[2] != td[1] || qd[0] > 65535 || cd[0] > 65535 ||
      page_size < 1 || rounds < 0) {
    return ffi::Error::InvalidArgument("sparrow_sparse_score: unsupported arguments");
  }
  const int hkv = static_cast<int>(cd[0]), m = static_cast<int>(td[1]);
  if (qd[0] == 0 || m == 0) return ffi::Error::Success();
  const int chunks = (m + SLOTS - 1) / SLOTS;
  if (rounds == 0) {   // as few as fill the GPU in one wave of blocks
    int blocks_per_sm = 0, sms = 0;
    const cudaError_t e = residency(&blocks_per_sm, &sms);
    if (e != cudaSuccess) {
      return ffi::Error::Internal(std::string("sparrow_sparse_score: ") + cudaGetErrorString(e));
    }
    const int64_t total = static_cast<int64_t>(chunks) * hkv * qd[0];
    const int64_t resident = std::max<int64_t>(1, static_cast<int64_t>(blocks_per_sm) * sms);
    rounds = (total + resident - 1) / resident;
  }
  rounds = std::min<int64_t>(rounds, chunks);
  const int blocks_x = (chunks + static_cast<int>(rounds) - 1) / static_cast<int>(rounds);
  rounds = (chunks + blocks_x - 1) / blocks_x;   // the same rounds, fewest of them
  const dim3 grid(blocks_x, hkv, static_cast<unsigned>(qd[0]));
  score_kernel<<<grid, THREADS, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(q.untyped_data()),
      reinterpret_cast<const __nv_bfloat16*>(centroids.untyped_data()), table.typed_data(),
      lengths.typed_data(), keys->typed_data(), hkv, static_cast<int>(qd[1] / hkv), cd[1], m,
      static_cast<int>(page_size), static_cast<int>(rounds));
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("sparrow_sparse_score launch: ") +
                              cudaGetErrorString(e));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowSparseScore, Score,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("page_size")
                                  .Attr<int64_t>("rounds"),
                              {ffi::Traits::kCmdBufferCompatible});
