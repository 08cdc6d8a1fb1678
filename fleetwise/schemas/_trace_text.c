/* Splits a block of replay lines (GPU samples and training steps, one JSON object per line)
 * into sample columns and step records, in one pass over the text.
 *
 * The replay's hot path in front of msgspec (`SampleDecoder.trace_lines` in fast.py). It reads
 * the line shapes writers use, not only the simulator's (issue 16 item 5), and returns None for
 * anything else, which then takes the msgspec path (and the pydantic records, which name the
 * problem). What it accepts it decodes to the values msgspec would give, one rule per field as
 * `TraceLine`, or, where only the records read a line (RFC 3339 times, numeric strings), to the
 * values the records give (tests/test_trace_text.py compares them on real, generated and mutated
 * lines). Taken in C:
 *
 * - keys in any order (top level and in metrics; the metric keys of the line before are tried
 *   first at each place, so a writer's own order costs one memcmp a key), JSON whitespace
 *   around any token, one "\r" before the newline;
 * - optional fields in or out: rack/site/job/uuid a string or null, rank an integer >= 0 or
 *   null, any other key not read holding any value, nested objects and arrays included (their
 *   grammar checked, up to MAX_DEPTH deep, then skipped); a sample's uuid is returned as its
 *   board id (`board_id` in fast.py: the CRC-32 of its UTF-8 value, NaN when null, empty or absent);
 * - strings of ASCII with JSON's escapes (\" \\ \/ \b \f \n \r \t \uXXXX, surrogate pairs),
 *   keys included; read strings are decoded (UTF-8 from the escapes); a lone surrogate, an
 *   unknown escape, a control character, a raw byte >= 0x80 or an escaped key (or RFC 3339
 *   time, or uuid) over MAX_ESCAPED bytes: refused;
 * - ts a finite number or an RFC 3339 string, YYYY-MM-DD(T|t| )HH:MM:SS[.digits](Z|z|+-HH:MM),
 *   read as `_parse_ts` reads it (`rfc3339`); other spellings Python parses: refused;
 * - a line that has a top-level "metrics" key is a GPU sample: node a non-empty string, gpu an
 *   integer 0..1023, model a non-empty string, metrics an object whose keys named in `fields`
 *   hold an int64 integer, a finite number, null (NaN) or a string of a JSON number (read as
 *   the records read it, `numeric_string`), and whose other keys hold any flat value; a step's
 *   fields on a sample line, a read key twice, a nested value in metrics or where a field is
 *   read: refused;
 * - any other line is a training step, checked by `TraceLine`'s rules for a step and those
 *   `_trace_steps_ok` adds (see `step_record`), and returned as a `TraceStep` record;
 * - every line starts with "{" and ends with "}", as the msgspec path's check; a blank line is
 *   refused. A node batch (a "samples" list) is refused: the line path reads it.
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
    int esc; /* T_STR: has escapes (its text is JSON's, `unescape` gives the value) */
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

/* Rare shapes (escapes, nested extras, RFC 3339 times, numeric strings) out of line, so the
 * plain path stays inlined in one function, as before they were read here. */
#if defined(__GNUC__)
#define RARE __attribute__((cold, noinline))
#else
#define RARE
#endif

#define MAX_DEPTH 32 /* nesting of an unread value; deeper: refused */
#define MAX_ESCAPED 1024 /* bytes of a key or a read string with escapes; longer: refused */
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

static inline int hex_digit(char ch) {
    return ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : -1;
}

/* The code unit of the 4 hex digits at p; -1 when they are not. */
static inline int hex4(const char *p) {
    int a = hex_digit(p[0]), b = hex_digit(p[1]), c = hex_digit(p[2]), d = hex_digit(p[3]);
    return (a | b | c | d) < 0 ? -1 : a << 12 | b << 8 | c << 4 | d;
}

/* The length of the escape at p (a backslash) when it is one JSON has and decodes to a Unicode
 * scalar value: \" \\ \/ \b \f \n \r \t, \uXXXX other than a surrogate, or a high and a low
 * surrogate's \uXXXX\uXXXX; 0 for anything else (a lone surrogate included: refused). */
RARE static int escape_length(const char *p, const char *end) {
    if (end - p < 2) return 0;
    switch (p[1]) {
    case '"': case '\\': case '/': case 'b': case 'f': case 'n': case 'r': case 't': return 2;
    case 'u': break;
    default: return 0;
    }
    int unit = end - p >= 6 ? hex4(p + 2) : -1;
    if (unit < 0 || (unit >= 0xDC00 && unit <= 0xDFFF)) return 0;
    if (unit < 0xD800 || unit > 0xDBFF) return 6;
    int low = end - p >= 12 && p[6] == '\\' && p[7] == 'u' ? hex4(p + 8) : -1;
    return low >= 0xDC00 && low <= 0xDFFF ? 12 : 0;
}

/* A string of ASCII without control characters, with or without escapes (`escape_length`); NULL
 * when it is anything else (raw bytes >= 0x80 included). */
static inline const char *parse_string(const char *p, const char *end, Tok *t) {
    const char *start = ++p; /* past the opening quote */
    int esc = 0;
scan:
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
            t->esc = esc;
            t->p = start;
            t->n = p - start;
            return p + 1;
        }
        if (c == '\\') {
            int n = escape_length(p, end);
            if (n == 0) return NULL;
            p += n;
            esc = 1;
            goto scan;
        }
        if (c < 0x20 || c >= 0x80) return NULL;
    }
    return NULL;
}

/* The value of a string token with escapes (checked by `parse_string`), as UTF-8, into buf (at
 * least t->n bytes: no escape is shorter than what it stands for); returns its length. */
RARE static Py_ssize_t unescape(const Tok *t, char *buf) {
    const char *p = t->p, *end = t->p + t->n;
    char *o = buf;
    while (p < end) {
        if (*p != '\\') {
            *o++ = *p++;
            continue;
        }
        char e = p[1];
        p += 2;
        switch (e) {
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'n': *o++ = '\n'; break;
        case 'r': *o++ = '\r'; break;
        case 't': *o++ = '\t'; break;
        case 'u': {
            unsigned cp = (unsigned)hex4(p);
            p += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + ((unsigned)hex4(p + 2) - 0xDC00);
                p += 6;
            }
            if (cp < 0x80) {
                *o++ = (char)cp;
            } else if (cp < 0x800) {
                *o++ = (char)(0xC0 | cp >> 6);
                *o++ = (char)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                *o++ = (char)(0xE0 | cp >> 12);
                *o++ = (char)(0x80 | (cp >> 6 & 0x3F));
                *o++ = (char)(0x80 | (cp & 0x3F));
            } else {
                *o++ = (char)(0xF0 | cp >> 18);
                *o++ = (char)(0x80 | (cp >> 12 & 0x3F));
                *o++ = (char)(0x80 | (cp >> 6 & 0x3F));
                *o++ = (char)(0x80 | (cp & 0x3F));
            }
            break;
        }
        default: *o++ = e; /* " \ / */
        }
    }
    return o - buf;
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

/* A flat value; a nested one is reported as T_NESTED at its bracket (not parsed: callers refuse
 * it or `skip_nested` it). */
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

/* The nested value (object or array) at p, its grammar checked, skipped; NULL when refused
 * (malformed, a string `parse_string` refuses, deeper than MAX_DEPTH). */
RARE static const char *skip_nested(const char *p, const char *end, int depth) {
    if (depth > MAX_DEPTH) return NULL;
    const int object = *p == '{';
    const char close = object ? '}' : ']';
    p = skip_ws(p + 1, end);
    if (p < end && *p == close) return p + 1;
    for (;;) {
        Tok t;
        if (object) {
            if (p >= end || *p != '"' || (p = parse_string(p, end, &t)) == NULL) return NULL;
            p = skip_ws(p, end);
            if (p >= end || *p != ':') return NULL;
            p = skip_ws(p + 1, end);
        }
        if ((p = parse_value(p, end, &t)) == NULL) return NULL;
        if (t.type == T_NESTED && (p = skip_nested(p, end, depth + 1)) == NULL) return NULL;
        p = skip_ws(p, end);
        if (p >= end) return NULL;
        if (*p == close) return p + 1;
        if (*p != ',') return NULL;
        p = skip_ws(p + 1, end);
    }
}

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

/* A metric given as a string of a JSON number ("61", as exporters that write every value as text
 * do): the double pydantic's lax float gives for it, the text read as a float ("-0" is -0.0); 0
 * for any other string (escapes, spaces, "NaN", "1_0", ...: the pydantic path decides). */
RARE static int numeric_string(const Tok *t, double *out) {
    Tok number;
    if (t->esc || t->n == 0 || parse_number(t->p, t->p + t->n, &number) != t->p + t->n) return 0;
    number.type = T_FLOAT; /* "7" too: read as float(text) is, not as an int */
    return finite_number(&number, out);
}

static inline int is_digits(const char *p, int n) {
    for (int k = 0; k < n; k++)
        if (p[k] < '0' || p[k] > '9') return 0;
    return 1;
}

static inline int digits_value(const char *p, int n) {
    int v = 0;
    for (int k = 0; k < n; k++) v = v * 10 + (p[k] - '0');
    return v;
}

/* Days from 1970-01-01 to a proleptic Gregorian date (H. Hinnant's days_from_civil). */
static inline int64_t days_from_civil(int64_t y, int m, int d) {
    y -= m <= 2;
    const int64_t era = (y >= 0 ? y : y - 399) / 400;
    const int64_t yoe = y - era * 400;
    const int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    const int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

/* An RFC 3339 date-time, YYYY-MM-DD(T|t| )HH:MM:SS[.digits](Z|z|+HH:MM|-HH:MM), as the Unix
 * seconds `_parse_ts` gives (`datetime.fromisoformat(...).timestamp()`: microseconds, further
 * digits cut off, over 10**6, correctly rounded). 0 for anything else, an invalid date, a leap
 * second or a time beyond 2**53 microseconds from the epoch (the pydantic path decides those). */
RARE static int rfc3339(const char *p, Py_ssize_t n, double *out) {
    static const int month_days[12] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (n < 20 || !is_digits(p, 4) || p[4] != '-' || !is_digits(p + 5, 2) || p[7] != '-' || !is_digits(p + 8, 2)
        || (p[10] != 'T' && p[10] != 't' && p[10] != ' ') || !is_digits(p + 11, 2) || p[13] != ':'
        || !is_digits(p + 14, 2) || p[16] != ':' || !is_digits(p + 17, 2))
        return 0;
    int year = digits_value(p, 4), month = digits_value(p + 5, 2), day = digits_value(p + 8, 2);
    int hour = digits_value(p + 11, 2), minute = digits_value(p + 14, 2), second = digits_value(p + 17, 2);
    int leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    if (year < 1 || month < 1 || month > 12 || day < 1 || day > month_days[month - 1] + (month == 2 && leap)
        || hour > 23 || minute > 59 || second > 59)
        return 0;
    Py_ssize_t i = 19;
    int64_t micro = 0;
    if (p[i] == '.') {
        int digits = 0;
        for (i++; i < n && p[i] >= '0' && p[i] <= '9'; i++, digits++)
            if (digits < 6) micro = micro * 10 + (p[i] - '0');
        if (digits == 0) return 0;
        for (; digits < 6; digits++) micro *= 10;
    }
    int64_t offset = 0;
    if (i < n && (p[i] == 'Z' || p[i] == 'z')) {
        i++;
    } else if (n - i == 6 && (p[i] == '+' || p[i] == '-') && is_digits(p + i + 1, 2) && p[i + 3] == ':'
               && is_digits(p + i + 4, 2)) {
        int hours = digits_value(p + i + 1, 2), minutes = digits_value(p + i + 4, 2);
        if (hours > 23 || minutes > 59) return 0;
        offset = (p[i] == '-' ? -1 : 1) * (hours * 3600 + minutes * 60);
        i += 6;
    } else {
        return 0;
    }
    if (i != n) return 0;
    int64_t seconds = days_from_civil(year, month, day) * 86400 + hour * 3600 + minute * 60 + second - offset;
    int64_t total = seconds * 1000000 + micro;
    if (total > (1ll << 53) || total < -(1ll << 53)) return 0;
    *out = (double)total / 1e6; /* both exact: one correctly rounded division, as Python's int / int */
    return 1;
}

/* A `ts` string: an RFC 3339 time (`rfc3339`), escaped or not, as Unix seconds. */
RARE static int ts_string(const Tok *t, double *out) {
    if (!t->esc) return rfc3339(t->p, t->n, out);
    char buf[MAX_ESCAPED];
    return t->n <= MAX_ESCAPED && rfc3339(buf, unescape(t, buf), out);
}

/* A `ts` value: a number (`float_field`) or an RFC 3339 string, as Unix seconds. */
static inline int ts_field(const Tok *t, double *out) {
    return t->type != T_STR ? float_field(t, out) : ts_string(t, out);
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

/* The shared str of a string token (new reference), through this call's table (by the token's
 * bytes: the same escaped text, the same value), then the dict. */
static PyObject *shared_string(Ctx *c, const Tok *t) {
    const char *p = t->p;
    Py_ssize_t n = t->n;
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
    PyObject *fresh;
    if (t->esc) {
        char stack[256], *buf = n <= (Py_ssize_t)sizeof(stack) ? stack : PyMem_Malloc((size_t)n);
        if (buf == NULL) return PyErr_NoMemory();
        fresh = PyUnicode_DecodeUTF8(buf, unescape(t, buf), NULL);
        if (buf != stack) PyMem_Free(buf);
    } else {
        fresh = PyUnicode_DecodeASCII(p, n, NULL);
    }
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
    K_REFUSED = -2, K_OTHER = -1, K_TS, K_NODE, K_GPU, K_MODEL, K_RACK, K_SITE, K_JOB, K_RANK, K_UUID, K_METRICS,
    K_STEP, K_STEP_TIME, K_COMPUTE, K_MICRO_BATCH, K_SAMPLES, N_KEYS
};
#define STEP_FIELDS ((1u << K_STEP) | (1u << K_STEP_TIME) | (1u << K_COMPUTE) | (1u << K_MICRO_BATCH) | (1u << K_SAMPLES))

static inline int top_key(const char *p, Py_ssize_t n) {
#define IS(word) (n == (Py_ssize_t)sizeof(word) - 1 && memcmp(p, word, sizeof(word) - 1) == 0)
    switch (n) {
    case 2: return IS("ts") ? K_TS : K_OTHER;
    case 3: return IS("gpu") ? K_GPU : IS("job") ? K_JOB : K_OTHER;
    case 4: return IS("node") ? K_NODE : IS("rack") ? K_RACK : IS("site") ? K_SITE : IS("rank") ? K_RANK
                   : IS("step") ? K_STEP : IS("uuid") ? K_UUID : K_OTHER;
    case 5: return IS("model") ? K_MODEL : K_OTHER;
    case 7: return IS("metrics") ? K_METRICS : IS("samples") ? K_SAMPLES : K_OTHER;
    case 9: return IS("compute_s") ? K_COMPUTE : K_OTHER;
    case 11: return IS("step_time_s") ? K_STEP_TIME : IS("micro_batch") ? K_MICRO_BATCH : K_OTHER;
    default: return K_OTHER;
    }
#undef IS
}

/* `top_key` and `field_index` of a key with escapes, by its value; K_REFUSED when it is longer
 * than MAX_ESCAPED bytes. */
RARE static int escaped_top_key(const Tok *key) {
    char buf[MAX_ESCAPED];
    return key->n > MAX_ESCAPED ? K_REFUSED : top_key(buf, unescape(key, buf));
}

RARE static int escaped_field_index(const Ctx *c, const Tok *key) {
    char buf[MAX_ESCAPED];
    return key->n > MAX_ESCAPED ? K_REFUSED : field_index(c, buf, unescape(key, buf));
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
            if (key.esc) { /* looked up by its value, not remembered */
                if ((k = escaped_field_index(c, &key)) == K_REFUSED) return NULL;
            } else {
                k = field_index(c, key.p, key.n);
                if (e) *e = (ExpectedKey){key.p, key.n, k};
            }
        }
        p = skip_ws(p, end);
        if (p >= end || *p != ':') return NULL;
        p = skip_ws(p + 1, end);
        if ((p = parse_value(p, end, &value)) == NULL || value.type == T_NESTED) return NULL;
        if (k >= 0) {
            if (seen & (1ull << k)) return NULL;
            seen |= 1ull << k;
            if (value.type == T_NULL) row[k] = NAN;
            else if (!finite_number(&value, &row[k]) && (value.type != T_STR || !numeric_string(&value, &row[k])))
                return NULL;
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

/* CRC-32 (zlib's: reflected polynomial 0xEDB88320), as `zlib.crc32`. */
static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

static uint32_t crc32_of(const char *p, Py_ssize_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (Py_ssize_t k = 0; k < n; k++) c = crc_table[(c ^ (unsigned char)p[k]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* A sample's board id from its uuid token (`board_id` in fast.py); 0 when refused (an escaped
 * uuid over MAX_ESCAPED bytes). */
static int board_field(const Tok *t, int present, double *out) {
    if (!present || t->type == T_NULL || t->n == 0) {
        *out = NAN;
        return 1;
    }
    if (!t->esc) {
        *out = (double)crc32_of(t->p, t->n);
        return 1;
    }
    char buf[MAX_ESCAPED];
    if (t->n > MAX_ESCAPED) return 0;
    Py_ssize_t n = unescape(t, buf);
    *out = n == 0 ? NAN : (double)crc32_of(buf, n);
    return 1;
}

/* Field rules shared by samples and steps: an integer >= 0; absent, null or a string. */
static inline int count_field(const Tok *t) { return t->type == T_INT && t->i >= 0; }
static inline int string_or_null(const Tok *t, int present) {
    return !present || t->type == T_NULL || t->type == T_STR;
}

/* A field that `string_or_null` let through, as the record's value (new reference; NULL on a
 * Python error). */
static PyObject *optional_string(Ctx *c, const Tok *t, int present) {
    if (!present || t->type == T_NULL) Py_RETURN_NONE;
    return shared_string(c, t);
}

static int append_new(PyObject *list, PyObject *item) {
    if (item == NULL) return -1;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

/* One sample's columns from its top-level tokens; 0 when refused (-1 on a Python error). */
static int add_sample(Ctx *c, const Tok *keys, unsigned seen, double *ts, double *board, Columns *out) {
#define HAS(k) (seen & (1u << (k)))
    if ((seen & STEP_FIELDS) || !HAS(K_TS) || !HAS(K_NODE) || !HAS(K_GPU) || !HAS(K_MODEL)) return 0;
    if (!ts_field(&keys[K_TS], ts)) return 0;
    if (keys[K_NODE].type != T_STR || keys[K_NODE].n == 0) return 0;
    if (keys[K_MODEL].type != T_STR || keys[K_MODEL].n == 0) return 0;
    if (keys[K_GPU].type != T_INT || keys[K_GPU].i < 0 || keys[K_GPU].i > 1023) return 0;
    if (HAS(K_RANK) && keys[K_RANK].type != T_NULL && !count_field(&keys[K_RANK])) return 0;
    for (int k = K_RACK; k <= K_JOB; k++)
        if (!string_or_null(&keys[k], HAS(k))) return 0;
    if (!board_field(&keys[K_UUID], HAS(K_UUID), board)) return 0;
    if (append_new(out->node, shared_string(c, &keys[K_NODE])) < 0) return -1;
    if (append_new(out->gpu, PyLong_FromLongLong(keys[K_GPU].i)) < 0) return -1;
    if (append_new(out->model, shared_string(c, &keys[K_MODEL])) < 0) return -1;
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
    if (!ts_field(&keys[K_TS], &ts) || !float_field(&keys[K_STEP_TIME], &step_time)
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
        shared_string(c, &keys[K_JOB]),
        PyLong_FromLongLong(keys[K_RANK].i),
        shared_string(c, &keys[K_NODE]),
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
static int parse_line(Ctx *c, const char *p, const char *end, double *ts, double *board, double *row,
                      Columns *out, PyObject *steps) {
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
            int k = key.esc ? escaped_top_key(&key) : top_key(key.p, key.n);
            if (k == K_REFUSED) return -2;
            if (k != K_OTHER && (seen & (1u << k))) return -2;
            if (k == K_METRICS) {
                if (p >= end || *p != '{' || (p = parse_metrics(c, p, end, row)) == NULL) return -2;
            } else {
                if ((p = parse_value(p, end, &value)) == NULL) return -2;
                if (value.type != T_NESTED) {
                    if (k >= 0) keys[k] = value;
                } else if (k != K_OTHER || (p = skip_nested(p, end, 1)) == NULL) {
                    return -2; /* a nested value where a field is read: the msgspec path names it */
                }
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
    if (!string_or_null(&keys[K_UUID], seen & (1u << K_UUID))) return -2; /* as `TraceLine.uuid` */
    if (!(seen & (1u << K_METRICS))) {
        PyObject *step = step_record(c, keys, seen);
        if (step == NULL) return -1;
        if (step == Py_None) {
            Py_DECREF(step);
            return -2;
        }
        return append_new(steps, step) < 0 ? -1 : 0;
    }
    int added = add_sample(c, keys, seen, ts, board, out);
    return added == 1 ? 1 : added == 0 ? -2 : -1;
}

static PyObject *split(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer text;
    PyObject *fields, *intern;
    if (!PyArg_ParseTuple(args, "y*O!O!:split", &text, &PyTuple_Type, &fields, &PyDict_Type, &intern))
        return NULL;
    PyObject *result = NULL, *ts_bytes = NULL, *board_bytes = NULL, *rows_bytes = NULL, *is_sample = NULL;
    PyObject *steps = NULL;
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
    board_bytes = PyByteArray_FromStringAndSize(NULL, n_lines * (Py_ssize_t)sizeof(double));
    rows_bytes = PyByteArray_FromStringAndSize(NULL, n_lines * n_fields * (Py_ssize_t)sizeof(double));
    is_sample = PyList_New(n_lines);
    cols.node = PyList_New(0), cols.gpu = PyList_New(0), cols.model = PyList_New(0);
    cols.rack = PyList_New(0), cols.site = PyList_New(0), cols.job = PyList_New(0);
    cols.rank = PyList_New(0);
    steps = PyList_New(0);
    if (!ts_bytes || !board_bytes || !rows_bytes || !is_sample || !cols.node || !cols.gpu || !cols.model || !cols.rack
        || !cols.site || !cols.job || !cols.rank || !steps) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    double *ts = (double *)PyByteArray_AS_STRING(ts_bytes);
    double *board = (double *)PyByteArray_AS_STRING(board_bytes);
    double *rows = (double *)PyByteArray_AS_STRING(rows_bytes);
    Py_ssize_t n_samples = 0, line = 0;
    for (const char *q = start; q < stop; line++) {
        const char *nl = memchr(q, '\n', (size_t)(stop - q));
        const char *line_end = nl ? nl : stop;
        int kind = parse_line(c, q, line_end, &ts[n_samples], &board[n_samples], &rows[n_samples * n_fields],
                              &cols, steps);
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
        || PyByteArray_Resize(board_bytes, n_samples * (Py_ssize_t)sizeof(double)) < 0
        || PyByteArray_Resize(rows_bytes, n_samples * n_fields * (Py_ssize_t)sizeof(double)) < 0)
        goto done;
    result = Py_BuildValue("(OOOOOOOOOOOO)", ts_bytes, board_bytes, rows_bytes, cols.node, cols.gpu, cols.model, cols.rack,
                           cols.site, cols.job, cols.rank, is_sample, steps);
done:
    if (c != NULL) PyMem_Free(c->strings);
    PyMem_Free(c);
    Py_XDECREF(ts_bytes);
    Py_XDECREF(board_bytes);
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
     "split(text, fields, strings) -> (ts, board, metrics, node, gpu, model, rack, site, job, rank, is_sample, "
     "steps) | None\n\nA block of newline-delimited GPU sample and step lines: the samples as columns (ts, "
     "board id and metrics as float64 bytes, the rest as lists, strings shared through `strings`), whether each line is a "
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
    crc_init();
    TraceStep = PyStructSequence_NewType(&step_desc);
    if (TraceStep == NULL || PyModule_AddObjectRef(m, "TraceStep", (PyObject *)TraceStep) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
