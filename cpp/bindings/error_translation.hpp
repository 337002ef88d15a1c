// Turns kvcached's C++ exceptions into the Python exceptions of kvcached.errors.
// Every extension module (core and GPU backends) installs it once at import.
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include "kvcached/error.hpp"

namespace kvcached::bindings {

namespace nb = nanobind;

// Looked up lazily so that importing an extension module never imports the
// package (stub generation imports the bare module).
inline nb::object python_error_class(const char* name) { return nb::module_::import_("kvcached.errors").attr(name); }

inline void raise_driver_error(const char* class_name, const DriverError& e) {
  nb::object cls = python_error_class(class_name);
  nb::object exc = cls(nb::str(e.what()));
  exc.attr("backend") = nb::str(e.backend().c_str());
  exc.attr("call") = nb::str(e.call().c_str());
  exc.attr("code") = nb::int_(e.code());
  exc.attr("driver_message") = nb::str(e.driver_message().c_str());
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

inline void raise_python_error(const char* class_name, const char* message) {
  nb::object cls = python_error_class(class_name);
  PyErr_SetString(cls.ptr(), message);
}

// A Python argument of the wrong type: kvcached.errors.InvalidTypeError (a TypeError too).
// Call with the GIL held.
[[noreturn]] inline void throw_invalid_type(const std::string& message) {
  raise_python_error("InvalidTypeError", message.c_str());
  throw nb::python_error();
}

inline void install_error_translator() {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const DeviceOutOfMemory& e) {
      raise_driver_error("DeviceOutOfMemoryError", e);
    } catch (const DriverError& e) {
      raise_driver_error("DriverError", e);
    } catch (const BudgetExhausted& e) {
      raise_python_error("OutOfMemoryError", e.what());
    } catch (const InvalidArgument& e) {
      raise_python_error("InvalidArgumentError", e.what());  // a ValueError too
    } catch (const BackendUnavailable& e) {
      raise_python_error("BackendUnavailableError", e.what());
    }
  });
}

}  // namespace kvcached::bindings
