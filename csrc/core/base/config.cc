#include "core/base/config.h"

#include <cstdlib>
#include <string>

#include "core/base/errors.h"

namespace pycomm {
namespace {

uint64_t env_uint(const char* name, uint64_t fallback, uint64_t lo, uint64_t hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  unsigned long long x = std::strtoull(v, &end, 10);
  if (end == v || *end != '\0' || x < lo || x > hi) {
    throw InvalidArgument(std::string("pycomm: ") + name + "=" + v + " is not an integer in [" +
                          std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return x;
}

std::string env_str(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  std::string s = (v == nullptr || *v == '\0') ? fallback : v;
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

Config Config::from_env() {
  Config c;
  // Slots hold whole cache lines, so round the chunk up to 64 bytes.
  c.chunk_bytes =
      (env_uint("PYCOMM_CHUNK_BYTES", c.chunk_bytes, 64, 1ull << 40) + 63) & ~size_t(63);
  c.slots = static_cast<uint32_t>(env_uint("PYCOMM_SLOTS", c.slots, 2, 64));
  c.direct_bytes =
      (env_uint("PYCOMM_DIRECT_BYTES", c.direct_bytes, 0, 1ull << 30) + 63) & ~size_t(63);
  // Pieces hold whole cache lines of any dtype, so that each rank's part is its own lines.
  c.two_shot_piece_bytes =
      (env_uint("PYCOMM_TWO_SHOT_PIECE_BYTES", c.two_shot_piece_bytes, 64, 1ull << 30) + 63) &
      ~size_t(63);
  if (const char* v = std::getenv("PYCOMM_TWO_SHOT_BYTES"); v != nullptr && *v != '\0') {
    c.two_shot_bytes = env_uint("PYCOMM_TWO_SHOT_BYTES", 0, 0, 1ull << 40);
    if (c.two_shot_bytes > c.two_shot_piece_bytes * kMaxTwoShotPieces) {
      throw InvalidArgument(
          "pycomm: PYCOMM_TWO_SHOT_BYTES=" + std::to_string(c.two_shot_bytes) + " is more than " +
          std::to_string(kMaxTwoShotPieces) +
          " pieces of PYCOMM_TWO_SHOT_PIECE_BYTES=" + std::to_string(c.two_shot_piece_bytes));
    }
  }
  c.spin_us = static_cast<uint32_t>(env_uint("PYCOMM_SPIN_US", c.spin_us, 0, 1u << 30));
  c.yield_us = static_cast<uint32_t>(env_uint("PYCOMM_YIELD_US", c.yield_us, 0, 1u << 30));
  c.wait_slice_us =
      static_cast<uint32_t>(env_uint("PYCOMM_WAIT_SLICE_US", c.wait_slice_us, 0, 100000));
  c.zero_copy = env_uint("PYCOMM_ZERO_COPY", 1, 0, 1) == 1;
  c.stripes = static_cast<uint32_t>(env_uint("PYCOMM_STRIPES", c.stripes, 1, kMaxStripes));
  // Every stripe holds whole cache lines of any dtype: at least 64 bytes each.
  c.stripe_bytes = env_uint("PYCOMM_STRIPE_BYTES", c.stripe_bytes, 64 * kMaxStripes, 1ull << 50);
  c.cuda_chunk_bytes =
      env_uint("PYCOMM_CUDA_CHUNK_BYTES", c.cuda_chunk_bytes, 16, 1ull << 40) / 16 * 16;
  c.cuda_slots = static_cast<uint32_t>(env_uint("PYCOMM_CUDA_SLOTS", c.cuda_slots, 2, 64));
  std::string algo = env_str("PYCOMM_ALGO", "AUTO");
  if (algo == "AUTO")
    c.algo = Algo::AUTO;
  else if (algo == "RING")
    c.algo = Algo::RING;
  else if (algo == "DIRECT")
    c.algo = Algo::DIRECT;
  else
    throw InvalidArgument("pycomm: PYCOMM_ALGO=" + algo + " is not one of auto, ring, direct");
  c.log = LogSettings::from_env();
  return c;
}

const char* algo_name(Algo a) {
  switch (a) {
    case Algo::AUTO:
      return "auto";
    case Algo::RING:
      return "ring";
    case Algo::DIRECT:
      return "direct";
  }
  return "?";
}

}  // namespace pycomm
