/* Decode attention over kvcompile's 8-bit cache on the CPU: one call per layer and step.
 *
 * The contract is kvcompile.ops._attention's (kvcompile/reference.py is the oracle); this file
 * computes it for float32 queries in one pass over the stored keys, with no temporary tensors:
 * a decode step's attention is a few hundred thousand multiply-adds, less work than the dozen
 * torch calls (dequantize K and V, rotate q, SDPA, rotate back) that compute it in the reference.
 *
 * Layouts (strides in elements; any stride may be 0 where a tensor broadcasts):
 *   q     [B, Hq, Tq, D] float32, unit stride along D
 *   out   [B, Hq, Tq, D] float32, contiguous
 *   codes [B, Hkv, L, D] int8 or e4m3 bytes (K: head_dim-contiguous; V: either way)
 *   scale token [B, Hkv, L, 1] / block32 [B, Hkv, L, D/32] (float32 or float16) / static [Hkv]
 *   mask  [B, Hq, Tq, Lm] bytes (bool, nonzero = attend) or NULL
 *   lens  [B] int64: keys at positions >= lens[b] are not stored
 * Keys [lo, hi) are the only ones read (the caller bounds them by the stored lengths).
 *
 * Per (batch row, kv head): the keys [lo, hi) of K and V are dequantized once into float32 rows
 * (the values formats.dequantize gives: code times scale, one fp32 product), then each query row of
 * the head's group takes its scores (q . k, 8-lane sums), its softmax and its weighted sum of V rows.
 *
 * Built at first use by kvcompile/native/__init__.py with the system C compiler (the one Inductor
 * uses on the CPU) and loaded with ctypes. Single-threaded: the caller sends larger work to torch.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { CODE_INT8 = 0, CODE_E4M3 = 1, CODE_Q8_0 = 2 }; /* Q8_0: the store's; attention reads it as INT8 */
enum { SCALE_TOKEN = 0, SCALE_BLOCK32 = 1, SCALE_STATIC = 2 };

static float e4m3_table[256];
static int e4m3_ready = 0;

/* float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN.
 * Every value is exact in float32. */
static void init_e4m3(void) {
    for (int b = 0; b < 256; ++b) {
        int e = (b >> 3) & 15, m = b & 7;
        float v;
        if (e == 15 && m == 7) v = NAN;
        else if (e == 0) v = ldexpf((float)m, -9);          /* subnormal: m/8 * 2^-6 */
        else v = ldexpf((float)(8 + m), e - 10);            /* (1 + m/8) * 2^(e-7) */
        e4m3_table[b] = (b & 128) ? -v : v;
    }
    e4m3_ready = 1;
}

static float half_to_float(uint16_t h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 0) v = ldexpf((float)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = ldexpf((float)(1024 + m), e - 25);
    return s ? -v : v;
}

typedef struct {
    const uint8_t *codes; /* int8 or e4m3 bytes */
    int64_t cb, ch, cl, cd;
    const void *scale;
    int64_t sb, sh, sl, sg;
    int code_kind, scale_kind, scale_f16;
} side_t;

static inline float scale_at(const side_t *s, int64_t b, int64_t h, int64_t l, int64_t g) {
    int64_t i = s->scale_kind == SCALE_STATIC ? h * s->sh : b * s->sb + h * s->sh + l * s->sl + g * s->sg;
    return s->scale_f16 ? half_to_float(((const uint16_t *)s->scale)[i]) : ((const float *)s->scale)[i];
}

/* Horizontal sums in 8 lanes: the compiler turns the lane loop into one vector multiply-add and the
 * lanes' sum into a few shuffles (an `omp simd` reduction spills its lanes to the stack per call). */
#define LANES 8

static inline float dot_f32(const float *x, const float *y, int n) {
    float lane[LANES] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int e = 0;
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

/* The keys [lo, hi) of one (batch row, kv head) as float32 values code * scale, channel-major:
 * dst[d * ld + (j - lo)], ld >= n = hi - lo. `sc` is scratch for n * groups scales. */
static void dequantize_by_channel(const side_t *x, int64_t b, int64_t h, int64_t lo, int64_t hi, int D, int64_t ld,
                                  float *dst, float *sc) {
    const uint8_t *base = x->codes + b * x->cb + h * x->ch;
    const int64_t n = hi - lo;
    const int groups = x->scale_kind == SCALE_BLOCK32 ? D / 32 : 1, width = D / groups;
    for (int64_t j = 0; j < n; ++j)
        for (int g = 0; g < groups; ++g) sc[j * groups + g] = scale_at(x, b, h, lo + j, g);
    if (x->cl == 1) { /* stored key-contiguous (V by default): each channel is a contiguous run of keys */
        for (int d = 0; d < D; ++d) {
            const uint8_t *c = base + d * x->cd + lo;
            const float *s = sc + d / width;
            float *r = dst + d * ld;
            if (x->code_kind == CODE_INT8) {
                const int8_t *ci = (const int8_t *)c;
                for (int64_t j = 0; j < n; ++j) r[j] = (float)ci[j] * s[j * groups];
            } else {
                for (int64_t j = 0; j < n; ++j) r[j] = e4m3_table[c[j]] * s[j * groups];
            }
        }
        return;
    }
    for (int64_t j = 0; j < n; ++j) { /* stored head_dim-contiguous: a transpose */
        const uint8_t *c = base + (lo + j) * x->cl;
        for (int g = 0; g < groups; ++g) {
            const float s = sc[j * groups + g];
            for (int d = g * width; d < (g + 1) * width; ++d) {
                const uint8_t *cd = c + d * x->cd;
                dst[d * ld + j] = (x->code_kind == CODE_INT8 ? (float)*(const int8_t *)cd : e4m3_table[*cd]) * s;
            }
        }
    }
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

/* Returns 0, or -1 when out of memory (the caller falls back to torch). */
int kvc_attend(int B, int Hq, int Hkv, int Tq, int D, int64_t lo, int64_t hi,
               const float *q, int64_t qb, int64_t qh, int64_t qt, float *out,
               const uint8_t *kc, int64_t kcb, int64_t kch, int64_t kcl, int64_t kcd, int k_kind,
               const void *ks, int64_t ksb, int64_t ksh, int64_t ksl, int64_t ksg, int k_scale_kind, int k_f16,
               const uint8_t *vc, int64_t vcb, int64_t vch, int64_t vcl, int64_t vcd, int v_kind,
               const void *vs, int64_t vsb, int64_t vsh, int64_t vsl, int64_t vsg, int v_scale_kind, int v_f16,
               const int64_t *lens, const uint8_t *mask, int64_t mb, int64_t mh, int64_t mt, int64_t ml,
               int is_causal, int64_t window, float sm_scale, float softcap, const float *sinks,
               const float *k_rot, const float *v_rot) {
    if (!e4m3_ready) init_e4m3();
    if (hi <= lo) return 0; /* the caller handles an empty range */
    const side_t k = {kc, kcb, kch, kcl, kcd, ks, ksb, ksh, ksl, ksg, k_kind, k_scale_kind, k_f16};
    const side_t v = {vc, vcb, vch, vcl, vcd, vs, vsb, vsh, vsl, vsg, v_kind, v_scale_kind, v_f16};
    const int group = Hq / Hkv;
    const int64_t n = hi - lo;
    /* K and V channel-major [D, n], scale scratch [n, D/32 or 1], the scores [n], q and the output [D] */
    /* channel rows of ld floats: a multiple of 16 plus 16, never a multiple of a 4 KiB page (64
     * channels at a page's stride share the L1's sets: 4x slower at n = 1024) */
    const int64_t ld = ((n + 15) & ~(int64_t)15) + 16;
    float *kt = scratch(sizeof(float) * ((size_t)(2 * ld + n + 3) * D + (size_t)n));
    if (!kt) return -1;
    float *vt = kt + ld * D, *sc = vt + ld * D, *p = sc + n * D, *qr = p + n, *acc = qr + D, *tmp = acc + D;
    for (int b = 0; b < B; ++b) {
        for (int hk = 0; hk < Hkv; ++hk) {
            dequantize_by_channel(&k, b, hk, lo, hi, D, ld, kt, sc);
            dequantize_by_channel(&v, b, hk, lo, hi, D, ld, vt, sc);
            for (int h = hk * group; h < (hk + 1) * group; ++h) {
                for (int t = 0; t < Tq; ++t) {
                    float *o = out + (((int64_t)b * Hq + h) * Tq + t) * D;
                    const float *qrow = q + b * qb + h * qh + t * qt;
                    rotate_row(qrow, k_rot, D, qr); /* q @ R_k: scores in K's rotated space */
                    /* scores of every key in [lo, hi): sum over channels, each a contiguous run of keys */
                    int64_t j0 = 0;
                    for (; j0 + 4 * LANES <= n; j0 += 4 * LANES) { /* 32 keys' sums stay in registers */
                        float blk[4 * LANES] = {0.f};
                        for (int d = 0; d < D; ++d) {
                            const float qd = qr[d];
                            const float *kd = kt + d * ld + j0;
                            for (int l = 0; l < 4 * LANES; ++l) blk[l] += qd * kd[l];
                        }
                        memcpy(p + j0, blk, sizeof(blk));
                    }
                    for (int64_t j = j0; j < n; ++j) {
                        float s = 0.f;
                        for (int d = 0; d < D; ++d) s += qr[d] * kt[d * ld + j];
                        p[j] = s;
                    }
                    /* the keys this query sees: its row's length, the causal bound, the window, the mask */
                    const int64_t len = lens[b], qpos = len - Tq + t;
                    int64_t end = hi < len ? hi : len, start = lo;
                    if (is_causal && qpos + 1 < end) end = qpos + 1;
                    if (window > 0 && qpos - window + 1 > start) start = qpos - window + 1;
                    const uint8_t *mrow = mask ? mask + b * mb + h * mh + t * mt : NULL;
                    float mx = -INFINITY;
                    for (int64_t j = lo; j < hi; ++j) {
                        float s = -INFINITY;
                        if (j >= start && j < end && (!mrow || mrow[j * ml])) {
                            s = p[j - lo] * sm_scale;
                            if (softcap > 0.f) s = softcap * tanhf(s / softcap);
                        }
                        p[j - lo] = s;
                        if (s > mx) mx = s;
                    }
                    if (mx == -INFINITY) { /* no visible key: zeros (with sinks too) */
                        memset(o, 0, sizeof(float) * D);
                        continue;
                    }
                    float sink = 0.f;
                    if (sinks) {
                        sink = sinks[h];
                        if (sink > mx) mx = sink;
                    }
                    float denom = 0.f;
                    for (int64_t j = 0; j < n; ++j) { /* a hidden key weighs exactly 0 */
                        p[j] = p[j] == -INFINITY ? 0.f : expf(p[j] - mx);
                        denom += p[j];
                    }
                    if (sinks) denom += expf(sink - mx);
                    const float inv = 1.f / denom;
                    float *dst = v_rot ? tmp : o;
                    for (int d = 0; d < D; ++d) dst[d] = dot_f32(p, vt + d * ld, (int)n) * inv;
                    if (v_rot) /* back from V's rotated space: o @ R_v^T */
                        for (int d = 0; d < D; ++d) o[d] = dot_f32(tmp, v_rot + (int64_t)d * D, D);
                }
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * The store: quantize-on-store of new tokens, kvcompile.formats.quantize's rounding bit for bit
 * ("int8": s = amax / 127, code = round-half-even(x / s) in [-127, 127]; "fp8_e4m3" per token:
 * s = amax / 448, code = e4m3(clamp(x / s, -448, 448)) rounded to nearest even), the non-finite
 * policy included: amax over the finite values, +-Inf saturates, a NaN stays NaN in e4m3 and
 * makes an int8 token's scale NaN (its code 0). A rotation R (x @ R, float32) and a K offset come first;
 * the rotation's sums run in this file's order, so a rotated side can differ from torch's matmul by
 * the last bit of a value, at most one code step.
 * ------------------------------------------------------------------------------------------------ */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

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
    int nan = 0;
    for (int d = 0; d < n; ++d) {
        const float a = fabsf(x[d]);
        if (a != a) nan = 1;
        else if (a != INFINITY && a > amax) amax = a;
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
        if (isinf(y)) y = y > 0 ? 448.f : -448.f;
        else if (y == y) y = s > 0.f ? y / s : 0.f;
        y = y > 448.f ? 448.f : (y < -448.f ? -448.f : y);
        c[d * cd] = e4m3_encode(y);
    }
    return s;
}

/* Store T new tokens k, v [B, H, T, D] (float32, unit stride along D) at positions start + t.
 * Per side: the code kind (CODE_INT8, CODE_E4M3, CODE_Q8_0) and its scales [B, H, L, G] with
 * G = D / group (group D or 32), float32, or float16 for q8_0. k_offset [H, D] or NULL (in K's
 * rotated space), k_rot / v_rot [D, D] or NULL. */
void kvc_store(int B, int H, int T, int D, int64_t start,
               const float *k, int64_t kb, int64_t kh, int64_t kt, const float *v, int64_t vb, int64_t vh, int64_t vt,
               uint8_t *kc, int64_t kcb, int64_t kch, int64_t kcl, int64_t kcd, int k_kind,
               void *ks, int64_t ksb, int64_t ksh, int64_t ksl, int64_t ksg, int k_group,
               uint8_t *vc, int64_t vcb, int64_t vch, int64_t vcl, int64_t vcd, int v_kind,
               void *vs, int64_t vsb, int64_t vsh, int64_t vsl, int64_t vsg, int v_group,
               const float *k_offset, const float *k_rot, const float *v_rot) {
    float x[1024]; /* D <= 1024, checked by the caller */
    for (int side = 0; side < 2; ++side) {
        const float *src = side ? v : k, *rot = side ? v_rot : k_rot;
        const int64_t sb = side ? vb : kb, sh = side ? vh : kh, st = side ? vt : kt;
        uint8_t *codes = side ? vc : kc;
        void *scales = side ? vs : ks;
        const int64_t cb = side ? vcb : kcb, ch = side ? vch : kch, cl = side ? vcl : kcl, cd = side ? vcd : kcd;
        const int64_t ssb = side ? vsb : ksb, ssh = side ? vsh : ksh, ssl = side ? vsl : ksl, ssg = side ? vsg : ksg;
        const int kind = side ? v_kind : k_kind, group = side ? v_group : k_group;
        for (int b = 0; b < B; ++b)
            for (int h = 0; h < H; ++h)
                for (int t = 0; t < T; ++t) {
                    const float *row = src + b * sb + h * sh + t * st;
                    rotate_row(row, rot, D, x);
                    if (!side && k_offset)
                        for (int d = 0; d < D; ++d) x[d] -= k_offset[h * D + d];
                    const int64_t pos = start + t;
                    uint8_t *c = codes + b * cb + h * ch + pos * cl;
                    for (int g = 0; g < D / group; ++g) {
                        const float s = quantize_group(x + g * group, group, kind, c + g * group * cd, cd);
                        const int64_t i = b * ssb + h * ssh + pos * ssl + g * ssg;
                        if (kind == CODE_Q8_0) ((uint16_t *)scales)[i] = half_bits(s);
                        else ((float *)scales)[i] = s;
                    }
                }
    }
}
