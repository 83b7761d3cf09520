// StagingBackend: the uploads both backends share (backend.hpp).
#include <new>
#include <string>

#include "backend.hpp"
#include "../errors.hpp"

namespace expcache {

expcache_status_t StagingBackend::copy_h2d(void* dst, const void* src, uint64_t bytes, bool pinned, void* stream) {
    if (!pinned) {
        if (staging_.copy_threads > 0) return ring().copy(dst, src, bytes, stream);
        return copy_h2d_direct(dst, src, bytes, stream);
    }
    // Never sent before finish_uploads(), however many: a batch that fails must fail the
    // call, whose slots the cache then frees; one sent earlier could fail unseen by it.
    try {
        pinned_.push_back({dst, src, bytes, stream});
    } catch (const std::bad_alloc&) {
        return fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY, "no host memory to queue an upload");
    }
    return EXPCACHE_OK;
}

// Every waiting pinned upload goes to its stream, one batch per run of uploads on
// the same stream (a call has one stream). The list is empty afterwards, whatever
// failed: a failed call's slots are freed by the cache, never served.
expcache_status_t StagingBackend::flush_pinned() {
    expcache_status_t status = EXPCACHE_OK;
    size_t i = 0;
    while (i < pinned_.size()) {
        size_t j = i + 1;
        while (j < pinned_.size() && pinned_[j].stream == pinned_[i].stream) ++j;
        if (status == EXPCACHE_OK) status = copy_h2d_batch(&pinned_[i], j - i);
        i = j;
    }
    pinned_.clear();
    return status;
}

expcache_status_t StagingBackend::copy_h2d_batch(const DirectCopy* copies, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        expcache_status_t s = copy_h2d_direct(copies[i].dst, copies[i].src, copies[i].bytes, copies[i].stream);
        if (s != EXPCACHE_OK) return s;
    }
    return EXPCACHE_OK;
}

expcache_status_t StagingBackend::finish_uploads() {
    expcache_status_t status = flush_pinned();
    if (!ring_) return status;
    if (status == EXPCACHE_OK) return ring_->finish();
    // The ring is drained all the same; the first failure stays the message.
    const std::string why = last_error();
    ring_->finish();
    return fail(status, "%s", why.c_str());
}

}  // namespace expcache
