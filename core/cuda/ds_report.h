/* `dslua --report`, as DeepSpeed's ds_report: the libraries this binary
 * runs on with their versions, the GPUs it sees, and the features on. */
#ifndef DS_REPORT_H
#define DS_REPORT_H

#include <stdio.h>

/* luajit: the LuaJIT version string (the binding layer knows it). */
void ds_report(FILE *f, const char *luajit);

#endif
