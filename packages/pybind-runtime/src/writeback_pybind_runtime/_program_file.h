// Reading a program file for writeback-pybind-runtime's _native.cpp (included
// there once): FileLoader, the ExecuTorch DataLoader of a program loaded from a
// path, and what keeps a file that changes under it from crashing the process.
//
// A program loaded from a file keeps the file open (read-only) and owns its
// flatbuffer prefix (the plan; the Python layer reads it through
// NativeProgram's buffer protocol). What the runtime asks for at load_program
// (the constant segment) is read into memory of its own when small, so what
// happens to the file later never reaches those bytes. A constant segment of
// kMappedConstantBytes or more (a decoder's embedding table, read by portable
// kernels at every call) is mapped read-only for the program's life instead,
// as stock's mmap loader maps it: loading does not copy it and its pages are the
// page cache's. Every call of a method of such a program checks the file first
// (a changed file: the call is refused and changes nothing) and runs under a
// SigbusGuard: a file cut while the call runs reads as zeros in place of the
// fault, and the call ends in an error saying so (see NativeMethod::run).
//
// While a method loads, the ranges the runtime asks for (delegate blobs, the
// named data XNNPACK packs its weights from) are mapped read-only from the file
// instead, as stock's mmap loader does: XNNPACK packs straight from the page
// cache, with no copy into fresh memory. A mapping is never left behind: a
// delegate frees what it has packed, and a range still held when the load ends
// is copied into memory of its own at the same address (mremap), so a loaded
// method never reads the file again.
//
// A file cut short under a mapping raises SIGBUS at the next page touched
// (private mappings too). For the duration of a method load a SIGBUS handler is
// installed that turns a fault inside one of these mappings into zero pages
// and a flag; any other SIGBUS goes to the handler installed before. When the
// load ends, the file is checked again (size, modification and status-change time, as every
// read checks it): a file cut or rewritten at any point of the load fails it
// with an error saying so. Outside a method load every range is read, and a
// short read is an error.

#pragma once

#include <executorch/runtime/core/data_loader.h>
#include <executorch/runtime/core/error.h>
#include <executorch/runtime/core/freeable_buffer.h>
#include <executorch/runtime/core/result.h>

#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace etr = executorch::runtime;

struct ProgramBytes {
  void* data = nullptr;
  size_t nbytes = 0;
  size_t mapped = 0;
  // Page-aligned anonymous memory (the runtime views constant data in place,
  // at the alignment the file was written with), its pages faulted in by one
  // call before they are filled. Not huge pages: in a fresh process, faulting in
  // 65 MB of them took 150-220 ms in 5 loads of 6 on the project's VM (2 MB
  // blocks the host had taken back; 4 KB pages, populated: 26 ms every time).
  explicit ProgramBytes(size_t n) : nbytes(n), mapped(std::max<size_t>(n, 1)) {
    data = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) {
      data = nullptr;
      throw std::bad_alloc();
    }
#ifdef MADV_POPULATE_WRITE
    if (mapped >= kPopulatedBytes) {
      ::madvise(data, mapped, MADV_POPULATE_WRITE);  // before Linux 5.14: refused, faulted by the read
    }
#endif
  }
  ~ProgramBytes() { ::munmap(data, mapped); }
  ProgramBytes(const ProgramBytes&) = delete;
  ProgramBytes& operator=(const ProgramBytes&) = delete;

 private:
  static constexpr size_t kPopulatedBytes = size_t{1} << 20;
};

// Size, modification time and status-change time, to the nanosecond. The kernel
// moves the status-change time on every write and on every utime() call, and no
// call sets it back: a file rewritten at the same size with its modification time
// restored still differs here.
inline bool same_file_state(const struct stat& a, const struct stat& b) {
  return a.st_size == b.st_size && a.st_mtim.tv_sec == b.st_mtim.tv_sec &&
         a.st_mtim.tv_nsec == b.st_mtim.tv_nsec && a.st_ctim.tv_sec == b.st_ctim.tv_sec &&
         a.st_ctim.tv_nsec == b.st_ctim.tv_nsec;
}

// Reads [offset, offset + size) of `fd` into `into`; "" on success, else why not.
inline std::string read_exactly(int fd, size_t offset, size_t size, void* into) {
  size_t done = 0;
  while (done < size) {
    ssize_t got = ::pread(fd, static_cast<char*>(into) + done, size - done,
                          static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) {
      continue;
    }
    if (got < 0) {
      return std::strerror(errno);
    }
    if (got == 0) {
      return "the file ends at byte " + std::to_string(offset + done) + ", before byte " +
             std::to_string(offset + size);
    }
    done += static_cast<size_t>(got);
  }
  return "";
}

// The ranges of program files mapped during method loads, as the SIGBUS handler
// sees them: a fixed table of atomics (a handler may not lock or allocate). A
// load that finds the table full reads instead.
struct MappedSlot {
  std::atomic<uintptr_t> begin{0};  // 0: a free slot
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> cut{false};  // the handler put zero pages in place of the file's
};
static_assert(std::atomic<uintptr_t>::is_always_lock_free && std::atomic<bool>::is_always_lock_free,
              "the SIGBUS handler reads the slots lock-free");
constexpr size_t kMappedSlots = 4096;
constexpr size_t kNoSlot = kMappedSlots;
inline MappedSlot g_mapped[kMappedSlots];
inline std::mutex g_mapped_mutex;  // claims and releases slots; the handler only reads them
inline const uintptr_t g_page_size = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
inline struct sigaction g_previous_sigbus {};  // the handler before ours, while ours is installed

inline size_t claim_slot(const void* base, size_t length) {
  auto begin = reinterpret_cast<uintptr_t>(base);
  uintptr_t end = begin + (length + g_page_size - 1) / g_page_size * g_page_size;
  std::lock_guard<std::mutex> lock(g_mapped_mutex);
  for (size_t i = 0; i < kMappedSlots; ++i) {
    if (g_mapped[i].begin.load(std::memory_order_relaxed) == 0) {
      g_mapped[i].cut.store(false, std::memory_order_relaxed);
      g_mapped[i].end.store(end, std::memory_order_relaxed);
      g_mapped[i].begin.store(begin, std::memory_order_release);
      return i;
    }
  }
  return kNoSlot;
}

// Frees slot `i`; returns whether the handler found the file cut under it.
inline bool release_slot(size_t i) {
  std::lock_guard<std::mutex> lock(g_mapped_mutex);
  g_mapped[i].begin.store(0, std::memory_order_release);
  g_mapped[i].end.store(0, std::memory_order_relaxed);
  return g_mapped[i].cut.exchange(false, std::memory_order_acq_rel);
}

// Only async-signal-safe calls: atomics, mmap, sigaction, raise.
inline void on_sigbus(int signo, siginfo_t* info, void* context) {
  if (info != nullptr && info->si_code > 0) {  // a fault, not a signal someone sent
    auto address = reinterpret_cast<uintptr_t>(info->si_addr);
    for (MappedSlot& slot : g_mapped) {
      uintptr_t begin = slot.begin.load(std::memory_order_acquire);
      uintptr_t end = slot.end.load(std::memory_order_acquire);
      if (begin == 0 || address < begin || address >= end) {
        continue;
      }
      // The file is gone from this page on: zeros in its place, read-only like
      // the mapping, and the access is retried on them.
      uintptr_t page = address - address % g_page_size;
      void* zeros = ::mmap(reinterpret_cast<void*>(page), end - page, PROT_READ,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
      if (zeros != MAP_FAILED) {
        slot.cut.store(true, std::memory_order_release);
        return;
      }
    }
  }
  const struct sigaction& previous = g_previous_sigbus;
  if ((previous.sa_flags & SA_SIGINFO) != 0 && previous.sa_sigaction != nullptr) {
    previous.sa_sigaction(signo, info, context);
    return;
  }
  if ((previous.sa_flags & SA_SIGINFO) == 0 && previous.sa_handler != SIG_DFL &&
      previous.sa_handler != SIG_IGN) {
    previous.sa_handler(signo);
    return;
  }
  // The default action: a fault happens again on return and ends the process;
  // a sent signal is sent again.
  ::sigaction(SIGBUS, &previous, nullptr);
  if (info == nullptr || info->si_code <= 0) {
    ::raise(signo);
  }
}

// Installs on_sigbus while any guard lives: the first guard installs it, the last
// one puts back the handler found then, unless someone replaced on_sigbus
// meanwhile. Guards are made and dropped holding the GIL (method loads of
// several threads may overlap while a Python delegate releases it), so the count
// needs no lock.
class SigbusGuard {
 public:
  SigbusGuard() {
    if (depth_++ > 0) {
      return;
    }
    struct sigaction ours {};
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    ::sigaction(SIGBUS, &ours, &g_previous_sigbus);
  }
  ~SigbusGuard() {
    if (--depth_ > 0) {
      return;
    }
    struct sigaction current {};
    ::sigaction(SIGBUS, nullptr, &current);
    if ((current.sa_flags & SA_SIGINFO) != 0 && current.sa_sigaction == on_sigbus) {
      ::sigaction(SIGBUS, &g_previous_sigbus, nullptr);
    }
  }
  SigbusGuard(const SigbusGuard&) = delete;
  SigbusGuard& operator=(const SigbusGuard&) = delete;

 private:
  static inline int depth_ = 0;
};

class FileLoader;

// A range mapped during a method load: the FreeableBuffer's context.
struct FileMapping {
  const FileLoader* loader;
  char* base;     // whole pages, from the one holding the range's first byte
  size_t length;
  size_t slot;    // kNoSlot once copied into memory of its own
};

// Constant segments from this size on are mapped, not read (see the top).
constexpr size_t kMappedConstantBytes = size_t{8} << 20;

class FileLoader final : public etr::DataLoader {
 public:
  FileLoader(int fd, std::string path, const struct stat& opened, std::unique_ptr<ProgramBytes> prefix)
      : fd_(fd), path_(std::move(path)), opened_(opened), prefix_(std::move(prefix)) {}
  ~FileLoader() override { ::close(fd_); }
  FileLoader(const FileLoader&) = delete;
  FileLoader& operator=(const FileLoader&) = delete;

  const ProgramBytes& prefix() const { return *prefix_; }

  etr::Result<etr::FreeableBuffer> load(size_t offset, size_t size,
                                        const SegmentInfo& info) const override {
    if (!in_file(offset, size)) {
      return etr::Error::InvalidArgument;
    }
    if (offset + size <= prefix_->nbytes) {
      return etr::FreeableBuffer(static_cast<const char*>(prefix_->data) + offset, size, nullptr);
    }
    bool loading_method = method_loads() > 0;
    bool resident = !loading_method && info.segment_type == SegmentInfo::Type::Constant &&
                    size >= kMappedConstantBytes;
    if (loading_method || resident) {
      if (!unchanged()) {
        return etr::Error::AccessFailed;
      }
      std::optional<etr::FreeableBuffer> mapped = map(offset, size, resident);
      if (mapped) {
        return std::move(*mapped);
      }
    }
    std::unique_ptr<ProgramBytes> block;
    try {
      block = std::make_unique<ProgramBytes>(size);
    } catch (std::bad_alloc&) {
      fail("cannot allocate " + std::to_string(size) + " bytes to read bytes " +
           std::to_string(offset) + ".. of it into");
      return etr::Error::MemoryAllocationFailed;
    }
    if (!read_checked(offset, size, block->data)) {
      return etr::Error::AccessFailed;
    }
    void* data = block->data;
    // The buffer's free function deletes the block (unmapping it).
    return etr::FreeableBuffer(data, size, &FileLoader::free_block, block.release());
  }

  etr::Error load_into(size_t offset, size_t size, const SegmentInfo& /*info*/,
                       void* buffer) const override {
    if (!in_file(offset, size)) {
      return etr::Error::InvalidArgument;
    }
    return read_checked(offset, size, buffer) ? etr::Error::Ok : etr::Error::AccessFailed;
  }

  etr::Result<size_t> size() const override { return static_cast<size_t>(opened_.st_size); }

  // Whether ranges stay mapped from the file past the method loads (the constant
  // segment): then calls must run under a SigbusGuard and check the file.
  bool maps_constants() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return !resident_.empty();
  }

  // Whether the file is as it was at load_program (the reason kept for take_failure).
  bool file_unchanged() const { return unchanged(); }

  // After a call of a program that maps its constants: false (the reason kept
  // for take_failure) when the file changed or a fault in a mapping put zeros in
  // place of its bytes. Call under the call's SigbusGuard.
  bool constants_intact() const {
    if (!unchanged()) {
      return false;
    }
    bool cut = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const FileMapping* mapping : resident_) {
        cut = cut || (mapping->slot != kNoSlot && g_mapped[mapping->slot].cut.load(std::memory_order_acquire));
      }
    }
    if (cut) {
      fail("bytes of it could not be read while the method ran (an I/O error?); its constants read as "
           "zeros from there on: load it again");
      return false;
    }
    return true;
  }

  // Whether [data, data + size) lies in a range mapped from the file for the
  // program's life (a value handed to Python must not point there: Python reads
  // it outside any SigbusGuard).
  bool in_resident_mapping(const void* data, size_t size) const {
    auto begin = reinterpret_cast<uintptr_t>(data);
    std::lock_guard<std::mutex> lock(mutex_);
    for (const FileMapping* mapping : resident_) {
      auto first = reinterpret_cast<uintptr_t>(mapping->base);
      if (begin + size > first && begin < first + mapping->length) {
        return true;
      }
    }
    return false;
  }

  // Why the last failed read failed ("" if none did), and forgets it.
  std::string take_failure() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string failure;
    failure.swap(failure_);
    return failure;
  }

  // From here until the matching end_method_load, ranges are mapped, not read.
  // Call under a SigbusGuard.
  void begin_method_load() const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (method_loads_++ == 0) {
      cut_ = false;
      mapped_any_ = false;
    }
  }

  // Copies every range still mapped into memory of its own at the same address,
  // then, if the load mapped anything, checks the file (what it read was checked
  // as it was read); false (the reason kept for take_failure) when the file was
  // cut or changed during the load, or a held range could not be copied. Call
  // under the same SigbusGuard.
  bool end_method_load() const {
    std::vector<FileMapping*> held;
    bool mapped_any = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --method_loads_;
      held = mapped_;
      mapped_.clear();
      mapped_any = mapped_any_;
    }
    bool copied = true;
    for (FileMapping* mapping : held) {
      copied = own(mapping) && copied;
    }
    if (!mapped_any) {
      return copied;
    }
    if (!unchanged()) {
      return false;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (cut_) {
      failure_ = "'" + path_ + "': bytes of it could not be read while the method loaded (an I/O error?)";
      return false;
    }
    return copied;
  }

 private:
  static void free_block(void* context, void* /*data*/, size_t /*size*/) {
    delete static_cast<ProgramBytes*>(context);
  }

  static void free_mapping(void* context, void* /*data*/, size_t /*size*/) {
    auto* mapping = static_cast<FileMapping*>(context);
    mapping->loader->forget(mapping);
    ::munmap(mapping->base, mapping->length);
    delete mapping;
  }

  int method_loads() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return method_loads_;
  }

  // [offset, offset + size) mapped read-only, or nothing when it cannot be (no
  // free slot, a file system that does not map): then the range is read.
  std::optional<etr::FreeableBuffer> map(size_t offset, size_t size, bool resident) const {
    size_t first = offset - offset % g_page_size;
    size_t length = offset + size - first;
    if (size == 0) {
      return std::nullopt;
    }
    void* base = ::mmap(nullptr, length, PROT_READ, MAP_PRIVATE, fd_, static_cast<off_t>(first));
    if (base == MAP_FAILED) {
      return std::nullopt;
    }
    size_t slot = claim_slot(base, length);
    if (slot == kNoSlot) {
      ::munmap(base, length);
      return std::nullopt;
    }
    auto* mapping = new FileMapping{this, static_cast<char*>(base), length, slot};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (resident) {
        resident_.push_back(mapping);
      } else {
        mapped_.push_back(mapping);
        mapped_any_ = true;
      }
    }
    return etr::FreeableBuffer(mapping->base + (offset - first), size, &FileLoader::free_mapping,
                               mapping);
  }

  // Drops a freed mapping from the table and from the load's list.
  void forget(FileMapping* mapping) const {
    bool cut = mapping->slot != kNoSlot && release_slot(mapping->slot);
    mapping->slot = kNoSlot;
    std::lock_guard<std::mutex> lock(mutex_);
    cut_ = cut_ || cut;
    mapped_.erase(std::remove(mapped_.begin(), mapped_.end(), mapping), mapped_.end());
    resident_.erase(std::remove(resident_.begin(), resident_.end(), mapping), resident_.end());
  }

  // Replaces a held mapping by a copy of its bytes at the same address.
  bool own(FileMapping* mapping) const {
    void* copy = ::mmap(nullptr, mapping->length, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    bool moved = false;
    if (copy != MAP_FAILED) {
      std::memcpy(copy, mapping->base, mapping->length);  // a cut file faults here: zeros
      ::mprotect(copy, mapping->length, PROT_READ);
      moved = ::mremap(copy, mapping->length, mapping->length, MREMAP_MAYMOVE | MREMAP_FIXED,
                       mapping->base) != MAP_FAILED;
      if (!moved) {
        ::munmap(copy, mapping->length);
      }
    }
    if (!moved) {
      fail("cannot copy " + std::to_string(mapping->length) +
           " bytes a delegate keeps into memory of its own: " + std::strerror(errno));
      // Still mapped: the failed load frees it.
      std::lock_guard<std::mutex> lock(mutex_);
      mapped_.push_back(mapping);
      return false;
    }
    bool cut = release_slot(mapping->slot);
    mapping->slot = kNoSlot;
    std::lock_guard<std::mutex> lock(mutex_);
    cut_ = cut_ || cut;
    return true;
  }

  bool in_file(size_t offset, size_t size) const {
    size_t file_size = static_cast<size_t>(opened_.st_size);
    if (offset > file_size || size > file_size - offset) {
      fail("the program asks for bytes " + std::to_string(offset) + ".." +
           std::to_string(offset + size) + " of a " + std::to_string(file_size) +
           "-byte file (a corrupted program?)");
      return false;
    }
    return true;
  }

  bool unchanged() const {
    struct stat now {};
    if (::fstat(fd_, &now) != 0) {
      fail(std::string("cannot check the file: ") + std::strerror(errno));
      return false;
    }
    if (!same_file_state(now, opened_)) {
      std::string how = now.st_size == opened_.st_size
                            ? std::to_string(now.st_size) + " bytes then and now, written since"
                            : std::to_string(opened_.st_size) + " bytes then, " + std::to_string(now.st_size) + " now";
      fail("the file changed since load_program (" + how +
           "); load it again, or load its bytes to keep the whole program in memory");
      return false;
    }
    return true;
  }

  bool read_checked(size_t offset, size_t size, void* into) const {
    if (!unchanged()) {
      return false;
    }
    std::string failure = read_exactly(fd_, offset, size, into);
    if (!failure.empty()) {
      fail("cannot read bytes " + std::to_string(offset) + ".." + std::to_string(offset + size) +
           ": " + failure);
      return false;
    }
    return unchanged();
  }

  void fail(const std::string& why) const {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_ = "'" + path_ + "': " + why;
  }

  int fd_;
  std::string path_;
  struct stat opened_;
  std::unique_ptr<ProgramBytes> prefix_;
  mutable std::mutex mutex_;
  mutable std::string failure_;
  mutable int method_loads_ = 0;                 // open method loads: map, do not read
  mutable std::vector<FileMapping*> mapped_;     // mappings not yet freed or copied
  mutable std::vector<FileMapping*> resident_;   // mapped for the program's life
  mutable bool mapped_any_ = false;              // this load mapped a range
  mutable bool cut_ = false;                     // a fault in a mapping of this load
};

// A method load of a program: its file's ranges mapped, under a SigbusGuard, until
// close() (or the destructor) copies what is held and checks the file. A no-op for
// a program loaded from bytes.
class MethodLoad {
 public:
  explicit MethodLoad(const FileLoader* file) : file_(file) {
    if (file_ != nullptr) {
      guard_.emplace();
      file_->begin_method_load();
    }
  }
  ~MethodLoad() { close(); }
  MethodLoad(const MethodLoad&) = delete;
  MethodLoad& operator=(const MethodLoad&) = delete;

  // Whether the file held still for the whole load (see FileLoader::end_method_load).
  bool close() {
    if (file_ == nullptr) {
      return true;
    }
    bool held_still = file_->end_method_load();
    file_ = nullptr;
    guard_.reset();
    return held_still;
  }

 private:
  const FileLoader* file_;
  std::optional<SigbusGuard> guard_;
};
