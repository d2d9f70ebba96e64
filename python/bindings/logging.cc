// ecx._core: C++ log records delivered to Python's `logging` (logger "ecx.<component>").
//
// The spdlog sink never touches the GIL: it only queues the formatted record. One
// delivery thread, owned here, takes the GIL to hand records to Python. Taking the
// GIL inside the sink could deadlock: a C++ thread holding spdlog's sink mutex would
// wait for the GIL while the Python thread, holding the GIL, waits for that mutex to
// log its own line. detach() (run from atexit, before the interpreter finalizes)
// stops the thread, so nothing reaches for the GIL of a dying interpreter.
#include <Python.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <pybind11/pybind11.h>
#include <spdlog/details/null_mutex.h>
#include <spdlog/sinks/base_sink.h>

#include "bindings/common.h"
#include "core/logging.h"

namespace ecx::python {
namespace {

constexpr std::size_t kMaxQueuedRecords = 16'384;
constexpr auto kIdleWake = std::chrono::milliseconds(200);

struct Record {
  std::string logger;
  int level = 20;  // Python's numeric levels
  std::string text;
};

int python_level(spdlog::level::level_enum level) {
  switch (level) {
    case spdlog::level::trace:
      return 5;
    case spdlog::level::debug:
      return 10;
    case spdlog::level::info:
      return 20;
    case spdlog::level::warn:
      return 30;
    case spdlog::level::err:
      return 40;
    case spdlog::level::critical:
      return 50;
    default:
      return 20;
  }
}

bool interpreter_usable() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() != 0 && Py_IsFinalizing() == 0;
#else
  return Py_IsInitialized() != 0 && _Py_IsFinalizing() == 0;
#endif
}

// Bounded queue plus its delivery thread. Created by attach(), stopped by detach().
class Bridge {
 public:
  Bridge() : thread_([this] { run(); }) {}
  ~Bridge() { stop(); }
  Bridge(const Bridge&) = delete;
  Bridge& operator=(const Bridge&) = delete;

  void push(Record record) {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      if (queue_.size() >= kMaxQueuedRecords) {
        queue_.pop_front();  // drop the oldest, say so later
        ++dropped_;
      }
      queue_.push_back(std::move(record));
      ++enqueued_;
    }
    wake_.notify_one();
  }

  // Waits (GIL released by the caller) until everything queued before the call was
  // handed to Python, or the timeout. True when caught up.
  bool flush(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    const std::uint64_t target = enqueued_;
    wake_.notify_one();
    return delivered_cv_.wait_for(lock, timeout, [&] { return delivered_ >= target || stopping_; });
  }

  // Stops and joins the thread (caller must not hold the GIL); returns what was
  // still queued so the caller can deliver it itself.
  std::vector<Record> stop() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
    std::lock_guard lock(mutex_);
    std::vector<Record> rest(std::make_move_iterator(queue_.begin()), std::make_move_iterator(queue_.end()));
    queue_.clear();
    return rest;
  }

  static void deliver(std::vector<Record>& batch, std::uint64_t dropped) {
    if (!interpreter_usable()) return;
    py::gil_scoped_acquire gil;
    try {
      py::object get_logger = py::module_::import("logging").attr("getLogger");
      if (dropped > 0) {
        get_logger("ecx").attr("log")(30, "%s ECX log records were dropped (the Python log bridge fell behind)",
                                      dropped);
      }
      for (auto& r : batch) get_logger(r.logger).attr("log")(r.level, "%s", r.text);
    } catch (py::error_already_set& e) {
      // A failing handler costs its records, never the process.
      e.discard_as_unraisable("ecx log bridge");
    }
  }

 private:
  void run() {
    std::vector<Record> batch;
    for (;;) {
      std::uint64_t dropped = 0;
      std::uint64_t taken = 0;
      {
        std::unique_lock lock(mutex_);
        wake_.wait_for(lock, kIdleWake, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        batch.assign(std::make_move_iterator(queue_.begin()), std::make_move_iterator(queue_.end()));
        queue_.clear();
        dropped = std::exchange(dropped_, 0);
        taken = batch.size();
      }
      if (taken > 0 || dropped > 0) deliver(batch, dropped);
      batch.clear();
      {
        std::lock_guard lock(mutex_);
        delivered_ += taken + dropped;  // dropped records count as handled
      }
      delivered_cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable delivered_cv_;
  std::deque<Record> queue_;
  std::uint64_t enqueued_ = 0;
  std::uint64_t delivered_ = 0;
  std::uint64_t dropped_ = 0;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after every member above exists
};

std::mutex g_bridge_mutex;
std::shared_ptr<Bridge> g_bridge;  // guarded by g_bridge_mutex

std::shared_ptr<Bridge> current_bridge() {
  std::lock_guard lock(g_bridge_mutex);
  return g_bridge;
}

// The spdlog side: format-free, GIL-free, just a hand-off to the bridge.
class QueueSink final : public spdlog::sinks::base_sink<spdlog::details::null_mutex> {
 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    auto bridge = current_bridge();
    if (!bridge) return;
    bridge->push(Record{std::string(msg.logger_name.data(), msg.logger_name.size()), python_level(msg.level),
                        std::string(msg.payload.data(), msg.payload.size())});
  }
  void flush_() override {}
};

void attach() {
  {
    std::lock_guard lock(g_bridge_mutex);
    if (g_bridge) return;
    g_bridge = std::make_shared<Bridge>();
  }
  ecx::log::set_sink(std::make_shared<QueueSink>());
}

void detach() {
  std::shared_ptr<Bridge> bridge;
  {
    std::lock_guard lock(g_bridge_mutex);
    bridge = std::move(g_bridge);
  }
  ecx::log::set_sink(nullptr);  // back to stderr for whatever logs after this
  if (!bridge) return;
  std::vector<Record> rest;
  {
    py::gil_scoped_release release;  // the delivery thread may be waiting for the GIL
    rest = bridge->stop();
  }
  Bridge::deliver(rest, 0);
}

}  // namespace

void register_logging(py::module_& m) {
  m.def("attach_python_logging", &attach,
        "Route ECX's C++ log records to Python's logging (loggers 'ecx.<component>'). Idempotent.");
  m.def("detach_python_logging", &detach,
        "Stop routing C++ log records to Python (they go to stderr again); delivers what is queued. Idempotent.");
  m.def(
      "flush_logs",
      [](double timeout_s) {
        auto bridge = current_bridge();
        if (!bridge) return true;
        py::gil_scoped_release release;
        return bridge->flush(std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000)));
      },
      py::arg("timeout_s") = 1.0, "Wait until queued C++ log records reached Python's logging; True when caught up.");
  m.def(
      "set_log_level",
      [](const std::string& name) { ecx::log::set_level(value_or_raise(ecx::log::parse_level(name))); },
      py::arg("name"), "Level of every ECX C++ logger (ECX_LOG_LEVEL, when set, wins).");
  m.def(
      "log_message",
      [](const std::string& component, const std::string& level, const std::string& text) {
        ecx::log::get(component)->log(value_or_raise(ecx::log::parse_level(level)), "{}", text);
      },
      py::arg("component"), py::arg("level"), py::arg("text"), "Log through ECX's C++ loggers (diagnostics, tests).");
}

}  // namespace ecx::python
