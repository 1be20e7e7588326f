// Probe (session 42): the sparse step's attention in CUDA C, each warp streaming its own pages
// through a ring of shared-memory stages by cp.async while it runs the products of the page
// before on the tensor cores (mma.sync), so that a warp's copies are in flight during its own
// and its neighbours' math. Timed against the Pallas attention by
// 2026-11-29c_cuda_attention.py; not part of the library.
//
// Shapes (the probe's): pages [Hkv, N, 16, 128] bf16, q [B, Hkv * 4, 128] bf16, lists / slots
// [B, Hkv, L] int32, counts [B, Hkv], lengths [B]. Grid: B * Hkv * S blocks, split s of list
// (b, h) taking list entries [s * per, min(count, (s + 1) * per)), per = ceil(count / S); warp
// w of the block the entries w, w + W, ... of its split. Each block merges its warps in shared
// memory; with S > 1 it writes a partial (normalised output, log2-sum-exp) and the last block
// of the list to arrive (a counter it resets) merges the S partials into out [B, Hq, 128] bf16.
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int P = 16, D = 128, G = 4, CHUNKS = D / 8;   // 16-byte chunks a token's row
constexpr int PAGE_BYTES = P * D * 2;

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

// c += a * b for m16n8k16, a's rows 8-15 zero (the group's 4 heads sit in rows 0-3).
__device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// A page's token t, 16-byte chunk c, at chunk c ^ (t & 7) of its row: the 8 rows an ldmatrix
// reads then fall in 8 different bank groups (rows are 256 bytes apart).
__device__ __forceinline__ uint32_t swizzled(int t, int c) {
  return (uint32_t)((t * CHUNKS + (c ^ (t & 7))) * 16);
}

__device__ __forceinline__ void copy_page(uint32_t dst, const __nv_bfloat16* k,
                                          const __nv_bfloat16* v, int lane) {
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    int j = lane + 32 * u, t = j >> 4, c = j & 15;
    cp_async16(dst + swizzled(t, c), k + t * D + c * 8);
    cp_async16(dst + PAGE_BYTES + swizzled(t, c), v + t * D + c * 8);
  }
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <int W, int STAGES, bool MATH>
__device__ __forceinline__ void attend(const __nv_bfloat16* __restrict__ q,
                                       const __nv_bfloat16* __restrict__ kpages,
                                       const __nv_bfloat16* __restrict__ vpages,
                                       const int* __restrict__ lists,
                                       const int* __restrict__ slots,
                                       const int* __restrict__ counts,
                                       const int* __restrict__ lengths, __nv_bfloat16* out,
                                       float* part_o, float* part_lse, int* arrivals, int hkv,
                                       int n_pages, int list_len, int splits, float scale_log2) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ int s_phys[256], s_slot[256];
  __shared__ int s_last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int split = blockIdx.x % splits, lh = blockIdx.x / splits;
  const int h = lh % hkv, b = lh / hkv;
  const int count = counts[lh], length = lengths[b];
  const int per = (count + splits - 1) / splits;
  const int start = min(split * per, count), stop = min(start + per, count);
  const int mine = max(0, (stop - start - warp + W - 1) / W);

  for (int i = threadIdx.x; i < stop - start; i += W * 32) {
    s_phys[i] = lists[(size_t)lh * list_len + start + i];
    s_slot[i] = slots[(size_t)lh * list_len + start + i];
  }
  __syncthreads();

  const __nv_bfloat16* kbase = kpages + (size_t)h * n_pages * P * D;
  const __nv_bfloat16* vbase = vpages + (size_t)h * n_pages * P * D;
  const uint32_t ring = (uint32_t)__cvta_generic_to_shared(smem) + warp * STAGES * 2 * PAGE_BYTES;
  auto issue = [&](int i) {
    size_t off = (size_t)s_phys[warp + W * i] * P * D;
    copy_page(ring + (i % STAGES) * 2 * PAGE_BYTES, kbase + off, vbase + off, lane);
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < mine) issue(i);
    cp_commit();
  }

  // The group's query rows as A fragments (row g < 4 real, k = 16 kk + 2 tig + {0, 1, 8, 9}).
  uint32_t qa[8][2];
  const __nv_bfloat16* qrow = q + ((size_t)b * hkv * G + h * G + min(g, G - 1)) * D + 2 * tig;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    qa[kk][0] = g < G ? *reinterpret_cast<const uint32_t*>(qrow + 16 * kk) : 0u;
    qa[kk][1] = g < G ? *reinterpret_cast<const uint32_t*>(qrow + 16 * kk + 8) : 0u;
  }
  float o[16][4];
#pragma unroll
  for (int j = 0; j < 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m = -INFINITY, l = 0.f;

  for (int i = 0; i < mine; ++i) {
    cp_wait<STAGES - 2>();
    __syncwarp();
    if (i + STAGES - 1 < mine) issue(i + STAGES - 1);
    cp_commit();
    const uint32_t kb = ring + (i % STAGES) * 2 * PAGE_BYTES, vb = kb + PAGE_BYTES;
    if (!MATH) {
      // Loads only: each lane adds up the chunks it copied (as the Pallas probe's loads_only).
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        int j = lane + 32 * u, t = j >> 4, c = j & 15;
        uint4 x, y;
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "r"(kb + swizzled(t, c)));
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(y.x), "=r"(y.y), "=r"(y.z), "=r"(y.w) : "r"(vb + swizzled(t, c)));
        const __nv_bfloat162* px = reinterpret_cast<const __nv_bfloat162*>(&x);
        const __nv_bfloat162* py = reinterpret_cast<const __nv_bfloat162*>(&y);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float2 a = __bfloat1622float2(px[e]), c2 = __bfloat1622float2(py[e]);
          o[e][0] += a.x + c2.x;
          o[e][1] += a.y + c2.y;
        }
      }
      continue;
    }
    // Scores: S[head g][token 8 nt + 2 tig + e] in sc[nt][e].
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      int t = ((lane >> 4) << 3) + (lane & 7), c = 2 * kk + ((lane >> 3) & 1);
      uint32_t b0, b1, b2, b3;
      ldsm_x4(kb + swizzled(t, c), b0, b1, b2, b3);
      mma(sc[0], qa[kk][0], qa[kk][1], b0, b1);
      mma(sc[1], qa[kk][0], qa[kk][1], b2, b3);
    }
    const int pos = s_slot[warp + W * i] * P + 2 * tig;
    float x[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int tok = pos + (e >> 1) * 8 + (e & 1);
      x[e] = tok < length ? sc[e >> 1][e & 1] * scale_log2 : -INFINITY;
    }
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);
    const float base = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(m - base);
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) p[e] = exp2f(x[e] - base);
    l = l * alpha + (p[0] + p[1]) + (p[2] + p[3]);
    m = m_new;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      o[j][0] *= alpha;
      o[j][1] *= alpha;
    }
    // P as the A fragment of P V (k = token): tokens 2 tig + {0, 1} and 8 + 2 tig + {0, 1}.
    const uint32_t pa0 = pack_bf16(p[0], p[1]), pa2 = pack_bf16(p[2], p[3]);
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      int t = (((lane >> 3) & 1) << 3) + (lane & 7), c = 2 * jj + (lane >> 4);
      uint32_t b0, b1, b2, b3;
      ldsm_x4_t(vb + swizzled(t, c), b0, b1, b2, b3);
      mma(o[2 * jj], pa0, pa2, b0, b1);
      mma(o[2 * jj + 1], pa0, pa2, b2, b3);
    }
  }
  cp_wait<0>();
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (!MATH) m = 0.f, l = 1.f;
  __syncthreads();

  // The block's warps merged through shared memory (the ring, now idle).
  float* s_o = reinterpret_cast<float*>(smem);          // [W][G][D]
  float* s_m = s_o + W * G * D;                          // [W][G]
  float* s_l = s_m + W * G;
  if (g < G) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      s_o[(warp * G + g) * D + 8 * j + 2 * tig] = o[j][0];
      s_o[(warp * G + g) * D + 8 * j + 2 * tig + 1] = o[j][1];
    }
    if (tig == 0) s_m[warp * G + g] = m, s_l[warp * G + g] = l;
  }
  __syncthreads();
  const size_t part = (size_t)lh * splits + split;
  for (int idx = threadIdx.x; idx < G * D; idx += W * 32) {
    const int hh = idx / D;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; ++w) mm = fmaxf(mm, s_m[w * G + hh]);
    float acc = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      float f = s_m[w * G + hh] == -INFINITY ? 0.f : exp2f(s_m[w * G + hh] - mm);
      acc += f * s_o[w * G * D + idx];
      den += f * s_l[w * G + hh];
    }
    const float val = den > 0.f ? acc / den : 0.f;
    if (splits == 1) {
      out[((size_t)b * hkv * G + h * G) * D + idx] = __float2bfloat16(val);
    } else {
      part_o[part * G * D + idx] = val;
      if (idx % D == 0) part_lse[part * G + hh] = den > 0.f ? mm + log2f(den) : -INFINITY;
    }
  }
  if (splits == 1) return;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(&arrivals[lh], 1) == splits - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const size_t first = (size_t)lh * splits;
  for (int idx = threadIdx.x; idx < G * D; idx += W * 32) {
    const int hh = idx / D;
    float mm = -INFINITY;
    for (int s = 0; s < splits; ++s) mm = fmaxf(mm, __ldcg(&part_lse[(first + s) * G + hh]));
    float acc = 0.f, den = 0.f;
    for (int s = 0; s < splits; ++s) {
      float lse = __ldcg(&part_lse[(first + s) * G + hh]);
      float f = lse == -INFINITY ? 0.f : exp2f(lse - mm);
      acc += f * __ldcg(&part_o[(first + s) * G * D + idx]);
      den += f;
    }
    out[((size_t)b * hkv * G + h * G) * D + idx] = __float2bfloat16(den > 0.f ? acc / den : 0.f);
  }
  if (threadIdx.x == 0) arrivals[lh] = 0;
}

}  // namespace

#define ATTEND(name, W, STAGES, MATH)                                                          \
  extern "C" __global__ void __launch_bounds__(W * 32)                                         \
      name(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,            \
           const int* lists, const int* slots, const int* counts, const int* lengths,          \
           __nv_bfloat16* out, float* part_o, float* part_lse, int* arrivals, int hkv,         \
           int n_pages, int list_len, int splits, float scale_log2) {                          \
    attend<W, STAGES, MATH>(q, k, v, lists, slots, counts, lengths, out, part_o, part_lse,     \
                            arrivals, hkv, n_pages, list_len, splits, scale_log2);             \
  }

ATTEND(attend_w4_s2, 4, 2, true)
ATTEND(attend_w4_s3, 4, 3, true)
ATTEND(attend_w4_s4, 4, 4, true)
ATTEND(attend_w8_s2, 8, 2, true)
ATTEND(attend_w8_s3, 8, 3, true)
ATTEND(attend_w2_s4, 2, 4, true)
ATTEND(loads_w4_s3, 4, 3, false)
ATTEND(loads_w4_s4, 4, 4, false)
ATTEND(loads_w8_s3, 8, 3, false)
