// Includes LibTorch, ampkit and Catch2 in the one order that works: c10's logging defines a CHECK macro of its
// own, and in the tests Catch2's CHECK must be the one in effect. AMPKIT_REQUIRE_CUDA_DEVICE: the first line of
// every [cuda] test, failing it where no device exists, so that a run that could not test CUDA never passes.
#pragma once

#include <torch/torch.h>

#include <ampkit/ampkit.h>

#undef CHECK
#include <catch2/catch.hpp>

#define AMPKIT_REQUIRE_CUDA_DEVICE()                          \
  do {                                                        \
    if (!torch::cuda::is_available()) {                       \
      FAIL("no CUDA device: run this test where one exists"); \
    }                                                         \
  } while (0)
