/* Blend interleaves: earliest-deadline-first (ours) and largest-deficit-first (the baseline).
 *
 * Plain C loaded through ctypes, so building needs a C compiler and nothing else (no Python or
 * numpy headers). Both functions fill caller-owned output arrays and allocate only scratch that
 * grows with the number of corpora, never with the number of samples.
 *
 * EDF view: slot n = 1..N receives one sample. Item k (0-based) of corpus d may sit in slot n only
 * if count_d(n) = k + 1 <= w_d * n + 1, i.e. n >= release = ceil(k / w_d), and must sit no later
 * than deadline = floor((k + 1) / w_d) + 1, else count_d(n - 1) = k < w_d * (n - 1) - 1. Unit jobs
 * with integer release times and deadlines are scheduled optimally by EDF, and Tijdeman's
 * chairman-assignment theorem says a schedule meeting every window exists, so EDF meets them all:
 * every prefix honours every weight to within one sample.
 *
 * Each corpus has exactly one "next item", so the scheduler tracks corpora, each in one place:
 *   - a calendar of release slots (bucket = slot mod num_buckets), while its next item is not
 *     released yet;
 *   - the near set, a bitmap over (deadline mod num_slots, corpus), once released with a deadline
 *     less than num_slots ahead. Bit order from the current slot is (deadline, corpus id) order,
 *     so the first set bit is the EDF choice with ties to the lowest id;
 *   - the far heap, keyed the same way, for released items with a deadline further ahead (tiny
 *     weights, or thousands of corpora); they move to the near set in deadline order as the
 *     window reaches them.
 * Choosing from the bitmap is a few word operations; a binary heap over the ~D/2 ready corpora
 * costs a chain of dependent loads and mispredicted branches per level (measured at D = 100: the
 * bitmap is ~1.4x faster). Everything is sized from the weights alone, never from N.
 */
#include <stdint.h>
#include <stdlib.h>

/* Slots past this are "never": deadline << id_bits must fit int64 with id_bits <= 15. The clamp
 * does not depend on N, so a longer run extends a shorter one sample for sample. */
#define SLOT_NEVER (INT64_C(1) << 47)
/* Near-set size: with one top word over 64 middle words over 4096 leaf words, any first-set-bit
 * search is at most four loads, and the 32 KiB leaf level stays in L1/L2 cache. */
#define NEAR_MAX_BITS (1 << 18)
/* Calendar size: longer than the typical window puts each corpus in its bucket without laps;
 * capped so the bucket heads stay cache-resident (256 KiB). */
#define MIN_BUCKETS 16
#define MAX_BUCKETS (1 << 16)
#define HEAP_EMPTY INT64_MAX

/* Quotients are never negative, so truncation is floor; plain casts avoid a libm call per slot
 * (x86-64's baseline ISA has no SSE4.1 round instruction). */
static int64_t slot_floor(double x) { return x >= (double)SLOT_NEVER ? SLOT_NEVER : (int64_t)x; }

static int64_t slot_ceil(double x) {
    int64_t whole = slot_floor(x);
    return whole + ((double)whole < x);
}

/* Three-level bitmap; a level's bit i says whether word i of the level below is non-zero. */
typedef struct {
    uint64_t *leaf;
    uint64_t middle[64];
    uint64_t top;
} bitset;

static void bitset_add(bitset *set, uint32_t bit) {
    uint32_t word = bit >> 6;
    set->leaf[word] |= UINT64_C(1) << (bit & 63);
    set->middle[word >> 6] |= UINT64_C(1) << (word & 63);
    set->top |= UINT64_C(1) << (word >> 6);
}

/* Branch-free: whether a word emptied is folded into the mask. */
static void bitset_remove(bitset *set, uint32_t bit) {
    uint32_t word = bit >> 6;
    set->leaf[word] &= ~(UINT64_C(1) << (bit & 63));
    set->middle[word >> 6] &= ~((uint64_t)(set->leaf[word] == 0) << (word & 63));
    set->top &= ~((uint64_t)(set->middle[word >> 6] == 0) << (word >> 6));
}

/* First set bit at or after `from`, which must be a multiple of 64; -1 if there is none. The two
 * candidates (rest of from's group, first later group) are both computed and one is picked with
 * masks: which one holds the answer is a coin flip the branch predictor would lose. */
static int64_t bitset_next(const bitset *set, uint32_t from) {
    uint32_t word = from >> 6;
    uint32_t group = word >> 6;
    uint64_t words = set->middle[group] & (~UINT64_C(0) << (word & 63));
    /* (~1) << g keeps the groups above g; bit 63 keeps ctz defined when there are none. */
    uint64_t later_groups = set->top & (~UINT64_C(1) << group);
    if (!words && !later_groups) return -1;
    uint32_t later = (uint32_t)__builtin_ctzll(later_groups | UINT64_C(1) << 63);
    uint64_t in_group = -(uint64_t)(words != 0);
    uint64_t chosen_words = (words & in_group) | (set->middle[later] & ~in_group);
    uint32_t chosen_group = (group & (uint32_t)in_group) | (later & ~(uint32_t)in_group);
    word = chosen_group << 6 | (uint32_t)__builtin_ctzll(chosen_words);
    return (int64_t)word << 6 | __builtin_ctzll(set->leaf[word]);
}

/* Binary min-heap of packed keys. heap[size] always holds HEAP_EMPTY, so heap[0] is HEAP_EMPTY
 * when empty and the descent compares both children without a bounds branch. */
static void heap_push(int64_t *heap, int32_t *size, int64_t key) {
    int32_t i = (*size)++;
    heap[*size] = HEAP_EMPTY;
    while (i > 0) {
        int32_t parent = (i - 1) >> 1;
        if (heap[parent] <= key) break;
        heap[i] = heap[parent];
        i = parent;
    }
    heap[i] = key;
}

static int64_t heap_pop(int64_t *heap, int32_t *size) {
    int64_t top = heap[0];
    int32_t n = --(*size);
    int64_t last = heap[n];
    heap[n] = HEAP_EMPTY;
    int32_t i = 0;
    for (int32_t child = 1; child < n; child = 2 * i + 1) {
        child += heap[child + 1] < heap[child];
        if (heap[child] >= last) break;
        heap[i] = heap[child];
        i = child;
    }
    if (n > 0) heap[i] = last;
    return top;
}

typedef struct {
    int id_bits;
    int64_t id_mask;
    int64_t num_slots; /* deadlines the near set covers, a power of two */
    int64_t *far;
    int32_t far_size;
    bitset near;
} ready_set;

static void ready_add(ready_set *ready, int64_t now, int64_t deadline, int32_t corpus) {
    if (deadline < now + ready->num_slots) {
        int64_t slot = deadline & (ready->num_slots - 1);
        bitset_add(&ready->near, (uint32_t)(slot << ready->id_bits | corpus));
    } else {
        heap_push(ready->far, &ready->far_size, deadline << ready->id_bits | corpus);
    }
}

/* The released corpus with the earliest (deadline, id) at slot `now`, removed; -1 if none. */
static int32_t ready_take(ready_set *ready, int64_t now) {
    int64_t horizon = (now + ready->num_slots) << ready->id_bits;
    while (ready->far[0] < horizon) {
        int64_t key = heap_pop(ready->far, &ready->far_size);
        ready_add(ready, now, key >> ready->id_bits, (int32_t)(key & ready->id_mask));
    }
    /* Near deadlines lie in [now, now + num_slots), so the circular scan from now's slot visits
     * them in deadline order; every far deadline is later still. */
    uint32_t start = (uint32_t)((now & (ready->num_slots - 1)) << ready->id_bits);
    int64_t bit = bitset_next(&ready->near, start);
    if (bit < 0) bit = bitset_next(&ready->near, 0);
    if (bit >= 0) {
        bitset_remove(&ready->near, (uint32_t)bit);
        return (int32_t)(bit & ready->id_mask);
    }
    if (ready->far_size > 0) return (int32_t)(heap_pop(ready->far, &ready->far_size) & ready->id_mask);
    return -1;
}

/* Fills corpus_out/sample_out for slots 1..num_samples. Returns how many slots found no released
 * item and fell back to the earliest release (0 whenever the weights sum to 1; the count exists so
 * tests can prove it), or -1 if scratch memory could not be allocated. */
int64_t goodput_edf_interleave(const double *weight, int32_t num_corpora, int64_t num_samples,
                               int16_t *corpus_out, int64_t *sample_out) {
    /* Unnamed members start at zero: an empty near set and far heap. */
    ready_set ready = {.id_bits = 6, .num_slots = 2};
    while ((INT32_C(1) << ready.id_bits) < num_corpora) ready.id_bits++;
    ready.id_mask = (INT64_C(1) << ready.id_bits) - 1;
    double longest_window = 0.0;
    for (int32_t d = 0; d < num_corpora; d++) {
        if (1.0 / weight[d] + 2.0 > longest_window) longest_window = 1.0 / weight[d] + 2.0;
    }
    while (ready.num_slots < longest_window && (ready.num_slots << ready.id_bits) < NEAR_MAX_BITS)
        ready.num_slots *= 2;
    int64_t num_buckets = MIN_BUCKETS;
    while (num_buckets < longest_window && num_buckets < MAX_BUCKETS) num_buckets *= 2;
    const int64_t bucket_mask = num_buckets - 1;

    int64_t *count = calloc((size_t)num_corpora, sizeof(int64_t));
    int64_t *release = calloc((size_t)num_corpora, sizeof(int64_t));
    int64_t *deadline = calloc((size_t)num_corpora, sizeof(int64_t));
    int64_t *later_release = calloc((size_t)num_corpora, sizeof(int64_t));
    int32_t *next_in_bucket = calloc((size_t)num_corpora, sizeof(int32_t));
    int32_t *bucket_head = calloc((size_t)num_buckets, sizeof(int32_t));
    ready.far = calloc((size_t)num_corpora + 1, sizeof(int64_t));
    ready.near.leaf = calloc((size_t)((ready.num_slots << ready.id_bits) >> 6), sizeof(uint64_t));
    int64_t fallbacks = -1;
    if (!count || !release || !deadline || !later_release || !next_in_bucket || !bucket_head ||
        !ready.far || !ready.near.leaf)
        goto done;

    for (int64_t b = 0; b < num_buckets; b++) bucket_head[b] = -1;
    ready.far[0] = HEAP_EMPTY;
    for (int32_t d = 0; d < num_corpora; d++) {
        deadline[d] = slot_floor(1.0 / weight[d]) + 1;
        later_release[d] = slot_ceil(1.0 / weight[d]);
        ready_add(&ready, 1, deadline[d], d);
    }

    fallbacks = 0;
    for (int64_t n = 1; n <= num_samples; n++) {
        /* Corpora whose next item is released at slot n become ready. A bucket may also hold
         * corpora a whole lap of the calendar ahead; they stay. */
        int32_t *link = &bucket_head[n & bucket_mask];
        while (*link >= 0) {
            int32_t d = *link;
            if (release[d] <= n) {
                *link = next_in_bucket[d];
                ready_add(&ready, n, deadline[d], d);
            } else {
                link = &next_in_bucket[d];
            }
        }

        int32_t chosen = ready_take(&ready, n);
        if (chosen < 0) {
            /* Unreachable when the weights sum to 1 (more than n items are released by slot n),
             * but rounding must never crash a run: take the earliest release, lowest id. */
            chosen = 0;
            for (int32_t d = 1; d < num_corpora; d++) {
                if (release[d] < release[chosen]) chosen = d;
            }
            link = &bucket_head[release[chosen] & bucket_mask];
            while (*link != chosen) link = &next_in_bucket[*link];
            *link = next_in_bucket[chosen];
            fallbacks++;
        }

        corpus_out[n - 1] = (int16_t)chosen;
        sample_out[n - 1] = count[chosen];
        int64_t k = ++count[chosen];
        /* Item k's release ceil(k / w) comes from the quotient that gave item k-1 its deadline:
         * one division per slot, the two windows never disagree by a rounding, and the division
         * stays off the path from this slot's choice to the next. An item released already joins
         * at the next slot, through the calendar like any other. */
        release[chosen] = later_release[chosen] > n ? later_release[chosen] : n + 1;
        double quotient = (double)(k + 1) / weight[chosen];
        deadline[chosen] = slot_floor(quotient) + 1;
        later_release[chosen] = slot_ceil(quotient);
        int32_t *head = &bucket_head[release[chosen] & bucket_mask];
        next_in_bucket[chosen] = *head;
        *head = chosen;
    }

done:
    free(count);
    free(release);
    free(deadline);
    free(later_release);
    free(next_in_bucket);
    free(bucket_head);
    free(ready.far);
    free(ready.near.leaf);
    return fallbacks;
}

/* The classic greedy: at sample i give the slot to the corpus furthest behind its target
 * w_d * max(i, 1), ties to the lowest id. O(N * D). Returns -1 if scratch could not be allocated. */
int64_t goodput_greedy_interleave(const double *weight, int32_t num_corpora, int64_t num_samples,
                                  int16_t *corpus_out, int64_t *sample_out) {
    int64_t *count = calloc((size_t)num_corpora, sizeof(int64_t));
    if (!count) return -1;
    for (int64_t i = 0; i < num_samples; i++) {
        double target = i > 0 ? (double)i : 1.0;
        int32_t chosen = 0;
        double worst = weight[0] * target - (double)count[0];
        for (int32_t d = 1; d < num_corpora; d++) {
            double deficit = weight[d] * target - (double)count[d];
            if (deficit > worst) {
                worst = deficit;
                chosen = d;
            }
        }
        corpus_out[i] = (int16_t)chosen;
        sample_out[i] = count[chosen]++;
    }
    free(count);
    return 0;
}
