// Who moves a device select's misses inside a CUDA graph, measured side by side in one process
// (CUDA only; `make copy-handoff`).
//
// A token is L layers. Each layer is a select, whose misses only the device knows (it reads them
// from a plan in device memory at the token the graph counts), then a kernel that reads the
// layer's k experts from the bank and sums each (the engine's expert kernel; the sums are checked
// against the source's afterwards, so a byte copied late or wrong is counted). Ways to move the
// misses, each over the same plan from the same starting bank:
//
//   sm            the select's grid, a block per SM, pulls each miss over the link from mapped
//                 pinned memory (what the library's device select does).
//   engine        the select's one block lists each miss in mapped memory; a host thread polling
//                 the list issues a cudaMemcpyAsync per part on its own stream, then a
//                 cuStreamWriteValue64 of the miss's tag into device memory; the select ends when
//                 it reads the last miss's tag. The copy engine moves the bytes, with no host
//                 call in the graph.
//   engine-batch  the same, one cudaMemcpyBatchAsync for the misses each poll finds.
//
// Then, for the first size, the hazard of the engine ways: one token of engine-batch with the
// caller in a copy to pageable memory behind it, as torch's .cpu() is, rather than waiting on an
// event, on a stream of its own and on the legacy default stream (torch's default); the selects
// whose copier never answered are counted (each waits 0.2 s here).
//   host          no graph: the host knows every miss ahead (the C loop's position: its ids come
//                 from a trace, not from the GPU), a cudaMemcpyAsync per part and the same
//                 kernels, stream-ordered. The reference.
//   host-batch    the same, one cudaMemcpyBatchAsync per layer (what the library's host select
//                 does).
//
//   build/copy_handoff [MiB per expert, comma-separated; default 6.75,4.5,13.5] [tokens; default 64]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda/atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>
#include "cuda_check.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLayers = 40;                                   // DeepSeek V4 Flash's routed layers 3-42
constexpr int kK = 6;                                         // routed experts per token
constexpr int kParts = 3;                                     // gate, up, down, lying apart as in a GGUF file
constexpr int kMaxMiss = kK;                                  // misses of one select, at most
constexpr int kExperts = 96;                                  // in the source
constexpr int kCap = 48;                                      // slots in the bank
constexpr int kThreads = 256;                                 // per block
constexpr uint64_t kTimeoutNs = 10ull * 1000 * 1000 * 1000;   // a select's wait for the copier, at most
constexpr uint64_t kBlockedTimeoutNs = 200ull * 1000 * 1000;  // the same in the blocked-caller check

// One layer of one token: its misses (expert into slot) and the slots its kernel reads.
struct LayerPlan {
    uint32_t n_miss;
    uint32_t miss_expert[kMaxMiss];
    uint32_t miss_slot[kMaxMiss];
    uint32_t read_slot[kK];
    uint32_t read_expert[kK];  // what each read slot holds after the select (checked on the host)
};

struct Geometry {
    const unsigned char* src[kParts];  // the device's address of each part's experts (mapped)
    unsigned char* bank;               // slot s, part p at bank + s * slot_bytes + p * part_bytes
    uint64_t part_bytes;
    uint64_t slot_bytes;
};

// The mailbox of the engine ways, in mapped pinned memory: the select writes it, the host polls.
struct Entry {
    uint32_t expert, slot;
};
struct Box {
    alignas(64) uint64_t listed;  // select number << 8 | misses listed
    alignas(64) Entry entry[kMaxMiss];
};

using SysWord = cuda::atomic_ref<uint64_t, cuda::thread_scope_system>;

__device__ inline uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// sm: every block copies its share of each miss's parts, 16-byte words, four loads in flight.
__global__ void __launch_bounds__(kThreads)
    select_sm(const LayerPlan* plan, const uint32_t* token, int layer, Geometry g) {
    const LayerPlan& p = plan[uint64_t(*token) * kLayers + layer];
    const uint64_t gtid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t gstride = uint64_t(gridDim.x) * blockDim.x;
    const uint64_t words = g.part_bytes / 16;
    for (uint32_t m = 0; m < p.n_miss; ++m)
        for (int q = 0; q < kParts; ++q) {
            const uint4* s = reinterpret_cast<const uint4*>(g.src[q] + p.miss_expert[m] * g.part_bytes);
            uint4* d = reinterpret_cast<uint4*>(g.bank + p.miss_slot[m] * g.slot_bytes + q * g.part_bytes);
            for (uint64_t w = gtid; w < words; w += 4 * gstride) {
                uint4 v[4];
#pragma unroll
                for (int u = 0; u < 4; ++u)
                    if (w + u * gstride < words) v[u] = s[w + u * gstride];
#pragma unroll
                for (int u = 0; u < 4; ++u)
                    if (w + u * gstride < words) d[w + u * gstride] = v[u];
            }
        }
}

// engine: one thread lists the misses for the host and waits for the copy engine's last tag.
__global__ void select_engine(const LayerPlan* plan, const uint32_t* token, int layer, Box* box, uint64_t* seq,
                              uint64_t* done, uint32_t* timeouts, uint64_t timeout_ns) {
    if (threadIdx.x != 0) return;
    const LayerPlan& p = plan[uint64_t(*token) * kLayers + layer];
    const uint64_t number = ++*seq;
    if (p.n_miss == 0) return;
    for (uint32_t m = 0; m < p.n_miss; ++m) {
        volatile Entry* e = &box->entry[m];
        e->expert = p.miss_expert[m];
        e->slot = p.miss_slot[m];
        SysWord(box->listed).store(number << 8 | (m + 1), cuda::memory_order_release);
    }
    const uint64_t want = number << 8 | p.n_miss;
    const uint64_t start = now_ns();
    while (SysWord(*done).load(cuda::memory_order_acquire) < want) {
        if (now_ns() - start > timeout_ns) {
            atomicAdd(timeouts, 1u);
            return;
        }
        __nanosleep(64);
    }
}

// The engine's expert kernel: each block sums its share of every read slot into sums[j].
__global__ void __launch_bounds__(kThreads)
    read_experts(const LayerPlan* plan, const uint32_t* token, int layer, Geometry g, unsigned long long* sums) {
    const LayerPlan& p = plan[uint64_t(*token) * kLayers + layer];
    unsigned long long* out = sums + (uint64_t(*token) * kLayers + layer) * kK;
    const uint64_t words = g.slot_bytes / 16;
    for (int j = 0; j < kK; ++j) {
        const uint4* s = reinterpret_cast<const uint4*>(g.bank + p.read_slot[j] * g.slot_bytes);
        unsigned long long acc = 0;
        for (uint64_t w = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < words;
             w += uint64_t(gridDim.x) * blockDim.x) {
            const uint4 v = s[w];
            acc += uint64_t(v.x) + v.y + v.z + v.w;
        }
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
        if ((threadIdx.x & 31) == 0) atomicAdd(out + j, acc);
    }
}

__global__ void next_token(uint32_t* token) {
    ++*token;
}

// The sum read_experts computes, of one expert in the source.
unsigned long long expert_sum(const unsigned char* const host_part[kParts], uint32_t e, uint64_t part_bytes) {
    unsigned long long acc = 0;
    for (int q = 0; q < kParts; ++q) {
        const uint32_t* w = reinterpret_cast<const uint32_t*>(host_part[q] + e * part_bytes);
        for (uint64_t i = 0; i < part_bytes / 4; ++i) acc += w[i];
    }
    return acc;
}

// A plan of `tokens` tokens: per layer 0-3 misses (1.4 on average, as the bundled decode traces
// at a 12 GiB budget), each a non-resident expert into a slot the layer does not read otherwise.
std::vector<LayerPlan> make_plan(int tokens, uint64_t seed, double* misses_per_layer) {
    std::mt19937_64 rng(seed);
    std::vector<uint32_t> content(kCap);
    for (int s = 0; s < kCap; ++s) content[s] = s;
    std::vector<LayerPlan> plan(uint64_t(tokens) * kLayers);
    const double weights[] = {0.15, 0.40, 0.30, 0.15};
    std::discrete_distribution<int> n_of(std::begin(weights), std::end(weights));
    uint64_t total = 0;
    for (LayerPlan& p : plan) {
        std::memset(&p, 0, sizeof p);
        std::vector<uint32_t> slots(kCap);
        for (int s = 0; s < kCap; ++s) slots[s] = s;
        std::shuffle(slots.begin(), slots.end(), rng);  // the first kK: the layer's slots
        std::vector<bool> resident(kExperts, false);
        for (int s = 0; s < kCap; ++s) resident[content[s]] = true;
        p.n_miss = n_of(rng);
        total += p.n_miss;
        for (uint32_t m = 0; m < p.n_miss; ++m) {
            uint32_t e;
            do e = rng() % kExperts;
            while (resident[e]);
            resident[e] = true;
            p.miss_expert[m] = e;
            p.miss_slot[m] = slots[m];
            content[slots[m]] = e;
        }
        for (int j = 0; j < kK; ++j) {
            p.read_slot[j] = slots[j];
            p.read_expert[j] = content[slots[j]];
        }
    }
    *misses_per_layer = double(total) / plan.size();
    return plan;
}

// n copies host to device on `stream`: one cudaMemcpyBatchAsync, or one cudaMemcpyAsync each.
void copy_parts(void** dsts, const void** srcs, size_t* sizes, uint32_t n, bool batch, cudaStream_t stream) {
    if (batch) {
        cudaMemcpyAttributes attr = {};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        size_t attr_idx = 0;
        CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes, n, &attr, &attr_idx, 1, stream));
        return;
    }
    for (uint32_t i = 0; i < n; ++i) CHECK(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyHostToDevice, stream));
}

CUresult (*write_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;

// The engine ways' host thread: polls the box, copies each listed miss, then writes its tag.
class Copier {
public:
    Copier(Box* box, uint64_t* done, const unsigned char* const host_part[kParts], const Geometry& g, bool batch)
        : box_(box), done_(done), g_(g), batch_(batch) {
        for (int q = 0; q < kParts; ++q) host_part_[q] = host_part[q];
        CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        thread_ = std::thread([this] { run(); });
    }
    ~Copier() {
        stop_.store(true);
        thread_.join();
        CHECK(cudaStreamSynchronize(stream_));
        CHECK(cudaStreamDestroy(stream_));
    }

private:
    void run() {
        CHECK(cudaSetDevice(0));
        uint64_t seq = 0;
        uint32_t issued = 0;
        while (!stop_.load(std::memory_order_relaxed)) {
            const uint64_t listed = __atomic_load_n(&box_->listed, __ATOMIC_ACQUIRE);
            const uint64_t number = listed >> 8;
            const uint32_t n = static_cast<uint32_t>(listed & 0xff);
            if (number != seq) {
                seq = number;
                issued = 0;
            }
            if (issued == n) {
#if defined(__x86_64__)
                _mm_pause();
#endif
                continue;
            }
            // Every miss listed since the last poll: its parts copied, then its tag written.
            void* dsts[kParts * kMaxMiss];
            const void* srcs[kParts * kMaxMiss];
            size_t sizes[kParts * kMaxMiss];
            const uint32_t from = issued;
            for (; issued < n; ++issued) {
                const Entry e = *const_cast<const Entry*>(&box_->entry[issued]);
                for (int q = 0; q < kParts; ++q) {
                    const uint32_t j = (issued - from) * kParts + q;
                    dsts[j] = g_.bank + e.slot * g_.slot_bytes + q * g_.part_bytes;
                    srcs[j] = host_part_[q] + e.expert * g_.part_bytes;
                    sizes[j] = g_.part_bytes;
                }
            }
            copy_parts(dsts, srcs, sizes, (n - from) * kParts, batch_, stream_);
            const CUresult r = write_value64(stream_, reinterpret_cast<CUdeviceptr>(done_), number << 8 | n,
                                             CU_STREAM_WRITE_VALUE_DEFAULT);
            if (r != CUDA_SUCCESS) {
                std::fprintf(stderr, "cuStreamWriteValue64: error %d\n", int(r));
                std::exit(1);
            }
        }
    }

    Box* box_;
    uint64_t* done_;
    const unsigned char* host_part_[kParts];
    Geometry g_;
    bool batch_;
    cudaStream_t stream_;
    std::atomic<bool> stop_{false};
    std::thread thread_;
};

// check_blocked: also the engine-batch way with the caller blocked in a synchronous copy.
void run_size(double mib, int tokens, double link, bool check_blocked) {
    const uint64_t part = uint64_t(mib * 1048576.0 / kParts) / 4096 * 4096;
    Geometry g{};
    g.part_bytes = part;
    g.slot_bytes = part * kParts;
    unsigned char* host_part[kParts];
    for (int q = 0; q < kParts; ++q) {
        CHECK(cudaHostAlloc(&host_part[q], kExperts * part, cudaHostAllocMapped));
        uint32_t* w = reinterpret_cast<uint32_t*>(host_part[q]);
        std::mt19937 rng(17 + q);
        for (uint64_t i = 0; i < kExperts * part / 4; ++i) w[i] = rng();
        void* dev = nullptr;
        CHECK(cudaHostGetDevicePointer(&dev, host_part[q], 0));
        g.src[q] = static_cast<const unsigned char*>(dev);
    }
    std::vector<unsigned long long> want(kExperts);
    for (uint32_t e = 0; e < kExperts; ++e) want[e] = expert_sum(host_part, e, part);
    CHECK(cudaMalloc(&g.bank, kCap * g.slot_bytes));
    double misses_per_layer = 0;
    const std::vector<LayerPlan> plan = make_plan(tokens, 1234, &misses_per_layer);
    LayerPlan* plan_d = nullptr;
    CHECK(cudaMalloc(&plan_d, plan.size() * sizeof(LayerPlan)));
    CHECK(cudaMemcpy(plan_d, plan.data(), plan.size() * sizeof(LayerPlan), cudaMemcpyHostToDevice));
    unsigned long long* sums = nullptr;
    const uint64_t n_sums = plan.size() * kK;
    CHECK(cudaMalloc(&sums, n_sums * sizeof(unsigned long long)));
    uint32_t* token = nullptr;
    uint64_t* words = nullptr;  // seq, done
    uint32_t* timeouts = nullptr;
    CHECK(cudaMalloc(&token, sizeof(uint32_t)));
    CHECK(cudaMalloc(&words, 2 * sizeof(uint64_t)));
    CHECK(cudaMalloc(&timeouts, sizeof(uint32_t)));
    Box* box = nullptr;
    CHECK(cudaHostAlloc(&box, sizeof(Box), cudaHostAllocMapped));
    Box* box_d = nullptr;
    CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&box_d), box, 0));
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));

    const double miss_bytes = misses_per_layer * kLayers * g.slot_bytes;  // per token
    std::printf(
        "\n%.2f MiB experts (3 parts of %.2f MiB), %d layers, top-%d, %.2f misses per layer (%.1f MiB per token), "
        "%d tokens\n",
        g.slot_bytes / 1048576.0, part / 1048576.0, kLayers, kK, misses_per_layer, miss_bytes / 1048576.0, tokens);
    std::printf("%-14s %10s %10s %12s %10s %s\n", "way", "tok/s", "vs host", "of link", "GB/s", "sums");

    double host_rate = 0;
    const char* ways[] = {"host",           "host-batch",           "sm", "engine", "engine-batch",
                          "engine-blocked", "engine-blocked-legacy"};
    for (const char* way : ways) {
        const std::string w = way;
        // engine-blocked: the engine-batch way for one token, the caller then in a copy of the
        // sums to pageable memory behind it (what torch's .cpu() does) rather than an event wait;
        // -legacy: the token and the copy on the legacy default stream.
        const bool blocked = w.rfind("engine-blocked", 0) == 0, legacy = w == "engine-blocked-legacy";
        if (blocked && !check_blocked) continue;
        const uint64_t timeout_ns = blocked ? kBlockedTimeoutNs : kTimeoutNs;
        const int run_tokens = blocked ? 1 : tokens;
        // The same start: slot s holds expert s; no token counted; no select numbered.
        for (int s = 0; s < kCap; ++s)
            for (int q = 0; q < kParts; ++q)
                CHECK(cudaMemcpy(g.bank + s * g.slot_bytes + q * part, host_part[q] + s * part, part,
                                 cudaMemcpyHostToDevice));
        CHECK(cudaMemset(sums, 0, n_sums * sizeof(unsigned long long)));
        CHECK(cudaMemset(token, 0, sizeof(uint32_t)));
        CHECK(cudaMemset(words, 0, 2 * sizeof(uint64_t)));
        CHECK(cudaMemset(timeouts, 0, sizeof(uint32_t)));
        std::memset(box, 0, sizeof(Box));
        CHECK(cudaDeviceSynchronize());
        std::unique_ptr<Copier> copier;
        if (w.rfind("engine", 0) == 0) copier.reset(new Copier(box, words + 1, host_part, g, w != "engine"));

        auto layer_select = [&](int l, cudaStream_t s) {
            if (w == "sm")
                select_sm<<<sms, kThreads, 0, s>>>(plan_d, token, l, g);
            else
                select_engine<<<1, 32, 0, s>>>(plan_d, token, l, box_d, words, words + 1, timeouts, timeout_ns);
        };
        cudaGraphExec_t exec = nullptr;
        if (w.rfind("host", 0) != 0) {
            cudaGraph_t graph;
            CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
            for (int l = 0; l < kLayers; ++l) {
                layer_select(l, stream);
                read_experts<<<sms, kThreads, 0, stream>>>(plan_d, token, l, g, sums);
            }
            next_token<<<1, 1, 0, stream>>>(token);
            CHECK(cudaStreamEndCapture(stream, &graph));
            CHECK(cudaGraphInstantiate(&exec, graph, 0));
            CHECK(cudaGraphDestroy(graph));
        }
        const cudaStream_t on = legacy ? cudaStreamLegacy : stream;
        CHECK(cudaEventRecord(t0, on));
        for (int t = 0; t < run_tokens; ++t) {
            if (exec) {
                CHECK(cudaGraphLaunch(exec, on));
                continue;
            }
            for (int l = 0; l < kLayers; ++l) {
                const LayerPlan& p = plan[uint64_t(t) * kLayers + l];
                void* dsts[kParts * kMaxMiss];
                const void* srcs[kParts * kMaxMiss];
                size_t sizes[kParts * kMaxMiss];
                for (uint32_t m = 0; m < p.n_miss; ++m)
                    for (int q = 0; q < kParts; ++q) {
                        dsts[m * kParts + q] = g.bank + p.miss_slot[m] * g.slot_bytes + q * part;
                        srcs[m * kParts + q] = host_part[q] + p.miss_expert[m] * part;
                        sizes[m * kParts + q] = part;
                    }
                if (p.n_miss) copy_parts(dsts, srcs, sizes, p.n_miss * kParts, w == "host-batch", stream);
                read_experts<<<sms, kThreads, 0, stream>>>(plan_d, token, l, g, sums);
            }
            next_token<<<1, 1, 0, stream>>>(token);
        }
        CHECK(cudaEventRecord(t1, on));
        if (blocked) {
            std::vector<unsigned long long> pageable(kK);
            CHECK(cudaMemcpyAsync(pageable.data(), sums, sizeof(unsigned long long) * kK, cudaMemcpyDeviceToHost, on));
        }
        CHECK(cudaEventSynchronize(t1));
        CHECK(cudaGetLastError());
        copier.reset();
        if (exec) CHECK(cudaGraphExecDestroy(exec));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        std::vector<unsigned long long> got(n_sums);
        CHECK(cudaMemcpy(got.data(), sums, n_sums * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
        uint32_t lost = 0;
        CHECK(cudaMemcpy(&lost, timeouts, sizeof lost, cudaMemcpyDeviceToHost));
        if (blocked) {
            uint32_t with_misses = 0;
            for (int l = 0; l < kLayers; ++l) with_misses += plan[l].n_miss > 0;
            std::printf(
                "engine-batch, one token on %s, the caller in a copy to pageable memory behind it there "
                "(torch's .cpu()): %u of the token's %u selects with misses waited out their %.1f s\n",
                legacy ? "the legacy default stream" : "a stream of its own", lost, with_misses,
                kBlockedTimeoutNs / 1e9);
            continue;
        }
        uint64_t bad = 0;
        for (uint64_t i = 0; i < plan.size(); ++i)
            for (int j = 0; j < kK; ++j) bad += got[i * kK + j] != want[plan[i].read_expert[j]];
        const double rate = tokens / (ms / 1e3);
        if (w == "host") host_rate = rate;
        const double bound = link / miss_bytes;  // tok/s if the misses were all the time
        std::printf("%-14s %10.2f %9.3fx %11.1f%% %10.1f %llu bad of %llu%s\n", way, rate, rate / host_rate,
                    100 * rate / bound, miss_bytes * rate / 1e9, (unsigned long long)bad, (unsigned long long)n_sums,
                    lost ? " (selects timed out)" : "");
    }
    CHECK(cudaEventDestroy(t0));
    CHECK(cudaEventDestroy(t1));
    CHECK(cudaStreamDestroy(stream));
    CHECK(cudaFreeHost(box));
    CHECK(cudaFree(timeouts));
    CHECK(cudaFree(words));
    CHECK(cudaFree(token));
    CHECK(cudaFree(sums));
    CHECK(cudaFree(plan_d));
    CHECK(cudaFree(g.bank));
    for (int q = 0; q < kParts; ++q) CHECK(cudaFreeHost(host_part[q]));
}

// The link's rate: cudaMemcpyAsync of 13.5 MiB chunks from pinned memory, as the bench measures it.
double link_rate() {
    const size_t chunk = 14155776, n = 32;
    void* host = nullptr;
    void* dev = nullptr;
    CHECK(cudaHostAlloc(&host, chunk * 4, 0));
    CHECK(cudaMalloc(&dev, chunk * 4));
    std::memset(host, 1, chunk * 4);
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int rep = 0; rep < 2; ++rep) {  // the first warms the link
        CHECK(cudaEventRecord(a, s));
        for (size_t i = 0; i < n; ++i)
            CHECK(cudaMemcpyAsync(static_cast<char*>(dev) + (i % 4) * chunk, static_cast<char*>(host) + (i % 4) * chunk,
                                  chunk, cudaMemcpyHostToDevice, s));
        CHECK(cudaEventRecord(b, s));
    }
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(dev));
    CHECK(cudaFreeHost(host));
    return chunk * n / (ms / 1e3);
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<double> sizes = {6.75, 4.5, 13.5};
    if (argc > 1) {
        sizes.clear();
        for (const char* p = argv[1]; *p;) {
            char* end = nullptr;
            sizes.push_back(std::strtod(p, &end));
            if (end == p || sizes.back() <= 0) {
                std::fprintf(stderr, "usage: %s [MiB per expert, comma-separated] [tokens]\n", argv[0]);
                return 2;
            }
            p = *end == ',' ? end + 1 : end;
        }
    }
    const int tokens = argc > 2 ? std::atoi(argv[2]) : 64;
    if (tokens <= 0) {
        std::fprintf(stderr, "tokens must be positive\n");
        return 2;
    }
    CHECK(cudaSetDevice(0));
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    CHECK(cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &fn, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || !fn) {
        std::fprintf(stderr, "the driver has no cuStreamWriteValue64\n");
        return 1;
    }
    write_value64 = reinterpret_cast<decltype(write_value64)>(fn);
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    const double link = link_rate();
    std::printf("copy handoff on %s: link %.1f GB/s (cudaMemcpyAsync of 13.5 MiB chunks from pinned memory)\n",
                prop.name, link / 1e9);
    for (size_t i = 0; i < sizes.size(); ++i) run_size(sizes[i], tokens, link, i == 0);
    return 0;
}
