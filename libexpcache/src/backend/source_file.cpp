#include "source_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "../errors.hpp"

namespace expcache {

SourceFile::~SourceFile() {
    if (fd_ >= 0) ::close(fd_);
    if (direct_fd_ >= 0) ::close(direct_fd_);
}

expcache_status_t SourceFile::open(const std::string& path, bool direct) {
    path_ = path;
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) return fail(EXPCACHE_ERR_IO, "cannot open %s: %s", path.c_str(), std::strerror(errno));
    struct stat st;
    if (fstat(fd_, &st) != 0) return fail(EXPCACHE_ERR_IO, "cannot stat %s: %s", path.c_str(), std::strerror(errno));
    if (!S_ISREG(st.st_mode)) return fail(EXPCACHE_ERR_IO, "%s is not a regular file", path.c_str());
    size_ = static_cast<uint64_t>(st.st_size);
#ifdef O_DIRECT
    if (direct) direct_fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);  // tmpfs and others refuse: fine
#endif
    return EXPCACHE_OK;
}

expcache_status_t SourceFile::open_fd(int fd, bool direct) {
    path_ = "descriptor " + std::to_string(fd);
    fd_ = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (fd_ < 0)
        return fail(errno == EBADF ? EXPCACHE_ERR_INVALID_ARGUMENT : EXPCACHE_ERR_IO, "cannot duplicate %s: %s",
                    path_.c_str(), std::strerror(errno));
    const std::string self = "/proc/self/fd/" + std::to_string(fd_);
    char target[4096];
    const ssize_t n = readlink(self.c_str(), target, sizeof target - 1);
    if (n > 0) path_ += " (" + std::string(target, static_cast<size_t>(n)) + ")";
    struct stat st;
    if (fstat(fd_, &st) != 0) return fail(EXPCACHE_ERR_IO, "cannot stat %s: %s", path_.c_str(), std::strerror(errno));
    if (!S_ISREG(st.st_mode)) return fail(EXPCACHE_ERR_IO, "%s is not a regular file", path_.c_str());
    const int mode = fcntl(fd_, F_GETFL);
    if (mode < 0 || (mode & O_ACCMODE) == O_WRONLY)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s is not open for reading", path_.c_str());
    size_ = static_cast<uint64_t>(st.st_size);
#ifdef O_DIRECT
    if (direct) direct_fd_ = ::open(self.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);  // no /proc, or refused: buffered
#endif
    return EXPCACHE_OK;
}

expcache_status_t SourceFile::read(void* dst, uint64_t offset, uint64_t n) const {
    char* out = static_cast<char*>(dst);
    while (n > 0) {
        ssize_t got = ::pread(fd_, out, n, static_cast<off_t>(offset));
        if (got < 0) {
            if (errno == EINTR) continue;
            return fail(EXPCACHE_ERR_IO, "reading %s at %llu: %s", path_.c_str(), (unsigned long long)offset,
                        std::strerror(errno));
        }
        if (got == 0)
            return fail(EXPCACHE_ERR_IO, "reading %s at %llu: the file ended early (is it shorter than registered?)",
                        path_.c_str(), (unsigned long long)offset);
        out += got;
        offset += static_cast<uint64_t>(got);
        n -= static_cast<uint64_t>(got);
    }
    return EXPCACHE_OK;
}

expcache_status_t SourceFile::read_direct(void* dst, uint64_t offset, uint64_t n, uint64_t* delta) const {
    const uint64_t first = offset / kDirectAlign * kDirectAlign;
    const uint64_t span = (offset + n - first + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    const uint64_t need = offset + n - first;  // the bytes of dst that must come from the file
    *delta = offset - first;
    char* out = static_cast<char*>(dst);
    uint64_t done = 0;
    while (direct_fd_ >= 0 && done < span) {
        ssize_t got = ::pread(direct_fd_, out + done, span - done, static_cast<off_t>(first + done));
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;  // refused (EINVAL on some file systems) or the end of the file
        done += static_cast<uint64_t>(got);
        if (done % kDirectAlign) break;  // short at the end of the file: O_DIRECT cannot go on unaligned
    }
    if (done >= need) return EXPCACHE_OK;  // the alignment padding past the part need not exist
    return read(out + done, first + done, need - done);
}

}  // namespace expcache
