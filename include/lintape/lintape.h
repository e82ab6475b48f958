// The public API of lintape in one include: #include <lintape/lintape.h>.
// Installed as <prefix>/include/lintape/lintape.h beside the core/, autograd/ and ops/ folders, so the
// paths below are relative to it; in the source tree they resolve through the source root.
#pragma once

#include "core/config.h"

#include "core/allocator.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "core/tensor.h"

#include "autograd/gradcheck.h"
#include "autograd/tape.h"

#include "ops/activation.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/impl.h"
#include "ops/matmul.h"
#include "ops/reduce.h"
#include "ops/rms_norm.h"
#include "ops/shape.h"

// The fused linear-attention ops.
#include "ops/fal/fal.h"
#include "ops/lrpe/lrpe.h"
#include "ops/tpa/tpa.h"

// Layers, the language model and its training loop.
#include "layers/fal_mixer.h"
#include "layers/language_model.h"
#include "layers/layers.h"
#include "layers/mixer.h"
#include "layers/module.h"
#include "layers/tpa_mixer.h"
#include "train/checkpoint.h"
#include "train/comm.h"
#include "train/config.h"
#include "train/data.h"
#include "train/documents.h"
#include "train/grad_reducer.h"
#include "train/optimizer.h"
#include "train/run_log.h"
#include "train/session.h"
#include "train/trainer.h"
