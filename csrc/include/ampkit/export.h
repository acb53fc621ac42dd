// Symbol visibility of libampkit's public API.
#pragma once

#if defined(_WIN32)
#define AMPKIT_API __declspec(dllexport)
#else
#define AMPKIT_API __attribute__((visibility("default")))
#endif
