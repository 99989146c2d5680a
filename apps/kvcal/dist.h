// The CLI's MPI layer: the calibration commands (profile-heads,
// calibrate-entropy, and mask-gen's candidate seeds) split their work items
// over the ranks of `mpirun` or `srun`, gather the partial results at rank 0
// in a fixed order, and rank 0 reduces them as the single process does, so
// the output's datasets are the same bytes for every rank count. This is the only code that knows MPI; the
// build without MPI (dist_serial.cpp) is one rank, and so is a binary with MPI
// started without a launcher. Commands have one code path either way.
//
// Faults: each phase of a command runs through Context::step on every rank.
// A rank whose phase throws tells every other rank to stop (they poll between
// work items), then all ranks agree at the end of the phase: rank 0 throws
// one line "rank R: <the failing rank's message>" (the lowest failing rank,
// through the error reporter), then every rank throws dist::Failed and exits
// non-zero. With one rank the error propagates unchanged. Only rank 0 writes, after every
// rank's work is in, so a rank killed mid-run (mpirun then ends the job)
// never leaves a partial file: rank 0 removes a temporary file it is writing
// when it is terminated (SIGTERM, SIGINT, SIGHUP).
#pragma once

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "kvcal/core/error.h"

namespace kvcal::cli::dist {

// True when the binary has MPI and was started by an MPI launcher (Open MPI's
// mpirun, srun --mpi=pmix, or another PMI launcher): the calibration commands
// then run in the process the launcher started, not in a child process (a rank
// must be the process mpirun watches and signals).
bool launched();
// "MPI (Open MPI 4.1.x)" or "no MPI", for --version.
std::string describe();

// Thrown on every rank once a phase failed and rank 0 has reported it: the
// process exits with `status` and prints nothing more.
struct Failed : std::exception {
  explicit Failed(int s) : status(s) {}
  const char* what() const noexcept override { return "failed (reported by rank 0)"; }
  int status;
};

// How rank 0 reports a failure (one line on stderr; returns the exit status).
// The CLI sets it to its usual error report. Rank 0 reports before any rank
// exits: mpirun ends the job at the first non-zero exit, and a line not yet
// written then would be lost.
using ErrorReporter = std::function<int(std::exception_ptr)>;
void set_error_reporter(ErrorReporter reporter);

class Context {
 public:
  Context();   // MPI_Init_thread when launched(), else one rank
  ~Context();  // MPI_Finalize
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  bool root() const { return rank_ == 0; }

  // Runs one phase on every rank (collective). See the header comment.
  void step(const std::function<void()>& phase);
  // Between work items: throws (ending the phase quietly) when another rank
  // has failed. Cheap (one MPI_Iprobe).
  void poll();
  // Rank i's `mine` at index i on rank 0, nothing elsewhere (collective).
  std::vector<std::string> gather(const std::string& mine);
  // Rank 0's `bytes` on every rank (collective; other ranks' argument is
  // ignored).
  std::string broadcast(const std::string& bytes);

 private:
  // Rank 0 reports `root_error`, then every rank leaves together.
  [[noreturn]] void fail_all(std::exception_ptr root_error);
  int rank_ = 0, size_ = 1;
  bool mpi_ = false;
  std::vector<bool> stop_from_;  // a stop message from rank r was received
};

// [begin, end) item ranges for `parts` ranks: contiguous, in order, balanced
// by weight (each item goes to the part holding the midpoint of its weight),
// so a rank reads neighbouring items (whole samples, whole files) when it can
// and splits one sample's layers when samples are fewer than ranks. Returns
// parts + 1 boundaries.
std::vector<std::size_t> split_by_weight(const std::vector<std::int64_t>& weights, int parts);

// Byte packing of the partial results sent to rank 0 (same binary on every
// rank, so plain bytes; the reader still checks every length).
class Packer {
 public:
  template <typename T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    bytes_.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  template <typename T>
  void put_vector(const std::vector<T>& v) {
    put<std::uint64_t>(v.size());
    if (!v.empty()) bytes_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  void put_string(const std::string& s) {
    put<std::uint64_t>(s.size());
    bytes_ += s;
  }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

class Unpacker {
 public:
  explicit Unpacker(const std::string& bytes) : bytes_(bytes) {}
  template <typename T>
  T get() {
    T v;
    take(&v, sizeof v);
    return v;
  }
  template <typename T>
  std::vector<T> get_vector() {
    const auto n = get<std::uint64_t>();
    KVCAL_CHECK(n <= (bytes_.size() - pos_) / sizeof(T), "MPI message truncated");
    std::vector<T> v(n);
    if (n > 0) take(v.data(), n * sizeof(T));
    return v;
  }
  std::string get_string() {
    const auto n = get<std::uint64_t>();
    KVCAL_CHECK(n <= bytes_.size() - pos_, "MPI message truncated");
    std::string s = bytes_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  bool done() const { return pos_ == bytes_.size(); }

 private:
  void take(void* out, std::size_t n) {
    KVCAL_CHECK(n <= bytes_.size() - pos_, "MPI message truncated");
    std::memcpy(out, bytes_.data() + pos_, n);
    pos_ += n;
  }
  const std::string& bytes_;
  std::size_t pos_ = 0;
};

}  // namespace kvcal::cli::dist
