// What `python -m pycomm.env` reports about this build, and the logger for Python's lines.
#include <torch/csrc/utils/pybind.h>

#include <cstddef>
#include <string>

#include "core/base/config.h"
#include "core/base/log.h"
#include "core/base/wait_policy.h"
#include "core/communicator/group_segment.h"
#include "core/kernels/f16c.h"
#include "core/kernels/reduce.h"
#include "core/transport/layout.h"
#include "torch/backend/tensor_args.h"

#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#elif __has_include(<torch/version.h>)
#include <torch/version.h>
#endif
#ifndef TORCH_VERSION
#define TORCH_VERSION "unknown"
#endif

namespace py = pybind11;

#ifdef PYCOMM_CUDA
namespace pycomm::cuda {
const char* arch_list();  // csrc/cuda/arch_list.cu
}  // namespace pycomm::cuda
#endif

namespace {

// The toolchain and torch this extension was compiled with (fixed at compile time).
py::dict build_info() {
  py::dict d;
  d["torch_version"] = TORCH_VERSION;
  d["compiler"] = std::string(
#if defined(__clang__)
      "clang "
#elif defined(__GNUC__)
      "gcc "
#endif
      __VERSION__);
#ifdef _GLIBCXX_USE_CXX11_ABI
  d["cxx11_abi"] = static_cast<bool>(_GLIBCXX_USE_CXX11_ABI);
#else
  d["cxx11_abi"] = py::none();
#endif
#ifdef PYCOMM_CUDA
  d["cuda"] = true;
#else
  d["cuda"] = false;
#endif
  d["kernel_isa"] = pycomm::kernel_isa();
  d["float16_conversion"] = pycomm::f16c_supported() ? "F16C" : "portable";
  return d;
}

// The segment a group of `world` would get with this process's PYCOMM_* settings.
py::dict segment_bytes(int world) {
  TORCH_CHECK_VALUE(world >= 1, "segment_bytes: a group has at least one rank, not ", world);
  pycomm::Config cfg = pycomm_torch::translated([] { return pycomm::Config::from_env(); });
  pycomm::GroupSettings s = pycomm::group_settings(cfg, world);
  pycomm::Layout layout(world, s);
  py::dict d;
  d["eager"] = layout.eager_bytes();
  // A channel takes its first buffers when first used and grows only while its receiver
  // lags and /dev/shm has room to spare: "total" is what a group needs, "deepest" what
  // every channel grown to PYCOMM_SLOTS buffers would take.
  const size_t channels = 2 * static_cast<size_t>(world) * (world - 1);
  const size_t channel = world > 1 ? layout.first_channel_bytes() : 0;
  d["channel"] = channel;
  d["channels"] = channels;
  // Each rank's two-shot stage areas, reserved by its first two-shot op.
  const size_t stage = layout.stage_extent(0).bytes;
  d["stage"] = stage;
  d["total"] = layout.eager_bytes() + channels * channel + world * stage;
  d["deepest"] = layout.total_bytes();
  d["stripes"] = cfg.stripes;  // a torch group takes one segment per stripe (stripes.h)
  return d;
}

// A channel's counter that `rank` writes: the head of its channel to `peer` (it sends),
// or the tail of peer's channel to it (it receives).
size_t channel_word(const pycomm::Layout& layout, int world, int rank, int peer,
                    const std::string& name) {
  TORCH_CHECK_VALUE(peer >= 0 && peer < world && peer != rank, "control_word: ", name,
                    " needs a peer other than rank ", rank, ", got ", peer);
  const pycomm::Lane lane = name.rfind("p2p_", 0) == 0 ? pycomm::P2P : pycomm::COLL;
  if (name.size() > 5 && name.compare(name.size() - 5, 5, "_head") == 0) {
    return layout.channel_offset(lane, rank, peer) + offsetof(pycomm::ChannelCtl, head);
  }
  return layout.channel_offset(lane, peer, rank) + offsetof(pycomm::ChannelCtl, tail);
}

size_t control_word(int world, int rank, const std::string& name, int peer) {
  TORCH_CHECK_VALUE(world >= 1 && rank >= 0 && rank < world, "control_word: rank ", rank, " of ",
                    world);
  pycomm::Config cfg = pycomm_torch::translated([] { return pycomm::Config::from_env(); });
  pycomm::Layout layout(world, pycomm::group_settings(cfg, world));
  size_t field = 0;
  if (name == "abort_flag") {  // the group's, in its header
    return offsetof(pycomm::SegmentHeader, abort_flag);
  }
  if (name == "coll_head" || name == "coll_tail" || name == "p2p_head" || name == "p2p_tail") {
    return channel_word(layout, world, rank, peer, name);
  }
  if (name == "stage") {
    field = offsetof(pycomm::RankControl, stage);
  } else if (name == "completed_seq") {
    field = offsetof(pycomm::RankControl, completed_seq);
  } else if (name == "recent") {
    field = offsetof(pycomm::RankControl, recent);
  } else {
    TORCH_CHECK_VALUE(false, "control_word: ", name,
                      " is not stage, completed_seq, recent, abort_flag or a channel's "
                      "coll_head, coll_tail, p2p_head, p2p_tail");
  }
  return layout.controls_offset() + rank * sizeof(pycomm::RankControl) + field;
}

pycomm::LogLevel level_of(const std::string& name) {
  if (name == "WARN") return pycomm::LogLevel::WARN;
  if (name == "INFO") return pycomm::LogLevel::INFO;
  TORCH_CHECK_VALUE(name == "TRACE", "pycomm._log: level ", name, " is not WARN, INFO or TRACE");
  return pycomm::LogLevel::TRACE;
}

pycomm::Subsys subsys_of(const std::string& name) {
  uint32_t bits = pycomm_torch::translated([&] { return pycomm::parse_subsys(name); });
  TORCH_CHECK_VALUE(bits != 0 && (bits & (bits - 1)) == 0, "pycomm._log: ", name,
                    " is not one subsystem");
  return static_cast<pycomm::Subsys>(bits);
}

pycomm::Logger logger(int rank) {
  return pycomm::Logger(pycomm_torch::translated([] { return pycomm::LogSettings::from_env(); }),
                        rank);
}

}  // namespace

void register_env_info(py::module_& m) {
  m.def("build_info", &build_info,
        "The torch version, compiler, C++ ABI, CUDA and CPU kernels this extension was built "
        "with.");
  m.def("kernel_isa", &pycomm::kernel_isa, "The copy of the CPU kernels this CPU runs.");
  m.def(
      "_wait_policy_yields",
      [](double yield_us, double for_ms) {
        // The waiting policy against a yield that takes `yield_us` (a late one: another
        // job's thread ran; a prompt one: none did), waits of never-ready peers back to
        // back for `for_ms`: how many yields it made. Deterministic, so the policy's rule
        // (no yielding for kRememberContention after a late yield) is tested on any host.
        py::gil_scoped_release unlocked;
        pycomm::WaitPolicy::contended_until() = {};
        const pycomm::WaitPolicy policy(1, 200);
        const auto yield_for = std::chrono::duration<double, std::micro>(yield_us);
        int64_t yields = 0;
        auto fake_yield = [&] {
          ++yields;
          const auto until = pycomm::Clock::now() + yield_for;
          while (pycomm::Clock::now() < until) {
          }
          return 0;
        };
        const auto end = pycomm::Clock::now() + std::chrono::duration<double, std::milli>(for_ms);
        while (pycomm::Clock::now() < end) policy.poll([] { return false; }, false, fake_yield);
        pycomm::WaitPolicy::contended_until() = {};
        return yields;
      },
      py::arg("yield_us"), py::arg("for_ms"));
  m.def(
      "_config_defaults",
      [] {
        const pycomm::Config c;  // the defaults, no environment read
        py::dict d;
        d["PYCOMM_CHUNK_BYTES"] = c.chunk_bytes;
        d["PYCOMM_SLOTS"] = c.slots;
        d["PYCOMM_SPIN_US"] = c.spin_us;
        d["PYCOMM_YIELD_US"] = c.yield_us;
        d["PYCOMM_WAIT_SLICE_US"] = c.wait_slice_us;
        d["PYCOMM_ZERO_COPY"] = c.zero_copy ? 1 : 0;
        d["PYCOMM_STRIPES"] = c.stripes;
        d["PYCOMM_STRIPE_BYTES"] = c.stripe_bytes;
        d["PYCOMM_TWO_SHOT_PIECE_BYTES"] = c.two_shot_piece_bytes;
        d["PYCOMM_CUDA_CHUNK_BYTES"] = c.cuda_chunk_bytes;
        d["PYCOMM_CUDA_SLOTS"] = c.cuda_slots;
        return d;
      },
      "The core's defaults of its numeric PYCOMM_* settings (the documented ones are "
      "checked against these).");
  m.def("_control_word", &control_word, py::arg("world"), py::arg("rank"), py::arg("name"),
        py::arg("peer") = -1,
        "Byte offset in a group's segment (this process's settings) of rank's control "
        "word `name` (stage, completed_seq, recent: its last descriptors; abort_flag: the "
        "group's; coll_head, p2p_head: of its channel to `peer`; coll_tail, p2p_tail: of "
        "peer's channel to it): for tests that play a hostile writer.");
  m.def("_segment_bytes", &segment_bytes, py::arg("world"),
        "Bytes of a group's segment with this process's settings: eager (at creation), "
        "channel (one), channels (how many), total (every channel in use).");
  m.def(
      "_log_enabled",
      [](const std::string& level, const std::string& subsys) {
        return logger(-1).enabled(level_of(level), subsys_of(subsys));
      },
      py::arg("level"), py::arg("subsys"), "Whether PYCOMM_DEBUG(_SUBSYS) lets such a line out.");
  m.def(
      "_log",
      [](const std::string& level, const std::string& subsys, int rank, const std::string& msg) {
        logger(rank).log(level_of(level), subsys_of(subsys), msg);
      },
      py::arg("level"), py::arg("subsys"), py::arg("rank"), py::arg("msg"),
      "Logs one line as the C++ core does (format, filter, PYCOMM_DEBUG_FILE).");
#ifdef PYCOMM_CUDA
  m.def(
      "cuda_archs", [] { return std::string(pycomm::cuda::arch_list()); },
      "The SM architectures the CUDA kernels were compiled for (nvcc's __CUDA_ARCH_LIST__).");
#endif
}
