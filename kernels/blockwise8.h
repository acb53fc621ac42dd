// 8-bit block-wise optimizer states (exp_avg_dtype / exp_avg_sq_dtype = torch.uint8), shared by the CPU loops and
// the CUDA kernels: the two dynamic quantization maps, the packed layout of a state and the quantizer.
#pragma once

#include "common.h"

namespace ampkit::kernels {

// NOTE [8-bit block-wise states]
// A moment kept in 8 bits (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022) is cut
// into blocks of kQuantBlock = 256 elements; each block keeps its FP32 absmax (clipped below at 1e-12) and one
// byte per element, the index of the nearest value of a 256-entry dynamic map (signed for the first moment and
// the momentum buffer, unsigned for the second moment) to element / absmax. The maps are bitsandbytes' dynamic
// maps without their zero padding, as torchao's 8-bit optimizers build them (create_dynamic_map: 7 exponent
// bits), rounded to FP32; the quantizer is torchao's quantize_8bit_with_qmap (a branchless binary search, then
// up where element / absmax - map[code] >= (map[code + 1] - map[code]) * 0.5, in FP32), so the bytes and
// absmaxes of a state equal torchao's scale_tensor + quantize_8bit_with_qmap of the same FP32 values
// (tests/python/test_optim_states.py checks them against torchao). A step dequantizes a block (map[code] *
// absmax), updates it in FP32 with the optimizer's formulas, updates the weight from those FP32 values and
// quantizes the block again with its new absmax: one pass over the state, inside the fused step. The state of a
// tensor of n elements is one uint8 tensor of blockwise8_bytes(n) bytes: the codes of ceil(n / 256) whole blocks
// (the last one's padding unused, kept 0), then the blocks' FP32 absmaxes, 4-byte aligned.
constexpr int kQuantBlock = 256;

AMPKIT_HOST_DEVICE constexpr int64_t blockwise8_blocks(int64_t numel) {
  return (numel + kQuantBlock - 1) / kQuantBlock;
}
AMPKIT_HOST_DEVICE constexpr int64_t blockwise8_bytes(int64_t numel) {
  return blockwise8_blocks(numel) * (kQuantBlock + 4);
}

// The maps' FP32 bit patterns, ascending (signed: index 127 is 0, 255 is 1; unsigned: 0 is 0, 255 is 1).
#define AMPKIT_QMAP_SIGNED_BITS                                                                                        \
  0xbf7e3333u, 0xbf7a999au, 0xbf770000u, 0xbf736666u, 0xbf6fcccdu, 0xbf6c3333u, 0xbf68999au, 0xbf650000u, 0xbf616666u, \
      0xbf5dcccdu, 0xbf5a3333u, 0xbf56999au, 0xbf530000u, 0xbf4f6666u, 0xbf4bcccdu, 0xbf483333u, 0xbf44999au,          \
      0xbf410000u, 0xbf3d6666u, 0xbf39cccdu, 0xbf363334u, 0xbf32999au, 0xbf2f0000u, 0xbf2b6666u, 0xbf27cccdu,          \
      0xbf243334u, 0xbf20999au, 0xbf1d0000u, 0xbf196666u, 0xbf15cccdu, 0xbf123334u, 0xbf0e999au, 0xbf0b0000u,          \
      0xbf076666u, 0xbf03ccccu, 0xbf003333u, 0xbef93332u, 0xbef20000u, 0xbeeaccccu, 0xbee3999au, 0xbedc6666u,          \
      0xbed53333u, 0xbece0000u, 0xbec6ccccu, 0xbebf999au, 0xbeb86666u, 0xbeb13333u, 0xbeaa0000u, 0xbea2ccccu,          \
      0xbe9b999au, 0xbe946666u, 0xbe8d3334u, 0xbe860000u, 0xbe7d9999u, 0xbe6f3333u, 0xbe60cccdu, 0xbe526666u,          \
      0xbe440000u, 0xbe35999au, 0xbe273333u, 0xbe18cccdu, 0xbe0a6666u, 0xbdf80000u, 0xbddb3334u, 0xbdc9eb85u,          \
      0xbdc428f7u, 0xbdbe6667u, 0xbdb8a3d7u, 0xbdb2e148u, 0xbdad1eb8u, 0xbda75c2au, 0xbda1999au, 0xbd9bd70au,          \
      0xbd96147bu, 0xbd9051ebu, 0xbd8a8f5du, 0xbd84cccdu, 0xbd7e147bu, 0xbd728f5du, 0xbd670a3du, 0xbd5b851fu,          \
      0xbd500000u, 0xbd447ae1u, 0xbd38f5c3u, 0xbd2d70a3u, 0xbd21eb85u, 0xbd166667u, 0xbd0ae148u, 0xbcfeb852u,          \
      0xbce7ae15u, 0xbcd0a3d7u, 0xbcb9999au, 0xbca28f5du, 0xbc8b851fu, 0xbc68f5c3u, 0xbc3ae148u, 0xbc1f3b64u,          \
      0xbc160418u, 0xbc0ccccdu, 0xbc039581u, 0xbbf4bc6au, 0xbbe24dd3u, 0xbbcfdf3bu, 0xbbbd70a4u, 0xbbab020du,          \
      0xbb989374u, 0xbb8624ddu, 0xbb676c8au, 0xbb428f5cu, 0xbb1db22du, 0xbaf1a9fcu, 0xbaa7ef9du, 0xba7765ffu,          \
      0xba59e83eu, 0xba3c6a80u, 0xba1eecc1u, 0xba016f01u, 0xb9c7e283u, 0xb98ce705u, 0xb923d70bu, 0xb8ba1f4bu,          \
      0xb88aefb3u, 0xb8378034u, 0xb7b24206u, 0xb70205ffu, 0xb65a1a94u, 0xb513a3b7u, 0x00000000u, 0x3513a3b7u,          \
      0x365a1a94u, 0x370205ffu, 0x37b24206u, 0x38378034u, 0x388aefb3u, 0x38ba1f4bu, 0x3923d70bu, 0x398ce705u,          \
      0x39c7e283u, 0x3a016f01u, 0x3a1eecc1u, 0x3a3c6a80u, 0x3a59e83eu, 0x3a7765ffu, 0x3aa7ef9du, 0x3af1a9fcu,          \
      0x3b1db22du, 0x3b428f5cu, 0x3b676c8au, 0x3b8624ddu, 0x3b989374u, 0x3bab020du, 0x3bbd70a4u, 0x3bcfdf3bu,          \
      0x3be24dd3u, 0x3bf4bc6au, 0x3c039581u, 0x3c0ccccdu, 0x3c160418u, 0x3c1f3b64u, 0x3c3ae148u, 0x3c68f5c3u,          \
      0x3c8b851fu, 0x3ca28f5du, 0x3cb9999au, 0x3cd0a3d7u, 0x3ce7ae15u, 0x3cfeb852u, 0x3d0ae148u, 0x3d166667u,          \
      0x3d21eb85u, 0x3d2d70a3u, 0x3d38f5c3u, 0x3d447ae1u, 0x3d500000u, 0x3d5b851fu, 0x3d670a3du, 0x3d728f5du,          \
      0x3d7e147bu, 0x3d84cccdu, 0x3d8a8f5du, 0x3d9051ebu, 0x3d96147bu, 0x3d9bd70au, 0x3da1999au, 0x3da75c2au,          \
      0x3dad1eb8u, 0x3db2e148u, 0x3db8a3d7u, 0x3dbe6667u, 0x3dc428f7u, 0x3dc9eb85u, 0x3ddb3334u, 0x3df80000u,          \
      0x3e0a6666u, 0x3e18cccdu, 0x3e273333u, 0x3e35999au, 0x3e440000u, 0x3e526666u, 0x3e60cccdu, 0x3e6f3333u,          \
      0x3e7d9999u, 0x3e860000u, 0x3e8d3334u, 0x3e946666u, 0x3e9b999au, 0x3ea2ccccu, 0x3eaa0000u, 0x3eb13333u,          \
      0x3eb86666u, 0x3ebf999au, 0x3ec6ccccu, 0x3ece0000u, 0x3ed53333u, 0x3edc6666u, 0x3ee3999au, 0x3eeaccccu,          \
      0x3ef20000u, 0x3ef93332u, 0x3f003333u, 0x3f03ccccu, 0x3f076666u, 0x3f0b0000u, 0x3f0e999au, 0x3f123334u,          \
      0x3f15cccdu, 0x3f196666u, 0x3f1d0000u, 0x3f20999au, 0x3f243334u, 0x3f27cccdu, 0x3f2b6666u, 0x3f2f0000u,          \
      0x3f32999au, 0x3f363334u, 0x3f39cccdu, 0x3f3d6666u, 0x3f410000u, 0x3f44999au, 0x3f483333u, 0x3f4bcccdu,          \
      0x3f4f6666u, 0x3f530000u, 0x3f56999au, 0x3f5a3333u, 0x3f5dcccdu, 0x3f616666u, 0x3f650000u, 0x3f68999au,          \
      0x3f6c3333u, 0x3f6fcccdu, 0x3f736666u, 0x3f770000u, 0x3f7a999au, 0x3f7e3333u, 0x3f800000u
#define AMPKIT_QMAP_UNSIGNED_BITS                                                                                      \
  0x00000000u, 0x34ae7baau, 0x35500998u, 0x360e9b38u, 0x3692ccf6u, 0x36de4c51u, 0x3714e5d5u, 0x3783126eu, 0x37e171a0u, \
      0x381fe868u, 0x384f1800u, 0x387e479au, 0x3896bb99u, 0x38ae5364u, 0x38c5eb31u, 0x3906594bu, 0x394154cau,          \
      0x397c5049u, 0x399ba5e4u, 0x39b923a2u, 0x39d6a163u, 0x39f41f22u, 0x3a08ce71u, 0x3a178d50u, 0x3a264c30u,          \
      0x3a350b10u, 0x3a43c9efu, 0x3a5288d0u, 0x3a6147afu, 0x3a70068eu, 0x3a7ec56eu, 0x3a958106u, 0x3aba5e35u,          \
      0x3adf3b64u, 0x3b020c4au, 0x3b147ae1u, 0x3b26e978u, 0x3b395810u, 0x3b4bc6a7u, 0x3b5e3540u, 0x3b70a3d7u,          \
      0x3b818937u, 0x3b8ac082u, 0x3b93f7cfu, 0x3b9d2f1au, 0x3ba66666u, 0x3baf9db2u, 0x3bb8d4fdu, 0x3bc20c4au,          \
      0x3bcb4395u, 0x3bd47ae1u, 0x3bddb22eu, 0x3be6e978u, 0x3bf020c5u, 0x3bf9580fu, 0x3c0147aeu, 0x3c05e354u,          \
      0x3c0a7ef9u, 0x3c0f1aa0u, 0x3c13b645u, 0x3c1851ebu, 0x3c1ced92u, 0x3c218937u, 0x3c2f5c2au, 0x3c466667u,          \
      0x3c5d70a3u, 0x3c747ae2u, 0x3c85c28fu, 0x3c9147afu, 0x3c9ccccdu, 0x3ca851ebu, 0x3cb3d70bu, 0x3cbf5c29u,          \
      0x3ccae147u, 0x3cd66667u, 0x3ce1eb87u, 0x3ced70a3u, 0x3cf8f5c3u, 0x3d023d70u, 0x3d080000u, 0x3d0dc28fu,          \
      0x3d13851fu, 0x3d1947afu, 0x3d1f0a3du, 0x3d24cccdu, 0x3d2a8f5cu, 0x3d3051ebu, 0x3d36147bu, 0x3d3bd70au,          \
      0x3d41999au, 0x3d475c28u, 0x3d4d1eb8u, 0x3d52e147u, 0x3d58a3d7u, 0x3d5e6667u, 0x3d6428f7u, 0x3d69eb87u,          \
      0x3d6fae15u, 0x3d7570a3u, 0x3d7b3333u, 0x3d807ae2u, 0x3d835c2au, 0x3d863d71u, 0x3d891eb8u, 0x3d8c0000u,          \
      0x3d8ee148u, 0x3d91c290u, 0x3d94a3d7u, 0x3d97851fu, 0x3d9a6667u, 0x3d9d47afu, 0x3da028f6u, 0x3da30a3eu,          \
      0x3da5eb85u, 0x3da8cccdu, 0x3dabae15u, 0x3dae8f5cu, 0x3db170a4u, 0x3db451ebu, 0x3db73333u, 0x3dba147bu,          \
      0x3dbcf5c3u, 0x3dbfd70bu, 0x3dc2b852u, 0x3dc5999au, 0x3dc87ae2u, 0x3dcb5c29u, 0x3dd40000u, 0x3de26666u,          \
      0x3df0cccdu, 0x3dff3333u, 0x3e06ccccu, 0x3e0e0000u, 0x3e153334u, 0x3e1c6666u, 0x3e23999au, 0x3e2accccu,          \
      0x3e320000u, 0x3e393334u, 0x3e406666u, 0x3e47999au, 0x3e4eccccu, 0x3e560000u, 0x3e5d3334u, 0x3e646666u,          \
      0x3e6b999au, 0x3e72ccccu, 0x3e7a0000u, 0x3e809999u, 0x3e843333u, 0x3e87cccdu, 0x3e8b6666u, 0x3e8f0000u,          \
      0x3e92999au, 0x3e963333u, 0x3e99ccccu, 0x3e9d6666u, 0x3ea10000u, 0x3ea4999au, 0x3ea83333u, 0x3eabccccu,          \
      0x3eaf6666u, 0x3eb30000u, 0x3eb6999au, 0x3eba3333u, 0x3ebdccccu, 0x3ec16666u, 0x3ec50000u, 0x3ec8999au,          \
      0x3ecc3333u, 0x3ecfccccu, 0x3ed36666u, 0x3ed70000u, 0x3eda999au, 0x3ede3333u, 0x3ee1ccccu, 0x3ee56666u,          \
      0x3ee90000u, 0x3eec999au, 0x3ef03333u, 0x3ef3ccccu, 0x3ef76666u, 0x3efb0000u, 0x3efe9999u, 0x3f01199au,          \
      0x3f02e666u, 0x3f04b333u, 0x3f068000u, 0x3f084cccu, 0x3f0a199au, 0x3f0be666u, 0x3f0db334u, 0x3f0f8000u,          \
      0x3f114ccdu, 0x3f13199au, 0x3f14e666u, 0x3f16b334u, 0x3f188000u, 0x3f1a4ccdu, 0x3f1c199au, 0x3f1de666u,          \
      0x3f1fb334u, 0x3f218000u, 0x3f234ccdu, 0x3f25199au, 0x3f26e666u, 0x3f28b334u, 0x3f2a8000u, 0x3f2c4ccdu,          \
      0x3f2e199au, 0x3f2fe666u, 0x3f31b334u, 0x3f338000u, 0x3f354ccdu, 0x3f37199au, 0x3f38e666u, 0x3f3ab334u,          \
      0x3f3c8000u, 0x3f3e4ccdu, 0x3f40199au, 0x3f41e666u, 0x3f43b334u, 0x3f458000u, 0x3f474cccu, 0x3f49199au,          \
      0x3f4ae666u, 0x3f4cb334u, 0x3f4e8000u, 0x3f504cccu, 0x3f52199au, 0x3f53e666u, 0x3f55b334u, 0x3f578000u,          \
      0x3f594cccu, 0x3f5b199au, 0x3f5ce666u, 0x3f5eb334u, 0x3f608000u, 0x3f624cccu, 0x3f64199au, 0x3f65e666u,          \
      0x3f67b334u, 0x3f698000u, 0x3f6b4cccu, 0x3f6d199au, 0x3f6ee666u, 0x3f70b334u, 0x3f728000u, 0x3f744cccu,          \
      0x3f76199au, 0x3f77e666u, 0x3f79b334u, 0x3f7b8000u, 0x3f7d4cccu, 0x3f7f199au, 0x3f800000u

#if !defined(__CUDACC__)
// The maps as FP32 arrays for host code (signed: the first moment and the momentum buffer; unsigned: the second
// moment). Device code copies them from a __device__ array into shared memory (kernels/cuda/optim_kernels.cu).
inline const float* blockwise8_map(bool is_signed) {
  struct Maps {
    float v[2][kQuantBlock];
  };
  static const Maps maps = [] {
    constexpr uint32_t bits[2][kQuantBlock] = {{AMPKIT_QMAP_SIGNED_BITS}, {AMPKIT_QMAP_UNSIGNED_BITS}};
    Maps m{};
    for (int s = 0; s < 2; ++s) {
      for (int i = 0; i < kQuantBlock; ++i) {
        m.v[s][i] = bit_cast<float>(bits[s][i]);
      }
    }
    return m;
  }();
  return maps.v[is_signed ? 0 : 1];
}
#endif

// absmax of a block as stored: the largest |x| clipped below at 1e-12 (torchao's scale); NaN stays NaN.
AMPKIT_HOST_DEVICE AMPKIT_INLINE float blockwise8_scale(float absmax) {
  return absmax >= 1e-12f || absmax != absmax ? absmax : 1e-12f;
}

// |x| folded into a running absmax; a NaN wins (the state shows it rather than hiding it).
AMPKIT_HOST_DEVICE AMPKIT_INLINE float absmax_fold(float acc, float x) {
  const float a = x < 0.f ? -x : x;
  return (a > acc || a != a) ? a : acc;
}

// The code of x / scale under `map` (256 ascending FP32 values): torchao's quantize_8bit_with_qmap.
AMPKIT_HOST_DEVICE AMPKIT_INLINE uint8_t blockwise8_code(float x, float scale, const float* map) {
  const float in = x / scale;
  int code = in >= map[128] ? 128 : 0;
  code += in >= map[code + 64] ? 64 : 0;
  code += in >= map[code + 32] ? 32 : 0;
  code += in >= map[code + 16] ? 16 : 0;
  code += in >= map[code + 8] ? 8 : 0;
  code += in >= map[code + 4] ? 4 : 0;
  code += in >= map[code + 2] ? 2 : 0;
  code += in >= map[code + 1] ? 1 : 0;
  const int up = code + 1 > 255 ? 255 : code + 1;
  const float down_value = map[code];
  return static_cast<uint8_t>(in - down_value >= (map[up] - down_value) * 0.5f ? up : code);
}

// NOTE [Quantizer search tree]
// The same code as blockwise8_code, found through the map laid out as the search visits it (Eytzinger order):
// tree[1] is the first threshold (map[128]), the node n of level l (2^l <= n < 2^(l+1)) holds map[(2(n - 2^l) + 1)
// * (128 >> l)], and its children are 2n and 2n + 1; tree[0] holds map[0]. The search compares with the same values
// in the same order as blockwise8_code, so the code is the same; and the two map values the final rounding needs
// are the last threshold it went up at (else map[0]) and the last it stayed below (else map[255]), carried along
// instead of read again. On a GPU the map lives in shared memory: the lanes of a warp read the thresholds of one
// level side by side (levels 0-5 take 1-32 consecutive words, one per bank: no bank conflict; level 6 at most two
// words per bank, level 7 four), where blockwise8_code's reads of map[code + 2^k] fall in one bank for 2^k >= 32,
// and its two final reads anywhere (tests/cpp/test_functors.cpp compares the two on every code's neighbourhood).
AMPKIT_HOST_DEVICE AMPKIT_INLINE int blockwise8_tree_source(int node) {  // the map index tree[node] holds
  if (node == 0) {
    return 0;
  }
  int level = 0;
  while ((node >> (level + 1)) != 0) {
    ++level;
  }
  return (2 * (node - (1 << level)) + 1) * (128 >> level);
}

AMPKIT_HOST_DEVICE AMPKIT_INLINE uint8_t blockwise8_code_tree(float x, float scale, const float* tree, float map_last) {
  const float in = x / scale;
  float down_value = tree[0];  // map[code] for the code found so far
  float up_value = map_last;   // map[code + 1], or map[255] while the search has gone up at every step
  int node = 1;
  for (int level = 0; level < 8; ++level) {  // a constant trip count: unrolled by nvcc and the host compilers
    const float threshold = tree[node];
    const bool go_up = in >= threshold;
    down_value = go_up ? threshold : down_value;
    up_value = go_up ? up_value : threshold;
    node = 2 * node + (go_up ? 1 : 0);
  }
  const int code = node - kQuantBlock;
  const int up = code + 1 > 255 ? 255 : code + 1;
  return static_cast<uint8_t>(in - down_value >= (up_value - down_value) * 0.5f ? up : code);
}

#if !defined(__CUDACC__)
// The two maps in search order (NOTE [Quantizer search tree]) for host code: blockwise8_tree_of(map) for a map
// blockwise8_map returned, else nullptr.
inline const float* blockwise8_tree_of(const float* map) {
  struct Trees {
    float v[2][kQuantBlock];
  };
  static const Trees trees = [] {
    Trees t{};
    for (int s = 0; s < 2; ++s) {
      const float* m = blockwise8_map(s == 0);
      for (int node = 0; node < kQuantBlock; ++node) {
        t.v[s][node] = m[blockwise8_tree_source(node)];
      }
    }
    return t;
  }();
  return map == blockwise8_map(true) ? trees.v[0] : map == blockwise8_map(false) ? trees.v[1] : nullptr;
}
#endif

}  // namespace ampkit::kernels
