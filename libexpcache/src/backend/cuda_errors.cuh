// A CUDA error as a status, once for every CUDA source: a sticky error (the context is unusable)
// poisons the handle, an allocation failure is OUT_OF_DEVICE_MEMORY, anything else CUDA.
#pragma once

#include <cuda_runtime.h>

#include "../errors.hpp"

namespace expcache {

// Errors after which the context is unusable: the handle is poisoned.
inline bool is_sticky(cudaError_t e) {
    switch (e) {
        case cudaErrorIllegalAddress:
        case cudaErrorLaunchFailure:
        case cudaErrorHardwareStackError:
        case cudaErrorIllegalInstruction:
        case cudaErrorMisalignedAddress:
        case cudaErrorInvalidAddressSpace:
        case cudaErrorInvalidPc:
        case cudaErrorAssert:
        case cudaErrorLaunchTimeout:
        case cudaErrorECCUncorrectable:
            return true;
        default:
            return false;
    }
}

inline expcache_status_t cuda_fail(cudaError_t e, const char* what) {
    cudaGetLastError();  // clear a non-sticky error so it does not leak into the caller's next check
    if (e == cudaErrorMemoryAllocation)
        return fail(EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
    return fail(is_sticky(e) ? EXPCACHE_ERR_POISONED : EXPCACHE_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorName(e),
                cudaGetErrorString(e));
}

#define EXPCACHE_CUDA_TRY(call)                             \
    do {                                                    \
        cudaError_t e_ = (call);                            \
        if (e_ != cudaSuccess) return cuda_fail(e_, #call); \
    } while (0)

}  // namespace expcache
