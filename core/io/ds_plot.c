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

/* The range of k series' values together (y, else x), finite ones only. */
static void ranges(const ds_plot_series *s, int k, int want_y, double *lo, double *hi) {
    *lo = INFINITY;
    *hi = -INFINITY;
    for (int i = 0; i < k; i++) {
        const double *v = want_y ? s[i].y : s[i].x;
        for (size_t j = 0; j < s[i].n; j++) {
            if (!isfinite(v[j])) continue;     /* an overflowed step's loss is not drawn */
            if (v[j] < *lo) *lo = v[j];
            if (v[j] > *hi) *hi = v[j];
        }
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

/* One colour per curve of a panel, cycling. */
static const double COLOURS[][3] = {{0.12, 0.4, 0.75}, {0.85, 0.37, 0.0}, {0.17, 0.6, 0.17},
                                    {0.8, 0.1, 0.15},  {0.55, 0.3, 0.7},  {0.45, 0.45, 0.45}};
enum { NCOLOURS = sizeof COLOURS / sizeof COLOURS[0] };

static void colour(cairo_t *cr, int i) {
    const double *c = COLOURS[i % NCOLOURS];
    cairo_set_source_rgb(cr, c[0], c[1], c[2]);
}

/* The labels of a panel's k curves, top right inside its plot area. */
static void legend(cairo_t *cr, const ds_plot_series *s, int k, double right, double top) {
    for (int i = 0; i < k; i++) {
        double y = top + 12 + 15 * i;
        const char *label = s[i].label ? s[i].label : "";
        cairo_text_extents_t e;
        cairo_text_extents(cr, label, &e);
        double x = right - 10 - e.x_advance;
        colour(cr, i);
        cairo_move_to(cr, x - 24, y);
        cairo_line_to(cr, x - 6, y);
        cairo_stroke(cr);
        cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
        text(cr, x, y, label, 0, 0.5);
    }
}

/* A value's pixel in the plot area x0, y0, pw x ph showing [xlo, xhi] x
 * [ylo, yhi] (the names in scope where they are used). */
#define PX(v) (x0 + ((v) - xlo) / (xhi - xlo) * pw)
#define PY(v) (y0 + ph - ((v) - ylo) / (yhi - ylo) * ph)

/* Draws a curve, broken where a value is not finite. */
static void curve(cairo_t *cr, const ds_plot_series *s, double x0, double y0, double pw, double ph, double xlo,
                  double xhi, double ylo, double yhi) {
    int drawing = 0;
    for (size_t i = 0; i < s->n; i++) {
        if (!isfinite(s->y[i])) { drawing = 0; continue; }
        if (drawing) cairo_line_to(cr, PX(s->x[i]), PY(s->y[i]));
        else cairo_move_to(cr, PX(s->x[i]), PY(s->y[i]));
        drawing = 1;
    }
    if (s->n == 1) cairo_arc(cr, PX(s->x[0]), PY(s->y[0]), 2.5, 0, 2 * M_PI);
    cairo_stroke(cr);
}

/* A panel of k curves, s[0]'s name its title. */
static void panel(cairo_t *cr, const ds_plot_series *s, int k, const char *xlabel, double top, double w, double h) {
    double x0 = MARGIN_L, y0 = top + MARGIN_T, pw = w - MARGIN_L - MARGIN_R, ph = h - MARGIN_T - MARGIN_B;
    double xlo, xhi, ylo, yhi;
    ranges(s, k, 0, &xlo, &xhi);
    ranges(s, k, 1, &ylo, &yhi);
    double pad = (yhi - ylo) * 0.05;
    ylo -= pad;
    yhi += pad;
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
    cairo_save(cr);
    cairo_rectangle(cr, x0, y0, pw, ph);
    cairo_clip(cr);
    cairo_set_line_width(cr, 1.8);
    for (int i = 0; i < k; i++) {
        colour(cr, i);
        curve(cr, &s[i], x0, y0, pw, ph, xlo, xhi, ylo, yhi);
    }
    if (k > 1) legend(cr, s, k, x0 + pw, y0);
    cairo_restore(cr);
#undef PX
#undef PY
}

/* How many series from s[0] on share its panel (the same name). */
static int panel_size(const ds_plot_series *s, int left) {
    int k = 1;
    while (k < left && strcmp(s[k].name, s[0].name) == 0) k++;
    return k;
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

int ds_plot_png(const char *path, const char *xlabel, const ds_plot_series *series, int nseries, int width,
                int height) {
    int npanels = 0;
    for (int i = 0; i < nseries; i += panel_size(&series[i], nseries - i)) npanels++;
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
    for (int i = 0, p = 0; i < nseries; p++) {
        int k = panel_size(&series[i], nseries - i);
        panel(cr, &series[i], k, xlabel, p * h, width, h);
        i += k;
    }
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
