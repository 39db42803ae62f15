/* Training curves as a PNG (cairo): panels stacked top to bottom, each one
 * series drawn as a line against its steps, with ticked axes. What
 * `dslua plot` draws from the monitors' CSV and event files. */
#ifndef DS_PLOT_H
#define DS_PLOT_H

#include <stddef.h>

typedef struct {
    const char *name;            /* the panel's title, e.g. "Train/Samples/train_loss" */
    const double *x, *y;         /* n points, x ascending */
    size_t n;
} ds_plot_series;

/* Writes a width x height PNG to path. Errors name the path. */
int ds_plot_png(const char *path, const char *xlabel, const ds_plot_series *panels, int npanels, int width,
                int height);

#endif
