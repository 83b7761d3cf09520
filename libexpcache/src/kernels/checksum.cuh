// The checksum kernel: reads every byte of a list of device ranges (the
// memory-bound floor of the expert GEMVs) and sums 64-bit words weighted by
// their position, so a wrong, shifted or stale byte changes the result.
#pragma once

#include <cuda_runtime.h>

#include "../backend/backend.hpp"

namespace expcache {

size_t checksum_scratch_bytes(uint32_t num_jobs, uint32_t num_sums);

// Packs the jobs into host_scratch (pinned), copies them to scratch and
// launches; the sums land in host_scratch after the stream completes.
cudaError_t launch_checksum(const ChecksumJob* jobs, uint32_t num_jobs, uint32_t num_sums, void* scratch,
                            void* host_scratch, cudaStream_t stream);

void read_checksum_results(const void* host_scratch, uint32_t num_jobs, uint32_t num_sums, uint64_t* out);

}  // namespace expcache
