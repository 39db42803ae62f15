#include "ds_autograd.h"
#include "ds_error.h"
#include "ds_ops.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local bool grad_disabled;

bool ds_grad_enabled(void) { return !grad_disabled; }

bool ds_set_grad_enabled(bool on) {
    bool prev = !grad_disabled;
    grad_disabled = !on;
    return prev;
}

ds_node *ds_autograd_record(const char *name, ds_backward_fn fn, int n_inputs,
                            ds_tensor *const *inputs, ds_tensor *out) {
    if (grad_disabled) return NULL;
    bool any = false;
    for (int k = 0; k < n_inputs; k++)
        if (inputs[k] && inputs[k]->requires_grad) any = true;
    if (!any) return NULL;
    ds_node *n = calloc(1, sizeof *n);
    if (!n) return NULL;    /* out of memory: the op still works, without history */
    atomic_init(&n->refcount, 1);
    n->name = name;
    n->backward = fn;
    n->n_inputs = n_inputs;
    for (int k = 0; k < n_inputs; k++) {
        ds_tensor *in = inputs[k];
        ds_edge *e = &n->next[k];
        if (!in) continue;
        e->ndim = in->ndim;
        memcpy(e->shape, in->shape, sizeof e->shape);
        e->dtype = in->dtype;
        if (!in->requires_grad) continue;
        if (in->grad_fn) {
            e->node = in->grad_fn;
            atomic_fetch_add(&e->node->refcount, 1);
        } else {
            e->leaf = in;
            ds_tensor_retain(in);
        }
    }
    out->grad_fn = n;
    out->requires_grad = true;
    /* a fresh output is an activation; a view shares its base's storage
     * (refcount > 1) and must not relabel the base's bytes */
    if (out->storage->category == DS_MEM_OTHER && atomic_load(&out->storage->refcount) == 1)
        ds_tensor_set_category(out, DS_MEM_ACT);
    return n;
}

int ds_node_save(ds_node *n, int slot, ds_tensor *t) {
    ds_tensor *alias = t;
    if (!t->grad_fn && t->requires_grad) ds_tensor_retain(t);
    else if (!(alias = ds_tensor_view_of(t, t->ndim, t->shape, t->stride, t->offset))) return -1;
    ds_tensor_release(n->saved[slot]);
    n->saved[slot] = alias;
    n->saved_storage[slot] = t->storage->id;
    n->saved_version[slot] = atomic_load_explicit(&t->storage->version, memory_order_relaxed);
    return 0;
}

static void node_free_saved(ds_node *n) {
    for (int k = 0; k < DS_NODE_MAX_SAVED; k++) {
        ds_tensor_release(n->saved[k]);
        n->saved[k] = NULL;
    }
}

/* Iterative, so a graph thousands of nodes deep cannot overflow the C stack. */
void ds_node_release(ds_node *n) {
    ds_node **stack = NULL;
    size_t len = 0, cap = 0;
    while (n) {
        if (atomic_fetch_sub(&n->refcount, 1) == 1) {
            if (n->on_free) n->on_free(n);
            node_free_saved(n);
            ds_tensor_release(n->grad);
            for (int k = 0; k < n->n_inputs; k++) {
                ds_tensor_release(n->next[k].leaf);
                if (!n->next[k].node) continue;
                if (len == cap) {
                    cap = cap ? cap * 2 : 16;
                    ds_node **grown = realloc(stack, cap * sizeof *stack);
                    if (!grown) abort();   /* cannot report from a destructor */
                    stack = grown;
                }
                stack[len++] = n->next[k].node;
            }
            free(n);
        }
        n = len ? stack[--len] : NULL;
    }
    free(stack);
}

/* Adds g into *slot: the first gradient is taken as is, later ones summed. */
static int accumulate(ds_tensor **slot, ds_tensor *g) {
    if (!*slot) {
        ds_tensor_retain(g);
        *slot = g;
        return 0;
    }
    ds_tensor *sum = ds_add(*slot, g);
    if (!sum) return -1;
    ds_tensor_release(*slot);
    *slot = sum;
    return 0;
}

/* A leaf's .grad must be its own buffer (never an alias of another
 * gradient) since optimizers and accumulation write it in place. */
/* True when g is the only reference to the only view of its storage. */
static bool sole_owner(ds_tensor *g) {
    return atomic_load(&g->refcount) == 1 && atomic_load(&g->storage->refcount) == 1 && !g->grad_fn &&
           g->offset == 0 && ds_tensor_is_contiguous(g) &&
           g->storage->nbytes == (size_t)ds_tensor_numel(g) * ds_dtype_size(g->dtype);
}

static int accumulate_leaf(ds_tensor *leaf, ds_tensor *g) {
    if (g->dtype != leaf->dtype) {
        ds_tensor *cast = ds_to_dtype(g, leaf->dtype);
        if (!cast) return -1;
        int rc = accumulate_leaf(leaf, cast);
        ds_tensor_release(cast);
        return rc;
    }
    if (leaf->grad) return ds_add_(leaf->grad, g);
    ds_tensor *own;
    if (sole_owner(g)) {      /* nobody else can see g: adopt it, no copy */
        ds_tensor_retain(g);
        own = g;
    } else if (!(own = ds_clone(g))) {
        return -1;
    }
    ds_tensor_set_category(own, DS_MEM_GRAD);
    leaf->grad = own;
    return 0;
}

/* Leaf hooks, in an array sorted by leaf address. pending counts the edges
 * of backward number `visit` still to deliver to the leaf. Set them from the
 * thread that runs backward. */
typedef struct {
    ds_tensor *leaf;
    ds_leaf_hook fn;
    void *ud;
    int pending;
    uint32_t visit;
} leaf_hook;

static leaf_hook *hooks;
static size_t n_hooks, cap_hooks;

/* The first position whose leaf is not below `leaf`. */
static size_t hook_pos(const ds_tensor *leaf) {
    size_t lo = 0, hi = n_hooks;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if ((uintptr_t)hooks[mid].leaf < (uintptr_t)leaf) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static leaf_hook *find_hook(const ds_tensor *leaf) {
    if (!n_hooks) return NULL;
    size_t i = hook_pos(leaf);
    return i < n_hooks && hooks[i].leaf == leaf ? &hooks[i] : NULL;
}

int ds_autograd_set_leaf_hook(ds_tensor *leaf, ds_leaf_hook fn, void *ud) {
    size_t i = hook_pos(leaf);
    bool have = i < n_hooks && hooks[i].leaf == leaf;
    if (!fn) {
        if (!have || hooks[i].ud != ud) return 0;
        memmove(&hooks[i], &hooks[i + 1], (n_hooks - i - 1) * sizeof *hooks);
        n_hooks--;
        ds_tensor_release(leaf);
        return 0;
    }
    if (leaf->grad_fn)
        return ds_fail(DS_ERR_ARG, "leaf hook: the tensor is not a leaf (%s made it)", leaf->grad_fn->name), -1;
    if (have) {
        hooks[i].fn = fn;
        hooks[i].ud = ud;
        return 0;
    }
    if (n_hooks == cap_hooks) {
        size_t cap = cap_hooks ? cap_hooks * 2 : 64;
        leaf_hook *grown = realloc(hooks, cap * sizeof *grown);
        if (!grown) return ds_fail(DS_ERR_NOMEM, "leaf hook: out of memory"), -1;
        hooks = grown;
        cap_hooks = cap;
    }
    memmove(&hooks[i + 1], &hooks[i], (n_hooks - i) * sizeof *hooks);
    hooks[i] = (leaf_hook){ .leaf = leaf, .fn = fn, .ud = ud };
    n_hooks++;
    ds_tensor_retain(leaf);
    return 0;
}

static void count_leaf_edge(const ds_tensor *leaf, uint32_t visit) {
    leaf_hook *h = find_hook(leaf);
    if (!h) return;
    if (h->visit != visit) {
        h->visit = visit;
        h->pending = 0;
    }
    h->pending++;
}

/* One edge of backward `visit` has delivered to leaf: the last one runs
 * the hook (copied out first: the hook may change the array). */
static int leaf_delivered(ds_tensor *leaf, uint32_t visit) {
    leaf_hook *h = find_hook(leaf);
    if (!h || h->visit != visit || --h->pending > 0) return 0;
    ds_leaf_hook fn = h->fn;
    return fn(leaf, h->ud);
}

typedef struct { ds_node **items; size_t len, cap; } node_list;

static int list_push(node_list *l, ds_node *n) {
    if (l->len == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        ds_node **grown = realloc(l->items, cap * sizeof *grown);
        if (!grown) { ds_fail(DS_ERR_NOMEM, "backward: out of memory"); return -1; }
        l->items = grown;
        l->cap = cap;
    }
    l->items[l->len++] = n;
    return 0;
}

static _Atomic uint32_t visits;

/* Counts, for every node reachable from root, how many edges lead to it;
 * a node runs once all of them have delivered their gradient. Edges to
 * hooked leaves are counted too. The pass is numbered `visit`. */
static int count_dependencies(ds_node *root, node_list *seen, uint32_t visit) {
    node_list stack = {0};
    root->visit = visit;
    int rc = list_push(&stack, root);
    root->pending = 0;
    if (rc == 0) rc = list_push(seen, root);
    while (rc == 0 && stack.len) {
        ds_node *n = stack.items[--stack.len];
        for (int k = 0; k < n->n_inputs && rc == 0; k++) {
            ds_node *m = n->next[k].node;
            if (!m) {
                if (n->next[k].leaf && n_hooks) count_leaf_edge(n->next[k].leaf, visit);
                continue;
            }
            if (m->visit != visit) {
                m->visit = visit;
                m->pending = 0;
                rc = list_push(seen, m);
                if (rc == 0) rc = list_push(&stack, m);
            }
            m->pending++;
        }
    }
    free(stack.items);
    return rc;
}

/* Stands in for the backward of a node whose saved tensors are gone, so a
 * second pass over the graph fails with a reason instead of reading NULLs. */
static int freed_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    (void)n; (void)g; (void)gin;
    ds_fail(DS_ERR_STATE, "its saved tensors were freed by an earlier backward; "
            "pass retain_graph=true to that backward to run it again");
    return -1;
}

/* A gradient must have its input's shape: a wrong one accumulated into a
 * leaf would send optimizers past the end of the parameter. */
static int check_grad_shape(const ds_node *n, int k, const ds_tensor *g) {
    const ds_edge *e = &n->next[k];
    if (g->ndim == e->ndim && memcmp(g->shape, e->shape, sizeof(int64_t) * (size_t)e->ndim) == 0) return 0;
    char gs[96], want[96] = "[";
    for (int i = 0; i < e->ndim; i++)
        snprintf(want + strlen(want), sizeof want - strlen(want), i ? ",%lld" : "%lld", (long long)e->shape[i]);
    strncat(want, "]", sizeof want - strlen(want) - 1);
    ds_fail(DS_ERR_STATE, "backward of %s: gradient of input %d has shape %s, the input %s", n->name, k + 1,
            ds_shape_str(g, gs, sizeof gs), want);
    return -1;
}

/* Fetchers, asked in turn until one makes the tensor whole: each stage-3
 * engine registers its own, so engines come and go independently. */
typedef struct {
    ds_fetch_fn fn;
    void *ud;
} fetcher;

static fetcher *fetchers;
static int n_fetchers, cap_fetchers;

int ds_autograd_add_fetch(ds_fetch_fn fn, void *ud) {
    if (n_fetchers == cap_fetchers) {
        int cap = cap_fetchers ? 2 * cap_fetchers : 4;
        fetcher *grown = realloc(fetchers, sizeof *grown * (size_t)cap);
        if (!grown) return ds_fail(DS_ERR_NOMEM, "fetch: out of memory"), -1;
        fetchers = grown;
        cap_fetchers = cap;
    }
    fetchers[n_fetchers++] = (fetcher){ fn, ud };
    return 0;
}

void ds_autograd_remove_fetch(ds_fetch_fn fn, void *ud) {
    for (int i = 0; i < n_fetchers; i++) {
        if (fetchers[i].fn != fn || fetchers[i].ud != ud) continue;
        memmove(&fetchers[i], &fetchers[i + 1], sizeof *fetchers * (size_t)(n_fetchers - i - 1));
        n_fetchers--;
        return;
    }
}

int ds_autograd_fetch(ds_tensor *t) {
    for (int i = 0; i < n_fetchers && ds_tensor_is_released(t); i++)
        if (fetchers[i].fn(t, fetchers[i].ud)) return -1;
    return 0;
}

/* Saved parameters whose data was released since forward come back first. */
static int fetch_saved(ds_node *n) {
    for (int k = 0; k < DS_NODE_MAX_SAVED; k++) {
        ds_tensor *t = n->saved[k];
        if (!t || !ds_tensor_is_released(t)) continue;
        if (ds_autograd_fetch(t)) return -1;
        if (ds_tensor_is_released(t)) {
            char s[96];
            return ds_fail(DS_ERR_STATE, "a saved %s %s has no data (a released partitioned parameter) and "
                           "nothing fetched it", ds_dtype_name(t->dtype), ds_shape_str(t, s, sizeof s)), -1;
        }
    }
    return 0;
}

/* Saved tensors written in place since they were saved would give wrong
 * gradients without a word: refused, naming the writer. */
static int check_versions(const ds_node *n) {
    for (int k = 0; k < DS_NODE_MAX_SAVED; k++) {
        const ds_tensor *t = n->saved[k];
        if (!t || t->storage->id != n->saved_storage[k]) continue;
        uint64_t now = atomic_load_explicit(&t->storage->version, memory_order_relaxed);
        if (now == n->saved_version[k]) continue;
        const char *by = atomic_load_explicit(&t->storage->modified_by, memory_order_relaxed);
        char s[96];
        return ds_fail(DS_ERR_STATE, "the %s %s tensor it saved (saved tensor %d) was modified in place by %s after "
                       "it was saved (version %llu, saved at %llu); clone it before the in-place op, or use the "
                       "out-of-place op",
                       ds_dtype_name(t->dtype), ds_shape_str(t, s, sizeof s), k + 1, by ? by : "an in-place op",
                       (unsigned long long)now, (unsigned long long)n->saved_version[k]), -1;
    }
    return 0;
}

static int run_node(ds_node *n, bool retain_graph, node_list *ready, uint32_t visit) {
    ds_tensor *gin[DS_NODE_MAX_INPUTS] = {0};
    ds_tensor *g = n->grad;
    n->grad = NULL;
    int rc = check_versions(n);
    if (rc == 0) rc = fetch_saved(n);
    if (n->fold_grad && n->next[0].node) {
        n->folded = n->next[0].node->grad;
        n->next[0].node->grad = NULL;
    }
    if (rc == 0) rc = n->backward(n, g, gin);
    ds_tensor_release(n->folded);
    n->folded = NULL;
    if (rc != 0) {
        char msg[1024];
        strncpy(msg, ds_error_message(), sizeof msg - 1);
        msg[sizeof msg - 1] = 0;
        ds_fail(DS_ERR_STATE, "backward of %s: %s", n->name, msg);
    }
    ds_tensor_release(g);
    if (!retain_graph) {
        for (int k = 0; k < DS_NODE_MAX_SAVED; k++)
            if (n->saved[k]) n->backward = freed_backward;    /* nodes that saved nothing may rerun */
        node_free_saved(n);
    }
    for (int k = 0; k < n->n_inputs; k++) {
        ds_edge *e = &n->next[k];
        if (rc == 0 && gin[k] && (e->leaf || e->node)) rc = check_grad_shape(n, k, gin[k]);
        if (rc == 0 && gin[k]) {
            if (e->leaf) rc = accumulate_leaf(e->leaf, gin[k]);
            else if (e->node) rc = accumulate(&e->node->grad, gin[k]);
        }
        if (e->leaf && n_hooks && rc == 0) rc = leaf_delivered(e->leaf, visit);
        if (e->node && --e->node->pending == 0 && rc == 0) rc = list_push(ready, e->node);
        ds_tensor_release(gin[k]);
    }
    return rc;
}

int ds_backward(ds_tensor *root, ds_tensor *grad, bool retain_graph) {
    char s[96];
    if (!root->requires_grad)
        return ds_fail(DS_ERR_ARG, "backward: tensor does not require grad"), -1;
    if (!grad && ds_tensor_numel(root) != 1)
        return ds_fail(DS_ERR_ARG, "backward: grad can be omitted only for one-element tensors, got shape %s",
                       ds_shape_str(root, s, sizeof s)), -1;
    if (grad && !ds_tensor_same_shape(grad, root))
        return ds_fail(DS_ERR_ARG, "backward: grad shape %s does not match tensor", ds_shape_str(grad, s, sizeof s)), -1;
    bool was = ds_set_grad_enabled(false);
    /* a grad of another dtype is cast to the root's, as PyTorch does */
    ds_tensor *g = grad ? ds_to_dtype(grad, root->dtype)
                        : ds_tensor_full(root->ndim, root->shape, root->dtype, ds_tensor_device(root), 1.0);
    int rc = g ? 0 : -1;
    uint32_t visit = atomic_fetch_add(&visits, 1) + 1;
    if (rc == 0 && !root->grad_fn) {
        rc = accumulate_leaf(root, g);
        if (rc == 0 && n_hooks) {
            count_leaf_edge(root, visit);
            rc = leaf_delivered(root, visit);
        }
    } else if (rc == 0) {
        node_list seen = {0}, ready = {0};
        ds_node *top = root->grad_fn;
        rc = count_dependencies(top, &seen, visit);
        if (rc == 0) rc = accumulate(&top->grad, g);
        if (rc == 0) rc = list_push(&ready, top);
        while (rc == 0 && ready.len) rc = run_node(ready.items[--ready.len], retain_graph, &ready, visit);
        for (size_t j = 0; j < seen.len; j++) {   /* drop partial sums after an error */
            ds_tensor_release(seen.items[j]->grad);
            seen.items[j]->grad = NULL;
        }
        free(seen.items);
        free(ready.items);
    }
    ds_tensor_release(g);
    ds_set_grad_enabled(was);
    return rc;
}

ds_tensor *ds_sum_to_shape(ds_tensor *g, int ndim, const int64_t *shape) {
    int lead = g->ndim - ndim;
    int64_t dims[DS_MAX_DIMS];
    int nd = 0;
    for (int d = 0; d < g->ndim; d++)
        if (d < lead || (shape[d - lead] == 1 && g->shape[d] != 1)) dims[nd++] = d;
    if (nd == 0 && lead == 0) { ds_tensor_retain(g); return g; }
    ds_tensor *s = ds_sum(g, nd, dims, true);
    if (!s) return NULL;
    ds_tensor *r = ds_reshape(s, ndim, shape);
    ds_tensor_release(s);
    return r;
}
