/* Compiled hot loops of MemoryIndex (kvgrid/controller/index/memory.py): probing one query's keys,
 * inserting and removing one event's keys and placing rows on a rehash, over the same numpy
 * buffers the Python code uses. The row format is documented in _rowloops.py (the Python twins of
 * these loops, which must leave the same rows and give the same answers); in short:
 *
 *   table row: lo, hi (the key), x; state byte: EMPTY, FULL (x = up to 4 inline holder lanes),
 *              TOMB, SPILL (x = index of the row's side row: TIERS blocks of w mask words)
 *   lane:      16 bits = slot << 3 | tier bits (L1 1, GPU 2, L2 4); 0 = unused
 *
 * Invariants: the caller holds the index lock (and the GIL: nothing here releases it), passes the
 * table's current buffers and shape, and made room before an insert (a free row always exists, so
 * every probe chain ends). A FULL row's lanes are sorted by slot, used lanes first, no lane without
 * a tier bit; a row is FULL exactly when its holders fit there (at most LANES holders, every slot
 * < INLINE_SLOTS), else SPILL: the form is a function of the row's holders. Free side rows form a
 * list through their word 0 (NIL ends it). Keys are 16-byte little-endian (lo, hi) pairs.
 * Little-endian hosts only: the module refuses to import elsewhere and memory.py falls back to
 * its Python loops (tests/controller/test_memindex.py runs both).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ST_EMPTY 0
#define ST_FULL 1
#define ST_TOMB 2
#define ST_SPILL 3
#define IS_LIVE(s) ((s) & 1) /* FULL or SPILL */
#define ROW 3                /* words per table row: lo, hi, x */
#define LANES 4
#define INLINE_SLOTS 8192 /* 13 bits of slot per lane */
#define NIL UINT64_MAX
/* Mask blocks per side row: L1, GPU, L2 words (kvgrid.controller.index.base.NUM_TIERS; IndexTier order). */
#define TIERS 3

static inline uint64_t load_u64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint64_t lane_at(uint64_t x, int j) { return (x >> (16 * j)) & 0xFFFF; }

/* masks(...) -> one Python int from w native little-endian words */
static PyObject *mask_int(const uint64_t *words, Py_ssize_t w) {
    if (w == 1) return PyLong_FromUnsignedLongLong(words[0]);
    return _PyLong_FromByteArray((const unsigned char *)words, (size_t)(8 * w), 1, 0);
}

typedef struct {
    Py_buffer st, tab, side, keys;
    Py_ssize_t cap, nside, sw; /* table rows, side rows, words per side row */
} bufs_t;

static void release(bufs_t *b) {
    if (b->st.obj) PyBuffer_Release(&b->st);
    if (b->tab.obj) PyBuffer_Release(&b->tab);
    if (b->side.obj) PyBuffer_Release(&b->side);
    if (b->keys.obj) PyBuffer_Release(&b->keys);
}

/* The buffers match (shift, w); ``item`` is the byte width of one element of ``keys`` (16 for a
 * key, 8 * ROW for place's whole rows). */
static int check_shape(bufs_t *b, int shift, Py_ssize_t w, Py_ssize_t item) {
    Py_ssize_t cap = b->st.len;
    if (cap <= 0 || (cap & (cap - 1)) || b->tab.len != cap * ROW * 8 || shift < 1 || shift > 63 ||
        ((uint64_t)1 << (64 - shift)) != (uint64_t)cap) {
        PyErr_SetString(PyExc_ValueError, "_probe: buffers do not match the table shape");
        return -1;
    }
    b->cap = cap;
    if (b->side.obj) {
        if (w < 1 || (w & (w - 1)) || b->side.len % (8 * TIERS * w)) {
            PyErr_SetString(PyExc_ValueError, "_probe: mask words not a power of two, or side rows that do not match them");
            return -1;
        }
        b->sw = TIERS * w;
        b->nside = b->side.len / (8 * b->sw);
    }
    if (b->keys.len % item) {
        PyErr_Format(PyExc_ValueError, "_probe: %zd bytes of keys or rows are not whole items of %zd bytes",
                     b->keys.len, item);
        return -1;
    }
    return 0;
}

/* The row of key (lo, hi), or -1: one linear probe chain, ending at the key or an empty row. */
static inline int64_t find_row(const uint8_t *st, const uint64_t *tab, int shift, uint64_t mask, uint64_t lo,
                               uint64_t hi) {
    uint64_t i = (lo ^ (hi >> 1)) >> shift;
    for (;;) {
        uint8_t s = st[i];
        if (IS_LIVE(s)) {
            const uint64_t *r = tab + i * ROW;
            if (r[0] == lo && r[1] == hi) return (int64_t)i;
        } else if (s == ST_EMPTY) {
            return -1;
        }
        i = (i + 1) & mask;
    }
}

/* Request every key's home row before any is read: the cache misses overlap. */
static inline void prefetch_homes(const uint8_t *st, const uint64_t *tab, int shift, const unsigned char *k,
                                  Py_ssize_t n, int write) {
    for (Py_ssize_t q = 0; q < n; q++) {
        uint64_t i = (load_u64(k + 16 * q) ^ (load_u64(k + 16 * q + 8) >> 1)) >> shift;
        if (write) {
            __builtin_prefetch(st + i, 1);
            __builtin_prefetch(tab + i * ROW, 1);
        } else {
            __builtin_prefetch(st + i);
            __builtin_prefetch(tab + i * ROW);
        }
    }
}

/* Row i's masks as TIERS * w words into dst; -1 (ValueError) on a side index past the side rows. */
static inline int row_words(const bufs_t *b, uint8_t s, const uint64_t *r, Py_ssize_t w, uint64_t *dst) {
    const Py_ssize_t rw = TIERS * w;
    if (s == ST_SPILL) {
        if (r[2] >= (uint64_t)b->nside) {
            PyErr_SetString(PyExc_ValueError, "_probe: a side index past the side rows");
            return -1;
        }
        const uint64_t *sr = (const uint64_t *)b->side.buf + r[2] * rw;
        for (Py_ssize_t k = 0; k < rw; k++) dst[k] = sr[k];
        return 0;
    }
    uint64_t x = r[2];
    if (w == 1) { /* up to 64 slots: in registers; most rows have one lane (one pod, any tiers) */
        uint64_t a = 0, g = 0, d = 0;
        for (; x; x >>= 16) {
            uint64_t lane = x & 0xFFFF, bit = (uint64_t)1 << ((lane >> 3) & 63);
            a |= bit & (0 - (lane & 1)); /* branchless per tier */
            g |= bit & (0 - ((lane >> 1) & 1));
            d |= bit & (0 - ((lane >> 2) & 1));
        }
        dst[0] = a;
        dst[1] = g;
        dst[2] = d;
        return 0;
    }
    memset(dst, 0, 8 * (size_t)rw);
    for (; x; x >>= 16) {
        /* w is a power of two: the word index stays inside the row whatever the lane says */
        uint64_t lane = x & 0xFFFF, slot = lane >> 3, bit = (uint64_t)1 << (slot & 63);
        Py_ssize_t word = (Py_ssize_t)(slot >> 6) & (w - 1);
        if (lane & 1) dst[word] |= bit;
        if (lane & 2) dst[w + word] |= bit;
        if (lane & 4) dst[2 * w + word] |= bit;
    }
    return 0;
}

/* Set tier bit ``tb`` of ``slot`` in the lanes *x: 1 set, 0 already set, -1 it does not fit (spill). */
static inline int lanes_set(uint64_t *x, uint64_t slot, uint64_t tb) {
    uint64_t v = *x;
    int j = 0;
    for (; j < LANES; j++) {
        uint64_t lane = lane_at(v, j);
        if (!lane || (lane >> 3) > slot) break;
        if ((lane >> 3) == slot) {
            if (lane & tb) return 0;
            *x = v | (tb << (16 * j));
            return 1;
        }
    }
    if (lane_at(v, LANES - 1) || slot >= INLINE_SLOTS) return -1;
    /* insert at j, the lanes from j move up one */
    uint64_t low = j ? v & (((uint64_t)1 << (16 * j)) - 1) : 0;
    uint64_t high = j < LANES - 1 ? (v >> (16 * j)) << (16 * (j + 1)) : 0; /* the top lane was free */
    *x = low | ((slot << 3 | tb) << (16 * j)) | high;
    return 1;
}

/* Clear tier bit ``tb`` of ``slot`` in the lanes *x (a lane left without tiers goes, the lanes
 * above it move down): 1 cleared, 0 it was not set. */
static inline int lanes_clear(uint64_t *x, uint64_t slot, uint64_t tb) {
    uint64_t v = *x;
    for (int j = 0; j < LANES; j++) {
        uint64_t lane = lane_at(v, j);
        if (!lane || (lane >> 3) > slot) return 0;
        if ((lane >> 3) != slot) continue;
        if (!(lane & tb)) return 0;
        if (lane & 7 & ~tb) {
            *x = v & ~(tb << (16 * j));
        } else {
            uint64_t low = j ? v & (((uint64_t)1 << (16 * j)) - 1) : 0;
            uint64_t high = j < LANES - 1 ? (v >> (16 * (j + 1))) << (16 * j) : 0;
            *x = low | high;
        }
        return 1;
    }
    return 0;
}

/* The lanes of side row ``sr`` (TIERS blocks of w words) when its holders fit inline, else -1. */
static inline int demote(const uint64_t *sr, Py_ssize_t w, uint64_t *x) {
    uint64_t out = 0;
    int n = 0;
    for (Py_ssize_t k = 0; k < w; k++) {
        uint64_t u = sr[k] | sr[w + k] | sr[2 * w + k];
        if (!u) continue;
        if (k >= INLINE_SLOTS / 64 || n + __builtin_popcountll(u) > LANES) return -1;
        while (u) {
            int b = __builtin_ctzll(u);
            uint64_t tiers = 0;
            for (int t = 0; t < TIERS; t++) tiers |= ((sr[t * w + k] >> b) & 1) << t;
            out |= ((uint64_t)(64 * k + b) << 3 | tiers) << (16 * n++);
            u &= u - 1;
        }
    }
    *x = out;
    return 0;
}

/* Parse the (state, tab, shift, side, w, keys, stop) arguments of probe / probe_words. */
static int probe_args(PyObject *args, bufs_t *b, int *shift, Py_ssize_t *w, int *stop) {
    if (!PyArg_ParseTuple(args, "y*y*iy*ny*p", &b->st, &b->tab, shift, &b->side, w, &b->keys, stop)) return -1;
    return check_shape(b, *shift, *w, 16);
}

/* probe(state, tab, shift, side, w, keys, stop) -> (l1 list, gpu list, l2 list)
 * Per key the L1, GPU and L2 holder masks (Python ints); with stop, the lists end before the first
 * key that is absent (a prefix cannot continue past it). */
static PyObject *probe(PyObject *Py_UNUSED(self), PyObject *args) {
    bufs_t b = {0};
    Py_ssize_t w;
    int shift, stop;
    PyObject *lists[TIERS] = {NULL}, *out = NULL;
    uint64_t *buf = NULL;
    if (probe_args(args, &b, &shift, &w, &stop) < 0) goto done;
    const uint8_t *st = b.st.buf;
    const uint64_t *tab = b.tab.buf;
    const unsigned char *k = b.keys.buf;
    const uint64_t mask = (uint64_t)b.cap - 1;
    const Py_ssize_t n = b.keys.len / 16;
    if (!(buf = PyMem_Malloc(8 * TIERS * w))) {
        PyErr_NoMemory();
        goto done;
    }
    for (int t = 0; t < TIERS; t++)
        if (!(lists[t] = PyList_New(0))) goto done;
    prefetch_homes(st, tab, shift, k, n, 0);
    for (Py_ssize_t q = 0; q < n; q++) {
        int64_t i = find_row(st, tab, shift, mask, load_u64(k + 16 * q), load_u64(k + 16 * q + 8));
        if (i < 0 && stop) break;
        if (i < 0) memset(buf, 0, 8 * TIERS * w);
        else if (row_words(&b, st[i], tab + i * ROW, w, buf) < 0) goto done;
        for (int t = 0; t < TIERS; t++) {
            PyObject *m = mask_int(buf + t * w, w);
            if (!m || PyList_Append(lists[t], m) < 0) {
                Py_XDECREF(m);
                goto done;
            }
            Py_DECREF(m);
        }
    }
    out = PyTuple_Pack(TIERS, lists[0], lists[1], lists[2]);
done:
    for (int t = 0; t < TIERS; t++) Py_XDECREF(lists[t]);
    PyMem_Free(buf);
    release(&b);
    return out;
}

/* probe_words(state, tab, shift, side, w, keys, stop) -> bytes
 * As probe, but the masks as raw rows: per key TIERS * w native uint64 words (L1 words, then GPU
 * words, then L2 words), zeros where absent; with stop, the rows end before the first absent key. */
static PyObject *probe_words(PyObject *Py_UNUSED(self), PyObject *args) {
    bufs_t b = {0};
    Py_ssize_t w;
    int shift, stop;
    PyObject *out = NULL;
    if (probe_args(args, &b, &shift, &w, &stop) < 0) goto done;
    const uint8_t *st = b.st.buf;
    const uint64_t *tab = b.tab.buf;
    const unsigned char *k = b.keys.buf;
    const uint64_t mask = (uint64_t)b.cap - 1;
    const Py_ssize_t n = b.keys.len / 16, rw = TIERS * w;
    prefetch_homes(st, tab, shift, k, n, 0);
    out = PyBytes_FromStringAndSize(NULL, n * 8 * rw);
    if (!out) goto done;
    uint64_t *dst = (uint64_t *)PyBytes_AS_STRING(out);
    Py_ssize_t rows = 0;
    for (Py_ssize_t q = 0; q < n; q++) {
        int64_t i = find_row(st, tab, shift, mask, load_u64(k + 16 * q), load_u64(k + 16 * q + 8));
        if (i < 0 && stop) break;
        if (i < 0) memset(dst + rows * rw, 0, 8 * (size_t)rw);
        else if (row_words(&b, st[i], tab + i * ROW, w, dst + rows * rw) < 0) {
            Py_CLEAR(out);
            goto done;
        }
        rows++;
    }
    if (rows < n) _PyBytes_Resize(&out, rows * 8 * rw);
done:
    release(&b);
    return out;
}

/* Parse the (state, tab, shift, side, w, head, slot, tier, keys) arguments of insert / remove. */
static int write_args(PyObject *args, bufs_t *b, int *shift, Py_ssize_t *w, uint64_t *head, Py_ssize_t *slot,
                      int *tier) {
    unsigned long long h;
    if (!PyArg_ParseTuple(args, "w*w*iw*nKniy*", &b->st, &b->tab, shift, &b->side, w, &h, slot, tier, &b->keys))
        return -1;
    *head = h;
    if (check_shape(b, *shift, *w, 16) < 0) return -1;
    if (*slot < 0 || *slot >= 64 * *w || *tier < 0 || *tier >= TIERS) {
        PyErr_SetString(PyExc_ValueError, "_probe: slot or tier outside the mask words");
        return -1;
    }
    if (*head != NIL && *head >= (uint64_t)b->nside) {
        PyErr_SetString(PyExc_ValueError, "_probe: free side row past the side rows");
        return -1;
    }
    return 0;
}

/* insert(state, tab, shift, side, w, head, slot, tier, keys)
 *   -> (keys done, new rows, rows taken from empty, bits set, free head, rows spilled)
 * Sets (slot, tier) on every key's row, inserting absent keys (the first tombstone on a chain is
 * reused). A row whose holders outgrow its lanes moves them to the free side row ``head``; with no
 * free side row left it stops before that key (keys done < keys: the caller adds side rows and
 * calls again with the rest). */
static PyObject *insert(PyObject *Py_UNUSED(self), PyObject *args) {
    bufs_t b = {0};
    Py_ssize_t w, slot;
    int shift, tier;
    uint64_t head;
    PyObject *out = NULL;
    if (write_args(args, &b, &shift, &w, &head, &slot, &tier) < 0) goto done;
    uint8_t *st = b.st.buf;
    uint64_t *tab = b.tab.buf, *side = b.side.buf;
    const unsigned char *k = b.keys.buf;
    const uint64_t mask = (uint64_t)b.cap - 1, tb = (uint64_t)1 << tier, bit = (uint64_t)1 << (slot & 63);
    const Py_ssize_t n = b.keys.len / 16, sw = b.sw, col = tier * w + (slot >> 6);
    Py_ssize_t q = 0, added = 0, fresh = 0, used = 0, spilled = 0;
    prefetch_homes(st, tab, shift, k, n, 1);
    for (; q < n; q++) {
        uint64_t lo = load_u64(k + 16 * q), hi = load_u64(k + 16 * q + 8);
        uint64_t i = (lo ^ (hi >> 1)) >> shift;
        int64_t tomb = -1;
        uint8_t s;
        for (;;) {
            s = st[i];
            if (IS_LIVE(s)) {
                if (tab[i * ROW] == lo && tab[i * ROW + 1] == hi) break;
            } else if (s == ST_EMPTY) {
                break;
            } else if (tomb < 0) {
                tomb = (int64_t)i;
            }
            i = (i + 1) & mask;
        }
        if (s == ST_SPILL) {
            uint64_t *wd = side + tab[i * ROW + 2] * sw + col;
            if (!(*wd & bit)) {
                *wd |= bit;
                added++;
            }
            continue;
        }
        uint64_t x = s == ST_FULL ? tab[i * ROW + 2] : 0;
        int rc = lanes_set(&x, (uint64_t)slot, tb);
        if (rc < 0 && head == NIL) break; /* no free side row: the caller adds some */
        if (s != ST_FULL) {
            if (tomb >= 0)
                i = (uint64_t)tomb;
            else
                used++;
            tab[i * ROW] = lo;
            tab[i * ROW + 1] = hi;
            st[i] = ST_FULL;
            fresh++;
        }
        uint64_t *r = tab + i * ROW;
        if (rc < 0) { /* spill: the lanes and the new bit into a fresh side row */
            uint64_t j = head;
            if (j >= (uint64_t)b.nside) {
                PyErr_SetString(PyExc_ValueError, "_probe: free side row past the side rows");
                goto done;
            }
            uint64_t *sr = side + j * sw;
            head = sr[0];
            memset(sr, 0, 8 * (size_t)sw);
            for (uint64_t v = s == ST_FULL ? r[2] : 0; v; v >>= 16) {
                uint64_t lane = v & 0xFFFF, ls = lane >> 3;
                for (int t = 0; t < TIERS; t++)
                    if ((lane >> t) & 1) sr[t * w + (ls >> 6)] |= (uint64_t)1 << (ls & 63);
            }
            sr[col] |= bit;
            r[2] = j;
            st[i] = ST_SPILL;
            spilled++;
            rc = 1;
        } else {
            r[2] = x;
        }
        added += rc;
    }
    out = Py_BuildValue("nnnnKn", q, fresh, used, added, (unsigned long long)head, spilled);
done:
    release(&b);
    return out;
}

/* remove(state, tab, shift, side, w, head, slot, tier, keys)
 *   -> (bits cleared, rows emptied, free head, side rows freed)
 * Clears (slot, tier) on every key's row; a row left without holders becomes a tombstone, and a
 * side row whose holders fit the lanes again goes back to them (its side row to the free list). */
static PyObject *remove_keys(PyObject *Py_UNUSED(self), PyObject *args) {
    bufs_t b = {0};
    Py_ssize_t w, slot;
    int shift, tier;
    uint64_t head;
    PyObject *out = NULL;
    if (write_args(args, &b, &shift, &w, &head, &slot, &tier) < 0) goto done;
    uint8_t *st = b.st.buf;
    uint64_t *tab = b.tab.buf, *side = b.side.buf;
    const unsigned char *k = b.keys.buf;
    const uint64_t mask = (uint64_t)b.cap - 1, tb = (uint64_t)1 << tier, bit = (uint64_t)1 << (slot & 63);
    const Py_ssize_t n = b.keys.len / 16, sw = b.sw, col = tier * w + (slot >> 6);
    Py_ssize_t removed = 0, killed = 0, freed = 0;
    prefetch_homes(st, tab, shift, k, n, 1);
    for (Py_ssize_t q = 0; q < n; q++) {
        int64_t i = find_row(st, tab, shift, mask, load_u64(k + 16 * q), load_u64(k + 16 * q + 8));
        if (i < 0) continue;
        uint64_t *r = tab + i * ROW;
        if (st[i] == ST_FULL) {
            if (!lanes_clear(&r[2], (uint64_t)slot, tb)) continue;
        } else {
            if (r[2] >= (uint64_t)b.nside) {
                PyErr_SetString(PyExc_ValueError, "_probe: a side index past the side rows");
                goto done;
            }
            uint64_t *sr = side + r[2] * sw, x;
            if (!(sr[col] & bit)) continue;
            sr[col] &= ~bit;
            if (demote(sr, w, &x) == 0) { /* fits the lanes again: free the side row */
                sr[0] = head;
                head = r[2];
                r[2] = x;
                st[i] = ST_FULL;
                freed++;
            }
        }
        removed++;
        if (st[i] == ST_FULL && !r[2]) {
            st[i] = ST_TOMB; /* the key stays in the row; the state says it is gone */
            killed++;
        }
    }
    out = Py_BuildValue("nnKn", removed, killed, (unsigned long long)head, freed);
done:
    release(&b);
    return out;
}

typedef struct {
    int64_t slot, matched, gpu, l1, l2, gen; /* gen: position in slot order */
} entry_t;

#define SAME_KEY(a, b) ((a).matched == (b).matched && (a).gpu == (b).gpu && (a).l1 == (b).l1 && (a).l2 == (b).l2)

static int by_rank(const void *a, const void *b) {
    const entry_t *x = a, *y = b;
    if (x->matched != y->matched) return x->matched > y->matched ? -1 : 1;
    if (x->gpu != y->gpu) return x->gpu > y->gpu ? -1 : 1;
    if (x->l1 != y->l1) return x->l1 > y->l1 ? -1 : 1;
    if (x->l2 != y->l2) return x->l2 > y->l2 ? -1 : 1;
    return x->slot < y->slot ? -1 : (x->slot > y->slot);
}

#define HAS(words, s) (((words)[(s) >> 6] >> ((s) & 63)) & 1)

/* match_words(words, w, eligible, max_pods) -> bytes of int64
 * One query's match from probe_words' rows (see kvgrid.controller.matching.match_one for the
 * rules): per listed pod, longest first, then more GPU, more own L1, more own L2, lower slot. The
 * result is [pods ascending (k), pod_index (k), gpu (k), l1 (k), l2 (k), peer (k), 0, k,
 * peer_fetchable]. Rows are grouped into runs of identical masks first, so the work is runs x pods. */
static PyObject *match_words(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer wb = {0}, eb = {0};
    Py_ssize_t w, max_pods;
    PyObject *out = NULL;
    entry_t *ent = NULL;
    Py_ssize_t *run_start = NULL;
    int64_t *pods = NULL;
    entry_t *rk = NULL;
    if (!PyArg_ParseTuple(args, "y*ny*n", &wb, &w, &eb, &max_pods)) return NULL;
    if (w < 1 || wb.len % (8 * TIERS * w) || eb.len != 8 * w) {
        PyErr_SetString(PyExc_ValueError, "_probe.match_words: buffers do not match the word count");
        goto done;
    }
    const uint64_t *rows = wb.buf, *elig = eb.buf;
    const Py_ssize_t n = wb.len / (8 * TIERS * w), ns = 64 * w, rw = TIERS * w;
    Py_ssize_t pf = n, nruns = 0;
    run_start = PyMem_Malloc((n + 1) * sizeof(Py_ssize_t));
    ent = PyMem_Malloc((ns ? ns : 1) * sizeof(entry_t));
    pods = PyMem_Malloc((ns ? ns : 1) * sizeof(int64_t));
    rk = PyMem_Malloc((ns ? ns : 1) * sizeof(entry_t));
    if (!run_start || !ent || !pods || !rk) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint64_t *r = rows + i * rw;
        if (pf == n) {
            uint64_t l1any = 0;
            for (Py_ssize_t x = 0; x < w; x++) l1any |= r[x];
            if (!l1any) pf = i;
        }
        if (i == 0 || memcmp(r, r - rw, 8 * rw)) run_start[nruns++] = i;
    }
    run_start[nruns] = n;
    Py_ssize_t k = 0;
    for (Py_ssize_t s = 0; s < ns; s++) {
        if (!HAS(elig, s)) continue;
        int64_t matched = 0, gc = 0, lc = 0, dc = 0;
        for (Py_ssize_t r = 0; r < nruns; r++) {
            const uint64_t *row = rows + run_start[r] * rw;
            int64_t len = run_start[r + 1] - run_start[r];
            if (HAS(row + w, s)) {
                gc += len;
            } else if (HAS(row, s)) {
                lc += len;
            } else if (HAS(row + 2 * w, s)) {
                dc += len;
            } else {
                uint64_t l1any = 0;
                for (Py_ssize_t x = 0; x < w; x++) l1any |= row[x];
                if (!l1any) break; /* nobody can fetch it: the prefix ends */
            }
            matched += len;
        }
        if (gc || lc || dc) {
            ent[k] = (entry_t){s, matched, gc, lc, dc, k};
            k++;
        }
    }
    /* Rank order. Entries were made in slot order; the distinct (matched, gpu, l1, l2) keys are few
     * (a conversation's pods share a handful of histories), so the keys are sorted and each key's
     * entries copied out in slot order; past 32 distinct keys qsort gives the same order. */
    entry_t keys[32];
    Py_ssize_t nk = 0, r = 0;
    for (Py_ssize_t j = 0; j < k && nk <= 32; j++) {
        Py_ssize_t x = 0;
        while (x < nk && !SAME_KEY(keys[x], ent[j])) x++;
        if (x == nk) {
            if (nk == 32) nk = 33; /* too many: qsort */
            else keys[nk++] = ent[j];
        }
    }
    if (nk <= 32) {
        qsort(keys, nk, sizeof(entry_t), by_rank);
        for (Py_ssize_t x = 0; x < nk; x++)
            for (Py_ssize_t j = 0; j < k; j++)
                if (SAME_KEY(keys[x], ent[j])) rk[r++] = ent[j];
    } else {
        memcpy(rk, ent, k * sizeof(entry_t));
        qsort(rk, k, sizeof(entry_t), by_rank);
    }
    Py_ssize_t kept = (max_pods > 0 && k > max_pods) ? max_pods : k;
    out = PyBytes_FromStringAndSize(NULL, (6 * kept + 3) * 8);
    if (!out) goto done;
    int64_t *o = (int64_t *)PyBytes_AS_STRING(out);
    /* pods: the kept slots ascending (= their order in ent); pod_index: position among them */
    for (Py_ssize_t j = 0; j < k; j++) pods[j] = -1;
    for (Py_ssize_t j = 0; j < kept; j++) pods[rk[j].gen] = 0;
    Py_ssize_t np_ = 0;
    for (Py_ssize_t j = 0; j < k; j++)
        if (pods[j] == 0) {
            o[np_] = ent[j].slot;
            pods[j] = np_++;
        }
    for (Py_ssize_t j = 0; j < kept; j++) {
        o[kept + j] = pods[rk[j].gen];
        o[2 * kept + j] = rk[j].gpu;
        o[3 * kept + j] = rk[j].l1;
        o[4 * kept + j] = rk[j].l2;
        o[5 * kept + j] = rk[j].matched - rk[j].gpu - rk[j].l1 - rk[j].l2;
    }
    k = kept;
    o[6 * k] = 0;
    o[6 * k + 1] = k;
    o[6 * k + 2] = pf;
done:
    PyMem_Free(run_start);
    PyMem_Free(ent);
    PyMem_Free(pods);
    PyMem_Free(rk);
    PyBuffer_Release(&wb);
    PyBuffer_Release(&eb);
    return out;
}

/* place(state, tab, shift, rows, states) -> None
 * Insert whole rows (``rows``: [m, ROW] uint64, keys distinct and absent; ``states``: m bytes, each
 * FULL or SPILL) into a table without tombstones (a rehash): each at the first empty row of its chain. */
static PyObject *place(PyObject *Py_UNUSED(self), PyObject *args) {
    bufs_t b = {0};
    Py_buffer rs = {0};
    int shift;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "w*w*iy*y*", &b.st, &b.tab, &shift, &b.keys, &rs)) return NULL;
    if (check_shape(&b, shift, 1, 8 * ROW) < 0) goto done;
    uint8_t *st = b.st.buf;
    uint64_t *tab = b.tab.buf;
    const uint64_t *rows = b.keys.buf, mask = (uint64_t)b.cap - 1;
    const uint8_t *states = rs.buf;
    const Py_ssize_t m = b.keys.len / (8 * ROW);
    if (rs.len != m) {
        PyErr_SetString(PyExc_ValueError, "_probe.place: one state per row expected");
        goto done;
    }
    for (Py_ssize_t r = 0; r < m; r++) {
        if (!IS_LIVE(states[r])) {
            PyErr_SetString(PyExc_ValueError, "_probe.place: a row that is not live");
            goto done;
        }
    }
    for (Py_ssize_t r = 0; r < m; r++) {
        const uint64_t *row = rows + r * ROW;
        uint64_t i = (row[0] ^ (row[1] >> 1)) >> shift;
        while (st[i] != ST_EMPTY) i = (i + 1) & mask;
        st[i] = states[r];
        memcpy(tab + i * ROW, row, 8 * ROW);
    }
    out = Py_None;
    Py_INCREF(out);
done:
    if (rs.obj) PyBuffer_Release(&rs);
    release(&b);
    return out;
}

static PyMethodDef methods[] = {
    {"probe", probe, METH_VARARGS, "Holder masks of one query's keys (see the module comment)."},
    {"insert", insert, METH_VARARGS, "Set one (slot, tier) on one event's keys, inserting absent ones."},
    {"remove", remove_keys, METH_VARARGS, "Clear one (slot, tier) on one event's keys."},
    {"place", place, METH_VARARGS, "Insert whole rows into a table without tombstones (rehash)."},
    {"probe_words", probe_words, METH_VARARGS, "One query's mask rows as bytes (see above)."},
    {"match_words", match_words, METH_VARARGS, "One query's match from its mask rows (see above)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_probe", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__probe(void) {
#if !PY_LITTLE_ENDIAN
    PyErr_SetString(PyExc_ImportError, "_probe: little-endian hosts only");
    return NULL;
#else
    return PyModule_Create(&module);
#endif
}
