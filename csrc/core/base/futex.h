// Sleeping on a 32-bit word in shared memory, across processes (Linux futex).
#pragma once

#include <atomic>
#include <cstdint>

namespace pycomm {

// Sleeps while *word == expected, at most timeout_us; returns early on a wake or change.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_us);
void futex_wake_all(std::atomic<uint32_t>* word);

}  // namespace pycomm
