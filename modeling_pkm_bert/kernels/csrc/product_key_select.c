/*
 * Exact product-key selection on CPU: from the sub-key scores of every (head, half), the top-knn product keys of each
 * (token, head), as `ProductKeyMemory.search` computes them with torch.topk (see `_combine_halves`).
 *
 * Per half: a threshold from the maxima of 2 * knn disjoint groups of sub-keys (at least knn scores reach the knn-th
 * largest maximum) leaves a few dozen candidates, ranked by counting. Per head: the pruned rank pairs (a, b) with
 * (a + 1) * (b + 1) <= knn are scored, those below a lower bound on the knn-th best sum are dropped, the rest ranked.
 * Ties rank the earlier sub-key (or pair) first. AVX-512 paths where the compiler targets it, portable C elsewhere.
 * Built and loaded at run time by `modeling_pkm_bert/cpu_kernels.py`.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* The k best of `count` values, sorted descending (ties: the earlier first), each placed at its counted rank. */
static void rank_select(const float *vals, const int32_t *idx, int count, int k, float *out_vals, int32_t *out_idx) {
#if defined(__AVX512F__)
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i one = _mm512_set1_epi32(1);
    int32_t ranks[16];
    for (int i = 0; i < count; i += 16) { /* the ranks of 16 values at once: every value adds 1 to those it beats */
        int end = count - i >= 16 ? i + 16 : count;
        __mmask16 valid = (__mmask16)((1u << (end - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(valid, vals + i);
        __m512i position = _mm512_add_epi32(lanes, _mm512_set1_epi32(i));
        __m512i rank = _mm512_setzero_si512();
        for (int j = 0; j < i; j++) /* earlier than every lane: a tie beats too */
            rank = _mm512_mask_add_epi32(rank, _mm512_cmp_ps_mask(_mm512_set1_ps(vals[j]), v, _CMP_GE_OQ), rank, one);
        for (int j = i; j < end; j++) { /* the block itself: a tie beats the later lanes */
            __m512 w = _mm512_set1_ps(vals[j]);
            __mmask16 beats = _mm512_cmp_ps_mask(w, v, _CMP_GT_OQ) |
                              (_mm512_cmp_ps_mask(w, v, _CMP_EQ_OQ) & _mm512_cmpgt_epi32_mask(position, _mm512_set1_epi32(j)));
            rank = _mm512_mask_add_epi32(rank, beats, rank, one);
        }
        for (int j = end; j < count; j++) /* later than every lane: only a larger value beats */
            rank = _mm512_mask_add_epi32(rank, _mm512_cmp_ps_mask(_mm512_set1_ps(vals[j]), v, _CMP_GT_OQ), rank, one);
        _mm512_storeu_si512(ranks, rank);
        for (int l = 0; l < end - i; l++)
            if (ranks[l] < k) { out_vals[ranks[l]] = vals[i + l]; out_idx[ranks[l]] = idx[i + l]; }
    }
#else
    for (int i = 0; i < count; i++) {
        float v = vals[i];
        int rank = 0;
        for (int j = 0; j < count; j++) rank += (vals[j] > v) | ((vals[j] == v) & (j < i));
        if (rank < k) { out_vals[rank] = v; out_idx[rank] = idx[i]; }
    }
#endif
}

/* The k-th largest of the g group maxima: at least k scores are >= it. */
static float kth_largest(const float *maxima, int g, int k) {
#if defined(__AVX512F__)
    if (g == 64) {
        __m512 m[4];
        __m512i above[4];
        const __m512i one = _mm512_set1_epi32(1);
        for (int q = 0; q < 4; q++) { m[q] = _mm512_loadu_ps(maxima + 16 * q); above[q] = _mm512_setzero_si512(); }
        for (int d = 0; d < g; d++) {
            __m512 w = _mm512_set1_ps(maxima[d]);
            for (int q = 0; q < 4; q++)
                above[q] = _mm512_mask_add_epi32(above[q], _mm512_cmp_ps_mask(w, m[q], _CMP_GE_OQ), above[q], one);
        }
        __m512 best = _mm512_set1_ps(-INFINITY);
        for (int q = 0; q < 4; q++)
            best = _mm512_mask_max_ps(best, _mm512_cmpge_epi32_mask(above[q], _mm512_set1_epi32(k)), best, m[q]);
        return _mm512_reduce_max_ps(best);
    }
#endif
    float t = -INFINITY;
    for (int c = 0; c < g; c++) {
        int above = 0;
        for (int d = 0; d < g; d++) above += maxima[d] >= maxima[c];
        t = (above >= k && maxima[c] > t) ? maxima[c] : t;
    }
    return t;
}

/* The top k of one row of n scores, sorted descending; nonzero if the row holds a NaN (the caller falls back). */
static int row_topk(const float *row, int n, int k, float *vals, int32_t *idx, float *cand, int32_t *cand_idx) {
    /* group c: the scores j with j % g == c, so that the maxima are a vertical (vectorised) max */
    int g = 2 * k < n ? 2 * k : n;
    float maxima[g];
    for (int c = 0; c < g; c++) maxima[c] = row[c];
    for (int j = g; j < n; j += g) {
        int width = n - j < g ? n - j : g;
        for (int c = 0; c < width; c++) maxima[c] = row[j + c] > maxima[c] ? row[j + c] : maxima[c];
    }
    float t = kth_largest(maxima, g, k);
    int count = 0, nan = 0;
#if defined(__AVX512F__)
    if (n % 16 == 0) {
        const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 threshold = _mm512_set1_ps(t);
        __mmask16 unordered = 0;
        for (int j = 0; j < n; j += 16) {
            __m512 x = _mm512_loadu_ps(row + j);
            __mmask16 keep = _mm512_cmp_ps_mask(x, threshold, _CMP_GE_OQ);
            unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            _mm512_storeu_ps(cand + count, _mm512_maskz_compress_ps(keep, x));
            _mm512_storeu_si512(cand_idx + count, _mm512_maskz_compress_epi32(keep, _mm512_add_epi32(lanes, _mm512_set1_epi32(j))));
            count += __builtin_popcount(keep);
        }
        nan = unordered != 0;
    } else
#endif
    for (int j = 0; j < n; j++) {
        float x = row[j];
        nan |= x != x;
        cand[count] = x;
        cand_idx[count] = j;
        count += x >= t;
    }
    if (nan || count < k) return 1;
    rank_select(cand, cand_idx, count, k, vals, idx);
    return 0;
}

/*
 * subkey_scores: (heads * 2, tokens, n_keys), row (2 h + s, t) the scores of head h's half s for token t;
 * pair_a, pair_b: the n_pairs rank pairs to score; out_scores, out_indices: (tokens, heads, knn), for the tokens
 * [token_begin, token_end). Returns 0, 1 when a score or a sum is NaN (nothing reliable written: use torch), -1 when
 * out of memory.
 */
int pkm_select_product_keys(const float *subkey_scores, int64_t heads, int64_t tokens, int64_t n_keys, int64_t knn,
                            const int32_t *pair_a, const int32_t *pair_b, int64_t n_pairs, float *out_scores,
                            int64_t *out_indices, int64_t token_begin, int64_t token_end) {
    float v1[knn], v2[knn], pair_vals[knn];
    int32_t i1[knn], i2[knn], pair_idx[knn];
    for (int64_t j = 0; j < knn; j++) i1[j] = i2[j] = pair_idx[j] = 0; /* never read unset: a bug gives wrong, not wild */
    int64_t size = (n_keys > n_pairs ? n_keys : n_pairs) + 16; /* room for a full vector store past the last candidate */
    float *cand = malloc(sizeof(float) * size);
    int32_t *cand_idx = malloc(sizeof(int32_t) * size);
    if (!cand || !cand_idx) { free(cand); free(cand_idx); return -1; }
    int bad = 0;
    for (int64_t t = token_begin; t < token_end && !bad; t++) {
        for (int64_t h = 0; h < heads && !bad; h++) {
            bad = row_topk(subkey_scores + (2 * h * tokens + t) * n_keys, n_keys, knn, v1, i1, cand, cand_idx) ||
                  row_topk(subkey_scores + ((2 * h + 1) * tokens + t) * n_keys, n_keys, knn, v2, i2, cand, cand_idx);
            if (bad) break;
            /* the r * ceil(knn / r) pairs with a < r, b < ceil(knn / r) all score >= v1[r - 1] + v2[ceil(knn / r) - 1]:
               the knn-th best sum is at least the largest of these bounds */
            float bound = -INFINITY;
            for (int64_t r = 1; r <= knn; r++) {
                float x = v1[r - 1] + v2[(knn + r - 1) / r - 1];
                bound = x > bound ? x : bound;
            }
            int count = 0, nan = bound != bound; /* inf - inf */
#if defined(__AVX512F__)
            if (knn <= 32) { /* both lists in two registers each: the pair sums are permutes */
                __mmask16 low = knn >= 16 ? 0xFFFF : (__mmask16)((1u << knn) - 1);
                __mmask16 high = knn <= 16 ? 0 : (__mmask16)((1u << (knn - 16)) - 1);
                __m512 first_low = _mm512_maskz_loadu_ps(low, v1), first_high = _mm512_maskz_loadu_ps(high, v1 + 16);
                __m512 second_low = _mm512_maskz_loadu_ps(low, v2), second_high = _mm512_maskz_loadu_ps(high, v2 + 16);
                const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
                const __m512 threshold = _mm512_set1_ps(bound);
                __mmask16 unordered = 0;
                for (int64_t p = 0; p < n_pairs; p += 16) {
                    __mmask16 valid = n_pairs - p >= 16 ? 0xFFFF : (__mmask16)((1u << (n_pairs - p)) - 1);
                    __m512i a = _mm512_maskz_loadu_epi32(valid, pair_a + p), b = _mm512_maskz_loadu_epi32(valid, pair_b + p);
                    __m512 x = _mm512_add_ps(_mm512_permutex2var_ps(first_low, a, first_high),
                                             _mm512_permutex2var_ps(second_low, b, second_high));
                    unordered |= _mm512_mask_cmp_ps_mask(valid, x, x, _CMP_UNORD_Q);
                    __mmask16 keep = _mm512_mask_cmp_ps_mask(valid, x, threshold, _CMP_GE_OQ);
                    _mm512_storeu_ps(cand + count, _mm512_maskz_compress_ps(keep, x));
                    _mm512_storeu_si512(cand_idx + count,
                                        _mm512_maskz_compress_epi32(keep, _mm512_add_epi32(lanes, _mm512_set1_epi32((int)p))));
                    count += __builtin_popcount(keep);
                }
                nan |= unordered != 0;
            } else
#endif
            for (int64_t p = 0; p < n_pairs; p++) {
                float x = v1[pair_a[p]] + v2[pair_b[p]];
                nan |= x != x;
                cand[count] = x;
                cand_idx[count] = (int32_t)p;
                count += x >= bound;
            }
            if (nan || count < knn) { bad = 1; break; }
            rank_select(cand, cand_idx, count, knn, pair_vals, pair_idx);
            float *scores = out_scores + (t * heads + h) * knn;
            int64_t *indices = out_indices + (t * heads + h) * knn;
            for (int j = 0; j < knn; j++) {
                scores[j] = pair_vals[j];
                indices[j] = (int64_t)i1[pair_a[pair_idx[j]]] * n_keys + i2[pair_b[pair_idx[j]]];
            }
        }
    }
    free(cand);
    free(cand_idx);
    return bad;
}
