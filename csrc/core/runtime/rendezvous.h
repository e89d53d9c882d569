// How ranks find each other's segment: a key-value store shared by the job (the torch
// layer adapts c10d::Store; tests can use anything). The torch layer hands each
// incarnation of a group its own key prefix, so keys never outlive their group.
#pragma once

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
};

}  // namespace pycomm
