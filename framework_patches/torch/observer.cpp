// A global RecordFunction observer: every ATen op, autograd node and record_function range of
// every thread, written to a per-thread buffer in C++ (no Python, no GIL), drained in bulk by the
// recorder's flusher through a C ABI (ctypes). Why: the profiler's own collection processes its
// events on the program's thread when a session stops (2-5 us an event); this costs the enter
// and exit callbacks only. See ops_native.py.
#include <ATen/record_function.h>

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
