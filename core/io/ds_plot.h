/* Training curves as a PNG (cairo): panels stacked top to bottom, each
 * one or more series drawn as lines against their steps, with ticked axes
 * and, for several, a legend of their labels. What `dslua plot` draws from
 * the monitors' CSV and event files. */
#ifndef DS_PLOT_H
#define DS_PLOT_H

#include <stddef.h>

typedef struct {
    const char *name;            /* the panel's title, e.g. "Train/Samples/train_loss" */
    const double *x, *y;         /* n points, x ascending */
    size_t n;
    const char *label;           /* the curve's name in the legend, or NULL */
} ds_plot_series;

/* Writes a width x height PNG to path: consecutive series of the same name
 * share one panel. Errors name the path. */
int ds_plot_png(const char *path, const char *xlabel, const ds_plot_series *series, int nseries, int width,
                int height);

#endif
