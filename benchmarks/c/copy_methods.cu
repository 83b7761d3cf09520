// Ways to move one decode call's misses to the GPU, measured side by side in one process
// (CUDA only; `make copy-methods`). Prints five tables:
//
// 1. A pinned source, six experts per call, each expert in three parts that lie apart (gate,
//    up and down tensors, as in a GGUF file): one cudaMemcpyAsync per part; one
//    cudaMemcpyBatchAsync per call; one gather kernel per call that reads the parts through
//    the mapped pinned memory (the SMs pull the bytes over the link instead of a copy engine);
//    the same gather by the TMA's bulk copies through shared memory; and, as the reference, one
//    cudaMemcpyAsync per expert of contiguous bytes.
// 2. A pageable source: the driver's own staging, one copy per expert or one batch per call.
// 3. What the caller pays to hand staged pieces to the link: a batch of copies, and an event per
//    piece or one per batch behind it (host time).
// 4. Host threads filling pinned staging chunks from a large pageable buffer (what the staging
//    ring's workers do), with memcpy and with non-temporal stores (16 bytes; 64 bytes, also with
//    prefetches ahead of the copy, where the CPU has AVX-512), alone and while the link runs at
//    full speed in the background (the DMA reads the same memory system).
// 5. The link reading chunks that host threads have just filled, as the ring's sends do: after
//    memcpy (the lines left dirty in the filling cores' caches), after memcpy and CLDEMOTE (the
//    lines pushed to the shared last-level cache; a no-op where the CPU lacks it), after memcpy
//    and CLFLUSHOPT (the lines written back to memory), and after non-temporal stores (16 bytes,
//    and 64 bytes with the ring's prefetch where the CPU has AVX-512).
//
//   build/copy_methods [GiB moved per row, default 1] [tables: pinned,pageable,enqueue,host,link; default all]
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/copy_nt.hpp"  // the staging ring's non-temporal copy
#include "cuda_check.hpp"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxJobs = 32;
struct GatherJobs {
    const uint4* src[kMaxJobs];
    uint4* dst[kMaxJobs];
    unsigned long long n16[kMaxJobs];  // 16-byte words
    int count;
};

// A 16-byte load that asks L2 to fetch the whole 256-byte sector group around it: over the link,
// fewer and larger read requests (PTX ld's L2::256B prefetch-size qualifier, sm_80 and later).
__device__ __forceinline__ uint4 load_256(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Each block takes its share of every job; each thread keeps four 16-byte loads in flight.
template <bool kPrefetch256>
__global__ void gather(GatherJobs jobs) {
    auto load = [](const uint4* p) { return kPrefetch256 ? load_256(p) : *p; };
    for (int j = 0; j < jobs.count; ++j) {
        const uint4* __restrict__ s = jobs.src[j];
        uint4* __restrict__ d = jobs.dst[j];
        const unsigned long long n = jobs.n16[j];
        const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
        unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
        for (; i + 3 * stride < n; i += 4 * stride) {
            uint4 a = load(s + i), b = load(s + i + stride), c = load(s + i + 2 * stride), e = load(s + i + 3 * stride);
            d[i] = a;
            d[i + stride] = b;
            d[i + 2 * stride] = c;
            d[i + 3 * stride] = e;
        }
        for (; i < n; i += stride) d[i] = load(s + i);
    }
}

// The same gather by the TMA's bulk copies (sm_90): each block's thread 0 moves its chunks of
// kChunk bytes (chunk c of the call's bytes for c = block, block + grid, ...) from the source
// into shared memory, kStages at once, each load completing on an mbarrier, and from there to
// the destination: the copy engine of the SM asks the link for whole chunks instead of the
// threads' 16-byte loads.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
#endif

template <int kChunk, int kStages>
__global__ void gather_tma(GatherJobs jobs) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ alignas(128) unsigned char buf[kStages][kChunk];
    __shared__ alignas(8) unsigned long long bar[kStages];
    if (threadIdx.x != 0) return;
    for (int s = 0; s < kStages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bar[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    // This block's chunks, in order: (job, offset) advanced by gridDim.x chunks at a time.
    int job = 0;
    unsigned long long at = (unsigned long long)blockIdx.x * kChunk;
    auto next = [&](const unsigned char*& src, unsigned char*& dst, unsigned& bytes) {
        while (job < jobs.count && at >= jobs.n16[job] * 16) {
            at -= jobs.n16[job] * 16;
            ++job;
        }
        if (job >= jobs.count) return false;
        const unsigned long long left = jobs.n16[job] * 16 - at;
        bytes = static_cast<unsigned>(left < kChunk ? left : kChunk);
        src = reinterpret_cast<const unsigned char*>(jobs.src[job]) + at;
        dst = reinterpret_cast<unsigned char*>(jobs.dst[job]) + at;
        at += (unsigned long long)gridDim.x * kChunk;
        return true;
    };
    for (unsigned phase = 0;; phase ^= 1) {
        unsigned char* dst[kStages];
        unsigned bytes[kStages];
        int issued = 0;
        for (; issued < kStages; ++issued) {
            const unsigned char* src;
            if (!next(src, dst[issued], bytes[issued])) break;
            const unsigned b = smem_addr(&bar[issued]);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes[issued])
                         : "memory");
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                    smem_addr(buf[issued])),
                "l"(src), "r"(bytes[issued]), "r"(b)
                : "memory");
        }
        for (int s = 0; s < issued; ++s) {
            unsigned done = 0;
            while (!done)
                asm volatile(
                    "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.b32 %0, 1, 0, p; }"
                    : "=r"(done)
                    : "r"(smem_addr(&bar[s])), "r"(phase)
                    : "memory");
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst[s]),
                         "r"(smem_addr(buf[s])), "r"(bytes[s])
                         : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // the buffers are free again
        if (issued < kStages) break;
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

double seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Layout {
    const char* name;
    size_t part[3];
    size_t expert() const { return part[0] + part[1] + part[2]; }
};

// GB/s of `calls` calls of `call(i)` on `stream`, timed from the first enqueue to the end.
template <typename Call>
double time_calls(int calls, size_t bytes_per_call, cudaStream_t stream, Call&& call) {
    call(0);
    CHECK(cudaStreamSynchronize(stream));
    const double t0 = seconds();
    for (int i = 0; i < calls; ++i) call(i);
    CHECK(cudaStreamSynchronize(stream));
    return double(calls) * bytes_per_call / (seconds() - t0) / 1e9;
}

void pinned_table(double gib) {
    const Layout layouts[] = {{"0.5 MiB", {160 << 10, 160 << 10, 192 << 10}},
                              {"6.75 MiB", {2162688, 2162688, 2752512}}};
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::printf("pinned source, 6 experts per call, GB/s (ratio to one copy per contiguous expert)\n");
    std::printf("%-9s %-26s %9s %7s\n", "expert", "method", "GB/s", "ratio");
    for (const Layout& L : layouts) {
        const size_t expert = L.expert();
        const int k = 6;
        const int experts = int(std::max<size_t>(64, size_t(gib * (1 << 30)) / expert));
        const int calls = experts / k;
        // Tensor placement: part p of expert e at base[p] + e * part[p]; and one contiguous copy.
        char* host = nullptr;
        CHECK(cudaMallocHost(&host, expert * experts));
        std::memset(host, 7, expert * experts);
        char* dev = nullptr;
        CHECK(cudaMalloc(&dev, expert * experts));
        const char* base[3] = {host, host + L.part[0] * experts, host + (L.part[0] + L.part[1]) * experts};
        auto src_part = [&](int e, int p) { return base[p] + size_t(e) * L.part[p]; };
        auto dst_part = [&](int e, int p) {
            return dev + size_t(e) * expert + (p > 0 ? L.part[0] : 0) + (p > 1 ? L.part[1] : 0);
        };
        const size_t call_bytes = expert * k;

        const double ref = time_calls(calls, call_bytes, stream, [&](int c) {
            for (int e = c * k; e < c * k + k; ++e)
                CHECK(cudaMemcpyAsync(dev + size_t(e) * expert, host + size_t(e) * expert, expert,
                                      cudaMemcpyHostToDevice, stream));
        });
        std::printf("%-9s %-26s %9.1f %6.0f%%\n", L.name, "memcpy per expert (ref)", ref, 100.0);

        const double per_part = time_calls(calls, call_bytes, stream, [&](int c) {
            for (int e = c * k; e < c * k + k; ++e)
                for (int p = 0; p < 3; ++p)
                    CHECK(cudaMemcpyAsync(dst_part(e, p), src_part(e, p), L.part[p], cudaMemcpyHostToDevice, stream));
        });
        std::printf("%-9s %-26s %9.1f %6.0f%%\n", L.name, "memcpy per part", per_part, 100 * per_part / ref);

        cudaMemcpyAttributes attr = {};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        size_t attr_idx = 0;
        const double batched = time_calls(calls, call_bytes, stream, [&](int c) {
            void* dsts[3 * k];
            const void* srcs[3 * k];
            size_t sizes[3 * k];
            int n = 0;
            for (int e = c * k; e < c * k + k; ++e)
                for (int p = 0; p < 3; ++p, ++n) {
                    dsts[n] = dst_part(e, p);
                    srcs[n] = src_part(e, p);
                    sizes[n] = L.part[p];
                }
            CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes, n, &attr, &attr_idx, 1, stream));
        });
        std::printf("%-9s %-26s %9.1f %6.0f%%\n", L.name, "cudaMemcpyBatchAsync", batched, 100 * batched / ref);

        // Call c's parts as gather jobs.
        auto call_jobs = [&](int c) {
            GatherJobs jobs{};
            for (int e = c * k; e < c * k + k; ++e)
                for (int p = 0; p < 3; ++p, ++jobs.count) {
                    jobs.src[jobs.count] = reinterpret_cast<const uint4*>(src_part(e, p));
                    jobs.dst[jobs.count] = reinterpret_cast<uint4*>(dst_part(e, p));
                    jobs.n16[jobs.count] = L.part[p] / 16;
                }
            return jobs;
        };
        // The gather kernel by block count; then with loads asking for 256-byte L2 sectors.
        const struct {
            bool prefetch256;
            int blocks;
        } runs[] = {{false, 16}, {false, 32}, {false, 64}, {false, 132}, {false, 264}, {true, 132}, {true, 264}};
        for (const auto& run : runs) {
            const double g = time_calls(calls, call_bytes, stream, [&](int c) {
                const GatherJobs jobs = call_jobs(c);
                if (run.prefetch256)
                    gather<true><<<run.blocks, 256, 0, stream>>>(jobs);
                else
                    gather<false><<<run.blocks, 256, 0, stream>>>(jobs);
                CHECK(cudaGetLastError());
            });
            char name[64];
            std::snprintf(name, sizeof name, run.prefetch256 ? "gather L2::256B, %d blk" : "gather kernel, %d blocks",
                          run.blocks);
            std::printf("%-9s %-26s %9.1f %6.0f%%\n", L.name, name, g, 100 * g / ref);
        }
        // The TMA's bulk copies: chunk bytes x stages in flight per block.
        const struct {
            int chunk, stages, blocks;
        } tma[] = {{8192, 4, 132}, {8192, 4, 264}, {8192, 4, 528}, {16384, 2, 264}, {4096, 8, 264}, {16384, 2, 528}};
        for (const auto& run : tma) {
            CHECK(cudaMemsetAsync(dev, 0, expert * experts, stream));
            const double g = time_calls(calls, call_bytes, stream, [&](int c) {
                const GatherJobs jobs = call_jobs(c);
                if (run.chunk == 8192)
                    gather_tma<8192, 4><<<run.blocks, 32, 0, stream>>>(jobs);
                else if (run.chunk == 16384)
                    gather_tma<16384, 2><<<run.blocks, 32, 0, stream>>>(jobs);
                else
                    gather_tma<4096, 8><<<run.blocks, 32, 0, stream>>>(jobs);
                CHECK(cudaGetLastError());
            });
            char name[64];
            std::snprintf(name, sizeof name, "TMA %dK x%d, %d blk", run.chunk >> 10, run.stages, run.blocks);
            std::printf("%-9s %-26s %9.1f %6.0f%%\n", L.name, name, g, 100 * g / ref);
            std::vector<char> got(expert * experts);
            CHECK(cudaMemcpy(got.data(), dev, got.size(), cudaMemcpyDeviceToHost));
            size_t bad = 0;
            for (int e = 0; e < calls * k; ++e)  // the experts the calls moved
                for (int p = 0; p < 3; ++p)
                    bad += std::memcmp(got.data() + (dst_part(e, p) - dev), src_part(e, p), L.part[p]) != 0;
            if (bad) std::printf("MISMATCH: %zu parts differ after %s\n", bad, name);
        }
        // The gather kernel's bytes must be the source's.
        std::vector<char> back(expert);
        CHECK(cudaMemcpy(back.data(), dev, expert, cudaMemcpyDeviceToHost));
        for (int p = 0; p < 3; ++p)
            if (std::memcmp(back.data() + (p > 0 ? L.part[0] : 0) + (p > 1 ? L.part[1] : 0), src_part(0, p), L.part[p]))
                std::printf("MISMATCH in part %d\n", p);
        CHECK(cudaFree(dev));
        CHECK(cudaFreeHost(host));
    }
    CHECK(cudaStreamDestroy(stream));
}

// A pageable source (malloc'd, as an mmap of a model file is): one cudaMemcpyAsync per expert
// (the driver stages it), and one cudaMemcpyBatchAsync per call that lets the driver read the
// source out of stream order (cudaMemcpySrcAccessOrderAny, meant for memory from malloc).
void pageable_table(double gib) {
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    int hmm = 0;
    CHECK(cudaDeviceGetAttribute(&hmm, cudaDevAttrPageableMemoryAccess, 0));
    std::printf("\npageable source, 6 experts of 6.75 MiB per call (device reads pageable memory: %s)\n",
                hmm ? "yes" : "no");
    const size_t expert = 7077888;
    const int k = 6;
    const int experts = int(std::max<size_t>(64, size_t(gib * (1 << 30)) / expert));
    char* host = static_cast<char*>(std::malloc(expert * experts));
    std::memset(host, 5, expert * experts);
    char* dev = nullptr;
    CHECK(cudaMalloc(&dev, expert * experts));
    const double per_expert = time_calls(experts / k, expert * k, stream, [&](int c) {
        for (int e = c * k; e < c * k + k; ++e)
            CHECK(cudaMemcpyAsync(dev + size_t(e) * expert, host + size_t(e) * expert, expert, cudaMemcpyHostToDevice,
                                  stream));
    });
    std::printf("%-9s %-26s %9.1f\n", "6.75 MiB", "memcpy per expert", per_expert);
    for (auto order : {cudaMemcpySrcAccessOrderStream, cudaMemcpySrcAccessOrderAny}) {
        cudaMemcpyAttributes attr = {};
        attr.srcAccessOrder = order;
        size_t attr_idx = 0;
        const double batched = time_calls(experts / k, expert * k, stream, [&](int c) {
            void* dsts[k];
            const void* srcs[k];
            size_t sizes[k];
            for (int i = 0; i < k; ++i) {
                dsts[i] = dev + size_t(c * k + i) * expert;
                srcs[i] = host + size_t(c * k + i) * expert;
                sizes[i] = expert;
            }
            CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes, k, &attr, &attr_idx, 1, stream));
        });
        std::printf("%-9s %-26s %9.1f\n", "6.75 MiB",
                    order == cudaMemcpySrcAccessOrderAny ? "batch, source order any" : "batch, stream order", batched);
    }
    CHECK(cudaFree(dev));
    std::free(host);
    CHECK(cudaStreamDestroy(stream));
}

// What the staging ring's caller pays to hand pieces to the link: one cudaMemcpyBatchAsync of n
// pieces of 128 KiB from pinned chunks, then one cudaEventRecord per piece (as the ring does) or
// one for the whole batch. Host time only, microseconds per batch (the copies run behind it).
void enqueue_table(double gib) {
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const size_t piece = 128 << 10;
    const int max_n = 16;
    char *host = nullptr, *dev = nullptr;
    CHECK(cudaMallocHost(&host, piece * max_n));
    std::memset(host, 7, piece * max_n);
    CHECK(cudaMalloc(&dev, piece * max_n));
    std::vector<cudaEvent_t> events(max_n);
    for (auto& e : events) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    std::printf("\nthe caller's cost of sending n pieces of 128 KiB from pinned chunks, us per batch (median of %d)\n",
                int(200 * gib) + 1);
    std::printf("%-4s %12s %18s %16s %16s\n", "n", "batch copy", "n events after", "1 event after",
                "n cudaMemcpyAsync");
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    auto median = [](std::vector<double>& v) {
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
    };
    for (int n : {1, 4, 8, 16}) {
        void* dsts[max_n];
        const void* srcs[max_n];
        size_t sizes[max_n];
        for (int i = 0; i < n; ++i) {
            dsts[i] = dev + size_t(i) * piece;
            srcs[i] = host + size_t(i) * piece;
            sizes[i] = piece;
        }
        std::vector<double> batch, many, one, singles;
        for (int r = 0; r < int(200 * gib) + 1; ++r) {
            size_t idx = 0;
            double t0 = seconds();
            CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes, n, &attr, &idx, 1, stream));
            double t1 = seconds();
            for (int i = 0; i < n; ++i) CHECK(cudaEventRecord(events[i], stream));
            double t2 = seconds();
            batch.push_back((t1 - t0) * 1e6);
            many.push_back((t2 - t1) * 1e6);
            CHECK(cudaStreamSynchronize(stream));
            CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes, n, &attr, &idx, 1, stream));
            t0 = seconds();
            CHECK(cudaEventRecord(events[0], stream));
            one.push_back((seconds() - t0) * 1e6);
            CHECK(cudaStreamSynchronize(stream));
            t0 = seconds();
            for (int i = 0; i < n; ++i) CHECK(cudaMemcpyAsync(dsts[i], srcs[i], piece, cudaMemcpyHostToDevice, stream));
            singles.push_back((seconds() - t0) * 1e6);
            CHECK(cudaStreamSynchronize(stream));
        }
        std::printf("%-4d %12.2f %18.2f %16.2f %16.2f\n", n, median(batch), median(many), median(one), median(singles));
    }
    for (auto& e : events) CHECK(cudaEventDestroy(e));
    CHECK(cudaFree(dev));
    CHECK(cudaFreeHost(host));
    CHECK(cudaStreamDestroy(stream));
}

// How a host thread fills a chunk: memcpy, or the staging ring's non-temporal copies (16-byte
// stores, 64-byte stores, 64-byte stores asking for source lines ahead; copy_nt.hpp).
struct Filler {
    const char* name;
    int stores;  // 0: memcpy, 16 or 64: non-temporal stores that wide
    expcache::Prefetch pf;
};

void fill_with(const Filler& f, char* d, const char* s, size_t n) {
    if (f.stores == 0)
        std::memcpy(d, s, n);
    else if (f.stores == 16)
        expcache::copy_nt(d, s, n);
    else
        expcache::copy_nt_wide(d, s, n, f.pf);
}

// GB/s of `threads` threads each copying random `piece`-byte pieces of `src` into its own
// ring of 8 pinned chunks, `total` bytes together.
double host_fill(const char* src, size_t src_bytes, size_t piece, int threads, size_t total, const Filler& how) {
    std::vector<char*> rings(threads);
    for (auto& r : rings) CHECK(cudaMallocHost(&r, piece * 8));
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> pool;
    const size_t per_thread = std::max<size_t>(1, total / threads / piece);
    for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
            std::mt19937_64 rng(t);
            ++ready;
            while (!go.load()) {
            }
            for (size_t i = 0; i < per_thread; ++i) {
                const char* s = src + (rng() % ((src_bytes - piece) / 4096)) * 4096;
                fill_with(how, rings[t] + (i % 8) * piece, s, piece);
            }
        });
    while (ready.load() < threads) {
    }
    const double t0 = seconds();
    go = true;
    for (auto& th : pool) th.join();
    const double gbs = double(per_thread * threads * piece) / (seconds() - t0) / 1e9;
    for (auto& r : rings) CHECK(cudaFreeHost(r));
    return gbs;
}

void host_table(double gib) {
    const size_t src_bytes = size_t(16) << 30;
    char* src = static_cast<char*>(std::malloc(src_bytes));
    if (!src) {
        std::printf("no 16 GiB for the host table\n");
        return;
    }
    std::memset(src, 3, src_bytes);
    // Background link traffic: a pinned buffer copied to the device over and over.
    const size_t bg_bytes = size_t(256) << 20;
    char *bg_host = nullptr, *bg_dev = nullptr;
    CHECK(cudaMallocHost(&bg_host, bg_bytes));
    std::memset(bg_host, 1, bg_bytes);
    CHECK(cudaMalloc(&bg_dev, bg_bytes));
    cudaStream_t bg;
    CHECK(cudaStreamCreateWithFlags(&bg, cudaStreamNonBlocking));
    const bool wide = expcache::copy_nt_wide_supported();
    std::vector<Filler> fillers = {{"memcpy", 0, {}}, {"stream 16 B", 16, {}}};
    if (wide)
        fillers.insert(fillers.end(), {{"stream 64 B", 64, {}},
                                       {"64 B, T0 1 KiB ahead", 64, {1024, 3}},
                                       {"64 B, T0 4 KiB ahead", 64, {4096, 3}},
                                       {"64 B, T2 4 KiB ahead", 64, {4096, 1}},
                                       {"64 B, NTA 1 KiB ahead", 64, {1024, 0}}});
    std::printf(
        "\nhost threads filling pinned chunks from a 16 GiB pageable buffer (malloc: 4 KiB pages), "
        "GB/s together%s\n",
        wide ? "" : " (no AVX-512 here: no 64-byte stores)");
    std::printf("%-7s %-8s %-22s %12s %12s\n", "threads", "piece", "stores", "link idle", "link busy");
    const size_t total = size_t(gib * (1 << 30)) * 4;
    for (int threads : {1, 4, 8, 12})
        for (size_t piece : {size_t(128) << 10, size_t(512) << 10})
            for (const Filler& how : fillers) {
                const double idle = host_fill(src, src_bytes, piece, threads, total, how);
                std::atomic<bool> stop{false};
                std::thread link([&] {
                    CHECK(cudaSetDevice(0));
                    while (!stop.load()) {
                        for (int i = 0; i < 8; ++i)
                            CHECK(cudaMemcpyAsync(bg_dev, bg_host, bg_bytes, cudaMemcpyHostToDevice, bg));
                        CHECK(cudaStreamSynchronize(bg));
                    }
                });
                std::this_thread::sleep_for(std::chrono::milliseconds(20));
                const double busy = host_fill(src, src_bytes, piece, threads, total, how);
                stop = true;
                link.join();
                std::printf("%-7d %-8s %-22s %12.1f %12.1f\n", threads,
                            piece == (size_t(128) << 10) ? "128 KiB" : "512 KiB", how.name, idle, busy);
            }
    CHECK(cudaFree(bg_dev));
    CHECK(cudaFreeHost(bg_host));
    CHECK(cudaStreamDestroy(bg));
    std::free(src);
}

#if defined(__x86_64__)
bool cpu_has_cldemote() {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c & (1u << 25));
}
// CLDEMOTE's encoding is a NOP on CPUs without it.
__attribute__((target("cldemote"))) void demote(const char* p, size_t n) {
    for (size_t i = 0; i < n; i += 64) _cldemote(const_cast<char*>(p + i));
}
__attribute__((target("clflushopt"))) void flush(const char* p, size_t n) {
    for (size_t i = 0; i < n; i += 64) _mm_clflushopt(const_cast<char*>(p + i));
    _mm_sfence();
}
#else
bool cpu_has_cldemote() {
    return false;
}
void demote(const char*, size_t) {}
void flush(const char*, size_t) {}
#endif

// Rounds of: `threads` threads each fill one 1 MiB pinned chunk from a random place in `src`
// (`how`), then the link takes the chunks, one cudaMemcpyAsync each, timed with events.
// Returns the link's GB/s over all rounds; the fills are not timed.
double link_after_fill(const char* src, size_t src_bytes, int threads, int rounds, const char* how, char* chunks,
                       char* dev, cudaStream_t stream) {
    const size_t piece = size_t(1) << 20;
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    std::mt19937_64 rng(42);
    double ms_total = 0;
    const std::string mode(how);
    for (int r = 0; r < rounds; ++r) {
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) {
            const char* s = src + (rng() % ((src_bytes - piece) / 4096)) * 4096;
            char* d = chunks + size_t(t) * piece;
            pool.emplace_back([=] {
                if (mode == "non-temporal 16 B") {
                    expcache::copy_nt(d, s, piece);
                    return;
                }
                if (mode == "non-temporal 64 B") {  // as the ring fills
                    expcache::copy_nt_wide(d, s, piece, expcache::kStagingPrefetch);
                    return;
                }
                std::memcpy(d, s, piece);
                if (mode == "memcpy + cldemote") demote(d, piece);
                if (mode == "memcpy + clflushopt") flush(d, piece);
            });
        }
        for (auto& th : pool) th.join();
        CHECK(cudaEventRecord(start, stream));
        for (int t = 0; t < threads; ++t)
            CHECK(cudaMemcpyAsync(dev + size_t(t) * piece, chunks + size_t(t) * piece, piece, cudaMemcpyHostToDevice,
                                  stream));
        CHECK(cudaEventRecord(stop, stream));
        CHECK(cudaEventSynchronize(stop));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, start, stop));
        ms_total += ms;
    }
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
    return double(rounds) * threads * piece / (ms_total * 1e-3) / 1e9;
}

void link_table(double gib) {
    const size_t src_bytes = size_t(16) << 30;
    char* src = static_cast<char*>(std::malloc(src_bytes));
    if (!src) {
        std::printf("no 16 GiB for the link table\n");
        return;
    }
    std::memset(src, 3, src_bytes);
    const int max_threads = 8;
    char *chunks = nullptr, *dev = nullptr;
    CHECK(cudaMallocHost(&chunks, size_t(max_threads) << 20));
    CHECK(cudaMalloc(&dev, size_t(max_threads) << 20));
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::printf(
        "\nthe link reading 1 MiB pinned chunks just filled by host threads, one cudaMemcpyAsync each "
        "(CLDEMOTE: %s), GB/s\n",
        cpu_has_cldemote() ? "yes" : "no, a no-op here");
    std::printf("%-7s %-20s %9s\n", "chunks", "filled with", "GB/s");
    const int rounds = std::max(8, int(gib * 1024 / max_threads));
    std::vector<const char*> modes = {"memcpy", "memcpy + cldemote", "memcpy + clflushopt", "non-temporal 16 B"};
    if (expcache::copy_nt_wide_supported()) modes.push_back("non-temporal 64 B");
    for (int threads : {1, 8})
        for (int pass = 0; pass < 2; ++pass)  // twice, alternating, to see the spread
            for (const char* how : modes)
                std::printf("%-7d %-20s %9.1f\n", threads, how,
                            link_after_fill(src, src_bytes, threads, rounds, how, chunks, dev, stream));
    CHECK(cudaFree(dev));
    CHECK(cudaFreeHost(chunks));
    CHECK(cudaStreamDestroy(stream));
    std::free(src);
}

}  // namespace

int main(int argc, char** argv) {
    const double gib = argc > 1 ? std::atof(argv[1]) : 1.0;
    const std::string tables = "," + std::string(argc > 2 ? argv[2] : "pinned,pageable,enqueue,host,link") + ",";
    auto wanted = [&](const char* name) { return tables.find("," + std::string(name) + ",") != std::string::npos; };
    size_t named = 0;
    for (const char* name : {"pinned", "pageable", "enqueue", "host", "link"})
        named += wanted(name) ? std::strlen(name) + 1 : 0;
    if (gib <= 0 || named + 1 != tables.size()) {
        std::fprintf(stderr, "usage: copy_methods [GiB per row > 0] [tables: pinned,pageable,enqueue,host,link]\n");
        return 2;
    }
    CHECK(cudaSetDevice(0));
    if (wanted("pinned")) pinned_table(gib);
    if (wanted("pageable")) pageable_table(gib);
    if (wanted("enqueue")) enqueue_table(gib);
    if (wanted("host")) host_table(gib);
    if (wanted("link")) link_table(gib);
    return 0;
}
