// pycomm.use_arena(): CPU tensors that torch allocates by itself (DDP's gradient buckets,
// a trainer's flat buffers) taken from the shared-memory arena, so collectives on them
// are zero-copy without the user's code calling pycomm.empty.
//
// As torch.cuda.use_mem_pool routes one thread's CUDA allocations to a pool, this routes
// one thread's CPU allocations of at least `min_bytes` while the block is open. The
// router is installed once as torch's CPU allocator and hands every other request to the
// allocator it replaced, so code outside a block allocates exactly as before. A tensor
// allocated inside keeps its arena memory (and the arena's deleter) after the block.
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <atomic>
#include <cstring>
#include <mutex>

#include "core/memory/arena.h"

namespace py = pybind11;

namespace {

// The open block on this thread: requests of at least min_bytes go to the arena; 0 = none.
thread_local size_t t_min_bytes = 0;

// Live arena allocations the router made: while there are none, freeing a pointer of the
// allocator it replaced skips the arena's lookup (and its lock).
std::atomic<size_t> g_routed_live{0};
c10::DeleterFnPtr g_fallback_deleter = nullptr;

void release_to_arena(void* ptr) {
  // Not the arena's: a forked child freeing its parent's tensor (the child has an arena
  // of its own; the parent's slabs stay mapped, privately, as for pycomm.empty's tensors).
  if (pycomm::Arena::instance().release(ptr)) g_routed_live.fetch_sub(1, std::memory_order_relaxed);
}

// torch frees raw_allocate()'s memory through raw_deleter() (kernels' scratch buffers),
// whichever allocator served it: one deleter for both kinds of pointer.
void release_any(void* ptr) {
  if (g_routed_live.load(std::memory_order_relaxed) > 0 && pycomm::Arena::instance().release(ptr)) {
    g_routed_live.fetch_sub(1, std::memory_order_relaxed);
    return;
  }
  g_fallback_deleter(ptr);
}

class ArenaRouter final : public c10::Allocator {
 public:
  explicit ArenaRouter(c10::Allocator* fallback) : fallback_(fallback) {}

  c10::DataPtr allocate(size_t bytes) override {
    if (t_min_bytes == 0 || bytes < t_min_bytes) return fallback_->allocate(bytes);
    void* p = nullptr;
    try {
      p = pycomm::Arena::instance().allocate(bytes);
    } catch (const std::exception& e) {
      // As torch's own CPU allocator reports it: an OutOfMemoryError naming the request.
      TORCH_CHECK_WITH(OutOfMemoryError, false, "pycomm.use_arena: cannot allocate ", bytes,
                       " bytes in the shared-memory arena: ", e.what());
    }
    g_routed_live.fetch_add(1, std::memory_order_relaxed);
    return {p, p, &release_to_arena, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return g_fallback_deleter == nullptr ? nullptr : &release_any;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

 private:
  c10::Allocator* fallback_;
};

// Installs the router as torch's CPU allocator (once; it stays: storages made through it
// keep a pointer to it). Refuses when torch's CPU allocator is not the router: another
// library installed its own at a higher priority, before or after it.
ArenaRouter& router() {
  static std::once_flag once;
  static ArenaRouter* installed = nullptr;
  std::call_once(once, [] {
    c10::Allocator* before = c10::GetCPUAllocator();
    g_fallback_deleter = before->raw_deleter();
    auto* r = new ArenaRouter(before);  // never freed: storages may outlive everything
    c10::SetCPUAllocator(r, /*priority=*/0);
    installed = r;
  });
  TORCH_CHECK(c10::GetCPUAllocator() == installed,
              "pycomm.use_arena: torch's CPU allocator is not pycomm's router (another "
              "library installed its own allocator with a higher priority), so torch's "
              "allocations cannot be routed to the shared-memory arena");
  return *installed;
}

// Opens a block on this thread; returns the previous threshold, which the closing call
// restores (blocks nest).
size_t open_block(size_t min_bytes) {
  TORCH_CHECK_VALUE(min_bytes > 0, "pycomm.use_arena: min_bytes must be at least 1, got 0");
  router();
  size_t previous = t_min_bytes;
  t_min_bytes = min_bytes;
  return previous;
}

void close_block(size_t previous) { t_min_bytes = previous; }

}  // namespace

void register_arena_allocator(py::module_& m) {
  m.def("_arena_block_open", &open_block, py::arg("min_bytes"),
        "pycomm.use_arena's entry: this thread's CPU allocations of at least min_bytes come "
        "from the arena; returns the previous threshold (0: none).");
  m.def("_arena_block_close", &close_block, py::arg("previous"),
        "pycomm.use_arena's exit: restores the threshold _arena_block_open returned.");
  m.def(
      "_arena_block_min_bytes", [] { return t_min_bytes; },
      "This thread's open threshold (0: no block open).");
}
