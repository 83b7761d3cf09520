// Prefetch and hints, on the cache's side: which slot a prefetch takes, what a serving call does
// with the queue (finish in place what it lists, cancel the rest), and the counters. The
// prefetch thread itself (prefetcher.hpp) only moves bytes. A prefetched expert takes its slot
// at once, marked loading: never served, never evicted, and cancelled by the next serving call
// if its bytes are not all sent by then. Once sent it is resident like any other, first to go
// until a select uses it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "call.hpp"
#include "class_table.hpp"
#include "layers.hpp"
#include "log.hpp"
#include "prefetcher.hpp"
#include "stream_order.hpp"

namespace expcache {

class PrefetchCoordinator {
public:
    struct Services {
        const expcache_config_t& config;
        Backend& backend;
        LayerTable& layers;
        ClassTable& classes;
        StreamOrder& streams;
        CallClock& clock;
        Log& log;
        Health& health;
    };
    explicit PrefetchCoordinator(const Services& services) : x_(services) {}

    bool active() const { return prefetcher_ != nullptr; }
    // Stops the thread (its pieces may be in flight into the slots).
    void stop() { prefetcher_.reset(); }

    // Takes back what the thread finished (and, with cancel, everything still queued). Called
    // under the cache's lock by every serving call (cancel, keep_partial: what the call lists may
    // be finished by it, resolve_partial), by releases (cancel) and by the prefetch calls.
    // Partial slots left by a call that failed are freed first.
    expcache_status_t settle(bool cancel, bool keep_partial = false);
    // After a serving call's ids are known (it lists them in scratch.unique, marked in the layer's
    // seen with call id `call`): the partial prefetches it lists are kept for fill_slots to finish,
    // the others are freed. inserts: the call's path inserts (decode, batch; not compact).
    void resolve_partial(int32_t c, uint32_t layer, bool inserts);
    // A miss whose prefetch was cut short: the rest of its bytes go now on `stream`, into the same
    // slot, and it enters the policy as any miss of call `call` would, recorded on `path` with the
    // bytes this call sent (ClassTable::reinstall). Counted late, never used.
    expcache_status_t finish_partial(int32_t c, int32_t s, bool cold, void* stream, uint32_t path);
    // A hit on a prefetched slot: the prefetch paid.
    void note_use(int32_t c, int32_t s);
    // A landed prefetch of `layer` leaving its slot unused (evicted: see Acquired).
    void dropped_unused(uint32_t layer);
    // Before these classes' slots are freed (ClassTable::release): no prefetch sends into them any
    // more (every queued one cancelled), the device has finished every kernel that may read
    // them (one synchronization for all), and the unused prefetches they hold are counted wasted.
    // Nothing to do for none.
    expcache_status_t vacate(const std::vector<int32_t>& classes);
    // vacate() without counting: nothing in flight into any slot or out of any source (every
    // queued prefetch cancelled, as a serving call cancels them) and the device idle (one
    // synchronization). Before a layer leaves or a class shrinks.
    expcache_status_t quiesce();
    // ClassTable::bind, the class it reuses for the layer (if any) vacated first: the one way a
    // class is bound, for the serving calls and the prefetches alike.
    expcache_status_t bind_class(uint32_t layer, uint32_t path, int32_t* out_cls);

    expcache_status_t prefetch(uint32_t layer, const uint32_t* ids, uint32_t n, void* stream, uint32_t* out_queued);
    expcache_status_t hint(uint32_t layer, const uint32_t* ids, uint32_t n);
    void stats(expcache_prefetch_stats_t* out) const;
    void reset_stats();
    // Every queued prefetch sent and landed.
    expcache_status_t wait();
    void pause(bool paused) { pump().pause(paused); }

private:
    Prefetcher& pump();
    void cancel(int32_t c, int32_t s);
    expcache_status_t take_error();

    Services x_;
    std::unique_ptr<Prefetcher> prefetcher_;  // made by the first prefetch
    Prefetcher::Taken taken_;
    CallScratch scratch_;               // a prefetch's or hint's distinct ids (unique only)
    std::vector<PrefetchJob> partial_;  // kPrefetchPartial slots of the serving call under way
    expcache_prefetch_stats_t stats_ = {};
    expcache_status_t error_ = EXPCACHE_OK;  // a piece's failure, reported by the next prefetch call
    std::string message_;
};

}  // namespace expcache
