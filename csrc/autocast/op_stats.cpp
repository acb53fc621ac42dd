// OpStatsGuard: per-op, per-dtype call counts on this thread, from a thread-local RecordFunction callback.
#include <ATen/record_function.h>

#include <memory>
#include <string_view>

#include "ampkit/autocast.h"

namespace ampkit {
namespace {

struct Stats {
  std::map<std::pair<std::string, std::string>, int64_t> counts;
  int depth = 0;           // nesting of ops: only the outermost is counted
  int backward_depth = 0;  // nesting of autograd backward nodes
  bool include_backward = false;
};
thread_local Stats* t_stats = nullptr;

std::string floating_dtype(const at::Tensor& t) {
  return t.defined() && t.is_floating_point() ? std::string(c10::toString(t.scalar_type())) : std::string();
}

// The dtype of the first floating tensor among the values, tensor lists (split, chunk, unbind) included.
std::string dtype_of(c10::ArrayRef<c10::IValue> values) {
  for (const auto& v : values) {
    if (v.isTensor()) {
      if (auto d = floating_dtype(v.toTensor()); !d.empty()) {
        return d;
      }
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) {
        if (auto d = floating_dtype(t); !d.empty()) {
          return d;
        }
      }
    } else if (v.isList()) {  // Tensor?[] (index, ...)
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) {
          if (auto d = floating_dtype(e.toTensor()); !d.empty()) {
            return d;
          }
        }
      }
    }
  }
  return "";
}

// NOTE [Inputs at the start]
// RecordFunction's inputs are valid in the start callback only (the end callback may find them moved from or
// freed: an op with tensor inputs and no floating output, `torch.arange(8) + 0`, read them there and crashed).
// The outermost op's input dtype is therefore read at its start and carried to its end in an ObserverContext.
struct InputDtype : at::ObserverContext {
  std::string dtype;
};

// Autograd's backward nodes, and the engine's records around them ("autograd::engine::evaluate_function: ...",
// FUNCTION scope): not ops themselves; the ops they run are the backward's.
bool is_backward_record(const at::RecordFunction& fn) {
  static constexpr std::string_view kEngine = "autograd::engine::evaluate_function";
  return fn.scope() == at::RecordScope::BACKWARD_FUNCTION || std::string_view(fn.name()).starts_with(kEngine);
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (t_stats == nullptr) {
    return nullptr;
  }
  if (is_backward_record(fn)) {
    ++t_stats->backward_depth;
    return nullptr;
  }
  if (++t_stats->depth != 1) {
    return nullptr;
  }
  auto ctx = std::make_unique<InputDtype>();
  ctx->dtype = dtype_of(fn.inputs());
  return ctx;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (t_stats == nullptr) {
    return;
  }
  if (is_backward_record(fn)) {
    --t_stats->backward_depth;
    return;
  }
  if (--t_stats->depth != 0) {
    return;  // an internal call of an outer op
  }
  if (t_stats->backward_depth > 0 && !t_stats->include_backward) {
    return;
  }
  std::string dtype = dtype_of(fn.outputs());
  if (dtype.empty() && ctx != nullptr) {
    dtype = static_cast<InputDtype*>(ctx)->dtype;
  }
  t_stats->counts[{fn.name(), dtype.empty() ? "other" : dtype}] += 1;
}

}  // namespace

OpStatsGuard::OpStatsGuard(bool include_backward) : stats_(new Stats()) {
  TORCH_CHECK(t_stats == nullptr, "ampkit::OpStatsGuard: one collection per thread at a time");
  t_stats = static_cast<Stats*>(stats_);
  t_stats->include_backward = include_backward;
  handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&on_start, &on_end)
                                           .needsInputs(true)
                                           .needsOutputs(true)
                                           .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
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
