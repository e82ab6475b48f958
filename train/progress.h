// What a training run's progress line shows, in words a reader takes in at a glance.
#pragma once
#include <string>

namespace lintape {

// A duration for an ETA: "45 s", "3 min 05 s", "4 h 03 min", "2 d 05 h"; "?" for a negative or
// non-finite value (no estimate yet).
std::string format_duration(double seconds);

}  // namespace lintape
