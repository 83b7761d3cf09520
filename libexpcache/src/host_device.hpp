// EXPCACHE_HOST_DEVICE marks a function compiled for both sides: the host (g++, and nvcc's host
// pass) and the device (nvcc's device pass). The device lookup's per-id rules are written once
// this way (kernels/lookup_rules.hpp, kernels/lookup_policy.hpp, policy/oppclass_count.hpp,
// policy/duel_vote.hpp), so the host backend runs the code the GPU runs.
#pragma once

#ifdef __CUDACC__
#define EXPCACHE_HOST_DEVICE __host__ __device__
#else
#define EXPCACHE_HOST_DEVICE
#endif
