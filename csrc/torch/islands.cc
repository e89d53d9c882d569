// Lifecycle, failure handling and the flat (gloo-only) ops of ProcessGroupIslands; the
// hierarchical collectives are in islands_collectives.cc.
#include "islands.h"

#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <map>
#include <thread>

#include "../core/config.h"
#include "../core/errors.h"
#include "tensor_args.h"
#include "work.h"

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

// The elements each peer's block holds, from split sizes in rows (empty: equal).
std::vector<int64_t> split_elems(const at::Tensor& t, const std::vector<int64_t>& splits, int n,
                                 const char* which, int rank) {
  const char* name = "all_to_all_single";
  int64_t rows = t.dim() > 0 ? t.size(0) : 1;
  int64_t row_elems = rows > 0 ? t.numel() / rows : 0;
  std::vector<int64_t> c(n);
  if (splits.empty()) {
    TORCH_CHECK_VALUE(rows % n == 0, "pycomm: ", name, " on rank ", rank, ": ", which, " of shape ",
                      shape_str(t), " has ", rows, " rows, not divisible by the world size ", n,
                      "; pass split sizes");
    for (auto& x : c) x = rows / n * row_elems;
    return c;
  }
  TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == n, "pycomm: ", name, " on rank ", rank, ": ",
                    which, " split sizes have ", splits.size(), " entries, expected ", n);
  int64_t total = 0;
  for (int i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(splits[i] >= 0, "pycomm: ", name, " on rank ", rank, ": negative split size");
    c[i] = splits[i] * row_elems;
    total += splits[i];
  }
  TORCH_CHECK_VALUE(total == rows, "pycomm: ", name, " on rank ", rank, ": ", which,
                    " split sizes add up to ", total, " rows but the tensor has ", rows);
  return c;
}

// A contiguous tensor's bytes as a flat uint8 tensor: data movement is dtype-blind, so
// the engine sees one dtype it surely supports.
at::Tensor as_bytes(const at::Tensor& t) { return t.reshape({-1}).view(at::kByte); }

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
      log_(translated([] { return pycomm::Config::from_env().log; }), rank, size),
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
  worker_ = std::make_unique<pycomm::Worker>();
  if (log_.enabled(pycomm::LogLevel::INFO)) {
    log_.log(pycomm::LogLevel::INFO,
             "islands: " + layout_.describe() + "; this rank is island " +
                 std::to_string(island()) + ", local rank " + std::to_string(local_rank()) +
                 "; shared memory inside an island, " + engines_.world->getBackendName() +
                 " between islands; all_reduce by " +
                 (layout_.even() ? "shards (equal islands)" : "leaders (unequal islands)"));
  }
}

ProcessGroupIslands::~ProcessGroupIslands() { shutdown(); }

void ProcessGroupIslands::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  if (local_) local_->setTimeout(timeout);
  for (auto* e : {&engines_.world, &engines_.shard, &engines_.leaders}) {
    if (*e) (*e)->setTimeout(timeout);
  }
}

// Finishes what is queued (each step is bounded by the timeout), then releases the
// island's segment and the engines (gloo joins its threads: an op stuck on a dead
// peer ends at gloo's own timeout).
void ProcessGroupIslands::shutdown() {
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
  leftovers_.drop_all();
  Op op{name, ++seq_};
  std::string title = std::string("pycomm:") + name;
  auto work = c10::make_intrusive<PycommWork>(getRank(), type, title.c_str(), std::move(outputs));
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
  if (async_op || !worker_->run_inline(task)) worker_->submit(std::move(task));
  return work;
}

void ProcessGroupIslands::log_path(const Op& op, const std::string& path) const {
  if (!log_.enabled(pycomm::LogLevel::INFO)) return;
  log_.log(pycomm::LogLevel::INFO,
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

// --- ops over the world engine (no hierarchy) ------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  at::Tensor in = single(inputs, "gather", getRank());
  checked_dtype(in, "gather", getRank());
  int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK_VALUE(root >= 0 && root < getSize(), "pycomm: gather on rank ", getRank(), ": root ",
                    root, " is not a rank of this group of ", getSize());
  std::vector<at::Tensor> outs;
  if (getRank() == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                      "pycomm: gather on rank ", getRank(), ": the root takes one output list of ",
                      getSize(), " tensors");
    outs = outputs[0];
    for (const auto& t : outs) {
      check_same_dtype(in, t, "gather", getRank());
      TORCH_CHECK_VALUE(t.numel() == in.numel(), "pycomm: gather on rank ", getRank(),
                        ": an output has shape ", shape_str(t), " but the input has shape ",
                        shape_str(in));
    }
  }
  return enqueue(c10d::OpType::GATHER, "gather", outs, opts.asyncOp,
                 [this, in, outs, root](const Op& op) mutable {
                   log_path(op, "flat over the world engine");
                   std::vector<std::vector<at::Tensor>> o(1);
                   if (getRank() == root) {
                     for (int r = 0; r < getSize(); ++r)
                       o[0].push_back(as_bytes(at::empty_like(in, at::MemoryFormat::Contiguous)));
                   } else {
                     o.clear();
                   }
                   std::vector<at::Tensor> i{as_bytes(in.contiguous())};
                   c10d::GatherOptions g;
                   g.rootRank = root;
                   remote_step(op, "gather", i[0].numel(),
                               [&] { return engines_.world->gather(o, i, g); });
                   if (getRank() == root) {
                     for (size_t r = 0; r < outs.size(); ++r) {
                       outs[r].copy_(o[0][r].view(in.scalar_type()).view(outs[r].sizes()));
                     }
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  at::Tensor out = single(outputs, "scatter", getRank());
  checked_dtype(out, "scatter", getRank());
  int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK_VALUE(root >= 0 && root < getSize(), "pycomm: scatter on rank ", getRank(), ": root ",
                    root, " is not a rank of this group of ", getSize());
  std::vector<at::Tensor> ins;
  if (getRank() == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
                      "pycomm: scatter on rank ", getRank(), ": the root takes one input list of ",
                      getSize(), " tensors");
    ins = inputs[0];
    for (const auto& t : ins) {
      check_same_dtype(out, t, "scatter", getRank());
      TORCH_CHECK_VALUE(t.numel() == out.numel(), "pycomm: scatter on rank ", getRank(),
                        ": an input has shape ", shape_str(t), " but the output has shape ",
                        shape_str(out));
    }
  }
  return enqueue(
      c10d::OpType::SCATTER, "scatter", {out}, opts.asyncOp, [this, out, ins, root](const Op& op) {
        log_path(op, "flat over the world engine");
        Staged buf(out);
        std::vector<at::Tensor> o{as_bytes(buf.get())};
        std::vector<std::vector<at::Tensor>> i;
        size_t nbytes = 0;
        if (getRank() == root) {
          i.emplace_back();
          for (const auto& t : ins) i[0].push_back(as_bytes(t.contiguous()));
          nbytes = o[0].numel() * getSize();
        }
        c10d::ScatterOptions s;
        s.rootRank = root;
        remote_step(op, "scatter", nbytes, [&] { return engines_.world->scatter(o, i, s); });
        buf.commit();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
    std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all_single";
  checked_dtype(input, name, getRank());
  checked_dtype(output, name, getRank());
  check_same_dtype(input, output, name, getRank());
  const int64_t esize = input.element_size();
  std::vector<int64_t> sends = split_elems(input, input_splits, getSize(), "input", getRank());
  std::vector<int64_t> recvs = split_elems(output, output_splits, getSize(), "output", getRank());
  for (auto* v : {&sends, &recvs}) {
    for (auto& x : *v) x *= esize;
  }
  at::Tensor out = output, in = input;
  return enqueue(c10d::OpType::ALLTOALL_BASE, name, {out}, opts.asyncOp,
                 [this, out, in, sends, recvs](const Op& op) mutable {
                   log_path(op, "flat over the world engine");
                   Staged buf(out);
                   at::Tensor o = as_bytes(buf.get()), i = as_bytes(in.contiguous());
                   remote_step(op, "all_to_all", i.numel(), [&] {
                     return engines_.world->alltoall_base(o, i, recvs, sends,
                                                          c10d::AllToAllOptions());
                   });
                   buf.commit();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::alltoall(std::vector<at::Tensor>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all";
  const int n = getSize();
  TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == n && static_cast<int>(outputs.size()) == n,
                    "pycomm: ", name, " on rank ", getRank(), ": needs ", n,
                    " input and output tensors, got ", inputs.size(), " and ", outputs.size());
  std::vector<int64_t> sends, recvs;
  for (int i = 0; i < n; ++i) {
    checked_dtype(inputs[i], name, getRank());
    checked_dtype(outputs[i], name, getRank());
    check_same_dtype(inputs[0], inputs[i], name, getRank());
    check_same_dtype(inputs[0], outputs[i], name, getRank());
    sends.push_back(inputs[i].numel() * inputs[i].element_size());
    recvs.push_back(outputs[i].numel() * outputs[i].element_size());
  }
  return enqueue(c10d::OpType::ALLTOALL, name, outputs, opts.asyncOp,
                 [this, outputs, inputs, sends, recvs](const Op& op) mutable {
                   log_path(op, "flat over the world engine");
                   std::vector<at::Tensor> flat_in;
                   for (const auto& t : inputs) flat_in.push_back(as_bytes(t.contiguous()));
                   at::Tensor i = at::cat(flat_in);
                   int64_t total = 0;
                   for (int64_t x : recvs) total += x;
                   at::Tensor o = at::empty({total}, i.options());
                   remote_step(op, "all_to_all", i.numel(), [&] {
                     return engines_.world->alltoall_base(o, i, recvs, sends,
                                                          c10d::AllToAllOptions());
                   });
                   int64_t off = 0;
                   for (auto& t : outputs) {
                     int64_t nb = t.numel() * t.element_size();
                     t.copy_(o.narrow(0, off, nb).view(t.scalar_type()).view(t.sizes()));
                     off += nb;
                   }
                 });
}

// --- send / recv -----------------------------------------------------------------------

namespace {

// A receive staged through a contiguous buffer: wait() copies it into the target.
class CopyBackWork : public c10d::Work {
 public:
  CopyBackWork(c10::intrusive_ptr<c10d::Work> inner, at::Tensor target, at::Tensor staged)
      : c10d::Work(-1, c10d::OpType::RECV),
        inner_(std::move(inner)),
        target_(std::move(target)),
        staged_(std::move(staged)) {}
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  bool wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    c10::impl::ExcludeDispatchKeyGuard no_autograd(
        c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    target_.copy_(staged_);
    return true;
  }
  int sourceRank() const override { return inner_->sourceRank(); }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  at::Tensor target_, staged_;
};

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::point_to_point(bool is_send, at::Tensor t,
                                                                   int peer, int tag) {
  const char* name = is_send ? "send" : "recv";
  checked_dtype(t, name, getRank());
  TORCH_CHECK_VALUE(peer >= 0 && peer < getSize() && peer != getRank(), "pycomm: ", name,
                    " on rank ", getRank(), ": peer ", peer,
                    " is not another rank of this group of ", getSize());
  check_usable();
  std::vector<at::Tensor> ts;
  if (layout_.island_of[peer] == island()) {  // same island: shared memory
    ts.push_back(t);
    int local_peer = layout_.local_of[peer];
    return is_send ? local_->send(ts, local_peer, tag) : local_->recv(ts, local_peer, tag);
  }
  at::Tensor staged = t.is_contiguous() ? t : t.contiguous();
  ts.push_back(as_bytes(staged));
  if (is_send) {
    inter_bytes_ += ts[0].numel();
    return engines_.world->send(ts, peer, tag);
  }
  auto w = engines_.world->recv(ts, peer, tag);
  if (staged.is_same(t)) return w;
  return c10::make_intrusive<CopyBackWork>(w, t, staged);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::send(std::vector<at::Tensor>& tensors, int dst,
                                                         int tag) {
  return point_to_point(true, single(tensors, "send", getRank()), dst, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::recv(std::vector<at::Tensor>& tensors, int src,
                                                         int tag) {
  return point_to_point(false, single(tensors, "recv", getRank()), src, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::recvAnysource(std::vector<at::Tensor>&, int) {
  TORCH_CHECK(false,
              "pycomm: recv from any source (dist.recv without src) is not supported; "
              "name the source rank");
}

}  // namespace pycomm_torch
