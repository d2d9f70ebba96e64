#pragma once
// Errors as values. Hot paths return Status / Result<T>; exceptions are only thrown
// at boundaries (CLI, Python) by converting a Status.

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace ecx {

enum class StatusCode : unsigned char {
  ok = 0,
  invalid_argument,
  not_found,
  conflict,
  unavailable,
  timeout,
  resource_exhausted,
  cancelled,
  protocol,
  internal,
};

std::string_view status_code_name(StatusCode code) noexcept;
// Parses a name produced by status_code_name; nullopt for anything else.
std::optional<StatusCode> parse_status_code(std::string_view name) noexcept;

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }

  bool is_ok() const noexcept { return code_ == StatusCode::ok; }
  explicit operator bool() const noexcept { return is_ok(); }
  StatusCode code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }
  // "<code>: <message>" (or "ok").
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::ok;
  std::string message_;
};

inline bool operator==(const Status& a, const Status& b) { return a.code() == b.code() && a.message() == b.message(); }

Status invalid_argument(std::string message);
Status not_found(std::string message);
Status conflict(std::string message);
Status unavailable(std::string message);
Status timeout_error(std::string message);
Status resource_exhausted(std::string message);
Status cancelled(std::string message);
Status protocol_error(std::string message);
Status internal_error(std::string message);

// strerror(err) for messages, safe to call from any thread (std::strerror is not).
std::string errno_text(int err);

// A value or an error Status (never an ok Status).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : data_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : data_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!std::get<Status>(data_).is_ok() && "Result built from an ok Status");
    if (std::get<Status>(data_).is_ok()) {
      data_ = Status(StatusCode::internal, "Result built from an ok Status");
    }
  }

  bool is_ok() const noexcept { return std::holds_alternative<T>(data_); }
  explicit operator bool() const noexcept { return is_ok(); }

  const T& value() const& { return std::get<T>(data_); }
  T& value() & { return std::get<T>(data_); }
  T&& value() && { return std::get<T>(std::move(data_)); }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  const T* operator->() const { return &value(); }
  T* operator->() { return &value(); }

  // The error; Status::ok() when a value is held.
  Status status() const { return is_ok() ? Status::ok() : std::get<Status>(data_); }

  template <typename U>
  T value_or(U&& fallback) const& {
    return is_ok() ? value() : static_cast<T>(std::forward<U>(fallback));
  }

 private:
  std::variant<T, Status> data_;
};

}  // namespace ecx

// Propagate an error Status from an expression returning Status.
#define ECX_RETURN_IF_ERROR(expr)                 \
  do {                                            \
    ::ecx::Status ecx_status_ = (expr);           \
    if (!ecx_status_.is_ok()) return ecx_status_; \
  } while (0)
