// The barriers and warp primitives of the emulated CUDA build (NOTE [Emulated execution] in emulation.h): a
// thread that reaches one waits on its fiber until every thread of the block, or every lane its mask names,
// waits at it too, then each gets CUDA's result; and the reports, naming block, threads and file:line, of a
// block that cannot go on.
#include <cstdio>
#include <cstring>
#include <string>

#include "emulation.h"
#include "emulation_scheduler.h"

namespace ampkit::kernels::emulation::detail {

std::string thread_name(const uint3& t) {
  return "thread (" + std::to_string(t.x) + "," + std::to_string(t.y) + "," + std::to_string(t.z) + ")";
}
std::string block_name() {
  return "block (" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) +
         ")";
}

namespace {

std::string site_name(const char* file, int line) { return std::string(file) + ":" + std::to_string(line); }

const char* barrier_name(BarrierKind k) {
  switch (k) {
    case BarrierKind::kSync:
      return "__syncthreads()";
    case BarrierKind::kCount:
      return "__syncthreads_count()";
    case BarrierKind::kAnd:
      return "__syncthreads_and()";
    case BarrierKind::kOr:
      return "__syncthreads_or()";
  }
  return "?";
}
const char* warp_name(WarpKind k) {
  switch (k) {
    case WarpKind::kSync:
      return "__syncwarp";
    case WarpKind::kShfl:
      return "__shfl_sync";
    case WarpKind::kShflUp:
      return "__shfl_up_sync";
    case WarpKind::kShflDown:
      return "__shfl_down_sync";
    case WarpKind::kShflXor:
      return "__shfl_xor_sync";
    case WarpKind::kBallot:
      return "__ballot_sync";
    case WarpKind::kAny:
      return "__any_sync";
    case WarpKind::kAll:
      return "__all_sync";
    case WarpKind::kMatchAny:
      return "__match_any_sync";
  }
  return "?";
}
std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}
// Where a waiting or exited thread is, for a report.
std::string where(const ThreadState& t) {
  switch (t.state) {
    case State::kExited:
      return "exited";
    case State::kBarrier:
      return std::string("waits at ") + barrier_name(t.barrier) + " at " + site_name(t.file, t.line);
    case State::kWarp:
      return std::string("waits at ") + warp_name(t.warp.kind) + "(mask " + hex(t.warp.mask) + ") at " +
             site_name(t.warp.file, t.warp.line);
    case State::kRunnable:
      break;
  }
  return "runs";
}

}  // namespace

std::string stuck_message(const Scheduler& s) {
  const auto& th = s.threads;
  for (int t = 0; t < s.n_threads; ++t) {
    const ThreadState& me = th[static_cast<size_t>(t)];
    if (me.state == State::kBarrier) {
      for (int o = 0; o < s.n_threads; ++o) {
        const ThreadState& other = th[static_cast<size_t>(o)];
        if (other.state != State::kBarrier) {
          return block_name() + " " + thread_name(me.idx) + " waits at " + barrier_name(me.barrier) + " at " +
                 site_name(me.file, me.line) + ", which " + thread_name(other.idx) + " never reaches: it " +
                 where(other) + " (divergent barrier)";
        }
      }
    }
    if (me.state == State::kWarp) {
      const int warp_base = t / 32 * 32;
      for (int l = 0; l < 32 && warp_base + l < s.n_threads; ++l) {
        const ThreadState& other = th[static_cast<size_t>(warp_base + l)];
        if (((me.warp.mask >> l) & 1u) == 0 || &other == &me) {
          continue;
        }
        if (other.state != State::kWarp || other.warp.kind != me.warp.kind || other.warp.mask != me.warp.mask ||
            other.warp.width != me.warp.width || other.warp.bytes != me.warp.bytes) {
          return block_name() + " " + thread_name(me.idx) + " (lane " + std::to_string(t % 32) + ") waits at " +
                 warp_name(me.warp.kind) + "(mask " + hex(me.warp.mask) + ") at " +
                 site_name(me.warp.file, me.warp.line) + ", but lane " + std::to_string(l) + " named in the mask, " +
                 thread_name(other.idx) + ", " + where(other) +
                 (other.state == State::kExited ? " (it cannot arrive)" : " (mask mismatch)");
        }
      }
    }
  }
  return block_name() + " cannot go on";
}

int block_barrier(BarrierKind kind, int pred, const char* file, int line) {
  Scheduler& s = active(barrier_name(kind));
  ThreadState& me = s.threads[static_cast<size_t>(s.current)];
  me.state = State::kBarrier;
  me.barrier = kind;
  me.pred = pred != 0 ? 1 : 0;
  me.file = file;
  me.line = line;
  s.arrived += 1;
  if (s.arrived < s.n_threads) {
    yield_to_host(s);
    return static_cast<int>(me.result);
  }
  // Every thread waits here: the same barrier (line and kind) for all, or the block is divergent.
  int count = 0;
  const ThreadState& first = s.threads[0];
  for (const ThreadState& t : s.threads) {
    if (t.barrier != first.barrier || t.line != first.line || std::strcmp(t.file, first.file) != 0) {
      fail(s, cudaErrorIllegalInstruction,
           block_name() + " " + thread_name(first.idx) + " waits at " + barrier_name(first.barrier) + " at " +
               site_name(first.file, first.line) + ", but " + thread_name(t.idx) + " waits at " +
               barrier_name(t.barrier) + " at " + site_name(t.file, t.line) + " (divergent barrier)");
    }
    count += t.pred;
  }
  const int r = kind == BarrierKind::kCount ? count
                : kind == BarrierKind::kAnd ? (count == s.n_threads ? 1 : 0)
                : kind == BarrierKind::kOr  ? (count > 0 ? 1 : 0)
                                            : 0;
  for (ThreadState& t : s.threads) {
    t.state = State::kRunnable;
    t.result = static_cast<uint64_t>(r);
  }
  s.arrived = 0;
  return r;
}

uint64_t warp_op(const WarpOp& op) {
  Scheduler& s = active(warp_name(op.kind));
  const int me_index = s.current;
  ThreadState& me = s.threads[static_cast<size_t>(me_index)];
  const int lane = me_index % 32;
  const int base = me_index - lane;
  const int lanes = s.n_threads - base < 32 ? s.n_threads - base : 32;
  const unsigned existing = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
  const std::string here = block_name() + " " + thread_name(me.idx) + " (lane " + std::to_string(lane) +
                           "): " + warp_name(op.kind) + "(mask " + hex(op.mask) + ") at " + site_name(op.file, op.line);
  if (((op.mask >> lane) & 1u) == 0) {
    fail(s, cudaErrorIllegalInstruction, here + " is called by a lane outside its mask");
  }
  if (op.width < 1 || op.width > 32 || (op.width & (op.width - 1)) != 0) {
    fail(s, cudaErrorIllegalInstruction,
         here + ": width " + std::to_string(op.width) + " is not a power of two from 1 to 32");
  }
  me.state = State::kWarp;
  me.warp = op;
  const unsigned lanes_in = op.mask & existing;
  for (int l = 0; l < lanes; ++l) {
    if (((lanes_in >> l) & 1u) == 0) {
      continue;
    }
    const ThreadState& t = s.threads[static_cast<size_t>(base + l)];
    if (t.state != State::kWarp || t.warp.kind != op.kind || t.warp.mask != op.mask || t.warp.width != op.width ||
        t.warp.bytes != op.bytes) {
      yield_to_host(s);  // a lane named in the mask has not arrived: the last to arrive completes the primitive
      return me.result;
    }
  }
  // Every lane of the mask waits here: each gets its result.
  auto value = [&](int l) { return s.threads[static_cast<size_t>(base + l)].warp.value; };
  auto takes_part = [&](int l) { return l >= 0 && l < 32 && ((lanes_in >> l) & 1u) != 0; };
  unsigned votes = 0;
  for (int l = 0; l < lanes; ++l) {
    if (takes_part(l) && value(l) != 0) {
      votes |= 1u << l;
    }
  }
  const uint64_t poison = ~uint64_t{0};
  for (int l = 0; l < lanes; ++l) {
    if (!takes_part(l)) {
      continue;
    }
    ThreadState& t = s.threads[static_cast<size_t>(base + l)];
    const int w = op.width;
    const int seg_lo = l & ~(w - 1);
    const int seg_hi = seg_lo + w - 1;
    const int arg = t.warp.lane_arg;
    int src = l;
    switch (op.kind) {
      case WarpKind::kShfl:
        src = seg_lo + (arg & (w - 1));
        break;
      case WarpKind::kShflUp:
        src = l - arg >= seg_lo ? l - arg : l;
        break;
      case WarpKind::kShflDown:
        src = l + arg <= seg_hi ? l + arg : l;
        break;
      case WarpKind::kShflXor:
        src = (l ^ arg) <= seg_hi ? (l ^ arg) : l;
        break;
      default:
        break;
    }
    uint64_t r = 0;
    switch (op.kind) {
      case WarpKind::kSync:
        break;
      case WarpKind::kShfl:
      case WarpKind::kShflUp:
      case WarpKind::kShflDown:
      case WarpKind::kShflXor:
        r = takes_part(src) ? value(src) : poison;  // CUDA leaves a value from a lane not taking part undefined
        break;
      case WarpKind::kBallot:
        r = votes;
        break;
      case WarpKind::kAny:
        r = votes != 0 ? 1 : 0;
        break;
      case WarpKind::kAll:
        r = votes == lanes_in ? 1 : 0;
        break;
      case WarpKind::kMatchAny: {
        unsigned same = 0;
        for (int k = 0; k < lanes; ++k) {
          if (takes_part(k) && value(k) == value(l)) {
            same |= 1u << k;
          }
        }
        r = same;
        break;
      }
    }
    t.result = r;
  }
  for (int l = 0; l < lanes; ++l) {
    if (takes_part(l)) {
      s.threads[static_cast<size_t>(base + l)].state = State::kRunnable;
    }
  }
  return me.result;
}

unsigned active_mask() {
  Scheduler& s = active("__activemask");
  const int base = s.current / 32 * 32;
  unsigned mask = 0;
  for (int l = 0; l < 32 && base + l < s.n_threads; ++l) {
    if (s.threads[static_cast<size_t>(base + l)].state != State::kExited) {
      mask |= 1u << l;
    }
  }
  return mask;
}

}  // namespace ampkit::kernels::emulation::detail
