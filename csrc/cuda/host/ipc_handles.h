// What one rank publishes (through the store) so the others can map its CUDA-IPC window:
// the memory handle of its window, the handles of its interprocess events, and enough
// about the device and the layout to refuse a mismatched peer with a clear message.
// Torch-free and CUDA-free: the handles are opaque 64-byte blobs here, so the format is
// tested in CI without a GPU.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace pycomm {

constexpr size_t kIpcHandleBytes =
    64;  // sizeof(cudaIpcMemHandle_t) == sizeof(cudaIpcEventHandle_t)
using IpcBlob = std::array<uint8_t, kIpcHandleBytes>;

struct IpcWindowInfo {
  int32_t rank = -1;
  int32_t device = -1;      // the CUDA ordinal in the owner's process (for messages)
  std::string pci_bus_id;   // "0000:3b:00.0": which physical GPU
  uint64_t slot_bytes = 0;  // bytes per window slot
  uint32_t slots = 0;
  IpcBlob window{};                      // cudaIpcMemHandle_t of the window (slots * slot_bytes)
  std::vector<IpcBlob> ready_events;     // per slot: recorded after the owner writes it
  std::vector<IpcBlob> consumed_events;  // per slot: recorded after the owner read its
                                         // predecessor's slot
};

// "pycomm-ipc/1 rank=.. device=.. bus=.. slot_bytes=.. slots=.. window=<hex> ready=<hex,..>
// consumed=<hex,..>"
std::string encode_ipc_info(const IpcWindowInfo& info);
// Throws CommError naming `from_rank` and what is malformed (another version, a field
// missing, a handle of the wrong length).
IpcWindowInfo decode_ipc_info(const std::string& text, int from_rank);
// Throws CommError when a peer's layout differs from this rank's (slots, slot bytes).
void check_ipc_peer(const IpcWindowInfo& mine, const IpcWindowInfo& peer);

}  // namespace pycomm
