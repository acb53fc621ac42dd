// Includes LibTorch, ampkit and Catch2 in the one order that works: c10's logging defines a CHECK macro of its
// own, and in the tests Catch2's CHECK must be the one in effect.
#pragma once

#include <torch/torch.h>

#include <ampkit/ampkit.h>

#undef CHECK
#include <catch2/catch.hpp>
