// The host value of a hyper-parameter that torch.optim lets be a number or a one-element tensor (Adam's tensor
// betas): what ampkit._C's param-group reader passes to the C++ core, which takes doubles.
#pragma once

#include <torch/extension.h>

namespace ampkit::python {

// `v` as a double. A tensor is read once and then again only when it is another tensor or has been written
// (its version counter moved): steps with unchanged tensor betas on a GPU make no host sync (the read is the
// sync); a value written in place is seen at the next step, at the cost of one read.
double hparam_value(const pybind11::handle& v);

}  // namespace ampkit::python
