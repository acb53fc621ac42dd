// ampkit's public C++ API: include this one header.
#pragma once

#include "ampkit/ops.h"
#include "ampkit/grad_scaler.h"
#include "ampkit/autocast.h"
#include "ampkit/optim.h"
#include "ampkit/optim_core.h"
#include "ampkit/lr_scheduler.h"
#include "ampkit/distributed.h"
#include "ampkit/monitor.h"
#include "ampkit/fp8.h"
