// A file that expert bytes are read from (EXPCACHE_SOURCE_FILE). Reads use
// pread; where the file system accepts O_DIRECT, aligned ranges bypass the
// page cache (a model larger than RAM would only thrash it), and anything the
// direct descriptor refuses falls back to the buffered one.
#pragma once

#include <cstdint>
#include <string>

#include "expcache.h"

namespace expcache {

class SourceFile {
public:
    static constexpr uint64_t kDirectAlign = 4096;

    ~SourceFile();
    // Status: OK, IO.
    expcache_status_t open(const std::string& path);
    uint64_t size() const { return size_; }
    const std::string& path() const { return path_; }
    bool direct() const { return direct_fd_ >= 0; }

    // Read exactly n bytes at offset into dst through the buffered descriptor.
    expcache_status_t read(void* dst, uint64_t offset, uint64_t n) const;
    // Read the 4096-aligned range [offset, offset + n) into a 4096-aligned dst
    // through O_DIRECT; falls back to the buffered descriptor if refused.
    expcache_status_t read_aligned(void* dst, uint64_t offset, uint64_t n) const;

private:
    std::string path_;
    int fd_ = -1;
    int direct_fd_ = -1;
    uint64_t size_ = 0;
};

}  // namespace expcache
