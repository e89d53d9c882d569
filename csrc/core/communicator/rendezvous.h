// How ranks find each other's segment: a key-value store shared by the job (the torch
// layer adapts c10d::Store; tests can use anything). The torch layer hands each
// incarnation of a group its own key prefix, so keys never outlive their group.
#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace pycomm {

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` is set (or the store's own timeout passes, then throws).
  virtual std::string get(const std::string& key) = 0;
  // Deletes `key` if it exists (best effort: never throws).
  virtual void remove(const std::string& key) = 0;
  // The value of `key` if it is set now (never blocks).
  virtual std::optional<std::string> try_get(const std::string& key) = 0;
  // How long one wait may take at most (the store's timeout).
  virtual std::chrono::milliseconds timeout() const = 0;
};

}  // namespace pycomm
