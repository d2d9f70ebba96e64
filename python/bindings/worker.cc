// ecx._core: the worker side of the connector. Tensors cross as (data_ptr, nbytes,
// device) only; no libtorch here. Every call that may wait releases the GIL, and the
// allocate callback of start_load_caches takes it back to let Python create tensors.
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/common.h"
#include "ecx/connector/worker/worker_coordinator.h"
#include "ecx/core/clock.h"
#include "ecx/core/metrics.h"

namespace ecx::python {
namespace {

using worker::WorkerCoordinator;
using worker::WorkerMeta;

using LoadTuple = std::tuple<std::string, std::string, std::vector<std::int64_t>, std::string, bool>;
using PushTuple =
    std::tuple<std::string, std::string, std::vector<std::int64_t>, std::string, std::string, std::string>;
// (mm_hash, shape, dtype): a store load or a store candidate.
using StoreTuple = std::tuple<std::string, std::vector<std::int64_t>, std::string>;
// (loaded, failed_loads, reclaimed, pending_saves, failed_saves, store_ready, store_failed, store_dropped)
using Hashes = std::vector<std::string>;
using MetaTuple = std::tuple<Hashes, Hashes, Hashes, bool, Hashes, Hashes, Hashes, Hashes>;

MetaTuple meta_to_tuple(const WorkerMeta& m) {
  return {{m.loaded.begin(), m.loaded.end()},
          {m.failed_loads.begin(), m.failed_loads.end()},
          {m.reclaimed.begin(), m.reclaimed.end()},
          m.pending_saves,
          {m.failed_saves.begin(), m.failed_saves.end()},
          {m.store_ready.begin(), m.store_ready.end()},
          {m.store_failed.begin(), m.store_failed.end()},
          {m.store_dropped.begin(), m.store_dropped.end()}};
}

// Accepts the first five alone (older callers) or all eight.
WorkerMeta meta_from_tuple(const py::tuple& t) {
  if (t.size() != 5 && t.size() != 8) throw py::value_error("worker metadata must be a tuple of 5 or 8 fields");
  WorkerMeta m;
  auto into = [&](std::set<std::string>& out, std::size_t i) {
    for (auto& h : t[i].cast<Hashes>()) out.insert(std::move(h));
  };
  into(m.loaded, 0);
  into(m.failed_loads, 1);
  into(m.reclaimed, 2);
  m.pending_saves = t[3].cast<bool>();
  into(m.failed_saves, 4);
  if (t.size() == 8) {
    into(m.store_ready, 5);
    into(m.store_failed, 6);
    into(m.store_dropped, 7);
  }
  return m;
}

// A zero-copy load: a view of the landed slot that Python wraps as a tensor
// (torch.frombuffer keeps this object alive as long as the tensor). The slot goes back
// to the pool when the view is collected. It also keeps the worker coordinator (and
// with it the receive pool's memory) alive: a tensor may outlive the connector's
// shutdown.
struct SlotView {
  std::shared_ptr<WorkerCoordinator> owner;
  consumer::SlotLease lease;
};

// The Python objects (tensors) behind lent outputs (zero_copy_saves). ECX gives an
// output back on its dispatcher thread, which must not touch reference counts without
// the GIL (nor wait for it): the release only moves the object here, and the next hook
// on a Python thread drops what collected.
class LentOwners {
 public:
  void hand_back(py::object object) {
    std::lock_guard lock(mutex_);
    released_.push_back(std::move(object));  // a move: no reference count changes
  }
  // Under the GIL.
  void drop_released() {
    std::vector<py::object> dropping;
    {
      std::lock_guard lock(mutex_);
      dropping.swap(released_);
    }
  }

 private:
  std::mutex mutex_;
  std::vector<py::object> released_;
};

// One lent output's owner until ECX gives it back. Dropped without a release (an
// engine that ended without shutdown), it takes the GIL to let go.
class LentOwner {
 public:
  LentOwner(py::object object, std::shared_ptr<LentOwners> owners)
      : object_(std::move(object)), owners_(std::move(owners)) {}
  LentOwner(const LentOwner&) = delete;
  LentOwner& operator=(const LentOwner&) = delete;
  ~LentOwner() {
    if (!object_) return;
    py::gil_scoped_acquire gil;
    object_ = py::object();
  }
  void release() {
    std::lock_guard lock(mutex_);
    if (object_) owners_->hand_back(std::move(object_));
  }

 private:
  std::mutex mutex_;
  py::object object_;
  std::shared_ptr<LentOwners> owners_;
};

class PyWorker {
 public:
  explicit PyWorker(const Config& config) : max_tensor_bytes_(config.effective_max_tensor_bytes()) {
    py::gil_scoped_release release;  // pool allocation and registration, socket binds
    impl_ = std::shared_ptr<WorkerCoordinator>(value_or_raise(WorkerCoordinator::start(config)));
    impl_->export_metrics(metrics::Registry::global());
  }

  WorkerCoordinator& impl() {
    if (!impl_) throw std::runtime_error("the ECX worker coordinator is shut down");
    return *impl_;
  }

  // allocate(mm_hash, shape, dtype) -> (data_ptr, is_cuda, device_index)
  // adopt(mm_hash, SlotView) -> None, or None to copy into what allocate returns.
  std::pair<std::vector<std::string>, std::vector<std::string>> start_load_caches(
      const std::vector<LoadTuple>& loads, const std::vector<std::string>& present, const py::function& allocate,
      const std::vector<StoreTuple>& store_loads, const std::vector<StoreTuple>& store_prefetches,
      const py::object& adopt) {
    scheduler::ConnectorMeta meta;
    meta.loads.reserve(loads.size());
    for (const auto& [mm_hash, transfer_id, shape, dtype, local] : loads) {
      meta.loads.push_back(
          scheduler::LoadSpec{mm_hash, transfer_id, make_spec(shape, dtype, max_tensor_bytes_), local});
    }
    meta.store_loads.reserve(store_loads.size());
    for (const auto& [mm_hash, shape, dtype] : store_loads) {
      meta.store_loads.push_back(scheduler::StoreLoad{mm_hash, make_spec(shape, dtype, max_tensor_bytes_)});
    }
    meta.store_prefetches.reserve(store_prefetches.size());
    for (const auto& [mm_hash, shape, dtype] : store_prefetches) {
      meta.store_prefetches.push_back(scheduler::StoreLoad{mm_hash, make_spec(shape, dtype, max_tensor_bytes_)});
    }
    const std::unordered_set<std::string> in_cache(present.begin(), present.end());
    auto is_present = [&in_cache](const std::string& h) { return in_cache.contains(h); };
    auto destination = [&allocate](const scheduler::LoadSpec& load) -> Result<worker::LoadDestination> {
      py::gil_scoped_acquire gil;
      try {
        py::tuple r = allocate(load.mm_hash, load.spec.shape_vector(), dtype_of(load.spec));
        if (r.size() != 3) return invalid_argument("allocate must return (data_ptr, is_cuda, device)");
        const auto ptr = r[0].cast<std::uintptr_t>();
        if (ptr == 0) return invalid_argument("allocate returned a null data pointer");
        // Python hands tensors over as addresses.
        return worker::LoadDestination{reinterpret_cast<void*>(ptr),  // NOLINT(performance-no-int-to-ptr)
                                       r[1].cast<bool>(), r[2].cast<int>()};
      } catch (py::error_already_set& e) {
        return internal_error(std::string("allocate raised: ") + e.what());
      } catch (const py::cast_error& e) {
        return invalid_argument(std::string("allocate returned a bad value: ") + e.what());
      }
    };
    WorkerCoordinator::Adopt adopt_view;
    if (!adopt.is_none()) {
      adopt_view = [this, &adopt](const scheduler::LoadSpec& load, consumer::SlotLease lease) -> Status {
        py::gil_scoped_acquire gil;
        try {
          adopt(load.mm_hash, SlotView{impl_, std::move(lease)});
          return Status::ok();
        } catch (py::error_already_set& e) {
          return internal_error(std::string("adopt raised: ") + e.what());
        }
      };
    }
    WorkerCoordinator& w = impl();
    worker::LoadReport report;
    {
      py::gil_scoped_release release;  // takes, copies, CUDA stream waits
      report = w.start_load_caches(meta, destination, adopt_view, is_present);
    }
    return {std::move(report.loaded), std::move(report.failed)};
  }

  void start_save_caches(const std::vector<PushTuple>& pushes, const std::vector<StoreTuple>& store_candidates) {
    scheduler::ConnectorMeta meta;
    meta.store_candidates.reserve(store_candidates.size());
    for (const auto& [mm_hash, shape, dtype] : store_candidates) {
      meta.store_candidates.push_back(scheduler::StoreCandidate{mm_hash, make_spec(shape, dtype, max_tensor_bytes_)});
    }
    meta.pushes.reserve(pushes.size());
    for (const auto& [mm_hash, transfer_id, shape, dtype, consumer_zmq, request_id] : pushes) {
      meta.pushes.push_back(scheduler::PushSpec{mm_hash, make_spec(shape, dtype, max_tensor_bytes_), consumer_zmq,
                                                transfer_id, request_id});
    }
    WorkerCoordinator& w = impl();
    py::gil_scoped_release release;
    w.start_save_caches(meta);
  }

  // Returns None, or the reason the output could not be staged.
  std::optional<std::string> save_cache(const std::string& mm_hash, std::uintptr_t data_ptr, std::uint64_t nbytes,
                                        bool cuda) {
    if (data_ptr == 0 && nbytes > 0) throw py::value_error("save_cache: null data pointer");
    WorkerCoordinator& w = impl();
    Status s;
    {
      py::gil_scoped_release release;                                     // synchronous copy into the staging pool
      s = w.save_cache(mm_hash, reinterpret_cast<const void*>(data_ptr),  // NOLINT(performance-no-int-to-ptr)
                       nbytes, cuda ? producer::SourceMemory::cuda : producer::SourceMemory::host);
    }
    if (s) return std::nullopt;
    return s.to_string();
  }

  // Returns None, or the reason the output could not be bound. `owner` (the tensor)
  // is held until ECX has sent the bytes: with zero_copy_saves they are read in place.
  std::optional<std::string> lend_cache(const std::string& mm_hash, std::uintptr_t data_ptr, std::uint64_t nbytes,
                                        py::object owner) {
    if (data_ptr == 0 && nbytes > 0) throw py::value_error("lend_cache: null data pointer");
    lent_owners_->drop_released();
    WorkerCoordinator& w = impl();
    auto held = std::make_shared<LentOwner>(std::move(owner), lent_owners_);
    Status s;
    {
      py::gil_scoped_release release;                                     // registration (or the staging copy)
      s = w.lend_cache(mm_hash, reinterpret_cast<const void*>(data_ptr),  // NOLINT(performance-no-int-to-ptr)
                       nbytes, [held] { held->release(); });
    }
    lent_owners_->drop_released();  // copied instead: given back already
    if (s) return std::nullopt;
    return s.to_string();
  }

  void get_finished(const std::vector<std::string>& ids) {
    lent_owners_->drop_released();
    WorkerCoordinator& w = impl();
    py::gil_scoped_release release;
    w.get_finished(ids);
  }

  std::optional<MetaTuple> build_worker_meta() {
    WorkerCoordinator& w = impl();
    std::optional<WorkerMeta> m;
    {
      py::gil_scoped_release release;
      m = w.build_worker_meta();
    }
    if (!m) return std::nullopt;
    return meta_to_tuple(*m);
  }

  py::dict counters() {
    py::dict d;
    WorkerCoordinator& w = impl();
    if (auto* shard = w.shard()) {
      const auto c = shard->counters().reservations;
      d["pool_capacity"] = c.pool_capacity;
      d["pool_used_bytes"] = c.pool_used_bytes;
      d["resident_bytes"] = c.resident_bytes;
      d["live_records"] = c.live_records;
      d["leases"] = c.leases;
      d["landings_ready"] = c.landings_ready;
      d["taken"] = c.taken;
      d["checksum_mismatches"] = c.checksum_mismatches;
      d["invalid_transitions"] = c.invalid_transitions;
      const Status inv = shard->check_invariants();
      d["invariants"] = inv ? std::string() : inv.message();
    }
    if (auto* engine = w.push_engine()) {
      const auto c = engine->counters();
      d["pushes_submitted"] = c.submitted;
      d["sources_bound"] = c.sources_bound;
      d["sources_unused"] = c.sources_unused;
      d["sources_lent"] = c.sources_lent;
      d["staging_failures"] = c.staging_failures;
      d["bytes_staged"] = c.bytes_staged;
      d["staging_used_bytes"] = c.staging_used_bytes;
      d["pushes_pending"] = engine->pending();
    }
    return d;
  }

  py::dict store_counters() {
    const worker::StoreWorkerCounters c = impl().store_counters();
    py::dict d;
    d["prefetched"] = c.prefetched;
    d["prefetch_failures"] = c.prefetch_failures;
    d["prefetch_dropped"] = c.prefetch_dropped;
    d["prefetch_held_bytes"] = c.prefetch_held_bytes;
    d["loads"] = c.loads;
    d["load_failures"] = c.load_failures;
    d["bytes_loaded"] = c.bytes_loaded;
    d["offered"] = c.offered;
    d["published"] = c.published;
    d["bytes_published"] = c.bytes_published;
    d["publish_dropped"] = c.publish_dropped;
    d["publish_failed"] = c.publish_failed;
    d["store_errors"] = c.store_errors;
    d["rejected"] = c.rejected;
    return d;
  }

  bool wait_published(double timeout_s) {
    WorkerCoordinator& w = impl();
    const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(seconds_to_duration(timeout_s));
    py::gil_scoped_release release;
    return w.wait_published(timeout);
  }

  std::optional<std::string> control_endpoint() {
    auto* shard = impl().shard();
    if (!shard) return std::nullopt;
    return shard->control_endpoint();
  }

  bool reports() { return impl().reports(); }
  bool is_shut_down() const noexcept { return impl_ == nullptr; }

  void shutdown() {
    if (!impl_) return;
    {
      py::gil_scoped_release release;  // drains writers, joins threads
      impl_->shutdown();
      impl_.reset();
    }
    lent_owners_->drop_released();  // the shutdown gave back every lent output
  }

 private:
  std::uint64_t max_tensor_bytes_;
  std::shared_ptr<WorkerCoordinator> impl_;  // shared with the SlotViews Python still holds
  std::shared_ptr<LentOwners> lent_owners_ = std::make_shared<LentOwners>();
};

}  // namespace

void register_worker(py::module_& m) {
  py::class_<SlotView>(m, "SlotView", py::buffer_protocol(),
                       "A landed slot lent to the engine (zero_copy_loads): a writable buffer of its bytes. The "
                       "slot goes back to the pool when this object is collected.")
      .def_buffer([](SlotView& v) {
        if (!v.lease) throw py::value_error("this slot view was released");
        return py::buffer_info(v.lease.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(v.lease.nbytes())}, {1});
      })
      .def_property_readonly("nbytes", [](const SlotView& v) { return v.lease.nbytes(); })
      .def_property_readonly("mm_hash", [](const SlotView& v) { return v.lease.mm_hash(); });
  py::class_<PyWorker>(m, "WorkerCoordinator", "The connector's worker-side logic for one TP/PP rank.")
      .def(py::init<const Config&>(), py::arg("config"),
           "Starts the consumer shard (consumer, first PP stage) and/or the push engine (producer).")
      .def("start_load_caches", &PyWorker::start_load_caches, py::arg("loads"), py::arg("present"), py::arg("allocate"),
           py::arg("store_loads") = std::vector<StoreTuple>{}, py::arg("store_prefetches") = std::vector<StoreTuple>{},
           py::arg("adopt") = py::none(),
           "loads: [(mm_hash, transfer_id, shape, dtype, local)]; present: hashes already in the encoder cache; "
           "allocate(mm_hash, shape, dtype) -> (data_ptr, is_cuda, device); store_loads: [(mm_hash, shape, dtype)] "
           "read from the shared store (producer with cross_encoder_cache); adopt(mm_hash, SlotView): when given, "
           "loads hand over views of the landed slots instead of copying (zero_copy_loads). Returns (loaded, "
           "failed).")
      .def("start_save_caches", &PyWorker::start_save_caches, py::arg("pushes"),
           py::arg("store_candidates") = std::vector<StoreTuple>{},
           "pushes: [(mm_hash, transfer_id, shape, dtype, consumer_zmq, request_id)]; store_candidates: [(mm_hash, "
           "shape, dtype)] that save_cache publishes to the shared store (producer with cross_encoder_cache).")
      .def("save_cache", &PyWorker::save_cache, py::arg("mm_hash"), py::arg("data_ptr"), py::arg("nbytes"),
           py::arg("cuda") = false,
           "Copies the encoder output into the staging pool now (the caller may free it after the call). Returns "
           "None, or why it could not be staged.")
      .def("lend_cache", &PyWorker::lend_cache, py::arg("mm_hash"), py::arg("data_ptr"), py::arg("nbytes"),
           py::arg("owner"),
           "A host output sent from its own memory with zero_copy_saves (else copied): `owner` (the tensor) is "
           "held until ECX is done with the bytes. Returns None, or why it could not be bound.")
      .def("get_finished", &PyWorker::get_finished, py::arg("finished_request_ids"))
      .def("build_worker_meta", &PyWorker::build_worker_meta,
           "(loaded, failed_loads, reclaimed, pending_saves, failed_saves), or None on ranks that do not report.")
      .def("counters", &PyWorker::counters)
      .def("store_counters", &PyWorker::store_counters,
           "The cross-encoder cache's counters (all zero without it): loads, load_failures, bytes_loaded, offered, "
           "published, bytes_published, publish_dropped, publish_failed, store_errors, rejected.")
      .def("wait_published", &PyWorker::wait_published, py::arg("timeout_s"),
           "Waits (real time) until every offered output is published or dropped; False on timeout.")
      .def_property_readonly("control_endpoint", &PyWorker::control_endpoint)
      .def_property_readonly("reports", &PyWorker::reports)
      .def_property_readonly("closed", &PyWorker::is_shut_down)
      .def("shutdown", &PyWorker::shutdown, "Stops threads, drains writers, frees registrations. Idempotent.");

  m.def(
      "aggregate_worker_meta",
      [](const py::tuple& a, const py::tuple& b) {
        return meta_to_tuple(meta_from_tuple(a).aggregate(meta_from_tuple(b)));
      },
      py::arg("a"), py::arg("b"), "The C++ rule for folding two ranks' reports (reference for the Python class).");
}

}  // namespace ecx::python
