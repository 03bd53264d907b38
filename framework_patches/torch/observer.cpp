// A global RecordFunction observer: every ATen op, autograd node and record_function range of
// every thread, written to a per-thread buffer in C++ (no Python, no GIL), drained in bulk by the
// recorder's flusher through a C ABI (ctypes). Why: the profiler's own collection processes its
// events on the program's thread when a session stops (2-5 us an event); this costs the enter
// and exit callbacks only. See ops_native.py.
// As libtorch is built: its headers' debug-only checks read state a release libtorch never sets
// (RecordFunction::inputs() asserts on inputs_valid_, which only a debug build keeps).
#ifndef NDEBUG
#define NDEBUG
#endif
#include <ATen/record_function.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#if __has_include(<torch/csrc/distributed/c10d/ParamCommsUtils.hpp>)
#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>
#define GT_PARAM_COMMS 1
#endif

#include <atomic>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace torch::autograd {
// graph_task.h (TORCH_API): the id of the graph task the calling thread runs, -1 outside one.
int get_current_graph_task_id();
}  // namespace torch::autograd

namespace {

// One finished range. Kept in step with RECORD in ops_native.py.
struct Rec {
  int64_t start;    // CLOCK_MONOTONIC ns
  int64_t end;      // CLOCK_MONOTONIC ns
  int64_t seq;      // autograd sequence number (-1: none); an autograd node's evaluate range
                    // takes its node's, as the profiler's events have it
  uint64_t id;      // this range's id (from 1)
  uint64_t parent;  // the enclosing range's id on the same thread (0: none)
  uint64_t root;    // the outermost enclosing range's id on the thread (itself at depth 0)
  uint64_t fwd_tid; // RecordFunction::forwardThreadId (backward nodes: the forward's thread)
  int64_t task;     // backward nodes: the autograd graph task (pass) running them, else -1
  int32_t name;     // interned name id
  int32_t tid;      // OS thread id
  int32_t depth;
  int32_t scope;    // at::RecordScope
};

struct Ctx : at::ObserverContext {
  int64_t start;
  uint64_t id;
  uint64_t parent;
  uint64_t root;
  int32_t depth;
};

struct Open {
  uint64_t id;
  int64_t child_seq;  // the sequence number of an autograd node run directly inside
};

struct Buffer {
  std::mutex lock;
  std::vector<Rec> recs;
};

std::mutex g_lock;  // guards the fields below
std::vector<std::shared_ptr<Buffer>> g_buffers;
std::unordered_map<std::string, int32_t> g_ids;
std::vector<std::unique_ptr<std::string>> g_names;  // stable addresses: cached by threads
std::atomic<uint64_t> g_next_id{1};
std::atomic<uint64_t> g_dropped{0};
std::atomic<size_t> g_cap{1 << 20};  // records a thread keeps between drains
at::CallbackHandle g_handle = 0;

struct Local {
  std::shared_ptr<Buffer> buf;
  std::vector<Open> stack;  // the open ranges
  std::vector<int64_t> starts;  // nodes only: the open nodes' starts
  // name pointer -> (id, interned text), a hit checked by content
  std::unordered_map<const char*, std::pair<int32_t, const std::string*>> by_ptr;
  int32_t tid = 0;
};

Local& local() {
  thread_local Local l;
  if (!l.buf || l.tid == 0) {
    l.buf = std::make_shared<Buffer>();
    l.buf->recs.reserve(4096);
    l.tid = static_cast<int32_t>(syscall(SYS_gettid));
    std::lock_guard<std::mutex> g(g_lock);
    g_buffers.push_back(l.buf);
  }
  return l;
}

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

int32_t intern(Local& l, const char* name) {
  // Operator names are stable pointers; strings built per call (an autograd node's) may reuse a
  // pointer for other text, so a hit is confirmed by content.
  auto it = l.by_ptr.find(name);
  if (it != l.by_ptr.end() && std::strcmp(it->second.second->c_str(), name) == 0) {
    return it->second.first;
  }
  std::lock_guard<std::mutex> g(g_lock);
  auto got = g_ids.find(name);
  int32_t id;
  if (got != g_ids.end()) {
    id = got->second;
  } else {
    id = static_cast<int32_t>(g_names.size());
    g_names.push_back(std::make_unique<std::string>(name));
    g_ids.emplace(*g_names.back(), id);
  }
  l.by_ptr[name] = {id, g_names[id].get()};
  return id;
}

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction&) {
  try {
    Local& l = local();
    auto ctx = std::make_unique<Ctx>();
    ctx->id = g_next_id.fetch_add(1, std::memory_order_relaxed);
    ctx->parent = l.stack.empty() ? 0 : l.stack.back().id;
    ctx->root = l.stack.empty() ? ctx->id : l.stack.front().id;
    ctx->depth = static_cast<int32_t>(l.stack.size());
    l.stack.push_back({ctx->id, -1});
    ctx->start = now_ns();
    return ctx;
  } catch (...) {
    return nullptr;
  }
}

void on_exit(const at::RecordFunction& fn, at::ObserverContext* base) {
  int64_t end = now_ns();
  if (base == nullptr) {
    return;
  }
  try {
    auto* ctx = static_cast<Ctx*>(base);
    Local& l = local();
    Rec r;
    r.seq = fn.seqNr();
    // An async range may end on another thread: pop only what this thread opened.
    if (!l.stack.empty() && l.stack.back().id == ctx->id) {
      if (r.seq < 0) {
        r.seq = l.stack.back().child_seq;
      }
      l.stack.pop_back();
    }
    if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION && r.seq >= 0 && !l.stack.empty() &&
        l.stack.back().id == ctx->parent && l.stack.back().child_seq < 0) {
      l.stack.back().child_seq = r.seq;
    }
    r.start = ctx->start;
    r.end = end;
    r.id = ctx->id;
    r.parent = ctx->parent;
    r.root = ctx->root;
    r.fwd_tid = fn.forwardThreadId();
    r.name = intern(l, fn.name());
    r.tid = l.tid;
    r.depth = ctx->depth;
    r.scope = static_cast<int32_t>(fn.scope());
    r.task = fn.scope() == at::RecordScope::BACKWARD_FUNCTION
                 ? static_cast<int64_t>(torch::autograd::get_current_graph_task_id())
                 : -1;
    std::lock_guard<std::mutex> g(l.buf->lock);
    if (l.buf->recs.size() >= g_cap.load(std::memory_order_relaxed)) {
      g_dropped.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    l.buf->recs.push_back(r);
  } catch (...) {
  }
}

// Nodes only (module level): lean callbacks, since every autograd node pays them. No context
// object, id or name: the start goes on the thread's stack (nodes nest on their thread) and the
// record keeps what module backward ranges need (times, sequence number, forward thread, graph
// task, depth).
std::unique_ptr<at::ObserverContext> on_node_enter(const at::RecordFunction&) {
  try {
    Local& l = local();
    l.starts.push_back(now_ns());
  } catch (...) {
  }
  return nullptr;
}

void on_node_exit(const at::RecordFunction& fn, at::ObserverContext*) {
  int64_t end = now_ns();
  try {
    Local& l = local();
    if (l.starts.empty()) {
      return;
    }
    Rec r;
    r.start = l.starts.back();
    l.starts.pop_back();
    r.end = end;
    r.seq = fn.seqNr();
    r.id = 0;
    r.parent = 0;
    r.root = 0;
    r.fwd_tid = fn.forwardThreadId();
    r.task = static_cast<int64_t>(torch::autograd::get_current_graph_task_id());
    r.name = -1;
    r.tid = l.tid;
    r.depth = static_cast<int32_t>(l.starts.size());
    r.scope = static_cast<int32_t>(at::RecordScope::BACKWARD_FUNCTION);
    std::lock_guard<std::mutex> g(l.buf->lock);
    if (l.buf->recs.size() >= g_cap.load(std::memory_order_relaxed)) {
      g_dropped.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    l.buf->recs.push_back(r);
  } catch (...) {
  }
}


// ---- collectives ---------------------------------------------------------------------------------
// Two more callbacks, started only in a process with a process group (collectives.py): c10d's
// dispatcher ops (c10d::allreduce_, ...) at FUNCTION scope: the call on the program's thread, with
// what c10d's record_param_comms range inside it says where a backend records one (NCCL: process
// group, sequence number, sizes, dtype, group ranks; read from the thread's debug info, not from
// inputs); and the backends' work ranges (gloo:all_reduce, nccl:all_reduce, ...) at USER_SCOPE with
// their input tensors, from when the work runs to when it completes, on the backend's thread.
// FUNCTION scope costs every op a one-byte name check; USER_SCOPE is record_function ranges only.

// One collective call or one backend work. Kept in step with COMM_RECORD in collectives.py.
struct CommRec {
  int64_t start;
  int64_t end;
  int64_t seq;        // record_param_comms' sequence number (-1: none)
  int64_t in_elems;   // -1: unknown
  int64_t out_elems;  // -1: unknown
  int64_t bytes;      // work: its input tensors' bytes; call: in_elems x the dtype's size; -1
  int32_t name;       // interned: c10d::allreduce_, gloo:all_reduce, ...
  int32_t pg;         // interned process group name (-1: unknown)
  int32_t pg_desc;    // interned process group description (-1)
  int32_t ranks;      // interned "0,1,..." global ranks of the group (-1)
  int32_t dtype;      // interned dtype name (-1)
  int32_t tid;
  int32_t kind;       // 0: a c10d call, 1: a backend's work
  int32_t rank;       // rank in the group (-1)
  int32_t world;      // group size (-1)
  int32_t depth;      // c10d calls open around it on its thread
};

struct CommCtx : at::ObserverContext {
  CommRec rec;
};

std::mutex g_comm_lock;  // guards g_comms
std::vector<CommRec> g_comms;
std::atomic<uint64_t> g_comm_dropped{0};
at::CallbackHandle g_call_handle = 0;
at::CallbackHandle g_work_handle = 0;
thread_local std::vector<CommCtx*> t_calls;  // this thread's open c10d calls

int32_t intern_text(const std::string& text) {
  std::lock_guard<std::mutex> g(g_lock);
  auto got = g_ids.find(text);
  if (got != g_ids.end()) {
    return got->second;
  }
  int32_t id = static_cast<int32_t>(g_names.size());
  g_names.push_back(std::make_unique<std::string>(text));
  g_ids.emplace(*g_names.back(), id);
  return id;
}

void comm_blank(CommRec& r) {
  r.seq = r.in_elems = r.out_elems = r.bytes = -1;
  r.pg = r.pg_desc = r.ranks = r.dtype = -1;
  r.rank = r.world = -1;
  r.depth = 0;
}

void comm_push(const CommRec& r) {
  std::lock_guard<std::mutex> g(g_comm_lock);
  if (g_comms.size() >= g_cap.load(std::memory_order_relaxed)) {
    g_comm_dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  g_comms.push_back(r);
}

#ifdef GT_PARAM_COMMS
// Getters of ParamCommsDebugInfo that some PyTorch releases lack (2.11 has no sequence number):
// read where the release has them, a blank where not. The overload taking `int` wins where its
// return type is well formed, so one source builds against each release.
template <typename T>
auto param_seq(const T* i, int) -> decltype(static_cast<int64_t>(i->getSequenceNumber())) {
  return static_cast<int64_t>(i->getSequenceNumber());
}
template <typename T>
int64_t param_seq(const T*, long) {
  return -1;
}
template <typename T>
auto param_desc(const T* i, int) -> decltype(std::string(i->getProcessGroupDesc())) {
  return std::string(i->getProcessGroupDesc());
}
template <typename T>
std::string param_desc(const T*, long) {
  return std::string();
}

void read_param_comms(CommRec& r) {
  auto* base = c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PARAM_COMMS_INFO);
  if (base == nullptr) {
    return;
  }
  // Only ParamCommsDebugInfo is kept under PARAM_COMMS_INFO (RECORD_PARAM_COMMS).
  auto* info = static_cast<torch::ParamCommsDebugInfo*>(base);
  r.seq = param_seq(info, 0);
  r.in_elems = info->getInMessageNelems();
  r.out_elems = info->getOutMessageNelems();
  r.bytes = r.in_elems * static_cast<int64_t>(c10::elementSize(info->getDType()));
  r.dtype = intern_text(c10::toString(info->getDType()));
  r.pg = intern_text(info->getProcessGroupName());
  const std::string desc = param_desc(info, 0);
  if (!desc.empty()) {
    r.pg_desc = intern_text(desc);
  }
  r.rank = info->getRank();
  r.world = info->getWorldSize();
  std::string ranks;
  for (int64_t k : info->getGroupRanks()) {
    ranks += (ranks.empty() ? "" : ",") + std::to_string(k);
  }
  if (!ranks.empty()) {
    r.ranks = intern_text(ranks);
  }
}
#endif

std::unique_ptr<at::ObserverContext> on_call_enter(const at::RecordFunction& fn) {
  const char* name = fn.name();
  if (name[0] != 'c' && name[0] != 'r') {  // nearly every op: one byte read
    return nullptr;
  }
  try {
    if (std::strncmp(name, "c10d::", 6) == 0) {
      auto ctx = std::make_unique<CommCtx>();
      comm_blank(ctx->rec);
      ctx->rec.name = intern(local(), name);
      ctx->rec.kind = 0;
      ctx->rec.depth = static_cast<int32_t>(t_calls.size());
      t_calls.push_back(ctx.get());
      ctx->rec.start = now_ns();
      return ctx;
    }
#ifdef GT_PARAM_COMMS
    if (!t_calls.empty() && std::strcmp(name, "record_param_comms") == 0) {
      read_param_comms(t_calls.back()->rec);
    }
#endif
  } catch (...) {
  }
  return nullptr;
}

void on_call_exit(const at::RecordFunction&, at::ObserverContext* base) {
  if (base == nullptr) {
    return;
  }
  int64_t end = now_ns();
  try {
    auto* ctx = static_cast<CommCtx*>(base);
    if (!t_calls.empty() && t_calls.back() == ctx) {
      t_calls.pop_back();
    }
    ctx->rec.end = end;
    ctx->rec.tid = local().tid;
    comm_push(ctx->rec);
  } catch (...) {
  }
}

bool is_work(const char* name) {
  for (const char* p : {"gloo:", "nccl:", "mpi:", "ucc:", "xccl:"}) {
    if (std::strncmp(name, p, std::strlen(p)) == 0) {
      return true;
    }
  }
  return false;
}

std::unique_ptr<at::ObserverContext> on_work_enter(const at::RecordFunction& fn) {
  try {
    const char* name = fn.name();
    if (!is_work(name)) {
      return nullptr;
    }
    auto ctx = std::make_unique<CommCtx>();
    comm_blank(ctx->rec);
    ctx->rec.name = intern(local(), name);
    ctx->rec.kind = 1;
    int64_t bytes = 0, elems = 0;
    std::string dtype;
    auto add = [&](const at::Tensor& t) {
      if (!t.defined()) {
        return;
      }
      bytes += static_cast<int64_t>(t.nbytes());
      elems += t.numel();
      if (dtype.empty()) {
        dtype = c10::toString(t.scalar_type());
      }
    };
    for (const c10::IValue& v : fn.inputs()) {
      if (v.isTensor()) {
        add(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorVector()) {
          add(t);
        }
      }
    }
    ctx->rec.bytes = bytes;
    ctx->rec.in_elems = elems;
    if (!dtype.empty()) {
      ctx->rec.dtype = intern_text(dtype);
    }
    ctx->rec.start = now_ns();
    return ctx;
  } catch (...) {
    return nullptr;
  }
}

void on_work_exit(const at::RecordFunction&, at::ObserverContext* base) {
  if (base == nullptr) {
    return;
  }
  int64_t end = now_ns();
  try {
    auto* ctx = static_cast<CommCtx*>(base);
    ctx->rec.end = end;
    ctx->rec.tid = local().tid;
    comm_push(ctx->rec);
  } catch (...) {
  }
}

}  // namespace

#define GT_API __attribute__((visibility("default")))

extern "C" {

// Size of one record, for the caller's check against its own layout.
GT_API size_t gt_record_size() { return sizeof(Rec); }

}  // extern "C"

namespace {

// fork: the child keeps none of the parent's records, and no lock another thread of the parent
// held (those threads do not exist in the child). The parent's buffers are left allocated.
void before_fork() { g_lock.lock(); }
void after_fork_parent() { g_lock.unlock(); }
void after_fork_child() {
  new std::vector<std::shared_ptr<Buffer>>(std::move(g_buffers));  // leaked on purpose
  g_buffers.clear();
  new (&g_lock) std::mutex();
  new (&g_comm_lock) std::mutex();
  g_comms.clear();
  t_calls.clear();
  Local& l = local();
  l.buf = std::make_shared<Buffer>();
  l.buf->recs.reserve(4096);
  l.tid = static_cast<int32_t>(syscall(SYS_gettid));
  g_buffers.push_back(l.buf);
}

}  // namespace

extern "C" {

// What gt_start observes: user scopes (record_function) too; or autograd nodes only (module
// level's backward ranges: ops then cost PyTorch one scope check each, no callback).
enum { GT_USER_SCOPES = 1, GT_NODES_ONLY = 2 };

// This thread's RecordFunction thread id: a backward node's forwardThreadId when its forward ran
// here.
GT_API uint64_t gt_thread_id() { return at::RecordFunction::currentThreadId(); }

// Starts observing (idempotent: a second call keeps the first's scopes); 0 on success, -1 on
// failure. flags: GT_* above.
GT_API int gt_start(int flags) {
  static bool forks = (pthread_atfork(before_fork, after_fork_parent, after_fork_child), true);
  (void)forks;
  std::lock_guard<std::mutex> g(g_lock);
  if (g_handle != 0) {
    return 0;
  }
  try {
    std::unordered_set<at::RecordScope, std::hash<at::RecordScope>> scopes{
        at::RecordScope::BACKWARD_FUNCTION};
    bool nodes = (flags & GT_NODES_ONLY) != 0;
    if (!nodes) {
      scopes.insert(at::RecordScope::FUNCTION);
    }
    if ((flags & GT_USER_SCOPES) && !nodes) {
      scopes.insert(at::RecordScope::USER_SCOPE);
    }
    // (a named type: glibc's on_exit is also in scope)
    at::RecordFunctionCallback::EndCallback end = on_exit;
    if (nodes) {
      end = on_node_exit;
    }
    g_handle = at::addGlobalCallback(at::RecordFunctionCallback(nodes ? on_node_enter : on_enter,
                                                                end)
                                         .scopes(scopes)
                                         .needsInputs(false)
                                         .needsOutputs(false)
                                         .needsIds(false));
    return 0;
  } catch (...) {
    return -1;
  }
}

// Stops observing; records already taken stay for gt_drain.
GT_API void gt_stop() {
  at::CallbackHandle h;
  {
    std::lock_guard<std::mutex> g(g_lock);
    h = g_handle;
    g_handle = 0;
  }
  if (h != 0) {
    try {
      at::removeCallback(h);
    } catch (...) {
    }
  }
}

GT_API void gt_set_capacity(size_t cap) { g_cap.store(cap); }

GT_API uint64_t gt_dropped() { return g_dropped.load(); }

// Finished records waiting in all threads' buffers.
GT_API size_t gt_count() {
  std::vector<std::shared_ptr<Buffer>> bufs;
  {
    std::lock_guard<std::mutex> g(g_lock);
    bufs = g_buffers;
  }
  size_t n = 0;
  for (auto& b : bufs) {
    std::lock_guard<std::mutex> g(b->lock);
    n += b->recs.size();
  }
  return n;
}

// Moves up to cap finished records of all threads into out; returns how many.
GT_API size_t gt_drain(Rec* out, size_t cap) {
  std::vector<std::shared_ptr<Buffer>> bufs;
  {
    std::lock_guard<std::mutex> g(g_lock);
    bufs = g_buffers;
  }
  size_t n = 0;
  for (auto& b : bufs) {
    if (n >= cap) {
      break;
    }
    std::lock_guard<std::mutex> g(b->lock);
    size_t take = std::min(cap - n, b->recs.size());
    if (take == 0) {
      continue;
    }
    std::memcpy(out + n, b->recs.data(), take * sizeof(Rec));
    if (take == b->recs.size()) {
      b->recs.clear();
    } else {
      b->recs.erase(b->recs.begin(), b->recs.begin() + take);
    }
    n += take;
  }
  {
    // Buffers of threads that ended (held by the registry only) and are empty go.
    std::lock_guard<std::mutex> g(g_lock);
    bufs.clear();
    std::vector<std::shared_ptr<Buffer>> kept;
    for (auto& b : g_buffers) {
      std::lock_guard<std::mutex> bg(b->lock);
      if (b.use_count() > 1 || !b->recs.empty()) {
        kept.push_back(b);
      }
    }
    g_buffers.swap(kept);
  }
  return n;
}

// How many names are interned.
GT_API int32_t gt_name_count() {
  std::lock_guard<std::mutex> g(g_lock);
  return static_cast<int32_t>(g_names.size());
}

// Copies name id into buf (NUL-terminated, truncated to cap); returns its full length, -1 if none.
GT_API int64_t gt_name(int32_t id, char* buf, size_t cap) {
  std::lock_guard<std::mutex> g(g_lock);
  if (id < 0 || static_cast<size_t>(id) >= g_names.size() || cap == 0) {
    return -1;
  }
  const std::string& s = *g_names[id];
  size_t k = std::min(cap - 1, s.size());
  std::memcpy(buf, s.data(), k);
  buf[k] = '\0';
  return static_cast<int64_t>(s.size());
}

}  // extern "C"

// ---- collectives (see above) ----------------------------------------------------------------------

extern "C" {

GT_API size_t gt_comm_record_size() { return sizeof(CommRec); }

// Starts the collectives' two callbacks (idempotent); 0 on success, -1 on failure.
GT_API int gt_comms_start() {
  std::lock_guard<std::mutex> g(g_lock);
  if (g_call_handle != 0) {
    return 0;
  }
  try {
    at::RecordFunctionCallback::EndCallback end = on_call_exit;
    g_call_handle = at::addGlobalCallback(at::RecordFunctionCallback(on_call_enter, end)
                                              .scopes({at::RecordScope::FUNCTION})
                                              .needsInputs(false)
                                              .needsOutputs(false)
                                              .needsIds(false));
    end = on_work_exit;
    g_work_handle = at::addGlobalCallback(at::RecordFunctionCallback(on_work_enter, end)
                                              .scopes({at::RecordScope::USER_SCOPE})
                                              .needsInputs(true)
                                              .needsOutputs(false)
                                              .needsIds(false));
    return 0;
  } catch (...) {
    return -1;
  }
}

// Stops them; records already taken stay for gt_comms_drain.
GT_API void gt_comms_stop() {
  at::CallbackHandle a, b;
  {
    std::lock_guard<std::mutex> g(g_lock);
    a = g_call_handle;
    b = g_work_handle;
    g_call_handle = g_work_handle = 0;
  }
  for (at::CallbackHandle h : {a, b}) {
    if (h != 0) {
      try {
        at::removeCallback(h);
      } catch (...) {
      }
    }
  }
}

GT_API uint64_t gt_comms_dropped() { return g_comm_dropped.load(); }

// Moves up to cap finished collective records into out; returns how many.
GT_API size_t gt_comms_drain(CommRec* out, size_t cap) {
  std::lock_guard<std::mutex> g(g_comm_lock);
  size_t take = std::min(cap, g_comms.size());
  if (take) {
    std::memcpy(out, g_comms.data(), take * sizeof(CommRec));
    g_comms.erase(g_comms.begin(), g_comms.begin() + take);
  }
  return take;
}

}  // extern "C"
