/* Reverse-mode autograd over coarse ops.
 *
 * An op that produces a tensor from inputs needing grad records a node: its
 * backward function, edges to where each input's gradient goes (the input's
 * own node, or the leaf tensor that accumulates it), the input shapes and
 * whatever it saved. The output owns the node; nodes own their edges, never
 * their outputs, so the graph has no cycles. Backward walks the nodes in
 * reverse topological order and drops each node's saved tensors as soon as
 * it has run, so activations are freed during backward, not after. */
#ifndef DS_AUTOGRAD_H
#define DS_AUTOGRAD_H

#include "ds_tensor.h"

#define DS_NODE_MAX_INPUTS 5   /* gelu_mlp: x, w1, b1, w2, b2 */
#define DS_NODE_MAX_SAVED 6

/* Fills grad_in[i] (new references, or NULL where an input needs none).
 * Returns 0, or -1 with the error set. Runs with grad mode off. */
typedef int (*ds_backward_fn)(ds_node *node, ds_tensor *grad_out, ds_tensor **grad_in);

typedef struct {
    ds_node *node;        /* input made by an op: send the gradient there */
    ds_tensor *leaf;      /* leaf input needing grad: accumulate into ->grad */
    int ndim;
    int64_t shape[DS_MAX_DIMS];
    ds_dtype dtype;
} ds_edge;

struct ds_node {
    _Atomic int refcount;
    const char *name;
    ds_backward_fn backward;
    int n_inputs;
    ds_edge next[DS_NODE_MAX_INPUTS];
    ds_tensor *saved[DS_NODE_MAX_SAVED];
    uint64_t saved_storage[DS_NODE_MAX_SAVED];  /* its storage's id and version when saved */
    uint64_t saved_version[DS_NODE_MAX_SAVED];
    double f[4];          /* op parameters (eps, p, scale, ...) */
    int64_t i[8];         /* op parameters (dims, flags, ...) */
    /* runs once as the node is freed: a node whose backward lives outside
     * C (the binding's Lua functions) drops what i[] refers to */
    void (*on_free)(ds_node *n);
    /* A backward that adds its first input's other gradients into its own
     * (one kernel where the sum took two): with fold_grad set, the gradient
     * that input's node has gathered so far is taken from it into folded
     * (NULL when none) for the backward, whose gin[0] then includes it. */
    bool fold_grad;
    ds_tensor *folded;
    /* during backward */
    ds_tensor *grad;
    int pending;
    uint32_t visit;       /* which backward pass last counted this node */
};

bool ds_grad_enabled(void);
bool ds_set_grad_enabled(bool on);      /* returns the previous mode */

/* Records a node for `out` if grad mode is on and any input requires grad;
 * returns it (borrowed, owned by out) so the op can save tensors and
 * parameters, or NULL when nothing is recorded. Inputs may be NULL. */
ds_node *ds_autograd_record(const char *name, ds_backward_fn fn, int n_inputs,
                            ds_tensor *const *inputs, ds_tensor *out);
/* Keeps t's data for backward. Pass the op's own output too: the node keeps
 * an alias without history, which avoids a reference cycle. A parameter (a
 * leaf needing grad) is kept itself, so backward reads the data it has
 * then: a partitioned parameter released after forward is fetched again.
 * Its storage's version is noted: backward fails, naming the op and the
 * tensor, if an in-place op wrote into the bytes since (a storage swapped
 * whole, by a fetch or an optimizer's flat buffer, is not a write). */
int ds_node_save(ds_node *n, int slot, ds_tensor *t);
/* Whether input k of n gets a gradient (it leads to a leaf or a node). */
static inline bool ds_node_needs_grad(const ds_node *n, int k) { return n->next[k].node || n->next[k].leaf; }
void ds_node_release(ds_node *n);

/* A leaf hook runs once per backward, as soon as the last gradient that
 * backward sends to the leaf has been accumulated into leaf->grad (edges to
 * the leaf are counted with the dependencies), while backward goes on with
 * the rest of the graph: how data parallelism starts reducing gradients
 * early. It returns 0, or -1 with the error set (backward then fails). */
typedef int (*ds_leaf_hook)(ds_tensor *leaf, void *ud);
/* Sets leaf's hook, replacing any; fn NULL removes the hook if it was set
 * with this ud. A hook keeps a reference to its leaf until it is removed.
 * 0, or -1 with the error set. */
int ds_autograd_set_leaf_hook(ds_tensor *leaf, ds_leaf_hook fn, void *ud);

/* Called before a node's backward for each saved tensor whose data was
 * released (ds_tensor_release_data): a fetcher makes the data of the
 * tensors it holds whole again (ds_tensor_set_data) and leaves others as
 * they are. 0, or -1 with the error set. When none fetches it, such a node
 * fails with an error naming the tensor. Fetchers are asked in the order
 * they were added; remove takes away the one added with fn and ud. */
typedef int (*ds_fetch_fn)(ds_tensor *t, void *ud);
int ds_autograd_add_fetch(ds_fetch_fn fn, void *ud);
void ds_autograd_remove_fetch(ds_fetch_fn fn, void *ud);
/* The same for a forward read: t made whole through the fetchers (a
 * binding calls it before an op reads t). 0, or -1 with the error set. */
int ds_autograd_fetch(ds_tensor *t);

/* Backpropagates from `root`; grad NULL means ones (root must then hold one
 * element). Frees the graph's saved tensors unless retain_graph. */
int ds_backward(ds_tensor *root, ds_tensor *grad, bool retain_graph);

/* Gradient `g` (shaped like an op's broadcast output) summed down to the
 * shape an input had: the inverse of broadcasting. New reference. */
ds_tensor *ds_sum_to_shape(ds_tensor *g, int ndim, const int64_t *shape);

#endif
