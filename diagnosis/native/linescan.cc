/* diagnosis.native._linescan: one pass over a buffer of complete lines, finding the
 * uncovered lines of the RE2 run-scan filter, each keyed (digits 1-9 as '0') and
 * counted per distinct key, without a Python object per line.
 *
 * A CPython extension built when forgeflow is installed (setup.py: an optional
 * setuptools Extension linking RE2 through its public C++ API, re2/re2.h); where it is
 * not built, diagnosis.filters.LogCompressor runs its pure-Python scan, which gives the
 * same result (tests/unit/diagnosis/test_native_scan.py compares both).
 *
 * Pattern: the filter's run pattern compiled by this module's own RE2 with the options
 * diagnosis.engine gives google-re2 (RE2's defaults, max_mem, no error log, Latin-1 for
 * an ASCII pattern), so a covered run ends where RunScanFilter.uncovered_spans finds it.
 * Table: the key table of one LogCompressor and its scan (Table.scan), run with the GIL
 * released; one call at a time per table.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <re2/re2.h>
#include <re2/stringpiece.h> /* its own class in RE2 2022, absl::string_view since */

#include <new>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#ifndef FF_SOURCE_SHA256 /* setup.py defines it: diagnosis.native refuses a build of another source */
#define FF_SOURCE_SHA256 ""
#endif

/* What the table knows of one key (one struct: one cache line to touch per line). */
typedef struct {
    int64_t off;     /* its bytes: arena[off:off + len] */
    int64_t stamp;   /* the scan that last touched it */
    int32_t len;
    int32_t touched; /* its index among that scan's touched ids */
    int8_t status;   /* FF_KEEP, FF_OVERFLOW or FF_BLANK (see ff_set_status) */
} ff_key;

typedef struct {
    /* open addressing: a slot holds (hash tag << 32) | (id + 1); 0 = empty */
    uint64_t *slots;
    int64_t cap; /* power of two */
    int32_t n_ids, ids_cap;
    ff_key *keys;
    char *arena;
    int64_t arena_len, arena_cap;
    int64_t scan_no;
    unsigned char *scratch;
    int64_t scratch_cap;
    /* the fingerprints of the uncovered entries' templates (a set of byte strings) */
    int32_t *print_slots;
    uint64_t *print_hash;
    int64_t print_cap, n_prints, prints_cap;
    int64_t *print_off, *print_len;
    char *print_arena;
    int64_t print_arena_len, print_arena_cap;
    /* new keys of the last scan, each followed by '\n' (see ff_scan) */
    char *new_keys;
    int64_t new_keys_len, new_keys_cap;
    /* and their template bodies (see ff_body), in the same order */
    char *new_bodies;
    int64_t new_bodies_len, new_bodies_cap;
    /* the last scan's lines and distinct ids (see ff_scan), out_cap slots each */
    int64_t *o_start, *o_end, *o_line, *t_count, *t_first, *t_last;
    int32_t *o_id, *t_id;
    int64_t out_cap;
} ff_table;

enum { FF_KEEP = 0, FF_OVERFLOW = 1, FF_BLANK = 2 };

static void ff_clear_ids(ff_table *t) {
    free(t->slots); free(t->keys); free(t->arena);
    t->slots = NULL; t->keys = NULL; t->arena = NULL;
    t->cap = 0; t->n_ids = t->ids_cap = 0; t->arena_len = t->arena_cap = 0;
}

static ff_table *ff_new(void) { return (ff_table *)calloc(1, sizeof(ff_table)); }

static void ff_free(ff_table *t) {
    if (!t) return;
    ff_clear_ids(t);
    free(t->scratch); free(t->print_slots); free(t->print_hash); free(t->print_off);
    free(t->print_len); free(t->print_arena); free(t->new_keys); free(t->new_bodies);
    free(t->o_start); free(t->o_end); free(t->o_line); free(t->t_count); free(t->t_first);
    free(t->t_last); free(t->o_id); free(t->t_id);
    free(t);
}

/* Forget every key (ids start again at 0); the fingerprints stay. */
static void ff_reset(ff_table *t) { ff_clear_ids(t); }

static int32_t ff_n_ids(ff_table *t) { return t->n_ids; }

static int64_t ff_arena_bytes(ff_table *t) { return t->arena_len; }

static uint64_t ff_hash(const unsigned char *p, int64_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
        p += 8; n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, (size_t)n);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
    return h;
}

static int ff_grow_slots(ff_table *t) {
    int64_t cap = t->cap ? t->cap * 2 : 1 << 14;
    uint64_t *slots = (uint64_t *)calloc((size_t)cap, sizeof(uint64_t));
    if (!slots) return -1;
    for (int64_t i = 0; i < t->cap; i++) {
        if (!t->slots[i]) continue;
        int64_t j = (int64_t)((t->slots[i] >> 32) & (uint64_t)(cap - 1));
        while (slots[j]) j = (j + 1) & (cap - 1);
        slots[j] = t->slots[i];
    }
    free(t->slots);
    t->slots = slots; t->cap = cap;
    return 0;
}

#define FF_GROW(ptr, type, n) do { \
        void *g_ = realloc((ptr), (size_t)(n) * sizeof(type)); \
        if (!g_) return -1; \
        (ptr) = (type *)g_; \
    } while (0)

/* id of the key (scratch[0:n]); a new key gets the next id. -1: out of memory */
static int32_t ff_intern(ff_table *t, const unsigned char *key, int64_t n, int *is_new) {
    *is_new = 0;
    if ((int64_t)(t->n_ids + 1) * 2 > t->cap && ff_grow_slots(t) < 0) return -1;
    uint64_t tag = ff_hash(key, n) >> 32;
    int64_t mask = t->cap - 1, j = (int64_t)(tag & (uint64_t)mask);
    for (;;) {
        uint64_t s = t->slots[j];
        if (!s) break;
        if (s >> 32 == tag) {
            int32_t id = (int32_t)(uint32_t)s - 1;
            if (t->keys[id].len == n && memcmp(t->arena + t->keys[id].off, key, (size_t)n) == 0) return id;
        }
        j = (j + 1) & mask;
    }
    if (t->n_ids == t->ids_cap) {
        int32_t cap = t->ids_cap ? t->ids_cap * 2 : 1 << 12;
        FF_GROW(t->keys, ff_key, cap);
        t->ids_cap = cap;
    }
    if (t->arena_len + n > t->arena_cap) {
        int64_t cap = t->arena_cap ? t->arena_cap : 1 << 20;
        while (cap < t->arena_len + n) cap *= 2;
        FF_GROW(t->arena, char, cap);
        t->arena_cap = cap;
    }
    int32_t id = t->n_ids++;
    *is_new = 1;
    memcpy(t->arena + t->arena_len, key, (size_t)n);
    t->keys[id].off = t->arena_len;
    t->keys[id].len = (int32_t)n;
    t->keys[id].stamp = 0;
    t->keys[id].touched = 0;
    t->keys[id].status = FF_KEEP;
    t->arena_len += n;
    t->slots[j] = (tag << 32) | (uint64_t)(uint32_t)(id + 1);
    return id;
}

/* What a key's fingerprint keeps (diagnosis.filters._NOT_PRINT): printable ASCII less
 * digits and the letters and signs of the rank prefixes; then stripped of end spaces.
 * A table, filled once: a strchr per byte took ~4 % of the compressor's CPU on the varied
 * benchmark log, where every new key past the entry budget is fingerprinted. */
static unsigned char ff_print_table[256]; /* filled when the module is imported */

static void ff_fill_print_table(void) {
    for (int c = 0; c < 256; c++)
        ff_print_table[c] = c >= 32 && c <= 126 && !(c >= '0' && c <= '9') && !strchr("[]:rankdefault", c);
}

static int64_t ff_fingerprint(const unsigned char *key, int64_t n, unsigned char *out) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) { /* no branch per byte: out has room for n bytes */
        out[m] = key[i];
        m += ff_print_table[key[i]];
    }
    int64_t lo = 0;
    while (lo < m && out[lo] == ' ') lo++;
    while (m > lo && out[m - 1] == ' ') m--;
    if (lo) memmove(out, out + lo, (size_t)(m - lo));
    return m - lo;
}

static int ff_grow_prints(ff_table *t) {
    int64_t cap = t->print_cap ? t->print_cap * 2 : 1 << 14;
    int32_t *slots = (int32_t *)calloc((size_t)cap, sizeof(int32_t));
    uint64_t *hashes = (uint64_t *)malloc((size_t)cap * sizeof(uint64_t));
    if (!slots || !hashes) { free(slots); free(hashes); return -1; }
    for (int64_t i = 0; i < t->print_cap; i++) {
        if (!t->print_slots[i]) continue;
        int64_t j = (int64_t)(t->print_hash[i] & (uint64_t)(cap - 1));
        while (slots[j]) j = (j + 1) & (cap - 1);
        slots[j] = t->print_slots[i];
        hashes[j] = t->print_hash[i];
    }
    free(t->print_slots); free(t->print_hash);
    t->print_slots = slots; t->print_hash = hashes; t->print_cap = cap;
    return 0;
}

/* 1 when print[0:n] is a known fingerprint; with add, it becomes one. -1: no memory */
static int ff_print_lookup(ff_table *t, const unsigned char *print, int64_t n, int add) {
    if (add && (t->n_prints + 1) * 2 > t->print_cap && ff_grow_prints(t) < 0) return -1;
    if (!t->print_cap) return 0;
    uint64_t h = ff_hash(print, n);
    int64_t mask = t->print_cap - 1, j = (int64_t)(h & (uint64_t)mask);
    for (;;) {
        int32_t s = t->print_slots[j];
        if (!s) break;
        if (t->print_hash[j] == h && t->print_len[s - 1] == n &&
            memcmp(t->print_arena + t->print_off[s - 1], print, (size_t)n) == 0) return 1;
        j = (j + 1) & mask;
    }
    if (!add) return 0;
    if (t->n_prints == t->prints_cap) {
        int64_t cap = t->prints_cap ? t->prints_cap * 2 : 1024;
        FF_GROW(t->print_off, int64_t, cap);
        FF_GROW(t->print_len, int64_t, cap);
        t->prints_cap = cap;
    }
    if (t->print_arena_len + n > t->print_arena_cap) {
        int64_t cap = t->print_arena_cap ? t->print_arena_cap : 1 << 16;
        while (cap < t->print_arena_len + n) cap *= 2;
        FF_GROW(t->print_arena, char, cap);
        t->print_arena_cap = cap;
    }
    int64_t k = t->n_prints++;
    memcpy(t->print_arena + t->print_arena_len, print, (size_t)n);
    t->print_off[k] = t->print_arena_len;
    t->print_len[k] = n;
    t->print_arena_len += n;
    t->print_slots[j] = (int32_t)(k + 1);
    t->print_hash[j] = h;
    return 0;
}

/* Add fingerprints, each followed by '\n'. 0, or -1 when out of memory. */
static int ff_add_prints(ff_table *t, const char *joined, int64_t size) {
    int64_t pos = 0;
    while (pos < size) {
        const char *nl = (const char *)memchr(joined + pos, '\n', (size_t)(size - pos));
        int64_t end = nl ? (int64_t)(nl - joined) : size;
        if (ff_print_lookup(t, (const unsigned char *)joined + pos, end - pos, 1) < 0) return -1;
        pos = end + 1;
    }
    return 0;
}

/* What the caller decided for keys of the last scans: their lines are no longer
 * reported but counted (FF_OVERFLOW) or skipped (FF_BLANK). */
static void ff_set_status(ff_table *t, const int32_t *ids, int64_t n, int8_t status) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] >= 0 && ids[i] < t->n_ids) t->keys[ids[i]].status = status;
}

static const char *ff_memmem(const unsigned char *hay, int64_t n, const char *needle, int64_t m) {
    for (int64_t i = 0; i + m <= n; i++)
        if (hay[i] == (unsigned char)needle[0] && memcmp(hay + i, needle, (size_t)m) == 0)
            return (const char *)hay + i;
    return NULL;
}

/* A key's template body (diagnosis.filters._uncovered_template before decoding): each
 * run of k '0's as ceil(k / 8) of them (three passes of "00" -> "0"), then without
 * the first of the launcher prefixes "[rank0]:", "[default0]:", "0: " it starts with.
 * Writes at most n bytes to out; returns the length. */
static int64_t ff_body(const unsigned char *key, int64_t n, unsigned char *out) {
    int64_t m = 0, i = 0;
    while (i < n) {
        if (key[i] != '0') { out[m++] = key[i++]; continue; }
        int64_t run = 0;
        while (i < n && key[i] == '0') { run++; i++; }
        for (int64_t k = (run + 7) / 8; k > 0; k--) out[m++] = '0';
    }
    int64_t cut = 0;
    if (m >= 8 && memcmp(out, "[rank0]:", 8) == 0) cut = 8;
    else if (m >= 11 && memcmp(out, "[default0]:", 11) == 0) cut = 11;
    else if (m >= 3 && memcmp(out, "0: ", 3) == 0) cut = 3;
    if (cut) memmove(out, out + cut, (size_t)(m - cut));
    return m - cut;
}

static int64_t ff_count_newlines(const char *p, int64_t n) {
    int64_t c = 0, i = 0;
#if defined(__SSE2__)
    /* per-byte counters (0 - (-1) per newline), summed by psadbw every 255 blocks: no
     * popcount, which without -mpopcnt is a library call per 16 bytes */
    const __m128i nl = _mm_set1_epi8('\n'), zero = _mm_setzero_si128();
    while (i + 16 <= n) {
        __m128i acc = zero;
        int64_t stop = i + 255 * 16 < n ? i + 255 * 16 : n;
        for (; i + 16 <= stop; i += 16)
            acc = _mm_sub_epi8(acc, _mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)(p + i)), nl));
        __m128i sums = _mm_sad_epu8(acc, zero);
        c += _mm_cvtsi128_si64(sums) + _mm_cvtsi128_si64(_mm_unpackhi_epi64(sums, sums));
    }
#endif
    for (; i < n; i++) c += p[i] == '\n';
    return c;
}

static int ff_grow_out(ff_table *t) {
    int64_t cap = t->out_cap ? t->out_cap * 2 : 1 << 14;
    FF_GROW(t->o_start, int64_t, cap);
    FF_GROW(t->o_end, int64_t, cap);
    FF_GROW(t->o_line, int64_t, cap);
    FF_GROW(t->t_count, int64_t, cap);
    FF_GROW(t->t_first, int64_t, cap);
    FF_GROW(t->t_last, int64_t, cap);
    FF_GROW(t->o_id, int32_t, cap);
    FF_GROW(t->t_id, int32_t, cap);
    t->out_cap = cap;
    return 0;
}

/* Scan buf[0:size] (complete lines, ending in '\n').
 *
 * sig[0:n_sig]: ascending starts of the error-signal lines (kept by the caller one
 * by one): for each, sig_line gets its line index and sig_uncovered whether no rule
 * covers it; those lines are not keyed.
 * Every other uncovered line gets (in the table's o_ arrays) o_start/o_end (its bytes, without the newline),
 * o_line (its 0-based line index in buf) and o_id: the id of its key (the line with
 * digits 1-9 as '0'), or -1 for a line longer than max_line (not keyed).
 * Each distinct id among them, in order of first appearance: t_id, t_count (lines),
 * t_first (index into the o_ arrays of its first line), t_last (line index of its
 * last line). Ids at or above the table's n_ids before the call are new keys.
 *
 * Lines of keys whose status is FF_OVERFLOW are only counted (out[3]), those of FF_BLANK
 * keys skipped. With budget_spent (no uncovered entry can open any more), a new key
 * whose fingerprint is not among ff_add_prints' gets FF_OVERFLOW at once (unless it may
 * be a line of torchrun's failure summary: those go to the caller one by one), as
 * LogCompressor._resolve_new_keys would decide. The new keys that are reported are in
 * t->new_keys, each followed by '\n', in order of their ids, and their
 * template bodies (ff_body) in t->new_bodies the same way.
 *
 * out[0] = uncovered lines written, out[1] = distinct ids, out[2] = lines in buf,
 * out[3] = lines counted as overflow.
 * Returns 0, or -1 when out of memory.
 */
static int ff_scan(ff_table *t, const re2::RE2 &re, const char *buf, int64_t size,
                   int64_t max_line, int budget_spent, const int64_t *sig, int64_t n_sig, int8_t *sig_uncovered,
                   int64_t *sig_line, int64_t *out) {
    const re2::StringPiece text(buf, (size_t)size);
    re2::StringPiece sub;
    int64_t pos = 0, cur = 0, line = 0, j = 0, n_out = 0, n_touched = 0, overflow = 0;
    int64_t scan_no = ++t->scan_no;
    t->new_keys_len = 0;
    t->new_bodies_len = 0;
    if (!t->out_cap && ff_grow_out(t) < 0) return -1;
    while (pos < size) {
        int64_t end = -1;
        sub = re2::StringPiece();
        if (re.Match(text, (size_t)pos, (size_t)size, re2::RE2::ANCHOR_START, &sub, 1) && sub.data())
            end = (int64_t)(sub.data() - buf) + (int64_t)sub.size();
        if (end > pos) {
            /* a run of covered lines: its signal lines are covered */
            while (j < n_sig && sig[j] < end) {
                line += ff_count_newlines(buf + cur, sig[j] - cur);
                cur = sig[j];
                sig_line[j] = line;
                sig_uncovered[j] = 0;
                j++;
            }
            line += ff_count_newlines(buf + cur, end - cur);
            cur = pos = end;
            if (pos >= size) break; /* the run is maximal: the line at its end is uncovered */
        }
        const char *nl = (const char *)memchr(buf + pos, '\n', (size_t)(size - pos));
        int64_t newline = nl ? (int64_t)(nl - buf) : size;
        while (j < n_sig && sig[j] < pos) { /* not at a line start: cannot happen */
            sig_line[j] = line; sig_uncovered[j] = 0; j++;
        }
        if (j < n_sig && sig[j] == pos) {
            sig_line[j] = line;
            sig_uncovered[j] = 1;
            j++;
        } else {
            int64_t n = newline - pos;
            int32_t id = -1;
            if (n_out == t->out_cap && ff_grow_out(t) < 0) return -1; /* n_touched <= n_out */
            if (n <= max_line && n < INT32_MAX) {
                if (2 * n > t->scratch_cap) { /* the key, then its fingerprint */
                    int64_t cap = t->scratch_cap ? t->scratch_cap : 4096;
                    while (cap < 2 * n) cap *= 2;
                    FF_GROW(t->scratch, unsigned char, cap);
                    t->scratch_cap = cap;
                }
                const unsigned char *src = (const unsigned char *)buf + pos;
                unsigned char *dst = t->scratch;
                for (int64_t i = 0; i < n; i++) {
                    unsigned char c = src[i];
                    dst[i] = (unsigned char)(c - '1') < 9 ? '0' : c;
                }
                int is_new;
                id = ff_intern(t, dst, n, &is_new);
                if (id < 0) return -1;
                if (is_new) {
                    if (budget_spent && !(n && memchr("[0123456789 ", dst[0], 12) &&
                                          (ff_memmem(dst, n, "host", 4) || ff_memmem(dst, n, "local_rank", 10)))) {
                        int64_t m = ff_fingerprint(dst, n, dst + n);
                        int known = ff_print_lookup(t, dst + n, m, 0);
                        if (known < 0) return -1;
                        if (!known) t->keys[id].status = FF_OVERFLOW;
                    }
                    if (t->keys[id].status == FF_KEEP) {
                        if (t->new_keys_len + n + 1 > t->new_keys_cap) {
                            int64_t cap = t->new_keys_cap ? t->new_keys_cap : 1 << 16;
                            while (cap < t->new_keys_len + n + 1) cap *= 2;
                            FF_GROW(t->new_keys, char, cap);
                            t->new_keys_cap = cap;
                        }
                        memcpy(t->new_keys + t->new_keys_len, dst, (size_t)n);
                        t->new_keys[t->new_keys_len + n] = '\n';
                        t->new_keys_len += n + 1;
                        if (t->new_bodies_len + n + 1 > t->new_bodies_cap) {
                            int64_t cap = t->new_bodies_cap ? t->new_bodies_cap : 1 << 16;
                            while (cap < t->new_bodies_len + n + 1) cap *= 2;
                            FF_GROW(t->new_bodies, char, cap);
                            t->new_bodies_cap = cap;
                        }
                        int64_t m = ff_body(dst, n, (unsigned char *)t->new_bodies + t->new_bodies_len);
                        t->new_bodies[t->new_bodies_len + m] = '\n';
                        t->new_bodies_len += m + 1;
                    }
                }
                if (t->keys[id].status != FF_KEEP) {
                    overflow += t->keys[id].status == FF_OVERFLOW;
                    goto next_line;
                }
                if (t->keys[id].stamp != scan_no) {
                    int32_t *t_id = t->t_id;
                    int64_t *t_count = t->t_count, *t_first = t->t_first, *t_last = t->t_last;
                    t->keys[id].stamp = scan_no;
                    t->keys[id].touched = (int32_t)n_touched;
                    t_id[n_touched] = id;
                    t_count[n_touched] = 1;
                    t_first[n_touched] = n_out;
                    t_last[n_touched] = line;
                    n_touched++;
                } else {
                    int32_t k = t->keys[id].touched;
                    t->t_count[k]++;
                    t->t_last[k] = line;
                }
            }
            t->o_start[n_out] = pos;
            t->o_end[n_out] = newline;
            t->o_line[n_out] = line;
            t->o_id[n_out] = id;
            n_out++;
        }
    next_line:
        if (newline >= size) { cur = pos = size; break; }
        line += 1;
        cur = pos = newline + 1;
    }
    while (j < n_sig) { /* past the last line: cannot happen */
        sig_line[j] = line; sig_uncovered[j] = 0; j++;
    }
    line += ff_count_newlines(buf + cur, size - cur);
    out[0] = n_out;
    out[1] = n_touched;
    out[2] = line;
    out[3] = overflow;
    return 0;
}


/* ------------------------------------------------------------------ Python binding */

/* Pattern(pattern: bytes, latin1: bool, max_mem: int): the run pattern compiled by RE2. */
typedef struct {
    PyObject_HEAD
    re2::RE2 *re;
} PatternObject;

static void Pattern_dealloc(PatternObject *self) {
    delete self->re;
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Pattern_init(PatternObject *self, PyObject *args, PyObject *kwds) {
    static const char *kwlist[] = {"pattern", "latin1", "max_mem", NULL};
    Py_buffer pattern;
    int latin1;
    long long max_mem;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*pL", (char **)kwlist, &pattern, &latin1, &max_mem)) return -1;
    if (self->re) {
        PyBuffer_Release(&pattern);
        PyErr_SetString(PyExc_RuntimeError, "Pattern is initialised once");
        return -1;
    }
    /* what diagnosis.engine._re2_options sets on RE2's default options */
    re2::RE2::Options options;
    options.set_max_mem(max_mem);
    options.set_log_errors(false);
    if (latin1) options.set_encoding(re2::RE2::Options::EncodingLatin1);
    re2::RE2 *re = NULL;
    try {
        re = new re2::RE2(re2::StringPiece((const char *)pattern.buf, (size_t)pattern.len), options);
    } catch (const std::bad_alloc &) {
        re = NULL;
    }
    PyBuffer_Release(&pattern);
    if (!re) {
        PyErr_NoMemory();
        return -1;
    }
    if (!re->ok()) {
        PyErr_Format(PyExc_ValueError, "RE2 cannot compile the run pattern: %s", re->error().c_str());
        delete re;
        return -1;
    }
    self->re = re;
    return 0;
}

static PyTypeObject PatternType = {PyVarObject_HEAD_INIT(NULL, 0)};

/* Table(pattern: Pattern): one compressor's key table and its scan. */
typedef struct {
    PyObject_HEAD
    ff_table *t;
    PatternObject *pattern;
    int busy; /* a scan runs without the GIL: no second call meanwhile */
} TableObject;

static void Table_dealloc(TableObject *self) {
    ff_free(self->t);
    Py_XDECREF(self->pattern);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Table_init(TableObject *self, PyObject *args, PyObject *kwds) {
    static const char *kwlist[] = {"pattern", NULL};
    PyObject *pattern;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!", (char **)kwlist, &PatternType, &pattern)) return -1;
    if (self->t) {
        PyErr_SetString(PyExc_RuntimeError, "Table is initialised once");
        return -1;
    }
    if (!((PatternObject *)pattern)->re) {
        PyErr_SetString(PyExc_ValueError, "the Pattern was never compiled");
        return -1;
    }
    self->t = ff_new();
    if (!self->t) {
        PyErr_NoMemory();
        return -1;
    }
    Py_INCREF(pattern);
    self->pattern = (PatternObject *)pattern;
    return 0;
}

static int Table_ready(TableObject *self) {
    if (!self->t) {
        PyErr_SetString(PyExc_ValueError, "the Table was never initialised");
        return 0;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the Table is scanning in another thread");
        return 0;
    }
    return 1;
}

static PyObject *Table_reset(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!Table_ready(self)) return NULL;
    ff_reset(self->t);
    Py_RETURN_NONE;
}

static PyObject *Table_n_ids(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!Table_ready(self)) return NULL;
    return PyLong_FromLong(ff_n_ids(self->t));
}

static PyObject *Table_arena_bytes(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!Table_ready(self)) return NULL;
    return PyLong_FromLongLong(ff_arena_bytes(self->t));
}

static PyObject *Table_add_prints(TableObject *self, PyObject *arg) {
    Py_buffer joined;
    if (!Table_ready(self) || PyObject_GetBuffer(arg, &joined, PyBUF_SIMPLE) < 0) return NULL;
    int status = ff_add_prints(self->t, (const char *)joined.buf, (int64_t)joined.len);
    PyBuffer_Release(&joined);
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *Table_set_status(TableObject *self, PyObject *args) {
    Py_buffer ids;
    int status;
    if (!Table_ready(self) || !PyArg_ParseTuple(args, "y*i", &ids, &status)) return NULL;
    if (ids.len % (Py_ssize_t)sizeof(int32_t) || status < FF_KEEP || status > FF_BLANK) {
        PyBuffer_Release(&ids);
        PyErr_SetString(PyExc_ValueError, "set_status takes int32 ids (bytes) and a status 0, 1 or 2");
        return NULL;
    }
    ff_set_status(self->t, (const int32_t *)ids.buf, (int64_t)(ids.len / (Py_ssize_t)sizeof(int32_t)), (int8_t)status);
    PyBuffer_Release(&ids);
    Py_RETURN_NONE;
}

static PyObject *Table_scan(TableObject *self, PyObject *args) {
    Py_buffer buf, sig;
    long long max_line;
    int budget_spent;
    if (!Table_ready(self) || !PyArg_ParseTuple(args, "y*y*Lp", &buf, &sig, &max_line, &budget_spent)) return NULL;
    PyObject *result = NULL;
    int64_t n_sig = (int64_t)(sig.len / (Py_ssize_t)sizeof(int64_t));
    int8_t *sig_uncovered = (int8_t *)malloc((size_t)(n_sig ? n_sig : 1));
    int64_t *sig_line = (int64_t *)malloc((size_t)(n_sig ? n_sig : 1) * sizeof(int64_t));
    int64_t out[4] = {0, 0, 0, 0};
    int status = 0;
    if (sig.len % (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "scan takes the signal line starts as int64 (bytes)");
        goto done;
    }
    if (!sig_uncovered || !sig_line) {
        PyErr_NoMemory();
        goto done;
    }
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    try {
        status = ff_scan(self->t, *self->pattern->re, (const char *)buf.buf, (int64_t)buf.len, max_line,
                         budget_spent, (const int64_t *)sig.buf, n_sig, sig_uncovered, sig_line, out);
    } catch (const std::bad_alloc &) { /* inside RE2 */
        status = -1;
    }
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (status != 0) {
        PyErr_SetString(PyExc_MemoryError, "the native line scan ran out of memory");
        goto done;
    }
    {
        ff_table *t = self->t;
        int64_t n = out[0], m = out[1];
#define FF_BYTES(ptr, count, type) PyBytes_FromStringAndSize((const char *)(ptr), (Py_ssize_t)((count) * (int64_t)sizeof(type)))
        /* copies (a few MB per 16 MB chunk at most): nothing points into the table */
        result = Py_BuildValue(
            "(NNNNNNNNNNLLNN)",
            FF_BYTES(t->o_start, n, int64_t), FF_BYTES(t->o_end, n, int64_t), FF_BYTES(t->o_line, n, int64_t),
            FF_BYTES(t->o_id, n, int32_t), FF_BYTES(t->t_id, m, int32_t), FF_BYTES(t->t_count, m, int64_t),
            FF_BYTES(t->t_first, m, int64_t), FF_BYTES(t->t_last, m, int64_t),
            FF_BYTES(sig_uncovered, n_sig, int8_t), FF_BYTES(sig_line, n_sig, int64_t),
            (long long)out[2], (long long)out[3],
            PyBytes_FromStringAndSize(t->new_keys, (Py_ssize_t)t->new_keys_len),
            PyBytes_FromStringAndSize(t->new_bodies, (Py_ssize_t)t->new_bodies_len));
#undef FF_BYTES
    }
done:
    free(sig_uncovered);
    free(sig_line);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&sig);
    return result;
}

static PyMethodDef Table_methods[] = {
    {"reset", (PyCFunction)Table_reset, METH_NOARGS, "Forget every key (ids start again at 0); fingerprints stay."},
    {"n_ids", (PyCFunction)Table_n_ids, METH_NOARGS, "How many keys the table holds."},
    {"arena_bytes", (PyCFunction)Table_arena_bytes, METH_NOARGS, "The bytes of all the keys."},
    {"add_prints", (PyCFunction)Table_add_prints, METH_O,
     "add_prints(joined): add fingerprints, each followed by a newline."},
    {"set_status", (PyCFunction)Table_set_status, METH_VARARGS,
     "set_status(ids, status): keys (int32 ids) whose lines are from now on counted (1) or skipped (2)."},
    {"scan", (PyCFunction)Table_scan, METH_VARARGS,
     "scan(buf, signal_starts, max_line, budget_spent) -> (starts, ends, lines, ids, touched, touched_count,\n"
     "touched_first, touched_last, signal_uncovered, signal_lines, total_lines, overflow, new_keys, new_bodies):\n"
     "the arrays as bytes (int64; ids and touched int32, signal_uncovered int8); see ff_scan."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TableType = {PyVarObject_HEAD_INIT(NULL, 0)};

static struct PyModuleDef linescan_module = {
    PyModuleDef_HEAD_INIT, "_linescan",
    "The compressor's native line pass (diagnosis.native): RE2 run-scan, keying and counting in one C++ pass.",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__linescan(void) {
    PatternType.tp_name = "diagnosis.native._linescan.Pattern";
    PatternType.tp_basicsize = sizeof(PatternObject);
    PatternType.tp_flags = Py_TPFLAGS_DEFAULT;
    PatternType.tp_doc = "Pattern(pattern, latin1, max_mem): a run pattern compiled by RE2.";
    PatternType.tp_new = PyType_GenericNew;
    PatternType.tp_init = (initproc)Pattern_init;
    PatternType.tp_dealloc = (destructor)Pattern_dealloc;
    TableType.tp_name = "diagnosis.native._linescan.Table";
    TableType.tp_basicsize = sizeof(TableObject);
    TableType.tp_flags = Py_TPFLAGS_DEFAULT;
    TableType.tp_doc = "Table(pattern): the key table of one compressor and its line scan.";
    TableType.tp_new = PyType_GenericNew;
    TableType.tp_init = (initproc)Table_init;
    TableType.tp_dealloc = (destructor)Table_dealloc;
    TableType.tp_methods = Table_methods;
    ff_fill_print_table();
    if (PyType_Ready(&PatternType) < 0 || PyType_Ready(&TableType) < 0) return NULL;
    PyObject *module = PyModule_Create(&linescan_module);
    if (!module) return NULL;
    if (PyModule_AddObjectRef(module, "Pattern", (PyObject *)&PatternType) < 0 ||
        PyModule_AddObjectRef(module, "Table", (PyObject *)&TableType) < 0 ||
        PyModule_AddStringConstant(module, "SOURCE_SHA256", FF_SOURCE_SHA256) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
