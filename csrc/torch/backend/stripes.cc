#include "torch/backend/stripes.h"

#include <pthread.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "core/base/errors.h"
#include "core/base/wait_slice.h"
#include "core/communicator/group_segment.h"
#include "torch/backend/store_rendezvous.h"

namespace pycomm_torch {

size_t stripe_start(size_t count, size_t elem_size, size_t n, size_t i) {
  if (i >= n) return count;
  const size_t line = std::max<size_t>(1, 64 / elem_size);  // elements per cache line
  const size_t lines = (count + line - 1) / line;
  // Whole lines per part, the first parts one line longer when they do not divide.
  const size_t start = (lines / n * i + std::min(i, lines % n)) * line;
  return std::min(start, count);
}

Stripe::Stripe(int index, pycomm::Rendezvous& rdv, int rank, int world, const pycomm::Config& cfg,
               std::chrono::milliseconds timeout)
    : wait_slice_us_(cfg.wait_slice_us) {
  try {
    comm_ = std::make_unique<pycomm::Communicator>(rdv, rank, world, cfg, timeout);
  } catch (const std::exception& e) {
    pycomm::report_init_failure(rdv, rank, e.what());  // the others fail at once too
    throw;
  }
  thread_ = std::thread([this] { loop(); });
  // Named (before the constructor returns) so that top -H, py-spy and the tests tell a
  // stripe's thread from the others.
  std::string name = "pycomm-stripe" + std::to_string(index);
  pthread_setname_np(thread_.native_handle(), name.substr(0, 15).c_str());
}

Stripe::~Stripe() { stop(); }

void Stripe::run(std::function<void()> part) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    part_ = std::move(part);
  }
  cv_.notify_one();
}

void Stripe::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (!part_ && !stopping_) {
      // Asleep until the group's next striped op: woken, run before the busy threads.
      pycomm::ShortSlice asleep(wait_slice_us_);
      cv_.wait(lock, [this] { return part_ || stopping_; });
    }
    if (!part_) return;  // stopping, with nothing left to run
    std::function<void()> part = std::move(part_);
    part_ = nullptr;
    lock.unlock();
    part();
    lock.lock();
  }
}

void Stripe::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

// What the parts of one op share: how many are still running and the first failure.
struct Stripes::Pending {
  std::mutex mu;
  std::condition_variable cv;
  size_t running = 0;
  std::exception_ptr error;
};

Stripes::Stripes(const c10::intrusive_ptr<c10d::Store>& store, pycomm::Communicator& own,
                 std::chrono::milliseconds timeout)
    : own_(own), min_bytes_(own.config().stripe_bytes) {
  pycomm::Config cfg = own.config();  // the group's (rank 0's) settings
  // A stripe's init and segment lines would repeat the group's: its op traces stay.
  cfg.log.subsys &=
      ~(static_cast<uint32_t>(pycomm::Subsys::INIT) | static_cast<uint32_t>(pycomm::Subsys::SHM));
  for (uint32_t i = 1; i < cfg.stripes; ++i) {
    StoreRendezvous rdv(
        c10::make_intrusive<c10d::PrefixStore>("pycomm-stripe-" + std::to_string(i), store));
    extra_.push_back(
        std::make_unique<Stripe>(static_cast<int>(i), rdv, own.rank(), own.world(), cfg, timeout));
  }
  if (!extra_.empty()) {
    own.logger().log(pycomm::LogLevel::INFO, pycomm::Subsys::INIT,
                     "init: all_reduce from " + std::to_string(min_bytes_) +
                         " bytes striped over " + std::to_string(count()) +
                         " communicators, each on its own thread (PYCOMM_STRIPES)");
  }
}

Stripes::~Stripes() { close(pycomm::Departure::EXITED); }

bool Stripes::splits(size_t bytes) const { return !extra_.empty() && bytes >= min_bytes_; }

void Stripes::all_reduce(void* data, size_t count, pycomm::DType dtype, pycomm::RedOp op) {
  const size_t elem = pycomm::dtype_size(dtype);
  if (!splits(count * elem)) return whole(data, count, dtype, op);
  const size_t n = this->count();
  auto* bytes = static_cast<char*>(data);
  // Shared with the stripes' threads, which may still hold it an instant after the last
  // one's count reaches zero.
  auto pending = std::make_shared<Pending>();
  pending->running = extra_.size();
  auto part = [&](size_t i) {
    Part p{i, n, count, stripe_start(count, elem, n, i), 0, nullptr};
    p.count = stripe_start(count, elem, n, i + 1) - p.first;
    p.data = bytes + p.first * elem;
    return p;
  };
  for (size_t i = 1; i < n; ++i) {
    Stripe* s = extra_[i - 1].get();
    s->run([this, s, p = part(i), dtype, op, pending] {
      run_part(*pending, p, [&] { s->comm().all_reduce(p.data, p.count, dtype, op); });
      std::lock_guard<std::mutex> lock(pending->mu);
      if (--pending->running == 0) pending->cv.notify_one();
    });
  }
  Part mine = part(0);
  run_part(*pending, mine, [&] { own_.all_reduce(mine.data, mine.count, dtype, op); });
  std::unique_lock<std::mutex> lock(pending->mu);
  if (pending->running != 0) {
    pycomm::ShortSlice asleep(own_.config().wait_slice_us);
    pending->cv.wait(lock, [&] { return pending->running == 0; });
  }
  if (pending->error) std::rethrow_exception(pending->error);
}

void Stripes::whole(void* data, size_t count, pycomm::DType dtype, pycomm::RedOp op) {
  try {
    own_.all_reduce(data, count, dtype, op);
  } catch (const pycomm::CommError& e) {
    // A peer that striped this op shows its part 0's count in the core's message.
    throw pycomm::CommError(std::string(e.what()) + " (this group stripes all_reduces of " +
                            std::to_string(min_bytes_) + " bytes or more over " +
                            std::to_string(this->count()) +
                            " communicators, PYCOMM_STRIPES: a rank that striped this op "
                            "shows the count of its part 0)");
  }
}

// A failure names the user's whole op as well as the part the core saw.
std::string Stripes::describe(const Part& part) const {
  return "pycomm: rank " + std::to_string(own_.rank()) + ": an all_reduce of " +
         std::to_string(part.whole) + " elements striped over " + std::to_string(part.of) +
         " communicators (PYCOMM_STRIPES), part " + std::to_string(part.index) + " = elements [" +
         std::to_string(part.first) + ", " + std::to_string(part.first + part.count) + "): ";
}

void Stripes::run_part(Pending& p, const Part& part, const std::function<void()>& body) {
  try {
    body();
  } catch (const pycomm::InvalidArgument& e) {
    record_failure(p, pycomm::InvalidArgument(describe(part) + e.what()));
  } catch (const std::exception& e) {
    record_failure(p, pycomm::CommError(describe(part) + e.what()));
  } catch (...) {
    record_failure(p, pycomm::CommError(describe(part) + "failed"));
  }
}

template <class Error>
void Stripes::record_failure(Pending& p, const Error& error) {
  {
    std::lock_guard<std::mutex> lock(p.mu);
    if (p.error) return;  // the first failure stands; the others follow from it
    p.error = std::make_exception_ptr(error);
  }
  fail_all(error.what());
}

void Stripes::fail_all(const std::string& msg) {
  own_.shared().set_abort(msg);
  for (auto& s : extra_) s->comm().shared().set_abort(msg);
}

void Stripes::set_timeout(std::chrono::milliseconds t) {
  for (auto& s : extra_) s->comm().set_timeout(t);
}

void Stripes::close(pycomm::Departure how) {
  for (auto& s : extra_) {
    s->stop();
    s->comm().depart(how);
  }
  extra_.clear();
}

void Stripes::forget_after_fork() {
  // Their threads do not exist in this process and their ranks are the parent's: nothing
  // is joined or departed (fork_guard.h), so the stripes are left as they are.
  for (auto& s : extra_) (void)s.release();
  extra_.clear();
}

}  // namespace pycomm_torch
