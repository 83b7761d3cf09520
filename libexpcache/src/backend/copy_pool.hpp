// A small pool of threads that split one large host-side job (a memcpy, or
// the preads of a file range) between them, so that staging into pinned
// buffers keeps up with the link, with several reads in flight.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "expcache.h"

namespace expcache {

class CopyPool {
public:
    // Work on [begin, begin + len) of the job; returns a status (fail() for the detail).
    using Part = std::function<expcache_status_t(uint64_t begin, uint64_t len)>;

    // `threads` helpers besides the calling thread (0: everything on the caller).
    explicit CopyPool(unsigned threads);
    ~CopyPool();
    CopyPool(const CopyPool&) = delete;
    CopyPool& operator=(const CopyPool&) = delete;

    // memcpy(dst, src, n), split across the pool.
    void copy(void* dst, const void* src, size_t n);
    // Run `part` over [0, n) in pieces that are multiples of `grain` bytes (the last
    // may be shorter); returns when all are done: the first failure, or OK.
    expcache_status_t run(uint64_t n, uint64_t grain, const Part& part);

private:
    void work(unsigned index);
    expcache_status_t do_part(unsigned index);

    std::vector<std::thread> threads_;
    std::mutex mu_;
    std::condition_variable start_, done_;
    unsigned long long generation_ = 0;
    unsigned pending_ = 0;
    bool stop_ = false;
    const Part* part_ = nullptr;
    uint64_t n_ = 0, per_ = 0;
    unsigned parts_ = 1;
    expcache_status_t status_ = EXPCACHE_OK;
    std::string message_;
};

}  // namespace expcache
