// The few element kernels the core itself needs (copy with conversion, fill, random, arange,
// accumulate), for each device. Internal to core/: users call Tensor methods and factories.
#pragma once
#include <cstdint>
#include "core/tensor.h"

namespace lintape::core_kernels {

// dst and src on the same device, same shape, any dtypes and strides.
void copy_cpu(const Tensor& dst, const Tensor& src);
void fill_cpu(const Tensor& dst, double value);
void random_cpu(const Tensor& dst, uint64_t seed, bool normal);  // dst contiguous
void arange_cpu(const Tensor& dst, int64_t start);               // dst contiguous
void accumulate_cpu(const Tensor& dst, const Tensor& src);       // dst += src, same shape; f32 += bf16/f16 too

#if LINTAPE_WITH_CUDA
void copy_cuda(const Tensor& dst, const Tensor& src);
void fill_cuda(const Tensor& dst, double value);
void random_cuda(const Tensor& dst, uint64_t seed, bool normal);
void arange_cuda(const Tensor& dst, int64_t start);
void accumulate_cuda(const Tensor& dst, const Tensor& src);
#endif

}  // namespace lintape::core_kernels

namespace lintape {
// dst += src in place, not recorded by autograd (gradient accumulation uses it).
void accumulate_(const Tensor& dst, const Tensor& src);
}  // namespace lintape
