// The device-side select on the host backend: the steps of lookup_kernels.hpp (the table read,
// then the hits' bookkeeping alone when every id in range is resident, else the lookup and the
// copy), run in order on host memory before the call returns, with the same choices as the CUDA
// kernel (the rules of lookup_rules.hpp, in the same order; a victim by a loop where the GPU
// reduces). One "block" does them all: no ticket, nothing published.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "../errors.hpp"
#include "lookup_kernels.hpp"
#include "lookup_rules.hpp"

namespace expcache {

namespace {

class HostLookupKernels final : public LookupKernels {
public:
    expcache_status_t select(const DeviceSelectArgs& a, void*) override {
        if (table_read(a) && a.mode == kModeDecode) {
            serve_from_table(a);
            return EXPCACHE_OK;
        }
        const PolicyNow now = lookup(a);
        if (a.copy && a.fed)
            feed(a, now.token);
        else if (a.copy)
            copy(a);
        return EXPCACHE_OK;
    }
    expcache_status_t mapped(const void* host, const unsigned char** out) override {
        *out = static_cast<const unsigned char*>(host);  // the host backend's "device" reads host memory
        return EXPCACHE_OK;
    }
    bool capturing(void*) override { return false; }
    expcache_status_t alloc_mapped(uint64_t bytes, void** out_host, void** out_device) override {
        // Page-aligned, as cudaHostAlloc's: a feed row is read into with O_DIRECT.
        const uint64_t rounded = (bytes + kFeedAlign - 1) / kFeedAlign * kFeedAlign;
        void* p = std::aligned_alloc(kFeedAlign, rounded ? rounded : kFeedAlign);
        if (!p) return fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY, "%llu bytes of host memory", (unsigned long long)bytes);
        std::memset(p, 0, rounded);
        *out_host = *out_device = p;
        return EXPCACHE_OK;
    }
    void free_mapped(void* host) override { std::free(host); }
    expcache_status_t unpin(uint8_t* pin, const int32_t* slots, uint32_t n, void*) override {
        for (uint32_t i = 0; i < n; ++i) pin[slots[i]] = 0;
        return EXPCACHE_OK;
    }
    expcache_status_t clear(const DeviceClass& c, int32_t* slot_of_key, void*) override {
        for (uint32_t s = 0; s < c.cap; ++s) clear_slot(c, slot_of_key, s);
        cleared(c);
        return EXPCACHE_OK;
    }

private:
    // The ids' keys and the slots the slot map gives them (reads only); whether every id in
    // range is resident.
    bool table_read(const DeviceSelectArgs& a) {
        keys_.resize(a.count);
        slots_.resize(a.count);
        bool resident = true;
        for (uint32_t i = 0; i < a.count; ++i) {
            keys_[i] = key_of(a, i);
            slots_[i] = keys_[i] == UINT32_MAX ? -1 : a.slot_of_key[keys_[i]];
            resident = resident && (keys_[i] == UINT32_MAX || slots_[i] >= 0);
        }
        return resident;
    }

    // The select served by its table read: what lookup() leaves when nothing misses, the
    // policy's hit bookkeeping included (the clock opened, each hit counted and refreshed in
    // order of first occurrence, then duel's shadow requests and vote in that order).
    void serve_from_table(const DeviceSelectArgs& a) {
        const DeviceClass& c = a.cls;
        const uint64_t base = select_base(c.handoff->selects++);
        const PolicyNow now = open_select(a);
        first_.resize(a.count);
        list_of_.resize(a.count);
        uint32_t distinct = 0;
        for (uint32_t i = 0; i < a.count; ++i) {
            a.out_slots[i] = slots_[i];
            if (a.out_filled) a.out_filled[i] = 0;
            first_[i] = 0;
            if (keys_[i] == UINT32_MAX) {
                report_bad_id(a, i);
                continue;
            }
            bool first = true;
            for (uint32_t j = 0; j < i && first; ++j) first = keys_[j] != keys_[i];
            if (!first) continue;
            first_[i] = 1;
            const int k = count_use(a, keys_[i], now);
            refresh_hit(a, slots_[i], base + i, k, now);
            if (a.policy.id == EXPCACHE_POLICY_DUEL)
                list_of_[i] = static_cast<uint8_t>(shadow_count_use(a, keys_[i], now));
            ++distinct;
        }
        if (a.policy.id == EXPCACHE_POLICY_DUEL)
            for (uint32_t i = 0; i < a.count; ++i)
                if (first_[i]) duel_request(a, keys_[i], base + i, list_of_[i], now);
        *c.miss_count = 0;
        write_counts(a, distinct, 0, distinct, 0, now.token);
        if (!a.host_call) {
            c.counters->calls++;
            c.counters->hits += distinct;
            c.handoff->table_reads++;
        }
    }

    // The select's time (its policy clock, opened) for the feed.
    PolicyNow lookup(const DeviceSelectArgs& a) {
        const DeviceClass& c = a.cls;
        const uint64_t base = select_base(c.handoff->selects++);
        const PolicyNow now = open_select(a);
        keys_.resize(a.count);
        first_.resize(a.count);
        list_of_.resize(a.count);
        // Ids to keys; each id's first occurrence in the call.
        for (uint32_t i = 0; i < a.count; ++i) {
            keys_[i] = key_of(a, i);
            if (keys_[i] == UINT32_MAX) report_bad_id(a, i);
            first_[i] = i;
            for (uint32_t j = 0; j < i; ++j)
                if (keys_[j] == keys_[i]) {
                    first_[i] = j;
                    break;
                }
        }
        // Each first occurrence's use counted, a hit refreshed (first_use: as the call's mode says).
        uint64_t distinct = 0, hits = 0, misses = 0, evictions = 0;
        for (uint32_t i = 0; i < a.count; ++i) {
            if (first_[i] != i || keys_[i] == UINT32_MAX) continue;
            ++distinct;
            const int32_t slot = a.slot_of_key[keys_[i]];
            list_of_[i] = static_cast<uint8_t>(first_use(a, keys_[i], slot, base + i, now));
            if (slot >= 0) ++hits;
        }
        // duel: the hits' requests to its shadows, in order (the misses have no slot yet).
        const bool duel = requests_shadows(a);
        if (duel)
            for (uint32_t i = 0; i < a.count; ++i)
                if (first_[i] == i && keys_[i] != UINT32_MAX && a.slot_of_key[keys_[i]] >= 0)
                    duel_request(a, keys_[i], base + i, shadow_count_use(a, keys_[i], now), now);
        // Misses, in order of first occurrence: each takes the policy's victim among the evictable slots.
        *c.miss_count = 0;
        filled_.assign(a.count, 0);
        for (uint32_t i = 0; i < a.count && fills_misses(a); ++i) {
            const uint32_t key = keys_[i];
            if (first_[i] != i || key == UINT32_MAX || a.slot_of_key[key] >= 0) continue;
            const bool lists = victims_by_lists(a);
            Candidate best = no_candidate();
            for (uint32_t s = 0; s < c.cap; ++s) {
                const Candidate here = slot_candidate(a, s, base, lists, now);
                if (goes_first(here, best)) best = here;
            }
            if (best.slot < 0) continue;  // every slot pinned or used (or, for a batch, not free): staged
            const uint64_t stamp = base + EXPCACHE_MAX_SELECT + i;
            int k = list_of_[i];
            if (fill_miss(a, best.slot, key, stamp, &k, now, (*c.miss_count)++)) ++evictions;
            filled_[i] = 1;
            ++misses;
            if (duel) duel_request(a, key, stamp, shadow_count_use(a, key, now), now);
        }
        for (uint32_t i = 0; i < a.count; ++i)
            a.out_slots[i] = keys_[i] == UINT32_MAX ? -1 : a.slot_of_key[keys_[first_[i]]];
        if (a.out_filled)
            for (uint32_t i = 0; i < a.count; ++i) a.out_filled[i] = a.out_slots[i] >= 0 && filled_[first_[i]];
        write_counts(a, static_cast<uint32_t>(distinct), static_cast<uint32_t>(misses), static_cast<uint32_t>(hits),
                     static_cast<uint32_t>(evictions), now.token);
        if (a.host_call) return now;  // counted by the call, on its path
        DeviceCounters& n = *c.counters;
        n.calls++;
        n.hits += hits;
        n.misses += misses;
        n.evictions += evictions;
        n.appends += misses - evictions;
        n.bytes_h2d += misses * a.expert_bytes();
        return now;
    }

    // duel: a request both shadows see (each a hit, or a fill of a new slot or of its victim), then the vote.
    static void duel_request(const DeviceSelectArgs& a, uint32_t key, uint64_t stamp, int k, const PolicyNow& now) {
        bool hit[2];
        for (int j : {kShadowLru, kShadowOpp}) {
            int32_t fill = -1;
            hit[j] = shadow_lookup(a, j, key, stamp, k, now, &fill);
            if (hit[j]) continue;
            if (fill < 0) {
                Candidate best = no_candidate();
                for (int32_t s = 0; s < a.cls.policy.duel->held[j]; ++s) {
                    const Candidate here = shadow_candidate(a, j, s, now);
                    if (goes_first(here, best)) best = here;
                }
                fill = best.slot;
            }
            shadow_fill(a, j, fill, key, stamp, k, now);
        }
        vote(a, hit[kShadowLru], hit[kShadowOpp]);
    }

    void copy(const DeviceSelectArgs& a) {
        const DeviceClass& c = a.cls;
        for (uint32_t m = 0; m < *c.miss_count; ++m) {
            const DeviceMiss miss = c.misses[m];
            for (int p = 0; p < EXPCACHE_MAX_PARTS && a.part_bytes[p]; ++p)  // 0 bytes: past the layer's parts
                std::memcpy(c.bank + c.part_at[p] + uint64_t(miss.slot) * c.part_stride[p],
                            a.src[p] + a.src_stride[p] * miss.expert, a.part_bytes[p]);
        }
    }

    // The select's misses through the class's feed (feed_protocol.hpp), as the CUDA grid takes
    // them: all listed at once with the select's policy token (the feed threads read up to
    // kFeedRows together), each piece copied out of its row when ready; the failed misses' slots
    // freed at the end.
    static void feed(const DeviceSelectArgs& a, int32_t token) {
        const DeviceClass& c = a.cls;
        const DeviceFeed& f = c.feed;
        const uint32_t n = *c.miss_count;
        if (n == 0) return;
        const uint64_t done = ++c.handoff->ticket << kPublishShift;  // the host backend's select number
        for (uint32_t m = 0; m < n; ++m) f.box->entry[m] = FeedEntry{a.layer, c.misses[m].expert, token};
        __atomic_store_n(&f.box->listed, done | n, __ATOMIC_RELEASE);
        std::vector<int32_t> failed;
        for (uint32_t m = 0; m < n; ++m) {
            const uint32_t r = m % kFeedRows;
            const uint64_t tag = done | m;
            const DeviceMiss miss = c.misses[m];
            const unsigned char* row = f.rows + uint64_t(r) * f.row_bytes;
            bool ok = true;
            for (int p = 0; p < EXPCACHE_MAX_PARTS; ++p)
                for (uint32_t q = 0; uint64_t(q) * f.piece < a.part_bytes[p]; ++q) {
                    const uint64_t w = wait_piece(&f.box->ready[r][p][q], tag);
                    ok = ok && !(w & kFeedFailed);
                    if (!ok) continue;
                    const uint64_t at = uint64_t(q) * f.piece;
                    std::memcpy(c.bank + c.part_at[p] + uint64_t(miss.slot) * c.part_stride[p] + at,
                                row + f.part_at[p] + q * (f.piece + 2 * kFeedAlign) + f.box->delta[r][p][q],
                                std::min(f.piece, a.part_bytes[p] - at));
                }
            if (!ok) failed.push_back(miss.slot);
            __atomic_store_n(&f.box->consumed[r], tag, __ATOMIC_RELEASE);
        }
        for (int32_t s : failed) {
            forget_slot(c, a.slot_of_key, static_cast<uint32_t>(s));
            ++*f.failures;
            for (uint32_t i = 0; i < a.count; ++i)  // no slot, as an id out of range
                if (a.out_slots[i] == s) a.out_slots[i] = -1;
        }
    }

    // A piece's ready word once it holds `tag` (kFeedFailed set after kFeedTimeoutNs).
    static uint64_t wait_piece(const uint64_t* ready, uint64_t tag) {
        const auto start = std::chrono::steady_clock::now();
        uint64_t w;
        while (((w = __atomic_load_n(ready, __ATOMIC_ACQUIRE)) & ~kFeedFailed) != tag) {
            if (std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(kFeedTimeoutNs))
                return tag | kFeedFailed;
            std::this_thread::yield();
        }
        return w;
    }

    std::vector<uint32_t> keys_, first_;  // per id (the cache's lock serializes selects)
    std::vector<int32_t> slots_;
    std::vector<uint8_t> list_of_;  // per first occurrence: its key's class of count
    std::vector<uint8_t> filled_;   // per first occurrence: a miss this select gave a slot
};

}  // namespace

std::unique_ptr<LookupKernels> make_host_lookup_kernels() {
    return std::unique_ptr<LookupKernels>(new HostLookupKernels());
}

}  // namespace expcache
