// The MPI layer of a build without MPI: one rank.
#include "dist.h"
#include "dist_common.h"

namespace kvcal::cli::dist {

bool launched() { return false; }
std::string describe() { return "no MPI"; }
void set_error_reporter(ErrorReporter) {}
void Context::fail_all(std::exception_ptr e) {
  if (e) std::rethrow_exception(e);
  throw Failed(1);
}

Context::Context() = default;
Context::~Context() = default;

void Context::step(const std::function<void()>& phase) { phase(); }
void Context::poll() {}
std::vector<std::string> Context::gather(const std::string& mine) { return {mine}; }
std::string Context::broadcast(const std::string& bytes) { return bytes; }

std::vector<std::size_t> split_by_weight(const std::vector<std::int64_t>& weights, int parts) {
  return detail::split(weights, parts);
}

}  // namespace kvcal::cli::dist
