// The sparse decode step's page selection from the scoring's keys (docs/design.md, section 3)
// as a CUDA C kernel behind an XLA FFI call; built and registered by
// pallas_kernels/sparse_select_cuda.py.
//
// Why CUDA C: the selection is latency, not bytes (it reads 8 KB a list at 32K). The Pallas
// kernel finds the k-th largest key bit by bit, a block-wide count and barrier for each of ~16
// bits, then compacts through layout conversions (7-13 us a step on an H100 and an H200,
// BENCHMARKS.md, kernel runs T and AO). Here the k-th largest key is found a byte at a time
// (four rounds of a 256-bin histogram built by shared-memory atomics), and the ties at the
// threshold and the compaction share one block-wide scan.
//
// Shapes: keys [B, Hkv, M] int32 (the scoring's order keys, INT_MIN where not eligible),
// table [B, M] int32, lengths [B] int32, budgets [B] int32 -> phys and slots [B, Hkv, 2 L]
// int32 (entries 0 .. count-1 the chosen pages in page order, count .. L-1 the row's last page
// again, L .. 2 L - 1 not written), count [B, Hkv, 1], arrivals [B, Hkv, 1] (zeros: the
// attention's merge counters). A row of n = ceil(length / P) pages with budget K (clipped to
// [3, max_pages]) takes every page when n <= K; else page 0, its last two, and the k = K - 3
// eligible slots of largest key, ties taken from the lowest slot.
// Grid: one block a (row, KV head); thread t holds slots t * per .. t * per + per - 1
// (per = ceil(n / THREADS)), so that block-wide prefix sums follow page order.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int THREADS = 256, WARPS = THREADS / 32, BINS = 256, RESERVED = 3;

// Inclusive prefix sums over the warp's lanes of one value a lane.
__device__ __forceinline__ int warp_scan(int x) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  return x;
}

// Inclusive prefix sums over the block of one value a thread, and the block's total; every
// thread of the block calls it (two barriers).
__device__ __forceinline__ int block_scan(int value, int* warp_sums, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int x = warp_scan(value);
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  int before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const int s = warp_sums[w];
    before += w < warp ? s : 0;
    all += s;
  }
  *total = all;
  __syncthreads();   // warp_sums may be written again by the next call
  return before + x;
}

template <int ITEMS>
__global__ void __launch_bounds__(THREADS)
    select_kernel(const int* __restrict__ keys, const int* __restrict__ table,
                  const int* __restrict__ lengths, const int* __restrict__ budgets,
                  int* __restrict__ phys, int* __restrict__ slots, int* __restrict__ counts,
                  int* __restrict__ arrivals, int hkv, int m, int list_len, int page_size,
                  int max_pages) {
  __shared__ int hist[BINS];
  __shared__ int warp_sums[WARPS];
  __shared__ unsigned prefix_s;
  __shared__ int need_s;
  const int list = blockIdx.x, b = list / hkv;
  const int n = min((lengths[b] + page_size - 1) / page_size, m);
  const int budget = min(max(budgets[b], RESERVED), max_pages);
  const int per = (n + THREADS - 1) / THREADS, first = threadIdx.x * per;
  const int* key_row = keys + static_cast<int64_t>(list) * m;
  const int* table_row = table + static_cast<int64_t>(b) * m;
  // Keys as unsigned in the same order (INT_MIN -> 0), and the table's entries, loaded once.
  unsigned u[ITEMS];
  int page[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int s = first + i;
    const bool in = i < per && s < n;
    u[i] = in ? static_cast<unsigned>(key_row[s]) ^ 0x80000000u : 0u;
    page[i] = in ? table_row[s] : 0;
  }
  // The threshold: the k-th largest key, a byte at a time from the top; `need` is how many
  // keys equal to it are taken. Not searched when the budget covers the row, or k = 0.
  const int k = budget - RESERVED;
  const bool take_all = n <= budget, search = !take_all && k > 0;
  unsigned prefix = 0u;
  int need = 0;
  if (search) {
    int rest = k;   // keys still to take at or below the prefix found so far
#pragma unroll 1
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = threadIdx.x; i < BINS; i += THREADS) hist[i] = 0;
      __syncthreads();
      const unsigned high = shift == 24 ? 0u : ~0u << (shift + 8);
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        // Eligible slots only (1 <= s < n - 2, whatever the keys elsewhere): k is below
        // their count, so the rest-th largest is always among them.
        const int s = first + i;
        if (i < per && s >= 1 && s < n - 2 && (u[i] & high) == prefix) {
          atomicAdd(&hist[(u[i] >> shift) & (BINS - 1)], 1);
        }
      }
      __syncthreads();
      if (threadIdx.x < 32) {   // the bin holding the rest-th largest, from the top bin down
        const int lane = threadIdx.x;
        int c[BINS / 32], sum = 0;   // lane l holds bins 255 - 8 l .. 248 - 8 l
#pragma unroll
        for (int j = 0; j < BINS / 32; ++j) sum += (c[j] = hist[BINS - 1 - (lane * 8 + j)]);
        const int incl = warp_scan(sum);
        int above = incl - sum;   // keys in the bins above this lane's
        if (above < rest && rest <= incl) {   // one lane: this one's bins hold it
          bool found = false;
#pragma unroll
          for (int j = 0; j < BINS / 32; ++j) {
            if (!found && above + c[j] >= rest) {
              found = true;
              prefix_s = prefix | (static_cast<unsigned>(BINS - 1 - (lane * 8 + j)) << shift);
              need_s = rest - above;
            } else if (!found) {
              above += c[j];
            }
          }
        }
      }
      __syncthreads();
      prefix = prefix_s;
      rest = need_s;
    }
    need = rest;
  }
  // One scan for the compaction: the slots certainly chosen (reserved, or above the
  // threshold) and the keys at the threshold, whose first `need` in page order are chosen.
  auto reserved = [&](int s) { return s == 0 || s >= n - 2; };
  int sure = 0, ties = 0;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int s = first + i;
    if (i < per && s < n) {
      if (take_all || reserved(s) || (search && u[i] > prefix)) ++sure;
      else if (search && u[i] == prefix) ++ties;
    }
  }
  int total_sure, total_ties;
  const int sure_before = block_scan(sure, warp_sums, &total_sure) - sure;
  const int ties_before = block_scan(ties, warp_sums, &total_ties) - ties;
  const int total = total_sure + min(total_ties, need);
  int* phys_row = phys + static_cast<int64_t>(list) * 2 * list_len;
  int* slot_row = slots + static_cast<int64_t>(list) * 2 * list_len;
  int rank = sure_before + min(ties_before, need), tie = ties_before;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int s = first + i;
    if (i < per && s < n) {
      bool chosen = take_all || reserved(s) || (search && u[i] > prefix);
      if (!chosen && search && u[i] == prefix) chosen = tie++ < need;
      if (chosen) {
        if (rank < list_len) {
          phys_row[rank] = page[i];
          slot_row[rank] = s;
        }
        ++rank;
      }
    }
  }
  // Entries past the count repeat the row's last page (the attention reads whole blocks of
  // entries; a repeated page comes from cache, not memory).
  const int last = max(n - 1, 0);
  const int last_page = table_row[last];
  for (int e = total + threadIdx.x; e < list_len; e += THREADS) {
    phys_row[e] = last_page;
    slot_row[e] = last;
  }
  if (threadIdx.x == 0) {
    counts[list] = total;
    arrivals[list] = 0;
  }
}

using Kernel = decltype(&select_kernel<1>);

// The kernel whose threads hold enough slots for a table of width m (up to 64 a thread).
Kernel kernel_for(int64_t m) {
  if (m <= THREADS) return select_kernel<1>;
  if (m <= 2 * THREADS) return select_kernel<2>;
  if (m <= 4 * THREADS) return select_kernel<4>;
  if (m <= 8 * THREADS) return select_kernel<8>;
  if (m <= 16 * THREADS) return select_kernel<16>;
  if (m <= 32 * THREADS) return select_kernel<32>;
  if (m <= 64 * THREADS) return select_kernel<64>;
  return nullptr;
}

ffi::Error Select(cudaStream_t stream, ffi::Buffer<ffi::S32> keys, ffi::Buffer<ffi::S32> table,
                  ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> budgets,
                  ffi::Result<ffi::Buffer<ffi::S32>> phys,
                  ffi::Result<ffi::Buffer<ffi::S32>> slots,
                  ffi::Result<ffi::Buffer<ffi::S32>> counts,
                  ffi::Result<ffi::Buffer<ffi::S32>> arrivals, int64_t page_size,
                  int64_t max_pages) {
  auto kd = keys.dimensions(), td = table.dimensions(), pd = phys->dimensions();
  if (kd.size() != 3 || td.size() != 2 || pd.size() != 3 || td[0] != kd[0] ||
      td[1] != kd[2] || lengths.dimensions()[0] != kd[0] || budgets.dimensions()[0] != kd[0] ||
      pd[0] != kd[0] || pd[1] != kd[1] || pd[2] % 2 != 0 || slots->dimensions().size() != 3 ||
      slots->dimensions()[2] != pd[2] ||
      kd[2] < 1 || page_size < 1 || max_pages < RESERVED || pd[2] / 2 < max_pages) {
    return ffi::Error::InvalidArgument("sparrow_sparse_select: unsupported arguments");
  }
  const int64_t lists = kd[0] * kd[1];
  if (lists == 0) return ffi::Error::Success();
  const Kernel kernel = kernel_for(kd[2]);
  if (kernel == nullptr || lists > INT_MAX) {
    return ffi::Error::InvalidArgument("sparrow_sparse_select: the table is wider than " +
                                       std::to_string(64 * THREADS) + " pages");
  }
  kernel<<<static_cast<unsigned>(lists), THREADS, 0, stream>>>(
      keys.typed_data(), table.typed_data(), lengths.typed_data(), budgets.typed_data(),
      phys->typed_data(), slots->typed_data(), counts->typed_data(), arrivals->typed_data(),
      static_cast<int>(kd[1]), static_cast<int>(kd[2]), static_cast<int>(pd[2] / 2),
      static_cast<int>(page_size), static_cast<int>(max_pages));
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("sparrow_sparse_select launch: ") +
                              cudaGetErrorString(e));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowSparseSelect, Select,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("page_size")
                                  .Attr<int64_t>("max_pages"),
                              {ffi::Traits::kCmdBufferCompatible});
