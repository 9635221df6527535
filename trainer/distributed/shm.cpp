// All-reduce and all-gather for the ranks of one host through one shared-memory segment (trainer/distributed/shm.py).
//
// Segment: a 4 KiB header (barrier counter and generation, each rank's pid), then one slot per rank and one result
// slot of slot_bytes each. A tensor goes through in slot-sized chunks: every rank copies its chunk into its slot,
// barrier, rank r reduces the r-th part of the chunk over all slots in rank order into the result slot, barrier,
// every rank copies the result out. Each element is reduced once, in the same order, so every rank gets the same
// bits. Waiting spins briefly, then sleeps on a futex; while asleep it checks every 20 ms that the peers are alive
// and that the timeout has not passed, and throws (a Python RuntimeError) naming the rank if either fails.
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t kHeaderBytes = 4096;
constexpr int kMaxRanks = 256;

struct Header {
  std::atomic<int32_t> arrive;
  char pad0[60];
  std::atomic<int32_t> generation;    // the futex word: bumped by the last rank to arrive
  char pad1[60];
  int64_t pids[kMaxRanks];
};
static_assert(sizeof(Header) <= kHeaderBytes, "header too large");

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

int32_t* word(std::atomic<int32_t>* a) { return reinterpret_cast<int32_t*>(a); }

// Gone, or a zombie its launcher has not reaped yet (its state in /proc/PID/stat is Z or X).
bool exited(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  char path[64], buf[512];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  const size_t got = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[got] = 0;
  const char* close = std::strrchr(buf, ')');      // the state follows the command name, which may hold spaces
  return close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

void check_peers(const Header* h, int world, int rank) {
  for (int r = 0; r < world; ++r) {
    if (r != rank && exited(h->pids[r])) {
      throw std::runtime_error("shared-memory all-reduce: rank " + std::to_string(r) + " (pid " +
                               std::to_string(h->pids[r]) + ") has exited");
    }
  }
}

void wait_for_next(Header* h, int32_t seen, int world, int rank, double timeout_s) {
  for (int i = 0; i < 2000; ++i) {          // a few microseconds: the common case on idle-free cores
    if (h->generation.load(std::memory_order_acquire) != seen) return;
    cpu_relax();
  }
  const auto start = std::chrono::steady_clock::now();
  while (h->generation.load(std::memory_order_acquire) == seen) {
    timespec nap{0, 20 * 1000 * 1000};
    syscall(SYS_futex, word(&h->generation), FUTEX_WAIT, seen, &nap, nullptr, 0);
    if (h->generation.load(std::memory_order_acquire) != seen) return;
    check_peers(h, world, rank);
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout_s) {
      throw std::runtime_error("shared-memory all-reduce: timed out after " + std::to_string(int(timeout_s)) +
                               " s (dist.timeout_s) waiting for the other ranks");
    }
  }
}

void barrier_impl(Header* h, int world, int rank, double timeout_s) {
  const int32_t seen = h->generation.load(std::memory_order_acquire);
  if (h->arrive.fetch_add(1, std::memory_order_acq_rel) == world - 1) {
    h->arrive.store(0, std::memory_order_relaxed);
    h->generation.fetch_add(1, std::memory_order_release);
    syscall(SYS_futex, word(&h->generation), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  } else {
    wait_for_next(h, seen, world, rank, timeout_s);
  }
}

enum Op { kSum = 0, kMax = 1, kMin = 2 };

template <typename T>
void reduce_part(char* base, int64_t slot_bytes, int world, int rank, int64_t n, int op, double scale) {
  T* out = reinterpret_cast<T*>(base + kHeaderBytes + world * slot_bytes);
  const int64_t per = (n + world - 1) / world;
  const int64_t lo = std::min(n, rank * per), hi = std::min(n, lo + per);
  auto slot = [&](int k) { return reinterpret_cast<const T*>(base + kHeaderBytes + k * slot_bytes); };
  std::memcpy(out + lo, slot(0) + lo, (hi - lo) * sizeof(T));
  for (int k = 1; k < world; ++k) {
    const T* s = slot(k);
    if (op == kSum) {
      for (int64_t i = lo; i < hi; ++i) out[i] += s[i];
    } else if (op == kMax) {
      for (int64_t i = lo; i < hi; ++i) out[i] = s[i] > out[i] ? s[i] : out[i];
    } else {
      for (int64_t i = lo; i < hi; ++i) out[i] = s[i] < out[i] ? s[i] : out[i];
    }
  }
  if (scale != 1.0) {
    const T factor = static_cast<T>(scale);
    for (int64_t i = lo; i < hi; ++i) out[i] *= factor;
  }
}

void reduce_chunk(c10::ScalarType dtype, char* base, int64_t slot_bytes, int world, int rank, int64_t n, int op,
                  double scale) {
  switch (dtype) {
    case torch::kFloat: return reduce_part<float>(base, slot_bytes, world, rank, n, op, scale);
    case torch::kDouble: return reduce_part<double>(base, slot_bytes, world, rank, n, op, scale);
    case torch::kLong: return reduce_part<int64_t>(base, slot_bytes, world, rank, n, op, 1.0);
    case torch::kInt: return reduce_part<int32_t>(base, slot_bytes, world, rank, n, op, 1.0);
    default: throw std::runtime_error("shared-memory all-reduce: unsupported dtype");
  }
}

}  // namespace

bool supports(torch::Tensor t) {
  const auto d = t.scalar_type();
  return t.device().is_cpu() && !t.is_sparse() &&
         (d == torch::kFloat || d == torch::kDouble || d == torch::kLong || d == torch::kInt);
}

// Moves one chunk between the tensors, seen as one concatenated buffer, and a slot: [off, off + m) elements.
void copy_span(std::vector<torch::Tensor>& ts, int64_t off, int64_t m, char* slot, bool to_slot) {
  int64_t start = 0;
  for (auto& t : ts) {
    const int64_t n = t.numel(), esize = t.element_size();
    const int64_t lo = std::max(off, start), hi = std::min(off + m, start + n);
    if (lo < hi) {
      char* data = reinterpret_cast<char*>(t.data_ptr()) + (lo - start) * esize;
      char* s = slot + (lo - off) * esize;
      if (to_slot) {
        std::memcpy(s, data, (hi - lo) * esize);
      } else {
        std::memcpy(data, s, (hi - lo) * esize);
      }
    }
    start += n;
    if (start >= off + m) break;
  }
}

// In place, every tensor of the list as one buffer (one synchronisation per slot-sized chunk, not per tensor);
// `scale` multiplies the result (1/world for a mean; floating dtypes only).
void all_reduce(torch::Tensor segment, std::vector<torch::Tensor> ts, int64_t world, int64_t rank,
                int64_t slot_bytes, int64_t op, double scale, double timeout_s) {
  TORCH_CHECK(!ts.empty(), "shared-memory all-reduce: no tensors");
  int64_t n = 0;
  for (const auto& t : ts) {
    TORCH_CHECK(supports(t) && t.is_contiguous() && t.scalar_type() == ts[0].scalar_type(),
                "shared-memory all-reduce: contiguous CPU tensors of one dtype: float32, float64, int64 or int32");
    n += t.numel();
  }
  TORCH_CHECK(world >= 1 && world <= kMaxRanks && rank >= 0 && rank < world, "bad rank/world");
  py::gil_scoped_release nogil;
  char* base = reinterpret_cast<char*>(segment.data_ptr());
  Header* h = reinterpret_cast<Header*>(base);
  const int64_t per_chunk = slot_bytes / ts[0].element_size();
  for (int64_t off = 0; off < n; off += per_chunk) {
    const int64_t m = std::min(per_chunk, n - off);
    copy_span(ts, off, m, base + kHeaderBytes + rank * slot_bytes, true);
    barrier_impl(h, world, rank, timeout_s);
    reduce_chunk(ts[0].scalar_type(), base, slot_bytes, world, rank, m, op, scale);
    barrier_impl(h, world, rank, timeout_s);
    copy_span(ts, off, m, base + kHeaderBytes + world * slot_bytes, false);
  }
}

// out (world * t.numel() elements, t's dtype): every rank's t in rank order. Any dtype (bytes are copied).
void all_gather(torch::Tensor segment, torch::Tensor t, torch::Tensor out, int64_t world, int64_t rank,
                int64_t slot_bytes, double timeout_s) {
  TORCH_CHECK(t.device().is_cpu() && out.device().is_cpu() && t.is_contiguous() && out.is_contiguous() &&
              out.scalar_type() == t.scalar_type() && out.numel() == world * t.numel(),
              "shared-memory all-gather: contiguous CPU tensors, out of world x numel elements");
  py::gil_scoped_release nogil;
  char* base = reinterpret_cast<char*>(segment.data_ptr());
  Header* h = reinterpret_cast<Header*>(base);
  const int64_t bytes = t.numel() * t.element_size();
  const char* src = reinterpret_cast<const char*>(t.data_ptr());
  char* dst = reinterpret_cast<char*>(out.data_ptr());
  for (int64_t off = 0; off < bytes; off += slot_bytes) {
    const int64_t m = std::min(slot_bytes, bytes - off);
    std::memcpy(base + kHeaderBytes + rank * slot_bytes, src + off, m);
    barrier_impl(h, world, rank, timeout_s);
    for (int k = 0; k < world; ++k) std::memcpy(dst + k * bytes + off, base + kHeaderBytes + k * slot_bytes, m);
    barrier_impl(h, world, rank, timeout_s);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supports", &supports);
  m.def("all_reduce", &all_reduce);
  m.def("all_gather", &all_gather);
  m.attr("max_ranks") = kMaxRanks;
}
