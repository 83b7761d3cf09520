#include "spin.cuh"

namespace expcache {

namespace {

__device__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void spin_kernel(uint64_t ns) {
    const uint64_t start = global_ns();
    while (global_ns() - start < ns) {
    }
}

}  // namespace

cudaError_t launch_spin(uint64_t ns, cudaStream_t stream) {
    spin_kernel<<<1, 1, 0, stream>>>(ns);
    return cudaGetLastError();
}

}  // namespace expcache
