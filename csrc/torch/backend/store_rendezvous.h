// The core's Rendezvous over the c10d::Store torch hands a backend (a PrefixStore per
// group), so the core never sees torch types.
#pragma once

#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "core/communicator/rendezvous.h"

namespace pycomm_torch {

class StoreRendezvous : public pycomm::Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    auto v = store_->get(key);
    return std::string(v.begin(), v.end());
  }
  std::optional<std::string> try_get(const std::string& key) override {
    if (!store_->check({key})) return std::nullopt;
    return get(key);
  }
  std::chrono::milliseconds timeout() const override { return store_->getTimeout(); }
  void remove(const std::string& key) override {
    try {
      store_->deleteKey(key);
    } catch (...) {  // a store without deleteKey, or one already gone: keys just stay
    }
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace pycomm_torch
