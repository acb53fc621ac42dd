// Reading and writing LibTorch optimizer archives for ampkit::optim's LibTorch optimizers (optim.cpp): the options
// and states LibTorch's own optimizers write and read, plus ampkit's (NOTE [LibTorch archives]).
#pragma once

#include <torch/serialize/archive.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ampkit/optim.h"

namespace ampkit::optim::archive {

// NOTE [LibTorch archives]
// torch::optim::{Adam,AdamW,SGD} and these classes write torch::optim::serialize's layout, and each reads only the
// keys it knows. LibTorch writes a state's step as an int64 and has no maximize, master_weights,
// write_unscaled_grads or lr_tensor option. So that LibTorch reads ampkit's archives, ampkit writes steps as int64
// too (a tensor only for a value no int64 holds exactly, which no count of steps is). Reading, a step is an int
// (LibTorch's, and ampkit's) or a one-element tensor (ampkit's archives before); a param group whose options have
// no master_weights (ampkit writes it always) is LibTorch's, and the options LibTorch lacks take this optimizer's
// defaults, as ampkit.optim's load_state_dict of a torch.optim state dict does; a parameter whose state has no
// master_param gets its master from the weight at its next step (init_master_params() after the load, while the
// weights are FP32, takes it from the FP32 weights). What LibTorch does not take from ampkit's archives: it
// ignores master_param, param_remainder and the options above (an O2 archive continues from the rounded
// weights), and its reader asserts on a state that has a master but no step (init_master_params() before the
// first step). SGD::save leaves out states that equal no state (see there).

// A bool option that archives from before it existed do not hold: left at its default when absent.
void read_optional_flag(torch::serialize::InputArchive& archive, const char* key, bool& value);
// A required option of `options` ("AdamOptions") in the archive, with a message that names the key.
c10::IValue read_required(torch::serialize::InputArchive& archive, const char* options, const char* key);
double read_double(torch::serialize::InputArchive& archive, const char* options, const char* key);
bool read_bool(torch::serialize::InputArchive& archive, const char* options, const char* key);
std::tuple<double, double> read_betas(torch::serialize::InputArchive& archive, const char* options);
// A state's step (NOTE [LibTorch archives]): an int64 (LibTorch's, ampkit's) becomes the one-element FP32 tensor
// ampkit keeps (on the CPU here; the load moves a fused parameter's to its device); a tensor is taken as it is.
at::Tensor read_step(torch::serialize::InputArchive& archive, const char* state);
// Writes a state's step as an int64 where it holds a count (every step does), else as the tensor; returns its
// value (nullopt: no step). Reads the step on the host: one sync per state, at save time only.
std::optional<double> write_step(torch::serialize::OutputArchive& archive, const at::Tensor& step);
// Which param groups of the archive LibTorch wrote (NOTE [LibTorch archives]): those whose options have no
// master_weights. Called after torch::optim::serialize has read the same archive, so its layout is known good.
std::vector<bool> groups_written_by_libtorch(torch::serialize::InputArchive& archive);
// Writes a master_weights option: a bool or none (as archives before remainder mode), or the mode's name.
void write_master_weights(torch::serialize::OutputArchive& archive, MasterWeights mw);
void read_master_weights(torch::serialize::InputArchive& archive, MasterWeights& mw);
// A state dtype option (exp_avg_dtype, momentum_dtype...): written as its ScalarType's number; absent (archives
// before it, LibTorch's) leaves the default.
void write_state_dtype(torch::serialize::OutputArchive& archive, const char* key, at::ScalarType dtype);
void read_state_dtype(torch::serialize::InputArchive& archive, const char* key, at::ScalarType& dtype);
void write_lr_tensor(torch::serialize::OutputArchive& archive, const at::Tensor& lr_tensor);
void read_lr_tensor(torch::serialize::InputArchive& archive, at::Tensor& lr_tensor);

}  // namespace ampkit::optim::archive
