// OpStatsGuard: per-op, per-dtype call counts on this thread, from a thread-local RecordFunction callback.
#include <ATen/record_function.h>

#include <memory>

#include "ampkit/autocast.h"

namespace ampkit {
namespace {

struct Stats {
  std::map<std::pair<std::string, std::string>, int64_t> counts;
  int depth = 0;
};
thread_local Stats* t_stats = nullptr;

std::string dtype_of(c10::ArrayRef<c10::IValue> values) {
  for (const auto& v : values) {
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_floating_point()) {
      return c10::toString(v.toTensor().scalar_type());
    }
  }
  return "";
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction&) {
  if (t_stats != nullptr) {
    ++t_stats->depth;
  }
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (t_stats == nullptr) {
    return;
  }
  if (--t_stats->depth != 0) {
    return;  // an internal call of an outer op
  }
  std::string dtype = dtype_of(fn.outputs());
  if (dtype.empty()) {
    dtype = dtype_of(fn.inputs());
  }
  t_stats->counts[{fn.name(), dtype.empty() ? "other" : dtype}] += 1;
}

}  // namespace

OpStatsGuard::OpStatsGuard() : stats_(new Stats()) {
  TORCH_CHECK(t_stats == nullptr, "ampkit::OpStatsGuard: one collection per thread at a time");
  t_stats = static_cast<Stats*>(stats_);
  handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&on_start, &on_end)
                                           .needsInputs(true)
                                           .needsOutputs(true)
                                           .scopes({at::RecordScope::FUNCTION}));
}

OpStatsGuard::~OpStatsGuard() {
  at::removeCallback(handle_);
  t_stats = nullptr;
  delete static_cast<Stats*>(stats_);
}

std::map<std::pair<std::string, std::string>, int64_t> OpStatsGuard::counts() const {
  return static_cast<Stats*>(stats_)->counts;
}

}  // namespace ampkit
