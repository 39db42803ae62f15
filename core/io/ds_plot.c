/* Training curves with cairo (see ds_plot.h). */
#include "ds_plot.h"
#include "ds_error.h"
#include "ds_file.h"

#include <cairo.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MARGIN_L = 80, MARGIN_R = 24, MARGIN_T = 34, MARGIN_B = 44 };

/* A "nice" tick step (1, 2 or 5 times a power of ten) for about 5 ticks. */
static double tick_step(double span) {
    double raw = span / 5, p = pow(10, floor(log10(raw))), m = raw / p;
    return p * (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10);
}

static void range(const double *v, size_t n, double *lo, double *hi) {
    *lo = INFINITY;
    *hi = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(v[i])) continue;         /* an overflowed step's loss is not drawn */
        if (v[i] < *lo) *lo = v[i];
        if (v[i] > *hi) *hi = v[i];
    }
    if (!isfinite(*lo)) { *lo = 0; *hi = 1; }
    if (*hi - *lo < 1e-12 * fmax(1, fabs(*hi))) {      /* a flat line gets a band around it */
        double d = fmax(fabs(*hi) * 0.1, 1e-12);
        *lo -= d;
        *hi += d;
    }
}

static void text(cairo_t *cr, double x, double y, const char *s, double ax, double ay) {
    cairo_text_extents_t e;
    cairo_text_extents(cr, s, &e);
    cairo_move_to(cr, x - ax * e.width - e.x_bearing, y - ay * e.height - e.y_bearing);
    cairo_show_text(cr, s);
}

static void panel(cairo_t *cr, const ds_plot_series *s, const char *xlabel, double top, double w, double h) {
    double x0 = MARGIN_L, y0 = top + MARGIN_T, pw = w - MARGIN_L - MARGIN_R, ph = h - MARGIN_T - MARGIN_B;
    double xlo, xhi, ylo, yhi;
    range(s->x, s->n, &xlo, &xhi);
    range(s->y, s->n, &ylo, &yhi);
    double pad = (yhi - ylo) * 0.05;
    ylo -= pad;
    yhi += pad;
#define PX(v) (x0 + ((v) - xlo) / (xhi - xlo) * pw)
#define PY(v) (y0 + ph - ((v) - ylo) / (yhi - ylo) * ph)
    cairo_set_font_size(cr, 14);
    cairo_set_source_rgb(cr, 0, 0, 0);
    text(cr, x0 + pw / 2, top + MARGIN_T / 2, s->name, 0.5, 0.5);
    cairo_set_font_size(cr, 11);
    /* grid and tick labels */
    char label[32];
    double step = tick_step(yhi - ylo);
    for (double v = ceil(ylo / step) * step; v <= yhi; v += step) {
        cairo_set_source_rgb(cr, 0.88, 0.88, 0.88);
        cairo_move_to(cr, x0, PY(v));
        cairo_line_to(cr, x0 + pw, PY(v));
        cairo_stroke(cr);
        cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
        snprintf(label, sizeof label, "%.4g", fabs(v) < step * 1e-6 ? 0.0 : v);
        text(cr, x0 - 6, PY(v), label, 1, 0.5);
    }
    step = tick_step(xhi - xlo);
    for (double v = ceil(xlo / step) * step; v <= xhi; v += step) {
        cairo_set_source_rgb(cr, 0.88, 0.88, 0.88);
        cairo_move_to(cr, PX(v), y0);
        cairo_line_to(cr, PX(v), y0 + ph);
        cairo_stroke(cr);
        cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
        snprintf(label, sizeof label, "%.6g", v);
        text(cr, PX(v), y0 + ph + 6, label, 0.5, 0);
    }
    text(cr, x0 + pw / 2, top + h - 6, xlabel, 0.5, 1);
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_rectangle(cr, x0, y0, pw, ph);
    cairo_stroke(cr);
    /* the curve, broken where a value is not finite */
    cairo_save(cr);
    cairo_rectangle(cr, x0, y0, pw, ph);
    cairo_clip(cr);
    cairo_set_source_rgb(cr, 0.12, 0.4, 0.75);
    cairo_set_line_width(cr, 1.8);
    int drawing = 0;
    for (size_t i = 0; i < s->n; i++) {
        if (!isfinite(s->y[i])) { drawing = 0; continue; }
        if (drawing) cairo_line_to(cr, PX(s->x[i]), PY(s->y[i]));
        else cairo_move_to(cr, PX(s->x[i]), PY(s->y[i]));
        drawing = 1;
    }
    if (s->n == 1) cairo_arc(cr, PX(s->x[0]), PY(s->y[0]), 2.5, 0, 2 * M_PI);
    cairo_stroke(cr);
    cairo_restore(cr);
#undef PX
#undef PY
}

/* The PNG's bytes, gathered in memory: the file is then written by the
 * guarded atomic write, which replaces a link at path instead of writing
 * through it. */
typedef struct {
    unsigned char *buf;
    size_t n, cap;
} png_bytes;

static cairo_status_t gather(void *closure, const unsigned char *data, unsigned int n) {
    png_bytes *b = closure;
    if (b->n + n > b->cap) {
        size_t cap = (b->n + n) * 2;
        unsigned char *more = realloc(b->buf, cap);
        if (!more) return CAIRO_STATUS_NO_MEMORY;
        b->buf = more, b->cap = cap;
    }
    memcpy(b->buf + b->n, data, n);
    b->n += n;
    return CAIRO_STATUS_SUCCESS;
}

int ds_plot_png(const char *path, const char *xlabel, const ds_plot_series *panels, int npanels, int width,
                int height) {
    if (npanels < 1 || width < 200 || height < 100 * npanels) {
        ds_fail(DS_ERR_ARG, "plot: %d panels in %dx%d pixels: too small", npanels, width, height);
        return -1;
    }
    cairo_surface_t *surface = cairo_image_surface_create(CAIRO_FORMAT_RGB24, width, height);
    cairo_t *cr = cairo_create(surface);
    cairo_set_source_rgb(cr, 1, 1, 1);
    cairo_paint(cr);
    cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_line_width(cr, 1);
    double h = (double)height / npanels;
    for (int i = 0; i < npanels; i++) panel(cr, &panels[i], xlabel, i * h, width, h);
    cairo_status_t st = cairo_status(cr);
    png_bytes png = { 0 };
    if (st == CAIRO_STATUS_SUCCESS) st = cairo_surface_write_to_png_stream(surface, gather, &png);
    cairo_destroy(cr);
    cairo_surface_destroy(surface);
    char why[1024] = "";
    if (st != CAIRO_STATUS_SUCCESS) snprintf(why, sizeof why, "%s", cairo_status_to_string(st));
    else if (ds_file_write_atomic(path, png.buf, png.n)) snprintf(why, sizeof why, "%s", ds_error_message());
    free(png.buf);
    if (!why[0]) return 0;
    return ds_fail(DS_ERR_IO, "plot: cannot write %s: %s", path, why), -1;
}
