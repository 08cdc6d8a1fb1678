/* Splits a block of replay lines (GPU samples and training steps, one JSON object per line)
 * into sample columns and step records, in one pass over the text.
 *
 * The replay's hot path in front of msgspec (`SampleDecoder.trace_lines` in fast.py): it reads
 * only the plain shape the simulator and the agent write (ASCII strings without escapes, flat
 * values) and returns None for anything else, which then takes the msgspec path. What it
 * accepts it decodes to the values msgspec would give, one rule per field as `TraceLine`
 * (tests/test_trace_text.py compares the two on real and mutated lines):
 *
 * - a line that has a top-level "metrics" key is a GPU sample: ts a finite number, node a
 *   non-empty string, gpu an integer 0..1023, model a non-empty string, rack/site/job a string
 *   or null, rank an integer >= 0 or null, metrics an object whose keys named in `fields` hold
 *   an int64 integer, a finite number or null (NaN) and whose other keys hold any flat value;
 *   a step's fields on a sample line, a key twice, a nested value anywhere: refused;
 * - any other line is a training step, checked by `TraceLine`'s rules for a step and those
 *   `_trace_steps_ok` adds (see `step_record`), and returned as a `TraceStep` record;
 * - strings: ASCII without escapes or control characters (else refused);
 * - every line starts with "{" and ends with "}" (one "\r" before the newline aside), as the
 *   msgspec path's check; a blank line is refused.
 *
 * Numbers: JSON's grammar is checked here; integers are read exactly (beyond int64: refused
 * where the value is read, skipped where it is not); other numbers are correctly rounded:
 * short decimals exactly (`short_decimal`), the rest by Python's own `PyOS_string_to_double`,
 * as `float(text)`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { T_STR = 1, T_INT, T_BIGINT, T_FLOAT, T_NULL, T_TRUE, T_FALSE, T_NESTED };

typedef struct {
    int type;
    const char *p; /* string contents (without quotes) or number text */
    Py_ssize_t n;
    int64_t i; /* T_INT */
} Tok;

#define MAX_FIELDS 64
#define FIELD_SLOTS 256 /* power of two, > 2 * MAX_FIELDS */
#define STRING_SLOTS 4096 /* per call; once half full, further strings go to the dict */

typedef struct {
    const char *name;
    Py_ssize_t n;
    int index; /* -1: empty slot */
} FieldSlot;

typedef struct {
    const char *p;
    Py_ssize_t n;
    uint64_t hash;
    PyObject *str; /* borrowed from the intern dict */
} StringSlot;

#define MAX_EXPECTED 128 /* metric keys remembered by their place in the object */

/* The metric key seen at a place in the last sample's metrics object: samples of one writer
 * list their metrics in one order, so one memcmp usually finds the key (bytes of this call's
 * text, already checked as a plain string). */
typedef struct {
    const char *name; /* NULL: none yet */
    Py_ssize_t n;
    int index; /* field index, or -1 for a key not read */
} ExpectedKey;

typedef struct {
    FieldSlot fields[FIELD_SLOTS];
    ExpectedKey expected[MAX_EXPECTED];
    int n_fields;
    StringSlot *strings;
    int n_strings;
    PyObject *intern; /* dict: str -> the shared str */
} Ctx;

static inline const char *skip_ws(const char *p, const char *end) {
    while (p < end && (unsigned char)*p <= ' ' && (*p == ' ' || *p == '\t' || *p == '\r')) p++;
    return p;
}

#if defined(__SSE2__)
#include <emmintrin.h>
/* Bits set for the bytes of 16 that end a plain string or rule it out: a quote, a backslash, a
 * control character or a byte >= 0x80 (signed, those are below 0x20 too). */
static inline unsigned special16(const char *p) {
    __m128i x = _mm_loadu_si128((const __m128i *)p);
    __m128i hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8('"')),
                                            _mm_cmpeq_epi8(x, _mm_set1_epi8('\\'))),
                               _mm_cmplt_epi8(x, _mm_set1_epi8(0x20)));
    return (unsigned)_mm_movemask_epi8(hit);
}
#endif

/* A string without escapes, of ASCII without control characters; NULL when it is anything else. */
static inline const char *parse_string(const char *p, const char *end, Tok *t) {
    const char *start = ++p; /* past the opening quote */
#if defined(__SSE2__)
    while (end - p >= 16) {
        unsigned hits = special16(p);
        if (hits) {
            p += __builtin_ctz(hits);
            break; /* the byte loop decides on it */
        }
        p += 16;
    }
#endif
    for (; p < end; p++) {
        unsigned char c = (unsigned char)*p;
        if (c == '"') {
            t->type = T_STR;
            t->p = start;
            t->n = p - start;
            return p + 1;
        }
        if (c < 0x20 || c >= 0x80 || c == '\\') return NULL;
    }
    return NULL;
}

/* A number as JSON's grammar has it: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? */
static inline const char *parse_number(const char *p, const char *end, Tok *t) {
    const char *start = p;
    int negative = 0;
    if (*p == '-') {
        negative = 1;
        p++;
    }
    if (p >= end || *p < '0' || *p > '9') return NULL;
    uint64_t v = 0;
    int big = 0;
    if (*p == '0') {
        p++;
    } else {
        const char *digits = p;
        while (p < end && *p >= '0' && *p <= '9') v = v * 10 + (unsigned)(*p++ - '0');
        big = p - digits > 19; /* 19 digits always fit in 64 bits; v wrapped beyond */
    }
    int is_int = 1;
    if (p < end && *p == '.') {
        is_int = 0;
        p++;
        if (p >= end || *p < '0' || *p > '9') return NULL;
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        is_int = 0;
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        if (p >= end || *p < '0' || *p > '9') return NULL;
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    if (p < end && *p >= '0' && *p <= '9') return NULL; /* "01" */
    t->p = start;
    t->n = p - start;
    if (!is_int) {
        t->type = T_FLOAT;
    } else if (big || v > (uint64_t)INT64_MAX + (uint64_t)negative) {
        t->type = T_BIGINT;
    } else {
        t->type = T_INT;
        t->i = negative ? (int64_t)(0 - v) : (int64_t)v;
    }
    return p;
}

static inline const char *parse_literal(const char *p, const char *end, const char *word, Py_ssize_t n,
                                        int type, Tok *t) {
    if (end - p < n || memcmp(p, word, (size_t)n) != 0) return NULL;
    t->type = type;
    t->p = p;
    t->n = n;
    return p + n;
}

/* A flat value; a nested one is reported as T_NESTED (not parsed: callers refuse it). */
static inline const char *parse_value(const char *p, const char *end, Tok *t) {
    if (p >= end) return NULL;
    switch (*p) {
    case '"': return parse_string(p, end, t);
    case 'n': return parse_literal(p, end, "null", 4, T_NULL, t);
    case 't': return parse_literal(p, end, "true", 4, T_TRUE, t);
    case 'f': return parse_literal(p, end, "false", 5, T_FALSE, t);
    case '{':
    case '[': t->type = T_NESTED, t->p = p, t->n = 0; return p;
    default: return parse_number(p, end, t);
    }
}

static inline int finite_number(const Tok *t, double *out);

/* A float field's value (JSON integers beyond 2**53, which msgspec may round otherwise, refused). */
static inline int float_field(const Tok *t, double *out) {
    if (t->type == T_INT && (t->i > (1ll << 53) || t->i < -(1ll << 53))) return 0;
    return finite_number(t, out);
}

static const double POW10[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                                  1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* A decimal of at most 15 significant digits and a power of ten within 1e+-22 (what DCGM and
 * step times are): its digits and the power are exact doubles, so one multiplication or
 * division gives the correctly rounded value (Clinger's fast path). 0: take the full path. */
static inline int short_decimal(const char *p, const char *end, double *out) {
    int negative = *p == '-', digits = 0, fraction = 0;
    uint64_t m = 0;
    p += negative;
    for (; p < end && *p >= '0' && *p <= '9'; p++) {
        if (m || *p != '0') {
            if (++digits > 15) return 0;
            m = m * 10 + (unsigned)(*p - '0');
        }
    }
    if (p < end && *p == '.') {
        for (p++; p < end && *p >= '0' && *p <= '9'; p++) {
            fraction++;
            if (m || *p != '0') {
                if (++digits > 15) return 0;
                m = m * 10 + (unsigned)(*p - '0');
            }
        }
    }
    int power = -fraction;
    if (p < end && (*p == 'e' || *p == 'E')) {
        int negative_power = 0, e = 0;
        p++;
        if (*p == '+' || *p == '-') negative_power = *p++ == '-';
        for (; p < end && *p >= '0' && *p <= '9'; p++) {
            if (e > 1000) return 0;
            e = e * 10 + (*p - '0');
        }
        power += negative_power ? -e : e;
    }
    if (power < -22 || power > 22) return 0;
    double v = power >= 0 ? (double)m * POW10[power] : (double)m / POW10[-power];
    *out = negative ? -v : v;
    return 1;
}

/* The double a number token holds, as msgspec gives it for a float or `int | float` field;
 * 0 when it is not a finite number. */
static inline int finite_number(const Tok *t, double *out) {
    if (t->type == T_INT) {
        *out = (double)t->i; /* round to nearest, as Python's int -> float */
        return 1;
    }
    if (t->type != T_FLOAT) return 0;
    if (short_decimal(t->p, t->p + t->n, out)) return 1;
    char *stop = NULL;
    double d = PyOS_string_to_double(t->p, &stop, NULL);
    if (d == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (stop != t->p + t->n || !isfinite(d)) return 0;
    *out = d;
    return 1;
}

static inline uint64_t key_hash(const char *p, Py_ssize_t n) {
    /* DCGM names share their prefix: hash the length and the last 8 bytes. */
    uint64_t tail = 0;
    if (n >= 8) memcpy(&tail, p + n - 8, 8);
    else memcpy(&tail, p, (size_t)n);
    return (tail ^ ((uint64_t)n << 56)) * 0x9E3779B97F4A7C15ull;
}

static inline int field_index(const Ctx *c, const char *p, Py_ssize_t n) {
    unsigned slot = (unsigned)(key_hash(p, n) >> 56) & (FIELD_SLOTS - 1);
    for (;;) {
        const FieldSlot *f = &c->fields[slot];
        if (f->index < 0) return -1;
        if (f->n == n && memcmp(f->name, p, (size_t)n) == 0) return f->index;
        slot = (slot + 1) & (FIELD_SLOTS - 1);
    }
}

/* The shared str for these bytes (new reference), through this call's table, then the dict. */
static PyObject *shared_string(Ctx *c, const char *p, Py_ssize_t n) {
    uint64_t h = 1469598103934665603ull;
    for (Py_ssize_t k = 0; k < n; k++) h = (h ^ (unsigned char)p[k]) * 1099511628211ull;
    unsigned slot = (unsigned)(h >> 40) & (STRING_SLOTS - 1);
    for (;;) {
        StringSlot *s = &c->strings[slot];
        if (s->str == NULL) break;
        if (s->hash == h && s->n == n && memcmp(s->p, p, (size_t)n) == 0) {
            Py_INCREF(s->str);
            return s->str;
        }
        slot = (slot + 1) & (STRING_SLOTS - 1);
    }
    PyObject *fresh = PyUnicode_DecodeASCII(p, n, NULL);
    if (fresh == NULL) return NULL;
    PyObject *shared = PyDict_SetDefault(c->intern, fresh, fresh); /* borrowed */
    Py_DECREF(fresh);
    if (shared == NULL) return NULL;
    if (c->n_strings < STRING_SLOTS / 2) {
        StringSlot *s = &c->strings[slot];
        s->p = p;
        s->n = n;
        s->hash = h;
        s->str = shared;
        c->n_strings++;
    }
    Py_INCREF(shared);
    return shared;
}

/* Top-level keys of a line, by what they are to a sample. */
enum {
    K_OTHER = -1, K_TS, K_NODE, K_GPU, K_MODEL, K_RACK, K_SITE, K_JOB, K_RANK, K_METRICS,
    K_STEP, K_STEP_TIME, K_COMPUTE, K_MICRO_BATCH, K_SAMPLES, N_KEYS
};
#define STEP_FIELDS ((1u << K_STEP) | (1u << K_STEP_TIME) | (1u << K_COMPUTE) | (1u << K_MICRO_BATCH) | (1u << K_SAMPLES))

static inline int top_key(const char *p, Py_ssize_t n) {
#define IS(word) (n == (Py_ssize_t)sizeof(word) - 1 && memcmp(p, word, sizeof(word) - 1) == 0)
    switch (n) {
    case 2: return IS("ts") ? K_TS : K_OTHER;
    case 3: return IS("gpu") ? K_GPU : IS("job") ? K_JOB : K_OTHER;
    case 4: return IS("node") ? K_NODE : IS("rack") ? K_RACK : IS("site") ? K_SITE : IS("rank") ? K_RANK
                   : IS("step") ? K_STEP : K_OTHER;
    case 5: return IS("model") ? K_MODEL : K_OTHER;
    case 7: return IS("metrics") ? K_METRICS : IS("samples") ? K_SAMPLES : K_OTHER;
    case 9: return IS("compute_s") ? K_COMPUTE : K_OTHER;
    case 11: return IS("step_time_s") ? K_STEP_TIME : IS("micro_batch") ? K_MICRO_BATCH : K_OTHER;
    default: return K_OTHER;
    }
#undef IS
}

/* The metrics object at p into row (NaN where missing); NULL when refused. */
static const char *parse_metrics(Ctx *c, const char *p, const char *end, double *row) {
    uint64_t seen = 0;
    for (int k = 0; k < c->n_fields; k++) row[k] = NAN;
    p = skip_ws(p + 1, end);
    if (p < end && *p == '}') return p + 1;
    for (int place = 0;; place++) {
        Tok key, value;
        int k;
        ExpectedKey *e = place < MAX_EXPECTED ? &c->expected[place] : NULL;
        if (p >= end || *p != '"') return NULL;
        if (e && e->name && end - p > e->n + 1 && p[e->n + 1] == '"' && memcmp(p + 1, e->name, (size_t)e->n) == 0) {
            k = e->index;
            p += e->n + 2;
        } else {
            if ((p = parse_string(p, end, &key)) == NULL) return NULL;
            k = field_index(c, key.p, key.n);
            if (e) *e = (ExpectedKey){key.p, key.n, k};
        }
        p = skip_ws(p, end);
        if (p >= end || *p != ':') return NULL;
        p = skip_ws(p + 1, end);
        if ((p = parse_value(p, end, &value)) == NULL || value.type == T_NESTED) return NULL;
        if (k >= 0) {
            if (seen & (1ull << k)) return NULL;
            seen |= 1ull << k;
            if (value.type == T_NULL) row[k] = NAN;
            else if (!finite_number(&value, &row[k])) return NULL;
        }
        p = skip_ws(p, end);
        if (p >= end) return NULL;
        if (*p == '}') return p + 1;
        if (*p != ',') return NULL;
        p = skip_ws(p + 1, end);
    }
}

typedef struct {
    PyObject *node, *gpu, *model, *rack, *site, *job, *rank; /* lists */
} Columns;

/* Field rules shared by samples and steps: an integer >= 0; absent, null or a string. */
static inline int count_field(const Tok *t) { return t->type == T_INT && t->i >= 0; }
static inline int string_or_null(const Tok *t, int present) {
    return !present || t->type == T_NULL || t->type == T_STR;
}

/* A field that `string_or_null` let through, as the record's value (new reference; NULL on a
 * Python error). */
static PyObject *optional_string(Ctx *c, const Tok *t, int present) {
    if (!present || t->type == T_NULL) Py_RETURN_NONE;
    return shared_string(c, t->p, t->n);
}

static int append_new(PyObject *list, PyObject *item) {
    if (item == NULL) return -1;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

/* One sample's columns from its top-level tokens; 0 when refused (-1 on a Python error). */
static int add_sample(Ctx *c, const Tok *keys, unsigned seen, double *ts, Columns *out) {
#define HAS(k) (seen & (1u << (k)))
    if ((seen & STEP_FIELDS) || !HAS(K_TS) || !HAS(K_NODE) || !HAS(K_GPU) || !HAS(K_MODEL)) return 0;
    if (!float_field(&keys[K_TS], ts)) return 0;
    if (keys[K_NODE].type != T_STR || keys[K_NODE].n == 0) return 0;
    if (keys[K_MODEL].type != T_STR || keys[K_MODEL].n == 0) return 0;
    if (keys[K_GPU].type != T_INT || keys[K_GPU].i < 0 || keys[K_GPU].i > 1023) return 0;
    if (HAS(K_RANK) && keys[K_RANK].type != T_NULL && !count_field(&keys[K_RANK])) return 0;
    for (int k = K_RACK; k <= K_JOB; k++)
        if (!string_or_null(&keys[k], HAS(k))) return 0;
    if (append_new(out->node, shared_string(c, keys[K_NODE].p, keys[K_NODE].n)) < 0) return -1;
    if (append_new(out->gpu, PyLong_FromLongLong(keys[K_GPU].i)) < 0) return -1;
    if (append_new(out->model, shared_string(c, keys[K_MODEL].p, keys[K_MODEL].n)) < 0) return -1;
    if (append_new(out->rack, optional_string(c, &keys[K_RACK], HAS(K_RACK))) < 0) return -1;
    if (append_new(out->site, optional_string(c, &keys[K_SITE], HAS(K_SITE))) < 0) return -1;
    if (append_new(out->job, optional_string(c, &keys[K_JOB], HAS(K_JOB))) < 0) return -1;
    PyObject *rank;
    if (HAS(K_RANK) && keys[K_RANK].type == T_INT) rank = PyLong_FromLongLong(keys[K_RANK].i);
    else rank = Py_NewRef(Py_None);
    if (append_new(out->rank, rank) < 0) return -1;
    return 1;
#undef HAS
}

static PyTypeObject *TraceStep;

static PyStructSequence_Field step_fields[] = {
    {"ts", NULL}, {"job", NULL}, {"rank", NULL}, {"node", NULL}, {"gpu", NULL}, {"step", NULL},
    {"step_time_s", NULL}, {"compute_s", NULL}, {"micro_batch", NULL}, {"samples", NULL}, {"model", NULL},
    {NULL, NULL},
};

static PyStructSequence_Desc step_desc = {
    "fleetwise.schemas._trace_text.TraceStep",
    "A training step record of a replay line, checked by `TrainingStep`'s rules (attribute names as\n"
    "`FastTrainingStep`).",
    step_fields, 11,
};

/* A step line's record from its top-level tokens (new reference); Py_None when refused, NULL on a
 * Python error. The rules of `TraceLine` for a step and of `_trace_steps_ok`: ts, job, rank,
 * node, gpu, step, step_time_s and compute_s present; job and node non-empty strings; rank,
 * gpu, step, micro_batch, samples integers >= 0 (the last two may be null); step time > 0,
 * compute >= 0, finite, compute at most 1.5x the step time; model, rack, site strings or null. */
static PyObject *step_record(Ctx *c, const Tok *keys, unsigned seen) {
#define HAS(k) (seen & (1u << (k)))
    const unsigned required = (1u << K_TS) | (1u << K_JOB) | (1u << K_RANK) | (1u << K_NODE) | (1u << K_GPU)
                              | (1u << K_STEP) | (1u << K_STEP_TIME) | (1u << K_COMPUTE);
    double ts, step_time, compute;
    if ((seen & required) != required) Py_RETURN_NONE;
    if (!float_field(&keys[K_TS], &ts) || !float_field(&keys[K_STEP_TIME], &step_time)
        || !float_field(&keys[K_COMPUTE], &compute) || !(step_time > 0) || !(compute >= 0)
        || !(compute <= step_time * 1.5))
        Py_RETURN_NONE;
    if (keys[K_JOB].type != T_STR || keys[K_JOB].n == 0 || keys[K_NODE].type != T_STR || keys[K_NODE].n == 0
        || !count_field(&keys[K_RANK]) || !count_field(&keys[K_GPU]) || !count_field(&keys[K_STEP]))
        Py_RETURN_NONE;
    for (int k = K_MICRO_BATCH; k <= K_SAMPLES; k++)
        if (HAS(k) && keys[k].type != T_NULL && !count_field(&keys[k])) Py_RETURN_NONE;
    const int strings[] = {K_MODEL, K_RACK, K_SITE};
    for (int i = 0; i < 3; i++)
        if (!string_or_null(&keys[strings[i]], HAS(strings[i]))) Py_RETURN_NONE;
    PyObject *rec = PyStructSequence_New(TraceStep);
    if (rec == NULL) return NULL;
    PyObject *items[11] = {
        PyFloat_FromDouble(ts),
        shared_string(c, keys[K_JOB].p, keys[K_JOB].n),
        PyLong_FromLongLong(keys[K_RANK].i),
        shared_string(c, keys[K_NODE].p, keys[K_NODE].n),
        PyLong_FromLongLong(keys[K_GPU].i),
        PyLong_FromLongLong(keys[K_STEP].i),
        PyFloat_FromDouble(step_time),
        PyFloat_FromDouble(compute),
        HAS(K_MICRO_BATCH) && keys[K_MICRO_BATCH].type == T_INT ? PyLong_FromLongLong(keys[K_MICRO_BATCH].i)
                                                                 : Py_NewRef(Py_None),
        HAS(K_SAMPLES) && keys[K_SAMPLES].type == T_INT ? PyLong_FromLongLong(keys[K_SAMPLES].i) : Py_NewRef(Py_None),
        optional_string(c, &keys[K_MODEL], HAS(K_MODEL)),
    };
    int failed = 0;
    for (int i = 0; i < 11; i++) {
        if (items[i] == NULL) failed = 1;
        PyStructSequence_SET_ITEM(rec, i, items[i]); /* (a NULL slot is fine to free) */
    }
    if (failed) {
        Py_DECREF(rec);
        return NULL;
    }
    return rec;
#undef HAS
}

/* One line [p, end): 1 a sample (its row written), 0 a step (appended to steps), -2 refused, -1
 * a Python error. */
static int parse_line(Ctx *c, const char *p, const char *end, double *ts, double *row, Columns *out,
                      PyObject *steps) {
    if (end > p && end[-1] == '\r') end--;
    if (end - p < 2 || *p != '{' || end[-1] != '}') return -2;
    Tok keys[N_KEYS];
    unsigned seen = 0;
    p = skip_ws(p + 1, end);
    if (*p != '}') {
        for (;;) {
            Tok key, value;
            if (*p != '"' || (p = parse_string(p, end, &key)) == NULL) return -2;
            p = skip_ws(p, end);
            if (p >= end || *p != ':') return -2;
            p = skip_ws(p + 1, end);
            int k = top_key(key.p, key.n);
            if (k != K_OTHER && (seen & (1u << k))) return -2;
            if (k == K_METRICS) {
                if (p >= end || *p != '{' || (p = parse_metrics(c, p, end, row)) == NULL) return -2;
            } else {
                if ((p = parse_value(p, end, &value)) == NULL || value.type == T_NESTED) return -2;
                if (k >= 0) keys[k] = value;
            }
            if (k >= 0) seen |= 1u << k;
            p = skip_ws(p, end);
            if (p >= end) return -2;
            if (*p == '}') break;
            if (*p != ',') return -2;
            p = skip_ws(p + 1, end);
        }
    }
    if (p != end - 1) return -2; /* the closing brace is the line's last */
    if (!(seen & (1u << K_METRICS))) {
        PyObject *step = step_record(c, keys, seen);
        if (step == NULL) return -1;
        if (step == Py_None) {
            Py_DECREF(step);
            return -2;
        }
        return append_new(steps, step) < 0 ? -1 : 0;
    }
    int added = add_sample(c, keys, seen, ts, out);
    return added == 1 ? 1 : added == 0 ? -2 : -1;
}

static PyObject *split(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer text;
    PyObject *fields, *intern;
    if (!PyArg_ParseTuple(args, "y*O!O!:split", &text, &PyTuple_Type, &fields, &PyDict_Type, &intern))
        return NULL;
    PyObject *result = NULL, *ts_bytes = NULL, *rows_bytes = NULL, *is_sample = NULL, *steps = NULL;
    Columns cols = {0};
    Ctx *c = PyMem_Calloc(1, sizeof(Ctx));
    if (c == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    c->intern = intern;
    c->strings = PyMem_Calloc(STRING_SLOTS, sizeof(StringSlot));
    if (c->strings == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t n_fields = PyTuple_GET_SIZE(fields);
    if (n_fields > MAX_FIELDS) {
        PyErr_Format(PyExc_ValueError, "at most %d metric fields, got %zd", MAX_FIELDS, n_fields);
        goto done;
    }
    c->n_fields = (int)n_fields;
    for (int s = 0; s < FIELD_SLOTS; s++) c->fields[s].index = -1;
    for (int k = 0; k < c->n_fields; k++) {
        Py_ssize_t n;
        const char *name = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(fields, k), &n);
        if (name == NULL) goto done;
        unsigned slot = (unsigned)(key_hash(name, n) >> 56) & (FIELD_SLOTS - 1);
        while (c->fields[slot].index >= 0) slot = (slot + 1) & (FIELD_SLOTS - 1);
        c->fields[slot] = (FieldSlot){name, n, k}; /* the tuple keeps name alive */
    }

    const char *start = text.buf, *stop = start + text.len;
    Py_ssize_t n_lines = 0;
    for (const char *q = start; q < stop; n_lines++) {
        const char *nl = memchr(q, '\n', (size_t)(stop - q));
        q = nl ? nl + 1 : stop;
    }
    ts_bytes = PyByteArray_FromStringAndSize(NULL, n_lines * (Py_ssize_t)sizeof(double));
    rows_bytes = PyByteArray_FromStringAndSize(NULL, n_lines * n_fields * (Py_ssize_t)sizeof(double));
    is_sample = PyList_New(n_lines);
    cols.node = PyList_New(0), cols.gpu = PyList_New(0), cols.model = PyList_New(0);
    cols.rack = PyList_New(0), cols.site = PyList_New(0), cols.job = PyList_New(0);
    cols.rank = PyList_New(0);
    steps = PyList_New(0);
    if (!ts_bytes || !rows_bytes || !is_sample || !cols.node || !cols.gpu || !cols.model || !cols.rack
        || !cols.site || !cols.job || !cols.rank || !steps) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    double *ts = (double *)PyByteArray_AS_STRING(ts_bytes);
    double *rows = (double *)PyByteArray_AS_STRING(rows_bytes);
    Py_ssize_t n_samples = 0, line = 0;
    for (const char *q = start; q < stop; line++) {
        const char *nl = memchr(q, '\n', (size_t)(stop - q));
        const char *line_end = nl ? nl : stop;
        int kind = parse_line(c, q, line_end, &ts[n_samples], &rows[n_samples * n_fields], &cols, steps);
        if (kind == -1) goto done;
        if (kind == -2) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        PyList_SET_ITEM(is_sample, line, Py_NewRef(kind == 1 ? Py_True : Py_False));
        n_samples += kind;
        q = nl ? nl + 1 : stop;
    }
    if (PyByteArray_Resize(ts_bytes, n_samples * (Py_ssize_t)sizeof(double)) < 0
        || PyByteArray_Resize(rows_bytes, n_samples * n_fields * (Py_ssize_t)sizeof(double)) < 0)
        goto done;
    result = Py_BuildValue("(OOOOOOOOOOO)", ts_bytes, rows_bytes, cols.node, cols.gpu, cols.model, cols.rack,
                           cols.site, cols.job, cols.rank, is_sample, steps);
done:
    if (c != NULL) PyMem_Free(c->strings);
    PyMem_Free(c);
    Py_XDECREF(ts_bytes);
    Py_XDECREF(rows_bytes);
    Py_XDECREF(steps);
    Py_XDECREF(cols.node), Py_XDECREF(cols.gpu), Py_XDECREF(cols.model), Py_XDECREF(cols.rack);
    Py_XDECREF(cols.site), Py_XDECREF(cols.job), Py_XDECREF(cols.rank);
    /* is_sample may hold NULL slots when refused early: a list frees those fine. */
    Py_XDECREF(is_sample);
    PyBuffer_Release(&text);
    return result;
}

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS,
     "split(text, fields, strings) -> (ts, metrics, node, gpu, model, rack, site, job, rank, is_sample, "
     "steps) | None\n\nA block of newline-delimited GPU sample and step lines: the samples as columns (ts and "
     "metrics as float64 bytes, the rest as lists, strings shared through `strings`), whether each line is a "
     "sample, and the steps as `TraceStep` records. None when any line is not the plain shape read here."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_trace_text", "Replay lines split into GPU sample columns and step lines (C).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__trace_text(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    TraceStep = PyStructSequence_NewType(&step_desc);
    if (TraceStep == NULL || PyModule_AddObjectRef(m, "TraceStep", (PyObject *)TraceStep) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
