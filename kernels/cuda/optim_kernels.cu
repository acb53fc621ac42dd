// CUDA kernels of the Adam/AdamW and SGD steps on ampkit's multi-tensor apply: one pass per parameter reads the
// grad, unscales it in registers, updates the FP32 master and moments and writes the low-precision weight; a
// device-side found_inf skips every write, step counts included. (LAMB and the grad norm: lamb_kernels.cu.)
#include "optim_passes.cuh"

namespace ampkit::kernels {
namespace {

static_assert(cuda::kChunkSize % 4 == 0, "a pack of 4 elements is one group of the stochastic rounding's counter");
static_assert(cuda::kChunkSize % kQuantBlock == 0, "a chunk holds whole quantization blocks of the 8-bit states");

template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// Writes back the optimizer states of element i that exist.
__device__ AMPKIT_INLINE void store_moments(float* m, float* v, float* vmax, int64_t i, float mi, float vi, float vmi) {
  if (m) {
    global_store(m + i, mi);
  }
  if (v) {
    global_store(v + i, vi);
  }
  if (vmax) {
    global_store(vmax + i, vmi);
  }
}

// NOTE [Optimizer chunk loop]
// One block walks a 64K-element chunk in packs of kVec = 4 elements per stream (16 bytes for FP32 streams, 8 for
// the 16-bit ones). Each stream is accessed with one vector access per pack where its base is aligned for it and
// with kVec element accesses where it is not: the decision is per stream and chunk (uniform over the block), so a
// misaligned grad does not make the master and the moments go scalar. Each thread loads kUnroll = 2 packs of
// every stream before any arithmetic: with 512-thread blocks and the 65-128 registers these kernels take, one block
// fits an SM whatever the register count in that range (bench/results/*_ptxas_sm90.txt), so the second pack's
// loads cost no occupancy and double the bytes in flight. The BF16 weight + int16 remainder mode runs the same
// vector loop. Only the last n % kVec elements of a chunk take the scalar loop.
template <typename T, int kVec>
struct StreamIO {
  T* p;
  bool vec;  // the base is aligned for one access per pack

  __device__ AMPKIT_INLINE Pack<T, kVec> load(int64_t pack) const {
    if (vec) {
      return global_load(reinterpret_cast<const Pack<T, kVec>*>(p) + pack);
    }
    Pack<T, kVec> r;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      r.v[j] = global_load(p + pack * kVec + j);
    }
    return r;
  }
  __device__ AMPKIT_INLINE void store(int64_t pack, const Pack<T, kVec>& x) const {
    if (vec) {
      global_store(reinterpret_cast<Pack<T, kVec>*>(p) + pack, x);
      return;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      global_store(p + pack * kVec + j, x.v[j]);
    }
  }
};

template <int kVec, typename T>
__device__ AMPKIT_INLINE StreamIO<T, kVec> stream_io(T* p) {
  return {p, p != nullptr && reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kVec) == 0};
}

// How a launch writes its weights back: `store`, and for stochastic rounding the step count the update reaches
// (the generator's counter with the element index; NOTE [Counter-based stochastic rounding]).
struct WeightOut {
  WeightStore store;
  uint32_t step;
};

// Element i's grad in FP32, divided by the scale (and stored back so) as `gin` says, for the element-wise loops.
template <typename T>
__device__ AMPKIT_INLINE float read_grad(T* grad, int64_t i, const GradIn& gin) {
  float g = to_opmath(global_load(grad + i));
  if (gin.unscale) {
    g = g / gin.scale;
    if (gin.write) {
      global_store(grad + i, from_opmath<T>(g));
    }
  }
  return g;
}

// One element's weight as a launch keeps it, for the element-wise loops: read as FP32 (the master, the BF16 weight
// joined with its remainder, or the parameter) and written back (the master and the rounded parameter; the
// remainder; the Kahan-compensated BF16 weight; or the BF16 weight rounded stochastically with element `first +
// i`'s word of step `step`). Pointers are offset to the chunk; null where the launch keeps no such stream.
template <typename T>
struct ElementWeight {
  T* param;
  float* master;
  int16_t* rem;
  uint16_t* comp;
  bool stochastic;
  uint64_t seed;
  uint32_t step;
  int64_t first;  // the chunk's first element in the tensor

  __device__ AMPKIT_INLINE uint16_t* bits() const { return reinterpret_cast<uint16_t*>(param); }
  __device__ AMPKIT_INLINE float load(int64_t i) const {
    return master ? global_load(master + i)
           : rem  ? join_remainder(global_load(bits() + i), global_load(rem + i))
                  : to_opmath(global_load(param + i));
  }
  // w0: the value load() gave, w: the updated one.
  __device__ AMPKIT_INLINE void store(int64_t i, float w0, float w) const {
    if (master) {
      global_store(master + i, w);
      global_store(param + i, from_opmath<T>(w));
    } else if (rem) {
      uint16_t wb;
      int16_t rb;
      split_remainder(w, &wb, &rb);
      global_store(bits() + i, wb);
      global_store(rem + i, rb);
    } else if (comp) {
      uint16_t wb;
      uint16_t cb = global_load(comp + i);
      kahan_store(w0, w, &wb, &cb);
      global_store(bits() + i, wb);
      global_store(comp + i, cb);
    } else if (stochastic) {
      global_store(bits() + i, bf16_bits_stochastic(w, rounding_bits(seed, step, first + i)));
    } else {
      global_store(param + i, from_opmath<T>(w));
    }
  }
};

// Calls body(w, g, m, v, vmax, tail) on every element of chunk [start, start + n) of tensor t. kStore, a template
// argument (one code path per way of keeping the weight), lets each path take its own registers: the lean paths'
// compensation and seed would otherwise push the master path over its budget (NOTE [Optimizer chunk loop]).
template <typename T, typename G, WeightStore kStore, typename Args, typename Body>
__device__ void for_each_element(const Args& a, int t, int64_t start, int64_t n, const GradIn& gin,
                                 const WeightOut& out, const Body& body) {
  constexpr int kVec = 4;
  constexpr int kUnroll = 2;
  using PackT = Pack<T, kVec>;
  using PackG = Pack<G, kVec>;
  using PackF = Pack<float, kVec>;
  using PackB = Pack<uint16_t, kVec>;
  using PackR = Pack<int16_t, kVec>;
  auto* param = static_cast<T*>(a.data[kParamIdx][t]) + start;
  auto* grad = static_cast<G*>(a.data[kGradIdx][t]) + start;  // NOTE [FP32 grads of low-precision params]
  // Index (in the chunk) of the first scalar-tail element.
  const int64_t tail_from = tail_start(a.numel[t], gin.tail_width) - start;
  auto offset = [&](int s) { return a.data[s][t] ? static_cast<float*>(a.data[s][t]) + start : nullptr; };
  float* master = offset(kMasterIdx);
  float* m = offset(kExpAvgIdx);
  float* v = offset(kExpAvgSqIdx);
  float* vmax = offset(kMaxExpAvgSqIdx);
  // BF16 weight + int16 remainder: the exact FP32 master without a FP32 copy.
  int16_t* rem = nullptr;
  // BF16 weight without a master (kernels/stochastic_rounding.h): its Kahan compensation, or stochastic rounding
  // with the tensor's seed.
  uint16_t* comp = nullptr;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr bool stochastic = kBf16 && kStore == WeightStore::kStochastic;
  uint64_t seed = 0;
  if constexpr (kBf16 && kStore == WeightStore::kRemainder) {
    rem = static_cast<int16_t*>(a.data[kRemainderIdx][t]) + start;
  } else if constexpr (kBf16 && kStore == WeightStore::kKahan) {
    comp = static_cast<uint16_t*>(a.data[kRemainderIdx][t]) + start;
  } else if constexpr (stochastic) {
    seed = static_cast<uint64_t>(*static_cast<const int64_t*>(a.data[kRemainderIdx][t]));
  }
  const bool lean = comp != nullptr || stochastic;  // the weight's bits are written, not a rounding of T
  auto* bits = reinterpret_cast<uint16_t*>(param);
  const auto param_io = stream_io<kVec>(param);
  const auto grad_io = stream_io<kVec>(grad);
  const auto bits_io = stream_io<kVec>(bits);
  const auto rem_io = stream_io<kVec>(rem);
  const auto comp_io = stream_io<kVec>(comp);
  const auto master_io = stream_io<kVec>(master);
  const auto m_io = stream_io<kVec>(m);
  const auto v_io = stream_io<kVec>(v);
  const auto vmax_io = stream_io<kVec>(vmax);

  struct Packs {
    PackG g;
    PackF w, m, v, vm;
    PackB c;
  };
  // Reads pack i of every stream (the param only when it holds the weight: a master-weight step only writes it).
  auto load = [&](int64_t i, Packs& r) {
    r.g = grad_io.load(i);
    if (master) {
      r.w = master_io.load(i);
    } else if (rem) {
      const PackB b = bits_io.load(i);
      const PackR q = rem_io.load(i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        r.w.v[j] = join_remainder(b.v[j], q.v[j]);
      }
    } else {
      const PackT p = param_io.load(i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        r.w.v[j] = to_opmath(p.v[j]);
      }
    }
    if (comp) {
      r.c = comp_io.load(i);
    }
    if (m) {
      r.m = m_io.load(i);
    }
    if (v) {
      r.v = v_io.load(i);
    }
    if (vmax) {
      r.vm = vmax_io.load(i);
    }
  };
  auto update = [&](int64_t i, Packs& r) {
    float gf[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      gf[j] = gin.unscale ? to_opmath(r.g.v[j]) / gin.scale : to_opmath(r.g.v[j]);
    }
    if (gin.unscale && gin.write) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        r.g.v[j] = from_opmath<G>(gf[j]);
      }
      grad_io.store(i, r.g);
    }
    PackT p4;
    PackB b4;
    PackR q4;
    // The pack's 4 elements are one group of the rounding's counter: chunks start at multiples of 4.
    const Philox4x32 words = stochastic ? rounding_words(seed, out.step, (start + i * kVec) / kVec) : Philox4x32{};
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      // Scalars, not array elements, go to the functor: their addresses stay in registers.
      float w = r.w.v[j];
      float mj = r.m.v[j];
      float vj = r.v.v[j];
      float vmj = r.vm.v[j];
      body(w, gf[j], m ? &mj : nullptr, v ? &vj : nullptr, vmax ? &vmj : nullptr, i * kVec + j >= tail_from);
      r.m.v[j] = mj;
      r.v.v[j] = vj;
      r.vm.v[j] = vmj;
      if (rem) {
        split_remainder(w, &b4.v[j], &q4.v[j]);
      } else if (comp) {
        kahan_store(r.w.v[j], w, &b4.v[j], &r.c.v[j]);
      } else if (stochastic) {
        b4.v[j] = bf16_bits_stochastic(w, words.v[j]);
      } else {
        p4.v[j] = from_opmath<T>(w);
      }
      r.w.v[j] = w;
    }
    if (rem) {
      bits_io.store(i, b4);
      rem_io.store(i, q4);
    } else if (lean) {
      bits_io.store(i, b4);
      if (comp) {
        comp_io.store(i, r.c);
      }
    } else {
      param_io.store(i, p4);
    }
    if (master) {
      master_io.store(i, r.w);
    }
    if (m) {
      m_io.store(i, r.m);
    }
    if (v) {
      v_io.store(i, r.v);
    }
    if (vmax) {
      vmax_io.store(i, r.vm);
    }
  };
  const int64_t n_vec = n / kVec;
  const int64_t stride = static_cast<int64_t>(blockDim.x);
  for (int64_t base = threadIdx.x; base < n_vec; base += kUnroll * stride) {
    Packs r[kUnroll]{};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < n_vec) {
        load(base + u * stride, r[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < n_vec) {
        update(base + u * stride, r[u]);
      }
    }
  }
  const ElementWeight<T> weight{param, master, rem, comp, stochastic, seed, out.step, start};
  for (int64_t i = n_vec * kVec + threadIdx.x; i < n; i += stride) {
    float w = weight.load(i);
    const float w0 = w;
    const float g = read_grad(grad, i, gin);
    float mi = m ? global_load(m + i) : 0.f;
    float vi = v ? global_load(v + i) : 0.f;
    float vmi = vmax ? global_load(vmax + i) : 0.f;
    body(w, g, m ? &mi : nullptr, v ? &vi : nullptr, vmax ? &vmi : nullptr, i >= tail_from);
    store_moments(m, v, vmax, i, mi, vi, vmi);
    weight.store(i, w0, w);
  }
}

// The dynamic maps of the 8-bit states (NOTE [8-bit block-wise states]); a block copies them to shared memory,
// where the quantizer's data-dependent lookups do not serialize as constant-memory reads would.
__device__ const uint32_t kBlockwise8Maps[2 * kQuantBlock] = {AMPKIT_QMAP_SIGNED_BITS, AMPKIT_QMAP_UNSIGNED_BITS};

// A moment stream of the state-block path: FP32, BF16 or packed 8-bit (its codes, then its blocks' absmaxes).
struct StateStream {
  void* base;  // of the whole tensor; nullptr: no such stream
  DType type;
  const float* map;       // 8-bit: the map in shared memory (dequantization)
  const float* tree;      // 8-bit: the same map in search order, in shared memory (NOTE [Quantizer search tree])
  int64_t absmax_offset;  // 8-bit: bytes from base to the absmaxes

  __device__ AMPKIT_INLINE float* absmax(int64_t block) const {
    return reinterpret_cast<float*>(static_cast<uint8_t*>(base) + absmax_offset) + block;
  }
};

// NOTE [State-block chunk loop]
// A tensor whose moments are not both FP32 (exp_avg_dtype / exp_avg_sq_dtype: BF16, or 8-bit block-wise) takes
// this loop: each warp walks the chunk's 256-element quantization blocks (chunks start at multiples of 256), each
// lane 8 elements of a block, 32 apart (element j * 32 + lane, j = 0..7), so that every load and store of the warp
// touches 32 consecutive elements: whole 32-byte sectors (NOTE [Memory transaction model]; lanes walking 8
// consecutive elements each touch 8 to 16 times the sectors). A lane loads its 8 moments as FP32 (an 8-bit block's
// absmax read once), runs the optimizer's formulas on each element with the weight kept as the launch keeps it
// (master, remainder, Kahan, stochastic rounding, or the parameter), and keeps the new moments in registers; the
// warp then reduces the block's new absmax with shuffles and every lane quantizes its 8 values through the map in
// search order (NOTE [Quantizer search tree]: the lanes' lookups fall in distinct shared-memory banks); lane 0
// stores the absmax. BF16 moments are rounded to nearest even. The same per-element operations as the CPU loop
// (csrc/ops/cpu/optim_loops.h: NOTE [Weight-block loop]): the bits agree.
template <typename T, typename G, typename Args, typename Body>
__device__ void for_each_state_block(const Args& a, int t, int64_t start, int64_t n, const GradIn& gin,
                                     const WeightOut& out, const Body& body) {
  constexpr int kPer = kQuantBlock / 32;  // elements per lane
  AMPKIT_SHARED(float, maps, 2 * kQuantBlock);
  AMPKIT_SHARED(float, trees, 2 * kQuantBlock);
  for (int i = threadIdx.x; i < 2 * kQuantBlock; i += blockDim.x) {
    const int which = i / kQuantBlock * kQuantBlock;
    maps[i] = bit_cast<float>(kBlockwise8Maps[i]);
    trees[i] = bit_cast<float>(kBlockwise8Maps[which + blockwise8_tree_source(i - which)]);
  }
  __syncthreads();
  const int64_t numel = a.numel[t];
  const int64_t absmax_offset = blockwise8_blocks(numel) * kQuantBlock;
  const StateStream ms{a.data[kExpAvgIdx][t], a.dtype[kExpAvgIdx][t], maps, trees, absmax_offset};
  const StateStream vs{a.data[kExpAvgSqIdx][t], a.dtype[kExpAvgSqIdx][t], maps + kQuantBlock, trees + kQuantBlock,
                       absmax_offset};
  auto* param = static_cast<T*>(a.data[kParamIdx][t]) + start;
  auto* grad = static_cast<G*>(a.data[kGradIdx][t]) + start;
  auto* master = a.data[kMasterIdx][t] ? static_cast<float*>(a.data[kMasterIdx][t]) + start : nullptr;
  auto* vmax = a.data[kMaxExpAvgSqIdx][t] ? static_cast<float*>(a.data[kMaxExpAvgSqIdx][t]) + start : nullptr;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  int16_t* rem = nullptr;
  uint16_t* comp = nullptr;
  uint64_t seed = 0;
  const bool stochastic = kBf16 && out.store == WeightStore::kStochastic;
  if (kBf16 && out.store == WeightStore::kRemainder) {
    rem = static_cast<int16_t*>(a.data[kRemainderIdx][t]) + start;
  } else if (kBf16 && out.store == WeightStore::kKahan) {
    comp = static_cast<uint16_t*>(a.data[kRemainderIdx][t]) + start;
  } else if (stochastic) {
    seed = static_cast<uint64_t>(*static_cast<const int64_t*>(a.data[kRemainderIdx][t]));
  }
  const ElementWeight<T> weight{param, master, rem, comp, stochastic, seed, out.step, start};
  const int64_t tail_from = tail_start(numel, gin.tail_width) - start;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warps = static_cast<int>(blockDim.x / 32);
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  // Element i of the chunk's moment stream s as FP32.
  auto load_state = [&](const StateStream& s, int64_t i, float scale) {
    const int64_t e = start + i;
    if (s.type == DType::kFloat32) {
      return global_load(static_cast<const float*>(s.base) + e);
    }
    if (s.type == DType::kBFloat16) {
      return bf16_bits_to_float(global_load(static_cast<const uint16_t*>(s.base) + e));
    }
    return s.map[global_load(static_cast<const uint8_t*>(s.base) + e)] * scale;
  };
  // The block's new values x[] stored back; 8-bit: with the warp's absmax. Every loop over a lane's kPer elements
  // is unrolled with the `j < valid` test inside, so that x[] and the moments stay in registers (a loop bounded by
  // `valid` indexes them at run time: ptxas put them in an 80-byte stack frame).
  auto store_state = [&](const StateStream& s, int64_t b0, int valid, int64_t block, const float(&x)[kPer]) {
    if (s.type == DType::kUInt8) {
      float absmax = 0.f;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        if (j < valid) {
          absmax = absmax_fold(absmax, x[j]);
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        absmax = absmax_fold(absmax, __shfl_xor_sync(0xffffffffu, absmax, offset));
      }
      const float scale = blockwise8_scale(absmax);
      if (lane == 0) {
        global_store(s.absmax(block), scale);
      }
      const float map_last = s.map[kQuantBlock - 1];  // a broadcast
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        if (j < valid) {
          global_store(static_cast<uint8_t*>(s.base) + start + b0 + j * 32 + lane,
                       blockwise8_code_tree(x[j], scale, s.tree, map_last));
        }
      }
      return;
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (j < valid) {
        const int64_t e = start + b0 + j * 32 + lane;
        if (s.type == DType::kFloat32) {
          global_store(static_cast<float*>(s.base) + e, x[j]);
        } else {
          global_store(static_cast<uint16_t*>(s.base) + e, bf16_bits_nearest(x[j]));
        }
      }
    }
  };
  for (int64_t qb = threadIdx.x / 32; qb < blocks; qb += warps) {  // uniform over the warp
    const int64_t b0 = qb * kQuantBlock;                           // the block's first element in the chunk
    const int64_t left = n - b0;                                   // of the block's elements, in the chunk
    // The lane's elements b0 + j * 32 + lane that exist: j < valid.
    const int valid = left <= lane                    ? 0
                      : left - lane > 32 * (kPer - 1) ? kPer
                                                      : static_cast<int>((left - lane + 31) / 32);
    const int64_t block = (start + b0) / kQuantBlock;  // of the tensor
    // An 8-bit block's absmax: read once (lane 0) and broadcast.
    float m_scale = ms.base && ms.type == DType::kUInt8 && lane == 0 ? global_load(ms.absmax(block)) : 0.f;
    float v_scale = vs.base && vs.type == DType::kUInt8 && lane == 0 ? global_load(vs.absmax(block)) : 0.f;
    m_scale = __shfl_sync(0xffffffffu, m_scale, 0);
    v_scale = __shfl_sync(0xffffffffu, v_scale, 0);
    float mv[kPer];
    float vv[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (j >= valid) {
        continue;
      }
      const int64_t i = b0 + j * 32 + lane;
      mv[j] = ms.base ? load_state(ms, i, m_scale) : 0.f;
      vv[j] = vs.base ? load_state(vs, i, v_scale) : 0.f;
      const float w0 = weight.load(i);
      const float g = read_grad(grad, i, gin);
      float vmj = vmax ? global_load(vmax + i) : 0.f;
      float w = w0;
      // Scalars, not array elements, go to the functor (as in for_each_element).
      float mj = mv[j];
      float vj = vv[j];
      body(w, g, ms.base ? &mj : nullptr, vs.base ? &vj : nullptr, vmax ? &vmj : nullptr, i >= tail_from);
      mv[j] = mj;
      vv[j] = vj;
      if (vmax) {
        global_store(vmax + i, vmj);
      }
      weight.store(i, w0, w);
    }
    if (ms.base) {
      store_state(ms, b0, valid, block, mv);
    }
    if (vs.base) {
      store_state(vs, b0, valid, block, vv);
    }
  }
}

// kStateBlocks: the kernel of the tensors whose moments are not both FP32 (NOTE [Moment storage kernels]).
template <bool kStateBlocks, typename Args, typename Body>
__device__ AMPKIT_INLINE void dispatch_dtype(const Args& a, int t, int64_t start, int64_t n, const GradIn& gin,
                                             const WeightOut& out, const Body& body) {
  with_param_and_grad_types(a, t, [&](auto param_zero, auto grad_zero) {
    using T = decltype(param_zero);
    using G = decltype(grad_zero);
    if constexpr (kStateBlocks) {
      for_each_state_block<T, G>(a, t, start, n, gin, out, body);  // NOTE [State-block chunk loop]
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      switch (out.store) {
        case WeightStore::kRemainder:
          for_each_element<T, G, WeightStore::kRemainder>(a, t, start, n, gin, out, body);
          break;
        case WeightStore::kKahan:
          for_each_element<T, G, WeightStore::kKahan>(a, t, start, n, gin, out, body);
          break;
        case WeightStore::kStochastic:
          for_each_element<T, G, WeightStore::kStochastic>(a, t, start, n, gin, out, body);
          break;
        default:
          for_each_element<T, G, WeightStore::kDirect>(a, t, start, n, gin, out, body);
          break;
      }
    } else {
      for_each_element<T, G, WeightStore::kDirect>(a, t, start, n, gin, out, body);
    }
  });
}

// The step count a tensor's update reaches (its stored count + 1; 0 without one).
template <typename Args>
__device__ AMPKIT_INLINE uint32_t step_reached(const Args& a, int t) {
  const auto* step = static_cast<const float*>(a.data[kStepIdx][t]);
  return step != nullptr ? static_cast<uint32_t>(*step + 1.f) : 0u;
}

template <bool kStateBlocks>
struct AdamChunkOp {
  AdamOp op;
  DeviceScalars dev;
  WeightStore store;

  template <typename Args>
  __device__ AMPKIT_INLINE void operator()(const Args& a, int t, int64_t start, int64_t n) const {
    if (dev.skipped()) {
      return;
    }
    const float step = *static_cast<const float*>(a.data[kStepIdx][t]) + 1.f;
    const AdamStepFactors f = block_factors<AdamStepFactors>([&] {
      return AdamStepFactors::at_step(op.p, dev.lr_or(op.p.lr), step);
    });  // NOTE [Step factors once per block]
    dispatch_dtype<kStateBlocks>(
        a, t, start, n, dev.grad_in(op.p.write_unscaled_grads, op.p.tail_width), WeightOut{store, step_reached(a, t)},
        [&](float& w, float g, float* m, float* v, float* vmax, bool tail) { op(w, g, *m, *v, vmax, f, tail); });
  }
};

template <bool kStateBlocks>
struct SgdChunkOp {
  SgdOp op;
  DeviceScalars dev;
  WeightStore store;

  template <typename Args>
  __device__ AMPKIT_INLINE void operator()(const Args& a, int t, int64_t start, int64_t n) const {
    if (dev.skipped()) {
      return;
    }
    SgdParams p = op.p;
    p.lr = dev.lr_or(p.lr);
    const SgdOp step_op(p);
    const bool first = a.data[kStepIdx][t] == nullptr || *static_cast<const float*>(a.data[kStepIdx][t]) == 0.f;
    dispatch_dtype<kStateBlocks>(
        a, t, start, n, dev.grad_in(p.write_unscaled_grads, p.tail_width), WeightOut{store, step_reached(a, t)},
        [&](float& w, float g, float* buf, float*, float*, bool tail) { step_op(w, g, buf, first, tail); });
  }
};

// NOTE [Kernel parameter budget] states how many tensors one optimizer launch takes.
static_assert(cuda::MultiTensorArgsFor<kStreams, AdamChunkOp<false>>::kMaxTensors == 192 &&
                  cuda::MultiTensorArgsFor<kStreams, AdamChunkOp<true>>::kMaxTensors == 192 &&
                  cuda::MultiTensorArgsFor<kStreams, SgdChunkOp<false>>::kMaxTensors == 192 &&
                  cuda::MultiTensorArgsFor<kStreams, SgdChunkOp<true>>::kMaxTensors == 192,
              "the optimizer steps take 192 tensors per launch");

}  // namespace

LaunchStatus launch_adam_step(const OptimTensor* tensors, int64_t n, const AdamParams& params, const float* grad_scale,
                              const float* found_inf, const float* lr, cudaStream_t stream) {
  return launch_step_by_storage<AdamChunkOp>(tensors, n, found_inf, stream, AdamOp{params},
                                             DeviceScalars{grad_scale, found_inf, lr}, weight_store(tensors, n));
}

LaunchStatus launch_sgd_step(const OptimTensor* tensors, int64_t n, const SgdParams& params, const float* grad_scale,
                             const float* found_inf, const float* lr, cudaStream_t stream) {
  return launch_step_by_storage<SgdChunkOp>(tensors, n, found_inf, stream, SgdOp{params},
                                            DeviceScalars{grad_scale, found_inf, lr}, weight_store(tensors, n));
}

}  // namespace ampkit::kernels
