// fagen: tensor-core primitives shared by the mma.sync templates (templates/tensor_core.cuh).
// mma.sync m16n8k16 with fp32 accumulators, ldmatrix fragment loads and cp.async copies, for
// fp16 and bf16 (sm_80 and later). Fragment layouts follow the PTX ISA: lane = 4 * group + quad;
// an accumulator tile holds rows group and group + 8, columns 2 * quad and 2 * quad + 1.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace fagen {
namespace tc {

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, register i receives it.
// Addresses are 32-bit shared-window offsets: a lane's base plus a compile-time offset folds into
// the instruction's immediate, where 64-bit generic pointers would each hold two registers.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}
// The same, each matrix transposed on the way: a row-major [k][n] tile becomes a "col" B operand.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// The lane's index read afresh (asm volatile: not merged with earlier reads), for addresses that a phase
// of a kernel at the register limit re-derives where it needs them instead of holding them through a loop.
__device__ __forceinline__ int fresh_lane() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
  return lane;
}

// Lane offsets (in elements, rows of `pitch`) of the x4 loads that make each operand:
//   A (16x16 of a row-major [m][k] tile):               rows lane % 16, columns 8 (lane / 16)
//   B pair (two 16x8 "col" tiles of a row-major [n][k]): rows 8 (lane / 16) + lane % 8, columns 8 ((lane / 8) % 2)
//   B pair, transposed (of a row-major [k][n] tile):    rows lane % 8 + 8 ((lane / 8) % 2), columns 8 (lane / 16)
//   A, transposed (of a row-major [k][m] tile):          the same offsets as the B pair
__device__ __forceinline__ int a_lane_offset(int lane, int pitch) { return (lane % 16) * pitch + (lane / 16) * 8; }
__device__ __forceinline__ int b_pair_lane_offset(int lane, int pitch) { return ((lane / 16) * 8 + lane % 8) * pitch + ((lane / 8) % 2) * 8; }
__device__ __forceinline__ int b_pair_trans_lane_offset(int lane, int pitch) { return (lane % 8 + ((lane / 8) % 2) * 8) * pitch + (lane / 16) * 8; }

// D = A (16x16, row) * B (16x8, col) + D with fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma_16x8x16<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16x8x16<__half>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded into one 32-bit register of the element type (low half first).
template <typename T> __device__ __forceinline__ unsigned pack_pair(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack_pair<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
template <> __device__ __forceinline__ unsigned pack_pair<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}

// Two accumulator n-tiles (keys 2kk*8 .. 2kk*8+15 of rows group, group + 8) as the A operand of
// the next MMA: the accumulator layout of C is already the register layout of A.
template <typename T>
__device__ __forceinline__ void accumulators_to_a(unsigned (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_pair<T>(lo[0], lo[1]);
  a[1] = pack_pair<T>(lo[2], lo[3]);
  a[2] = pack_pair<T>(hi[0], hi[1]);
  a[3] = pack_pair<T>(hi[2], hi[3]);
}

// Four accumulator n-tiles (keys 32 kk .. 32 kk + 31 of rows group, group + 8) as the e4m3 A operand of FP8 wgmma
// (m64 k32), rounded to nearest and saturated at e4m3's largest finite. Register r holds 4 keys of one row: byte i
// of register 0 is row group's key 4 quad + i of the first 16 in the order V^T is written in
// (wg::transpose_values_fp8): n-tile 0's two keys of this lane, then n-tile 1's. No lane trades values.
__device__ __forceinline__ unsigned pack_fp8_quad(float k0, float k1, float k2, float k3) {
  const unsigned lo = __nv_cvt_float2_to_fp8x2(make_float2(k0, k1), __NV_SATFINITE, __NV_E4M3);
  const unsigned hi = __nv_cvt_float2_to_fp8x2(make_float2(k2, k3), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}
__device__ __forceinline__ void accumulators_to_a_fp8(unsigned (&a)[4], const float (&t0)[4], const float (&t1)[4],
                                                      const float (&t2)[4], const float (&t3)[4]) {
  a[0] = pack_fp8_quad(t0[0], t0[1], t1[0], t1[1]);
  a[1] = pack_fp8_quad(t0[2], t0[3], t1[2], t1[3]);
  a[2] = pack_fp8_quad(t2[0], t2[1], t3[0], t3[1]);
  a[3] = pack_fp8_quad(t2[2], t2[3], t3[2], t3[3]);
}

// 16-byte global -> shared copy that bypasses registers; an invalid source is zero-filled. The L2::128B
// hint has L2 fetch a miss's whole 128-byte line: the tiles are read in whole rows (docs/decisions/0011-kernel-techniques.md).
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  cp_async_16(shared_address(dst), src, valid);
}
// 4-byte variant for per-row statistics, whose rows need not be 16-byte aligned.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(shared_address(dst)), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// load_rows_by_words' slow path, element by element and synchronously: a call rather than inlined, since
// inlined beside the fast path it cost kernels at the register limit 12-40 B of spills (ptxas, d = 59, 111).
template <int ROWS, int HEAD_DIM, int THREADS, typename T, typename SharedAt>
__device__ __noinline__ void load_rows_by_elements(SharedAt shared_at, const T* slice, long long row_stride, int row0,
                                                   int valid_rows, int valid_cols) {
  for (int idx = threadIdx.x; idx < ROWS * HEAD_DIM; idx += THREADS) {
    const int r = idx / HEAD_DIM, c = idx % HEAD_DIM;
    const T value = r < valid_rows && c < valid_cols ? slice[(long long)(row0 + r) * row_stride + c] : from_float<T>(0.f);
    if constexpr (sizeof(T) == 2) {
      asm volatile("st.shared.b16 [%0], %1;\n" :: "r"(shared_at(r, c)), "h"(*reinterpret_cast<const unsigned short*>(&value)));
    } else {
      asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(shared_at(r, c)), "r"(*reinterpret_cast<const unsigned*>(&value)));
    }
  }
}

// Rows whose data is not whole 16-byte chunks (a head dim that is not a multiple of 16 bytes' elements: the
// rows are not 16-byte aligned in global memory), for both tile layouts below; shared_at(r, c) is the shared
// address of column c of tile row r. Where every row of the slice starts on a 4-byte boundary (the slice
// 4-byte aligned and the row stride whole 4-byte words: d even; for an odd d, the heads interleaved as
// (B, N, H, d) with H even, and only the even heads), the rows go as asynchronous 4-byte copies like the
// 16-byte path, a last column alone (d odd) as a 2-byte copy whose other half is zero-filled. Otherwise (an
// odd row stride) element by element: finished before the next barrier like a completed copy, but with
// nothing to overlap. Columns at or past valid_cols and rows at or past valid_rows are zero.
template <int ROWS, int HEAD_DIM, int THREADS, typename T, typename SharedAt>
__device__ __forceinline__ void load_rows_by_words(SharedAt shared_at, const T* slice, long long row_stride, int row0,
                                                   int valid_rows, int valid_cols) {
  constexpr int PER_WORD = 4 / sizeof(T);
  constexpr int WORDS = HEAD_DIM / PER_WORD;   // per tile row, padding included
  static_assert(HEAD_DIM % PER_WORD == 0, "whole 4-byte words per tile row");
  // (fewer threads than words in a row, e.g. the 2-warp fp32 decode at d > 64: element by element)
  if (THREADS >= WORDS && reinterpret_cast<unsigned long long>(slice) % 4 == 0 && row_stride * sizeof(T) % 4 == 0) {
    // each thread one fixed word column of every ROW_STEP-th row, as the 16-byte path does: a few instructions
    // a copy (where THREADS is not a multiple of WORDS, the threads past ROW_STEP whole rows sit out)
    constexpr int ROW_STEP = THREADS >= WORDS ? THREADS / WORDS : 1;
    const int c = threadIdx.x % WORDS * PER_WORD, r0 = threadIdx.x / WORDS;
    const int col_bytes = max(0, min(PER_WORD, valid_cols - c)) * int(sizeof(T));   // 4, 2 (a last odd column), 0
    if (r0 < ROW_STEP) {
#pragma unroll 4
      for (int n = 0; n < (ROWS + ROW_STEP - 1) / ROW_STEP; ++n) {
        const int r = r0 + n * ROW_STEP;
        const int bytes = r < valid_rows ? col_bytes : 0;   // 0: zero-filled, nothing read
        if (ROWS % ROW_STEP == 0 || r < ROWS)
          asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                       :: "r"(shared_at(r, c)), "l"(bytes ? slice + (long long)(row0 + r) * row_stride + c : slice), "r"(bytes));
      }
    }
    return;
  }
  load_rows_by_elements<ROWS, HEAD_DIM, THREADS>(shared_at, slice, row_stride, row0, valid_rows, valid_cols);
}

// Rows [row0, row0 + ROWS) of one (batch, head) slice into a padded shared tile, 16 bytes per copy;
// rows at or past valid_rows, and the columns at or past valid_cols (a head dim padded up to the
// template's), are zero so that they add nothing to any product. A valid_cols that is not whole 16-byte
// chunks takes load_rows_by_words.
template <int ROWS, int HEAD_DIM, int PITCH, int THREADS, typename T>
__device__ __forceinline__ void async_load_rows(T* tile, const T* slice, long long row_stride, int row0, int valid_rows,
                                                int valid_cols = HEAD_DIM) {
  constexpr int CHUNKS_PER_ROW = HEAD_DIM * sizeof(T) / 16;
  constexpr int PER_CHUNK = 16 / sizeof(T);
  if (valid_cols % PER_CHUNK != 0) {
    const unsigned base = shared_address(tile);
    load_rows_by_words<ROWS, HEAD_DIM, THREADS>([=](int r, int c) { return base + unsigned(r * PITCH + c) * unsigned(sizeof(T)); },
                                                slice, row_stride, row0, valid_rows, valid_cols);
    return;
  }
  for (int chunk = threadIdx.x; chunk < ROWS * CHUNKS_PER_ROW; chunk += THREADS) {
    const int r = chunk / CHUNKS_PER_ROW, c = (chunk % CHUNKS_PER_ROW) * PER_CHUNK;
    const bool valid = r < valid_rows && c < valid_cols;
    cp_async_16(tile + r * PITCH + c, slice + (valid ? (long long)(row0 + r) * row_stride + c : 0), valid);
  }
}

// The same copy with whole rows per warp: warp w takes rows w, w + WARPS, ..., its lanes the row's 16-byte pieces,
// so each row's address is formed once rather than per piece. Rows at or past valid_rows are zero.
template <int ROWS, int COLS, int PITCH, int WARPS, typename T>
__device__ __forceinline__ void async_load_rows_by_warps(T* tile, const T* slice, long long row_stride, int row0,
                                                         int valid_rows) {
  constexpr int PIECES = COLS * sizeof(T) / 16, PER_PIECE = 16 / sizeof(T);
  static_assert(COLS * sizeof(T) % 16 == 0 && ROWS % WARPS == 0, "whole 16-byte pieces, rows over the warps");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < ROWS / WARPS; ++i) {
    const int r = warp + i * WARPS;
    const bool valid = r < valid_rows;
    const T* row = slice + (valid ? (long long)(row0 + r) * row_stride : 0);
#pragma unroll
    for (int j = 0; j < (PIECES + 31) / 32; ++j) {
      const int piece = lane + 32 * j;
      if (PIECES % 32 == 0 || piece < PIECES) cp_async_16(tile + r * PITCH + piece * PER_PIECE, row + piece * PER_PIECE, valid);
    }
  }
}

// Two adjacent output columns (dim, dim + 1) of one row, from fp32: one 32-bit store where the row's
// pairs are 4-byte aligned (DATA_DIM even), else element by element; columns past DATA_DIM (the head
// dim's padding) are never stored.
template <typename T, int DATA_DIM>
__device__ __forceinline__ void store_pair(T* row, int dim, float lo, float hi) {
  if (DATA_DIM % 2 == 0) {
    if (dim < DATA_DIM) *reinterpret_cast<unsigned*>(row + dim) = pack_pair<T>(lo, hi);
  } else {
    if (dim < DATA_DIM) row[dim] = from_float<T>(lo);
    if (dim + 1 < DATA_DIM) row[dim + 1] = from_float<T>(hi);
  }
}

// A warp's 16 x 8 TILES accumulator tile (rows group, group + 8; columns 8 n + 2 quad, + 1; each times `scale`) into
// rows [0, valid_rows) and columns [0, valid_cols) of `rows` (row_stride elements apart: the tile's columns from the
// first one the caller points at, the rest of a padded head dim never written), through `stage`:
// StagedTile<TILES>::BYTES of shared memory that this warp alone uses (nothing else may read it meanwhile). Staged,
// the tile goes out row by row, each warp store whole rows in 16-byte pieces where the rows start on 16-byte
// boundaries (else element by element). Straight from the fragments, each store instruction wrote 4 bytes of each
// lane, 16 of each of 8 rows (docs/decisions/0011-kernel-techniques.md).
template <int TILES>
struct StagedTile {
  static constexpr int ROW_BYTES = TILES * 16 + 16;   // padded: the 8 rows of one fragment store fall in disjoint banks
  static constexpr int BYTES = 16 * ROW_BYTES;
};
template <typename T, int TILES, int DATA_DIM>
__device__ __forceinline__ void store_tile_staged(T* rows, long long row_stride, int valid_rows, unsigned stage,
                                                  const float (&acc)[TILES][4], float scale, int valid_cols = DATA_DIM) {
  static_assert(TILES % 2 == 0, "whole 16-byte pieces, two rows' worth per warp store");
  constexpr int ROW_BYTES = StagedTile<TILES>::ROW_BYTES;
  const int lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
  __syncwarp();   // every lane has read what the stage held before
#pragma unroll
  for (int half = 0; half < 2; ++half)
#pragma unroll
    for (int n = 0; n < TILES; ++n)
      asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(stage + (group + 8 * half) * ROW_BYTES + n * 16 + quad * 4),
                   "r"(pack_pair<T>(acc[n][2 * half] * scale, acc[n][2 * half + 1] * scale)) : "memory");
  __syncwarp();
  valid_cols = min(valid_cols, 8 * TILES);
  const bool pieces = DATA_DIM % 8 == 0 && valid_cols % 8 == 0
                      && (reinterpret_cast<unsigned long long>(rows) | (unsigned long long)row_stride * sizeof(T)) % 16 == 0;
#pragma unroll
  for (int step = 0; step < TILES / 2; ++step) {
    const int piece = step * 32 + lane, r = piece / TILES, c = piece % TILES;   // 8 columns from 8 c of row r
    if (r >= valid_rows || 8 * c >= valid_cols) continue;
    uint4 v;
    asm volatile("ld.shared.v4.b32 { %0, %1, %2, %3 }, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(stage + r * ROW_BYTES + c * 16) : "memory");
    T* out = rows + r * row_stride + 8 * c;
    if (pieces) {
      *reinterpret_cast<uint4*>(out) = v;
    } else {
      const T* values = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (8 * c + e < valid_cols) out[e] = values[e];
    }
  }
}

// The online softmax's two row operations on an accumulator fragment of S_TILES 8-key tiles (rows group and group + 8
// of a 16-row slab, `half` 0 / 1; a row's 8 values of a tile are spread over the lanes of a quad). The row's max of
// the tile, the same in every lane of the quad:
template <int S_TILES>
__device__ __forceinline__ float accumulator_row_max(const float (&s)[S_TILES][4], int half) {
  float tile_max = -INFINITY;
#pragma unroll
  for (int t = 0; t < S_TILES; ++t) tile_max = fmaxf(tile_max, fmaxf(s[t][2 * half], s[t][2 * half + 1]));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
  return fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
}
// ... and P~ = 2^(S scale_log2 - m_scaled) in place (m_scaled: the row's max times scale_log2), each added to row_sum.
template <int S_TILES>
__device__ __forceinline__ void exponentiate_accumulator_row(float (&s)[S_TILES][4], int half, float scale_log2,
                                                             float m_scaled, float& row_sum) {
#pragma unroll
  for (int t = 0; t < S_TILES; ++t) {
    const float p0 = exp2f(fmaf(s[t][2 * half], scale_log2, -m_scaled));
    const float p1 = exp2f(fmaf(s[t][2 * half + 1], scale_log2, -m_scaled));
    row_sum += p0 + p1;
    s[t][2 * half] = p0;
    s[t][2 * half + 1] = p1;
  }
}

// The mma.sync backwards' score products for a warp's 16 keys: S^T = K_w Q_i^T and dP^T = V_w dO_i^T over the head
// dim, zeroed first. K_w, V_w are the A operands (k_warp, v_warp: this lane's ldmatrix addresses), the rows of Q_i
// and dO_i the B operands (q_tile, do_tile plus b_pair: this lane's offset), one ldmatrix feeding two 8-query tiles.
// dP^T takes the first V_STEPS k-steps (K_STEPS but where v's head dim is narrower: the rest are zeros).
template <typename T, int K_STEPS, int V_STEPS, int R_TILES, int PITCH>
__device__ __forceinline__ void transposed_score_products(float (&s_acc)[R_TILES][4], float (&dp_acc)[R_TILES][4],
                                                          unsigned k_warp, unsigned v_warp, unsigned q_tile,
                                                          unsigned do_tile, unsigned b_pair) {
  constexpr int E = sizeof(T);
#pragma unroll
  for (int n = 0; n < R_TILES; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s_acc[n][e] = dp_acc[n][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < K_STEPS; ++kk) {
    unsigned k_frag[4], v_frag[4];
    ldmatrix_x4(k_frag, k_warp + kk * 16 * E);
    if (kk < V_STEPS) ldmatrix_x4(v_frag, v_warp + kk * 16 * E);
#pragma unroll
    for (int pair = 0; pair < R_TILES / 2; ++pair) {
      const unsigned b_offset = b_pair + (pair * 16 * PITCH + kk * 16) * E;
      unsigned qf[4], dof[4];
      ldmatrix_x4(qf, q_tile + b_offset);
      mma_16x8x16<T>(s_acc[2 * pair], k_frag, qf[0], qf[1]);
      mma_16x8x16<T>(s_acc[2 * pair + 1], k_frag, qf[2], qf[3]);
      if (kk < V_STEPS) {
        ldmatrix_x4(dof, do_tile + b_offset);
        mma_16x8x16<T>(dp_acc[2 * pair], v_frag, dof[0], dof[1]);
        mma_16x8x16<T>(dp_acc[2 * pair + 1], v_frag, dof[2], dof[3]);
      }
    }
  }
}

}  // namespace tc
}  // namespace fagen
