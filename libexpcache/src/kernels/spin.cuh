// A kernel that only takes time: the benchmark's stand-in for an engine's
// non-expert work of a layer (attention, the shared expert, the router).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace expcache {

// One thread that spins on the GPU's global timer for `ns` nanoseconds, on `stream`.
cudaError_t launch_spin(uint64_t ns, cudaStream_t stream);

}  // namespace expcache
