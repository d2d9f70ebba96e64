// ecx._core: the scheduler side of the connector. RequestView is built once per
// engine request by the Python layer (and cached there); the coordinator's hooks take
// it as is, so a hook costs one call across the boundary.
#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/common.h"
#include "ecx/connector/scheduler/coordinator.h"
#include "ecx/connector/worker/scheduler_links.h"
#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/dtype.h"
#include "ecx/core/metrics.h"
#include "ecx/core/metrics_server.h"

namespace ecx::python {
namespace {

using scheduler::ConnectorMeta;
using scheduler::MmFeature;
using scheduler::RequestView;
using scheduler::SchedulerCoordinator;

constexpr std::uint64_t kAnySize = std::numeric_limits<std::uint64_t>::max();

// (identifier, modality, offset, length, num_encoder_embeds[, shape, dtype][, has_media])
MmFeature feature_from(const py::handle& item) {
  auto t = py::reinterpret_borrow<py::tuple>(item);
  if (t.size() < 5 || t.size() > 8) {
    throw py::value_error(
        "a feature is (identifier, modality, offset, length, num_encoder_embeds[, shape, dtype][, has_media])");
  }
  MmFeature f;
  f.identifier = t[0].cast<std::string>();
  f.modality = t[1].cast<std::string>();
  f.offset = t[2].cast<std::int64_t>();
  f.length = t[3].cast<std::int64_t>();
  f.num_encoder_embeds = t[4].cast<std::int64_t>();
  if (t.size() >= 7 && !t[5].is_none()) {
    f.output_spec = make_spec(t[5].cast<std::vector<std::int64_t>>(), t[6].cast<std::string>(), kAnySize);
  }
  if (t.size() == 6 || t.size() == 8) f.has_media = t[t.size() - 1].cast<bool>();
  return f;
}

py::tuple meta_to_python(const ConnectorMeta& meta) {
  py::list candidates;
  for (const auto& c : meta.store_candidates)
    candidates.append(py::make_tuple(c.mm_hash, shape_of(c.spec), dtype_of(c.spec)));
  py::list pushes;
  for (const auto& p : meta.pushes) {
    pushes.append(
        py::make_tuple(p.mm_hash, p.transfer_id, shape_of(p.spec), dtype_of(p.spec), p.consumer_zmq, p.request_id));
  }
  py::list loads;
  for (const auto& l : meta.loads) {
    loads.append(py::make_tuple(l.mm_hash, l.transfer_id, shape_of(l.spec), dtype_of(l.spec), l.local));
  }
  py::list store_loads;
  for (const auto& l : meta.store_loads)
    store_loads.append(py::make_tuple(l.mm_hash, shape_of(l.spec), dtype_of(l.spec)));
  py::list store_prefetches;
  for (const auto& l : meta.store_prefetches)
    store_prefetches.append(py::make_tuple(l.mm_hash, shape_of(l.spec), dtype_of(l.spec)));
  // The store parts last: callers unpack the first six by position.
  return py::make_tuple(meta.freed, meta.orphan_cancels, candidates, pushes, loads, meta.retained, store_loads,
                        store_prefetches);
}

py::dict stats_to_python(const scheduler::CoordinatorStats& s) {
  py::dict d;
  d["drains"] = s.drains;
  d["events_received"] = s.events_received;
  d["events_malformed"] = s.events_malformed;
  d["ready_accepted"] = s.ready_accepted;
  d["ready_ignored"] = s.ready_ignored;
  d["awaiting_shards"] = s.awaiting_shards;
  d["partial_dropped"] = s.partial_dropped;
  d["abandoned_events"] = s.abandoned_events;
  d["failed_events"] = s.failed_events;
  d["pushes_planned"] = s.pushes_planned;
  d["push_conflicts"] = s.push_conflicts;
  d["unresolved_transfer_ids"] = s.unresolved_transfer_ids;
  d["malformed_requests"] = s.malformed_requests;
  d["cancels_queued"] = s.cancels_queued;
  d["cancels_succeeded"] = s.cancels_succeeded;
  d["cancels_failed"] = s.cancels_failed;
  d["cancels_dropped"] = s.cancels_dropped;
  d["cancels_local_only"] = s.cancels_local_only;
  d["cancels_abandoned"] = s.cancels_abandoned;
  d["readiness_rechecks"] = s.readiness_rechecks;
  d["rechecks_failed"] = s.rechecks_failed;
  d["readiness_recovered"] = s.readiness_recovered;
  d["alloc_loads"] = s.alloc_loads;
  d["alloc_load_misses"] = s.alloc_load_misses;
  d["rechecks_remembered"] = s.rechecks_remembered;
  d["local_fallbacks"] = s.local_fallbacks;
  d["stranded_items"] = s.stranded_items;
  d["store_lookups"] = s.store_lookups;
  d["store_hits"] = s.store_hits;
  d["store_prefetches"] = s.store_prefetches;
  d["store_prefetch_failures"] = s.store_prefetch_failures;
  d["store_prefetch_timeouts"] = s.store_prefetch_timeouts;
  d["store_loads"] = s.store_loads;
  d["store_load_failures"] = s.store_load_failures;
  d["subscription_malformed"] = s.subscription_malformed;
  d["subscription_unknown_kind"] = s.subscription_unknown_kind;
  d["subscription_auth_failures"] = s.subscription_auth_failures;
  d["discoveries_started"] = s.discoveries_started;
  d["discoveries_failed"] = s.discoveries_failed;
  return d;
}

// Owns the coordinator; close() is idempotent and every hook after it is a no-op
// answer, so an engine that keeps calling during shutdown cannot crash.
//
// Loads the connector confirms on the engine's behalf (vLLM versions whose workers
// never report them) are held here and confirmed before the next hook that reads
// the state, so the Python layer needs no per-call bookkeeping of its own.
class PyScheduler {
 public:
  PyScheduler(const Config& config, const std::string& model_dtype, std::int64_t model_hidden_width,
              const std::shared_ptr<ManualClock>& clock) {
    const DType dtype = value_or_raise(parse_dtype(model_dtype));
    std::shared_ptr<const Clock> c = clock ? std::shared_ptr<const Clock>(clock) : SteadyClock::shared();
    py::gil_scoped_release release;  // socket setup
    impl_ = value_or_raise(worker::make_scheduler_coordinator(config, dtype, model_hidden_width, std::move(c)));
  }

  // For the hooks that read the coordinator's state: deferred confirmations first.
  SchedulerCoordinator& current() {
    SchedulerCoordinator& c = impl();
    if (!loads_to_confirm_.empty()) confirm_deferred_loads(c);
    return c;
  }
  SchedulerCoordinator& impl() {
    if (!impl_) throw std::runtime_error("the ECX scheduler coordinator is closed");
    return *impl_;
  }
  bool open() const noexcept { return impl_ != nullptr; }

  // The hook vLLM calls most: open() and the deferred loads checked inline.
  bool has_cache_item(std::string_view identifier) {
    if (!impl_) return false;
    return current().has_cache_item(identifier);
  }

  void confirm_loads_later(const std::vector<std::string>& hashes) {
    loads_to_confirm_.insert(loads_to_confirm_.end(), hashes.begin(), hashes.end());
  }
  std::size_t loads_awaiting_confirmation() const noexcept { return loads_to_confirm_.size(); }

  // Every report passes through here, so the last pending_saves is the worker's latest.
  void update_connector_output(const scheduler::WorkerOutput& out) {
    pending_saves_ = out.pending_saves;
    impl().update_connector_output(out);
  }

  // An endpoint of the scheduler's own: vLLM runs the scheduler in its EngineCore
  // process, which need not hold a worker (TP > 1). Its ecx_scheduler_* metrics come
  // from a registry of its own (a worker's endpoint in the same process would otherwise
  // show them twice); the process's other ECX metrics (the stage histograms the
  // scheduler records, event_delivery) are added while no worker endpoint of this
  // process serves them.
  int serve_metrics(const std::string& host, int port) {
    SchedulerCoordinator& c = impl();
    if (metrics_server_) throw std::runtime_error("the ECX scheduler already serves its metrics");
    auto registry = std::make_unique<metrics::Registry>();
    c.export_metrics(*registry);     // the registry is the scheduler's alone: the collector goes with it
    py::gil_scoped_release release;  // binds a socket, starts a thread
    auto server = value_or_raise(
        metrics::MetricsServer::start(*registry, host, port, metrics::ServeOptions{.global_when_unserved = true}));
    metrics_registry_ = std::move(registry);
    metrics_server_ = std::move(server);
    return metrics_server_->port();
  }

  void close() {
    if (!impl_) return;
    loads_to_confirm_.clear();
    py::gil_scoped_release release;  // joins the cancel executor
    impl_->close();
    impl_.reset();
    if (metrics_server_) metrics_server_->stop();
  }

 private:
  void confirm_deferred_loads(SchedulerCoordinator& c) {
    std::vector<std::string> loaded = std::move(loads_to_confirm_);
    loads_to_confirm_.clear();
    std::sort(loaded.begin(), loaded.end());
    loaded.erase(std::unique(loaded.begin(), loaded.end()), loaded.end());
    scheduler::WorkerOutput out;
    out.loaded = std::move(loaded);
    out.pending_saves = pending_saves_;
    c.update_connector_output(out);
  }

  std::unique_ptr<SchedulerCoordinator> impl_;
  // Declared in this order: the server reads the registry until it is stopped.
  std::unique_ptr<metrics::Registry> metrics_registry_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_;
  std::vector<std::string> loads_to_confirm_;
  bool pending_saves_ = false;
};

// has_cache_item as a plain CPython function (METH_FASTCALL) bound to one
// scheduler: vLLM asks it for every item of every waiting request each step, and
// pybind11's general dispatch (argument loaders, type lookups, a heap-allocated
// flag vector per call) cost more than the lookup itself.
constexpr const char* kBoundSchedulerCapsule = "ecx._core.BoundScheduler";

struct BoundScheduler {
  py::object owner;  // keeps the SchedulerCoordinator object (and so `scheduler`) alive
  PyScheduler* scheduler = nullptr;
};

PyObject* fast_has_cache_item(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1 || !PyUnicode_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "has_cache_item(identifier): identifier must be one str");
    return nullptr;
  }
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(args[0], &size);
  if (data == nullptr) return nullptr;
  auto* bound = static_cast<BoundScheduler*>(PyCapsule_GetPointer(self, kBoundSchedulerCapsule));
  if (bound == nullptr) return nullptr;
  try {
    if (bound->scheduler->has_cache_item(std::string_view(data, static_cast<std::size_t>(size)))) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyMethodDef fast_has_cache_item_def = {
    "has_cache_item", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_has_cache_item)), METH_FASTCALL,
    "has_cache_item(identifier) -> bool: whether the item can be served without encoding it."};

void release_bound_scheduler(PyObject* capsule) {
  // Reclaims what bound_has_cache_item handed to the capsule.
  std::unique_ptr<BoundScheduler> bound(
      static_cast<BoundScheduler*>(PyCapsule_GetPointer(capsule, kBoundSchedulerCapsule)));
}

py::object bound_has_cache_item(const py::object& owner) {
  auto bound = std::make_unique<BoundScheduler>();
  bound->owner = owner;
  bound->scheduler = &owner.cast<PyScheduler&>();
  auto capsule =
      py::reinterpret_steal<py::object>(PyCapsule_New(bound.get(), kBoundSchedulerCapsule, &release_bound_scheduler));
  if (!capsule) throw py::error_already_set();
  bound.release();  // NOLINT(bugprone-unused-return-value): the capsule owns it now
  auto function = py::reinterpret_steal<py::object>(PyCFunction_New(&fast_has_cache_item_def, capsule.ptr()));
  if (!function) throw py::error_already_set();
  return function;
}

}  // namespace

void register_scheduler(py::module_& m) {
  py::class_<ManualClock, std::shared_ptr<ManualClock>>(m, "ManualClock", "A clock that moves only when told (tests).")
      .def(py::init<>())
      .def(
          "advance", [](ManualClock& c, double seconds) { c.advance(seconds_to_duration(seconds)); },
          py::arg("seconds"));

  py::class_<RequestView>(m, "RequestView", "What the scheduler coordinator knows about one engine request.")
      .def(py::init([](const std::string& request_id, const py::sequence& features,
                       const std::optional<std::string>& ec_transfer_params_json) {
             RequestView v;
             v.request_id = request_id;
             v.mm_features.reserve(features.size());
             for (const auto& f : features) v.mm_features.push_back(feature_from(f));
             if (ec_transfer_params_json) v.set_ec_transfer_params_text(*ec_transfer_params_json);
             return v;
           }),
           py::arg("request_id"), py::arg("features"), py::arg("ec_transfer_params_json") = std::nullopt,
           "features: (identifier, modality, offset, length, num_encoder_embeds[, shape, dtype][, has_media]) per "
           "item; "
           "ec_transfer_params_json: the request's ec_transfer_params as JSON text (None = absent).")
      .def_readonly("request_id", &RequestView::request_id)
      .def_property_readonly("num_features", [](const RequestView& v) { return v.mm_features.size(); })
      .def_property_readonly("has_params", [](const RequestView& v) { return v.ec_transfer_params.has_value(); })
      .def_property_readonly("has_malformed_params", &RequestView::has_malformed_params)
      .def_readonly("ec_transfer_params_error", &RequestView::ec_transfer_params_error)
      .def("identifier", [](const RequestView& v, std::size_t i) { return v.mm_features.at(i).identifier; });

  py::class_<PyScheduler>(m, "SchedulerCoordinator",
                          "The connector's scheduler-side logic (never blocks on the network).")
      .def(py::init<const Config&, const std::string&, std::int64_t, std::shared_ptr<ManualClock>>(), py::arg("config"),
           py::arg("model_dtype") = "bfloat16", py::arg("model_hidden_width") = 0, py::arg("clock") = nullptr)
      .def("has_cache_item", [](PyScheduler& s, std::string_view id) { return s.has_cache_item(id); })
      .def_property_readonly("fast_has_cache_item", &bound_has_cache_item,
                             "has_cache_item as a plain function bound to this scheduler (the same answers, without "
                             "the general binding's per-call cost); it keeps the scheduler alive and answers False "
                             "once it is closed.")
      .def("ensure_cache_available", [](PyScheduler& s, const RequestView& r,
                                        std::int64_t n) { return s.current().ensure_cache_available(r, n); })
      .def("update_state_after_alloc",
           [](PyScheduler& s, const RequestView& r, std::size_t i) { s.current().update_state_after_alloc(r, i); })
      .def("update_state_after_free",
           [](PyScheduler& s, const RequestView& r, std::size_t i) { s.impl().update_state_after_free(r, i); })
      .def(
          "build_connector_meta",
          [](PyScheduler& s, std::vector<std::string> free_hashes, std::vector<std::string> preempted) {
            scheduler::StepView step{std::move(free_hashes), std::move(preempted)};
            return meta_to_python(s.current().build_connector_meta(step));
          },
          py::arg("free_encoder_mm_hashes"), py::arg("preempted_request_ids") = std::vector<std::string>{},
          "Returns (freed, orphan_cancels, store_candidates[(mm_hash, shape, dtype)], "
          "pushes[(mm_hash, transfer_id, shape, dtype, consumer_zmq, request_id)], "
          "loads[(mm_hash, transfer_id, shape, dtype, local)], retained, store_loads[(mm_hash, shape, dtype)], "
          "store_prefetches[(mm_hash, shape, dtype)]).")
      .def(
          "update_connector_output",
          [](PyScheduler& s, std::vector<std::string> loaded, std::vector<std::string> failed_loads,
             std::vector<std::string> reclaimed, bool pending_saves, std::vector<std::string> failed_saves,
             std::vector<std::string> store_ready, std::vector<std::string> store_failed,
             std::vector<std::string> store_dropped) {
            scheduler::WorkerOutput out{std::move(loaded),       std::move(failed_loads), std::move(reclaimed),
                                        pending_saves,           std::move(failed_saves), std::move(store_ready),
                                        std::move(store_failed), std::move(store_dropped)};
            s.update_connector_output(out);
          },
          py::arg("loaded"), py::arg("failed_loads"), py::arg("reclaimed"), py::arg("pending_saves"),
          py::arg("failed_saves"), py::arg("store_ready") = std::vector<std::string>{},
          py::arg("store_failed") = std::vector<std::string>{}, py::arg("store_dropped") = std::vector<std::string>{})
      .def(
          "request_finished",
          [](PyScheduler& s, const RequestView& r) -> std::pair<bool, std::optional<std::string>> {
            auto result = s.impl().request_finished(r);
            return {result.delay_free, std::move(result.params)};
          },
          "Returns (delay_free, params as JSON text or None).")
      .def("confirm_loads_later", &PyScheduler::confirm_loads_later, py::arg("mm_hashes"),
           "Loads that ran where no worker report will confirm them: confirmed (as loaded, with the last reported "
           "pending_saves) before the next has_cache_item, ensure_cache_available, update_state_after_alloc or "
           "build_connector_meta.")
      .def_property_readonly("loads_awaiting_confirmation", &PyScheduler::loads_awaiting_confirmation)
      .def("take_unavailable_requests", [](PyScheduler& s) { return s.impl().take_unavailable_requests(); })
      .def("has_pending_push_work", [](PyScheduler& s) { return s.open() && s.impl().has_pending_push_work(); })
      .def(
          "set_asynchronous_loads", [](PyScheduler& s, bool on) { s.impl().set_asynchronous_loads(on); }, py::arg("on"),
          "True: the gate starts loads and waits for the workers' reports (the engine runs the connector on steps "
          "without tokens and reports every step). False: landed items pass the gate and load in the step that "
          "allocates them.")
      .def(
          "set_unavailable_reaches_engine",
          [](PyScheduler& s, bool on) { s.impl().set_unavailable_reaches_engine(on); }, py::arg("on"),
          "Whether the engine fails the requests take_unavailable_requests returns; without it an item whose push "
          "cannot arrive is encoded locally when the request carries its media.")
      .def_property_readonly("asynchronous_loads", [](PyScheduler& s) { return s.impl().options().asynchronous_loads; })
      .def("stats", [](PyScheduler& s) { return stats_to_python(s.impl().stats()); })
      .def_property_readonly("closed", [](const PyScheduler& s) { return !s.open(); })
      .def("serve_metrics", &PyScheduler::serve_metrics, py::arg("host"), py::arg("port"),
           "Serves this scheduler's ecx_scheduler_* metrics (as of its last step) over HTTP on host:port (0 picks a "
           "free port) until close(); returns the port.")
      .def("close", &PyScheduler::close, "Joins the cancel executor, closes the sockets. Idempotent.");
}

}  // namespace ecx::python
