/* libdslua_loopback.so: preloaded into mpirun by the launcher for jobs on
 * this machine only. Open MPI 4.1's runtime binds its control listeners to
 * every interface (orte/mca/oob/tcp create_listen: INADDR_ANY and
 * in6addr_any, whatever oob_tcp_if_include says), so anyone who reaches the
 * host could talk to the job's daemon. Here a wildcard bind becomes a
 * loopback one. The library takes itself out of LD_PRELOAD when it loads,
 * so the ranks mpirun starts run without it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real;
    if (!real) real = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            a.sin6_addr = in6addr_loopback;
            return real(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real(fd, addr, len);
}

/* LD_PRELOAD without this library (its entries split at ':' or ' '). */
__attribute__((constructor)) static void leave_preload(void) {
    Dl_info me;
    const char *list = getenv("LD_PRELOAD");
    if (!list || !dladdr((void *)leave_preload, &me) || !me.dli_fname) return;
    char *kept = malloc(strlen(list) + 1);
    if (!kept) return;
    size_t n = 0;
    for (const char *p = list; *p;) {
        size_t len = strcspn(p, ": ");
        if (len && !(len == strlen(me.dli_fname) && strncmp(p, me.dli_fname, len) == 0)) {
            if (n) kept[n++] = ':';
            memcpy(kept + n, p, len);
            n += len;
        }
        p += len;
        if (*p) p++;
    }
    kept[n] = 0;
    if (n) setenv("LD_PRELOAD", kept, 1);
    else unsetenv("LD_PRELOAD");
    free(kept);
}
