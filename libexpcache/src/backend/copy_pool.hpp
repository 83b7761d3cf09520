// A small pool of threads that split one large host memcpy between them,
// so staging pageable memory into pinned buffers keeps up with the link.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

namespace expcache {

class CopyPool {
public:
    // `threads` helpers besides the calling thread (0: plain memcpy).
    explicit CopyPool(unsigned threads);
    ~CopyPool();
    CopyPool(const CopyPool&) = delete;
    CopyPool& operator=(const CopyPool&) = delete;

    // memcpy(dst, src, n), split across the pool; returns when all is copied.
    void copy(void* dst, const void* src, size_t n);

private:
    void work(unsigned index);
    void copy_part(unsigned index);

    std::vector<std::thread> threads_;
    std::mutex mu_;
    std::condition_variable start_, done_;
    unsigned long long generation_ = 0;
    unsigned pending_ = 0;
    bool stop_ = false;
    char* dst_ = nullptr;
    const char* src_ = nullptr;
    size_t n_ = 0;
    unsigned parts_ = 1;
};

}  // namespace expcache
