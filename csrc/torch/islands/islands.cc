// Layout, lifecycle and failure handling of ProcessGroupIslands; the hierarchical
// collectives are in islands_collectives.cc, the flat ones and send/recv in islands_flat.cc.
#include "torch/islands/islands.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <thread>

#include "core/base/config.h"
#include "core/base/errors.h"
#include "core/communicator/fork_guard.h"
#include "torch/backend/tensor_args.h"
#include "torch/backend/work.h"

namespace pycomm_torch {
namespace {

// While a rank waits for the inter-island engine it looks this often at the store for
// a failure reported by another rank (gloo cannot see a rank dying in another island).
constexpr auto kPoll = std::chrono::milliseconds(100);
const char* kFirstError = "pycomm/islands/first_error";
const std::string kReported = "pycomm/islands/reported/";

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

std::string str(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

// --- layout --------------------------------------------------------------------------

IslandLayout IslandLayout::from(const std::vector<int>& island_of) {
  IslandLayout l;
  std::map<int, int> number;  // caller's island id -> island index, by lowest rank
  for (int id : island_of) {
    if (!number.count(id)) {
      int idx = static_cast<int>(number.size());
      number[id] = idx;
    }
  }
  l.members.resize(number.size());
  for (size_t r = 0; r < island_of.size(); ++r) {
    int i = number[island_of[r]];
    l.island_of.push_back(i);
    l.local_of.push_back(static_cast<int>(l.members[i].size()));
    l.members[i].push_back(static_cast<int>(r));
  }
  return l;
}

bool IslandLayout::even() const {
  for (const auto& m : members) {
    if (m.size() != members[0].size()) return false;
  }
  return true;
}

std::string IslandLayout::describe() const {
  std::string s = std::to_string(islands()) + " islands:";
  for (const auto& m : members) s += " [" + rank_list(m) + "]";
  return s;
}

// --- lifecycle -----------------------------------------------------------------------

ProcessGroupIslands::ProcessGroupIslands(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                         int size, std::chrono::milliseconds timeout,
                                         const std::vector<int>& island_of,
                                         c10::intrusive_ptr<ProcessGroupPycomm> local,
                                         IslandEngines engines)
    : c10d::Backend(rank, size),
      layout_(IslandLayout::from(island_of)),
      store_(store),
      timeout_(timeout),
      log_(translated([] { return pycomm::LogSettings::from_env(); }), rank),
      local_(std::move(local)),
      engines_(std::move(engines)) {
  TORCH_CHECK_VALUE(static_cast<int>(island_of.size()) == size,
                    "pycomm: islands: ", island_of.size(), " island ids for a group of ", size);
  TORCH_CHECK_VALUE(local_ &&
                        local_->getSize() == static_cast<int>(layout_.members[island()].size()) &&
                        local_->getRank() == local_rank(),
                    "pycomm: islands: rank ", rank, ": the island group does not match the layout");
  TORCH_CHECK_VALUE(engines_.world, "pycomm: islands: no inter-island engine for all ranks");
  TORCH_CHECK_VALUE(!layout_.even() || engines_.shard, "pycomm: islands: no shard engine");
  TORCH_CHECK_VALUE(!is_leader() || engines_.leaders, "pycomm: islands: no leaders engine");
  worker_ = std::make_unique<pycomm::Worker>(timeout);
  worker_->watch_stalls([this](const std::string& why) { return fail_on_stall(why); },
                        [this] { return local_->getSequenceNumberForGroup() + inter_bytes_; });
  if (log_.enabled(pycomm::LogLevel::INFO, pycomm::Subsys::ISLANDS)) {
    log_.log(pycomm::LogLevel::INFO, pycomm::Subsys::ISLANDS,
             "islands: " + layout_.describe() + "; this rank is island " +
                 std::to_string(island()) + ", local rank " + std::to_string(local_rank()) +
                 "; shared memory inside an island, " + engines_.world->getBackendName() +
                 " between islands; all_reduce by " +
                 (layout_.even() ? "shards (equal islands)" : "leaders (unequal islands)"));
  }
}

// Destroyed without shutdown() (the process exits without destroy_process_group): the
// island's ranks hear that from the local group's own destructor.
ProcessGroupIslands::~ProcessGroupIslands() {
  if (getpid() != creator_pid_) {  // a forked child's copy (see ProcessGroupPycomm::close)
    (void)worker_.release();
    for (auto* e : {&engines_.world, &engines_.shard, &engines_.leaders}) (void)e->release();
    (void)local_.release();
    return;
  }
  if (worker_) worker_->stop();
  local_.reset();
  shutdown();
}

// The stall watch's failure (see Worker): reported like any other, to every island.
std::string ProcessGroupIslands::fail_on_stall(const std::string& why) {
  std::string msg = stall_failure(
      "rank " + std::to_string(getRank()) + " (island " + std::to_string(island()) + ")", why);
  std::string first = msg;
  try {
    first = str(store_->compareSet(kFirstError, {}, bytes(msg)));
  } catch (...) {  // the store is gone: this rank's own word is all there is
  }
  local_->fail_with(msg);
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.empty()) failed_ = first;
  return failed_;
}

void ProcessGroupIslands::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  if (local_) local_->setTimeout(timeout);
  if (worker_) worker_->set_stall_after(timeout);
  for (auto* e : {&engines_.world, &engines_.shard, &engines_.leaders}) {
    if (*e) (*e)->setTimeout(timeout);
  }
}

// Finishes what is queued (each step is bounded by the timeout), then releases the
// island's segment and the engines (gloo joins its threads: an op stuck on a dead
// peer ends at gloo's own timeout).
void ProcessGroupIslands::shutdown() {
  if (getpid() != creator_pid_) return;  // a forked child's copy: see the destructor
  if (worker_) worker_->stop();
  worker_.reset();
  if (local_) local_->shutdown();
  local_.reset();
  engines_ = IslandEngines{};
  leftovers_.drop_all();
}

void ProcessGroupIslands::abort() {
  std::string msg = "pycomm: rank " + std::to_string(getRank()) + " aborted the process group";
  if (local_) local_->fail_with(msg);
  try {
    store_->compareSet(kFirstError, {}, bytes(msg));
  } catch (...) {  // the store may be gone already: aborting must not throw
  }
  shutdown();
}

void ProcessGroupIslands::check_usable() const {
  if (std::string forked = pycomm::forked_group_error(creator_pid_, getRank()); !forked.empty())
    TORCH_CHECK(false, forked);
  TORCH_CHECK(worker_ != nullptr, "pycomm: rank ", getRank(),
              ": the process group was shut down (destroy_process_group) and cannot run ops");
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_.empty()) translated([&] { throw pycomm::CommError(failed_); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::enqueue(c10d::OpType type, const char* name,
                                                            std::vector<at::Tensor> outputs,
                                                            bool async_op,
                                                            std::function<void(const Op&)> body) {
  check_usable();
  if (!worker_->on_worker_thread()) leftovers_.drop_all();  // (see ProcessGroupPycomm)
  Op op{name, ++seq_};
  const char* title = interned_title(std::string("pycomm:") + name);
  auto work =
      c10::make_intrusive<PycommWork>(getRank(), type, title, std::move(outputs), worker_.get());
  std::function<void()> task = [this, work, op, body = std::move(body)]() mutable {
    std::exception_ptr error;
    try {
      c10::impl::ExcludeDispatchKeyGuard no_autograd(
          c10::autograd_dispatch_keyset_with_ADInplaceOrView);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!failed_.empty()) throw pycomm::CommError(failed_);
      }
      body(op);
    } catch (...) {
      error = translate_current_exception();
    }
    work->complete(error);
    // Dropped later on the caller's thread (see Leftovers): it holds user tensors.
    leftovers_.park(std::move(work), {},
                    std::make_shared<std::function<void(const Op&)>>(std::move(body)));
  };
  dispatch(*worker_, work, async_op, std::move(task));
  return work;
}

void ProcessGroupIslands::log_path(const Op& op, const std::string& path) const {
  if (!log_.enabled(pycomm::LogLevel::TRACE, pycomm::Subsys::ISLANDS)) return;
  log_.log(pycomm::LogLevel::TRACE, pycomm::Subsys::ISLANDS,
           std::string("islands ") + op.name + " seq " + std::to_string(op.seq) + ": " + path);
}

// --- steps and failure ---------------------------------------------------------------

std::string ProcessGroupIslands::island_note(int island) const {
  const auto& m = layout_.members[island];
  return "island " + std::to_string(island) + " (its local ranks 0.." +
         std::to_string(m.size() - 1) + " are global ranks " + rank_list(m) + ")";
}

void ProcessGroupIslands::local_step(const Op& op, const char* what,
                                     const c10::intrusive_ptr<c10d::Work>& w) {
  try {
    w->wait();
  } catch (const std::exception& e) {
    fail(op, std::string(what) + " inside " + island_note(island()) + " failed: " + e.what());
  }
}

void ProcessGroupIslands::remote_step(
    const Op& op, const char* what, size_t nbytes,
    const std::function<c10::intrusive_ptr<c10d::Work>()>& start) {
  inter_bytes_ += nbytes;
  c10::intrusive_ptr<c10d::Work> w;
  try {
    w = start();
    // Wait in slices: between them, look for a failure another rank reported.
    while (!w->isCompleted()) {
      try {
        w->wait(kPoll);
      } catch (...) {
        if (w->isCompleted()) break;  // it ended (maybe with an error) just now
      }
      if (!w->isCompleted() && store_->check({kFirstError})) {
        fail(op, std::string(what) + " across islands stopped: another rank reported a failure");
      }
    }
    w->wait();  // returns, or throws the engine's error
  } catch (const pycomm::CommError&) {
    throw;  // from fail() above
  } catch (const std::exception& e) {
    fail(op, std::string(what) + " across islands (" + engines_.world->getBackendName() +
                 ") failed: " + e.what());
  }
}

// Every rank that sees a failure reports it in the store and stops its island; the
// others notice (in shared memory: the island's abort flag; in the network engine:
// the store, polled), report too, and raise. Whoever has not reported after a grace
// period is named: a rank that died, or one that never arrived at this op.
void ProcessGroupIslands::fail(const Op& op, const std::string& why) {
  std::string where = std::string("pycomm: ") + op.name + " seq " + std::to_string(op.seq) +
                      " on rank " + std::to_string(getRank()) + " (island " +
                      std::to_string(island()) + ")";
  std::string first;
  std::vector<int> missing;
  try {
    first = str(store_->compareSet(kFirstError, {}, bytes(where + ": " + why)));
    store_->set(kReported + std::to_string(getRank()), bytes(why));
    local_->fail_with(where + " failed: " + first);
    auto grace = std::min<std::chrono::milliseconds>(
        std::chrono::seconds(3), std::max<std::chrono::milliseconds>(timeout_ / 2, kPoll * 5));
    auto deadline = std::chrono::steady_clock::now() + grace;
    for (int r = 0; r < getSize(); ++r) missing.push_back(r);
    while (!missing.empty()) {
      missing.erase(
          std::remove_if(missing.begin(), missing.end(),
                         [&](int r) { return store_->check({kReported + std::to_string(r)}); }),
          missing.end());
      if (missing.empty() || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception& e) {  // the store itself failed: report what we know
    first = first.empty() ? why + " (store unreachable: " + e.what() + ")" : first;
  }
  std::string msg = where + " failed";
  if (!missing.empty()) {
    msg += ": rank(s) " + rank_list(missing) +
           " did not arrive (no report from them after the failure; dead or elsewhere)";
  }
  msg += "; first error: " + first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.empty()) failed_ = msg;
  }
  throw pycomm::CommError(msg);
}

}  // namespace pycomm_torch
