// Linked into the host-only library (built with g++ alone) in place of cuda.cu.
#include "backend.hpp"
#include "../errors.hpp"
#include "../kernels/lookup_kernels.hpp"
#include "../kernels/test_kernels.hpp"

namespace expcache {

expcache_status_t make_cuda_backend(int, const StagingConfig&, std::unique_ptr<StagingBackend>*) {
    return fail(EXPCACHE_ERR_UNSUPPORTED,
                "this library was built without CUDA (libexpcache_host); build with nvcc for the CUDA backend");
}

// Never called: the CUDA backend is refused first.
std::unique_ptr<TestKernels> make_cuda_kernels(int) {
    return make_host_kernels();
}
std::unique_ptr<LookupKernels> make_cuda_lookup_kernels(int) {
    return make_host_lookup_kernels();
}

}  // namespace expcache
