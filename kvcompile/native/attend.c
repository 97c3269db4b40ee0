/* Decode attention over kvcompile's 8-bit cache on the CPU, and the store: one call per layer and step.
 *
 * The contracts are kvcompile.ops._attention's and _store_kv's (kvcompile/reference.py is the oracle);
 * this file computes them for float32 inputs in one pass over the stored keys, with no temporary
 * tensors: a decode step's attention is a few hundred thousand multiply-adds, less work than the
 * dozen torch calls (dequantize K and V, rotate q, SDPA, rotate back) that compute it in the reference.
 *
 * A layer's cache arrives as one cache_t, built once per cache by the caller (kvcompile/native):
 *   codes [B, H, L, D] int8 or e4m3 bytes (K: head_dim-contiguous; V: either way), strides in elements
 *   scale token [B, H, L, 1] / block32 [B, H, L, D/32] (float32, float16 for q8_0) / static [H]
 * and per call (strides in elements, 0 where a tensor broadcasts):
 *   q     [B, Hq, Tq, D] float32, unit stride along D
 *   out   [B, Hq, Tq, D] float32, contiguous
 *   mask  [B, Hq, Tq, Lm] bytes (bool, nonzero = attend) or NULL
 *   kv_len [] or [B] int64: keys at positions >= kv_len[b] are not stored
 *
 * Attention, per (batch row, kv head): the head's group x Tq query rows are rotated into K's space
 * once; each stored key in the range any row can see is converted once (code times scale, the fp32
 * product formats.dequantize gives) and dotted with every row; each row takes its softmax; each
 * stored value row (or channel, V stored key-contiguous) is converted once and accumulated into every
 * row. So the cost tracks the keys stored, not the cache's L, and each cache byte is read once.
 *
 * Built at first use by kvcompile/native/__init__.py with the system C compiler (the one Inductor
 * uses on the CPU) and loaded with ctypes. Single-threaded: the caller sends larger work to torch.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The ids are kvcompile.formats' (FormatSpec.id, the granularity ids), passed by kvcompile/native as -D flags:
 * one numbering for Python, Triton and C. */
#if !defined(KVC_CODE_INT8) || !defined(KVC_CODE_FP8_E4M3) || !defined(KVC_CODE_Q8_0) || !defined(KVC_SCALE_TOKEN) \
    || !defined(KVC_SCALE_BLOCK32) || !defined(KVC_SCALE_STATIC)
#error "attend.c is built by kvcompile/native, which passes the formats' ids (-DKVC_CODE_* / -DKVC_SCALE_*)"
#endif
enum { CODE_INT8 = KVC_CODE_INT8, CODE_E4M3 = KVC_CODE_FP8_E4M3, CODE_Q8_0 = KVC_CODE_Q8_0 }; /* attention reads
                                                                                             Q8_0 as INT8 */
enum { SCALE_TOKEN = KVC_SCALE_TOKEN, SCALE_BLOCK32 = KVC_SCALE_BLOCK32, SCALE_STATIC = KVC_SCALE_STATIC };

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float16 bits to float32, exactly: a normal value's fields move into float32's with the exponent
 * bias raised by 112, a subnormal m is m * 2^-24, Inf and NaN keep their kind */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023;
    uint32_t bits;
    if (e == 0) bits = f32_bits((float)m * 0x1p-24f);
    else if (e == 31) bits = 0x7F800000u | (m << 13);
    else bits = ((e + 112) << 23) | (m << 13);
    return f32_from_bits(bits | sign);
}

/* One side (K or V) of a layer's cache: codes [B, H, L, D] and scales, strides in elements. */
typedef struct {
    uint8_t *codes; /* int8 or e4m3 bytes */
    int64_t cb, ch, cl, cd;
    void *scale;
    int64_t sb, sh, sl, sg;
    int32_t code_kind;  /* CODE_INT8, CODE_E4M3 (attention reads CODE_Q8_0 as CODE_INT8) */
    int32_t scale_kind; /* SCALE_TOKEN, SCALE_BLOCK32, SCALE_STATIC */
    int32_t scale_f16;  /* the scales are float16 (q8_0) */
    int32_t group;      /* elements per scale along D: D or 32 */
} side_t;

/* A layer's cache as the two calls read it, built once per cache by the caller (kvcompile/native). */
typedef struct {
    side_t k, v;
    const float *k_rot, *v_rot; /* [D, D] row-major or NULL: the codes hold x @ R */
    int64_t B, H, L, D;
} cache_t;

static inline float scale_at(const side_t *s, int64_t b, int64_t h, int64_t l, int64_t g) {
    int64_t i = s->scale_kind == SCALE_STATIC ? h * s->sh : b * s->sb + h * s->sh + l * s->sl + g * s->sg;
    return s->scale_f16 ? half_to_float(((const uint16_t *)s->scale)[i]) : ((const float *)s->scale)[i];
}

/* Horizontal sums in 8 lanes: the compiler turns the lane loop into one vector multiply-add and the
 * lanes' sum into a few shuffles (an `omp simd` reduction spills its lanes to the stack per call). */
#define LANES 8

static inline float dot_f32(const float *x, const float *y, int64_t n) {
    float lane[LANES] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t e = 0;
    for (; e + LANES <= n; e += LANES)
        for (int l = 0; l < LANES; ++l) lane[l] += x[e + l] * y[e + l];
    float acc = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
    for (; e < n; ++e) acc += x[e] * y[e];
    return acc;
}

/* out = x @ R (R [D, D] row-major, float32 sums over x's entries in order), or a copy of x without R */
static void rotate_row(const float *x, const float *R, int D, float *out) {
    if (!R) {
        memcpy(out, x, sizeof(float) * D);
        return;
    }
    for (int d = 0; d < D; ++d) out[d] = 0.f;
    for (int e = 0; e < D; ++e) {
        const float xe = x[e];
        const float *r = R + (int64_t)e * D;
        for (int d = 0; d < D; ++d) out[d] += xe * r[d];
    }
}

/* n codes at unit stride times one scale each: out[i] = value(c[i]) * s, the fp32 product
 * formats.dequantize gives. e4m3 by integer arithmetic the compiler vectorizes (no table gather, no
 * subnormal float): a normal code's exponent and mantissa bits move into float32's fields with the
 * bias raised by 120, a subnormal code m is m * 2^-9, 0x7F / 0xFF are NaN; every value is exact. */
static inline void codes_to_f32(const uint8_t *c, int kind, float s, float *out, int64_t n) {
    if (kind != CODE_E4M3) { /* int8 and q8_0 */
        const int8_t *ci = (const int8_t *)c;
        for (int64_t i = 0; i < n; ++i) out[i] = (float)ci[i] * s;
        return;
    }
    for (int64_t i = 0; i < n; ++i) { /* selects by masks: no branch, so the loop vectorizes */
        const uint32_t b = c[i], mag = b & 0x7F;
        const uint32_t normal = (mag << 20) + (120u << 23);
        const uint32_t sub = f32_bits((float)(int32_t)(mag & 7) * 0x1p-9f);
        const uint32_t is_sub = 0u - (uint32_t)(mag < 8), is_nan = 0u - (uint32_t)(mag == 0x7F);
        uint32_t bits = (sub & is_sub) | (normal & ~is_sub);
        bits = (0x7FC00000u & is_nan) | (bits & ~is_nan);
        out[i] = f32_from_bits(bits | ((b & 0x80) << 24)) * s;
    }
}

/* Row j's D values (code times its scale, the reference's fp32 value) of a head_dim-contiguous side */
static inline void row_values(const side_t *x, int64_t b, int64_t h, int64_t j, int D, float *out) {
    const uint8_t *c = x->codes + b * x->cb + h * x->ch + j * x->cl;
    const int groups = D / x->group;
    for (int g = 0; g < groups; ++g)
        codes_to_f32(c + g * x->group, x->code_kind, scale_at(x, b, h, j, g), out + g * x->group, x->group);
}

/* A per-thread buffer that only grows: a malloc per call of a few hundred KB would be an mmap and
 * fresh page faults every call in a process that pins malloc's mmap threshold (torch's does). */
static float *scratch(size_t bytes) {
    static _Thread_local float *buf = NULL;
    static _Thread_local size_t cap = 0;
    if (bytes > cap) {
        float *grown = (float *)realloc(buf, bytes);
        if (!grown) return NULL;
        buf = grown;
        cap = bytes;
    }
    return buf;
}

/* Attention of q [B, Hq, Tq, D] (float32, unit stride along D) over the cache's stored keys.
 * kv_len: int64, n_len = 1 (shared) or B values; keys at positions >= kv_len[b] are not stored (a
 * length above L makes all L visible). Only keys [lo, hi) are read: hi the longest stored length
 * (at most L), lo the first key a window lets any query see. mask: bool bytes [B, Hq, Tq, mask_len]
 * at strides mb, mh, mt, ml (0 where it broadcasts), or NULL.
 * Returns 0; 1 where the work is above max_work multiply-adds with more than max_queries queries,
 * or the mask is shorter than the keys read (nothing written: the caller runs torch); -1 out of memory. */
int kvc_attend(const cache_t *c, int B, int Hq, int Tq, const float *q, int64_t qb, int64_t qh, int64_t qt,
               float *out, const int64_t *kv_len, int n_len, const uint8_t *mask, int64_t mb, int64_t mh,
               int64_t mt, int64_t ml, int64_t mask_len, int is_causal, int64_t window, float sm_scale,
               float softcap, const float *sinks, int64_t max_work, int max_queries) {
    const int D = (int)c->D, Hkv = (int)c->H, group = Hq / Hkv, rows = group * Tq;
    const side_t *k = &c->k, *v = &c->v;
    int64_t hi = 0, lmin = INT64_MAX;
    for (int b = 0; b < B; ++b) {
        const int64_t len = kv_len[n_len == 1 ? 0 : b];
        if (len > hi) hi = len;
        if (len < lmin) lmin = len;
    }
    if (hi > c->L) hi = c->L;
    int64_t lo = 0; /* the first key any query can see: query 0 of the shortest row sits at lmin - Tq */
    if (window > 0) {
        lo = lmin - Tq - window + 1;
        lo = lo < 0 ? 0 : (lo > hi ? hi : lo);
    }
    const int64_t n = hi - lo;
    if ((Tq > max_queries && 2 * n * Hq * Tq * D > max_work) || (mask && ml && mask_len < hi)) return 1;
    /* per kv head: the group's rotated queries [rows, D], scores [rows, n], output sums [rows, D],
     * one key's or value's D values, a channel's n values (V stored key-contiguous), one output row */
    const int64_t nn = n > D ? n : D;
    float *qr = scratch(sizeof(float) * ((size_t)rows * (2 * D + n + 1) + 2 * nn + D));
    if (!qr) return -1;
    float *p = qr + (size_t)rows * D, *acc = p + (size_t)rows * n, *inv = acc + (size_t)rows * D;
    float *kv = inv + rows, *sv = kv + nn, *tmp = sv + nn;
    const int v_keys = v->cl == 1 && v->cd != 1; /* V stored key-contiguous: a channel's keys are a run */
    for (int b = 0; b < B; ++b) {
        const int64_t len = kv_len[n_len == 1 ? 0 : b];
        /* the keys [j0, j1) of [lo, hi) that some query of row b may see: values outside are never read
         * (a NaN stored past the row's length, or below every query's window, reaches no output) */
        int64_t j1 = (hi < len ? hi : len) - lo, j0 = window > 0 ? len - Tq - window + 1 - lo : 0;
        j0 = j0 < 0 ? 0 : j0;
        const int64_t nb = j1 > j0 ? j1 - j0 : 0;
        for (int hk = 0; hk < Hkv; ++hk) {
            for (int r = 0; r < rows; ++r) { /* row r: query head hk * group + r / Tq, query r % Tq */
                const int h = hk * group + r / Tq, t = r % Tq;
                rotate_row(q + b * qb + h * qh + t * qt, c->k_rot, D, qr + (size_t)r * D); /* q @ R_k */
            }
            /* scores: each stored key's values once, dotted with the group's rows */
            for (int64_t j = 0; j < n; ++j) {
                row_values(k, b, hk, lo + j, D, kv);
                for (int r = 0; r < rows; ++r) p[(size_t)r * n + j] = dot_f32(qr + (size_t)r * D, kv, D);
            }
            /* the keys each row sees (its row's length, the causal bound, the window, the mask), softmax */
            for (int r = 0; r < rows; ++r) {
                const int h = hk * group + r / Tq, t = r % Tq;
                const int64_t qpos = len - Tq + t;
                int64_t end = hi < len ? hi : len, start = lo;
                if (is_causal && qpos + 1 < end) end = qpos + 1;
                if (window > 0 && qpos - window + 1 > start) start = qpos - window + 1;
                const uint8_t *mrow = mask ? mask + b * mb + h * mh + t * mt : NULL;
                float *pr = p + (size_t)r * n, mx = -INFINITY;
                int nan = 0; /* a visible key scores NaN (a NaN in q or K) */
                for (int64_t j = 0; j < n; ++j) {
                    const int64_t pos = lo + j;
                    float s = -INFINITY;
                    if (pos >= start && pos < end && (!mrow || mrow[pos * ml])) {
                        s = pr[j] * sm_scale;
                        if (softcap > 0.f) s = softcap * tanhf(s / softcap);
                        nan |= s != s;
                    }
                    pr[j] = s;
                    if (s > mx) mx = s; /* a NaN score never passes: mx is the finite scores' max */
                }
                /* no finite score: zeros where no key is visible or every visible score is -inf (an Inf
                 * in q; SDPA gives zeros too), with sinks too; NaN where a visible key scores NaN, as
                 * softmax over it gives (not "no visible key") */
                if (mx == -INFINITY) {
                    for (int64_t j = 0; j < n; ++j) pr[j] = 0.f;
                    inv[r] = nan ? NAN : 0.f;
                    continue;
                }
                float sink = 0.f;
                if (sinks) {
                    sink = sinks[h];
                    if (sink > mx) mx = sink;
                }
                float denom = 0.f;
                for (int64_t j = 0; j < n; ++j) { /* a hidden key weighs exactly 0 */
                    pr[j] = pr[j] == -INFINITY ? 0.f : expf(pr[j] - mx);
                    denom += pr[j];
                }
                if (sinks) denom += expf(sink - mx);
                inv[r] = 1.f / denom;
            }
            /* P @ V: each stored value row (or channel) once, for the group's rows */
            memset(acc, 0, sizeof(float) * (size_t)rows * D);
            if (v_keys) { /* token or static scales (block32 V is stored head_dim-contiguous) */
                for (int64_t j = 0; j < nb; ++j) sv[j] = scale_at(v, b, hk, lo + j0 + j, 0);
                for (int d = 0; d < D && nb; ++d) {
                    /* the channel's values, code * scale as formats.dequantize (code * 1 is exact) */
                    codes_to_f32(v->codes + b * v->cb + hk * v->ch + d * v->cd + lo + j0, v->code_kind, 1.f, kv, nb);
                    for (int64_t j = 0; j < nb; ++j) kv[j] *= sv[j];
                    for (int r = 0; r < rows; ++r) acc[(size_t)r * D + d] = dot_f32(p + (size_t)r * n + j0, kv, nb);
                }
            } else {
                for (int64_t j = j0; j < j1; ++j) {
                    row_values(v, b, hk, lo + j, D, kv);
                    for (int r = 0; r < rows; ++r) {
                        const float w = p[(size_t)r * n + j];
                        float *a = acc + (size_t)r * D;
                        for (int d = 0; d < D; ++d) a[d] += w * kv[d];
                    }
                }
            }
            for (int r = 0; r < rows; ++r) {
                const int h = hk * group + r / Tq, t = r % Tq;
                float *o = out + (((int64_t)b * Hq + h) * Tq + t) * D;
                const float *a = acc + (size_t)r * D;
                if (c->v_rot) { /* back from V's rotated space: o @ R_v^T */
                    for (int d = 0; d < D; ++d) tmp[d] = a[d] * inv[r];
                    for (int d = 0; d < D; ++d) o[d] = dot_f32(tmp, c->v_rot + (int64_t)d * D, D);
                } else {
                    for (int d = 0; d < D; ++d) o[d] = a[d] * inv[r];
                }
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * The store: quantize-on-store of new tokens, kvcompile.formats.quantize's rounding bit for bit
 * (int8: s = amax / 127, code = round-half-even(x / s) in [-127, 127]; fp8_e4m3 per token:
 * s = amax / 448, code = e4m3(clamp(x / s, -448, 448)) rounded to nearest even), the non-finite
 * policy included: amax over the finite values; a NaN or +-Inf (no format holds an Inf) makes its
 * group's scale NaN, and its code e4m3's NaN code in fp8 (int8: 0 for a NaN, +-127 for +-Inf).
 * A rotation R (x @ R, float32) and a K offset come first;
 * the rotation's sums run in this file's order, so a rotated side can differ from torch's matmul by
 * the last bit of a value, at most one code step.
 * ------------------------------------------------------------------------------------------------ */

/* float8_e4m3fn of y, |y| <= 448 or NaN, rounded to nearest even (torch's conversion) */
static uint8_t e4m3_encode(float y) {
    const uint32_t bits = f32_bits(y);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    if (y != y) return sign | 0x7F;
    const float a = fabsf(y);
    if (a < 0x1p-6f) { /* subnormal range: multiples of 2^-9; 8 * 2^-9 is the smallest normal, code 8 */
        return sign | (uint8_t)rintf(a * 512.f);
    }
    const int e = (int)((f32_bits(a) >> 23) & 255) - 127; /* 2^e <= a < 2^(e+1), e in [-6, 8] */
    const float quantum = ldexpf(1.f, e - 3);
    const float r = rintf(a / quantum) * quantum; /* exact: a power-of-two division, an integer times it */
    const uint32_t rb = f32_bits(r);
    const int re = (int)((rb >> 23) & 255) - 127; /* a carry may raise the exponent */
    return sign | (uint8_t)(((re + 7) << 3) | ((rb >> 20) & 7));
}

/* float16 bits of f, rounded to nearest even (torch's conversion; NaN keeps its sign, 0x7E00) */
static uint16_t half_bits(float f) {
    uint32_t x = f32_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7FFFFFFFu;
    if (x > 0x7F800000u) return sign | 0x7E00;   /* NaN */
    if (x >= 0x477FF000u) return sign | 0x7C00;  /* >= 65520 rounds to Inf (Inf itself too) */
    if (x < 0x38800000u)                         /* below 2^-14: multiples of 2^-24, exact scaling */
        return sign | (uint16_t)rintf(fabsf(f) * 0x1p24f);
    x -= (uint32_t)(127 - 15) << 23;             /* rebias, then round the 13 dropped bits to even */
    x += 0xFFFu + ((x >> 13) & 1u);
    return sign | (uint16_t)(x >> 13);
}

/* C's roundf, as formats._roundf: half away from zero */
static inline float round_away(float y) {
    const float a = fabsf(y), f = floorf(a);
    const float r = f + floorf(2.f * (a - f));
    return y < 0 ? -r : r;
}

/* Quantize n values x (already rotated / centered) into codes at `c` (step cd); returns the
 * group's scale (float32; q8_0's is rounded to float16 by the caller). */
static float quantize_group(const float *x, int n, int kind, uint8_t *c, int64_t cd) {
    float amax = 0.f;
    int nan = 0; /* the group holds a NaN or an Inf: a NaN scale marks it */
    for (int d = 0; d < n; ++d) {
        const float a = fabsf(x[d]);
        if (a != a || a == INFINITY) nan = 1;
        else if (a > amax) amax = a;
    }
    if (kind == CODE_INT8) {
        const float s = amax / 127.f, div = s > 0.f ? s : 1.f;
        for (int d = 0; d < n; ++d) {
            float y = x[d];
            if (y != y) y = 0.f;
            else if (isinf(y)) y = y > 0 ? 127.f : -127.f;
            else y = y / div;
            y = y > 127.f ? 127.f : (y < -127.f ? -127.f : y);
            ((int8_t *)c)[d * cd] = (int8_t)rintf(y);
        }
        return nan ? NAN : s;
    }
    if (kind == CODE_Q8_0) { /* GGUF: d = amax / 127, codes roundf(x * (1 / d)) from the float32 d */
        const float dq = amax / 127.f, inv = dq > 0.f ? 1.f / dq : 0.f;
        for (int d = 0; d < n; ++d) {
            float y = x[d];
            if (y != y) y = 0.f;
            else if (isinf(y)) y = y > 0 ? 127.f : -127.f;
            else y = y * inv;
            y = y > 127.f ? 127.f : (y < -127.f ? -127.f : y);
            ((int8_t *)c)[d * cd] = (int8_t)round_away(y);
        }
        return nan ? NAN : dq;
    }
    const float s = amax / 448.f;
    for (int d = 0; d < n; ++d) {
        float y = x[d];
        if (isinf(y)) y = NAN; /* e4m3 has no Inf: its NaN code, as for a NaN (which keeps its sign) */
        else if (y == y) y = s > 0.f ? y / s : 0.f;
        y = y > 448.f ? 448.f : (y < -448.f ? -448.f : y);
        c[d * cd] = e4m3_encode(y);
    }
    return nan ? NAN : s;
}

/* Store T new tokens k, v [B, H, T, D] (float32, unit stride along D) at positions start_at[0] + t
 * of the cache: per side the code kind (CODE_INT8, CODE_E4M3, CODE_Q8_0) and its scales
 * [B, H, L, D / group] (float32, or float16 for q8_0). The cache's rotations apply, then K's offset
 * k_offset [H, D] (or NULL) is subtracted. Returns 0; 1 (nothing written) when the tokens would pass
 * the cache's L positions, 2 (nothing written) for a negative start. */
int kvc_store(const cache_t *c, int B, int T, const float *k, int64_t kb, int64_t kh, int64_t kt,
              const float *v, int64_t vb, int64_t vh, int64_t vt, const int64_t *start_at, const float *k_offset) {
    const int H = (int)c->H, D = (int)c->D;
    const int64_t start = *start_at;
    if (start + T > c->L) return 1;
    if (start < 0) return 2;
    float x[1024]; /* D <= 1024, checked by the caller */
    for (int side = 0; side < 2; ++side) {
        const side_t *s = side ? &c->v : &c->k;
        const float *src = side ? v : k, *rot = side ? c->v_rot : c->k_rot;
        const int64_t sb = side ? vb : kb, sh = side ? vh : kh, st = side ? vt : kt;
        for (int b = 0; b < B; ++b)
            for (int h = 0; h < H; ++h)
                for (int t = 0; t < T; ++t) {
                    rotate_row(src + b * sb + h * sh + t * st, rot, D, x);
                    if (!side && k_offset)
                        for (int d = 0; d < D; ++d) x[d] -= k_offset[h * D + d];
                    const int64_t pos = start + t;
                    uint8_t *codes = s->codes + b * s->cb + h * s->ch + pos * s->cl;
                    for (int g = 0; g < D / s->group; ++g) {
                        const float sc = quantize_group(x + g * s->group, s->group, s->code_kind,
                                                        codes + g * s->group * s->cd, s->cd);
                        const int64_t i = b * s->sb + h * s->sh + pos * s->sl + g * s->sg;
                        if (s->code_kind == CODE_Q8_0) ((uint16_t *)s->scale)[i] = half_bits(sc);
                        else ((float *)s->scale)[i] = sc;
                    }
                }
    }
    return 0;
}
