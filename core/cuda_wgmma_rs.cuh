// Warpgroup matrix products with A in registers (wgmma, sm_90a): D (64 x N, f32) += A (64 x 16, 16-bit, in
// registers) B (16 x N, shared memory). A's fragment is that of mma.sync m16n8k16 per warp (warp w of the
// warpgroup holds rows 16 w..16 w + 15): a[0] (row lane / 4, columns 2 (lane % 4) + 0..1), a[1] the same 8
// rows down, a[2] and a[3] the same 8 columns right; so an accumulator pair of a previous product (the
// layout of core/cuda_wgmma.cuh) rounded to 16 bits is the next product's A. B's descriptor and layouts are
// those of core/cuda_wgmma.cuh. Only for code compiled for sm_90a (LINTAPE_WGMMA).
#pragma once
#include "core/cuda_wgmma.cuh"

namespace lintape::cuda {

#ifdef LINTAPE_WGMMA
// D (64 x 64) += A B; TransB 1: B MN-major, else K-major.
template <class T, int TransB>
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
#define LINTAPE_WGMMA_RS(TY)                                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                      \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {"                                      \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18,"            \
               "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"                                 \
               "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                                \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),        \
                 "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),      \
                 "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),      \
                 "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                           \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(TransB))
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    LINTAPE_WGMMA_RS("bf16");
  else
    LINTAPE_WGMMA_RS("f16");
#undef LINTAPE_WGMMA_RS
}

// D (64 x 128) += A B; TransB 1: B MN-major, else K-major.
template <class T, int TransB>
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
#define LINTAPE_WGMMA_RS(TY)                                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                      \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {"                                     \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18,"            \
               "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35,"            \
               "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52,"            \
               "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"                                           \
               "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                                                \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),        \
                 "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),      \
                 "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),      \
                 "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),      \
                 "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),      \
                 "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),      \
                 "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),      \
                 "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])       \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(TransB))
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    LINTAPE_WGMMA_RS("bf16");
  else
    LINTAPE_WGMMA_RS("f16");
#undef LINTAPE_WGMMA_RS
}

// D += A B for one k-step of 16.
template <class T, int N, int TransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
  static_assert(N == 64 || N == 128, "wgmma widths built here");
  if constexpr (N == 64)
    wgmma_rs_n64<T, TransB>(d, a, b);
  else
    wgmma_rs_n128<T, TransB>(d, a, b);
}
#endif  // LINTAPE_WGMMA

}  // namespace lintape::cuda
