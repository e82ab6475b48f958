#include "train/progress.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>

namespace lintape {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  // Past about 3 000 years the count of days is still exact enough; the cap keeps the cast defined.
  const int64_t s = int64_t(std::llround(std::min(seconds, 1e11)));
  char text[64];
  if (s < 60)
    std::snprintf(text, sizeof(text), "%lld s", static_cast<long long>(s));
  else if (s < 3600)
    std::snprintf(text, sizeof(text), "%lld min %02lld s", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  else if (s < 86400)
    std::snprintf(text, sizeof(text), "%lld h %02lld min", static_cast<long long>(s / 3600),
                  static_cast<long long>(s % 3600 / 60));
  else
    std::snprintf(text, sizeof(text), "%lld d %02lld h", static_cast<long long>(s / 86400),
                  static_cast<long long>(s % 86400 / 3600));
  return text;
}

}  // namespace lintape
