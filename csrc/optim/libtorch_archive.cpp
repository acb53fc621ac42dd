// Reading and writing LibTorch optimizer archives (see libtorch_archive.h).
#include "libtorch_archive.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace ampkit::optim::archive {

// A bool option that archives from before it existed do not hold: left at its default when absent.
void read_optional_flag(torch::serialize::InputArchive& archive, const char* key, bool& value) {
  c10::IValue ivalue;
  if (archive.try_read(key, ivalue)) {
    TORCH_CHECK_VALUE(ivalue.isBool(), "ampkit::optim: option '", key, "' in the archive must be a bool, but it is a ",
                      ivalue.tagKind());
    value = ivalue.toBool();
  }
}

// A required option of `options` ("AdamOptions") in the archive, with a message that names the key.
c10::IValue read_required(torch::serialize::InputArchive& archive, const char* options, const char* key) {
  c10::IValue ivalue;
  TORCH_CHECK_VALUE(archive.try_read(key, ivalue), "ampkit::optim::", options,
                    "::serialize: the options in the "
                    "archive must hold '",
                    key, "', but they do not (an archive of another optimizer?)");
  return ivalue;
}

double read_double(torch::serialize::InputArchive& archive, const char* options, const char* key) {
  const c10::IValue ivalue = read_required(archive, options, key);
  TORCH_CHECK_VALUE(ivalue.isDouble(), "ampkit::optim::", options, "::serialize: option '", key,
                    "' in the archive must be a float, but got ", ivalue.tagKind());
  return ivalue.toDouble();
}

bool read_bool(torch::serialize::InputArchive& archive, const char* options, const char* key) {
  const c10::IValue ivalue = read_required(archive, options, key);
  TORCH_CHECK_VALUE(ivalue.isBool(), "ampkit::optim::", options, "::serialize: option '", key,
                    "' in the archive must be a bool, but got ", ivalue.tagKind());
  return ivalue.toBool();
}

std::tuple<double, double> read_betas(torch::serialize::InputArchive& archive, const char* options) {
  const c10::IValue ivalue = read_required(archive, options, "betas");
  const bool pair = ivalue.isTuple() && ivalue.toTupleRef().elements().size() == 2 &&
                    ivalue.toTupleRef().elements()[0].isDouble() && ivalue.toTupleRef().elements()[1].isDouble();
  TORCH_CHECK_VALUE(pair, "ampkit::optim::", options,
                    "::serialize: option 'betas' in the archive must be a tuple "
                    "of two floats, but got ",
                    ivalue.tagKind());
  return {ivalue.toTupleRef().elements()[0].toDouble(), ivalue.toTupleRef().elements()[1].toDouble()};
}

// A state's step (NOTE [LibTorch archives]): an int64 (LibTorch's, ampkit's) becomes the one-element FP32 tensor
// ampkit keeps (on the CPU here; the load moves a fused parameter's to its device); a tensor is taken as it is.
at::Tensor read_step(torch::serialize::InputArchive& archive, const char* state) {
  c10::IValue ivalue;
  if (!archive.try_read("step", ivalue)) {
    return {};
  }
  if (ivalue.isInt()) {
    TORCH_CHECK_VALUE(ivalue.toInt() >= 0, "ampkit::optim::", state,
                      "::serialize: 'step' in the archive must be "
                      ">= 0, but got ",
                      ivalue.toInt());
    return at::scalar_tensor(static_cast<double>(ivalue.toInt()), at::TensorOptions().dtype(at::kFloat));
  }
  TORCH_CHECK_VALUE(ivalue.isTensor(), "ampkit::optim::", state,
                    "::serialize: 'step' in the archive must be an "
                    "int (LibTorch's format) or a tensor (ampkit's), but got ",
                    ivalue.tagKind());
  return ivalue.toTensor();
}

// Writes a state's step as an int64 where it holds a count (every step does), else as the tensor; returns its
// value (nullopt: no step). Reads the step on the host: one sync per state, at save time only.
std::optional<double> write_step(torch::serialize::OutputArchive& archive, const at::Tensor& step) {
  if (!step.defined()) {
    return std::nullopt;
  }
  const double value = step.item<double>();
  if (value >= 0 && value == std::floor(value) && value <= 9007199254740992.0) {  // 2^53
    archive.write("step", c10::IValue(static_cast<int64_t>(value)));
  } else {
    archive.write("step", step);
  }
  return value;
}

// Which param groups of the archive LibTorch wrote (NOTE [LibTorch archives]): those whose options have no
// master_weights. Called after torch::optim::serialize has read the same archive, so its layout is known good.
std::vector<bool> groups_written_by_libtorch(torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive groups;
  archive.read("param_groups", groups);
  at::Tensor size;
  groups.read("param_groups/size", size);
  std::vector<bool> out;
  for (int64_t i = 0; i < size.item<int64_t>(); ++i) {
    torch::serialize::InputArchive group;
    groups.read("param_groups/" + std::to_string(i), group);
    torch::serialize::InputArchive options;
    group.read("options", options);
    c10::IValue ivalue;
    out.push_back(!options.try_read("master_weights", ivalue));
  }
  return out;
}

// Writes a master_weights option: a bool or none (as archives before remainder mode), or the mode's name.
void write_master_weights(torch::serialize::OutputArchive& archive, MasterWeights mw) {
  switch (mw.mode()) {
    case MasterWeights::kRemainder:
    case MasterWeights::kStochastic:
    case MasterWeights::kKahan:
      archive.write("master_weights", c10::IValue(std::string(mw.name())));
      break;
    case MasterWeights::kAuto:
      archive.write("master_weights", c10::IValue());
      break;
    default:
      archive.write("master_weights", c10::IValue(mw == MasterWeights::kOn));
  }
}

void read_master_weights(torch::serialize::InputArchive& archive, MasterWeights& mw) {
  c10::IValue ivalue;
  if (!archive.try_read("master_weights", ivalue)) {
    return;
  }
  if (ivalue.isNone()) {
    mw = MasterWeights::kAuto;
  } else if (ivalue.isBool()) {
    mw = MasterWeights(ivalue.toBool());
  } else {
    TORCH_CHECK_VALUE(ivalue.isString(),
                      "ampkit::optim: option 'master_weights' in the archive must be a bool, none "
                      "or a string, but it is a ",
                      ivalue.tagKind());
    mw = MasterWeights::from_name(ivalue.toStringRef());
  }
}

void write_state_dtype(torch::serialize::OutputArchive& archive, const char* key, at::ScalarType dtype) {
  archive.write(key, c10::IValue(static_cast<int64_t>(dtype)));
}

void read_state_dtype(torch::serialize::InputArchive& archive, const char* key, at::ScalarType& dtype) {
  c10::IValue ivalue;
  if (!archive.try_read(key, ivalue)) {
    return;
  }
  TORCH_CHECK_VALUE(ivalue.isInt(), "ampkit::optim: option '", key, "' in the archive must be an int (a ScalarType), ",
                    "but it is a ", ivalue.tagKind());
  const int64_t v = ivalue.toInt();
  TORCH_CHECK_VALUE(v == static_cast<int64_t>(at::kFloat) || v == static_cast<int64_t>(at::kBFloat16) ||
                        v == static_cast<int64_t>(at::kByte),
                    "ampkit::optim: option '", key, "' in the archive must be Float, BFloat16 or Byte, but it is ",
                    "ScalarType ", v);
  dtype = static_cast<at::ScalarType>(v);
}

void write_lr_tensor(torch::serialize::OutputArchive& archive, const at::Tensor& lr_tensor) {
  if (lr_tensor.defined()) {
    archive.write("lr_tensor", lr_tensor);
  }
}

void read_lr_tensor(torch::serialize::InputArchive& archive, at::Tensor& lr_tensor) {
  c10::IValue ivalue;
  if (archive.try_read("lr_tensor", ivalue)) {
    TORCH_CHECK_VALUE(ivalue.isTensor(),
                      "ampkit::optim: option 'lr_tensor' in the archive must be a tensor, but it is a ",
                      ivalue.tagKind());
    lr_tensor = ivalue.toTensor();
  }
}

}  // namespace ampkit::optim::archive
