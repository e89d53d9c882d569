// PYCOMM_DEBUG logging, shaped like NCCL's: a level (WARN, INFO: the choices made when a
// communicator is created, TRACE: a line per op and per send/recv), a subsystem filter
// (PYCOMM_DEBUG_SUBSYS) and a destination (PYCOMM_DEBUG_FILE, else stderr). Each line reads
//
//   host:pid:tid [rank] PYCOMM INFO message
//
// The Python side (pycomm/_log.py) logs through the same Logger, so both agree on the
// variables, the format and the file.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace pycomm {

enum class LogLevel { WARN = 0, INFO = 1, TRACE = 2 };

// What a line is about, one bit each. PYCOMM_DEBUG_SUBSYS keeps INFO and TRACE lines of
// the listed subsystems; warnings always print.
enum class Subsys : uint32_t { INIT = 1, COLL = 2, P2P = 4, SHM = 8, ISLANDS = 16 };
constexpr uint32_t kAllSubsys = 31;

struct LogSettings {
  LogLevel level = LogLevel::WARN;  // PYCOMM_DEBUG=WARN|INFO|TRACE
  uint32_t subsys = kAllSubsys;     // PYCOMM_DEBUG_SUBSYS=INIT,COLL,... or ^COLL,...

  // Reads PYCOMM_DEBUG and PYCOMM_DEBUG_SUBSYS; a bad value throws InvalidArgument
  // naming the variable and the values it takes.
  static LogSettings from_env();
};

LogLevel parse_log_level(const std::string& value);  // throws InvalidArgument
uint32_t parse_subsys(const std::string& value);     // throws InvalidArgument
const char* level_name(LogLevel l);

// PYCOMM_DEBUG_FILE with %h (host name) and %p (pid) replaced; %% is a percent sign.
std::string expand_log_path(const std::string& pattern);

// Where this process logs: PYCOMM_DEBUG_FILE, opened once (line-buffered) at the first
// line, or stderr when it is unset or cannot be opened (which is itself warned about).
std::FILE* log_stream();

class Logger {
 public:
  Logger(LogSettings s, int rank) : s_(s), rank_(rank) {}
  bool enabled(LogLevel l, Subsys sub) const {
    return l == LogLevel::WARN || (s_.level >= l && (s_.subsys & static_cast<uint32_t>(sub)) != 0);
  }
  void log(LogLevel l, Subsys sub, const std::string& msg) const;

 private:
  LogSettings s_;
  int rank_;
};

}  // namespace pycomm
