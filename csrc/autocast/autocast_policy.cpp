// Per-scope autocast overrides and autocast for custom ops, on the Autocast dispatch keys.
//
// NOTE [Autocast override kernels]
// For each op overload that is overridden (AutocastGuard / ampkit.autocast) or given a policy
// (register_autocast), one boxed kernel is registered on AutocastCPU / AutocastCUDA, once per process, and kept:
// dispatcher registration is global, the scope lives in a thread-local policy stack. Before registering, the
// kernel ATen had there is captured (OperatorHandle::getComputedKernelForDispatchKey). At run time the kernel
// looks the op up in this thread's scopes, innermost first, then in the registered policies; with a policy it
// casts the floating inputs on that device (at::autocast::cached_cast, so weights hit the cast cache) and calls
// the op again with the autocast key excluded, as ATen's own autocast kernels do; without one it calls the
// captured ATen kernel, or falls through below the autocast key when there was none: outside an override, the op
// behaves exactly as under torch.autocast.
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "ampkit/autocast.h"

namespace ampkit {
namespace {

struct Installed {
  std::optional<c10::SafeKernelFunction> original;  // ATen's kernel at this key, if it had one
  std::optional<AutocastPolicy> policy;             // set by register_autocast
  const char* lowp_input_warning = nullptr;         // said once when the first input is FP16/BF16
};

struct Registry {
  std::shared_mutex mutex;
  std::unordered_map<std::string, Installed> installed;    // "ns::name.overload|key"
  std::vector<std::unique_ptr<torch::Library>> libraries;  // kept alive: the registrations stay
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: kernels may run during static destruction
  return *r;
}

struct Scope {
  c10::DeviceType device;
  std::unordered_map<std::string, AutocastPolicy> policies;  // "ns::name" -> policy
};
thread_local std::vector<Scope> t_scopes;

c10::DispatchKey autocast_key(c10::DeviceType device) {
  switch (device) {
    case c10::DeviceType::CPU:
      return c10::DispatchKey::AutocastCPU;
    case c10::DeviceType::CUDA:
      return c10::DispatchKey::AutocastCUDA;
    default:
      TORCH_CHECK_VALUE(false, "ampkit autocast overrides: device must be cpu or cuda, but got ", device);
  }
}

std::string qualified(const std::string& op) { return op.find("::") == std::string::npos ? "aten::" + op : op; }

std::string entry_key(const c10::OperatorName& name, c10::DispatchKey key) {
  return name.name + "." + name.overload_name + "|" + c10::toString(key);
}

std::vector<c10::OperatorHandle> overloads_of(const std::string& name) {
  std::vector<c10::OperatorHandle> ops;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& op_name : dispatcher.getAllOpNames()) {
    if (op_name.name == name) {
      if (auto handle = dispatcher.findOp(op_name)) {
        ops.push_back(*handle);
      }
    }
  }
  TORCH_CHECK_VALUE(!ops.empty(), "ampkit autocast: no operator named '", name,
                    "' is registered (names look like 'softmax', 'aten::linear' or 'myns::myop')");
  return ops;
}

// Drops the dispatcher's "overriding a previously registered kernel" warning: overriding is the point.
struct SilentWarnings : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

std::optional<AutocastPolicy> thread_policy(const std::string& name, c10::DeviceType device) {
  for (auto it = t_scopes.rbegin(); it != t_scopes.rend(); ++it) {
    if (it->device == device) {
      const auto found = it->policies.find(name);
      if (found != it->policies.end()) {
        return found->second;
      }
    }
  }
  return std::nullopt;
}

at::Tensor cast_to(const at::Tensor& t, at::ScalarType to, c10::DeviceType device) {
  return at::autocast::cached_cast(to, t, device);
}

template <typename F>
void for_each_tensor_arg(torch::jit::Stack* stack, size_t num_args, const F& f) {
  for (size_t i = stack->size() - num_args; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isTensor()) {
      f(v.toTensor(), [&](at::Tensor t) { v = std::move(t); });
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        f(list.get(j), [&](at::Tensor t) { list.set(j, std::move(t)); });
      }
    }
  }
}

// The low-precision probabilities of binary_cross_entropy are said once per process, in whichever form they come
// first (FP16/BF16 under CPU autocast, or a low-precision sigmoid cast back: NOTE [Low-precision probabilities
// cast back]): true for the first caller only.
bool first_lowp_probability_warning() {
  static std::atomic<bool> said{false};
  return !said.exchange(true);
}

// One instantiation per autocast key: the key a kernel serves is fixed at registration, never read from the
// call's key set (under torch.compile's tracing the set's highest key is not the autocast key).
template <c10::DispatchKey key>
void autocast_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const c10::DeviceType device = key == c10::DispatchKey::AutocastCUDA ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  const c10::OperatorName& name = op.operator_name();
  std::optional<AutocastPolicy> policy = thread_policy(name.name, device);
  const Installed* installed = nullptr;
  {
    std::shared_lock lock(registry().mutex);
    const auto it = registry().installed.find(entry_key(name, key));
    TORCH_INTERNAL_ASSERT(it != registry().installed.end(), "ampkit autocast kernel without a registry entry");
    installed = &it->second;  // entries are never erased
    if (!policy) {
      policy = installed->policy;
    }
  }
  const size_t num_args = op.schema().arguments().size();
  if (installed->lowp_input_warning != nullptr && num_args > 0) {
    const c10::IValue& first = (*stack)[stack->size() - num_args];
    if (first.isTensor() &&
        (first.toTensor().scalar_type() == at::kHalf || first.toTensor().scalar_type() == at::kBFloat16) &&
        first_lowp_probability_warning()) {
      TORCH_WARN(installed->lowp_input_warning);
    }
  }
  if (!policy) {
    if (installed->original) {
      installed->original->callBoxed(op, ks, stack);
    } else {
      op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, key), stack);
    }
    return;
  }
  at::ScalarType to = *policy == AutocastPolicy::kFp32 ? at::kFloat : at::autocast::get_autocast_dtype(device);
  if (*policy == AutocastPolicy::kPromote) {
    for_each_tensor_arg(stack, num_args, [&](const at::Tensor& t, const auto&) {
      if (at::autocast::is_eligible(t, device)) {
        to = at::promoteTypes(to, t.scalar_type());
      }
    });
  }
  for_each_tensor_arg(stack, num_args, [&](const at::Tensor& t, const auto& replace) {
    if (at::autocast::is_eligible(t, device) && t.scalar_type() != to) {
      replace(cast_to(t, to, device));
    }
  });
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  op.callBoxed(stack);
}

// Registers autocast_kernel for every overload of `name` at `key` (once), capturing ATen's kernel first.
void install(const std::string& name, c10::DispatchKey key, const char* lowp_input_warning = nullptr) {
  const auto ops = overloads_of(name);
  std::unique_lock lock(registry().mutex);
  for (const auto& op : ops) {
    const std::string k = entry_key(op.operator_name(), key);
    if (registry().installed.count(k) != 0) {
      continue;
    }
    Installed entry;
    entry.lowp_input_warning = lowp_input_warning;
    if (op.hasKernelForDispatchKey(key)) {
      entry.original = op.getComputedKernelForDispatchKey(key);
    }
    const auto& op_name = op.operator_name();
    const std::string ns = op_name.name.substr(0, op_name.name.find("::"));
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, key, __FILE__, __LINE__);
    SilentWarnings silent;
    const c10::WarningUtils::WarningHandlerGuard quiet(&silent);
    const std::string overload =
        op_name.overload_name.empty() ? op_name.name : op_name.name + "." + op_name.overload_name;
    lib->impl(overload.c_str(),
              key == c10::DispatchKey::AutocastCUDA
                  ? torch::CppFunction::makeFromBoxedFunction<&autocast_kernel<c10::DispatchKey::AutocastCUDA>>()
                  : torch::CppFunction::makeFromBoxedFunction<&autocast_kernel<c10::DispatchKey::AutocastCPU>>());
    registry().libraries.push_back(std::move(lib));
    registry().installed.emplace(k, std::move(entry));
  }
}

// NOTE [Low-precision binary_cross_entropy]
// binary_cross_entropy takes probabilities, typically a sigmoid's output. Computed in FP16/BF16 they saturate: a
// probability within half an ulp of 1 is 1, and log(1 - p) is -inf (-100 after ATen's clamp), so the loss and
// its grads overflow or are wrong; a GAN's discriminator loss skips step after step under FP16. torch refuses the
// op under CUDA autocast; under CPU autocast it casts the inputs to FP32 and runs without a word. When libampkit
// loads, ampkit's kernel takes AutocastCPU's place for it (ATen's kernel captured): it warns once per process when
// the probabilities arrive in FP16/BF16, then runs ATen's kernel, so the result is torch's.
const bool kLowpBceWatched = [] {
  try {
    install("aten::binary_cross_entropy", c10::DispatchKey::AutocastCPU,
            "binary_cross_entropy under CPU autocast got FP16/BF16 probabilities; computed in low precision they "
            "saturate (log(1 - p) of a p rounded to 1), so the loss overflows or is wrong. Pass the logits to "
            "binary_cross_entropy_with_logits (nn.BCEWithLogitsLoss) instead; torch refuses binary_cross_entropy "
            "under CUDA autocast for this reason");
  } catch (const std::exception&) {
    return false;  // an ATen without the op: nothing to watch
  }
  return true;
}();

// NOTE [Low-precision probabilities cast back]
// The O2 form of the same mistake passes no autocast key: an FP16/BF16 model's sigmoid, cast to FP32 with .float()
// before binary_cross_entropy (ampkit's O2 recipe computes the loss in FP32 that way). The cast cannot restore what
// the low-precision sigmoid rounded to 1, so the loss is as wrong as above (36.5 against 6.16 in FP32 on a
// discriminator's logits). The probabilities' autograd graph tells it without reading a value: behind the cast
// (ToCopyBackward0 nodes) sits a SigmoidBackward0 whose output (the node's input metadata) was FP16/BF16. A kernel
// on AutogradCPU/AutogradCUDA looks, warns once per process, then calls ATen's autograd kernel captured there; a
// tensor without a graph (no grad) is not looked at.
constexpr const char* kCastBackWarning =
    "binary_cross_entropy got probabilities from an FP16/BF16 sigmoid cast to FP32 afterwards (sigmoid in low "
    "precision, then .float()): the cast does not restore what the low-precision sigmoid rounded away (a p rounded "
    "to 1 makes log(1 - p) -inf, clamped to -100), so the loss and its grads are wrong. Pass the logits, cast to "
    "FP32, to binary_cross_entropy_with_logits (nn.BCEWithLogitsLoss) instead";

bool sigmoid_in_low_precision_behind_casts(const at::Tensor& p) {
  if (!p.defined() || !p.requires_grad()) {
    return false;
  }
  auto node = p.grad_fn();  // a shared_ptr or an intrusive_ptr, by torch version
  bool cast = false;
  while (node != nullptr && node->name() == "ToCopyBackward0" && node->num_outputs() == 1) {
    cast = true;
    node = node->next_edge(0).function;
  }
  if (!cast || node == nullptr || node->name() != "SigmoidBackward0" || node->num_inputs() != 1) {
    return false;
  }
  const at::ScalarType lowp = node->input_metadata(0).options().dtype().toScalarType();
  return lowp == at::kHalf || lowp == at::kBFloat16;
}

std::optional<c10::SafeKernelFunction>& bce_autograd_original(c10::DispatchKey key) {
  static std::optional<c10::SafeKernelFunction> cpu;
  static std::optional<c10::SafeKernelFunction> cuda;
  return key == c10::DispatchKey::AutogradCUDA ? cuda : cpu;
}

template <c10::DispatchKey key>
void bce_autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const size_t num_args = op.schema().arguments().size();
  const c10::IValue& self = (*stack)[stack->size() - num_args];
  if (self.isTensor() && sigmoid_in_low_precision_behind_casts(self.toTensor()) && first_lowp_probability_warning()) {
    TORCH_WARN(kCastBackWarning);
  }
  bce_autograd_original(key)->callBoxed(op, ks, stack);
}

const bool kCastBackBceWatched = [] {
  try {
    const auto handle = c10::Dispatcher::singleton().findSchema({"aten::binary_cross_entropy", ""});
    if (!handle.has_value()) {
      return false;
    }
    static auto* lib =
        new torch::Library(torch::Library::IMPL, "aten", std::nullopt, __FILE__, __LINE__);  // kept: the kernels stay
    SilentWarnings silent;
    const c10::WarningUtils::WarningHandlerGuard quiet(&silent);
    // ATen registers its autograd kernels on the Autograd alias key: the per-backend keys' computed kernels.
    for (const c10::DispatchKey key : {c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutogradCUDA}) {
      bce_autograd_original(key) = handle->getComputedKernelForDispatchKey(key);
      lib->impl(
          "binary_cross_entropy",
          key == c10::DispatchKey::AutogradCUDA
              ? torch::dispatch(
                    key,
                    torch::CppFunction::makeFromBoxedFunction<&bce_autograd_kernel<c10::DispatchKey::AutogradCUDA>>())
              : torch::dispatch(
                    key,
                    torch::CppFunction::makeFromBoxedFunction<&bce_autograd_kernel<c10::DispatchKey::AutogradCPU>>()));
    }
  } catch (const std::exception&) {
    return false;  // an ATen without the op or its autograd kernel: nothing to watch
  }
  return true;
}();

}  // namespace

void push_autocast_overrides(c10::DeviceType device, const AutocastOverrides& overrides) {
  const c10::DispatchKey key = autocast_key(device);
  for (const auto& op : overrides.fp32_ops) {
    for (const auto& other : overrides.lowp_ops) {
      TORCH_CHECK_VALUE(qualified(op) != qualified(other), "ampkit autocast overrides: '", op,
                        "' is in both fp32_ops and lowp_ops; an op can be forced to one precision only");
    }
  }
  Scope scope{device, {}};
  for (const auto& [ops, policy] : {std::pair{&overrides.fp32_ops, AutocastPolicy::kFp32},
                                    std::pair{&overrides.lowp_ops, AutocastPolicy::kLowerPrecision}}) {
    for (const auto& op : *ops) {
      const std::string name = qualified(op);
      install(name, key);
      scope.policies[name] = policy;
    }
  }
  t_scopes.push_back(std::move(scope));
}

void pop_autocast_overrides() {
  TORCH_INTERNAL_ASSERT(!t_scopes.empty(), "ampkit: unbalanced autocast override scopes");
  t_scopes.pop_back();
}

void register_autocast(const std::string& op, c10::DeviceType device, AutocastPolicy policy) {
  const c10::DispatchKey key = autocast_key(device);
  const std::string name = qualified(op);
  if (name.rfind("aten::", 0) == 0) {
    TORCH_WARN("ampkit::register_autocast: '", name,
               "' is an ATen op, so this changes plain torch.autocast for it "
               "in the whole process; to change it in one scope only, use the fp32_ops/lowp_ops overrides of "
               "AutocastGuard / ampkit.autocast");
  }
  install(name, key);
  std::unique_lock lock(registry().mutex);
  for (auto& [k, entry] : registry().installed) {
    if (k.rfind(name + ".", 0) == 0 && k.size() > name.size() &&
        k.compare(k.size() - std::strlen(c10::toString(key)), std::string::npos, c10::toString(key)) == 0) {
      entry.policy = policy;
    }
  }
}

}  // namespace ampkit
