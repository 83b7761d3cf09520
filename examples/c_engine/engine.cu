/*
 * engine.cu — an example MoE decode engine on libexpcache's C ABI, written the way ds4 and
 * llama.cpp read experts (docs/engines.md): the routed experts of a GGUF file stay on disk (or in
 * pinned host memory the engine fills itself), the cache keeps the hot ones in a bank per size
 * class, and one kernel per layer reads each selected expert's quantized blocks as bytes at
 * the bank's part base + slot * part stride (--bank slots: an expert's parts in one slot; --bank
 * parts: a region per part, as ggml's expert tensors are), with no gather. The kernel is a memory-bound
 * stand-in for the GEMVs: it reduces every byte of every selected expert into a per-part sum,
 * which the engine checks against the sums prepare.py recorded when it made the bytes.
 *
 * Two loops over the same routing, each with a cache of its own, cold after the same prefill:
 *  - graph: the device select (config.lookup = DEVICE). Per token, every layer's
 *    expcache_select_device_async (ids on the device in, slots on the device out) and its
 *    kernel, the whole token captured once into a CUDA graph and replayed, the token's ids copied
 *    into the captured ids buffer before each replay; every few tokens an MTP-style verification
 *    of several tokens as one union select of [n, k] ids per layer (a second graph).
 *  - gather: the baseline, as engines do it today. Per layer a host select
 *    (expcache_select_ids_async: int32 ids on the host in, per-expert device addresses out), each
 *    selected expert copied into a compact table (cudaMemcpyAsync per expert), the same kernel
 *    reading the table.
 * Before either, a prefill of the prompt's tokens by slot id (expcache_batch_prepare_slots_async,
 * expcache_batch_finish): appended into free slots of the same bank, read by the same kernel.
 *
 * Without a CUDA device the engine runs on the library's host backend: bank memory is host
 * memory, the kernel is a host loop over the same bytes, nothing is captured. Every sum of every
 * expert of every token is checked; a mismatch makes the run exit 1.
 *
 * Usage: c_engine [options] DIR (the folder prepare.py wrote); c_engine --help lists the options.
 */
#include <cuda_runtime.h>

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "expcache.h"
#include "gguf.h"

/* ---------------------------------------------------------------------- */
/* The engine's log, failures                                              */
/* ---------------------------------------------------------------------- */

__attribute__((format(printf, 1, 2))) static void say(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("c_engine: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

[[noreturn]] __attribute__((format(printf, 1, 2))) static void fatal(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("c_engine: error: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

#define EC(call)                                                                                              \
    do {                                                                                                      \
        expcache_status_t s_ = (call);                                                                        \
        if (s_ != EXPCACHE_OK) fatal("%s: %s: %s", #call, expcache_status_string(s_), expcache_last_error()); \
    } while (0)

#define CU(call)                                                               \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess) fatal("%s: %s", #call, cudaGetErrorString(e_)); \
    } while (0)

/* The library's lines, in the engine's log (expcache_log_set_callback). */
static std::atomic<uint64_t> g_library_warnings{0};
static void library_log(void* user, uint32_t level, const char* message) {
    (void)user;
    static const char* const names[] = {"silent", "warning", "notice", "debug"};
    if (level == EXPCACHE_LOG_WARNING) ++g_library_warnings;
    say("expcache %s: %s", level <= EXPCACHE_LOG_DEBUG ? names[level] : "?", message);
}

static double now_s() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------------- */
/* Options                                                                 */
/* ---------------------------------------------------------------------- */

struct Options {
    std::string dir, model, routing, sums, json;
    bool pinned_source = false; /* --source pinned: the engine reads the experts into pinned memory */
    bool direct_reads = true;   /* --reads direct (O_DIRECT) or buffered */
    bool parts_bank = false;    /* --bank parts: a region per tensor, as ggml's expert tensors are */
    int backend = -1;           /* -1 auto, else EXPCACHE_BACKEND_HOST or _CUDA */
    double budget_gib = 0;      /* the cache's budget; 0: budget_frac of the model's experts */
    double budget_frac = 0.15;
    int policy = -1;                 /* -1: the library's default */
    uint32_t mtp = 3, mtp_every = 8; /* a verification of mtp tokens after every mtp_every steps; 0: none */
    uint32_t tokens = 0;             /* decode tokens (0: all of the routing file's) */
    int prompt = -1;                 /* prompt tokens prefilled (-1: all of the routing file's) */
    bool run_graph = true, run_gather = true;
    bool verbose = false;
};

static void usage(FILE* to) {
    fprintf(to,
            "usage: c_engine [options] DIR\n"
            "  DIR holds model.gguf, model.gguf.sums and routing.bin (examples/c_engine/prepare.py)\n"
            "  --source file|pinned     experts read from the file by the cache (default), or read into pinned\n"
            "                           host memory by the engine first and registered as pinned sources\n"
            "  --reads direct|buffered  the cache's file reads: O_DIRECT (default) or through the page cache\n"
            "  --bank slots|parts       each class's bank: an expert's parts in one slot (default), or a region\n"
            "                           per part, each [rows, part] (a tensor per part, as ggml's are)\n"
            "  --backend auto|host|cuda the library's backend (auto: CUDA when a device is usable)\n"
            "  --budget-gib X           the cache's budget (default: --budget-frac of the experts' bytes)\n"
            "  --budget-frac F          default 0.15\n"
            "  --policy NAME            an eviction policy of the library (default: its default)\n"
            "  --mtp N                  a verification step of N tokens as one union select (default 3; 0: none)\n"
            "  --mtp-every S            after every S single-token steps (default 8)\n"
            "  --tokens N               decode the first N tokens (default: all)\n"
            "  --prompt N               prefill the first N prompt tokens (default: all; 0: no prefill)\n"
            "  --loops both|graph|gather\n"
            "  --model PATH, --routing PATH, --sums PATH   instead of DIR's files\n"
            "  --json PATH              the results as JSON too\n"
            "  --verbose                the library's debug lines\n");
}

static Options parse_options(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) {
                usage(stderr);
                fatal("%s needs a value", a.c_str());
            }
            return argv[++i];
        };
        if (a == "--help" || a == "-h") {
            usage(stdout);
            exit(0);
        } else if (a == "--source") {
            std::string v = value();
            if (v != "file" && v != "pinned") fatal("--source file|pinned, not %s", v.c_str());
            o.pinned_source = v == "pinned";
        } else if (a == "--bank") {
            std::string v = value();
            if (v != "slots" && v != "parts") fatal("--bank slots|parts, not %s", v.c_str());
            o.parts_bank = v == "parts";
        } else if (a == "--reads") {
            std::string v = value();
            if (v != "direct" && v != "buffered") fatal("--reads direct|buffered, not %s", v.c_str());
            o.direct_reads = v == "direct";
        } else if (a == "--backend") {
            std::string v = value();
            if (v == "auto")
                o.backend = -1;
            else if (v == "host")
                o.backend = EXPCACHE_BACKEND_HOST;
            else if (v == "cuda")
                o.backend = EXPCACHE_BACKEND_CUDA;
            else
                fatal("--backend auto|host|cuda, not %s", v.c_str());
        } else if (a == "--budget-gib") {
            o.budget_gib = atof(value().c_str());
            if (!(o.budget_gib > 0)) fatal("--budget-gib must be positive");
        } else if (a == "--budget-frac") {
            o.budget_frac = atof(value().c_str());
            if (!(o.budget_frac > 0)) fatal("--budget-frac must be positive");
        } else if (a == "--policy") {
            std::string v = value();
            for (uint32_t p = 0; expcache_policy_name(p); ++p)
                if (v == expcache_policy_name(p)) o.policy = (int)p;
            if (o.policy < 0) fatal("unknown policy %s", v.c_str());
        } else if (a == "--mtp") {
            o.mtp = (uint32_t)atoi(value().c_str());
        } else if (a == "--mtp-every") {
            o.mtp_every = (uint32_t)atoi(value().c_str());
            if (o.mtp_every == 0) fatal("--mtp-every must be at least 1");
        } else if (a == "--tokens") {
            o.tokens = (uint32_t)atoi(value().c_str());
        } else if (a == "--prompt") {
            o.prompt = atoi(value().c_str());
            if (o.prompt < 0) fatal("--prompt must be at least 0");
        } else if (a == "--loops") {
            std::string v = value();
            if (v != "both" && v != "graph" && v != "gather") fatal("--loops both|graph|gather, not %s", v.c_str());
            o.run_graph = v != "gather";
            o.run_gather = v != "graph";
        } else if (a == "--model") {
            o.model = value();
        } else if (a == "--routing") {
            o.routing = value();
        } else if (a == "--sums") {
            o.sums = value();
        } else if (a == "--json") {
            o.json = value();
        } else if (a == "--verbose") {
            o.verbose = true;
        } else if (!a.empty() && a[0] != '-' && o.dir.empty()) {
            o.dir = a;
        } else {
            usage(stderr);
            fatal("unknown argument %s", a.c_str());
        }
    }
    if (o.model.empty()) o.model = o.dir.empty() ? "" : o.dir + "/model.gguf";
    if (o.routing.empty()) o.routing = o.dir.empty() ? "" : o.dir + "/routing.bin";
    if (o.sums.empty()) o.sums = o.model.empty() ? "" : o.model + ".sums";
    if (o.model.empty() || o.routing.empty()) {
        usage(stderr);
        fatal("no model: give DIR, or --model and --routing");
    }
    if (o.mtp > 64) fatal("--mtp is at most 64");
    return o;
}

/* ---------------------------------------------------------------------- */
/* The router's stand-in (routing.bin) and the recorded sums               */
/* ---------------------------------------------------------------------- */

struct Routing {
    uint32_t L = 0, k = 0, P = 0, T = 0, E = 0;
    std::vector<int32_t> layers;
    std::vector<int32_t> prompt, decode; /* [P][L][k], [T][L][k] */
    const int32_t* prompt_ids(uint32_t t, uint32_t li) const { return &prompt[((size_t)t * L + li) * k]; }
    const int32_t* decode_ids(uint32_t t, uint32_t li) const { return &decode[((size_t)t * L + li) * k]; }
};

struct Sums {
    uint32_t L = 0, E = 0;
    std::vector<int32_t> layers;
    std::vector<uint64_t> v; /* [L][E][3] */
    const uint64_t* of(uint32_t li, uint32_t e) const { return &v[((size_t)li * E + e) * 3]; }
};

static void read_exact(FILE* f, void* dst, size_t bytes, const char* path) {
    if (bytes && fread(dst, 1, bytes, f) != bytes) fatal("%s: truncated", path);
}

static std::vector<int32_t> read_header(FILE* f, const char* magic, uint32_t ints, const char* path) {
    char m[4];
    read_exact(f, m, 4, path);
    if (memcmp(m, magic, 4) != 0) fatal("%s: not a %.4s file", path, magic);
    std::vector<int32_t> h(ints);
    read_exact(f, h.data(), ints * 4, path);
    if (h[0] != 1) fatal("%s: version %d, this engine reads 1", path, h[0]);
    for (int32_t x : h)
        if (x < 0) fatal("%s: a negative count in the header", path);
    return h;
}

static Routing load_routing(const std::string& path) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) fatal("%s: %s", path.c_str(), strerror(errno));
    std::vector<int32_t> h = read_header(f, "ECRT", 6, path.c_str());
    Routing r;
    r.L = h[1], r.k = h[2], r.P = h[3], r.T = h[4], r.E = h[5];
    if (!r.L || !r.k || r.k > 64 || !r.T || !r.E) fatal("%s: bad geometry", path.c_str());
    r.layers.resize(r.L);
    r.prompt.resize((size_t)r.P * r.L * r.k);
    r.decode.resize((size_t)r.T * r.L * r.k);
    read_exact(f, r.layers.data(), r.L * 4, path.c_str());
    read_exact(f, r.prompt.data(), r.prompt.size() * 4, path.c_str());
    read_exact(f, r.decode.data(), r.decode.size() * 4, path.c_str());
    fclose(f);
    for (int32_t id : r.prompt)
        if (id < 0 || (uint32_t)id >= r.E) fatal("%s: expert id %d out of range", path.c_str(), id);
    for (int32_t id : r.decode)
        if (id < 0 || (uint32_t)id >= r.E) fatal("%s: expert id %d out of range", path.c_str(), id);
    return r;
}

static Sums load_sums(const std::string& path) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) fatal("%s: %s", path.c_str(), strerror(errno));
    std::vector<int32_t> h = read_header(f, "ECSM", 3, path.c_str());
    Sums s;
    s.L = h[1], s.E = h[2];
    s.layers.resize(s.L);
    s.v.resize((size_t)s.L * s.E * 3);
    read_exact(f, s.layers.data(), s.L * 4, path.c_str());
    read_exact(f, s.v.data(), s.v.size() * 8, path.c_str());
    fclose(f);
    return s;
}

/* ---------------------------------------------------------------------- */
/* The expert-reading kernel: the GEMVs' stand-in                          */
/* ---------------------------------------------------------------------- */

/* Where a layer's selected experts are: entry i's part p at base[p] + slots[i] * stride[p] (one
   slot's parts side by side, or a region per part: the bank's arrangement). */
struct Geometry {
    const uint8_t* base[3];
    uint64_t stride[3];
    uint64_t bytes[3];
};

/* What a sum is made of when the entry had no slot (-1: an id out of range, a failed read). */
static constexpr uint64_t kNoSlot = 0x8000000000000badull;
static constexpr uint64_t kChunk = 64 << 10; /* bytes of one part one block reduces */

/* One block per (64 KiB chunk, entry, part): the sum of the part's little-endian 32-bit words,
   16-byte loads, added into sums[entry * 3 + part] (zeroed before). */
__global__ void expert_sums_kernel(Geometry g, const int32_t* slots, uint32_t count, unsigned long long* sums) {
    const uint32_t entry = blockIdx.y / 3, part = blockIdx.y % 3;
    const uint64_t start = (uint64_t)blockIdx.x * kChunk, bytes = g.bytes[part];
    if (entry >= count || start >= bytes) return;
    const int32_t slot = slots[entry];
    unsigned long long* out = sums + entry * 3 + part;
    if (slot < 0) {
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(out, (unsigned long long)kNoSlot);
        return;
    }
    const uint8_t* p = g.base[part] + (uint64_t)slot * g.stride[part];
    const uint64_t end = start + kChunk < bytes ? start + kChunk : bytes;
    const uint64_t vend = start + ((end - start) & ~15ull);
    unsigned long long acc = 0;
#pragma unroll 4
    for (uint64_t i = start + threadIdx.x * 16; i < vend; i += blockDim.x * 16) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(p + i));
        acc += (unsigned long long)v.x + v.y + v.z + v.w;
    }
    for (uint64_t i = vend + threadIdx.x; i < end; i += blockDim.x) acc += (unsigned long long)p[i] << (8 * (i & 3));
    for (int d = 16; d > 0; d /= 2) acc += __shfl_down_sync(0xffffffffu, acc, d);
    __shared__ unsigned long long warp_sums[32];
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long total = 0;
        for (uint32_t w = 0; w < blockDim.x / 32; ++w) total += warp_sums[w];
        atomicAdd(out, total);
    }
}

/* The same sums on the host backend: a loop over the same bytes. */
static void expert_sums_host(const Geometry& g, const int32_t* slots, uint32_t count, uint64_t* sums) {
    for (uint32_t i = 0; i < count; ++i)
        for (int p = 0; p < 3; ++p) {
            if (slots[i] < 0) {
                sums[i * 3 + p] += kNoSlot;
                continue;
            }
            const uint8_t* src = g.base[p] + (uint64_t)slots[i] * g.stride[p];
            uint64_t acc = 0, j = 0;
            for (; j + 4 <= g.bytes[p]; j += 4) {
                uint32_t w;
                memcpy(&w, src + j, 4);
                acc += w;
            }
            for (; j < g.bytes[p]; ++j) acc += (uint64_t)src[j] << (8 * (j & 3));
            sums[i * 3 + p] += acc;
        }
}

/* ---------------------------------------------------------------------- */
/* The engine                                                              */
/* ---------------------------------------------------------------------- */

struct Layer {
    gguf_moe_layer_t file;    /* where its experts are in the GGUF */
    const uint8_t* pinned[3]; /* --source pinned: the engine's copy of each part's tensor */
    uint32_t cls;             /* its size class in the current cache */
    Geometry bank;            /* the class's bank in the current cache */
};

/* One decode step: tokens first..first+n-1 (n > 1: a verification as one union select). Its ids
   are laid out [L][n][k] at ids_at (entries), its results [sums: L*n*k*3 uint64][slots: L*n*k
   int32] at result_at (bytes). */
struct Step {
    uint32_t first, n;
    size_t ids_at, result_at;
};

struct Counters {
    uint64_t hits = 0, misses = 0, evictions = 0, appends = 0, direct = 0, h2d = 0, d2d = 0;
};

struct LoopResult {
    const char* name = "";
    bool ran = false;
    double seconds = 0;
    uint32_t tokens = 0, steps = 0;
    Counters decode;                               /* the library's counters over the decode loop */
    uint64_t gather_bytes = 0;                     /* bytes the engine copied device to device (the gather) */
    uint64_t checked = 0, bad = 0;                 /* decode entries whose three sums were checked, and wrong */
    uint64_t no_slot = 0;                          /* entries given slot -1 */
    uint64_t prefill_checked = 0, prefill_bad = 0; /* the prompt's distinct experts per layer, summed */
    Counters prefill;
};

struct Engine {
    Options opt;
    bool cuda = false;
    cudaStream_t stream = nullptr;
    int fd = -1;
    gguf_model_t model{};
    Routing rt;
    Sums sums;
    std::vector<Layer> layers;
    uint32_t num_classes = 0, num_layers = 0; /* distinct expert sizes; config.num_layers */
    uint64_t expert_bytes = 0, budget = 0;
    std::vector<Step> steps;
    uint32_t tokens = 0, max_entries = 0; /* decode tokens; most ids one layer of a step selects */
    int32_t* step_ids = nullptr;          /* every step's ids (pinned on CUDA: copied while others run) */
    uint8_t* results = nullptr;           /* every step's results (pinned on CUDA) */
    size_t results_bytes = 0;
};

static uint32_t L_of(const Engine& e) {
    return (uint32_t)e.layers.size();
}

/* Memory that follows the backend, and copies between it on the engine's stream. On CUDA the
   caller names the allocator: cudaMalloc for device memory, cudaMallocHost for pinned host memory
   (freed by cudaFree and cudaFreeHost); on the host backend both are plain host memory. */
typedef cudaError_t (*CudaAlloc)(void** p, size_t bytes);
typedef cudaError_t (*CudaFree)(void* p);
static void* backend_alloc(Engine& e, CudaAlloc cuda_alloc, size_t bytes) {
    void* p = nullptr;
    if (e.cuda)
        CU(cuda_alloc(&p, bytes ? bytes : 1));
    else if (posix_memalign(&p, 4096, bytes ? bytes : 1) != 0)
        fatal("out of host memory (%zu bytes)", bytes);
    return p;
}
static void backend_free(Engine& e, CudaFree cuda_free, void* p) {
    if (e.cuda)
        CU(cuda_free(p));
    else
        free(p);
}
static void copy_async(Engine& e, void* dst, const void* src, size_t bytes) {
    if (e.cuda)
        CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, e.stream));
    else
        memcpy(dst, src, bytes);
}
static void zero_async(Engine& e, void* dst, size_t bytes) {
    if (e.cuda)
        CU(cudaMemsetAsync(dst, 0, bytes, e.stream));
    else
        memset(dst, 0, bytes);
}
static void sync(Engine& e) {
    if (e.cuda) CU(cudaStreamSynchronize(e.stream));
}

/* The kernel on the stream, or the host loop. */
static void read_experts(Engine& e, const Geometry& g, const int32_t* slots, uint32_t count, uint64_t* sums) {
    if (count == 0) return;
    if (!e.cuda) {
        expert_sums_host(g, slots, count, sums);
        return;
    }
    const uint64_t largest = std::max(g.bytes[0], std::max(g.bytes[1], g.bytes[2]));
    dim3 grid((unsigned)((largest + kChunk - 1) / kChunk), count * 3);
    expert_sums_kernel<<<grid, 256, 0, e.stream>>>(g, slots, count, reinterpret_cast<unsigned long long*>(sums));
    CU(cudaGetLastError());
}

/* ---------------------------------------------------------------------- */
/* Set-up: the model, the pinned copy, the cache                           */
/* ---------------------------------------------------------------------- */

static void load_model(Engine& e) {
    e.fd = open(e.opt.model.c_str(), O_RDONLY);
    if (e.fd < 0) fatal("%s: %s", e.opt.model.c_str(), strerror(errno));
    char err[512];
    if (gguf_load(e.fd, &e.model, err, sizeof err) != 0) fatal("%s: %s", e.opt.model.c_str(), err);
    if (!e.model.num_layers) fatal("%s: no routed expert tensors (blk.N.ffn_*_exps.weight)", e.opt.model.c_str());
    e.rt = load_routing(e.opt.routing);
    e.sums = load_sums(e.opt.sums);
    if (e.opt.prompt >= 0 && (uint32_t)e.opt.prompt < e.rt.P) e.rt.P = (uint32_t)e.opt.prompt;
    if (e.rt.L != e.model.num_layers || e.sums.L != e.model.num_layers)
        fatal("the model has %u MoE layers, the routing %u, the sums %u", e.model.num_layers, e.rt.L, e.sums.L);
    std::vector<std::array<uint64_t, 3>> keys; /* the size classes: distinct (gate, up, down) bytes */
    for (uint32_t i = 0; i < e.model.num_layers; ++i) {
        const gguf_moe_layer_t& f = e.model.layers[i];
        if ((int32_t)f.layer != e.rt.layers[i] || (int32_t)f.layer != e.sums.layers[i])
            fatal("layer %u of the model is layer %d of the routing and %d of the sums", f.layer, e.rt.layers[i],
                  e.sums.layers[i]);
        if (f.num_experts != e.rt.E || f.num_experts != e.sums.E)
            fatal("layer %u has %u experts, the routing says %u, the sums %u", f.layer, f.num_experts, e.rt.E,
                  e.sums.E);
        Layer L{};
        L.file = f;
        e.layers.push_back(L);
        e.expert_bytes += (f.bytes[0] + f.bytes[1] + f.bytes[2]) * f.num_experts;
        e.num_layers = std::max(e.num_layers, f.layer + 1);
        const std::array<uint64_t, 3> key = {f.bytes[0], f.bytes[1], f.bytes[2]};
        if (std::find(keys.begin(), keys.end(), key) == keys.end()) keys.push_back(key);
    }
    e.num_classes = (uint32_t)keys.size();
    e.budget = e.opt.budget_gib > 0 ? (uint64_t)(e.opt.budget_gib * (1ull << 30))
                                    : (uint64_t)(e.opt.budget_frac * (double)e.expert_bytes);
}

/* --source pinned: the engine reads every expert tensor into pinned host memory itself, by threads
   reading 64 MiB pieces at once (as an engine that keeps its experts in RAM loads them). */
static void load_pinned(Engine& e) {
    const double t0 = now_s();
    struct Piece {
        uint8_t* dst;
        uint64_t offset, bytes;
    };
    std::vector<Piece> pieces;
    uint64_t total = 0;
    for (Layer& L : e.layers)
        for (int p = 0; p < 3; ++p) {
            const uint64_t bytes = L.file.stride[p] * L.file.num_experts;
            uint8_t* buf = (uint8_t*)backend_alloc(e, cudaMallocHost, bytes);
            L.pinned[p] = buf;
            for (uint64_t at = 0; at < bytes; at += 64ull << 20)
                pieces.push_back({buf + at, L.file.offset[p] + at, std::min<uint64_t>(64ull << 20, bytes - at)});
            total += bytes;
        }
    std::atomic<size_t> next{0};
    std::atomic<int> failed{0};
    auto reader = [&]() {
        for (size_t i; (i = next++) < pieces.size();)
            for (uint64_t done = 0; done < pieces[i].bytes;) {
                ssize_t got =
                    pread(e.fd, pieces[i].dst + done, pieces[i].bytes - done, (off_t)(pieces[i].offset + done));
                if (got <= 0) {
                    failed = errno ? errno : EIO;
                    return;
                }
                done += (uint64_t)got;
            }
    };
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) threads.emplace_back(reader);
    for (auto& t : threads) t.join();
    if (failed) fatal("%s: reading the experts: %s", e.opt.model.c_str(), strerror(failed));
    posix_fadvise(e.fd, 0, 0, POSIX_FADV_DONTNEED);
    const double dt = now_s() - t0;
    say("read %.3f GiB of experts into %s host memory in %.1f s (%.2f GB/s)", total / 1073741824.0,
        e.cuda ? "pinned" : "(the host backend's) plain", dt, total / dt / 1e9);
}

/* The decode schedule: single-token steps, and after every mtp_every of them a verification of
   mtp tokens (while that many are left). */
static void plan_steps(Engine& e) {
    const uint32_t L = L_of(e), k = e.rt.k;
    e.tokens = e.opt.tokens && e.opt.tokens < e.rt.T ? e.opt.tokens : e.rt.T;
    size_t ids = 0, bytes = 0;
    uint32_t singles = 0;
    for (uint32_t t = 0; t < e.tokens;) {
        uint32_t n = 1;
        if (e.opt.mtp > 1 && singles == e.opt.mtp_every && t + e.opt.mtp <= e.tokens) n = e.opt.mtp;
        singles = n > 1 ? 0 : singles + 1;
        e.steps.push_back({t, n, ids, bytes});
        ids += (size_t)L * n * k;
        bytes += ((size_t)L * n * k * 28 + 7) / 8 * 8; /* each step's sums 8-byte aligned */
        e.max_entries = std::max(e.max_entries, n * k);
        t += n;
    }
    e.step_ids = (int32_t*)backend_alloc(e, cudaMallocHost, ids * 4);
    for (const Step& s : e.steps)
        for (uint32_t li = 0; li < L; ++li)
            for (uint32_t r = 0; r < s.n; ++r)
                memcpy(e.step_ids + s.ids_at + ((size_t)li * s.n + r) * k, e.rt.decode_ids(s.first + r, li), k * 4);
    e.results_bytes = bytes;
    e.results = (uint8_t*)backend_alloc(e, cudaMallocHost, bytes);
}

/* A cache for one loop: the engine's config, its log, the file (by descriptor, as ds4 holds it) or
   the pinned copy, every MoE layer registered in one call, each layer's class bound and its bank's
   geometry read (before any capture). */
static expcache_t* make_cache(Engine& e, bool device_lookup) {
    expcache_config_t cfg;
    EC(expcache_config_init(&cfg));
    cfg.backend = e.cuda ? EXPCACHE_BACKEND_CUDA : EXPCACHE_BACKEND_HOST;
    cfg.num_layers = e.num_layers;
    cfg.max_classes = e.num_classes;
    cfg.budget_bytes = e.budget;
    cfg.lookup = device_lookup ? EXPCACHE_LOOKUP_DEVICE : EXPCACHE_LOOKUP_HOST;
    cfg.environment = EXPCACHE_ENVIRONMENT_IGNORE; /* the engine's settings are the cache's */
    cfg.file_reads = e.opt.direct_reads ? EXPCACHE_FILE_READS_DIRECT : EXPCACHE_FILE_READS_BUFFERED;
    cfg.bank_arrangement = e.opt.parts_bank ? EXPCACHE_BANK_PARTS : EXPCACHE_BANK_SLOTS;
    cfg.log_level = e.opt.verbose ? EXPCACHE_LOG_DEBUG : EXPCACHE_LOG_NOTICE;
    if (e.opt.policy >= 0) cfg.policy = (uint32_t)e.opt.policy;
    expcache_t* cache = nullptr;
    EC(expcache_create(&cfg, &cache));
    EC(expcache_log_set_callback(cache, library_log, nullptr));

    uint32_t file = 0;
    if (!e.opt.pinned_source) {
        posix_fadvise(e.fd, 0, 0, POSIX_FADV_DONTNEED); /* each loop's buffered reads start from the disk */
        EC(expcache_file_open_fd(cache, e.fd, &file));
    }
    std::vector<uint32_t> ids;
    std::vector<expcache_layer_desc_t> descs;
    for (const Layer& L : e.layers) {
        expcache_layer_desc_t d;
        EC(expcache_layer_desc_init(&d));
        d.num_experts = L.file.num_experts;
        d.source_kind = e.opt.pinned_source ? EXPCACHE_SOURCE_PINNED : EXPCACHE_SOURCE_FILE;
        d.file = e.opt.pinned_source ? 0 : file;
        d.gate_bytes = L.file.bytes[0], d.up_bytes = L.file.bytes[1], d.down_bytes = L.file.bytes[2];
        d.gate_stride = L.file.stride[0], d.up_stride = L.file.stride[1], d.down_stride = L.file.stride[2];
        const void* base[3];
        for (int p = 0; p < 3; ++p)
            base[p] = e.opt.pinned_source ? (const void*)L.pinned[p] : (const void*)(uintptr_t)L.file.offset[p];
        d.gate_base = base[0], d.up_base = base[1], d.down_base = base[2];
        ids.push_back(L.file.layer);
        descs.push_back(d);
    }
    EC(expcache_layers_register(cache, (uint32_t)ids.size(), ids.data(), descs.data()));
    for (Layer& L : e.layers) {
        EC(expcache_layer_bind_class(cache, L.file.layer, &L.cls));
        expcache_bank_t b;
        b.struct_size = sizeof b;
        EC(expcache_class_bank_get(cache, L.cls, &b));
        for (int p = 0; p < 3; ++p) {
            L.bank.base[p] = (const uint8_t*)b.base + b.part_offset[p];
            L.bank.stride[p] = b.part_stride[p];
            L.bank.bytes[p] = b.part_bytes[p];
            if (((uintptr_t)L.bank.base[p] | L.bank.stride[p]) % 16)
                fatal("class %u's bank is not 16-byte aligned (the kernel's loads)", L.cls);
        }
    }
    return cache;
}

static Counters totals(expcache_t* cache, uint32_t classes) {
    std::vector<expcache_class_info_t> infos(classes);
    std::vector<expcache_stats_t> st((size_t)classes * EXPCACHE_NUM_PATHS);
    infos[0].struct_size = sizeof infos[0];
    st[0].struct_size = sizeof st[0];
    EC(expcache_stats_read(cache, classes, infos.data(), st.data()));
    Counters c;
    for (const expcache_stats_t& s : st) {
        c.hits += s.hits, c.misses += s.misses, c.evictions += s.evictions, c.appends += s.appends;
        c.direct += s.direct_loads, c.h2d += s.bytes_h2d, c.d2d += s.bytes_d2d;
    }
    return c;
}

static Counters minus(const Counters& a, const Counters& b) {
    Counters c;
    c.hits = a.hits - b.hits, c.misses = a.misses - b.misses, c.evictions = a.evictions - b.evictions;
    c.appends = a.appends - b.appends, c.direct = a.direct - b.direct, c.h2d = a.h2d - b.h2d, c.d2d = a.d2d - b.d2d;
    return c;
}

/* expcache_stats_read, printed: every class, every path that served a call. */
static void print_stats(expcache_t* cache, uint32_t classes, const char* loop) {
    std::vector<expcache_class_info_t> infos(classes);
    std::vector<expcache_stats_t> st((size_t)classes * EXPCACHE_NUM_PATHS);
    infos[0].struct_size = sizeof infos[0];
    st[0].struct_size = sizeof st[0];
    EC(expcache_stats_read(cache, classes, infos.data(), st.data()));
    printf("\n%s loop: expcache_stats_read\n", loop);
    printf("  %-5s %-26s %6s %8s  %-8s %7s %8s %8s %9s %7s %7s %11s %11s\n", "class", "gate/up/down KiB", "cap",
           "resident", "path", "calls", "hits", "misses", "evictions", "appends", "direct", "H2D MiB", "D2D MiB");
    for (uint32_t c = 0; c < classes; ++c) {
        const expcache_class_info_t& in = infos[c];
        if (!in.in_use) continue;
        char key[64];
        snprintf(key, sizeof key, "%.2f/%.2f/%.2f", in.gate_bytes / 1024.0, in.up_bytes / 1024.0,
                 in.down_bytes / 1024.0);
        bool first = true;
        for (uint32_t p = 0; p < EXPCACHE_NUM_PATHS; ++p) {
            const expcache_stats_t& s = st[(size_t)c * EXPCACHE_NUM_PATHS + p];
            if (!s.calls) continue;
            if (first)
                printf("  %-5u %-26s %6" PRIu64 " %8" PRIu64, c, key, in.cap_experts, in.resident_experts);
            else
                printf("  %-5s %-26s %6s %8s", "", "", "", "");
            first = false;
            printf("  %-8s %7" PRIu64 " %8" PRIu64 " %8" PRIu64 " %9" PRIu64 " %7" PRIu64 " %7" PRIu64
                   " %11.1f %11.1f\n",
                   expcache_path_name(p), s.calls, s.hits, s.misses, s.evictions, s.appends, s.direct_loads,
                   s.bytes_h2d / 1048576.0, s.bytes_d2d / 1048576.0);
        }
    }
}

/* ---------------------------------------------------------------------- */
/* Checking the sums                                                       */
/* ---------------------------------------------------------------------- */

/* Entry sums[i] (three parts) of layer index li against expert ids[i]'s recorded sums; `token` is
   the decode token, or -1 for the prompt's distinct experts. Returns the entries that differ. */
static uint64_t check_sums(Engine& e, LoopResult& r, uint32_t li, int64_t token, const int32_t* ids,
                           const uint64_t* sums, const int32_t* slots, uint32_t count) {
    static const char* const parts[] = {"gate", "up", "down"};
    uint64_t bad = 0;
    for (uint32_t i = 0; i < count; ++i) {
        const uint64_t* want = e.sums.of(li, (uint32_t)ids[i]);
        if (slots[i] < 0) ++r.no_slot;
        std::string wrong;
        for (int p = 0; p < 3; ++p)
            if (sums[i * 3 + p] != want[p]) wrong += std::string(wrong.empty() ? "" : ", ") + parts[p];
        if (wrong.empty()) continue;
        if (r.bad + r.prefill_bad + bad < 8) {
            char where[64];
            if (token < 0)
                snprintf(where, sizeof where, "the prompt");
            else
                snprintf(where, sizeof where, "decode token %" PRId64, token);
            say("BAD SUM: %s loop, %s, layer %u, expert %d (%s %d): the sums of %s differ from the recorded ones",
                r.name, where, e.layers[li].file.layer, ids[i],
                strcmp(r.name, "gather") == 0 && token >= 0 ? "table row" : "slot", slots[i], wrong.c_str());
        }
        ++bad;
    }
    return bad;
}

static void check_decode(Engine& e, LoopResult& r) {
    const uint32_t L = L_of(e), k = e.rt.k;
    for (const Step& s : e.steps) {
        const uint64_t* sums = (const uint64_t*)(e.results + s.result_at);
        const int32_t* slots = (const int32_t*)(sums + (size_t)L * s.n * k * 3);
        for (uint32_t li = 0; li < L; ++li)
            for (uint32_t row = 0; row < s.n; ++row) {
                const size_t at = ((size_t)li * s.n + row) * k;
                r.bad += check_sums(e, r, li, s.first + row, e.rt.decode_ids(s.first + row, li), sums + at * 3,
                                    slots + at, k);
                r.checked += k;
            }
    }
}

/* ---------------------------------------------------------------------- */
/* Prefill: the prompt's tokens by slot id, appended into the same bank    */
/* ---------------------------------------------------------------------- */

static void prefill(Engine& e, expcache_t* cache, LoopResult& r) {
    if (!e.rt.P) return;
    const uint32_t L = L_of(e), k = e.rt.k, n = e.rt.P * k;
    std::vector<int32_t> ids(n);
    std::vector<uint32_t> out_ids(n);
    std::vector<int32_t> out_slots(n);
    int32_t* slots_dev = (int32_t*)backend_alloc(e, cudaMalloc, (size_t)n * 4);
    uint64_t* sums_dev = (uint64_t*)backend_alloc(e, cudaMalloc, (size_t)n * 24);
    std::vector<uint64_t> sums((size_t)n * 3);
    const Counters before = totals(cache, e.num_classes);
    for (uint32_t li = 0; li < L; ++li) {
        for (uint32_t t = 0; t < e.rt.P; ++t) memcpy(&ids[(size_t)t * k], e.rt.prompt_ids(t, li), k * 4);
        uint32_t count = 0;
        uint64_t batch = 0;
        EC(expcache_batch_prepare_slots_async(cache, e.layers[li].file.layer, ids.data(), 32, n, e.stream,
                                              out_ids.data(), out_slots.data(), &count, &batch));
        copy_async(e, slots_dev, out_slots.data(), (size_t)count * 4);
        zero_async(e, sums_dev, (size_t)count * 24);
        read_experts(e, e.layers[li].bank, slots_dev, count, sums_dev);
        copy_async(e, sums.data(), sums_dev, (size_t)count * 24);
        EC(expcache_batch_finish(cache, batch, e.stream));
        sync(e);
        std::vector<int32_t> distinct(out_ids.begin(), out_ids.begin() + count);
        r.prefill_bad += check_sums(e, r, li, -1, distinct.data(), sums.data(), out_slots.data(), count);
        r.prefill_checked += count;
    }
    r.prefill = minus(totals(cache, e.num_classes), before);
    backend_free(e, cudaFree, slots_dev);
    backend_free(e, cudaFree, sums_dev);
}

/* ---------------------------------------------------------------------- */
/* The graph loop: device select, one CUDA graph per step                  */
/* ---------------------------------------------------------------------- */

/* One step of n tokens on the stream: every layer's device select of its [n, k] ids and its kernel
   reading the selected experts in place through the bank. What is captured (or, on the host
   backend, run as it is). */
static void device_step(Engine& e, expcache_t* cache, uint32_t n, const int32_t* ids, uint8_t* result) {
    const uint32_t L = L_of(e), k = e.rt.k;
    uint64_t* sums = (uint64_t*)result;
    int32_t* slots = (int32_t*)(sums + (size_t)L * n * k * 3);
    zero_async(e, sums, (size_t)L * n * k * 24);
    for (uint32_t li = 0; li < L; ++li) {
        const size_t at = (size_t)li * n * k;
        EC(expcache_select_device_async(cache, e.layers[li].file.layer, ids + at, 32, n, k, slots + at, e.stream));
        read_experts(e, e.layers[li].bank, slots + at, n * k, sums + at * 3);
    }
}

static void graph_loop(Engine& e, LoopResult& r) {
    const uint32_t L = L_of(e), k = e.rt.k;
    expcache_t* cache = make_cache(e, true);
    prefill(e, cache, r);

    /* Per step width n (1, and the verification's): the captured ids and results buffers, a graph. */
    struct Width {
        int32_t* ids = nullptr;
        uint8_t* result = nullptr;
        cudaGraphExec_t exec = nullptr;
    };
    std::vector<Width> widths(e.opt.mtp + 2);
    for (const Step& s : e.steps) {
        Width& w = widths[s.n];
        if (w.ids) continue;
        w.ids = (int32_t*)backend_alloc(e, cudaMalloc, (size_t)L * s.n * k * 4);
        w.result = (uint8_t*)backend_alloc(e, cudaMalloc, (size_t)L * s.n * k * 28);
        if (!e.cuda) continue;
        cudaGraph_t graph;
        CU(cudaStreamBeginCapture(e.stream, cudaStreamCaptureModeThreadLocal));
        device_step(e, cache, s.n, w.ids, w.result);
        CU(cudaStreamEndCapture(e.stream, &graph));
        CU(cudaGraphInstantiate(&w.exec, graph, 0));
        CU(cudaGraphDestroy(graph));
        CU(cudaGraphUpload(w.exec, e.stream));
    }
    sync(e);

    const Counters before = totals(cache, e.num_classes);
    const double t0 = now_s();
    for (const Step& s : e.steps) {
        Width& w = widths[s.n];
        const size_t result_bytes = (size_t)L * s.n * k * 28;
        copy_async(e, w.ids, e.step_ids + s.ids_at, (size_t)L * s.n * k * 4); /* the router's stand-in */
        if (e.cuda)
            CU(cudaGraphLaunch(w.exec, e.stream));
        else
            device_step(e, cache, s.n, w.ids, w.result);
        copy_async(e, e.results + s.result_at, w.result, result_bytes);
        sync(e); /* the token is read back, as an engine samples it */
    }
    r.seconds = now_s() - t0;
    r.decode = minus(totals(cache, e.num_classes), before);
    r.tokens = e.tokens;
    r.steps = (uint32_t)e.steps.size();
    r.ran = true;
    print_stats(cache, e.num_classes, r.name);
    for (Width& w : widths) {
        if (w.exec) CU(cudaGraphExecDestroy(w.exec));
        if (w.ids) backend_free(e, cudaFree, w.ids), backend_free(e, cudaFree, w.result);
    }
    expcache_destroy(cache);
    check_decode(e, r);
}

/* ---------------------------------------------------------------------- */
/* The gather loop: host select, a compact table per layer                 */
/* ---------------------------------------------------------------------- */

/* The compact table's rows for a layer (the table at `table`): laid out as its bank's slot where
   the bank keeps a slot's parts side by side, else its parts side by side, each 256-byte aligned. */
static Geometry table_rows(const Geometry& bank, const uint8_t* table) {
    const bool slots = bank.stride[0] == bank.stride[1] && bank.stride[1] == bank.stride[2] &&
                       bank.base[0] <= bank.base[1] && bank.base[1] <= bank.base[2] &&
                       (uint64_t)(bank.base[2] - bank.base[0]) < bank.stride[0];
    Geometry g = bank;
    uint64_t at = 0;
    for (int p = 0; p < 3; ++p) {
        g.base[p] = table + (slots ? (uint64_t)(bank.base[p] - bank.base[0]) : at);
        at += (bank.bytes[p] + 255) / 256 * 256;
    }
    for (int p = 0; p < 3; ++p) g.stride[p] = slots ? bank.stride[0] : at;
    return g;
}

static void gather_loop(Engine& e, LoopResult& r) {
    const uint32_t L = L_of(e), k = e.rt.k;
    expcache_t* cache = make_cache(e, false);
    prefill(e, cache, r);

    /* The compact table: max_entries rows laid out as a bank slot (table_rows: with a bank of slots
       the same stride and part offsets, so one copy per expert when its parts are contiguous), and
       the rows the kernel reads: 0..n*k-1. */
    uint64_t row_bytes = 0;
    for (const Layer& Ly : e.layers) row_bytes = std::max(row_bytes, table_rows(Ly.bank, nullptr).stride[0]);
    uint8_t* table = (uint8_t*)backend_alloc(e, cudaMalloc, row_bytes * e.max_entries);
    std::vector<int32_t> rows(e.max_entries);
    for (uint32_t i = 0; i < e.max_entries; ++i) rows[i] = (int32_t)i;
    int32_t* rows_dev = (int32_t*)backend_alloc(e, cudaMalloc, e.max_entries * 4);
    copy_async(e, rows_dev, rows.data(), e.max_entries * 4);
    uint8_t* result_dev = (uint8_t*)backend_alloc(e, cudaMalloc, (size_t)L * e.max_entries * 24);
    std::vector<expcache_expert_ptrs_t> ptrs(e.max_entries);
    sync(e);

    const Counters before = totals(cache, e.num_classes);
    const double t0 = now_s();
    for (const Step& s : e.steps) {
        const uint32_t count = s.n * k;
        uint64_t* sums = (uint64_t*)result_dev;
        zero_async(e, sums, (size_t)L * count * 24);
        for (uint32_t li = 0; li < L; ++li) {
            const Layer& Ly = e.layers[li];
            const size_t at = (size_t)li * count;
            EC(expcache_select_ids_async(cache, Ly.file.layer, e.step_ids + s.ids_at + at, 32, count, e.stream,
                                         ptrs.data()));
            const Geometry g = table_rows(Ly.bank, table);
            const uint64_t up_at = g.base[1] - g.base[0], down_at = g.base[2] - g.base[0];
            for (uint32_t i = 0; i < count; ++i) {
                uint8_t* row = table + (uint64_t)i * g.stride[0];
                const uint8_t* gate = (const uint8_t*)ptrs[i].gate;
                if ((const uint8_t*)ptrs[i].up == gate + up_at && (const uint8_t*)ptrs[i].down == gate + down_at) {
                    copy_async(e, row, gate, down_at + g.bytes[2]); /* one copy per expert */
                    r.gather_bytes += down_at + g.bytes[2];
                } else {
                    const void* src[3] = {ptrs[i].gate, ptrs[i].up, ptrs[i].down};
                    for (int p = 0; p < 3; ++p) copy_async(e, row + (g.base[p] - table), src[p], g.bytes[p]);
                    r.gather_bytes += g.bytes[0] + g.bytes[1] + g.bytes[2];
                }
            }
            read_experts(e, g, rows_dev, count, sums + at * 3);
        }
        uint64_t* out = (uint64_t*)(e.results + s.result_at);
        copy_async(e, out, sums, (size_t)L * count * 24);
        int32_t* out_rows = (int32_t*)(out + (size_t)L * count * 3);
        for (uint32_t li = 0; li < L; ++li) memcpy(out_rows + (size_t)li * count, rows.data(), count * 4);
        sync(e); /* the token is read back, as an engine samples it */
    }
    r.seconds = now_s() - t0;
    r.decode = minus(totals(cache, e.num_classes), before);
    r.tokens = e.tokens;
    r.steps = (uint32_t)e.steps.size();
    r.ran = true;
    print_stats(cache, e.num_classes, r.name);
    backend_free(e, cudaFree, table);
    backend_free(e, cudaFree, rows_dev);
    backend_free(e, cudaFree, result_dev);
    expcache_destroy(cache);
    check_decode(e, r);
}

/* ---------------------------------------------------------------------- */
/* The report                                                              */
/* ---------------------------------------------------------------------- */

static void print_table(const Engine& e, const LoopResult* loops, int n) {
    const LoopResult* base = nullptr;
    for (int i = 0; i < n; ++i)
        if (loops[i].ran && strcmp(loops[i].name, "gather") == 0) base = &loops[i];
    const char* head[] = {"loop",         "tokens",        "tok/s",         "vs gather",    "hit rate",
                          "misses/token", "H2D MiB/token", "D2D MiB/token", "sums checked", "bad"};
    std::vector<std::vector<std::string>> rows;
    for (int i = 0; i < n; ++i) {
        const LoopResult& r = loops[i];
        if (!r.ran) continue;
        char b[10][64];
        const double tps = r.tokens / r.seconds, req = (double)(r.decode.hits + r.decode.misses);
        snprintf(b[0], 64, "%s", strcmp(r.name, "graph") == 0 ? "graph (select_device)" : "gather (host select)");
        snprintf(b[1], 64, "%u", r.tokens);
        snprintf(b[2], 64, e.cuda ? "%.2f" : "%.2f (emulated)", tps);
        if (base)
            snprintf(b[3], 64, "%.3fx", tps / (base->tokens / base->seconds));
        else
            snprintf(b[3], 64, "-");
        snprintf(b[4], 64, "%.1f %%", req ? 100.0 * r.decode.hits / req : 0.0);
        snprintf(b[5], 64, "%.2f", (double)r.decode.misses / r.tokens);
        snprintf(b[6], 64, "%.2f", r.decode.h2d / 1048576.0 / r.tokens);
        snprintf(b[7], 64, "%.3f", (r.decode.d2d + r.gather_bytes) / 1048576.0 / r.tokens);
        snprintf(b[8], 64, "%" PRIu64, r.checked + r.prefill_checked);
        snprintf(b[9], 64, "%" PRIu64, r.bad + r.prefill_bad);
        rows.emplace_back(b, b + 10);
    }
    size_t width[10];
    for (int c = 0; c < 10; ++c) {
        width[c] = strlen(head[c]);
        for (auto& row : rows) width[c] = std::max(width[c], row[c].size());
    }
    printf("\n");
    for (int c = 0; c < 10; ++c) printf("%-*s%s", (int)width[c], head[c], c < 9 ? "  " : "\n");
    for (int c = 0; c < 10; ++c) printf("%s%s", std::string(width[c], '-').c_str(), c < 9 ? "  " : "\n");
    for (auto& row : rows)
        for (int c = 0; c < 10; ++c) printf("%-*s%s", c < 9 ? (int)width[c] : 0, row[c].c_str(), c < 9 ? "  " : "\n");
}

static void write_json(const Engine& e, const LoopResult* loops, int n, bool ok) {
    FILE* f = fopen(e.opt.json.c_str(), "w");
    if (!f) fatal("%s: %s", e.opt.json.c_str(), strerror(errno));
    fprintf(f,
            "{\"backend\": \"%s\", \"source\": \"%s\", \"reads\": \"%s\", \"bank\": \"%s\", \"layers\": %u, "
            "\"classes\": %u,\n",
            e.cuda ? "cuda" : "host", e.opt.pinned_source ? "pinned" : "file",
            e.opt.direct_reads ? "direct" : "buffered", e.opt.parts_bank ? "parts" : "slots", L_of(e), e.num_classes);
    fprintf(f, " \"expert_bytes\": %" PRIu64 ", \"budget_bytes\": %" PRIu64 ", \"tokens\": %u, \"steps\": %zu,",
            e.expert_bytes, e.budget, e.tokens, e.steps.size());
    fprintf(f, " \"prompt_tokens\": %u, \"library_warnings\": %" PRIu64 ", \"ok\": %s,\n \"loops\": {", e.rt.P,
            g_library_warnings.load(), ok ? "true" : "false");
    bool first = true;
    for (int i = 0; i < n; ++i) {
        const LoopResult& r = loops[i];
        if (!r.ran) continue;
        fprintf(f, "%s\n  \"%s\": {\"seconds\": %.6f, \"tok_s\": %.4f, \"tokens\": %u, \"steps\": %u,",
                first ? "" : ",", r.name, r.seconds, r.tokens / r.seconds, r.tokens, r.steps);
        fprintf(f,
                " \"hits\": %" PRIu64 ", \"misses\": %" PRIu64 ", \"evictions\": %" PRIu64 ", \"h2d_bytes\": %" PRIu64
                ", \"d2d_bytes\": %" PRIu64 ", \"gather_bytes\": %" PRIu64 ",",
                r.decode.hits, r.decode.misses, r.decode.evictions, r.decode.h2d, r.decode.d2d, r.gather_bytes);
        fprintf(f, " \"checked\": %" PRIu64 ", \"bad\": %" PRIu64 ", \"no_slot\": %" PRIu64 ",", r.checked, r.bad,
                r.no_slot);
        fprintf(f,
                " \"prefill\": {\"checked\": %" PRIu64 ", \"bad\": %" PRIu64 ", \"hits\": %" PRIu64
                ", \"misses\": %" PRIu64 ", \"appends\": %" PRIu64 "}}",
                r.prefill_checked, r.prefill_bad, r.prefill.hits, r.prefill.misses, r.prefill.appends);
        first = false;
    }
    fprintf(f, "\n }}\n");
    fclose(f);
}

int main(int argc, char** argv) {
    setvbuf(stdout, nullptr, _IOLBF, 0); /* the report and the library's lines (stderr) in order */
    Engine e;
    e.opt = parse_options(argc, argv);

    int devices = 0;
    const bool has_device = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
    if (e.opt.backend == EXPCACHE_BACKEND_CUDA && !has_device) fatal("--backend cuda: no CUDA device");
    e.cuda = e.opt.backend == -1 ? has_device : e.opt.backend == EXPCACHE_BACKEND_CUDA;
    if (e.cuda) CU(cudaStreamCreateWithFlags(&e.stream, cudaStreamNonBlocking));
    load_model(e);
    if (e.opt.pinned_source) load_pinned(e);
    plan_steps(e);

    std::string classes;
    for (const Layer& L : e.layers) {
        char key[96];
        snprintf(key, sizeof key, "%s/%s/%s %.3f MiB", gguf_type_name(L.file.type[0]), gguf_type_name(L.file.type[1]),
                 gguf_type_name(L.file.type[2]), (L.file.bytes[0] + L.file.bytes[1] + L.file.bytes[2]) / 1048576.0);
        if (classes.find(key) == std::string::npos) classes += (classes.empty() ? "" : ", ") + std::string(key);
    }
    uint32_t verifies = 0;
    for (const Step& s : e.steps) verifies += s.n > 1;
    printf("model    %s: %u MoE layers (%u-%u), %u size classes (%s), %.3f GiB of experts\n", e.opt.model.c_str(),
           L_of(e), e.layers.front().file.layer, e.layers.back().file.layer, e.num_classes, classes.c_str(),
           e.expert_bytes / 1073741824.0);
    printf("source   %s; backend %s; budget %.3f GiB (%.1f %% of the experts); banks of %s\n",
           e.opt.pinned_source ? "pinned host memory, filled by the engine"
                               : (e.opt.direct_reads ? "the file, O_DIRECT reads" : "the file, buffered reads"),
           e.cuda ? "CUDA" : "host (no CUDA device: bank memory is host memory, no capture)", e.budget / 1073741824.0,
           100.0 * e.budget / e.expert_bytes, e.opt.parts_bank ? "parts (a region per part)" : "slots");
    printf("routing  %s: %u prompt tokens, %u decode tokens in %zu steps (%u verifications of %u tokens), k %u\n",
           e.opt.routing.c_str(), e.rt.P, e.tokens, e.steps.size(), verifies, e.opt.mtp, e.rt.k);
    fflush(stdout);

    LoopResult loops[2];
    loops[0].name = "graph";
    loops[1].name = "gather";
    if (e.opt.run_graph) graph_loop(e, loops[0]);
    if (e.opt.run_gather) gather_loop(e, loops[1]);

    print_table(e, loops, 2);
    bool ok = true;
    for (const LoopResult& r : loops) {
        if (!r.ran) continue;
        printf("%-6s prefill: %u prompt tokens, %" PRIu64 " distinct experts over the layers (%" PRIu64
               " hits, %" PRIu64 " misses, %" PRIu64 " appended), sums checked, bad %" PRIu64 "\n",
               r.name, e.rt.P, r.prefill_checked, r.prefill.hits, r.prefill.misses, r.prefill.appends, r.prefill_bad);
        ok &= r.bad == 0 && r.prefill_bad == 0;
    }
    if (loops[0].ran && loops[1].ran)
        printf("hits and misses of the two loops %s (%" PRIu64 "/%" PRIu64 " and %" PRIu64 "/%" PRIu64 ")\n",
               loops[0].decode.hits == loops[1].decode.hits && loops[0].decode.misses == loops[1].decode.misses
                   ? "equal"
                   : "DIFFER",
               loops[0].decode.hits, loops[0].decode.misses, loops[1].decode.hits, loops[1].decode.misses);
    printf("%s\n", ok ? "sums: every expert of every token as recorded" : "SUMS DIFFER: the run failed");
    if (!e.opt.json.empty()) write_json(e, loops, 2, ok);

    backend_free(e, cudaFreeHost, e.step_ids);
    backend_free(e, cudaFreeHost, e.results);
    if (e.opt.pinned_source)
        for (Layer& L : e.layers)
            for (int p = 0; p < 3; ++p) backend_free(e, cudaFreeHost, (void*)L.pinned[p]);
    gguf_free(&e.model);
    close(e.fd);
    if (e.cuda) CU(cudaStreamDestroy(e.stream));
    return ok ? 0 : 1;
}
