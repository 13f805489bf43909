/* A stand-in for the parts of Apple's Accelerate that anectypes binds (anectypes/host/accelerate.py and
   anectypes/host/blas.py), for the tests on Linux: EXACTLY Apple's prototypes, types and struct layouts (the
   headers are cited in docs/accelerate.md) and the real arithmetic, so that a binding with a wrong argument
   order, stride, struct layout or type gives wrong numbers or a crash. The tests build it with gcc
   (tests/support/accelerate.py); the package itself has no compiled code.

   Compiled with -DLEGACY_ONLY it has neither the current CBLAS ($NEWLAPACK) nor the BLAS threading API:
   Accelerate before macOS 13.3 and 15. Every legacy CBLAS call is counted (standin_legacy_calls). */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

/* ---- vImage (vImage_Types.h, Conversion.h) ---- */

typedef unsigned long vImagePixelCount;
typedef struct vImage_Buffer {
    void *data;
    vImagePixelCount height;
    vImagePixelCount width;
    size_t rowBytes;
} vImage_Buffer;
typedef uint32_t vImage_Flags;
typedef ssize_t vImage_Error;
enum { kvImageNoError = 0, kvImageRoiLargerThanInputBuffer = -21766, kvImageNullPointerArgument = -21772,
       kvImageUnknownFlagsBit = -21775, kvImageInvalidRowBytes = -21777 };
enum { kvImageNoFlags = 0, kvImageDoNotTile = 16 };

static vImage_Error check(const vImage_Buffer *src, const vImage_Buffer *dest, vImage_Flags flags,
                          size_t in_size, size_t out_size) {
    if (!src || !dest || !src->data || !dest->data)
        return kvImageNullPointerArgument;
    if (flags & ~(vImage_Flags)kvImageDoNotTile)
        return kvImageUnknownFlagsBit;
    if (dest->height > src->height || dest->width > src->width)
        return kvImageRoiLargerThanInputBuffer;
    if (src->rowBytes < src->width * in_size || dest->rowBytes < dest->width * out_size)
        return kvImageInvalidRowBytes;
    return kvImageNoError;
}

/* IEEE-754 binary16 from binary32 in the current rounding mode (nearest even by default), subnormals kept,
   overflow to infinity: the compiler's own conversion. NaNs keep their sign and top payload bits and come out
   quiet ("Per IEEE-754, all signaling NaNs are quieted during the conversion", Conversion.h). */
static uint16_t half_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16 & 0x8000u) | 0x7e00u | (u >> 13 & 0x3ffu));
    _Float16 h = (_Float16)f;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
}

static float single_of(uint16_t h) {
    if ((h & 0x7fffu) > 0x7c00u) {
        uint32_t u = (uint32_t)(h & 0x8000u) << 16 | 0x7fc00000u | (uint32_t)(h & 0x3ffu) << 13;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
}

vImage_Error vImageConvert_PlanarFtoPlanar16F(const vImage_Buffer *src, const vImage_Buffer *dest, vImage_Flags flags) {
    vImage_Error e = check(src, dest, flags, 4, 2);
    if (e)
        return e;
    for (vImagePixelCount y = 0; y < dest->height; y++) {
        const float *s = (const float *)((const char *)src->data + y * src->rowBytes);
        uint16_t *d = (uint16_t *)((char *)dest->data + y * dest->rowBytes);
        for (vImagePixelCount x = 0; x < dest->width; x++)
            d[x] = half_of(s[x]);
    }
    return kvImageNoError;
}

vImage_Error vImageConvert_Planar16FtoPlanarF(const vImage_Buffer *src, const vImage_Buffer *dest, vImage_Flags flags) {
    vImage_Error e = check(src, dest, flags, 2, 4);
    if (e)
        return e;
    for (vImagePixelCount y = 0; y < dest->height; y++) {
        const uint16_t *s = (const uint16_t *)((const char *)src->data + y * src->rowBytes);
        float *d = (float *)((char *)dest->data + y * dest->rowBytes);
        for (vImagePixelCount x = 0; x < dest->width; x++)
            d[x] = single_of(s[x]);
    }
    return kvImageNoError;
}

/* ---- vForce (vForce.h): y, x, and the count by pointer ---- */

void vvexpf(float *y, const float *x, const int *n) {
    for (int i = 0; i < *n; i++)
        y[i] = expf(x[i]);
}

void vvexp(double *y, const double *x, const int *n) {
    for (int i = 0; i < *n; i++)
        y[i] = exp(x[i]);
}

void vvsqrtf(float *y, const float *x, const int *n) {
    for (int i = 0; i < *n; i++)
        y[i] = sqrtf(x[i]);
}

/* ---- vDSP (vDSP.h, LP64): scalars by pointer, strides in elements ---- */

typedef unsigned long vDSP_Length;
typedef long vDSP_Stride;

/* A is [N][M], C is [M][N]: C[m][n] = A[n][m] */
void vDSP_mtrans(const float *__A, vDSP_Stride __IA, float *__C, vDSP_Stride __IC, vDSP_Length __M, vDSP_Length __N) {
    for (vDSP_Length m = 0; m < __M; m++)
        for (vDSP_Length n = 0; n < __N; n++)
            __C[(vDSP_Stride)(m * __N + n) * __IC] = __A[(vDSP_Stride)(n * __M + m) * __IA];
}

void vDSP_vsmul(const float *__A, vDSP_Stride __IA, const float *__B, float *__C, vDSP_Stride __IC, vDSP_Length __N) {
    for (vDSP_Length n = 0; n < __N; n++)
        __C[(vDSP_Stride)n * __IC] = __A[(vDSP_Stride)n * __IA] * *__B;
}

void vDSP_vsma(const float *__A, vDSP_Stride __IA, const float *__B, const float *__C, vDSP_Stride __IC, float *__D,
               vDSP_Stride __ID, vDSP_Length __N) {
    for (vDSP_Length n = 0; n < __N; n++)
        __D[(vDSP_Stride)n * __ID] = __A[(vDSP_Stride)n * __IA] * *__B + __C[(vDSP_Stride)n * __IC];
}

void vDSP_vsmsma(const float *__A, vDSP_Stride __IA, const float *__B, const float *__C, vDSP_Stride __IC,
                 const float *__D, float *__E, vDSP_Stride __IE, vDSP_Length __N) {
    for (vDSP_Length n = 0; n < __N; n++)
        __E[(vDSP_Stride)n * __IE] = __A[(vDSP_Stride)n * __IA] * *__B + __C[(vDSP_Stride)n * __IC] * *__D;
}

void vDSP_vsq(const float *__A, vDSP_Stride __IA, float *__C, vDSP_Stride __IC, vDSP_Length __N) {
    for (vDSP_Length n = 0; n < __N; n++)
        __C[(vDSP_Stride)n * __IC] = __A[(vDSP_Stride)n * __IA] * __A[(vDSP_Stride)n * __IA];
}

void vDSP_vsadd(const float *__A, vDSP_Stride __IA, const float *__B, float *__C, vDSP_Stride __IC, vDSP_Length __N) {
    for (vDSP_Length n = 0; n < __N; n++)
        __C[(vDSP_Stride)n * __IC] = __A[(vDSP_Stride)n * __IA] + *__B;
}

/* "Caution: A and B are swapped!" (vDSP.h): the divisor comes first */
void vDSP_vdiv(const float *__B, vDSP_Stride __IB, const float *__A, vDSP_Stride __IA, float *__C, vDSP_Stride __IC,
               vDSP_Length __N) {
    for (vDSP_Length n = 0; n < __N; n++)
        __C[(vDSP_Stride)n * __IC] = __A[(vDSP_Stride)n * __IA] / __B[(vDSP_Stride)n * __IB];
}

void vDSP_vclr(float *__C, vDSP_Stride __IC, vDSP_Length __N) {
    for (vDSP_Length n = 0; n < __N; n++)
        __C[(vDSP_Stride)n * __IC] = 0.0f;
}

/* float sums in 8 lanes, as a vector unit adds */
void vDSP_svesq(const float *__A, vDSP_Stride __IA, float *__C, vDSP_Length __N) {
    float lanes[8] = {0};
    for (vDSP_Length n = 0; n < __N; n++)
        lanes[n % 8] += __A[(vDSP_Stride)n * __IA] * __A[(vDSP_Stride)n * __IA];
    *__C = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

/* ---- CBLAS (cblas.h, cblas_new.h; lapack_types.h: __LAPACK_int is an int without ACCELERATE_LAPACK_ILP64) ---- */

enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112, CblasConjTrans = 113 };
typedef int __LAPACK_int;

static int legacy_calls;

int standin_legacy_calls(void) { return legacy_calls; }

static void refuse(const char *what) {             /* as the BLAS's own parameter check: report and stop */
    fprintf(stderr, "accelerate stand-in: %s\n", what);
    abort();
}

static void sgemm(enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb, __LAPACK_int M,
                  __LAPACK_int N, __LAPACK_int K, float alpha, const float *A, __LAPACK_int lda, const float *B,
                  __LAPACK_int ldb, float beta, float *C, __LAPACK_int ldc) {
    if (order == CblasColMajor) {                  /* Cᵀ = op(B)ᵀ op(A)ᵀ, row-major */
        sgemm(CblasRowMajor, tb, ta, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc);
        return;
    }
    if (order != CblasRowMajor || ta < CblasNoTrans || ta > CblasConjTrans || tb < CblasNoTrans || tb > CblasConjTrans)
        refuse("sgemm: bad order or transpose");
    if (M < 0 || N < 0 || K < 0 || lda < (ta == CblasNoTrans ? K : M) || lda < 1 ||
        ldb < (tb == CblasNoTrans ? N : K) || ldb < 1 || ldc < N || ldc < 1)
        refuse("sgemm: bad dimension or leading dimension");
    for (__LAPACK_int i = 0; i < M; i++)
        for (__LAPACK_int j = 0; j < N; j++) {
            double s = 0;
            for (__LAPACK_int k = 0; k < K; k++)
                s += (double)(ta == CblasNoTrans ? A[(long)i * lda + k] : A[(long)k * lda + i]) *
                     (tb == CblasNoTrans ? B[(long)k * ldb + j] : B[(long)j * ldb + k]);
            float *c = &C[(long)i * ldc + j];
            *c = (float)(alpha * s + (beta == 0 ? 0.0 : (double)beta * *c));   /* beta 0: C is not read */
        }
}

static void sgemv(enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE ta, __LAPACK_int M, __LAPACK_int N, float alpha,
                  const float *A, __LAPACK_int lda, const float *X, __LAPACK_int incx, float beta, float *Y,
                  __LAPACK_int incy) {
    if (order == CblasColMajor) {
        sgemv(CblasRowMajor, ta == CblasNoTrans ? CblasTrans : CblasNoTrans, N, M, alpha, A, lda, X, incx, beta, Y, incy);
        return;
    }
    if (order != CblasRowMajor || M < 0 || N < 0 || lda < N || lda < 1 || incx == 0 || incy == 0)
        refuse("sgemv: bad argument");
    __LAPACK_int rows = ta == CblasNoTrans ? M : N, cols = ta == CblasNoTrans ? N : M;
    for (__LAPACK_int i = 0; i < rows; i++) {
        double s = 0;
        for (__LAPACK_int k = 0; k < cols; k++)
            s += (double)(ta == CblasNoTrans ? A[(long)i * lda + k] : A[(long)k * lda + i]) * X[(long)k * incx];
        float *y = &Y[(long)i * incy];
        *y = (float)(alpha * s + (beta == 0 ? 0.0 : (double)beta * *y));
    }
}

/* the legacy interface (cblas.h): the unsuffixed symbols */
void cblas_sgemm(const enum CBLAS_ORDER __Order, const enum CBLAS_TRANSPOSE __TransA, const enum CBLAS_TRANSPOSE __TransB,
                 const int __M, const int __N, const int __K, const float __alpha, const float *__A, const int __lda,
                 const float *__B, const int __ldb, const float __beta, float *__C, const int __ldc) {
    legacy_calls++;
    sgemm(__Order, __TransA, __TransB, __M, __N, __K, __alpha, __A, __lda, __B, __ldb, __beta, __C, __ldc);
}

void cblas_sgemv(const enum CBLAS_ORDER __Order, const enum CBLAS_TRANSPOSE __TransA, const int __M, const int __N,
                 const float __alpha, const float *__A, const int __lda, const float *__X, const int __incX,
                 const float __beta, float *__Y, const int __incY) {
    legacy_calls++;
    sgemv(__Order, __TransA, __M, __N, __alpha, __A, __lda, __X, __incX, __beta, __Y, __incY);
}

#ifndef LEGACY_ONLY
/* the current interface (cblas_new.h with ACCELERATE_NEW_LAPACK): __LAPACK_ALIAS renames each to sym$NEWLAPACK
   (lapack_version.h), the assembler name carrying Mach-O's leading underscore on a Mac */
#ifdef __APPLE__
#define ALIAS(sym) __asm__("_" sym "$NEWLAPACK")
#else
#define ALIAS(sym) __asm__(sym "$NEWLAPACK")
#endif
void new_sgemm(const enum CBLAS_ORDER ORDER, const enum CBLAS_TRANSPOSE TRANSA, const enum CBLAS_TRANSPOSE TRANSB,
               const __LAPACK_int M, const __LAPACK_int N, const __LAPACK_int K, const float ALPHA, const float *A,
               const __LAPACK_int LDA, const float *B, const __LAPACK_int LDB, const float BETA, float *C,
               const __LAPACK_int LDC) ALIAS("cblas_sgemm");
void new_sgemm(const enum CBLAS_ORDER ORDER, const enum CBLAS_TRANSPOSE TRANSA, const enum CBLAS_TRANSPOSE TRANSB,
               const __LAPACK_int M, const __LAPACK_int N, const __LAPACK_int K, const float ALPHA, const float *A,
               const __LAPACK_int LDA, const float *B, const __LAPACK_int LDB, const float BETA, float *C,
               const __LAPACK_int LDC) {
    sgemm(ORDER, TRANSA, TRANSB, M, N, K, ALPHA, A, LDA, B, LDB, BETA, C, LDC);
}

void new_sgemv(const enum CBLAS_ORDER ORDER, const enum CBLAS_TRANSPOSE TRANSA, const __LAPACK_int M,
               const __LAPACK_int N, const float ALPHA, const float *A, const __LAPACK_int LDA, const float *X,
               const __LAPACK_int INCX, const float BETA, float *Y, const __LAPACK_int INCY) ALIAS("cblas_sgemv");
void new_sgemv(const enum CBLAS_ORDER ORDER, const enum CBLAS_TRANSPOSE TRANSA, const __LAPACK_int M,
               const __LAPACK_int N, const float ALPHA, const float *A, const __LAPACK_int LDA, const float *X,
               const __LAPACK_int INCX, const float BETA, float *Y, const __LAPACK_int INCY) {
    sgemv(ORDER, TRANSA, M, N, ALPHA, A, LDA, X, INCX, BETA, Y, INCY);
}

/* thread_api.h (macOS 15): `enum BLAS_THREADING : unsigned int`, per thread */
enum BLAS_THREADING { BLAS_THREADING_MULTI_THREADED = 0, BLAS_THREADING_SINGLE_THREADED, BLAS_THREADING_MAX_OPTIONS };
static __thread unsigned int threading = BLAS_THREADING_MULTI_THREADED;

int BLASSetThreading(const enum BLAS_THREADING t) {
    if ((unsigned int)t >= BLAS_THREADING_MAX_OPTIONS)
        return -1;
    threading = t;
    return 0;
}

enum BLAS_THREADING BLASGetThreading(void) { return (enum BLAS_THREADING)threading; }
#endif
