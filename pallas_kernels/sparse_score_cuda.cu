// The sparse decode step's page scoring from centroids (docs/design.md, section 3) as a CUDA C
// kernel behind an XLA FFI call; built and registered by pallas_kernels/sparse_score_cuda.py.
//
// Why CUDA C: the scoring reads one 256-byte centroid a page and is bound by how many of those
// reads stay in flight. The Pallas kernel (a chain of table, query and centroid loads a
// program, one tile each) reads at 63-68% of the ceiling whatever the pages' addresses
// (BENCHMARKS.md, kernel runs AK, AO, AP); so did kernels of one such chain a block. Here each
// warp streams a contiguous run of the (row, KV head, slot) space through a ring of
// shared-memory stages by cp.async, as the CUDA attention streams its pages: the table entries
// of a stage arrive in the copy group STAGES stages before its centroids are asked for, so no
// copy waits on a load, and a warp's copies stay in flight while it scores the stage before.
//
// Shapes: q [B, Hkv * G, 128] bf16, centroids [Hkv, N, 128] bf16, table [B, M] int32 (the
// physical page of each slot, M a multiple of 16), lengths [B] int32 -> keys [B, Hkv, M]
// int32. Slot j of row b is eligible when 1 <= j < n - 2 (n = ceil(length / P): page 0 and the
// last two are always kept); its key is the order key of sum_d centroid[d] * qbar[d], qbar the
// mean of the KV head's G query heads, float32 products and sums; INT_MIN where not eligible.
// The key is the float's bits with a negative one's magnitude bits flipped, -0.0 as 0.0, so
// that int32 order is the scores' order (sparrow_jax.attention.selection.order_key).
// A stage is 16 consecutive slots of one (row, KV head), 4 KB of centroids; the B * Hkv * M / 16
// stages are cut into one contiguous run a warp over a persistent grid. Half-warp `half` of a
// warp reads the stage's centroids 2 u + half (u < 8), lane l of it dimensions 8 l .. 8 l + 7.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int D = 128, MAX_GROUP = 8;
constexpr int SLOTS = 16, WARPS = 8, STAGES = 4;   // a stage: SLOTS slots of one (row, KV head)
constexpr int STAGE_BYTES = SLOTS * D * 2;   // a stage's centroids
constexpr int WARP_BYTES = STAGES * (STAGE_BYTES + SLOTS * 4);   // centroids and table entries
constexpr int SMEM_BYTES = WARPS * WARP_BYTES;

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// 16 bytes if `bytes` is 16, else 16 zero bytes and no read.
__device__ __forceinline__ void cp_async16_or_zero(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(bytes));
}
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ int order_key(float s) {
  const int bits = __float_as_int(s == 0.f ? 0.f : s);
  return bits < 0 ? bits ^ 0x7FFFFFFF : bits;
}

// bf16 to float32 is exact: the 16 bits above 16 zero bits.
__device__ __forceinline__ float low_bf16(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float high_bf16(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

__device__ __forceinline__ void add_bf16x8(const uint4& w, float* x) {
  const uint32_t v[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] += low_bf16(v[i]);
    x[2 * i + 1] += high_bf16(v[i]);
  }
}

__device__ __forceinline__ float dot_bf16x8(const uint4& w, const float* x) {
  const uint32_t v[4] = {w.x, w.y, w.z, w.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s += low_bf16(v[i]) * x[2 * i];
    s += high_bf16(v[i]) * x[2 * i + 1];
  }
  return s;
}

// s[u] summed over the 16 lanes of each half-warp, halving the values a lane keeps at each
// step (N / 2 + N / 4 + ... shuffles where one reduction a value takes 4 N). Lane l of a half
// ends with the sum of s[(l & 15) / (16 / N)].
template <int N>
__device__ __forceinline__ float reduce_scatter(float (&s)[N], int lane) {
  int bit = 8;
#pragma unroll
  for (int width = N / 2; width >= 1; width >>= 1, bit >>= 1) {
    const bool upper = lane & bit;
#pragma unroll
    for (int k = 0; k < width; ++k) {
      const float give = upper ? s[k] : s[k + width];
      const float keep = upper ? s[k + width] : s[k];
      s[k] = keep + __shfl_xor_sync(0xffffffffu, give, bit);
    }
  }
#pragma unroll
  for (; bit >= 1; bit >>= 1) s[0] += __shfl_xor_sync(0xffffffffu, s[0], bit);
  return s[0];
}

// A stage's place: row b, KV head h, stage s of the row's per_row, stepped without dividing.
struct Cursor {
  int b, h, s;
  __device__ __forceinline__ void next(int per_row, int hkv) {
    if (++s == per_row) {
      s = 0;
      if (++h == hkv) h = 0, ++b;
    }
  }
};

__global__ void __launch_bounds__(WARPS * 32)
    score_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ centroids,
                 const int* __restrict__ table, const int* __restrict__ lengths,
                 int* __restrict__ keys, int hkv, int group, int64_t n_pages, int m,
                 int page_size, int64_t stages) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t workers = static_cast<int64_t>(gridDim.x) * WARPS;
  const int64_t me = static_cast<int64_t>(blockIdx.x) * WARPS + warp;
  const int64_t first = me * stages / workers;
  const int count = static_cast<int>((me + 1) * stages / workers - first);
  if (count == 0) return;
  const int per_row = m / SLOTS;                // stages a (row, KV head)
  unsigned char* mine = smem + warp * WARP_BYTES;
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(mine));
  const int* s_table = reinterpret_cast<const int*>(mine + STAGES * STAGE_BYTES);
  const uint32_t ring_table = ring + STAGES * STAGE_BYTES;
  const Cursor start{static_cast<int>(first / per_row / hkv),
                     static_cast<int>(first / per_row % hkv), static_cast<int>(first % per_row)};

  // The lengths of the rows this warp's run touches, a row a lane (a run over more than 32
  // rows, of tables under 4 slots a KV head, reads the rest when it needs them).
  const int rows = static_cast<int>((first + count - 1) / per_row / hkv) - start.b + 1;
  const int my_pages = lane < rows ? (lengths[start.b + lane] + page_size - 1) / page_size : 0;
  auto pages_of = [&](int b) {
    return b - start.b < 32 ? __shfl_sync(0xffffffffu, my_pages, b - start.b)
                            : (lengths[b] + page_size - 1) / page_size;
  };

  // A stage's table entries (one 16-byte copy each by the first lanes) into ring slot `at`.
  auto copy_table = [&](const Cursor& c, int at) {
    if (lane < SLOTS / 4) {
      cp_async16(ring_table + (at * SLOTS + 4 * lane) * 4,
                 table + static_cast<int64_t>(c.b) * m + c.s * SLOTS + 4 * lane);
    }
  };
  // Stage i's centroids into ring slot i % STAGES (zeros for slots not eligible, read from
  // nowhere), then the table entries of stage i + STAGES (at `ahead`) into that slot's
  // entries, once every lane has read stage i's. No branch: the copies go out back to back.
  auto issue = [&](int i, const Cursor& c, const Cursor& ahead) {
    const int at = i % STAGES, n = pages_of(c.b), slot0 = c.s * SLOTS;
    const __nv_bfloat16* src = centroids + c.h * n_pages * D + 8 * (lane & 15);
    const uint32_t dst = ring + at * STAGE_BYTES + (lane & 15) * 16;
    int phys[SLOTS / 2];
#pragma unroll
    for (int u = 0; u < SLOTS / 2; ++u) phys[u] = s_table[at * SLOTS + 2 * u + (lane >> 4)];
#pragma unroll
    for (int u = 0; u < SLOTS / 2; ++u) {
      const int p = 2 * u + (lane >> 4), slot = slot0 + p;
      const bool read = slot >= 1 && slot < n - 2;
      cp_async16_or_zero(dst + p * D * 2, src + (read ? static_cast<int64_t>(phys[u]) * D : 0),
                         read ? 16 : 0);
    }
    __syncwarp();
    if (i + STAGES < count) copy_table(ahead, at);
  };
  auto load_queries = [&](const Cursor& c, uint4 (&raw)[MAX_GROUP]) {
    const __nv_bfloat16* row =
        q + (static_cast<int64_t>(c.b) * hkv + c.h) * group * D + 8 * (lane & 15);
#pragma unroll
    for (int r = 0; r < MAX_GROUP; ++r) {
      if (r < group) raw[r] = __ldg(reinterpret_cast<const uint4*>(row + r * D));
    }
  };
  auto mean = [&](const uint4 (&raw)[MAX_GROUP], float (&qbar)[8]) {
#pragma unroll
    for (int d = 0; d < 8; ++d) qbar[d] = 0.f;
#pragma unroll
    for (int r = 0; r < MAX_GROUP; ++r) {
      if (r < group) add_bf16x8(raw[r], qbar);
    }
#pragma unroll
    for (int d = 0; d < 8; ++d) qbar[d] /= group;
  };

  // The table entries of the first STAGES stages, then the centroids of all but the last.
  Cursor tab = start;   // the next stage whose table entries are asked for
  for (int i = 0; i < STAGES && i < count; ++i, tab.next(per_row, hkv)) copy_table(tab, i);
  cp_commit();
  cp_wait<0>();
  __syncwarp();
  Cursor put = start;   // the next stage whose centroids are asked for
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < count) {
      issue(i, put, tab);
      put.next(per_row, hkv), tab.next(per_row, hkv);
    }
    cp_commit();
  }
  uint4 raw[MAX_GROUP];
  float qbar[8];
  load_queries(start, raw);
  mean(raw, qbar);

  Cursor c = start;     // the stage scored
  for (int i = 0; i < count; ++i) {
    if (i + STAGES - 1 < count) {
      issue(i + STAGES - 1, put, tab);
      put.next(per_row, hkv), tab.next(per_row, hkv);
    }
    cp_commit();
    Cursor after = c;
    after.next(per_row, hkv);
    const bool new_head = i + 1 < count && after.s == 0;
    if (new_head) load_queries(after, raw);   // on their way while this stage is scored
    cp_wait<STAGES - 1>();
    __syncwarp();
    const int n = pages_of(c.b), slot0 = c.s * SLOTS;
    const unsigned char* stage = mine + (i % STAGES) * STAGE_BYTES + (lane & 15) * 16;
    uint4 w[SLOTS / 2];   // all of the stage's loads before any product
#pragma unroll
    for (int u = 0; u < SLOTS / 2; ++u) {
      w[u] = *reinterpret_cast<const uint4*>(stage + (2 * u + (lane >> 4)) * D * 2);
    }
    float s[SLOTS / 2];
#pragma unroll
    for (int u = 0; u < SLOTS / 2; ++u) s[u] = dot_bf16x8(w[u], qbar);
    const float total = reduce_scatter(s, lane);
    constexpr int SHARE = 32 / SLOTS;   // lanes of a half holding each sum
    if (lane % SHARE == 0) {
      const int p = 2 * ((lane & 15) / SHARE) + (lane >> 4), slot = slot0 + p;
      keys[(first + i) * SLOTS + p] = slot >= 1 && slot < n - 2 ? order_key(total) : INT_MIN;
    }
    __syncwarp();   // the stage's slot is copied into again by the next issue
    if (new_head) mean(raw, qbar);
    c = after;
  }
  cp_wait<0>();
}

ffi::Error Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

// Past 48 KB a kernel gets dynamic shared memory only when it asks: once on each device.
ffi::Error RaiseSharedLimit() {
  constexpr int kMaxDevices = 64;
  static std::once_flag once[kMaxDevices];
  static cudaError_t result[kMaxDevices];
  int device = 0;
  if (auto e = Check(cudaGetDevice(&device), "cudaGetDevice"); e.failure()) return e;
  if (device >= kMaxDevices) return ffi::Error::Internal("sparrow_sparse_score: device id");
  std::call_once(once[device], [device] {
    result[device] = cudaFuncSetAttribute(score_kernel,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          SMEM_BYTES);
  });
  return Check(result[device], "raising the scoring's shared memory limit");
}

ffi::Error Score(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer centroids,
                 ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
                 ffi::Result<ffi::Buffer<ffi::S32>> keys, int64_t page_size, int64_t blocks) {
  auto qd = q.dimensions(), cd = centroids.dimensions(), td = table.dimensions();
  auto kd = keys->dimensions();
  if (q.element_type() != ffi::BF16 || centroids.element_type() != ffi::BF16 ||
      qd.size() != 3 || cd.size() != 3 || td.size() != 2 || kd.size() != 3 || qd[2] != D ||
      cd[2] != D || cd[0] < 1 || qd[1] % cd[0] != 0 || qd[1] / cd[0] > MAX_GROUP ||
      td[0] != qd[0] || td[1] % SLOTS != 0 || lengths.dimensions()[0] != qd[0] ||
      kd[0] != qd[0] || kd[1] != cd[0] || kd[2] != td[1] || page_size < 1 || blocks < 1 ||
      blocks > INT_MAX) {
    return ffi::Error::InvalidArgument("sparrow_sparse_score: unsupported arguments");
  }
  const int hkv = static_cast<int>(cd[0]), m = static_cast<int>(td[1]);
  const int64_t stages = qd[0] * hkv * (m / SLOTS);
  if (stages == 0) return ffi::Error::Success();
  if (auto e = RaiseSharedLimit(); e.failure()) return e;
  score_kernel<<<static_cast<unsigned>(blocks), WARPS * 32, SMEM_BYTES, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(q.untyped_data()),
      reinterpret_cast<const __nv_bfloat16*>(centroids.untyped_data()), table.typed_data(),
      lengths.typed_data(), keys->typed_data(), hkv, static_cast<int>(qd[1] / hkv), cd[1], m,
      static_cast<int>(page_size), stages);
  return Check(cudaGetLastError(), "sparrow_sparse_score launch");
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
                                  .Attr<int64_t>("blocks"),
                              {ffi::Traits::kCmdBufferCompatible});
