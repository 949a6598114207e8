// fagen: Hopper warpgroup-MMA primitives (templates/warpgroup_mma.cuh), for sm_90a.
// wgmma.mma_async is issued by a warpgroup (4 consecutive warps) and reads its B operand (and A,
// unless A comes from registers) straight from shared memory through a 64-bit matrix descriptor.
// fagen keeps every wgmma operand tile in a swizzled layout (Swizzle below): the tile is cut into panels
// of whole swizzle rows, each panel stores its rows at that pitch, and the 16-byte chunks of a row are
// permuted by the row's phase. That spreads any 8 rows of one chunk column over all 32 banks, which is
// both what the tensor cores expect and conflict-free for cp.async.
// The accumulator layout of m64nNk16 per warp equals mma.sync's m16n8 tiles side by side: warp w of
// the group holds rows 16w .. 16w + 15, and `fagen::tc` fragment code applies unchanged.
#pragma once
#include "tensor_core.cuh"

namespace fagen {
namespace wg {

constexpr int TILE_ALIGN = 1024;  // the largest swizzle atom (8 rows x 128 B): every tile starts on such a boundary

// Descriptor bits (PTX ISA, "Matrix Descriptor Format"): start address, leading and stride byte offsets
// (all >> 4), the swizzle mode in bits 62-63 (1 = 128-byte, 2 = 64-byte).
__device__ __forceinline__ unsigned long long descriptor(unsigned address, unsigned leading_bytes, unsigned stride_bytes,
                                                         unsigned long long mode) {
  return (unsigned long long)((address & 0x3FFFF) >> 4)
       | (unsigned long long)((leading_bytes >> 4) & 0x3FFF) << 16
       | (unsigned long long)((stride_bytes >> 4) & 0x3FFF) << 32
       | mode << 62;
}

// The layout of a tile whose rows hold COLUMNS fp16/bf16 elements.
//   COLUMNS a multiple of 64: 128-byte swizzle. Panels of 64 columns, 8-row atoms of 1 KB; the 16-byte
//     chunk c of row r sits at chunk position c ^ (r % 8).
//   Otherwise (d = 32, 96, 160, 224): 64-byte swizzle. Panels of 32 columns, 8-row atoms of 512 B; chunk c
//     of row r sits at c ^ ((r / 2) % 4).
// Both are the hardware's rule (address bits 7.. XOR-ed into bits 4..) written per row; 64-byte panels let
// a head dim that is an odd number of 32-column halves run on wgmma without padding it to 64. A template may ask
// for 64-byte panels at any multiple of 32 (PANEL_BYTES): backward_wgmma_wide, whose warpgroups read d = 192 in
// halves of 96 columns, each of which must start on a panel.
// ELEMENT_BYTES 1 (fp8; Swizzle8Bit below): the same rule over rows of COLUMNS bytes.
template <int COLUMNS, int PANEL_BYTES = COLUMNS % 64 == 0 ? 128 : 64, int ELEMENT_BYTES = 2>
struct Swizzle {
  static_assert((PANEL_BYTES == 128 || PANEL_BYTES == 64) && COLUMNS * ELEMENT_BYTES % PANEL_BYTES == 0,
                "whole swizzle panels");
  static constexpr int ROW_BYTES = PANEL_BYTES;                    // bytes per row within a panel
  static constexpr int PANEL_COLUMNS = ROW_BYTES / ELEMENT_BYTES;
  static constexpr int PANELS = COLUMNS * ELEMENT_BYTES / PANEL_BYTES;
  static constexpr int CHUNKS = ROW_BYTES / 16;                    // 16-byte chunks per panel row
  static constexpr int ATOM_BYTES = 8 * ROW_BYTES;                 // the pattern repeats every 8 rows
  static constexpr unsigned long long MODE = ROW_BYTES == 128 ? 1 : 2;
  static_assert(TILE_ALIGN % ATOM_BYTES == 0, "atoms stay aligned");

  // Byte offset of the 16-byte chunk `chunk` (counted across panels) of row `row` in a tile of `rows` rows.
  static __device__ __forceinline__ unsigned offset(int rows, int row, int chunk) {
    const int panel = chunk / CHUNKS, within = chunk % CHUNKS;
    const int phase = ROW_BYTES == 128 ? row % 8 : (row / 2) % 4;
    return panel * rows * ROW_BYTES + row * ROW_BYTES + ((within ^ phase) << 4);
  }
  // K-major operand (the reduction dimension contiguous, e.g. Q or K for S = Q K^T): the stride offset steps
  // from one 8-row atom to the next; the leading offset is unused (1).
  static __device__ __forceinline__ unsigned long long k_major(unsigned address) {
    return descriptor(address, 16, ATOM_BYTES, MODE);
  }
  // MN-major operand (e.g. V for O = P V, read transposed): the leading offset steps from one panel to the
  // next (`rows` rows each), the stride offset from one 8-row atom to the next.
  static __device__ __forceinline__ unsigned long long mn_major(unsigned address, int rows) {
    return descriptor(address, rows * ROW_BYTES, ATOM_BYTES, MODE);
  }
  // What a k-step (16 elements, or 32 fp8 ones: 32 bytes either way) adds to a descriptor (>> 4, never carrying out
  // of the 14-bit address field: shared addresses stay below 256 KB). K-major: 32 bytes along a swizzled row, past a
  // panel's end the next panel. MN-major: 16 rows, two 8-row atoms.
  __host__ __device__ static constexpr unsigned long long k_major_step(int rows, int kk) {
    return ((kk / (ROW_BYTES / 32)) * rows * ROW_BYTES + (kk % (ROW_BYTES / 32)) * 32) >> 4;
  }
  __host__ __device__ static constexpr unsigned long long mn_major_step(int kk) { return (kk * 2 * ATOM_BYTES) >> 4; }
};

// An fp8 tile's layout: rows of COLUMNS bytes in 128-byte panels, or 64-byte ones where COLUMNS is an odd number of 64.
template <int COLUMNS>
using Swizzle8Bit = Swizzle<COLUMNS, COLUMNS % 128 == 0 ? 128 : 64, 1>;

// V_j's KEYS x COLUMNS fp8 tile `raw` (RawLayout: V's rows as in memory) into V_j^T at `transposed` (TLayout:
// COLUMNS rows of KEYS keys), the B operand of O += P~ V, which FP8 wgmma reads K-major only. Within each 16
// keys, byte 4 b + i of a row holds key 8 (i / 2) + 2 b + i % 2: the order P~'s accumulators already have as FP8
// wgmma's register A operand (tc::accumulators_to_a_fp8), so no lane trades values. Warp w moves 16 keys x 32
// columns at a time, of groups w, w + WARPS, ...: ldmatrix.trans reads keys 0-7 and 8-15 of two 16-column chunks as
// 16-bit pairs (a lane gets keys 2 b, 2 b + 1 of columns 2 c, 2 c + 1), byte permutes make each column's 4 keys a
// word, and stmatrix writes word b of each column's row. All THREADS threads call it.
template <int KEYS, int COLUMNS, int THREADS, typename RawLayout, typename TLayout>
__device__ __forceinline__ void transpose_values_fp8(unsigned raw, unsigned transposed) {
  constexpr int WARPS = THREADS / 32, GROUPS = KEYS / 16;
  static_assert(KEYS % 16 == 0 && COLUMNS % 32 == 0 && (WARPS & (WARPS - 1)) == 0 && TLayout::ROW_BYTES == KEYS,
                "whole 16-key groups, pairs of 16-column chunks, a power-of-2 warp count, V^T's rows one panel");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, matrix = lane / 8, row = lane % 8;
  // This lane's row of the warp's first unit (group `warp`, columns 0-31). The others are constants away: 16 key rows
  // keep a row's swizzle phase, and an even chunk pair (of V) or the groups WARPS apart (of V^T: WARPS, a power of 2,
  // lies above `warp`'s bits) change a chunk's bits alone, which the phase XORs.
  const unsigned from0 = RawLayout::offset(KEYS, 16 * warp + 8 * (matrix % 2) + row, matrix / 2);  // keys 0-7 / 8-15
  const unsigned to0 = TLayout::offset(COLUMNS, 16 * (matrix / 2) + 2 * row + matrix % 2, warp);   // V^T rows 2 r, + 1
#pragma unroll
  for (int k = 0; k < (GROUPS + WARPS - 1) / WARPS; ++k) {
    if (warp + k * WARPS >= GROUPS) break;
#pragma unroll
    for (int pair = 0; pair < COLUMNS / 32; ++pair) {
      constexpr int CHUNKS = RawLayout::CHUNKS;
      const unsigned from = raw + ((from0 ^ ((2 * pair % CHUNKS) << 4)) + (2 * pair / CHUNKS) * KEYS * RawLayout::ROW_BYTES
                                   + k * WARPS * 16 * RawLayout::ROW_BYTES);
      unsigned x[4];
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3]) : "r"(from) : "memory");
      const unsigned to = transposed + ((to0 ^ ((k * WARPS) << 4)) + 32 * pair * TLayout::ROW_BYTES);
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                   :: "r"(to), "r"(__byte_perm(x[0], x[1], 0x6420)), "r"(__byte_perm(x[0], x[1], 0x7531)),
                      "r"(__byte_perm(x[2], x[3], 0x6420)), "r"(__byte_perm(x[2], x[3], 0x7531)) : "memory");
    }
  }
}

// Rows [row0, row0 + ROWS) of one (batch, head) slice into a swizzled shared tile; rows at or past
// valid_rows are zero-filled so that they add nothing to any product. Each thread copies one fixed
// 16-byte column chunk of every (THREADS / chunks-per-row)-th row: when that row step is a multiple of 8
// the swizzle phase never changes, so every copy after the first is a constant offset away, and the thread
// steps one source pointer down its rows (a row past valid_rows: 0 bytes read from it, 16 zero-filled): about
// 6 instructions a copy instead of 15. (tc::async_load_rows, the mma.sync templates' padded tiles, keeps its loop
// by index: at 255 registers on sm_80, every change to it moved ptxas's spills into forwards; docs/decisions/0011-kernel-techniques.md.)
// PANEL_BYTES: the tile's Swizzle (its default, or what the template's Layout asks for).
template <int ROWS, int HEAD_DIM, int THREADS, int PANEL_BYTES = Swizzle<HEAD_DIM>::ROW_BYTES, typename T>
__device__ __forceinline__ void async_load_rows_swizzled(unsigned tile, const T* slice, long long row_stride, int row0, int valid_rows,
                                                         int valid_cols = HEAD_DIM) {
  constexpr int CHUNKS_PER_ROW = HEAD_DIM * sizeof(T) / 16;
  constexpr int PER_CHUNK = 16 / sizeof(T);
  constexpr int ROW_STEP = THREADS / CHUNKS_PER_ROW;
  using Layout = Swizzle<HEAD_DIM, PANEL_BYTES, sizeof(T)>;
  if (valid_cols % PER_CHUNK != 0) {   // rows not whole 16-byte chunks: 4-byte copies (or elements) into the same places
    tc::load_rows_by_words<ROWS, HEAD_DIM, THREADS>(
        [=](int r, int c) { return tile + Layout::offset(ROWS, r, c / PER_CHUNK) + unsigned(c % PER_CHUNK * sizeof(T)); },
        slice, row_stride, row0, valid_rows, valid_cols);
    return;
  }
  if constexpr (THREADS % CHUNKS_PER_ROW == 0 && ROW_STEP % 8 == 0 && ROWS % ROW_STEP == 0) {
    const int c = threadIdx.x % CHUNKS_PER_ROW, r0 = threadIdx.x / CHUNKS_PER_ROW;
    const unsigned dst = tile + Layout::offset(ROWS, r0, c);
    const T* src = slice + (long long)(row0 + r0) * row_stride + c * PER_CHUNK;
    const long long src_step = ROW_STEP * row_stride;
    const int rows_left = valid_rows - r0;
    const bool cols_here = c * PER_CHUNK < valid_cols;
#pragma unroll
    for (int n = 0; n < ROWS / ROW_STEP; ++n) {
      tc::cp_async_16(dst + n * ROW_STEP * Layout::ROW_BYTES, src, rows_left > n * ROW_STEP && cols_here);
      src += src_step;
    }
  } else {
    for (int chunk = threadIdx.x; chunk < ROWS * CHUNKS_PER_ROW; chunk += THREADS) {
      const int r = chunk / CHUNKS_PER_ROW, c = chunk % CHUNKS_PER_ROW;
      const bool valid = r < valid_rows && c * PER_CHUNK < valid_cols;
      tc::cp_async_16(tile + Layout::offset(ROWS, r, c), slice + (valid ? (long long)(row0 + r) * row_stride + c * PER_CHUNK : 0), valid);
    }
  }
}

// Ordering: wgmma.fence before the first wgmma that touches registers other instructions wrote;
// commit closes a group of issued wgmmas; wait<N> blocks until at most N groups are in flight.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
// cp.async writes through the generic proxy, wgmma reads through the async proxy: each writer
// fences after its copies land and before the barrier that publishes them.
__device__ __forceinline__ void fence_async_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Rows [row0, row0 + ROWS) into a swizzled shared tile as above, from rows that need not be evenly spaced:
// rows_at.offset(r) is row r's place (fagen::PagedRows, a paged K/V cache); valid_cols whole 16-byte chunks (the host
// refuses paged caches otherwise). As above, each thread copies one column chunk of every ROW_STEP-th row. Where a
// warp's rows line up with its lanes, each lane looks up one of the warp's rows (its block-table read and page
// arithmetic once, all in flight together) and shuffles hand the offsets to the lanes that copy that row
// (docs/decisions/0010-paged-loads.md). All THREADS threads call it together.
template <int ROWS, int HEAD_DIM, int THREADS, int PANEL_BYTES = Swizzle<HEAD_DIM>::ROW_BYTES, typename RowsAt>
__device__ __forceinline__ void async_load_rows_swizzled_at(unsigned tile, const RowsAt& rows_at, int row0, int valid_rows,
                                                            int valid_cols) {
  using T = typename RowsAt::element_type;
  constexpr int CHUNKS_PER_ROW = HEAD_DIM * sizeof(T) / 16;
  constexpr int PER_CHUNK = 16 / sizeof(T);
  constexpr int ROW_STEP = THREADS / CHUNKS_PER_ROW;
  using Layout = Swizzle<HEAD_DIM, PANEL_BYTES, sizeof(T)>;
  if constexpr (THREADS % CHUNKS_PER_ROW == 0 && ROWS % ROW_STEP == 0 &&
                (32 % CHUNKS_PER_ROW == 0 || CHUNKS_PER_ROW % 32 == 0)) {
    constexpr int N = ROWS / ROW_STEP;                                            // rows a thread copies
    constexpr int WARP_ROWS_PER_STEP = CHUNKS_PER_ROW < 32 ? 32 / CHUNKS_PER_ROW : 1;
    constexpr int LOOKUPS = (WARP_ROWS_PER_STEP * N + 31) / 32;                   // of the warp's rows, per lane
    const int lane = threadIdx.x % 32, c = threadIdx.x % CHUNKS_PER_ROW, r0 = threadIdx.x / CHUNKS_PER_ROW;
    const int warp_r0 = (threadIdx.x - lane) / CHUNKS_PER_ROW, local = r0 - warp_r0;
    // The warp's k-th row is warp_r0 + k % WARP_ROWS_PER_STEP + (k / WARP_ROWS_PER_STEP) * ROW_STEP.
    long long found[LOOKUPS];
#pragma unroll
    for (int s = 0; s < LOOKUPS; ++s) {
      const int k = s * 32 + lane;
      const int r = warp_r0 + k % WARP_ROWS_PER_STEP + (k / WARP_ROWS_PER_STEP) * ROW_STEP;
      found[s] = k < WARP_ROWS_PER_STEP * N && r < valid_rows ? rows_at.offset(row0 + r) : 0;
    }
    const bool cols_here = c * PER_CHUNK < valid_cols;
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const int k = local + n * WARP_ROWS_PER_STEP;   // never crosses a 32-lane slot: WARP_ROWS_PER_STEP divides 32
      const long long offset = __shfl_sync(0xffffffffu, found[n * WARP_ROWS_PER_STEP / 32], k % 32);
      const int r = r0 + n * ROW_STEP;
      tc::cp_async_16(tile + Layout::offset(ROWS, r, c), rows_at.head_rows + offset + c * PER_CHUNK,
                      r < valid_rows && cols_here);
    }
  } else {
    for (int chunk = threadIdx.x; chunk < ROWS * CHUNKS_PER_ROW; chunk += THREADS) {
      const int r = chunk / CHUNKS_PER_ROW, c = chunk % CHUNKS_PER_ROW;
      const bool valid = r < valid_rows && c * PER_CHUNK < valid_cols;
      tc::cp_async_16(tile + Layout::offset(ROWS, r, c), rows_at.head_rows + (valid ? rows_at.offset(row0 + r) + c * PER_CHUNK : 0),
                      valid);
    }
  }
}

// A tile of keys from a paged cache (async_load_key_rows): pages of whole tiles (page_size a multiple of ROWS; tiles
// start at multiples of ROWS) hold each tile in one page, found once, then copied as contiguous rows; smaller pages
// through async_load_rows_swizzled_at's lookups. A call rather than inlined: inlined beside the contiguous copies, it
// made ptxas spill (docs/decisions/0010-paged-loads.md).
template <int ROWS, int HEAD_DIM, int THREADS, int PANEL_BYTES, typename T>
__device__ __noinline__ void async_load_paged_rows(unsigned tile, const PagedRows<T> rows_at, int col0, int valid_rows,
                                                   int valid_cols) {
  if (rows_at.page_size % ROWS == 0) {
    const long long page = key_page(rows_at.table_row, col0, rows_at.page_size, rows_at.page_count);
    async_load_rows_swizzled<ROWS, HEAD_DIM, THREADS, PANEL_BYTES>(tile, rows_at.head_rows + page * rows_at.page_stride,
                                                                   rows_at.row_stride, col0 % rows_at.page_size,
                                                                   valid_rows, valid_cols);
  } else {
    async_load_rows_swizzled_at<ROWS, HEAD_DIM, THREADS, PANEL_BYTES>(tile, rows_at, col0, valid_rows, valid_cols);
  }
}

// K_j's or V_j's rows [col0, col0 + valid_rows) of one (sequence, K/V head) into a swizzled tile: `slice` from
// Problem::key_rows, `stride` the tensor's (batch or page, head, row) strides; through sequence b's row of the
// block table where the call passed a paged cache (async_load_paged_rows).
template <int ROWS, int HEAD_DIM, int THREADS, int PANEL_BYTES = Swizzle<HEAD_DIM>::ROW_BYTES, typename T>
__device__ __forceinline__ void async_load_key_rows(unsigned tile, const AttentionArgs& args, long long b, const T* slice,
                                                    const long long (&stride)[3], int col0, int valid_rows, int valid_cols) {
  if (args.block_table == nullptr) {
    async_load_rows_swizzled<ROWS, HEAD_DIM, THREADS, PANEL_BYTES>(tile, slice, stride[2], col0, valid_rows, valid_cols);
  } else {
    async_load_paged_rows<ROWS, HEAD_DIM, THREADS, PANEL_BYTES>(tile, PagedRows<T>(args, b, slice, stride), col0,
                                                                valid_rows, valid_cols);
  }
}

// ---- a warp-specialized block's stages: mbarriers (8 bytes of shared memory each, by shared address) ----
// A stage is "full" once the producer's copies into it landed and "empty" once every consumer is done
// reading it; each side waits on the other's barrier with the phase parity it expects, so the warpgroups
// of one block no longer meet at a block-wide barrier every step.
__device__ __forceinline__ void barrier_init(unsigned barrier, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(barrier), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void barrier_arrive(unsigned barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(barrier) : "memory");
}
// A "full" barrier, completed by COPIERS threads each calling barrier_arrive_when_copied once per phase: two
// arrivals each, one when the thread's cp.async copies issued so far land (.noinc: counted in the init) and a
// plain one, whose release also publishes what the thread wrote with ordinary stores (rows of odd length are
// copied element by element: tc::load_rows_by_elements). Without .noinc (the copies' arrival raising the pending
// count itself) the protocol is the same, but compute-sanitizer's synccheck reports each thread's second arrival
// as a missing wait (dev/gpu/probes/mbarrier_synccheck.cu).
__device__ __forceinline__ void copy_barrier_init(unsigned barrier, unsigned copiers) {
  barrier_init(barrier, 2 * copiers);
}
__device__ __forceinline__ void barrier_arrive_when_copied(unsigned barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(barrier) : "memory");
  barrier_arrive(barrier);
}
__device__ __forceinline__ void barrier_wait(unsigned barrier, unsigned parity) {
  unsigned done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(barrier), "r"(parity) : "memory");
  } while (!done);
}

// ---- the Tensor Memory Accelerator: a tile copied by one thread through a tensor map the host encoded ----
// A tensor map (CUtensorMap: 128 opaque bytes from cuTensorMapEncodeTiled), and the kernel parameter that holds
// q's, k's, v's (and a backward's dO's) over (column, row, head, batch entry), one box a column panel of the tiles' Swizzle
// (fagen/runtime/tensor_maps.py). `enabled` is 0 where the call's tensors cannot be mapped (a paged cache, strides
// off 16 bytes): the loads then go through cp.async. __grid_constant__ keeps the maps in parameter space, where the
// TMA reads them.
struct alignas(64) TensorMap { unsigned long long opaque[16]; };
struct TensorMaps {
  TensorMap q, k, v, d_o;
  int enabled;
};
static_assert(sizeof(TensorMaps) == 576, "fagen/runtime/tensor_maps.py PARAMETER_BYTES");
// The TMA's completions see the barriers initialised (the async proxy): once, after the mbarrier.inits.
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" :: "l"(&map) : "memory");
}
// The barrier's current phase also waits for `bytes` of TMA copies (before they are issued; no arrival).
__device__ __forceinline__ void barrier_expect_bytes(unsigned barrier, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" :: "r"(barrier), "r"(bytes) : "memory");
}
// Rows [row, row + ROWS) of (head, entry) into a tile of Layout, a box of the map per column panel; each box's
// bytes (the map's zeros past its rows and columns included) count towards `barrier`'s expected bytes.
template <int ROWS, typename Layout>
__device__ __forceinline__ void tma_load_rows(unsigned tile, const TensorMap& map, unsigned barrier, int row, int head,
                                              int entry) {
#pragma unroll
  for (int p = 0; p < Layout::PANELS; ++p)
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 :: "r"(tile + p * ROWS * Layout::ROW_BYTES), "l"(&map), "r"(p * Layout::PANEL_COLUMNS), "r"(row),
                    "r"(head), "r"(entry), "r"(barrier) : "memory");
}

// Registers per thread of the calling warpgroup from here on (a multiple of 8): the producer gives its
// share to the consumers, whose accumulators need more than an even split of the block's registers.
template <int REGISTERS> __device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REGISTERS));
}
template <int REGISTERS> __device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REGISTERS));
}
// Named barrier ID (1..15; 0 is __syncthreads') over THREADS threads: sync waits, arrive only counts. Both
// immediates: with a barrier number in a register, ptxas serialised the wgmmas around an arrive.
template <int ID, int THREADS> __device__ __forceinline__ void named_barrier_sync() {
  asm volatile("bar.sync %0, %1;\n" :: "n"(ID), "n"(THREADS) : "memory");
}
template <int ID, int THREADS> __device__ __forceinline__ void named_barrier_arrive() {
  asm volatile("bar.arrive %0, %1;\n" :: "n"(ID), "n"(THREADS) : "memory");
}

// target[0..3] += value where `when`: one 16-byte fp32 reduction (sm_90), predicated rather than branched around.
__device__ __forceinline__ void add_four_if(float* target, float4 value, bool when) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n@p red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n}\n"
               :: "l"(target), "f"(value.x), "f"(value.y), "f"(value.z), "f"(value.w), "r"(int(when)) : "memory");
}

// Keeps the compiler from moving reads or writes of accumulators across an in-flight wgmma.
template <int TILES>
__device__ __forceinline__ void fence_registers(float (&acc)[TILES][4]) {
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[t][e]) :: "memory");
}
template <int TILES>
__device__ __forceinline__ void fence_registers(unsigned (&fragments)[TILES][4]) {
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(fragments[t][e]) :: "memory");
}

}  // namespace wg
}  // namespace fagen
