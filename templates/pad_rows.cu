// Copies rows of WIDTH 2-byte elements (fp16 / bf16) into rows of PADDED elements, zero after WIDTH:
// fagen.torch's route for head dims that are not multiples of 8 (fagen/pad_rows.py). The attention kernels
// load a row as whole 16-byte copies only where it is a multiple of 8 elements wide and 16-byte aligned;
// a d = 59 row is neither, and loaded 4 or 2 bytes at a time the kernels ran 1.3-6x slower than at d = 64.
// One launch pads q, k and v (or dO alone): blockIdx.y picks the tensor. Each thread writes one 16-byte
// chunk of a padded row (so every store is whole and aligned) from 2-byte reads of the source row, which
// may start anywhere and have any strides but a unit last one.
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

// fagen/pad_rows.py packs Args as 27 eight-byte fields (struct.Struct "<" + "QQqqqqqq" * 3 + "qqq")
static_assert(sizeof(Operand) == 64 && sizeof(Args) == 216, "Args must match fagen/pad_rows.py's _ARGS");

}  // namespace fagen_pad

extern "C" __global__ void __launch_bounds__(256) fagen_pad_rows(const fagen_pad::Args args) {
    using namespace fagen_pad;
    if (blockIdx.y >= args.count) return;
    const Operand& t = args.operand[blockIdx.y];
    const int width = static_cast<int>(args.width);
    const int chunks_per_row = static_cast<int>(args.padded_width / CHUNK);
    // the host keeps rows * chunks_per_row + the grid's stride below 2^31, so 32-bit indices and divisions
    // suffice (the loop's last step cannot wrap)
    const int chunks = static_cast<int>(t.rows) * chunks_per_row;
    const int extent1 = static_cast<int>(t.extent[0]), extent2 = static_cast<int>(t.extent[1]);
    for (int chunk = blockIdx.x * blockDim.x + threadIdx.x; chunk < chunks; chunk += gridDim.x * blockDim.x) {
        const int row = chunk / chunks_per_row;
        const int column = (chunk - row * chunks_per_row) * CHUNK;
        const int i2 = row % extent2, i01 = row / extent2;
        const int i1 = i01 % extent1, i0 = i01 / extent1;
        const uint16_t* source = t.source + i0 * t.stride[0] + i1 * t.stride[1] + i2 * t.stride[2] + column;
        uint16_t values[CHUNK];
#pragma unroll
        for (int e = 0; e < CHUNK; ++e) values[e] = column + e < width ? __ldg(source + e) : uint16_t(0);
        uint4 packed;
        packed.x = values[0] | (uint32_t(values[1]) << 16);
        packed.y = values[2] | (uint32_t(values[3]) << 16);
        packed.z = values[4] | (uint32_t(values[5]) << 16);
        packed.w = values[6] | (uint32_t(values[7]) << 16);
        *reinterpret_cast<uint4*>(t.padded + static_cast<long long>(chunk) * CHUNK) = packed;
    }
}
