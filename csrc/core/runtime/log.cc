#include "core/runtime/log.h"

#include <unistd.h>

#include <cstdio>

namespace pycomm {

void Logger::log(LogLevel l, const std::string& msg) const {
  if (!enabled(l)) return;
  static const char* names[] = {"WARN", "INFO", "TRACE"};
  // One fprintf per line so lines from concurrent ranks do not interleave mid-line.
  std::fprintf(stderr, "pycomm %s [rank %d/%d pid %d] %s\n", names[static_cast<int>(l)], rank_,
               world_, static_cast<int>(getpid()), msg.c_str());
}

}  // namespace pycomm
