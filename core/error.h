// Errors: library code throws lintape::Error with a message a user can read; only main() exits.
#pragma once
#include <stdexcept>
#include <string>
#include <sstream>

namespace lintape {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {
inline void format_into(std::ostringstream&) {}
template <class T, class... Rest>
void format_into(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  format_into(os, rest...);
}
}  // namespace detail

// Concatenates its arguments with operator<< into one message.
template <class... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  detail::format_into(os, args...);
  return os.str();
}

[[noreturn]] inline void fail(const std::string& msg) { throw Error(msg); }

}  // namespace lintape

// LT_CHECK(cond, "[op] what was expected; got ", value): throws lintape::Error when cond is false.
#define LT_CHECK(cond, ...)                                   \
  do {                                                        \
    if (!(cond)) ::lintape::fail(::lintape::str(__VA_ARGS__)); \
  } while (0)
