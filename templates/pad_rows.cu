// Copies rows of WIDTH 2-byte elements (fp16 / bf16) into rows of PADDED elements, zero after WIDTH:
// fagen.torch's route for head dims that are not multiples of 8 (fagen/pad_rows.py). The attention kernels
// load a row as whole 16-byte copies only where it is a multiple of 8 elements wide and 16-byte aligned;
// a d = 59 row is neither, and loaded 4 or 2 bytes at a time the kernels ran 1.3-6x slower than at d = 64.
// One launch pads q, k and v (or dO alone): blockIdx.y picks the tensor. A block pads a run of rows
// through shared memory: each warp reads whole rows (lane c reads column c: one contiguous span per load
// instruction, wherever the row starts), several rows' loads in flight at once; then every thread writes one
// 16-byte chunk of the padded rows, which are contiguous. The source may have any outer strides.
#include <cstdint>

namespace fagen_pad {

constexpr int CHUNK = 8;   // 2-byte elements in a 16-byte store

struct Operand {
    const uint16_t* source;
    uint16_t* padded;            // contiguous (rows, PADDED)
    long long extent[2];         // the source's second and third outer dims (the first is rows / both)
    long long stride[3];         // the source's outer strides, in elements
    long long rows;
};

struct Args {
    Operand operand[3];
    long long width;             // the source's last dim
    long long padded_width;      // a multiple of CHUNK
    long long count;             // how many of operand[] are in use
};

}  // namespace fagen_pad

namespace fagen_pad {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr int TILE = THREADS * CHUNK;   // padded elements a block writes per step (4 KB)
constexpr int UNROLL = 4;               // rows whose loads a warp issues together

// COLUMN_STEPS = ceil(padded width / 32): the columns of a row a lane covers (c = lane + 32 s)
template <int COLUMN_STEPS>
__device__ __forceinline__ void pad_rows(const Args& args) {
    static_assert(COLUMN_STEPS * 32 <= TILE / WARPS, "a padded row is at most 256 elements (one per warp and step)");
    __shared__ __align__(16) uint16_t tile[TILE];
    if (blockIdx.y >= args.count) return;
    const Operand& t = args.operand[blockIdx.y];
    const int width = static_cast<int>(args.width), padded = static_cast<int>(args.padded_width);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int rows_per_warp = TILE / padded / WARPS;
    const int step_rows = rows_per_warp * WARPS;
    const long long rows = t.rows, extent1 = t.extent[0], extent2 = t.extent[1];
    for (long long row0 = static_cast<long long>(blockIdx.x) * step_rows; row0 < rows;
         row0 += static_cast<long long>(gridDim.x) * step_rows) {
        // this warp's rows: the first one's coordinates by division, the next ones' by carrying
        long long row = row0 + warp * rows_per_warp;
        long long i2 = row % extent2, i1 = (row / extent2) % extent1, i0 = row / extent2 / extent1;
        for (int j = 0; j < rows_per_warp; j += UNROLL) {
            uint16_t values[UNROLL][COLUMN_STEPS];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const bool live = j + u < rows_per_warp && row + u < rows;
                const uint16_t* source = t.source + i0 * t.stride[0] + i1 * t.stride[1] + i2 * t.stride[2];
#pragma unroll
                for (int s = 0; s < COLUMN_STEPS; ++s) {
                    const int c = lane + 32 * s;
                    values[u][s] = live && c < width ? __ldg(source + c) : uint16_t(0);
                }
                if (++i2 == extent2) {
                    i2 = 0;
                    if (++i1 == extent1) { i1 = 0; ++i0; }
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
                for (int s = 0; s < COLUMN_STEPS; ++s) {
                    const int c = lane + 32 * s;
                    if (c < padded && j + u < rows_per_warp) tile[(warp * rows_per_warp + j + u) * padded + c] = values[u][s];
                }
            }
            row += UNROLL;
        }
        __syncthreads();
        const long long elements = min(static_cast<long long>(step_rows), rows - row0) * padded;
        const int e = threadIdx.x * CHUNK;
        if (e < elements)
            *reinterpret_cast<uint4*>(t.padded + row0 * padded + e) = *reinterpret_cast<const uint4*>(tile + e);
        __syncthreads();   // the tile is refilled by the next step
    }
}

}  // namespace fagen_pad

// One entry per ceil(padded width / 32); fagen/pad_rows.py picks it.
#define FAGEN_PAD_ROWS(STEPS) \
    extern "C" __global__ void __launch_bounds__(fagen_pad::THREADS) fagen_pad_rows_##STEPS(const fagen_pad::Args args) { \
        fagen_pad::pad_rows<STEPS>(args); \
    }
FAGEN_PAD_ROWS(1)
FAGEN_PAD_ROWS(2)
FAGEN_PAD_ROWS(3)
FAGEN_PAD_ROWS(4)
FAGEN_PAD_ROWS(5)
FAGEN_PAD_ROWS(6)
FAGEN_PAD_ROWS(7)
FAGEN_PAD_ROWS(8)
