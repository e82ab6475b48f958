#include "layers/mixer.h"

#include "core/error.h"
#include "layers/fal_mixer.h"
#include "layers/tpa_mixer.h"

namespace lintape {

const std::vector<MixerKind>& mixer_kinds() {
  static const std::vector<MixerKind> kinds = {
      {"fal", &make_fal_mixer, &fal_train_flops_per_token},
      {"tpa", &make_tpa_mixer, &tpa_train_flops_per_token},
  };
  return kinds;
}

bool is_mixer_name(const std::string& name) {
  for (const MixerKind& k : mixer_kinds())
    if (name == k.name) return true;
  return false;
}

std::string mixer_names() {
  std::string names;
  const std::vector<MixerKind>& kinds = mixer_kinds();
  for (size_t i = 0; i < kinds.size(); ++i)
    names += (i == 0 ? "" : i + 1 == kinds.size() ? " or " : ", ") + std::string(kinds[i].name);
  return names;
}

const MixerKind& mixer_kind(const std::string& name) {
  for (const MixerKind& k : mixer_kinds())
    if (name == k.name) return k;
  fail(str("[config] mixers: unknown mixer '", name, "'; expected ", mixer_names()));
}

}  // namespace lintape
