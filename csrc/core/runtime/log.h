// PYCOMM_DEBUG logging to stderr, one line per event, prefixed with the rank.
#pragma once

#include <string>

#include "core/runtime/config.h"

namespace pycomm {

class Logger {
 public:
  Logger(LogLevel level, int rank, int world) : level_(level), rank_(rank), world_(world) {}
  bool enabled(LogLevel l) const { return level_ >= l; }
  void log(LogLevel l, const std::string& msg) const;

 private:
  LogLevel level_;
  int rank_;
  int world_;
};

}  // namespace pycomm
