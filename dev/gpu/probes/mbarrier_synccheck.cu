// Which mbarrier patterns does compute-sanitizer's synccheck call "Missing wait"? One producer warp copies
// with cp.async and arrives; one consumer warp waits. Variants (the first argument): 0 the copies' arrival
// without .noinc, then a plain arrival; 1 .noinc alone; 2 as 0 with a tail waiting on the last phases; 3 as 2,
// each stage's previous phase also waited for; 4 wait_all, then a plain arrival; 5 .noinc, then a plain arrival,
// the full barriers counting two arrivals per thread. Seen on an H200 (2026-12-01): synccheck reports "Missing
// wait" for 0, 2 and 3, nothing for 1 and 4 (5: see docs/decisions/0007-mbarrier-noinc.md).
#include <cstdio>
__device__ __forceinline__ unsigned saddr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void init(unsigned b, unsigned n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(b), "r"(n) : "memory"); }
__device__ __forceinline__ void arrive(unsigned b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(b) : "memory"); }
__device__ __forceinline__ void arrive_copied(unsigned b) { asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" :: "r"(b) : "memory"); }
__device__ __forceinline__ void arrive_copied_noinc(unsigned b) { asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(b) : "memory"); }
__device__ __forceinline__ void wait(unsigned b, unsigned parity) {
  unsigned done;
  do { asm volatile("{.reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p;}" : "=r"(done) : "r"(b), "r"(parity) : "memory"); } while (!done);
}
__global__ void k(int variant, const float* in, float* out, int rounds) {
  __shared__ alignas(16) float tile[2][32];
  __shared__ alignas(8) unsigned long long full[2], empty[2];
  const int t = threadIdx.x, lane = t % 32;
  if (t == 0) for (int s = 0; s < 2; ++s) { init(saddr(&full[s]), variant == 5 ? 64 : 32); init(saddr(&empty[s]), 32); }
  __syncthreads();
  if (t < 32) {   // producer
    for (int i = 0; i < rounds; ++i) {
      const int s = i % 2;
      if (variant == 3 && i >= 2) wait(saddr(&full[s]), ((i / 2) - 1) & 1);   // its own last phase, already done
      wait(saddr(&empty[s]), ((i / 2) & 1) ^ 1);
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(saddr(&tile[s][lane])), "l"(in + i * 32 + lane) : "memory");
      if (variant == 1) { arrive_copied_noinc(saddr(&full[s])); }
      else if (variant == 5) { arrive_copied_noinc(saddr(&full[s])); arrive(saddr(&full[s])); }
      else if (variant == 4) { asm volatile("cp.async.wait_all;" ::: "memory"); arrive(saddr(&full[s])); }
      else { arrive_copied(saddr(&full[s])); arrive(saddr(&full[s])); }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    if (variant == 2 || variant == 3)   // a tail: wait for the last phase of each full barrier
      for (int i = max(0, rounds - 2); i < rounds; ++i) wait(saddr(&full[i % 2]), (i / 2) & 1);
    return;
  }
  float acc = 0.f;
  for (int i = 0; i < rounds; ++i) {
    const int s = i % 2;
    wait(saddr(&full[s]), (i / 2) & 1);
    acc += tile[s][lane];
    arrive(saddr(&empty[s]));
  }
  out[blockIdx.x * 32 + lane] = acc;
}
int main(int argc, char** argv) {
  const int variant = argc > 1 ? atoi(argv[1]) : 0, rounds = 6;
  float *in, *out; cudaMalloc(&in, rounds * 32 * 4); cudaMalloc(&out, 4 * 32 * 4);
  float h[rounds * 32]; for (int i = 0; i < rounds * 32; ++i) h[i] = i % 7;
  cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice);
  k<<<4, 64>>>(variant, in, out, rounds);
  cudaError_t e = cudaDeviceSynchronize();
  float r[32]; cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost);
  printf("variant %d: %s, out[0] = %g (want %g)\n", variant, cudaGetErrorString(e), r[0], 0. + 0 % 7 + 32 % 7 + 64 % 7 + 96 % 7 + 128 % 7 + 160 % 7);
  return 0;
}
