#include "cuda/host/ipc_handles.h"

#include <map>
#include <sstream>

#include "core/base/errors.h"

namespace pycomm {
namespace {

constexpr const char* kMagic = "pycomm-ipc/1";

std::string hex(const IpcBlob& b) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (uint8_t c : b) {
    s += digits[c >> 4];
    s += digits[c & 15];
  }
  return s;
}

[[noreturn]] void malformed(int from, const std::string& what) {
  throw CommError("pycomm: the CUDA-IPC handles published by rank " + std::to_string(from) +
                  " are malformed: " + what);
}

IpcBlob unhex(const std::string& s, int from, const std::string& field) {
  if (s.size() != 2 * kIpcHandleBytes) {
    malformed(from, field + " has " + std::to_string(s.size()) + " hex digits, expected " +
                        std::to_string(2 * kIpcHandleBytes));
  }
  IpcBlob b{};
  for (size_t i = 0; i < kIpcHandleBytes; ++i) {
    int v = 0;
    for (int k = 0; k < 2; ++k) {
      char c = s[2 * i + k];
      int d = c >= '0' && c <= '9' ? c - '0' : (c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1);
      if (d < 0) malformed(from, field + " holds '" + std::string(1, c) + "', not hex");
      v = v * 16 + d;
    }
    b[i] = static_cast<uint8_t>(v);
  }
  return b;
}

std::string join(const std::vector<IpcBlob>& blobs) {
  std::string s;
  for (size_t i = 0; i < blobs.size(); ++i) s += (i ? "," : "") + hex(blobs[i]);
  return s;
}

std::vector<IpcBlob> split(const std::string& s, int from, const std::string& field) {
  std::vector<IpcBlob> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(unhex(item, from, field));
  return out;
}

int64_t number(const std::map<std::string, std::string>& f, const std::string& key, int from) {
  try {
    return std::stoll(f.at(key));
  } catch (const std::exception&) {
    malformed(from, "field " + key + " is missing or not a number");
  }
}

}  // namespace

std::string encode_ipc_info(const IpcWindowInfo& info) {
  std::ostringstream s;
  s << kMagic << " rank=" << info.rank << " device=" << info.device << " bus=" << info.pci_bus_id
    << " slot_bytes=" << info.slot_bytes << " slots=" << info.slots
    << " window=" << hex(info.window) << " ready=" << join(info.ready_events)
    << " consumed=" << join(info.consumed_events);
  return s.str();
}

IpcWindowInfo decode_ipc_info(const std::string& text, int from_rank) {
  std::stringstream in(text);
  std::string magic;
  in >> magic;
  if (magic != kMagic) {
    malformed(from_rank, "it starts with '" + magic + "', expected '" + kMagic +
                             "' (a different pycomm version?)");
  }
  std::map<std::string, std::string> fields;
  std::string item;
  while (in >> item) {
    auto eq = item.find('=');
    if (eq == std::string::npos) malformed(from_rank, "'" + item + "' is not key=value");
    fields[item.substr(0, eq)] = item.substr(eq + 1);
  }
  IpcWindowInfo info;
  info.rank = static_cast<int32_t>(number(fields, "rank", from_rank));
  info.device = static_cast<int32_t>(number(fields, "device", from_rank));
  info.slot_bytes = static_cast<uint64_t>(number(fields, "slot_bytes", from_rank));
  info.slots = static_cast<uint32_t>(number(fields, "slots", from_rank));
  info.pci_bus_id = fields.count("bus") ? fields["bus"] : "";
  if (info.rank != from_rank) {
    malformed(from_rank, "it says rank " + std::to_string(info.rank));
  }
  if (!fields.count("window")) malformed(from_rank, "field window is missing");
  info.window = unhex(fields["window"], from_rank, "window");
  info.ready_events = split(fields["ready"], from_rank, "ready");
  info.consumed_events = split(fields["consumed"], from_rank, "consumed");
  if (info.ready_events.size() != info.slots || info.consumed_events.size() != info.slots) {
    malformed(from_rank, std::to_string(info.ready_events.size()) + " ready and " +
                             std::to_string(info.consumed_events.size()) +
                             " consumed event handles for " + std::to_string(info.slots) +
                             " slots");
  }
  return info;
}

void check_ipc_peer(const IpcWindowInfo& mine, const IpcWindowInfo& peer) {
  if (mine.slots != peer.slots || mine.slot_bytes != peer.slot_bytes) {
    throw CommError("pycomm: rank " + std::to_string(peer.rank) + "'s CUDA window has " +
                    std::to_string(peer.slots) + " slots of " + std::to_string(peer.slot_bytes) +
                    " bytes, rank " + std::to_string(mine.rank) + "'s has " +
                    std::to_string(mine.slots) + " of " + std::to_string(mine.slot_bytes) +
                    " (PYCOMM_CUDA_CHUNK_BYTES / PYCOMM_CUDA_SLOTS differ between ranks?)");
  }
}

}  // namespace pycomm
