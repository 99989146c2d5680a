// The MPI layer with MPI (see dist.h). MPI is called from the main thread
// only (MPI_THREAD_FUNNELED); the library's reader and OpenMP threads never
// touch it.
#include <mpi.h>
#include <unistd.h>

#include <climits>
#include <csignal>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "dist.h"
#include "dist_common.h"
#include "kvcal/core/log.h"
#include "kvcal/io/temp_files.h"

namespace kvcal::cli::dist {
namespace {

constexpr int kStopTag = 7101;   // "a rank failed: stop" (one int, to every other rank)
constexpr int kErrorTag = 7102;  // the first failing rank's message, to rank 0

// Thrown by poll() on a rank told to stop; ends the phase without an error of
// its own.
struct Stopped {};

// The temporary file rank 0 may be writing, removed if the launcher
// terminates the job (async-signal-safe: a fixed buffer and unlink).
char g_temp_path[4096];

extern "C" void remove_temp_and_die(int sig) {
  if (g_temp_path[0] != '\0') unlink(g_temp_path);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

ErrorReporter& reporter() {
  static ErrorReporter r;
  return r;
}

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0';
}

}  // namespace

void set_error_reporter(ErrorReporter r) { reporter() = std::move(r); }

void Context::fail_all(std::exception_ptr root_error) {
  int status = 1;
  if (rank_ == 0) {
    status = reporter() ? reporter()(root_error) : 1;
    std::fflush(stdout);
    std::fflush(stderr);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  throw Failed(status);
}

bool launched() {
  // Open MPI's mpirun, PMIx launchers (srun --mpi=pmix, prun), PMI-1/2
  // launchers (srun --mpi=pmi2, Hydra).
  return env_set("OMPI_COMM_WORLD_SIZE") || env_set("PMIX_RANK") || env_set("PMI_RANK") || env_set("PMI_SIZE");
}

std::string describe() {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(version, &len);
  std::string v(version, static_cast<std::size_t>(std::max(len, 0)));
  v = v.substr(0, v.find_first_of(",\n"));
  return "MPI (" + v + ")";
}

Context::Context() {
  if (!launched()) return;
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  mpi_ = true;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  stop_from_.assign(static_cast<std::size_t>(size_), false);
  if (rank_ == 0) {
    set_temp_file_observer([](const std::string& path) {
      const std::size_t n = std::min(path.size(), sizeof g_temp_path - 1);
      std::memcpy(g_temp_path, path.data(), n);
      g_temp_path[n] = '\0';
    });
    for (int sig : {SIGTERM, SIGINT, SIGHUP}) std::signal(sig, remove_temp_and_die);
  } else {
    // Progress and the summary come from rank 0; the others report their
    // timings to it (gathered) and their errors through step().
    set_log_callback(nullptr);
  }
}

Context::~Context() {
  if (mpi_) MPI_Finalize();
}

void Context::poll() {
  if (!mpi_ || size_ == 1) return;
  int flag = 0;
  MPI_Status status;
  MPI_Iprobe(MPI_ANY_SOURCE, kStopTag, MPI_COMM_WORLD, &flag, &status);
  if (!flag) return;
  int dummy = 0;
  MPI_Recv(&dummy, 1, MPI_INT, status.MPI_SOURCE, kStopTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  stop_from_[static_cast<std::size_t>(status.MPI_SOURCE)] = true;
  throw Stopped{};
}

void Context::step(const std::function<void()>& phase) {
  if (!mpi_) {
    phase();
    return;
  }
  std::string error;
  std::exception_ptr own;
  std::vector<MPI_Request> stops;
  int one = 1;
  try {
    phase();
  } catch (const Stopped&) {
  } catch (...) {
    own = std::current_exception();
    error = detail::describe_current_exception();
    // Tell every other rank to stop at its next work item (`one` and the
    // requests live until the MPI_Waitall below).
    stops.reserve(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      stops.emplace_back();
      MPI_Isend(&one, 1, MPI_INT, r, kStopTag, MPI_COMM_WORLD, &stops.back());
    }
  }
  // Agreement: who failed.
  const int failed = own ? 1 : 0;
  std::vector<int> flags(static_cast<std::size_t>(size_));
  MPI_Allgather(&failed, 1, MPI_INT, flags.data(), 1, MPI_INT, MPI_COMM_WORLD);
  // Every failed rank sent one stop message to each other rank: receive those
  // not received yet, so none is left over for the next phase.
  for (int r = 0; r < size_; ++r) {
    if (flags[r] && r != rank_ && !stop_from_[r]) {
      int dummy = 0;
      MPI_Recv(&dummy, 1, MPI_INT, r, kStopTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
  }
  std::fill(stop_from_.begin(), stop_from_.end(), false);
  if (!stops.empty()) MPI_Waitall(static_cast<int>(stops.size()), stops.data(), MPI_STATUSES_IGNORE);
  int first = -1;
  for (int r = 0; r < size_ && first < 0; ++r) {
    if (flags[r]) first = r;
  }
  if (first < 0) return;
  if (size_ == 1) std::rethrow_exception(own);
  const std::string prefix = fmt::format("rank {}: ", first);
  if (first != 0) {
    if (rank_ == first) {
      const int n = static_cast<int>(std::min<std::size_t>(error.size(), 1 << 16));
      MPI_Send(error.data(), n, MPI_CHAR, 0, kErrorTag, MPI_COMM_WORLD);
    } else if (rank_ == 0) {
      MPI_Status status;
      MPI_Probe(first, kErrorTag, MPI_COMM_WORLD, &status);
      int n = 0;
      MPI_Get_count(&status, MPI_CHAR, &n);
      error.assign(static_cast<std::size_t>(n), '\0');
      MPI_Recv(error.data(), n, MPI_CHAR, first, kErrorTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      fail_all(std::make_exception_ptr(Error(prefix + error)));
    }
    fail_all(nullptr);
  }
  if (rank_ != 0) fail_all(nullptr);
  try {
    std::rethrow_exception(own);
  } catch (const UsageError& e) {
    fail_all(std::make_exception_ptr(UsageError(prefix + e.what())));
  } catch (...) {
    fail_all(std::make_exception_ptr(Error(prefix + error)));
  }
}

std::vector<std::string> Context::gather(const std::string& mine) {
  if (!mpi_) return {mine};
  const auto n = static_cast<long long>(mine.size());
  std::vector<long long> sizes(static_cast<std::size_t>(size_));
  MPI_Allgather(&n, 1, MPI_LONG_LONG, sizes.data(), 1, MPI_LONG_LONG, MPI_COMM_WORLD);
  long long total = 0;
  for (long long s : sizes) total += s;
  if (total > INT_MAX) {
    fail_all(std::make_exception_ptr(
        Error(fmt::format("the partial results of {} ranks add up to {} bytes, more than one MPI message holds "
                          "(2 GiB)",
                          size_, total))));
  }
  std::vector<int> counts(sizes.begin(), sizes.end()), displs(static_cast<std::size_t>(size_), 0);
  for (int r = 1; r < size_; ++r) displs[r] = displs[r - 1] + counts[r - 1];
  std::string all(rank_ == 0 ? static_cast<std::size_t>(total) : 0, '\0');
  MPI_Gatherv(mine.data(), static_cast<int>(n), MPI_CHAR, all.data(), counts.data(), displs.data(), MPI_CHAR, 0,
              MPI_COMM_WORLD);
  std::vector<std::string> out;
  if (rank_ == 0) {
    for (int r = 0; r < size_; ++r) out.push_back(all.substr(displs[r], counts[r]));
  }
  return out;
}

std::string Context::broadcast(const std::string& bytes) {
  if (!mpi_) return bytes;
  long long n = rank_ == 0 ? static_cast<long long>(bytes.size()) : 0;
  MPI_Bcast(&n, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  if (n > INT_MAX) {
    fail_all(std::make_exception_ptr(
        Error(fmt::format("rank 0 has {} bytes to send to every rank, more than one MPI message holds (2 GiB)", n))));
  }
  std::string out = rank_ == 0 ? bytes : std::string(static_cast<std::size_t>(n), '\0');
  MPI_Bcast(out.data(), static_cast<int>(n), MPI_CHAR, 0, MPI_COMM_WORLD);
  return out;
}

std::vector<std::size_t> split_by_weight(const std::vector<std::int64_t>& weights, int parts) {
  return detail::split(weights, parts);
}

}  // namespace kvcal::cli::dist
