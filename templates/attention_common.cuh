// fagen: device helpers shared by every attention template (templates/attention_common.cuh).
// Named after the maths so that kernel bodies read like the FlashAttention pseudocode.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <limits.h>

#include "shared_constants.cuh"   // PHILOX_ROUNDS, SUMMARY_GRAIN, MaskKind: written from fagen's Python

namespace fagen {

// ---- the launch arguments ------------------------------------------------------------------
// One struct for every kernel, passed by value. Every field is 8 bytes so that the host side
// (fagen/runtime/arguments.py) and this layout agree without padding rules.
struct AttentionArgs {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;            // (batch, heads, seq_q), natural log, -inf for rows with no visible key
  const void* d_o;       // backward only
  void* dq;
  void* dk;
  void* dv;
  float* dq_accum;       // fp32 (batch, heads, seq_q, head_dim), cleared by the _delta kernel; atomics target
  float* delta;          // D_i = rowsum(dO_i * O_i) (less d_lse_i, below), (batch, heads, seq_q)
  float* o_accum;        // fa1: O in HBM between (i, j) steps, fp32 (batch, heads, seq_q, head_dim)
  float* row_max;        // fa1: m in HBM, log2 domain
  float* row_sum;        // fa1: l in HBM
  long long q_stride[3];  // batch, head, row strides in elements (the last dim is contiguous)
  long long k_stride[3];
  long long v_stride[3];
  long long o_stride[3];
  long long do_stride[3];
  long long dq_stride[3];
  long long dk_stride[3];
  long long dv_stride[3];
  long long batch, heads, seq_q, seq_k;
  const int* kv_lengths;              // padding: keys visible per batch entry
  const unsigned char* block_mask;    // block_sparse: layout over (q block, k block), nonzero = visible
  long long block_mask_stride[4];     // batch, head, q block, k block (0 = broadcast)
  unsigned long long seed, offset;    // dropout: Philox key and counter word
  long long row_groups;               // fa1: blocks sharing one (batch, head)
  // Grouped KV heads (GQA; MQA when heads == kv_group): query head h reads K/V head h / kv_group.
  // The backward writes dK, dV per query head into dk/dv (a (batch, heads, seq_k, d) workspace), and
  // the _kv_group_sum kernel adds each group's heads into dk_sum/dv_sum, the caller's gradients.
  long long kv_group;
  void* dk_sum;
  void* dv_sum;
  long long dk_sum_stride[3];
  long long dv_sum_stride[3];
  // Packed variable-length batches (spec layout packed, FlashAttention-2's varlen convention): the
  // tensors hold one batch entry of seq_q (seq_k) rows in which sequence b is rows
  // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) (keys likewise), at most max_seq_q (max_seq_k) long.
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  long long max_seq_q, max_seq_k;
  // Run-time inputs of a spec's mask_mod / score_mod (fagen/expressions.py renders the code that reads
  // them): up to 4 tensors of 1 or 2 dimensions (float32 or int32; sizes and strides in elements, every
  // index clamped into the tensor) and up to 4 scalars, in the order the spec declares them.
  const void* mod_tensor[4];
  long long mod_size[4][2];
  long long mod_stride[4][2];
  double mod_scalar[4];
  // Per tensor input whose values decide which tiles a mask_mod leaves empty or full (document ids):
  // its min and max per SUMMARY_GRAIN positions along the dimension the tile's positions index,
  // written by summarise_input before the attention kernels run; nullptr for the others.
  void* mod_summary[4];
  // The (sequence, head) pairs the grid covers (fagen/runtime/grids.py: problem_grid): grid_problem() below.
  long long problems;
  // Dropout's seed in device memory, or nullptr for `seed` above: a seed drawn on the GPU each step (by
  // torch's CUDA generator), which a CUDA graph then replays as a new draw instead of a captured value.
  const unsigned long long* seed_pointer;
  // A paged K/V cache (the decode pass, and the packed forward: PagedRows): k and v hold page_count pages of
  // page_size rows each (strides: page, head, row), and sequence b's key j lives in page
  // block_table[b * block_table_stride + j / page_size], row j % page_size. nullptr: k and v are (batch, head,
  // row) tensors as above.
  const int* block_table;
  long long block_table_stride, page_size, page_count;
  // Gradients of score_mod's float tensor inputs (the backward built WITH_INPUT_GRADS): per tensor input, a
  // zeroed contiguous float32 buffer of its shape that it adds dS' * d score_mod / d input into (the
  // generated Mods::add_input_grads, flush_input_grads); unread by the other builds.
  float* mod_grad[4];
  // Grouped KV heads in the backward (templates whose FOLDS_HEADS is true): where > 1, the grid covers (sequence, K/V
  // head) pairs and each block walks the fold_heads (= kv_group) query heads of its group in turn, writing dK, dV
  // to the K/V head's rows itself (no workspace, no _kv_group_sum). 0 or 1: one query head per block.
  long long fold_heads;
  // The backward's dL/d lse, laid out as lse, where the caller's loss reads the forward's lse (a merge of
  // partial attentions, a sink logit): it adds dlse_i * P_ij to dS_ij, which is D_i - dlse_i in place of D_i
  // (the _delta kernel subtracts it). nullptr: lse was not used.
  const float* d_lse;
  // An fp8 forward's descale factors of q, k and v (FlashAttention-3's q_descale, k_descale, v_descale): the
  // true values are the e4m3 elements times these, per (sequence, K/V head) with these strides (0: broadcast).
  // nullptr: 1.
  const float* descale[3];
  long long descale_stride[3][2];
};

// The K/V head that query head h reads. A 32-bit division: head counts are small, and a 64-bit divide
// costs registers that the largest kernels do not have to spare.
__device__ __forceinline__ long long kv_head(const AttentionArgs& args, long long h) { return (unsigned)h / (unsigned)args.kv_group; }

// ---- the problem one block works on -------------------------------------------------------
// The grids lay the (sequence, head) pairs along y, which holds at most 65535 blocks: a packed batch of
// many short sequences, or a large decode batch, has more. The host folds them over z (y * z >= problems)
// and each kernel first returns from the few spare blocks of the last z slice.
// (unsigned: 65535 x 65535 pairs fit in 32 bits, and a 64-bit index costs registers the largest kernels lack)
__device__ __forceinline__ unsigned grid_problem() { return blockIdx.z * gridDim.y + blockIdx.y; }

// First thing in each kernel: a spare block of the fold ends at once. An `exit` instruction rather than a
// `return`: with a second way out of the kernel in the compiler's control flow, ptxas spilled in several
// of the largest kernels.
__device__ __forceinline__ void exit_if_spare(const AttentionArgs& args) {
  if (grid_problem() >= args.problems) asm volatile("exit;");
}

// The Hopper kernels' grids (fagen/runtime/grids.py: grouped_grid) run their blocks in groups of problems:
// x = a problem of the group, y = the block's index (key block, or row block in dispatch order), z = the
// group, so that every block of a group with index 0 is dispatched before any with index 1. Where a
// block's work falls with its index (causal: those kernels order their blocks heaviest first) that is
// longest-first across the group's problems, not only within each one, so the last blocks to start are
// light ones; and blocks in flight together belong to different problems (different dQ rows for the
// backward's atomics). All from special registers, which ptxas re-reads where it needs them instead of
// holding a register (a division of one linear index cost the backward 4-20 bytes of spills).
__device__ __forceinline__ unsigned grouped_problem() { return blockIdx.z * gridDim.x + blockIdx.x; }
__device__ __forceinline__ void exit_if_spare_grouped(const AttentionArgs& args) {
  if (grouped_problem() >= args.problems) asm volatile("exit;");
}
// A backward block's first (sequence, query head) pair, b * heads + h: grouped_problem(), or where the grid covers
// (sequence, K/V head) pairs (args.fold_heads > 1) the first query head of the pair's group. (32-bit divisions.)
__device__ __forceinline__ long long folded_problem(const AttentionArgs& args) {
  const unsigned pair = grouped_problem();
  if (args.fold_heads <= 1) return pair;
  const unsigned kv_heads = (unsigned)args.heads / (unsigned)args.kv_group;
  return (long long)(pair / kv_heads) * args.heads + (long long)(pair % kv_heads) * args.kv_group;
}

// One (sequence, query head) pair, grid_problem() = b * heads + h. Padded batches: sequence b is rows
// [0, seq_q) of batch entry b. Packed batches: every sequence lives in batch entry 0, sequence b at
// rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and keys [cu_seqlens_k[b], cu_seqlens_k[b + 1]).
// Those offsets arrive in device memory unchecked (reading them back would synchronise), so they are
// clamped here, the one place any kernel reads them: into [0, rows of the tensor], non-decreasing,
// and each sequence to the max_seq_q / max_seq_k the grid was sized for. Masks, dropout and the
// bottom-right alignment use positions within the sequence, so a sequence is computed exactly as a
// padded batch entry of its own lengths would be.
template <bool PACKED>
struct Problem {
  long long b, h, h_kv, bh;  // sequence, query head, the K/V head it reads, b * heads + h (dropout's stream)
  long long entry;           // the batch entry holding the rows: b, or 0 when packed
  long long q_row0, k_row0;  // the sequence's first query / key row within that entry
  int seq_q, seq_k;          // its lengths
  long long row_offset;      // index of its query row 0 in (batch, heads, seq_q) buffers: lse, delta, dq_accum

  __device__ __forceinline__ Problem(const AttentionArgs& args, long long bh_) : bh(bh_) {
    b = bh / args.heads;
    h = bh % args.heads;
    h_kv = kv_head(args, h);
    if (PACKED) {
      entry = 0;
      // a paged cache holds each sequence's keys from its row 0 (PagedRows): cu_seqlens_k gives only their counts
      const bool paged = args.block_table != nullptr;
      const int rows_q = (int)args.seq_q, rows_k = paged ? INT_MAX : (int)args.seq_k;
      const int q_begin = min(max(args.cu_seqlens_q[b], 0), rows_q), q_end = min(max(args.cu_seqlens_q[b + 1], q_begin), rows_q);
      const int k_begin = min(max(args.cu_seqlens_k[b], 0), rows_k), k_end = min(max(args.cu_seqlens_k[b + 1], k_begin), rows_k);
      q_row0 = q_begin;
      k_row0 = paged ? 0 : k_begin;
      seq_q = min(q_end - q_begin, (int)args.max_seq_q);
      seq_k = min(k_end - k_begin, (int)args.max_seq_k);
      row_offset = h * args.seq_q + q_begin;
    } else {
      entry = b;
      q_row0 = k_row0 = 0;
      seq_q = (int)args.seq_q;
      seq_k = (int)args.seq_k;
      row_offset = bh * args.seq_q;
    }
  }
  // Row 0 of this problem in a tensor with (batch, head, row) strides: queries (q, o, dO, dQ) of head
  // h, keys (k, v) of head h_kv, and per-query-head key gradients (the GQA dK/dV workspace) of head h.
  template <typename T> __device__ __forceinline__ T* query_rows(T* base, const long long (&stride)[3]) const {
    return base + entry * stride[0] + h * stride[1] + q_row0 * stride[2];
  }
  template <typename T> __device__ __forceinline__ T* key_rows(T* base, const long long (&stride)[3]) const {
    return base + entry * stride[0] + h_kv * stride[1] + k_row0 * stride[2];
  }
  template <typename T> __device__ __forceinline__ T* key_grad_rows(T* base, const long long (&stride)[3]) const {
    return base + entry * stride[0] + h * stride[1] + k_row0 * stride[2];
  }
};

// An fp8 forward's descale factor of q (0), k (1) or v (2) for this problem's (sequence, K/V head): 1 without one.
template <typename ProblemT>
__device__ __forceinline__ float fp8_descale(const AttentionArgs& args, int operand, const ProblemT& problem) {
  const float* factors = args.descale[operand];
  return factors == nullptr ? 1.f
                            : factors[problem.b * args.descale_stride[operand][0] + problem.h_kv * args.descale_stride[operand][1]];
}

// ---- a paged K/V cache (AttentionArgs::block_table) ----
// The page holding key j of the sequence whose block-table row is `table_row`. Page numbers arrive in device
// memory unchecked: clamped into [0, page_count).
__device__ __forceinline__ long long key_page(const int* table_row, int j, int page_size, long long page_count) {
  return min(max((long long)table_row[j / page_size], 0LL), page_count - 1);
}
// Where key row r of sequence b lives, for the forward kernels' loaders (wg::async_load_key_rows) in place of a
// contiguous slice and its row stride: `head_rows` is the
// cache plus the K/V head's offset (Problem::key_rows, whose k_row0 is 0 when paged).
template <typename T>
struct PagedRows {
  using element_type = T;
  const T* head_rows;
  const int* table_row;
  long long page_stride, row_stride, page_count;
  int page_size;
  __device__ __forceinline__ PagedRows(const AttentionArgs& args, long long b, const T* head_rows_,
                                       const long long (&stride)[3])
      : head_rows(head_rows_), table_row(args.block_table + b * args.block_table_stride), page_stride(stride[0]),
        row_stride(stride[2]), page_count(args.page_count), page_size((int)args.page_size) {}
  // Elements from head_rows to key row r.
  __device__ __forceinline__ long long offset(int r) const {
    return key_page(table_row, r, page_size, page_count) * page_stride + (long long)(r % page_size) * row_stride;
  }
};

// The block's values that its main loop does not touch at every instruction -- global row pointers used once a
// step (the backward's next Q_i, dO_i loads and dQ's atomics, the forward's next K_j, V_j loads where Q is re-read
// from shared memory) or only after the loop (the forward's O and LSE rows, the backward's dK and dV rows) -- kept
// in shared memory instead of registers. At the edge of the register file, with the accumulators
// live through the loop, ptxas otherwise puts such values in local memory (sm_80's mma.sync templates spilled
// 8-76 B so). Thread 0 writes `slot`; the barrier publishes it before anyone reads.
template <typename T>
__device__ __forceinline__ const T& block_values_in_shared(T& slot, const T& value) {
  if (threadIdx.x == 0) slot = value;
  __syncthreads();
  return slot;
}

// ---- element conversion --------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// ---- reductions across a warp ----------------------------------------------------------------
// x combined by op over each aligned group of LANES lanes (a power of two), every lane of the warp taking
// part (full-mask shuffles) and every lane of a group getting the result.
template <int LANES, typename T, typename Op>
__device__ __forceinline__ T lanes_combine(T x, Op op) {
#pragma unroll
  for (int lane_mask = LANES / 2; lane_mask > 0; lane_mask >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, lane_mask));
  return x;
}
template <int LANES>
__device__ __forceinline__ float lanes_sum(float x) { return lanes_combine<LANES>(x, [](float a, float b) { return a + b; }); }
__device__ __forceinline__ float warp_sum(float x) { return lanes_sum<32>(x); }
__device__ __forceinline__ float warp_max(float x) { return lanes_combine<32>(x, [](float a, float b) { return fmaxf(a, b); }); }

// exp2 of (x - m) where m may still be -inf for a row that has seen no visible key:
// FlashAttention's convention, so that such rows give 0 instead of NaN.
__device__ __forceinline__ float safe_max(float m) { return m == -INFINITY ? 0.f : m; }

// ---- dropout: counter-based Philox4x32-7 -----------------------------------------------------
// The mask of element (b, h, row, col) depends only on (seed, offset) and those indices, never on
// the tiling or the loop order, so the backward regenerates it and fagen/reference.py matches it.
// PHILOX_ROUNDS rounds (shared_constants.cuh; fagen/dropout.py says why 7).
__device__ __forceinline__ uint4 philox4x32(uint4 counter, uint2 key) {
#pragma unroll
  for (int round = 0; round < PHILOX_ROUNDS; ++round) {
    if (round > 0) {
      key.x += 0x9E3779B9u;
      key.y += 0xBB67AE85u;
    }
    const unsigned hi0 = __umulhi(0xD2511F53u, counter.x), lo0 = 0xD2511F53u * counter.x;
    const unsigned hi1 = __umulhi(0xCD9E8D57u, counter.z), lo1 = 0xCD9E8D57u * counter.z;
    counter = make_uint4(hi1 ^ counter.y ^ key.x, lo1, hi0 ^ counter.w ^ key.y, lo0);
  }
  return counter;
}

// The random stream is laid out in patches that match the m16n8 accumulator layouts (the PTX ISA's: a
// thread holds rows g, g + 8 of a 16-row slab and columns 2t, 2t + 1 of each 8-column tile), so that
// one Philox call serves 8 elements of the forward's fragments (and, shuffled, of the backward's
// transposed ones) instead of one per element: Philox is what a dropout kernel spends its time on.
// A patch is rows {i, i + 8} x columns {j0, j0 + 1, j0 + 8, j0 + 9} (i & 8 == 0, j0 & 9 == 0) of an
// aligned 16 x 16 square; its call's word ((i >> 3) & 1) * 2 + ((j >> 3) & 1) holds the row's pair of
// columns j0 + (j & 8), 16 bits each (column j in half j & 1). fagen/reference.py: dropout_bits.
// The Philox key: the seed argument, or the seed in device memory where the caller gave one there.
// forward_wgmma reads it once per block; the kernels at the edge of their registers (the mma.sync forward,
// every backward) read it where they draw, as holding it through their loops made ptxas spill (docs/decisions/0011-kernel-techniques.md).
__device__ __forceinline__ uint2 dropout_key(const AttentionArgs& args) {
  const unsigned long long seed = args.seed_pointer != nullptr ? __ldg(args.seed_pointer) : args.seed;
  return make_uint2((unsigned)seed, (unsigned)(seed >> 32));
}

__device__ __forceinline__ uint4 dropout_draws(const AttentionArgs& args, const uint2 key, long long bh, int row, int col) {
  const unsigned row_patch = ((unsigned)row >> 4) * 8 + ((unsigned)row & 7);
  const unsigned col_patch = ((unsigned)col >> 4) * 4 + (((unsigned)col >> 1) & 3);
  const uint4 counter = make_uint4(col_patch, row_patch, (unsigned)bh, (unsigned)args.offset);
  return philox4x32(counter, key);
}

__device__ __forceinline__ uint4 dropout_draws(const AttentionArgs& args, long long bh, int row, int col) {
  return dropout_draws(args, dropout_key(args), bh, row, col);
}

// Word `word` of a patch's draws (a compile-time index in the unrolled loops, so the choice folds away).
__device__ __forceinline__ unsigned dropout_word(const uint4& draws, int word) {
  return word == 0 ? draws.x : word == 1 ? draws.y : word == 2 ? draws.z : draws.w;
}

// Kept iff the 16-bit draw in half `half` of `word` (0: low bits) is >= threshold = floor(p * 2^16).
// The threshold is a parameter, not the templates' constant, so that a spec without dropout
// (threshold 0) compiles without nvcc's "pointless comparison" warning in code that HAS_DROPOUT
// switches off anyway.
__device__ __forceinline__ bool dropout_half_kept(unsigned word, int half, unsigned threshold) {
  return ((word >> (16 * half)) & 0xFFFFu) >= threshold;
}

// One element's decision, a whole Philox call for it: the SIMT templates and the split-KV decode.
__device__ __forceinline__ bool dropout_keep(const AttentionArgs& args, long long bh, int row, int col,
                                             unsigned threshold) {
  const uint4 draws = dropout_draws(args, bh, row, col);
  return dropout_half_kept(dropout_word(draws, ((row >> 3) & 1) * 2 + ((col >> 3) & 1)), col & 1, threshold);
}

// Dropout of one thread's share of a 16 x 16 patch of m16n8 accumulators: n-tiles `lo` (columns
// 16c .. 16c + 7) and `hi` (16c + 8 .. 16c + 15) of a 16-row slab, whose element e is row g + 8 (e / 2),
// column 2t + e % 2. `draws` = dropout_draws(row g, column 16c + 2t): that is the whole patch.
__device__ __forceinline__ void dropout_accumulator_pair(float (&lo)[4], float (&hi)[4], const uint4& draws,
                                                         unsigned threshold, float keep_scale) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int word = (e / 2) * 2;   // rows g + 8 are words 2, 3; the hi tile's columns are words 1, 3
    lo[e] = dropout_half_kept(dropout_word(draws, word), e % 2, threshold) ? lo[e] * keep_scale : 0.f;
    hi[e] = dropout_half_kept(dropout_word(draws, word + 1), e % 2, threshold) ? hi[e] * keep_scale : 0.f;
  }
}

// The dropout decisions of one thread's share of the backward's transposed m16n8 accumulators
// (S^T of 16 keys x 8 * R_TILES queries; element e of n-tile n is key key0 + group + 8 (e / 2), query
// row0 + 8 n + 2 quad + e % 2), as bit 4 n + e. Transposed, a thread holds only 4 elements of any one
// patch: queries q, q + 8 x keys group, group + 8, all in half group & 1 of the call's words. Two ways:
//  - SHUFFLED: the warp draws each 16 x 16 square once, in the forward's layout: lane (group, quad) draws
//    the patch of queries group, group + 8 x keys 2 quad + {0, 1, 8, 9} (8 decisions from one call), and
//    each lane takes its 4 + 4 from the two lanes that drew its queries 2 quad and 2 quad + 1, one
//    shuffle each: one Philox call per 8 elements (docs/decisions/0011-kernel-techniques.md). Every lane of the warp must call it.
//  - otherwise each lane draws the patches of its own elements, one call per 4, for the kernels where the
//    shuffled form's few more live registers make ptxas spill (backward_fa2_mma at 255 on sm_80).
// row0 and key0 are multiples of 16. Loops that are not unrolled, because the backwards run at the edge
// of their registers: unrolled, ptxas interleaves the Philox calls and spills.
template <int R_TILES, bool SHUFFLED>
__device__ __forceinline__ unsigned long long dropout_transposed_mask(const AttentionArgs& args, long long bh, int row0,
                                                                      int key0, int group, int quad, unsigned threshold) {
  static_assert(R_TILES % 2 == 0 && 4 * R_TILES <= 64, "whole 16-query squares, one bit per element");
  unsigned long long kept = 0;
  const uint2 key = dropout_key(args);
  if constexpr (SHUFFLED) {
#pragma unroll 1
    for (int c = 0; c < R_TILES / 2; ++c) {   // the square of n-tiles 2c, 2c + 1
      const uint4 draws = dropout_draws(args, key, bh, row0 + c * 16 + group, key0 + quad * 2);
      unsigned patch = 0;   // bit 2 w + h: the decision in half h of word w (query + 8 (w / 2), key + 8 (w % 2) + h)
#pragma unroll
      for (int word = 0; word < 4; ++word)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          patch |= (unsigned)dropout_half_kept(dropout_word(draws, word), half, threshold) << (2 * word + half);
#pragma unroll
      for (int odd = 0; odd < 2; ++odd) {   // queries 2 quad + odd (+ 8): drawn by lane (2 quad + odd, group / 2)
        const unsigned drawn = __shfl_sync(0xffffffffu, patch, (2 * quad + odd) * 4 + (group >> 1));
        // half group & 1 of each word; word w = 2 (n - 2c) + e / 2 lands on bit 4 n + e with e % 2 = odd
        kept |= (unsigned long long)((drawn >> (group & 1)) & 0x55u) << (8 * c + odd);
      }
    }
  } else {
#pragma unroll 1
    for (int step = 0; step < R_TILES; ++step) {   // n-tiles 2c, 2c + 1, queries 2 quad + odd
      const int c = step / 2, odd = step % 2;
      const uint4 draws = dropout_draws(args, key, bh, row0 + c * 16 + quad * 2 + odd, key0 + group);
      unsigned bits = 0;   // word w is n-tile 2c + w / 2, element 2 (w % 2) + odd: bit 8c + odd + 2w
#pragma unroll
      for (int word = 0; word < 4; ++word)
        bits |= (unsigned)dropout_half_kept(dropout_word(draws, word), group & 1, threshold) << (2 * word);
      kept |= (unsigned long long)bits << (8 * c + odd);
    }
  }
  return kept;
}

// The factor Z of bit `bit` of dropout_transposed_mask's result: keep_scale where kept, else 0.
__device__ __forceinline__ float dropout_keep_factor(unsigned long long kept, int bit, float keep_scale) {
  return (kept >> bit) & 1 ? keep_scale : 0.f;
}

// ---- masks ---------------------------------------------------------------------------------
// The keys batch entry b may attend to. For the padding mask this is kv_lengths[b], which arrives in
// device memory unchecked (the host cannot read it back without synchronising), so it is clamped to
// [0, seq_k] here, the one place any kernel reads it: a negative length means no key (O = 0,
// LSE = -inf, zero gradients), a length past the end means every key, and neither can move a K/V
// load out of bounds. fagen/reference.py applies the same clamp.
template <int MASK>
__device__ __forceinline__ int visible_keys(const AttentionArgs& args, long long b, int seq_k) {
  return MASK == MASK_PADDING ? min(max(args.kv_lengths[b], 0), seq_k) : seq_k;
}

// A spec without mask_mod / score_mod. A spec with them gets a generated struct of the same shape
// (fagen/expressions.py, rendered into every template as SpecMods): visible(i, j) is the mask_mod,
// tile_maybe_visible / tile_all_visible bound it over a tile by interval arithmetic (the generated struct
// also has tile_class, both as one value, for the host tests), score / score_grad are the score_mod and
// its derivative in the score (sympy's), in natural units (score = tau * q.k); raw_score is the score_mod
// on the raw product q.k, in its units (score_mod(tau s) / tau, tau folded in by sympy). Each takes the
// position (i, j) as ints and as floats (fi, fj), which a float expression of them reads. MASK_READS_KEYS: the
// mask_mod reads an input at a key position (doc[b, j]), which the wgmma forwards test ahead of the tile's scores
// (accumulator_visibility) rather than per score in their softmax: forward_wgmma where that buys a third resident
// block, forward_wgmma_ws always (per score it spilled the consumers' registers).
struct NoMods {
  static constexpr bool HAS_MASK = false, HAS_SCORE = false, SCORE_GRAD_IS_ONE = true, MASK_READS_KEYS = false;
  __device__ NoMods(const AttentionArgs&, long long, long long, int, int) {}
  __device__ __forceinline__ bool visible(int, int) const { return true; }
  // Over rows [i_lo, i_hi] x keys [j_lo, j_hi] (inclusive): may a pair be visible (false only when none
  // is: TILE_EMPTY), is every pair visible (TILE_FULL)
  __device__ __forceinline__ bool tile_maybe_visible(int, int, int, int) const { return true; }
  __device__ __forceinline__ bool tile_all_visible(int, int, int, int) const { return true; }
  __device__ __forceinline__ float score(float s, int, int, float, float) const { return s; }
  __device__ __forceinline__ float raw_score(float s, int, int, float, float) const { return s; }
  __device__ __forceinline__ float score_grad(float, int, int, float, float) const { return 1.f; }
  // gradients of score_mod's tensor inputs: none without a score_mod (a generated struct's comments say more)
  static constexpr int INPUT_GRADS = 0, INPUT_GRAD_SUMS = 1;
  static constexpr bool INPUT_GRADS_READ_SCORE = false;
  __device__ __forceinline__ void add_input_grads(float, float, int, int, float*) const {}
  __device__ __forceinline__ void flush_input_grads(const float*) const {}
};
enum TileClass { TILE_EMPTY = 0, TILE_PARTIAL = 1, TILE_FULL = 2 };

// ---- run-time summaries of mask_mod inputs ----------------------------------------------------
// A mask_mod that reads an input at a query or key position (doc[b, i] == doc[b, j]) can only be
// decided per tile from that input's values. summarise_input writes, for input k along dimension dim,
// the (min, max) of every SUMMARY_GRAIN consecutive positions, for each index of its other dimension
// (1-D inputs: one row), into args.mod_summary[k]; the generated tile tests bound a tile's loads by
// the entries its positions cover. LANES threads per entry (a warp; 1 in the host build of the tests), a
// grid-stride loop: they read the entry's SUMMARY_GRAIN positions side by side (coalesced where the
// positions are contiguous, as document ids are), then combine (docs/decisions/0011-kernel-techniques.md).
// (SUMMARY_GRAIN: the tiles' own grain, so that a tile's bounds read 1-2 entries per axis.)

// A NaN among a float input's values widens its entry to (-inf, inf): fminf / fmaxf would skip it, and a
// tile whose bounds hid it could be called FULL while visible() is false at the NaN.
__device__ __forceinline__ void widen_if_nan(float value, float& low, float& high) {
  if (value != value) {
    low = -INFINITY;
    high = INFINITY;
  }
}
__device__ __forceinline__ void widen_if_nan(int, int&, int&) {}

template <typename T, int LANES = 32>
__device__ void summarise_input(const AttentionArgs& args, int k, int dim) {
  // a whole warp or one thread: with 2-16 lanes, two groups of one warp could leave the loop on different
  // iterations, and the full-mask shuffles would run with lanes missing
  static_assert(LANES == 1 || LANES == 32, "summarise_input: LANES is 32 (a warp) or 1 (the host build)");
  const T* input = static_cast<const T*>(args.mod_tensor[k]);
  T* summary = static_cast<T*>(args.mod_summary[k]);
  const long long size = args.mod_size[k][dim], stride = args.mod_stride[k][dim];
  const long long others = args.mod_size[k][1 - dim], other_stride = args.mod_stride[k][1 - dim];
  const long long blocks = (size + SUMMARY_GRAIN - 1) / SUMMARY_GRAIN;
  const int lane = threadIdx.x % LANES;
  const long long groups = (long long)gridDim.x * (blockDim.x / LANES);
  for (long long entry = blockIdx.x * (long long)(blockDim.x / LANES) + threadIdx.x / LANES; entry < others * blocks;
       entry += groups) {   // the same entries for every lane of a group: the shuffles below see all LANES
    const long long other = entry / blocks, first = (entry % blocks) * SUMMARY_GRAIN;
    const long long last = min(first + SUMMARY_GRAIN, size) - 1;
    const T* row = input + other * other_stride;
    // a lane past the entry's last position reads the last one again: a repeat changes no min or max
    T low = row[min(first + lane, last) * stride], high = low;
    widen_if_nan(low, low, high);
#pragma unroll
    for (int step = 1; step < SUMMARY_GRAIN / LANES; ++step) {
      const T value = row[min(first + lane + LANES * step, last) * stride];
      low = min(low, value);
      high = max(high, value);
      widen_if_nan(value, low, high);
    }
    low = lanes_combine<LANES>(low, [](T a, T b) { return min(a, b); });
    high = lanes_combine<LANES>(high, [](T a, T b) { return max(a, b); });
    if (lane == 0) {
      summary[2 * entry] = low;
      summary[2 * entry + 1] = high;
    }
  }
}

// Which keys a query sees, for one (sequence, head) of lengths seq_q, seq_k. The mask kinds that are formulas
// of the positions, causal and sliding_window, arrive as Kind: a struct printed from their expression
// (fagen/expressions.py MASK_KIND_TEXT; queries and keys aligned bottom-right, as PyTorch and FlashAttention
// do when seq_q != seq_k) by the same code as a mask_mod's, so that their per-element test and their tile
// classes are derived, not written here. The kinds that are data stay here: padding is the key count (the
// sequence end, which every test has anyway) and block_sparse a layout read block by block. A spec's
// mask_mod (Mods) narrows the mask further (AND); its positions are not shifted.
template <int MASK, int GRAIN, typename Kind = NoMods, typename Mods = NoMods>
struct Visibility {
  Kind kind;
  Mods mods;
  int key_count;  // keys that exist: visible_keys (padding: this batch entry's clamped length)
  const unsigned char* layout;
  long long layout_q_stride, layout_k_stride;

  template <bool PACKED>
  __device__ Visibility(const AttentionArgs& args, const Problem<PACKED>& problem)
      : Visibility(args, problem.b, problem.h, problem.seq_q, problem.seq_k) {}

  __device__ Visibility(const AttentionArgs& args, long long b, long long h, int seq_q, int seq_k)
      : kind(args, b, h, seq_q, seq_k), mods(args, b, h, seq_q, seq_k) {
    key_count = visible_keys<MASK>(args, b, seq_k);
    layout = nullptr;
    layout_q_stride = layout_k_stride = 0;
    if (MASK == MASK_BLOCK_SPARSE) {
      layout = args.block_mask + b * args.block_mask_stride[0] + h * args.block_mask_stride[1];
      layout_q_stride = args.block_mask_stride[2];
      layout_k_stride = args.block_mask_stride[3];
    }
  }

  __device__ __forceinline__ bool visible(int row, int col) const { return visible_if(true, row, col); }

  // visible(row, col) for a caller that also needs `exists` (the row and key are in range). The
  // mask_mod is evaluated whatever `exists` says (its loads are clamped into its inputs): with no
  // branch in front of its loads, the compiler shares them between a thread's elements of the same
  // row or key (doc[b, i] == doc[b, j] on a 64 x 64 wgmma tile: 18 loads per thread, not 64). The
  // mask kinds' own tests stay behind the branch: a block-sparse layout has no entry past the ends.
  __device__ __forceinline__ bool visible_if(bool exists, int row, int col) const {
    if (Mods::HAS_MASK) {
      if (!(exists & (col < key_count) & mods.visible(row, col))) return false;
    } else if (!exists || col >= key_count) {
      return false;
    }
    if (Kind::HAS_MASK) return kind.visible(row, col);
    if (MASK == MASK_BLOCK_SPARSE) return layout[(row / GRAIN) * layout_q_stride + (col / GRAIN) * layout_k_stride] != 0;
    return true;
  }

  // Does the tile rows [row0, row0 + rows) x cols [col0, col0 + cols) hold any visible element?
  // A tile that holds none is skipped without loading K_j / V_j (block sparsity).
  __device__ bool tile_has_visible(int row0, int rows, int col0, int cols) const {
    if (rows <= 0 || cols <= 0 || col0 >= key_count) return false;
    const int last_row = row0 + rows - 1, last_col = col0 + cols - 1;
    // the mask kind's own (arithmetic) test first: a mask_mod's may read its inputs' summaries
    if (Kind::HAS_MASK && !kind.tile_maybe_visible(row0, last_row, col0, last_col)) return false;
    if (Mods::HAS_MASK && !mods.tile_maybe_visible(row0, last_row, col0, last_col)) return false;
    if (MASK == MASK_BLOCK_SPARSE) {
      for (int qb = row0 / GRAIN; qb <= last_row / GRAIN; ++qb)
        for (int kb = col0 / GRAIN; kb <= last_col / GRAIN; ++kb)
          if (layout[qb * layout_q_stride + kb * layout_k_stride] != 0) return true;
      return false;
    }
    return true;
  }

  // Is every element of the tile visible? Such interior tiles skip the per-element mask test.
  // WITH_MODS = false leaves the mask_mod out (the caller has its answer for a tile around this one: TileWalk).
  template <bool WITH_MODS = true>
  __device__ bool tile_all_visible(int row0, int rows, int col0, int cols) const {
    const int last_row = row0 + rows - 1, last_col = col0 + cols - 1;
    if (last_col >= key_count) return false;
    if (Kind::HAS_MASK && !kind.tile_all_visible(row0, last_row, col0, last_col)) return false;
    if (WITH_MODS && Mods::HAS_MASK && !mods.tile_all_visible(row0, last_row, col0, last_col)) return false;
    if (MASK == MASK_BLOCK_SPARSE) {
      for (int qb = row0 / GRAIN; qb <= last_row / GRAIN; ++qb)
        for (int kb = col0 / GRAIN; kb <= last_col / GRAIN; ++kb)
          if (layout[qb * layout_q_stride + kb * layout_k_stride] == 0) return false;
    }
    return true;
  }

  // The score_mod applied to a raw product s = q.k (what the kernels accumulate): the modified score
  // in the same raw units (divided by tau again), so that the online softmax, which multiplies by
  // tau * log2(e), is unchanged. Identity without a score_mod.
  // frow, fcol: row and col as floats, which the tensor-core templates make by adding constants to one
  // conversion per tile (a conversion per score would share the pipe of the softmax's exponentials).
  __device__ __forceinline__ float modified_score(float s, int row, int col, float frow, float fcol) const {
    return Mods::HAS_SCORE ? mods.raw_score(s, row, col, frow, fcol) : s;
  }
  __device__ __forceinline__ float modified_score(float s, int row, int col) const {
    return modified_score(s, row, col, (float)row, (float)col);
  }
  // d(score_mod)/d(score) at the raw product s: the factor the backward multiplies dS by.
  __device__ __forceinline__ float score_gradient(float s, int row, int col, float frow, float fcol, float scale) const {
    return Mods::SCORE_GRAD_IS_ONE ? 1.f : mods.score_grad(s * scale, row, col, frow, fcol);
  }
  __device__ __forceinline__ float score_gradient(float s, int row, int col, float scale) const {
    return score_gradient(s, row, col, (float)row, (float)col, scale);
  }
};

// The visibility of a warp's 16 x COLS tile of scores in the tensor cores' accumulator layout (lane (group,
// quad) holds rows row0 + group + 8 half and keys col0 + 8 t + 2 quad + e, e = 0, 1), as a bit per score the
// lane holds: bit 2 t + e of bits[half]. The lanes split the test by key instead (lane l tests key 32 m + l
// against each of the 16 rows) and each row's ballot goes to the lanes that hold it, so that a lane reads the
// inputs of COLS / 32 keys and of the warp's rows (the same address across the warp), where testing its own
// scores reads COLS / 4 keys' (doc[b, j]: 32 values held at once on a 128-key tile). For a mask_mod that reads
// its inputs at key positions, tested before its tile's scores are issued (forward_wgmma, forward_wgmma_ws).
// Uniform over the warp.
template <int COLS, typename V>
__device__ __forceinline__ void accumulator_visibility(const V& visibility, int row0, int col0, int seq_k, unsigned (&bits)[2]) {
  static_assert(COLS % 8 == 0 && COLS <= 128, "whole 8-key tiles; a lane's COLS / 4 keys of a row fit one word");
  constexpr int WORDS = (COLS + 31) / 32;   // (Bc = 112: the last ballot's keys past the tile are not used)
  const int lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
  unsigned rows_of_lane[2][WORDS];   // rows group, group + 8: the key-by-lane ballots of their keys
#pragma unroll
  for (int r = 0; r < 16; ++r) {
#pragma unroll
    for (int m = 0; m < WORDS; ++m) {
      const int col = col0 + 32 * m + lane;
      const unsigned row_bits = __ballot_sync(0xffffffffu, visibility.visible_if(col < seq_k, row0 + r, col));
      if (r % 8 == group) rows_of_lane[r / 8][m] = row_bits;
    }
  }
  // key 8 t + 2 quad + e is bit 8 (t % 4) + 2 quad + e of word t / 4
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    bits[half] = 0u;
#pragma unroll
    for (int t = 0; t < COLS / 8; ++t) bits[half] |= ((rows_of_lane[half][t / 4] >> (8 * (t % 4) + 2 * quad)) & 3u) << (2 * t);
  }
}

// A block's walk over the tiles of its loop: key tiles of a query block (KEYS, the forwards) or query tiles
// of a key block (the backwards); tiles without a visible pair are never loaded. The mask kinds' tests are
// arithmetic and run tile by tile. A mask_mod's test (ACTIVE) reads its inputs' run-time summaries from
// memory: tested one after the other, those reads sat between one tile and the next (docs/decisions/0011-kernel-techniques.md). So with
// a mask_mod the block's threads classify THREADS tiles at once, one tile each, and keep two bits per tile
// in shared memory (a visible pair; the mask_mod sees every pair); the loop then reads bits.
// Uniform over its walkers: every one calls next() with the same arguments (a refill meets __syncthreads, or
// where the walkers are threads 0 .. THREADS - 1 of a larger block, named barrier BARRIER).
template <int THREADS, bool ACTIVE, int BARRIER = 0>
struct TileWalk {
  static constexpr int WORDS = THREADS / 32;
  static constexpr int SHARED_WORDS = ACTIVE ? 2 * WORDS : 1;   // for the template's __shared__ array
  static_assert(THREADS % 32 == 0, "whole warps");
  unsigned* bits;   // WORDS words of "holds a visible pair", then WORDS of "the mask_mod sees every pair"
  int first;        // the tiles held: [first, first + THREADS)

  __device__ explicit TileWalk(unsigned* shared_bits) : bits(shared_bits), first(-THREADS - 1) {}

  // The first tile t' >= t (of `tiles`, `size` positions each, ending at `extent`) with a visible pair:
  // key tiles against the rows [other0, other0 + other_count) (KEYS), or query tiles against those keys.
  template <bool KEYS, typename V>
  __device__ __forceinline__ int next(const V& visibility, int t, int tiles, int size, int other0, int other_count, int extent) {
    // (if constexpr / else: with a plain `if`, nvcc warned at every run-time compile that the loop after it is
    // unreachable in the !ACTIVE instantiation, #128-D)
    if constexpr (!ACTIVE) {
      auto visible = [&](int tile) {
        const int start = tile * size, length = min(size, extent - start);
        return KEYS ? visibility.tile_has_visible(other0, other_count, start, length)
                    : visibility.tile_has_visible(start, length, other0, other_count);
      };
      while (t < tiles && !visible(t)) ++t;
      return t;
    } else {
      while (t < tiles) {
        if (t < first || t >= first + THREADS) fill<KEYS>(visibility, t, tiles, size, other0, other_count, extent);
        int word = (t - first) / 32;
        unsigned held = bits[word] & (~0u << ((t - first) % 32));
        while (true) {
          if (held != 0u) return min(first + 32 * word + __ffs(held) - 1, tiles);
          if (++word == WORDS) break;
          held = bits[word];
        }
        t = first + THREADS;
      }
      return tiles;
    }
  }
  // Does the mask_mod see every pair of tile t (the tile next() returned last, or one held with it)?
  __device__ __forceinline__ bool mods_full(int t) const {
    return !ACTIVE || t >= first && t < first + THREADS && ((bits[WORDS + (t - first) / 32] >> ((t - first) % 32)) & 1u);
  }

 private:
  __device__ __forceinline__ static void walkers_meet() {
    if constexpr (BARRIER == 0) __syncthreads();
    else asm volatile("bar.sync %0, %1;\n" :: "n"(BARRIER), "n"(THREADS) : "memory");
  }
  template <bool KEYS, typename V>
  __device__ __forceinline__ void fill(const V& visibility, int t, int tiles, int size, int other0, int other_count, int extent) {
    walkers_meet();   // every walker is done reading the tiles held so far
    const int tile = t + threadIdx.x, start = tile * size, length = min(size, extent - start);
    bool visible = false, full = false;
    if (tile < tiles) {
      const int row0 = KEYS ? other0 : start, rows = KEYS ? other_count : length;
      const int col0 = KEYS ? start : other0, cols = KEYS ? length : other_count;
      visible = visibility.tile_has_visible(row0, rows, col0, cols);
      full = visible && visibility.mods.tile_all_visible(row0, row0 + rows - 1, col0, col0 + cols - 1);
    }
    const unsigned visible_bits = __ballot_sync(0xffffffffu, visible), full_bits = __ballot_sync(0xffffffffu, full);
    if (threadIdx.x % 32 == 0) {
      bits[threadIdx.x / 32] = visible_bits;
      bits[WORDS + threadIdx.x / 32] = full_bits;
    }
    first = t;
    walkers_meet();
  }
};

// ---- whole-row passes of the backward (_delta, _dq_convert, _kv_group_sum) -------------------
// Memory-bound passes over (batch, heads, rows, d) tensors, so they are written for bandwidth: a thread
// moves VEC contiguous elements (16 bytes of the caller's dtype) when every tensor's rows start 16-byte
// aligned, else one element; LANES threads (a power of two, at most a warp) share a row, and a warp
// takes 32 / LANES rows at a time. Row offsets are found once per row chunk with 32-bit division where
// the sizes allow (64-bit division by a run-time value costs tens of instructions).
template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T e[N]; };

// The widest vector (at most 16 bytes of T) whose width divides every d given (the user's and the padded).
template <typename T, int DATA_DIM, int HEAD_DIM, int OTHER_DIM = HEAD_DIM>
__host__ __device__ constexpr int row_vector() {
  int vec = 16 / (int)sizeof(T);
  while (vec > 1 && (DATA_DIM % vec != 0 || HEAD_DIM % vec != 0 || OTHER_DIM % vec != 0)) vec /= 2;
  return vec;
}

template <int CHUNKS>
__host__ __device__ constexpr int row_lanes() {
  int lanes = 1;
  while (lanes < CHUNKS && lanes < 32) lanes *= 2;
  return lanes;
}

// Whether a tensor's rows all start on a VEC-element boundary (its base and its three strides).
template <int VEC, typename T>
__device__ __forceinline__ bool rows_aligned(const void* base, const long long* stride) {
  return reinterpret_cast<uintptr_t>(base) % (VEC * sizeof(T)) == 0 && stride[0] % VEC == 0 && stride[1] % VEC == 0 &&
         stride[2] % VEC == 0;
}

// Flattened row r = (b * heads + h) * seq + n split into (b, h, n), and where it starts in a tensor.
struct RowIndex {
  long long b, h, n;
  __device__ __forceinline__ long long start(const long long* stride) const { return b * stride[0] + h * stride[1] + n * stride[2]; }
};
__device__ __forceinline__ RowIndex row_index(long long r, long long heads, long long seq, long long rows) {
  if (rows <= 0x7fffffffLL) {   // every index fits in 32 bits: unsigned division is a few instructions
    const unsigned int rr = (unsigned int)r, s = (unsigned int)seq, hh = (unsigned int)heads;
    const unsigned int bh = rr / s, b = bh / hh;
    return {b, bh - b * hh, rr - bh * s};
  }
  const long long bh = r / seq, b = bh / heads;
  return {b, bh - b * heads, r - bh * seq};
}
__device__ __forceinline__ long long row_start(long long r, long long heads, long long seq, long long rows,
                                               const long long* stride) {
  return row_index(r, heads, seq, rows).start(stride);
}

// Calls body(row, chunk) for every (row, chunk of VEC elements) of `rows` rows of CHUNKS chunks, and
// reduce(row, valid) once per row and warp step with every lane of the warp present (for shuffles).
// The grid walks the rows from the last one back: the main kernel's grid dispatches the (sequence, head) pairs
// in order, so the rows its last blocks wrote (dQ's accumulator, the dK / dV workspace), which L2 still holds
// when the pass after it starts, are the last rows; and the rows the pass before it touches last (D, the cleared
// accumulator, dO) are the first ones, which its first blocks read.
template <int CHUNKS, typename Body, typename Reduce>
__device__ __forceinline__ void for_row_chunks(long long rows, Body body, Reduce reduce) {
  constexpr int LANES = row_lanes<CHUNKS>();
  constexpr int ROWS_PER_WARP = 32 / LANES;
  const int warps = blockDim.x / 32, lane = threadIdx.x % LANES;
  const long long step = (long long)gridDim.x * warps * ROWS_PER_WARP;
  for (long long warp_row = ((long long)blockIdx.x * warps + threadIdx.x / 32) * ROWS_PER_WARP; warp_row < rows;
       warp_row += step) {   // the same bound for the whole warp
    const long long back = warp_row + (threadIdx.x % 32) / LANES;   // how far from the last row
    const bool valid = back < rows;
    const long long row = rows - 1 - back;
    if (valid)
      for (int c = lane; c < CHUNKS; c += LANES) body(row, c);
    reduce(row, valid);
  }
}

// D_i = rowsum(dO_i o O_i); the same threads clear the row's dq_accum (when the plan has one: the main
// kernel adds into it with atomics), which saves the host a memset launch per call.
template <int VEC, int DATA_DIM, int HEAD_DIM, typename T>
__device__ __forceinline__ void delta_rows_at_width(const AttentionArgs& args) {
  constexpr int CHUNKS = DATA_DIM / VEC, LANES = row_lanes<CHUNKS>();
  const long long rows = args.batch * args.heads * args.seq_q;
  float acc = 0.f;
  for_row_chunks<CHUNKS>(
      rows,
      [&](long long row, int c) {
        const Pack<T, VEC> d_o = *reinterpret_cast<const Pack<T, VEC>*>(
            static_cast<const T*>(args.d_o) + row_start(row, args.heads, args.seq_q, rows, args.do_stride) + c * VEC);
        const Pack<T, VEC> o = *reinterpret_cast<const Pack<T, VEC>*>(
            static_cast<const T*>(args.o) + row_start(row, args.heads, args.seq_q, rows, args.o_stride) + c * VEC);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc = fmaf(to_float(d_o.e[e]), to_float(o.e[e]), acc);
      },
      [&](long long row, bool valid) {
        const float total = lanes_sum<LANES>(acc);
        acc = 0.f;
        if (!valid) return;
        if (threadIdx.x % LANES == 0) args.delta[row] = args.d_lse == nullptr ? total : total - args.d_lse[row];
        if (args.dq_accum == nullptr) return;
        float* accum = args.dq_accum + row * HEAD_DIM;
        if (HEAD_DIM % 4 == 0)   // rows of whole float4s (every tensor-core plan); the SIMT plans' odd d one by one
          for (int c = threadIdx.x % LANES; c < HEAD_DIM / 4; c += LANES)
            reinterpret_cast<float4*>(accum)[c] = make_float4(0.f, 0.f, 0.f, 0.f);
        else
          for (int c = threadIdx.x % LANES; c < HEAD_DIM; c += LANES) accum[c] = 0.f;
      });
}

// dQ from the fp32 atomics buffer (rows of HEAD_DIM, padding included) into the caller's dtype and strides.
template <int VEC, int DATA_DIM, int HEAD_DIM, typename T>
__device__ __forceinline__ void dq_convert_rows_at_width(const AttentionArgs& args) {
  const long long rows = args.batch * args.heads * args.seq_q;
  for_row_chunks<DATA_DIM / VEC>(
      rows,
      [&](long long row, int c) {
        const Pack<float, VEC> accum = *reinterpret_cast<const Pack<float, VEC>*>(args.dq_accum + row * HEAD_DIM + c * VEC);
        Pack<T, VEC> dq;
#pragma unroll
        for (int e = 0; e < VEC; ++e) dq.e[e] = from_float<T>(accum.e[e]);
        *reinterpret_cast<Pack<T, VEC>*>(static_cast<T*>(args.dq) +
                                         row_start(row, args.heads, args.seq_q, rows, args.dq_stride) + c * VEC) = dq;
      },
      [](long long, bool) {});
}

// Grouped KV heads: dK, dV of one KV head are the sums of its group's per-query-head gradients, which the
// main kernel wrote into the dk/dv workspace (query head h of KV head g is g * kv_group + i). Added in fp32.
// dK's rows are DATA_DIM long, dV's VALUE_DIM: a chunk past one of them is the other's alone.
template <int VEC, int DATA_DIM, int VALUE_DIM, typename T>
__device__ __forceinline__ void kv_group_sum_rows_at_width(const AttentionArgs& args) {
  const long long kv_heads = args.heads / args.kv_group, rows = args.batch * kv_heads * args.seq_k;
  constexpr int WIDEST = DATA_DIM > VALUE_DIM ? DATA_DIM : VALUE_DIM;
  for_row_chunks<WIDEST / VEC>(
      rows,
      [&](long long row, int c) {
        // (true at compile time for the widest: equal d's compile as before there were two; the other reads zeros)
        const bool in_dk = DATA_DIM == WIDEST || c < DATA_DIM / VEC, in_dv = VALUE_DIM == WIDEST || c < VALUE_DIM / VEC;
        // row (b, g, n) of KV head g sums rows (b, g * kv_group + i, n) of the per-query-head workspace
        const RowIndex kv = row_index(row, kv_heads, args.seq_k, rows);
        float dk_total[VEC] = {}, dv_total[VEC] = {};
        for (long long i = 0; i < args.kv_group; ++i) {
          const RowIndex member{kv.b, kv.h * args.kv_group + i, kv.n};
          const Pack<T, VEC> dk = in_dk ? *reinterpret_cast<const Pack<T, VEC>*>(static_cast<const T*>(args.dk) + member.start(args.dk_stride) + c * VEC) : Pack<T, VEC>{};
          const Pack<T, VEC> dv = in_dv ? *reinterpret_cast<const Pack<T, VEC>*>(static_cast<const T*>(args.dv) + member.start(args.dv_stride) + c * VEC) : Pack<T, VEC>{};
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            dk_total[e] += to_float(dk.e[e]);
            dv_total[e] += to_float(dv.e[e]);
          }
        }
        Pack<T, VEC> dk_sum, dv_sum;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          dk_sum.e[e] = from_float<T>(dk_total[e]);
          dv_sum.e[e] = from_float<T>(dv_total[e]);
        }
        if (in_dk) *reinterpret_cast<Pack<T, VEC>*>(static_cast<T*>(args.dk_sum) + kv.start(args.dk_sum_stride) + c * VEC) = dk_sum;
        if (in_dv) *reinterpret_cast<Pack<T, VEC>*>(static_cast<T*>(args.dv_sum) + kv.start(args.dv_sum_stride) + c * VEC) = dv_sum;
      },
      [](long long, bool) {});
}

// The passes as the backward templates launch them: VEC-wide where every tensor the pass moves in Packs
// has its rows on a VEC-element boundary, one element at a time where not.
template <int DATA_DIM, int HEAD_DIM, typename T>
__device__ __forceinline__ void delta_rows(const AttentionArgs& args) {
  constexpr int VEC = row_vector<T, DATA_DIM, HEAD_DIM>();
  if (rows_aligned<VEC, T>(args.d_o, args.do_stride) && rows_aligned<VEC, T>(args.o, args.o_stride))
    delta_rows_at_width<VEC, DATA_DIM, HEAD_DIM, T>(args);
  else
    delta_rows_at_width<1, DATA_DIM, HEAD_DIM, T>(args);
}

template <int DATA_DIM, int HEAD_DIM, typename T>
__device__ __forceinline__ void dq_convert_rows(const AttentionArgs& args) {
  constexpr int VEC = row_vector<T, DATA_DIM, HEAD_DIM>();
  if (rows_aligned<VEC, T>(args.dq, args.dq_stride))
    dq_convert_rows_at_width<VEC, DATA_DIM, HEAD_DIM, T>(args);
  else
    dq_convert_rows_at_width<1, DATA_DIM, HEAD_DIM, T>(args);
}

template <int DATA_DIM, int VALUE_DIM, int HEAD_DIM, typename T>
__device__ __forceinline__ void kv_group_sum_rows(const AttentionArgs& args) {
  constexpr int VEC = row_vector<T, DATA_DIM, HEAD_DIM, VALUE_DIM>();
  if (rows_aligned<VEC, T>(args.dk, args.dk_stride) && rows_aligned<VEC, T>(args.dv, args.dv_stride) &&
      rows_aligned<VEC, T>(args.dk_sum, args.dk_sum_stride) && rows_aligned<VEC, T>(args.dv_sum, args.dv_sum_stride))
    kv_group_sum_rows_at_width<VEC, DATA_DIM, VALUE_DIM, T>(args);
  else
    kv_group_sum_rows_at_width<1, DATA_DIM, VALUE_DIM, T>(args);
}

// ---- tile movement -------------------------------------------------------------------------
// Copy rows [row0, row0 + ROWS) of one (batch, head) slice into shared memory with a row pitch;
// rows past `valid_rows` are zero so that padded lanes contribute nothing.
template <int ROWS, int HEAD_DIM, int PITCH, int THREADS, typename T>
__device__ __forceinline__ void load_tile(T* tile, const T* slice, long long row_stride, int row0, int valid_rows) {
  for (int idx = threadIdx.x; idx < ROWS * HEAD_DIM; idx += THREADS) {
    const int r = idx / HEAD_DIM, c = idx % HEAD_DIM;
    tile[r * PITCH + c] = r < valid_rows ? slice[(long long)(row0 + r) * row_stride + c] : from_float<T>(0.f);
  }
}

template <int HEAD_DIM, typename A, typename B>
__device__ __forceinline__ float dot_row(const A* a, const B* b) {
  float acc = 0.f;
#pragma unroll 8
  for (int e = 0; e < HEAD_DIM; ++e) acc = fmaf(to_float(a[e]), to_float(b[e]), acc);
  return acc;
}

// S = tau * score_mod(Q_i K_j^T) into a Br x Bc fp32 tile (log2 domain); masked and out-of-range entries -inf.
template <int BLOCK_R, int BLOCK_C, int HEAD_DIM, int K_PITCH, int THREADS, typename T, typename Vis>
__device__ __forceinline__ void masked_scores(float* s_tile, const T* q_tile, const T* k_tile, const Vis& visibility,
                                              int row0, int rows_here, int col0, int cols_here, float scale_log2) {
  for (int idx = threadIdx.x; idx < BLOCK_R * BLOCK_C; idx += THREADS) {
    const int r = idx / BLOCK_C, c = idx % BLOCK_C;
    const bool keep = visibility.visible_if((r < rows_here) & (c < cols_here), row0 + r, col0 + c);
    s_tile[idx] = keep ? visibility.modified_score(dot_row<HEAD_DIM>(q_tile + r * HEAD_DIM, k_tile + c * K_PITCH),
                                                   row0 + r, col0 + c) * scale_log2 : -INFINITY;
  }
}

// The CUDA-core forwards' softmax on one row of S in shared memory, a warp per row: the row's max, then
// P~ = exp2(S - m) written back (dropped entries 0, kept ones scaled after the sum) and rowsum(P~) before dropout.
template <int BLOCK_C>
__device__ __forceinline__ float row_max_in_warp(const float* s_row, int lane) {
  float tile_max = -INFINITY;
  for (int c = lane; c < BLOCK_C; c += 32) tile_max = fmaxf(tile_max, s_row[c]);
  return warp_max(tile_max);
}
template <int BLOCK_C, bool HAS_DROPOUT>
__device__ __forceinline__ float exponentiate_row_in_warp(float* s_row, float m_use, int lane, const AttentionArgs& args,
                                                          long long bh, int row, int col0, unsigned threshold,
                                                          float keep_scale) {
  float tile_sum = 0.f;
  for (int c = lane; c < BLOCK_C; c += 32) {
    float p = exp2f(s_row[c] - m_use);
    tile_sum += p;
    if (HAS_DROPOUT) p = dropout_keep(args, bh, row, col0 + c, threshold) ? p * keep_scale : 0.f;
    s_row[c] = p;
  }
  return warp_sum(tile_sum);
}

}  // namespace fagen
