// The sparse decode step's attention over page lists (docs/design.md, section 3) as a CUDA C
// kernel behind an XLA FFI call; built and registered by pallas_kernels/sparse_attend_cuda.py.
//
// Why CUDA C: the Pallas and Triton attentions read the listed pages at ~65% of the read
// ceiling where their loads alone read at ~85% (notes/kernel_notes.md): their per-block
// products and softmax are not overlapped with the next block's loads. Here each warp streams
// its own pages through a ring of shared-memory stages by cp.async and runs the products of
// the page before on the tensor cores (mma.sync, m16n8k16), so every warp's copies are in
// flight during its own and its neighbours' math; no warp waits on another until the end.
//
// Shapes: q [B, Hkv * G, 128] bf16 (G <= 8 query heads a KV head), pages [Hkv, N, 16, 128]
// bf16, phys / slots [B, Hkv, L] int32 (physical page, and page index in the sequence),
// counts [B, Hkv] int32 (entries used), lengths [B] int32 -> out [B, Hkv * G, 128] bf16.
// Grid: a persistent block of W warps an SM (`programs`), sharing the lists by even splits or
// stream-K (attend_kernel); warp w of a block takes the entries w, w + W, ... of its share.
// The block's warps are merged in shared memory; a list shared by several blocks has each
// write a partial (normalised output, log2-sum-exp) and the last of them to arrive
// (`arrivals`, zero on entry and reset to zero by that block) merges the partials, unless the
// list's parts are the blocks of one cluster, which merge through distributed shared memory.
// A second handler takes the scoring's keys instead of the lists: each block then chooses its
// list's pages itself (select_part) before it streams them, where every block holds one part of
// one list (one row, or up to a wave of lists), which saves the selection kernel's launch and
// its lists' round trip through global memory. The third handler is that choice alone, one
// block a list (select_kernel); the fourth, it and then the attention over its lists in one
// call; the fifth, the scoring and the choice in one kernel (score_select_kernel) and then the
// attention, whose blocks may wait for each list alone instead of for every list.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace cg = cooperative_groups;
namespace ffi = xla::ffi;

namespace {

constexpr int P = 16, D = 128, MAX_GROUP = 8, CHUNKS = D / 8;   // 16-byte chunks a row
constexpr int PAGE_BYTES = P * D * 2;
constexpr int WARPS = 8, STAGES = 2;                            // BENCHMARKS.md, run AJ
constexpr int RING_BYTES = WARPS * STAGES * 2 * PAGE_BYTES;
constexpr int MAX_PARTS = RING_BYTES / (4 * MAX_GROUP);   // a list's parts' weights (merge_parts)
// The warps' merge (merge_warps) has shared memory of its own past the ring, so that the next
// list's first pages can land in the ring while a list's warps merge.
constexpr int MERGE_BYTES = WARPS * MAX_GROUP * (D + 2) * 4;
// What a list costs a block beside its pages, in pages: staging its entries, its queries' and
// first pages' loads one after the other, and the warps' merge (~2 us where a block streams a
// page in ~0.3 us: BENCHMARKS.md, kernel run AM).
constexpr int LIST_UNITS = 8;
// A cluster's partial results: each block's in its ring.
constexpr int MAX_CLUSTER = 8, CLUSTER_PART = 64 * 1024;
static_assert(CLUSTER_PART + (D + 1) * MAX_GROUP * 4 <= RING_BYTES);

// The kernels' timeline, built only with -DSPARROW_TRACE (SPARROW_CUDA_DEFINES, read by
// pallas_kernels/cuda_trace.py): thread 0 of a block records each mark below (the global
// clock, the SM's cycle counter, its SM, block, event and list) into a device buffer that
// SparrowTraceRead copies out. Without the macro a mark is empty, so the kernels measured are
// the kernels traced, less the marks' stores.
enum TraceEvent {
  SCORE_START, SCORE_DONE, LIST_CHOSEN, SELECT_START, SELECT_DONE,
  ATTEND_START, ATTEND_GO, PART_READY, PART_STREAMED, PART_DONE, ATTEND_END
};
#ifdef SPARROW_TRACE
struct TraceRecord {
  unsigned long long ns, cycles;
  int sm, block, event, list;
};
constexpr unsigned TRACE_CAPACITY = 1u << 20;
__device__ TraceRecord g_trace[TRACE_CAPACITY];
__device__ unsigned long long g_trace_count;
// Not inlined: inlined, its registers made the scoring kernel spill under its 64.
__device__ __noinline__ void trace(TraceEvent event, int list) {
  if (threadIdx.x != 0) return;
  unsigned long long ns;
  unsigned sm;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  const unsigned long long at = atomicAdd(&g_trace_count, 1ull);
  if (at < TRACE_CAPACITY) {
    g_trace[at] = {ns, static_cast<unsigned long long>(clock64()), static_cast<int>(sm),
                   static_cast<int>(blockIdx.x), event, list};
  }
}
#else
__device__ __forceinline__ void trace(TraceEvent, int) {}
#endif

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                        uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                          uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// c += a b (m16n8k16, bf16 in, float32 accumulate) with a's rows 8-15 zero: the group's
// query heads sit in rows 0-7.
__device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// Token t's 16-byte chunk c sits at chunk c ^ (t & 7) of its row, so that the 8 rows one
// ldmatrix reads (256 bytes apart) fall in 8 different bank groups.
__device__ __forceinline__ uint32_t swizzled(int t, int c) {
  return static_cast<uint32_t>((t * CHUNKS + (c ^ (t & 7))) * 16);
}

__device__ __forceinline__ void copy_page(uint32_t dst, const __nv_bfloat16* k,
                                          const __nv_bfloat16* v, int lane) {
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int j = lane + 32 * u, t = j >> 4, c = j & 15;
    cp_async16(dst + swizzled(t, c), k + t * D + c * 8);
    cp_async16(dst + PAGE_BYTES + swizzled(t, c), v + t * D + c * 8);
  }
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// One warp's running attention: the group's rows of the output (mma C fragments: row g,
// columns 8 j + 2 tig + {0, 1}), running max (log2 units) and this lane's part of the sum.
struct Acc {
  float o[16][4];
  float m, l;
};

__device__ __forceinline__ void reset(Acc& a) {
#pragma unroll
  for (int j = 0; j < 16; ++j) a.o[j][0] = a.o[j][1] = a.o[j][2] = a.o[j][3] = 0.f;
  a.m = -INFINITY;
  a.l = 0.f;
}

// The group's queries of list (b, h) as A fragments: row g (a query head when g < group),
// columns 16 kk + 2 tig + {0, 1} and + 8.
__device__ __forceinline__ void load_queries(const __nv_bfloat16* q, int b, int h, int hkv,
                                             int group, int lane, uint32_t (&qa)[8][2]) {
  const int g = lane >> 2, tig = lane & 3;
  const __nv_bfloat16* qrow =
      q + (static_cast<int64_t>(b) * hkv * group + h * group + min(g, group - 1)) * D + 2 * tig;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    qa[kk][0] = g < group ? *reinterpret_cast<const uint32_t*>(qrow + 16 * kk) : 0u;
    qa[kk][1] = g < group ? *reinterpret_cast<const uint32_t*>(qrow + 16 * kk + 8) : 0u;
  }
}

// Warp `warp`'s share of n staged entries (w, w + WARPS, ...) of list (b, h) streamed into
// `a`: page i + 1's copies in flight while page i's products run (`first_in`: the first page's
// were issued already, into the ring's first stage). Leaves no copy pending.
__device__ __forceinline__ void stream_entries(const int* s_phys, const int* s_slot, int n,
                                               const __nv_bfloat16* kbase,
                                               const __nv_bfloat16* vbase, uint32_t ring,
                                               const __nv_bfloat16* q, int b, int h, int hkv,
                                               int group, int length, float scale_log2,
                                               int warp, int lane, bool first_in, Acc& a) {
  const int tig = lane & 3;
  const int mine = max(0, (n - warp + WARPS - 1) / WARPS);
  auto issue = [&](int i) {
    const int64_t off = static_cast<int64_t>(s_phys[warp + WARPS * i]) * P * D;
    copy_page(ring + (i % STAGES) * 2 * PAGE_BYTES, kbase + off, vbase + off, lane);
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < mine && !(i == 0 && first_in)) issue(i);
    cp_commit();
  }
  uint32_t qa[8][2];      // loaded while the first copies are in flight
  load_queries(q, b, h, hkv, group, lane, qa);
  for (int i = 0; i < mine; ++i) {
    cp_wait<STAGES - 2>();
    __syncwarp();   // every lane's copies of page i landed, and page i - 1's slot is read
    if (i + STAGES - 1 < mine) issue(i + STAGES - 1);
    cp_commit();
    const uint32_t kb = ring + (i % STAGES) * 2 * PAGE_BYTES, vb = kb + PAGE_BYTES;
    // Logits of head g and tokens 8 nt + 2 tig + {0, 1} in sc[nt][0..1].
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const int t = ((lane >> 4) << 3) + (lane & 7), c = 2 * kk + ((lane >> 3) & 1);
      uint32_t b0, b1, b2, b3;
      ldsm_x4(kb + swizzled(t, c), b0, b1, b2, b3);
      mma(sc[0], qa[kk][0], qa[kk][1], b0, b1);
      mma(sc[1], qa[kk][0], qa[kk][1], b2, b3);
    }
    const int pos = s_slot[warp + WARPS * i] * P + 2 * tig;
    float x[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      x[e] = pos + (e >> 1) * 8 + (e & 1) < length ? sc[e >> 1][e & 1] * scale_log2 : -INFINITY;
    }
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(a.m, mx);
    const float base = m_new == -INFINITY ? 0.f : m_new;   // a fully masked page so far
    const float alpha = exp2f(a.m - base);
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) p[e] = exp2f(x[e] - base);
    a.l = a.l * alpha + (p[0] + p[1]) + (p[2] + p[3]);
    a.m = m_new;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      a.o[j][0] *= alpha;
      a.o[j][1] *= alpha;
    }
    // The probabilities are already the A fragment of P V (columns = tokens).
    const uint32_t pa0 = pack_bf16(p[0], p[1]), pa2 = pack_bf16(p[2], p[3]);
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int t = (((lane >> 3) & 1) << 3) + (lane & 7), c = 2 * jj + (lane >> 4);
      uint32_t b0, b1, b2, b3;
      ldsm_x4_t(vb + swizzled(t, c), b0, b1, b2, b3);
      mma(a.o[2 * jj], pa0, pa2, b0, b1);
      mma(a.o[2 * jj + 1], pa0, pa2, b2, b3);
    }
  }
  cp_wait<0>();
}

// The block's warps merged through `scratch` (MERGE_BYTES of shared memory, not the ring):
// for each of the group's idx = head * D + column, emit(idx, normalised output, log2-sum-exp
// of the head). Ends synchronised.
template <class Emit>
__device__ __forceinline__ void merge_warps(Acc& a, uint8_t* scratch, int group, int warp,
                                            int lane, Emit emit) {
  const int g = lane >> 2, tig = lane & 3;
  a.l += __shfl_xor_sync(0xffffffffu, a.l, 1);
  a.l += __shfl_xor_sync(0xffffffffu, a.l, 2);
  float* s_o = reinterpret_cast<float*>(scratch);         // [WARPS][group][D]
  float* s_m = s_o + WARPS * MAX_GROUP * D;                // [WARPS][group]
  float* s_l = s_m + WARPS * MAX_GROUP;
  __syncthreads();
  if (g < group) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      s_o[(warp * group + g) * D + 8 * j + 2 * tig] = a.o[j][0];
      s_o[(warp * group + g) * D + 8 * j + 2 * tig + 1] = a.o[j][1];
    }
    if (tig == 0) s_m[warp * group + g] = a.m, s_l[warp * group + g] = a.l;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * D; idx += WARPS * 32) {
    const int hh = idx / D;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, s_m[w * group + hh]);
    float acc = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float f = s_m[w * group + hh] == -INFINITY ? 0.f : exp2f(s_m[w * group + hh] - mm);
      acc += f * s_o[w * group * D + idx];
      den += f * s_l[w * group + hh];
    }
    emit(idx, den > 0.f ? acc / den : 0.f, den > 0.f ? mm + log2f(den) : -INFINITY);
  }
  __syncthreads();
}

// List `list`'s n partial results at parts first .. first + n - 1 (written by other blocks:
// read past L1) rescaled to their common max and summed into its output row. Each head's
// part weights are worked out once, a warp a head, into shared memory (`s_w`, the ring, free
// once the warps are merged), so that summing a column is independent loads the compiler
// keeps many of in flight: read one after another, the ~16 parts of a stream-K list took
// longer than its attention (BENCHMARKS.md, kernel run AL).
__device__ __forceinline__ void merge_parts(const float* part_o, const float* part_lse,
                                            int64_t first, int n, int group,
                                            __nv_bfloat16* out_row, float* s_w) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int hh = warp; hh < group; hh += WARPS) {   // s_w[s * group + hh]: part s's weight
    float mm = -INFINITY;
    for (int s = lane; s < n; s += 32) mm = fmaxf(mm, __ldcg(&part_lse[(first + s) * group + hh]));
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, d));
    for (int s = lane; s < n; s += 32) {
      const float lse = __ldcg(&part_lse[(first + s) * group + hh]);
      s_w[s * group + hh] = lse == -INFINITY ? 0.f : exp2f(lse - mm);
    }
  }
  __syncthreads();
  const float* column = part_o + first * group * D;
  for (int idx = threadIdx.x; idx < group * D; idx += WARPS * 32) {
    const int hh = idx / D;
    float acc = 0.f, den = 0.f;
#pragma unroll 8
    for (int s = 0; s < n; ++s) {
      const float f = s_w[s * group + hh];
      acc += f * __ldcg(&column[static_cast<int64_t>(s) * group * D + idx]);
      den += f;
    }
    out_row[idx] = __float2bfloat16(den > 0.f ? acc / den : 0.f);
  }
}

// This block's partial of a list written at `part`, its arrival counted on the list's
// counter; the list's last block to arrive (of n) merges parts first .. first + n - 1 and
// resets the counter for the next call.
__device__ __forceinline__ void arrive(int* counter, int n, const float* part_o,
                                       const float* part_lse, int64_t first, int group,
                                       __nv_bfloat16* out_row, int* s_last, float* s_w) {
  __threadfence();   // this block's partial visible before its arrival is counted
  __syncthreads();
  if (threadIdx.x == 0) *s_last = atomicAdd(counter, 1) == n - 1;
  __syncthreads();
  if (*s_last) {
    __threadfence();
    merge_parts(part_o, part_lse, first, n, group, out_row, s_w);
    if (threadIdx.x == 0) *counter = 0;
  }
  __syncthreads();   // s_last is read by every thread before the next list sets it
}

// A list whose n parts are the n blocks of this cluster: after a cluster barrier each block
// reads every block's partial (`part`: normalised output [group, D], then log2-sum-exp
// [group]) from its shared memory and writes its own slice of the output row. Replaces the
// partials' round trips through global memory, the fence and the arrival counter, and the
// last block's merge alone (at one row 2.2-2.9 us of the attention: kernel run AR).
__device__ __forceinline__ void merge_cluster(float* part, int n, int group,
                                              __nv_bfloat16* out_row) {
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();   // every block's partial written and visible
  const int size = group * D, per = (size + n - 1) / n;
  const int lo = static_cast<int>(cluster.block_rank()) * per, hi = min(lo + per, size);
  for (int idx = lo + threadIdx.x; idx < hi; idx += WARPS * 32) {
    const int hh = idx / D;
    float lse[MAX_CLUSTER], mm = -INFINITY;
#pragma unroll
    for (int r = 0; r < MAX_CLUSTER; ++r) {
      lse[r] = r < n ? cluster.map_shared_rank(part, r)[size + hh] : -INFINITY;
      mm = fmaxf(mm, lse[r]);
    }
    float acc = 0.f, den = 0.f;
#pragma unroll
    for (int r = 0; r < MAX_CLUSTER; ++r) {
      if (r < n && lse[r] != -INFINITY) {
        const float f = exp2f(lse[r] - mm);
        acc += f * cluster.map_shared_rank(part, r)[idx];
        den += f;
      }
    }
    out_row[idx] = __float2bfloat16(den > 0.f ? acc / den : 0.f);
  }
  cluster.sync();   // no block leaves, or reuses its ring, while another reads its partial
}

// Entries [start, start + n) of list `list` into shared memory.
__device__ __forceinline__ void stage(const int* lists, const int* slots, int list, int list_len,
                                      int start, int n, int* s_phys, int* s_slot) {
  const int64_t row = static_cast<int64_t>(list) * list_len + start;
  for (int i = threadIdx.x; i < n; i += WARPS * 32) {
    s_phys[i] = lists[row + i];
    s_slot[i] = slots[row + i];
  }
}

// Entries [row, row + n) of a list, at most STAGED_EACH a thread, loaded into registers
// before the block waits on something else and stored to its staged entries after the wait,
// so that neither the loads nor the stores hold the wait up.
constexpr int STAGED_EACH = 2;

__device__ __forceinline__ void load_entries(const int* lists, const int* slots, int64_t row,
                                             int n, int (&phys)[STAGED_EACH],
                                             int (&slot)[STAGED_EACH]) {
#pragma unroll
  for (int u = 0; u < STAGED_EACH; ++u) {
    const int j = threadIdx.x + u * WARPS * 32;
    if (j < n) phys[u] = lists[row + j], slot[u] = slots[row + j];
  }
}

__device__ __forceinline__ void store_entries(int n, const int (&phys)[STAGED_EACH],
                                              const int (&slot)[STAGED_EACH], int* s_phys,
                                              int* s_slot) {
#pragma unroll
  for (int u = 0; u < STAGED_EACH; ++u) {
    const int j = threadIdx.x + u * WARPS * 32;
    if (j < n) s_phys[j] = phys[u], s_slot[j] = slot[u];
  }
}

// Inclusive prefix sums over the block of one value a thread, and the block's total.
__device__ __forceinline__ int block_scan(int value, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = value;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  int before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    before += w < warp ? warp_sums[w] : 0;
    all += warp_sums[w];
  }
  *total = all;
  __syncthreads();   // warp_sums may be written again by the next call
  return before + x;
}

// The lists' units laid end to end: a list's units are LIST_UNITS for what it costs beside its
// pages, then its pages (at least one: a list without pages has one, whose block writes its
// zeros). s_ends[i] = the units of lists 0 .. i; *s_most = the most units of a list.
__device__ __forceinline__ void list_ends(const int* counts, int list_len, int n, int* s_ends,
                                          int* s_warp, int* s_most) {
  const int per = (n + WARPS * 32 - 1) / (WARPS * 32);
  const int lo = min(n, static_cast<int>(threadIdx.x) * per), hi = min(n, lo + per);
  if (threadIdx.x == 0) *s_most = 0;
  int sum = 0, most = 0;
  for (int i = lo; i < hi; ++i) {
    const int units = LIST_UNITS + max(min(counts[i], list_len), 1);
    sum += units;
    most = max(most, units);
  }
  int all;
  int run = block_scan(sum, s_warp, &all) - sum;
  if (lo < hi) atomicMax(s_most, most);
  for (int i = lo; i < hi; ++i) {
    run += LIST_UNITS + max(min(counts[i], list_len), 1);
    s_ends[i] = run;
  }
  __syncthreads();
}

// ---- The selection inside the attention (the second handler) ----

// What the block needs to choose a list's pages: the scoring's order keys [Hkv, B, width]
// (INT_MIN where a page may not be chosen), the page table [B, width], the budgets [B].
struct Choice {
  const int* keys;
  const int* table;
  const int* budgets;
  int batch, width, page_size, max_pages;
};

constexpr int RESERVED = 3, BINS = 256, ROUNDS = 4, THREADS = WARPS * 32, RUN = 8;
// The scratch the choice takes from the ring (free until the pages stream): the row's keys
// and pages (padded: slot s at s + s / 32, so that a thread's run of slots and its
// neighbours' fall in different banks), one histogram a round (16-byte aligned for vector
// loads; all cleared with the load, so that a round needs one barrier) and the warps' sums.
__host__ __device__ constexpr int padded(int s) { return s + (s >> 5); }
__host__ __device__ constexpr int hist_offset(int width) { return (8 * padded(width) + 15) & ~15; }
constexpr int MAX_CHOICE_WIDTH = 8192;
static_assert(MAX_CHOICE_WIDTH <= 32 * THREADS);   // a thread's slots' kinds in one mask
static_assert(hist_offset(MAX_CHOICE_WIDTH) + 4 * (ROUNDS * BINS + 3 * WARPS) <= RING_BYTES);

// f(s, key of slot s) for slots [lo, hi) in order, the keys of RUN slots loaded before any is
// used: otherwise each load waits behind the previous slot's atomic or store.
template <class F>
__device__ __forceinline__ void for_keys(const unsigned* key, int lo, int hi, F f) {
  for (int base = lo; base < hi; base += RUN) {
    unsigned u[RUN];
#pragma unroll
    for (int j = 0; j < RUN; ++j) u[j] = base + j < hi ? key[padded(base + j)] : 0u;
#pragma unroll
    for (int j = 0; j < RUN; ++j)
      if (base + j < hi) f(base + j, u[j]);
  }
}

// One round of the threshold's search, run by every warp alike on the round's histogram
// (bins of the keys' bits from `shift` up, among the keys that match the prefix above them):
// the bin holding the rest-th largest key, scanned from the top bin down. Moves prefix to
// that bin, rest to the rank within it; returns the bin's count.
__device__ __forceinline__ int search_round(const int* hist, int shift, unsigned* prefix,
                                            int* rest) {
  const int lane = threadIdx.x & 31;
  // Lane l holds bins 255 - 8 l .. 248 - 8 l, two 16-byte loads.
  const int4 top = reinterpret_cast<const int4*>(hist)[(BINS - 4) / 4 - 2 * lane];
  const int4 low = reinterpret_cast<const int4*>(hist)[(BINS - 8) / 4 - 2 * lane];
  const int cnt[BINS / 32] = {top.w, top.z, top.y, top.x, low.w, low.z, low.y, low.x};
  int sum = 0;
#pragma unroll
  for (int j = 0; j < BINS / 32; ++j) sum += cnt[j];
  int incl = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += y;
  }
  int run = incl - sum, above = 0, bin = 0, count = 0;   // run: keys in the bins above
#pragma unroll
  for (int j = 0; j < BINS / 32; ++j) {
    if (run < *rest && *rest <= run + cnt[j]) {
      bin = BINS - 1 - (lane * 8 + j);
      count = cnt[j];
      above = run;
    }
    run += cnt[j];
  }
  // One lane's bins hold it: rest lies in (its keys above, its keys above and its own].
  const int src = __ffs(__ballot_sync(0xffffffffu, incl - sum < *rest && *rest <= incl)) - 1;
  *prefix |= static_cast<unsigned>(__shfl_sync(0xffffffffu, bin, src)) << shift;
  *rest -= __shfl_sync(0xffffffffu, above, src);
  return __shfl_sync(0xffffffffu, count, src);
}

// List i's page list chosen as the selection kernel chooses it (docs/design.md, section 3;
// pallas_kernels/sparse_decode_gpu.py, _select_kernel): a row of n pages with budget K
// (clipped to [3, max_pages]) takes every page when n <= K, else page 0, its last two and the
// K - 3 eligible pages of largest key, ties to the lower page. The K - 3-th largest key is
// found up to 8 bits a round (a 256-bin histogram), from the highest bit in which the
// eligible keys differ (the bits above are the same in all of them: keys of one scale share
// their sign and exponent's top), done early where the bin holding it is taken whole; the
// ties and the compaction in page order share one block scan. Entries [from, to) of the
// list, part `split` of `splits` even parts, are staged at s_phys / s_slot; returns from and
// to.
__device__ __forceinline__ int2 select_part(const Choice& c, int i, int hkv, int length,
                                            int split, int splits, uint8_t* scratch,
                                            int* s_phys, int* s_slot) {
  const int b = i / hkv, h = i % hkv;
  // A thread's slots (t, t + THREADS, ...) are loaded RUN at a time before any is stored,
  // the first run before the row's length and budget are even used (slots up to the table's
  // width are stored whatever the length; those past it are never read): the choice then
  // waits on one round trip where it waited on three (the length and budget, then the two
  // runs of 4 loads the compiler had made of 2048 slots). The keys were just written by the
  // scoring and come from L2, so this is 0.1-0.2 us of the attention at 1 and 8 rows (H100,
  // BENCHMARKS.md, kernel run BC).
  const int* key_row = c.keys + (static_cast<int64_t>(h) * c.batch + b) * c.width;
  const int* table_row = c.table + static_cast<int64_t>(b) * c.width;
  unsigned u[RUN];
  int p[RUN];
  auto load_run = [&](int s0) {
#pragma unroll
    for (int r = 0; r < RUN; ++r) {
      const int s = s0 + r * THREADS;
      // Past L1: the fifth handler's keys were written by other blocks of the same kernel.
      if (s < c.width) u[r] = static_cast<unsigned>(__ldcg(key_row + s)) ^ 0x80000000u,
                       p[r] = table_row[s];
    }
  };
  load_run(threadIdx.x);
  const int n = min((length + c.page_size - 1) / c.page_size, c.width);
  const int budget = min(max(c.budgets[b], RESERVED), c.max_pages);
  const int k = budget - RESERVED;
  const bool take_all = n <= budget, search = !take_all && k > 0;
  unsigned* key = reinterpret_cast<unsigned*>(scratch);
  int* page = reinterpret_cast<int*>(key + padded(c.width));
  int* hist = reinterpret_cast<int*>(scratch + hist_offset(c.width));
  int* warp_sums = hist + ROUNDS * BINS;
  unsigned* warp_bits = reinterpret_cast<unsigned*>(warp_sums + WARPS);   // or, and a warp
  unsigned any = 0u, all = ~0u;   // of the eligible keys (slots 1 .. n - 3)
  for (int s0 = threadIdx.x; s0 < c.width; s0 += RUN * THREADS) {
    if (s0 != threadIdx.x) load_run(s0);
#pragma unroll
    for (int r = 0; r < RUN; ++r) {
      const int s = s0 + r * THREADS;
      if (s < c.width) {
        key[padded(s)] = u[r];
        page[padded(s)] = p[r];
        if (s >= 1 && s < n - 2) any |= u[r], all &= u[r];
      }
    }
    if (s0 + RUN * THREADS >= n) break;
  }
  if (search) {
    for (int j = threadIdx.x; j < ROUNDS * BINS; j += THREADS) hist[j] = 0;
    any = __reduce_or_sync(0xffffffffu, any);
    all = __reduce_and_sync(0xffffffffu, all);
    if ((threadIdx.x & 31) == 0) {
      warp_bits[threadIdx.x >> 5] = any;
      warp_bits[WARPS + (threadIdx.x >> 5)] = all;
    }
  }
  __syncthreads();
  // Thread t holds slots [lo, hi): block-wide prefix sums then follow page order.
  const int per = (n + THREADS - 1) / THREADS;
  const int lo = min(n, static_cast<int>(threadIdx.x) * per), hi = min(n, lo + per);
  // The search keeps the threshold's bits found so far (prefix, the bits under `known`) and
  // how many keys equal to it on those bits are still to take (need).
  unsigned prefix = 0u, known = ~0u;
  int need = 0;
  if (search) {
    for (int w = 0; w < WARPS; ++w) any |= warp_bits[w], all &= warp_bits[WARPS + w];
    const int top = 31 - __clz(any ^ all);   // -1: every eligible key the same
    known = top == 31 ? 0u : ~0u << (top + 1);
    prefix = all & known;
    need = k;
#pragma unroll 1
    for (int high = top, r = 0; high >= 0; ++r) {
      const int shift = max(high - 7, 0);
      int* h_r = hist + r * BINS;
      for_keys(key, max(lo, 1), min(hi, n - 2), [&](int, unsigned u) {
        if ((u & known) == prefix) atomicAdd(&h_r[(u >> shift) & (BINS - 1)], 1);
      });
      __syncthreads();
      const int count = search_round(h_r, shift, &prefix, &need);
      known |= ((2u << (high - shift)) - 1u) << shift;   // bits shift .. high
      high = shift - 1;
      if (count == need) break;   // the bin is taken whole: its lower bits decide nothing
    }
  }
  auto reserved = [&](int s) { return s == 0 || s >= n - 2; };
  // Per slot: 2 taken for sure (reserved, or above the threshold), 1 a tie, 0 not taken.
  auto kind = [&](int s, unsigned u) {
    if (take_all || reserved(s)) return 2;
    if (!search) return 0;
    u &= known;
    return u > prefix ? 2 : u == prefix ? 1 : 0;
  };
  // A thread's slots are at most 32 (MAX_CHOICE_WIDTH / THREADS): their kinds kept as two
  // masks, so that the staging below reads neither the keys nor their kinds again.
  unsigned sure_bits = 0u, tie_bits = 0u;
  for_keys(key, lo, hi, [&](int s, unsigned u) {
    const int t = kind(s, u);
    sure_bits |= static_cast<unsigned>(t == 2) << (s - lo);
    tie_bits |= static_cast<unsigned>(t == 1) << (s - lo);
  });
  const int sure = __popc(sure_bits), ties = __popc(tie_bits);
  // One scan of both counts (each below 2^16: a list has at most MAX_CHOICE_WIDTH slots).
  int totals;
  const int before = block_scan((sure << 16) | ties, warp_sums, &totals) - ((sure << 16) | ties);
  const int sure_before = before >> 16, ties_before = before & 0xffff;
  const int count = (totals >> 16) + min(totals & 0xffff, need);
  const int each = (count + splits - 1) / splits;
  const int from = min(split * each, count), to = min(from + each, count);
  int rank = sure_before + min(ties_before, need), tie = ties_before;
  for (unsigned bits = sure_bits | tie_bits; bits != 0u; bits &= bits - 1u) {
    const int j = __ffs(bits) - 1, s = lo + j;
    if ((sure_bits >> j & 1u) || tie++ < need) {
      if (rank >= from && rank < to) {
        s_phys[rank - from] = page[padded(s)];
        s_slot[rank - from] = s;
      }
      ++rank;
    }
  }
  __syncthreads();   // the list staged, and the ring free for the pages
  return make_int2(from, to);
}

// The fifth handler's lists, each marked ready (1) by the block that chose it, after the
// list: the block waits until list `wait` is ready (-1: none), then says whether list `peek`
// is ready already (-1 or past the lists: false), the same answer in every thread. Reads past
// L1 (acquire), so that what the list's block wrote before the mark is seen after it.
__device__ __forceinline__ bool wait_list(const int* ready, int wait, int peek, int* s_peek) {
  if (threadIdx.x == 0) {
    auto flag = [&](int i) {
      int v;
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(ready + i) : "memory");
      return v;
    };
    if (wait >= 0) {
      while (flag(wait) == 0) __nanosleep(64);
    }
    *s_peek = peek >= 0 && flag(peek) != 0;
  }
  __syncthreads();
  return *s_peek;
}

// How the blocks share the lists. Even: list i's `splits` parts of ceil(pages / splits)
// entries are blocks of work lists * splits in all, taken by the gridDim.x blocks in turn
// (fewer parts than blocks: one each by every stride-th block), each part merged with its
// list's others at parts i * splits ... Stream-K: block p takes units
// [p * chunk, (p + 1) * chunk) of the lists laid end to end (list_ends), chunk =
// ceil(total / blocks), across lists' ends where they fall, so every block has about the
// same work however ragged the lists are. A list's part is the block's share of its pages
// (the LIST_UNITS before them only weigh its cost); a list inside one block is written out
// directly, otherwise each of its blocks writes a part at p + i (parts run in the order of
// their units and from one to the next p or i or both grow, so each has its own place) and
// the last to arrive merges parts p_first + i .. p_last + i. `balance` 1: stream-K, 0: even,
// -1: whichever the units say is faster (even, unless stream-K takes under 1/1.1 of its
// time): stream-K where even parts leave SMs idle, e.g. 19 rows' 152 lists on 132 SMs, and
// where the lists are ragged, e.g. one long row among rows of one page (kernel run AM).
// kCluster: even splits launched as one block a part, each list's `splits` parts one cluster
// of blocks (merge_cluster); its own instantiation, so that the other launches run the code
// they ran before it. kSelect: even splits whose lists each block chooses itself from
// `choice` (select_part; lists, slots and counts unused).
template <bool kCluster, bool kSelect>
__global__ void __launch_bounds__(WARPS * 32)
    attend_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kpages,
                  const __nv_bfloat16* __restrict__ vpages, const int* __restrict__ lists,
                  const int* __restrict__ slots, const int* __restrict__ counts,
                  const int* __restrict__ lengths, __nv_bfloat16* __restrict__ out,
                  float* part_o, float* part_lse, int* arrivals, int hkv, int group,
                  int64_t n_pages, int list_len, int n_lists, int splits, int balance, int cap,
                  float scale_log2, Choice choice, const int* ready) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ int s_last, s_warp[WARPS], s_most, s_peek;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint8_t* s_merge = smem + RING_BYTES;
  int* s_phys = reinterpret_cast<int*>(smem + RING_BYTES + MERGE_BYTES);
  int* s_slot = s_phys + cap;
  int* s_ends = s_slot + cap;
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) +
                        warp * STAGES * 2 * PAGE_BYTES;
  const int blocks = gridDim.x, even_blocks = n_lists * splits;
  // Launched by programmatic dependent launch (the fourth and fifth handlers), the block
  // started while the lists were being chosen. With `ready` (the fifth handler, even splits)
  // it waits for each list's flag before it reads the list (wait_list); without, for the
  // whole grid before it (a no-op when not launched so).
  trace(ATTEND_START, -1);
  if (ready == nullptr) asm volatile("griddepcontrol.wait;" ::: "memory");
  // Even parts fewer than the blocks go to every stride-th block, so that the working blocks
  // spread over the GPU instead of filling the first SMs (kernel run AR, batch 8: 64 parts on
  // 132 blocks, the attention 23.4 us against 30.3 on the first 64 blocks of one H200, 22.8
  // on another: where the first blocks land differs between machines).
  const int stride = max(1, blocks / even_blocks);
  const int first_part = blockIdx.x % stride ? even_blocks : blockIdx.x / stride;
  // Even splits' first part of this block, and its list's count, loaded before anything
  // waits, on the guess that the list is full (count == list_len: every list of a row past
  // its budget), so that these loads overlap the scan of the counts instead of following it
  // (kernel run AR: at batch 1 the scan took 0.8 us and the staging after it 1.4 of 10.5).
  const int guess_each = (list_len + splits - 1) / splits;
  const int guess_from = min((first_part % splits) * guess_each, list_len);
  const int guess_n = min(guess_each, list_len - guess_from);
  const bool guessed = !kSelect && balance <= 0 && first_part < even_blocks &&
                       guess_n <= min(cap, STAGED_EACH * WARPS * 32);
  if (ready != nullptr && first_part < even_blocks) {
    wait_list(ready, first_part / splits, -1, &s_peek);
  }
  trace(ATTEND_GO, first_part < even_blocks ? first_part / splits : -1);
  const int guess_count = guessed ? __ldcg(&counts[first_part / splits]) : 0;
  int guess_phys[STAGED_EACH], guess_slot[STAGED_EACH];
  if (guessed)
    load_entries(lists, slots, static_cast<int64_t>(first_part / splits) * list_len + guess_from,
                 guess_n, guess_phys, guess_slot);
  // Even splits asked for (the host knows the lists are of one length): no scan.
  if (balance != 0) list_ends(counts, list_len, n_lists, s_ends, s_warp, &s_most);
  if (guessed) store_entries(guess_n, guess_phys, guess_slot, s_phys, s_slot);
  __syncthreads();
  const int64_t head_pages = n_pages * P * D;

  // Entries [from, to) of list i into `a`, `cap` staged at a time (the first `cap` already,
  // if `staged`; the warp's first page in flight already, if `first_in`).
  auto attend = [&](int i, int from, int to, Acc& a, bool staged, bool first_in) {
    const int h = i % hkv, b = i / hkv;
    reset(a);
    for (int s = from; s < to; s += cap) {
      const int n = min(cap, to - s);
      if (!staged || s != from) {
        stage(lists, slots, i, list_len, s, n, s_phys, s_slot);
        __syncthreads();
      }
      stream_entries(s_phys, s_slot, n, kpages + h * head_pages, vpages + h * head_pages, ring,
                     q, b, h, hkv, group, lengths[b], scale_log2, warp, lane,
                     first_in && s == from, a);
      __syncthreads();   // every warp is done with the staged entries
    }
  };
  // The block's part of list i: its output row if it is the list's only part, else part
  // `part` of the n at first .. first + n - 1.
  auto finish = [&](int i, Acc& a, int64_t part, int64_t first, int n) {
    __nv_bfloat16* out_row = out + static_cast<int64_t>(i) * group * D;
    if (n == 1) {
      merge_warps(a, s_merge, group, warp, lane,
                  [&](int idx, float val, float) { out_row[idx] = __float2bfloat16(val); });
      return;
    }
    if constexpr (kCluster) {
      float* own = reinterpret_cast<float*>(smem + CLUSTER_PART);
      merge_warps(a, s_merge, group, warp, lane, [&](int idx, float val, float lse) {
        own[idx] = val;
        if (idx % D == 0) own[group * D + idx / D] = lse;
      });
      merge_cluster(own, n, group, out_row);
      return;
    }
    merge_warps(a, s_merge, group, warp, lane, [&](int idx, float val, float lse) {
      part_o[part * group * D + idx] = val;
      if (idx % D == 0) part_lse[part * group + idx / D] = lse;
    });
    arrive(&arrivals[i], n, part_o, part_lse, first, group, out_row, &s_last,
           reinterpret_cast<float*>(smem));
  };

  // Each way's time in units (a model fitted to kernel run AM): a round of blocks takes the
  // longer of its units over the blocks that reach the memory's bandwidth (about half the
  // SMs: BENCHMARKS.md, run AJ) and its longest part; stream-K is one round whose longest
  // part is a chunk. Merging n parts, a list's last block reads them: LIST_UNITS * n / 4.
  const int total = balance == 0 ? 0 : s_ends[n_lists - 1];
  const int chunk = (total + blocks - 1) / blocks;
  const float reach = 0.5f * blocks;
  auto merge = [](int n) { return n > 1 ? 0.25f * LIST_UNITS * n : 0.f; };
  auto even_faster = [&] {
    const float even_total = total + static_cast<float>(n_lists) * (splits - 1) * LIST_UNITS;
    const float longest =
        LIST_UNITS + (s_most - LIST_UNITS + splits - 1) / splits + merge(splits);
    auto round_time = [&](int n) { return fmaxf(even_total * n / even_blocks / reach, longest); };
    const float even_time = (even_blocks / blocks) * round_time(blocks) +
                            (even_blocks % blocks ? round_time(even_blocks % blocks) : 0.f);
    const float streamk_time =
        fmaxf(total / reach, chunk + LIST_UNITS + merge((s_most + chunk - 1) / chunk));
    return 10 * even_time <= 11 * streamk_time;
  };
  Acc a;
  if (balance == 0 || (balance < 0 && even_faster())) {
    // One part a list (splits 1): while the block streams a list, the next one's count,
    // entries and each warp's first page entry are loaded, and that page is copied into the
    // warp's ring once the list's own pages have landed, so that it arrives during the warps'
    // merge, instead of waiting on the merge, its count, its staging and its first page's round
    // trip in turn (~4 us a block at 32 rows, H200: kernel run AR). The attention gained 0.4-0.8
    // us at 32 rows (H100, kernel run BD): the blocks drift apart, so one block's wait was
    // mostly other blocks' streaming.
    const int step = blocks / stride;
    int count_ahead = -1;   // the part's count, when loaded ahead
    bool staged_ahead = false, in_flight = false;
    for (int v = first_part; v < even_blocks; v += step) {
      const int i = v / splits, split = v % splits;
      if constexpr (kSelect) {
        const int2 part = select_part(choice, i, hkv, lengths[i / hkv], split, splits, smem,
                                      s_phys, s_slot);
        trace(PART_READY, i);
        attend(i, part.x, part.y, a, true, false);
        trace(PART_STREAMED, i);
        finish(i, a, v, static_cast<int64_t>(i) * splits, splits);
        trace(PART_DONE, i);
        continue;
      }
      const bool first = v == first_part;
      const int next = v + step;
      // The next list is loaded ahead only if it is ready already.
      const bool next_ready =
          ready == nullptr || wait_list(ready, first ? -1 : i,
                                        splits == 1 && next < even_blocks ? next : -1, &s_peek);
      const int given = first && guessed ? guess_count : count_ahead;   // loaded already
      const int count = given >= 0 ? min(given, list_len) : min(__ldcg(&counts[i]), list_len);
      const int each = (count + splits - 1) / splits;
      const int from = min(split * each, count), to = min(from + each, count);
      const bool ahead = splits == 1 && next < even_blocks && next_ready;
      trace(PART_READY, i);
      int next_count = 0, next_phys = 0, ahead_phys[STAGED_EACH], ahead_slot[STAGED_EACH];
      if (ahead) {
        const int64_t row = static_cast<int64_t>(next) * list_len;
        next_count = __ldcg(&counts[next]);
        if (warp < list_len) next_phys = lists[row + warp];
        load_entries(lists, slots, row, list_len, ahead_phys, ahead_slot);
      }
      attend(i, from, to, a,
             staged_ahead ||
                 (guessed && first && from == guess_from && to - from == guess_n),
             in_flight);
      trace(PART_STREAMED, i);
      in_flight = false;
      count_ahead = -1;
      staged_ahead = false;
      if (ahead) {   // every copy of this list landed (attend ends synchronised)
        count_ahead = min(next_count, list_len);
        in_flight = warp < count_ahead;
        if (in_flight) {
          const int64_t off = (next % hkv) * head_pages + int64_t{next_phys} * P * D;
          copy_page(ring, kpages + off, vpages + off, lane);
          cp_commit();
        }
      }
      finish(i, a, v, static_cast<int64_t>(i) * splits, splits);
      trace(PART_DONE, i);
      if (ahead && count_ahead <= min(cap, STAGED_EACH * WARPS * 32)) {
        store_entries(count_ahead, ahead_phys, ahead_slot, s_phys, s_slot);
        __syncthreads();
        staged_ahead = true;
      }
    }
    trace(ATTEND_END, -1);
    return;
  }
  const int lo = blockIdx.x * chunk, hi = min(lo + chunk, total);
  int i = 0;
  for (int top = n_lists; i < top;) {    // the first list ending after lo
    const int mid = (i + top) / 2;
    if (s_ends[mid] > lo) top = mid; else i = mid + 1;
  }
  for (; i < n_lists && lo < hi; ++i) {
    const int end = s_ends[i], first = (i > 0 ? s_ends[i - 1] : 0) + LIST_UNITS;  // its pages
    if (first >= hi) break;
    trace(PART_READY, i);
    attend(i, max(lo, first) - first, min(min(hi, end) - first, min(counts[i], list_len)), a,
           false, false);
    trace(PART_STREAMED, i);
    const int p_first = first / chunk, p_last = (end - 1) / chunk;
    finish(i, a, static_cast<int64_t>(blockIdx.x) + i, static_cast<int64_t>(p_first) + i,
           p_last - p_first + 1);
    trace(PART_DONE, i);
  }
  trace(ATTEND_END, -1);
}

// List i chosen by the block (select_part) and written out as the Pallas selection writes it
// (pallas_kernels/sparse_decode_gpu.py, _select_kernel): [count entries, then the row's last
// page repeated up to kpad] as physical pages and slots, its count, and a zero for the
// attention's arrival counter. Ends synchronised.
__device__ __forceinline__ void write_list(const Choice& c, int i, int hkv, int length,
                                           int kpad, uint8_t* scratch, int* phys, int* slots,
                                           int* counts, int* arrivals) {
  const int b = i / hkv;
  int* phys_row = phys + static_cast<int64_t>(i) * 2 * kpad;
  int* slot_row = slots + static_cast<int64_t>(i) * 2 * kpad;
  const int count = select_part(c, i, hkv, length, 0, 1, scratch, phys_row, slot_row).y;
  const int last = max(min((length + c.page_size - 1) / c.page_size, c.width) - 1, 0);
  const int last_phys = c.table[static_cast<int64_t>(b) * c.width + last];
  for (int j = count + threadIdx.x; j < kpad; j += THREADS) {
    phys_row[j] = last_phys;
    slot_row[j] = last;
  }
  if (threadIdx.x == 0) counts[i] = count, arrivals[i] = 0;
  __syncthreads();
}

// The lists alone, one block a list (the third handler). Two blocks an SM, so that 17-32
// rows' lists (136-256) choose in one wave.
__global__ void __launch_bounds__(THREADS, 2)
    select_kernel(Choice c, const int* __restrict__ lengths, int hkv, int kpad, int* phys,
                  int* slots, int* counts, int* arrivals) {
  extern __shared__ __align__(16) uint8_t scratch[];
  // An attention launched after it with programmatic dependent launch (the fourth handler)
  // may start its blocks now; they wait for this grid's writes before reading them.
  asm volatile("griddepcontrol.launch_dependents;");
  const int i = blockIdx.x;
  trace(SELECT_START, i);
  write_list(c, i, hkv, lengths[i / hkv], kpad, scratch, phys, slots, counts, arrivals);
  trace(SELECT_DONE, i);
}

// select_kernel's shared memory: the row's keys and pages, the histograms and sums.
__host__ __device__ constexpr int choice_bytes(int width) {
  return hist_offset(width) + 4 * (ROUNDS * BINS + 3 * WARPS);
}

// ---- The scoring and the selection in one kernel (the fifth handler) ----

// The scoring's inputs: q [B, Hkv * group, D] and the page centroids [Hkv, N, D], bf16.
struct Scoring {
  const __nv_bfloat16* q;
  const __nv_bfloat16* centroids;
  int64_t n_pages;
  int group, parts;   // parts: blocks a list, SCORE_SLOTS slots each
};

// A block scores SCORE_SLOTS slots of a list, a half-warp a slot (8 of the 128 columns a
// lane), SCORE_RUN slots a half-warp in flight.
constexpr int SCORE_SLOTS = 512, SCORE_RUN = 8;

// float32 -> int32 whose signed order is the scores' (sparrow_jax/attention/selection.py,
// order_key): -0.0 as 0.0, negative scores' magnitude bits flipped.
__device__ __forceinline__ int order_key(float x) {
  const int bits = __float_as_int(x == 0.f ? 0.f : x);
  return bits < 0 ? bits ^ 0x7fffffff : bits;
}

__device__ __forceinline__ void add_bf16x8(uint4 u, float (&acc)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    acc[2 * j] += f.x;
    acc[2 * j + 1] += f.y;
  }
}

// Slots [lo, hi) of list (b, h) scored into key_row (the keys of _score_kernel: the
// centroid's product with the mean of the group's queries, float32, then order_key; INT_MIN
// where a slot may not be chosen: slot 0, the row's last two pages and past them).
__device__ __forceinline__ void score_slots(const Scoring& sc, const Choice& c, int b, int h,
                                            int hkv, int n, int lo, int hi, int* key_row) {
  const int elo = max(lo, 1), ehi = min(hi, n - 2);
  for (int s = lo + threadIdx.x; s < hi; s += THREADS) {
    if (s < elo || s >= ehi) key_row[s] = INT_MIN;
  }
  if (elo >= ehi) return;
  const int warp = threadIdx.x >> 5, half = (threadIdx.x >> 4) & 1, col = (threadIdx.x & 15) * 8;
  // The group's queries summed, then divided by the group, as _score_kernel takes their mean.
  float qbar[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const __nv_bfloat16* qrow = sc.q + (static_cast<int64_t>(b) * hkv + h) * sc.group * D + col;
  for (int r = 0; r < sc.group; ++r) {
    add_bf16x8(*reinterpret_cast<const uint4*>(qrow + r * D), qbar);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) qbar[j] /= static_cast<float>(sc.group);
  const int* table_row = c.table + static_cast<int64_t>(b) * c.width;
  const __nv_bfloat16* cbase = sc.centroids + static_cast<int64_t>(h) * sc.n_pages * D + col;
  // Warp w takes slots elo + 2 w + half + 16 j: the loop's bounds are the warp's, so its
  // shuffles see every lane.
  for (int s0 = elo + 2 * warp; s0 < ehi; s0 += 2 * WARPS * SCORE_RUN) {
    int page[SCORE_RUN];
#pragma unroll
    for (int r = 0; r < SCORE_RUN; ++r) {
      const int s = s0 + half + 2 * WARPS * r;
      page[r] = s < ehi ? table_row[s] : -1;
    }
    uint4 u[SCORE_RUN];
#pragma unroll
    for (int r = 0; r < SCORE_RUN; ++r) {
      u[r] = page[r] >= 0 ? __ldg(reinterpret_cast<const uint4*>(cbase + int64_t{page[r]} * D))
                          : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int r = 0; r < SCORE_RUN; ++r) {
      float prod[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      add_bf16x8(u[r], prod);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) sum += prod[j] * qbar[j];
#pragma unroll
      for (int d = 8; d >= 1; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
      if ((threadIdx.x & 15) == 0 && page[r] >= 0) {
        key_row[s0 + half + 2 * WARPS * r] = order_key(sum);
      }
    }
  }
}

// Grid: `parts` blocks a list, list-major. Each block scores its slots of list i; the last of
// the list's blocks to arrive (tickets[i], zero on entry) chooses the list from
// all its keys and writes it (write_list), then marks it ready (ready[i] = 1, zero on entry),
// so that an attention launched after it may start on the list while other lists are still
// scored. The lists complete in about list order, and each choice runs beside later lists'
// scoring instead of after all of it.
__global__ void __launch_bounds__(THREADS, 4)
    score_select_kernel(Scoring sc, Choice c, const int* __restrict__ lengths, int hkv,
                        int kpad, int* keys, int* phys, int* slots, int* counts,
                        int* arrivals, int* tickets, int* ready) {
  extern __shared__ __align__(16) uint8_t scratch[];
  __shared__ int s_last;
  asm volatile("griddepcontrol.launch_dependents;");
  const int i = blockIdx.x / sc.parts, part = blockIdx.x % sc.parts;
  const int b = i / hkv, h = i % hkv;
  const int length = lengths[b];
  const int n = min((length + c.page_size - 1) / c.page_size, c.width);
  const int lo = part * SCORE_SLOTS, hi = min(lo + SCORE_SLOTS, c.width);
  trace(SCORE_START, i);
  score_slots(sc, c, b, h, hkv, n, lo, hi,
              keys + (static_cast<int64_t>(h) * c.batch + b) * c.width);
  // The arrival as in cooperative groups' grid barrier: the block's keys, then one fence and
  // the ticket by one thread; the last block fences again before it reads the others' keys.
  __syncthreads();
  trace(SCORE_DONE, i);
  if (threadIdx.x == 0) {
    __threadfence();
    s_last = atomicAdd(&tickets[i], 1) == sc.parts - 1;
    if (s_last) __threadfence();
  }
  __syncthreads();
  if (!s_last) return;
  write_list(c, i, hkv, length, kpad, scratch, phys, slots, counts, arrivals);
  if (threadIdx.x == 0) {
    __threadfence();
    asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(ready + i), "r"(1) : "memory");
  }
  trace(LIST_CHOSEN, i);
}

ffi::Error Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

// The kernel's instantiations: [kCluster][kSelect].
using Kernel = decltype(&attend_kernel<false, false>);
constexpr Kernel kKernels[2][2] = {{attend_kernel<false, false>, attend_kernel<false, true>},
                                   {attend_kernel<true, false>, attend_kernel<true, true>}};

// Past 48 KB a kernel gets dynamic shared memory only when it asks: once on each device, all
// that the device allows beside the kernel's static shared memory.
ffi::ErrorOr<int> RaiseSharedLimit() {
  constexpr int kMaxDevices = 64;
  static std::once_flag once[kMaxDevices];
  static cudaError_t result[kMaxDevices];
  static int dynamic[kMaxDevices];
  int device = 0;
  if (auto e = Check(cudaGetDevice(&device), "cudaGetDevice"); e.failure()) return e;
  if (device >= kMaxDevices) return ffi::Error::Internal("sparrow_sparse_attend: device id");
  std::call_once(once[device], [device] {
    int limit = 0;
    cudaFuncAttributes attributes;
    result[device] = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                            device);
    if (result[device] == cudaSuccess) {
      result[device] = cudaFuncGetAttributes(&attributes, kKernels[0][0]);
    }
    if (result[device] != cudaSuccess) return;
    dynamic[device] = limit - static_cast<int>(attributes.sharedSizeBytes);
    for (const auto& by_select : kKernels) {
      for (Kernel kernel : by_select) {
        if (result[device] == cudaSuccess) {
          result[device] = cudaFuncSetAttribute(
              kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic[device]);
        }
      }
    }
  });
  if (auto e = Check(result[device], "raising the attention's shared memory limit");
      e.failure()) {
    return e;
  }
  return dynamic[device];
}

// Both handlers' checks of q and the pages (bf16, [B, Hkv * G, 128] and [Hkv, N, 16, 128]).
bool PagesFit(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, int64_t batch) {
  auto qd = q.dimensions(), kd = k.dimensions();
  return q.element_type() == ffi::BF16 && k.element_type() == ffi::BF16 &&
         v.element_type() == ffi::BF16 && qd.size() == 3 && kd.size() == 4 && qd[2] == D &&
         kd[2] == P && kd[3] == D && qd[0] == batch && qd[1] % kd[0] == 0 &&
         qd[1] / kd[0] <= MAX_GROUP;
}

// One launch of the kernel on `programs` blocks (clusters of `cluster`, 1: none), each
// staging up to `longest` entries at a time, or what the shared memory holds. A `choice` with
// keys launches the instantiation whose blocks choose their lists (then all `longest` must fit).
ffi::Error Launch(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  const int* lists, const int* slots, const int* counts, const int* lengths,
                  void* out, float* part_o, float* part_lse, int* arrivals, int64_t lists_n,
                  int list_len, int64_t splits, int64_t programs, int64_t balance,
                  int64_t cluster, int64_t longest, Choice choice, bool pdl = false,
                  const int* ready = nullptr) {
  ffi::ErrorOr<int> limit = RaiseSharedLimit();
  if (limit.has_error()) return limit.error();
  const int64_t room = (*limit - RING_BYTES - MERGE_BYTES - 4 * lists_n) / 8;
  const int64_t cap = std::min(longest, room);
  if (room < WARPS || (choice.keys != nullptr && room < longest)) {
    return ffi::Error::InvalidArgument(
        "sparrow_sparse_attend: " + std::to_string(lists_n) + " lists leave too little shared "
        "memory to stage their entries");
  }
  // One row's clusters (kCluster) and programmatic dependent launch need launch attributes;
  // without either this is a plain launch.
  cudaLaunchAttribute attributes[2];
  int n_attributes = 0;
  if (cluster > 1) {
    attributes[n_attributes].id = cudaLaunchAttributeClusterDimension;
    attributes[n_attributes].val.clusterDim.x = static_cast<unsigned>(cluster);
    attributes[n_attributes].val.clusterDim.y = attributes[n_attributes].val.clusterDim.z = 1;
    ++n_attributes;
  }
  if (pdl) {
    attributes[n_attributes].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[n_attributes].val.programmaticStreamSerializationAllowed = 1;
    ++n_attributes;
  }
  cudaLaunchConfig_t launch = {};
  launch.gridDim = dim3(static_cast<unsigned>(programs));
  launch.blockDim = dim3(WARPS * 32);
  launch.dynamicSmemBytes = RING_BYTES + MERGE_BYTES + 8 * cap + 4 * lists_n;
  launch.stream = stream;
  launch.attrs = attributes;
  launch.numAttrs = n_attributes;
  auto kd = k.dimensions();
  const int hkv = static_cast<int>(kd[0]);
  const int group = static_cast<int>(q.dimensions()[1] / kd[0]);
  const cudaError_t launched = cudaLaunchKernelEx(
      &launch, kKernels[cluster > 1][choice.keys != nullptr],
      reinterpret_cast<const __nv_bfloat16*>(q.untyped_data()),
      reinterpret_cast<const __nv_bfloat16*>(k.untyped_data()),
      reinterpret_cast<const __nv_bfloat16*>(v.untyped_data()), lists, slots, counts, lengths,
      reinterpret_cast<__nv_bfloat16*>(out), part_o, part_lse, arrivals, hkv, group, kd[1],
      list_len, static_cast<int>(lists_n), static_cast<int>(splits),
      static_cast<int>(balance), static_cast<int>(cap),
      1.4426950408889634f / sqrtf(static_cast<float>(D)), choice, ready);
  return Check(launched, "sparrow_sparse_attend launch");
}

// The parts buffers hold max(programs + lists, lists * splits) parts (attend_kernel).
ffi::Error Attend(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  ffi::Buffer<ffi::S32> phys, ffi::Buffer<ffi::S32> slots,
                  ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> lengths,
                  ffi::Buffer<ffi::S32> /*arrivals, aliased to the second result*/,
                  ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::S32>> arrivals,
                  ffi::Result<ffi::Buffer<ffi::F32>> part_o,
                  ffi::Result<ffi::Buffer<ffi::F32>> part_lse, int64_t splits, int64_t programs,
                  int64_t balance, int64_t cluster) {
  auto kd = k.dimensions(), ld = phys.dimensions();
  if (ld.size() != 3 || !PagesFit(q, k, v, ld[0]) || kd[0] != ld[1] || splits < 1 ||
      splits > MAX_PARTS || programs < 1 || programs > MAX_PARTS || balance < -1 ||
      balance > 1 ||
      (cluster != 1 && (cluster > MAX_CLUSTER || cluster != splits || balance != 0 ||
                        programs != ld[0] * ld[1] * splits))) {
    return ffi::Error::InvalidArgument("sparrow_sparse_attend: unsupported arguments");
  }
  const int list_len = static_cast<int>(ld[2]);
  const int64_t lists = ld[0] * ld[1];
  if (lists == 0) return ffi::Error::Success();
  // Entries staged at once: the most a block's part of a list can hold, or what fits.
  const int64_t longest = std::max<int64_t>(
      (lists * std::max(list_len, 1) + programs - 1) / programs, (list_len + splits - 1) / splits);
  return Launch(stream, q, k, v, phys.typed_data(), slots.typed_data(), counts.typed_data(),
                lengths.typed_data(), out->untyped_data(), part_o->typed_data(),
                part_lse->typed_data(), arrivals->typed_data(), lists, list_len, splits,
                programs, balance, cluster, longest, Choice{});
}

// The second handler: the lists chosen inside the attention from the scoring's keys
// [Hkv, B, width] (select_part), each list in `splits` even parts, one block a part: one
// part (splits 1), or a cluster of 2-8 that merge through their shared memory.
ffi::Error SelectAttend(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::Buffer<ffi::S32> keys,
                        ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
                        ffi::Buffer<ffi::S32> budgets, ffi::Result<ffi::AnyBuffer> out,
                        int64_t splits, int64_t page_size, int64_t max_pages) {
  auto kd = k.dimensions(), keyd = keys.dimensions(), td = table.dimensions();
  if (keyd.size() != 3 || td.size() != 2 || !PagesFit(q, k, v, keyd[1]) || kd[0] != keyd[0] ||
      td[0] != keyd[1] || td[1] != keyd[2] || keyd[2] < 1 || keyd[2] > MAX_CHOICE_WIDTH ||
      lengths.dimensions()[0] != keyd[1] || budgets.dimensions()[0] != keyd[1] ||
      page_size != P || max_pages < 1 || splits < 1 || splits > MAX_CLUSTER ||
      keyd[0] * keyd[1] * splits > MAX_PARTS) {
    return ffi::Error::InvalidArgument("sparrow_sparse_select_attend: unsupported arguments");
  }
  const int64_t lists = keyd[0] * keyd[1];
  if (lists == 0) return ffi::Error::Success();
  const Choice choice{keys.typed_data(), table.typed_data(), budgets.typed_data(),
                      static_cast<int>(keyd[1]), static_cast<int>(keyd[2]),
                      static_cast<int>(page_size), static_cast<int>(max_pages)};
  return Launch(stream, q, k, v, nullptr, nullptr, nullptr, lengths.typed_data(),
                out->untyped_data(), nullptr, nullptr, nullptr, lists,
                static_cast<int>(max_pages), splits, lists * splits, 0, splits,
                (max_pages + splits - 1) / splits, choice);
}

// Whether keys [Hkv, B, width], table [B, width], lengths and budgets [B] and lists [B, Hkv,
// 2 kpad] are what select_part takes.
bool ChoiceFits(ffi::Span<const int64_t> keyd, ffi::Span<const int64_t> td,
                ffi::Span<const int64_t> pd, ffi::Buffer<ffi::S32> lengths,
                ffi::Buffer<ffi::S32> budgets, int64_t page_size, int64_t max_pages) {
  return keyd.size() == 3 && td.size() == 2 && pd.size() == 3 && td[0] == keyd[1] &&
         td[1] == keyd[2] && keyd[2] >= 1 && keyd[2] <= MAX_CHOICE_WIDTH &&
         lengths.dimensions()[0] == keyd[1] && budgets.dimensions()[0] == keyd[1] &&
         pd[0] == keyd[1] && pd[1] == keyd[0] && pd[2] % 2 == 0 && page_size >= 1 &&
         max_pages >= RESERVED && max_pages <= pd[2] / 2;
}

// A kernel that chooses lists (select_part) may take the widest table's shared memory: set
// once on each device.
template <auto kKernel>
ffi::Error RaiseChoiceLimit() {
  constexpr int kMaxDevices = 64;
  static std::once_flag once[kMaxDevices];
  static cudaError_t result[kMaxDevices];
  int device = 0;
  if (auto e = Check(cudaGetDevice(&device), "cudaGetDevice"); e.failure()) return e;
  if (device >= kMaxDevices) return ffi::Error::Internal("sparrow_sparse_select: device id");
  std::call_once(once[device], [device] {
    result[device] = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          choice_bytes(MAX_CHOICE_WIDTH));
  });
  return Check(result[device], "raising the selection's shared memory limit");
}

// The third handler's launch: keys [Hkv, B, width], table [B, width], lengths and budgets
// [B] -> phys and slots [B, Hkv, 2 kpad], counts and zeros [B, Hkv, 1] (select_kernel).
ffi::Error LaunchSelect(cudaStream_t stream, ffi::Buffer<ffi::S32> keys,
                        ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
                        ffi::Buffer<ffi::S32> budgets, ffi::Buffer<ffi::S32> phys,
                        ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> counts,
                        ffi::Buffer<ffi::S32> arrivals, int64_t page_size, int64_t max_pages,
                        const char* name) {
  auto keyd = keys.dimensions(), pd = phys.dimensions();
  if (!ChoiceFits(keyd, table.dimensions(), pd, lengths, budgets, page_size, max_pages)) {
    return ffi::Error::InvalidArgument(std::string(name) + ": unsupported arguments");
  }
  const int64_t lists = keyd[0] * keyd[1];
  if (lists == 0) return ffi::Error::Success();
  if (auto e = RaiseChoiceLimit<select_kernel>(); e.failure()) return e;
  const Choice choice{keys.typed_data(), table.typed_data(), budgets.typed_data(),
                      static_cast<int>(keyd[1]), static_cast<int>(keyd[2]),
                      static_cast<int>(page_size), static_cast<int>(max_pages)};
  select_kernel<<<static_cast<unsigned>(lists), THREADS, choice_bytes(keyd[2]), stream>>>(
      choice, lengths.typed_data(), static_cast<int>(keyd[0]), static_cast<int>(pd[2] / 2),
      phys.typed_data(), slots.typed_data(), counts.typed_data(), arrivals.typed_data());
  return Check(cudaGetLastError(), "sparrow_sparse_select_lists launch");
}

ffi::Error SelectLists(cudaStream_t stream, ffi::Buffer<ffi::S32> keys,
                       ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
                       ffi::Buffer<ffi::S32> budgets, ffi::Result<ffi::Buffer<ffi::S32>> phys,
                       ffi::Result<ffi::Buffer<ffi::S32>> slots,
                       ffi::Result<ffi::Buffer<ffi::S32>> counts,
                       ffi::Result<ffi::Buffer<ffi::S32>> arrivals, int64_t page_size,
                       int64_t max_pages) {
  return LaunchSelect(stream, keys, table, lengths, budgets, *phys, *slots, *counts, *arrivals,
                      page_size, max_pages, "sparrow_sparse_select_lists");
}

// The attention's settings over lists [B, Hkv, 2 kpad] just chosen in the same call.
bool ChosenFit(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Span<const int64_t> ld,
               int64_t splits, int64_t programs, int64_t balance) {
  return ld.size() == 3 && PagesFit(q, k, v, ld[0]) && k.dimensions()[0] == ld[1] &&
         splits >= 1 && splits <= MAX_PARTS && programs >= 1 && programs <= MAX_PARTS &&
         balance >= -1 && balance <= 1;
}

// The first handler's attention over the lists chosen just before it in the same call (the
// fourth and fifth handlers), launched by programmatic dependent launch so that its blocks
// start while the lists are being chosen: each block waits for them all, or with `ready`
// for each of its lists alone.
ffi::Error AttendChosen(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Buffer<ffi::S32> phys,
                        ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> counts,
                        ffi::Buffer<ffi::S32> arrivals, ffi::Buffer<ffi::F32> part_o,
                        ffi::Buffer<ffi::F32> part_lse, int64_t splits, int64_t programs,
                        int64_t balance, const int* ready) {
  // As the first handler takes the third's lists: rows of 2 kpad entries, counts <= kpad.
  auto ld = phys.dimensions();
  const int list_len = static_cast<int>(ld[2]);
  const int64_t lists = ld[0] * ld[1];
  if (lists == 0) return ffi::Error::Success();
  const int64_t longest = std::max<int64_t>(
      (lists * std::max(list_len, 1) + programs - 1) / programs, (list_len + splits - 1) / splits);
  return Launch(stream, q, k, v, phys.typed_data(), slots.typed_data(), counts.typed_data(),
                lengths.typed_data(), out->untyped_data(), part_o.typed_data(),
                part_lse.typed_data(), arrivals.typed_data(), lists, list_len, splits, programs,
                balance, 1, longest, Choice{}, /*pdl=*/true, ready);
}

// The fourth handler: the third's lists, then the attention over them in one custom call (one
// node of XLA's command buffer, not two; AttendChosen). Its results are the attention's and
// the lists it attended (phys, slots, counts, arrivals as the third handler's).
ffi::Error SelectListsAttend(
    cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::Buffer<ffi::S32> keys, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
    ffi::Buffer<ffi::S32> budgets, ffi::Result<ffi::AnyBuffer> out,
    ffi::Result<ffi::Buffer<ffi::S32>> phys, ffi::Result<ffi::Buffer<ffi::S32>> slots,
    ffi::Result<ffi::Buffer<ffi::S32>> counts, ffi::Result<ffi::Buffer<ffi::S32>> arrivals,
    ffi::Result<ffi::Buffer<ffi::F32>> part_o, ffi::Result<ffi::Buffer<ffi::F32>> part_lse,
    int64_t splits, int64_t programs, int64_t balance, int64_t page_size, int64_t max_pages) {
  const char* name = "sparrow_sparse_select_lists_attend";
  if (!ChosenFit(q, k, v, phys->dimensions(), splits, programs, balance)) {
    return ffi::Error::InvalidArgument(std::string(name) + ": unsupported arguments");
  }
  if (auto e = LaunchSelect(stream, keys, table, lengths, budgets, *phys, *slots, *counts,
                            *arrivals, page_size, max_pages, name);
      e.failure()) {
    return e;
  }
  return AttendChosen(stream, q, k, v, lengths, out, *phys, *slots, *counts, *arrivals,
                      *part_o, *part_lse, splits, programs, balance, nullptr);
}

// The fifth handler: the keys scored and the lists chosen by one kernel (score_select_kernel:
// centroids [Hkv, N, 128] bf16, table [B, width], lengths and budgets [B] -> keys [Hkv, B,
// width], and the lists as the third handler's), then the attention over them (AttendChosen);
// `overlap` 1 (even splits only): each of its blocks starts on a list as soon as that list is
// chosen. `sync` [2, lists]: the lists' tickets and ready marks, zeroed here.
ffi::Error ScoreSelectAttend(
    cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::AnyBuffer centroids, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
    ffi::Buffer<ffi::S32> budgets, ffi::Result<ffi::AnyBuffer> out,
    ffi::Result<ffi::Buffer<ffi::S32>> keys, ffi::Result<ffi::Buffer<ffi::S32>> sync,
    ffi::Result<ffi::Buffer<ffi::S32>> phys, ffi::Result<ffi::Buffer<ffi::S32>> slots,
    ffi::Result<ffi::Buffer<ffi::S32>> counts, ffi::Result<ffi::Buffer<ffi::S32>> arrivals,
    ffi::Result<ffi::Buffer<ffi::F32>> part_o, ffi::Result<ffi::Buffer<ffi::F32>> part_lse,
    int64_t splits, int64_t programs, int64_t balance, int64_t page_size, int64_t max_pages,
    int64_t overlap) {
  const char* name = "sparrow_sparse_score_select_attend";
  auto keyd = keys->dimensions(), kd = k.dimensions(), cd = centroids.dimensions();
  const int64_t lists = keyd.size() == 3 ? keyd[0] * keyd[1] : 0;
  if (!ChosenFit(q, k, v, phys->dimensions(), splits, programs, balance) ||
      !ChoiceFits(keyd, table.dimensions(), phys->dimensions(), lengths, budgets, page_size,
                  max_pages) ||
      centroids.element_type() != ffi::BF16 || cd.size() != 3 || cd[0] != kd[0] ||
      cd[1] != kd[1] || cd[2] != D || sync->element_count() != 2 * lists ||
      (overlap != 0 && (overlap != 1 || balance != 0))) {
    return ffi::Error::InvalidArgument(std::string(name) + ": unsupported arguments");
  }
  if (lists == 0) return ffi::Error::Success();
  if (auto e = RaiseChoiceLimit<score_select_kernel>(); e.failure()) return e;
  int* tickets = sync->typed_data();
  if (auto e = Check(cudaMemsetAsync(tickets, 0, 2 * lists * sizeof(int), stream),
                     "zeroing the lists' tickets");
      e.failure()) {
    return e;
  }
  const int width = static_cast<int>(keyd[2]), parts = (width + SCORE_SLOTS - 1) / SCORE_SLOTS;
  const Scoring scoring{reinterpret_cast<const __nv_bfloat16*>(q.untyped_data()),
                        reinterpret_cast<const __nv_bfloat16*>(centroids.untyped_data()), cd[1],
                        static_cast<int>(q.dimensions()[1] / kd[0]), parts};
  const Choice choice{keys->typed_data(), table.typed_data(), budgets.typed_data(),
                      static_cast<int>(keyd[1]), width, static_cast<int>(page_size),
                      static_cast<int>(max_pages)};
  score_select_kernel<<<static_cast<unsigned>(lists * parts), THREADS, choice_bytes(width),
                        stream>>>(scoring, choice, lengths.typed_data(),
                                  static_cast<int>(keyd[0]),
                                  static_cast<int>(phys->dimensions()[2] / 2),
                                  keys->typed_data(), phys->typed_data(), slots->typed_data(),
                                  counts->typed_data(), arrivals->typed_data(), tickets,
                                  tickets + lists);
  if (auto e = Check(cudaGetLastError(), "sparrow_sparse_score_select launch"); e.failure()) {
    return e;
  }
  return AttendChosen(stream, q, k, v, lengths, out, *phys, *slots, *counts, *arrivals,
                      *part_o, *part_lse, splits, programs, balance,
                      overlap ? tickets + lists : nullptr);
}

// What the attention's handlers take first: the stream, q, the K and V pages, and four
// arrays, int32 but the first (`First`: the fifth handler's centroids).
template <typename First = ffi::Buffer<ffi::S32>>
auto PagesAndFourArrays() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .template Arg<First>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>();
}

// The selection's results after what `binding` holds: phys, slots, counts and zeros.
template <typename Binding>
auto ListResults(Binding binding) {
  return std::move(binding)
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>();
}

// The part buffers and the attributes of an attention over lists chosen in the same call
// (the fourth and fifth handlers), after what `binding` holds.
template <typename Binding>
auto AttendChosenResults(Binding binding) {
  return std::move(binding)
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int64_t>("splits")
      .template Attr<int64_t>("programs")
      .template Attr<int64_t>("balance")
      .template Attr<int64_t>("page_size")
      .template Attr<int64_t>("max_pages");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowSparseAttend, Attend,
                              PagesAndFourArrays()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("programs")
                                  .Attr<int64_t>("balance")
                                  .Attr<int64_t>("cluster"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowSparseSelectAttend, SelectAttend,
                              PagesAndFourArrays()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("page_size")
                                  .Attr<int64_t>("max_pages"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SparrowSparseSelectListsAttend, SelectListsAttend,
    AttendChosenResults(ListResults(PagesAndFourArrays().Ret<ffi::AnyBuffer>())),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowSparseScoreSelectAttend, ScoreSelectAttend,
                              AttendChosenResults(ListResults(PagesAndFourArrays<ffi::AnyBuffer>()
                                                                  .Ret<ffi::AnyBuffer>()
                                                                  .Ret<ffi::Buffer<ffi::S32>>()
                                                                  .Ret<ffi::Buffer<ffi::S32>>()))
                                  .Attr<int64_t>("overlap"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowSparseSelectLists, SelectLists,
                              ListResults(ffi::Ffi::Bind()
                                              .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                              .Arg<ffi::Buffer<ffi::S32>>()
                                              .Arg<ffi::Buffer<ffi::S32>>()
                                              .Arg<ffi::Buffer<ffi::S32>>()
                                              .Arg<ffi::Buffer<ffi::S32>>())
                                  .Attr<int64_t>("page_size")
                                  .Attr<int64_t>("max_pages"),
                              {ffi::Traits::kCmdBufferCompatible});

#ifdef SPARROW_TRACE
// The marks recorded since the last call (at most `capacity` of them, TraceRecord's 32 bytes
// each) copied to `host`, and the buffer emptied: -> how many were recorded, which is more
// than were kept when the buffer or `capacity` ran out; -1 on a CUDA error.
extern "C" long long SparrowTraceRead(void* host, long long capacity) {
  unsigned long long count = 0, zero = 0;
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpyFromSymbol(&count, g_trace_count, sizeof count) != cudaSuccess) {
    return -1;
  }
  const unsigned long long kept =
      std::min<unsigned long long>({count, TRACE_CAPACITY, static_cast<unsigned long long>(
                                                               std::max(capacity, 0ll))});
  if ((kept && cudaMemcpyFromSymbol(host, g_trace, kept * sizeof(TraceRecord)) != cudaSuccess) ||
      cudaMemcpyToSymbol(g_trace_count, &zero, sizeof zero) != cudaSuccess) {
    return -1;
  }
  return static_cast<long long>(count);
}
#endif
