// ampkit::distributed::store_process_group (see <ampkit/distributed.h>, NOTE [Store process group]).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <string>
#include <utility>
#include <vector>

#include "ampkit/distributed.h"

namespace ampkit::distributed {
namespace {

class StoreBackend : public c10d::Backend {
 public:
  StoreBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size, const std::string& name)
      : c10d::Backend(rank, size), store_(std::move(store)), prefix_("ampkit/" + name + "/") {}
  const std::string getBackendName() const override { return "ampkit_store"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM || opts.reduceOp == c10d::ReduceOp::MAX,
                "ampkit::distributed::store_process_group: all-reduce takes SUM or MAX");
    const bool sum = opts.reduceOp == c10d::ReduceOp::SUM;
    for (auto& t : tensors) {
      TORCH_CHECK_TYPE(t.is_floating_point(),
                       "ampkit::distributed::store_process_group: all-reduce takes floating "
                       "tensors, but got ",
                       t.scalar_type());
      const int64_t round = round_++;
      const at::ScalarType acc = t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
      const at::Tensor mine = t.detach().to(at::kCPU, t.scalar_type()).contiguous();
      const auto* bytes = static_cast<const uint8_t*>(mine.const_data_ptr());
      store_->set(key(round, getRank()), std::vector<uint8_t>(bytes, bytes + mine.nbytes()));
      at::Tensor result;
      for (int r = 0; r < getSize(); ++r) {  // rank order: the same bits on every rank
        at::Tensor part;
        if (r == getRank()) {
          part = mine.to(acc, /*non_blocking=*/false, /*copy=*/true);
        } else {
          const std::vector<uint8_t> other = store_->get(key(round, r));  // waits for the key
          TORCH_CHECK(other.size() == static_cast<size_t>(mine.nbytes()),
                      "ampkit::distributed::store_process_group: "
                      "rank ",
                      r, " all-reduced ", other.size(), " bytes where this rank has ", mine.nbytes(),
                      ": the ranks' collectives differ");
          // a copy: the bytes belong to `other`, gone after this iteration
          part = at::from_blob(const_cast<uint8_t*>(other.data()), mine.sizes(), mine.options())
                     .to(acc, /*non_blocking=*/false, /*copy=*/true);
        }
        result = !result.defined() ? part : sum ? result.add_(part) : at::maximum(result, part);
      }
      t.copy_(result);
      // The last rank to finish the round deletes its keys (stores without deletion keep them).
      if (store_->add(key(round, -1), 1) == getSize()) {
        for (int r = -1; r < getSize(); ++r) {
          try {
            store_->deleteKey(key(round, r));
          } catch (const std::exception&) {
            break;
          }
        }
      }
    }
    return c10::make_intrusive<Done>();
  }

 private:
  struct Done : c10d::Work {
    bool isCompleted() override { return true; }
    bool wait(std::chrono::milliseconds) override { return true; }
  };
  std::string key(int64_t round, int rank) const {
    return prefix_ + std::to_string(round) + "/" + (rank < 0 ? "done" : std::to_string(rank));
  }
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;  // the group's name: groups sharing a store keep their keys apart
  int64_t round_ = 0;
};

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> store_process_group(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                                           const std::string& name) {
  TORCH_CHECK_VALUE(store, "ampkit::distributed::store_process_group: store must not be null");
  TORCH_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size,
                    "ampkit::distributed::store_process_group: expected 0 <= "
                    "rank < size, but got rank ",
                    rank, " and size ", size);
  TORCH_CHECK_VALUE(!name.empty(), "ampkit::distributed::store_process_group: name must not be empty");
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  auto backend = c10::make_intrusive<StoreBackend>(store, rank, size, name);
  for (const auto device : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
    pg->setBackend(device, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  }
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  return pg;
}

}  // namespace ampkit::distributed
