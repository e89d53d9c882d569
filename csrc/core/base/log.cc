#include "core/base/log.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/base/errors.h"

namespace pycomm {
namespace {

constexpr const char* kSubsysNames = "INIT, COLL, P2P, SHM, ISLANDS";

std::string upper(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

std::string trimmed(const std::string& s) {
  size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

uint32_t subsys_bit(const std::string& name, const std::string& whole) {
  static const struct {
    const char* name;
    uint32_t bits;
  } known[] = {{"INIT", 1}, {"COLL", 2}, {"P2P", 4}, {"SHM", 8}, {"ISLANDS", 16}, {"ALL", 31}};
  for (const auto& k : known)
    if (name == k.name) return k.bits;
  throw InvalidArgument("pycomm: PYCOMM_DEBUG_SUBSYS=" + whole + ": '" + name +
                        "' is not a subsystem; the subsystems are " + kSubsysNames +
                        " (comma-separated; ALL for every one; a leading ^ excludes the list)");
}

const std::string& hostname() {
  static const std::string name = [] {
    char buf[256] = {0};
    gethostname(buf, sizeof(buf) - 1);
    return std::string(buf);
  }();
  return name;
}

// "host:pid:tid [rank] PYCOMM " as NCCL writes it ("[-]": no rank, e.g. before a group).
std::string prefix(int rank) {
  return hostname() + ":" + std::to_string(getpid()) + ":" +
         std::to_string(static_cast<long>(syscall(SYS_gettid))) + " [" +
         (rank < 0 ? std::string("-") : std::to_string(rank)) + "] PYCOMM ";
}

}  // namespace

LogLevel parse_log_level(const std::string& value) {
  std::string v = upper(trimmed(value));
  if (v.empty() || v == "WARN" || v == "0" || v == "OFF") return LogLevel::WARN;
  if (v == "INFO") return LogLevel::INFO;
  if (v == "TRACE") return LogLevel::TRACE;
  throw InvalidArgument("pycomm: PYCOMM_DEBUG=" + value + " is not one of WARN, INFO, TRACE");
}

uint32_t parse_subsys(const std::string& value) {
  std::string v = upper(trimmed(value));
  if (v.empty()) return kAllSubsys;
  bool exclude = v[0] == '^';
  uint32_t bits = 0;
  size_t at = exclude ? 1 : 0;
  while (at <= v.size()) {
    size_t comma = v.find(',', at);
    if (comma == std::string::npos) comma = v.size();
    bits |= subsys_bit(trimmed(v.substr(at, comma - at)), value);
    at = comma + 1;
  }
  return exclude ? kAllSubsys & ~bits : bits;
}

const char* level_name(LogLevel l) {
  switch (l) {
    case LogLevel::WARN:
      return "WARN";
    case LogLevel::INFO:
      return "INFO";
    case LogLevel::TRACE:
      return "TRACE";
  }
  return "?";
}

LogSettings LogSettings::from_env() {
  auto env = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v == nullptr ? "" : v);
  };
  LogSettings s;
  s.level = parse_log_level(env("PYCOMM_DEBUG"));
  s.subsys = parse_subsys(env("PYCOMM_DEBUG_SUBSYS"));
  return s;
}

std::string expand_log_path(const std::string& pattern) {
  std::string out;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '%' || i + 1 == pattern.size()) {
      out += pattern[i];
      continue;
    }
    char c = pattern[++i];
    if (c == 'h')
      out += hostname();
    else if (c == 'p')
      out += std::to_string(getpid());
    else if (c == '%')
      out += '%';
    else
      out += std::string("%") + c;
  }
  return out;
}

std::FILE* log_stream() {
  // Opened once per process (NCCL does the same), at the first line logged.
  static std::FILE* stream = [] {
    const char* pattern = std::getenv("PYCOMM_DEBUG_FILE");
    if (pattern == nullptr || *pattern == '\0') return stderr;
    std::string path = expand_log_path(pattern);
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) {
      std::string line = prefix(-1) + "WARN PYCOMM_DEBUG_FILE=" + pattern + ": cannot open " +
                         path + " (" + std::strerror(errno) + "); logging to stderr\n";
      std::fwrite(line.data(), 1, line.size(), stderr);
      return stderr;
    }
    std::setvbuf(f, nullptr, _IOLBF, 0);
    return f;
  }();
  return stream;
}

void Logger::log(LogLevel l, Subsys sub, const std::string& msg) const {
  if (!enabled(l, sub)) return;
  // One write per line, so that lines of concurrent ranks do not interleave mid-line.
  std::string line = prefix(rank_) + level_name(l) + " " + msg + "\n";
  std::FILE* out = log_stream();
  std::fwrite(line.data(), 1, line.size(), out);
  std::fflush(out);
}

}  // namespace pycomm
