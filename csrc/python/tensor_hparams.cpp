// Tensor hyper-parameters read on the host once per change (see tensor_hparams.h).
#include "tensor_hparams.h"

#include <c10/util/intrusive_ptr.h>

#include <mutex>
#include <unordered_map>

namespace ampkit::python {
namespace {

// The value read from a tensor, with the version it had then. The weak pointer keeps the TensorImpl's memory
// (not the tensor) alive, so its address names no other tensor while the entry exists.
struct CachedValue {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> impl;
  uint32_t version;
  double value;
};

std::mutex cache_mutex;
std::unordered_map<const c10::TensorImpl*, CachedValue> cache;

double tensor_value(const at::Tensor& t) {
  if (t.is_inference() || !t.defined()) {
    return t.item<double>();  // no version counter: read every time
  }
  const c10::TensorImpl* key = t.unsafeGetTensorImpl();
  const uint32_t version = t._version();
  const std::lock_guard<std::mutex> lock(cache_mutex);
  const auto it = cache.find(key);
  if (it != cache.end() && !it->second.impl.expired() && it->second.version == version) {
    return it->second.value;
  }
  const double value = t.item<double>();
  if (cache.size() >= 64) {  // drop the entries of tensors that died
    for (auto e = cache.begin(); e != cache.end();) {
      e = e->second.impl.expired() ? cache.erase(e) : std::next(e);
    }
  }
  cache.insert_or_assign(
      key, CachedValue{c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(t.getIntrusivePtr()), version,
                       value});
  return value;
}

}  // namespace

double hparam_value(const pybind11::handle& v) {
  if (THPVariable_Check(v.ptr())) {
    return tensor_value(THPVariable_Unpack(v.ptr()));
  }
  return v.cast<double>();
}

}  // namespace ampkit::python
