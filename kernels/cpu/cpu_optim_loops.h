/* The optimizers' inner loops, included by cpu_optim.c once per
 * instruction set (SSE2 as built; AVX2 and AVX-512 under gcc's target
 * pragma or clang's target attribute), CPU_OPTIM_ISA naming the
 * variant. Every step is one IEEE operation rounded to f32 (the file is
 * built with -ffp-contract=off), so each variant writes the same bits as
 * a scalar loop of ds_optim_elem.h. */
#define CPU_OPTIM_PASTE(a, b) a##_##b
#define CPU_OPTIM_NAME(a, b) CPU_OPTIM_PASTE(a, b)
#define LOOP(name) CPU_OPTIM_NAME(name, CPU_OPTIM_ISA)

static void LOOP(scale)(float *restrict out, const float *restrict g, float f, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = g[i] * f;
}

static void LOOP(shadow)(uint16_t *restrict s, const float *restrict p, ds_dtype t, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) s[i] = ds_optim_half(p[i], t);
}

static void LOOP(sgd)(const optim_ctx *x, const float *restrict g, int64_t lo, int64_t hi) {
    float *restrict p = x->p, *restrict buf = x->m;
    float lr = x->lr, wd = x->wd, mom = x->a, damp = x->b;
    int nesterov = x->flag1, first = x->flag2;
    if (!buf) {
        #pragma omp simd
        for (int64_t i = lo; i < hi; i++) ds_sgd_elem(&p[i], g[i - lo], lr, wd);
        return;
    }
    #pragma omp simd
    for (int64_t i = lo; i < hi; i++)
        ds_sgd_momentum_elem(&p[i], &buf[i], g[i - lo], lr, wd, mom, damp, nesterov, first);
}

/* Adam and AdamW in loops of their own, so neither carries the other's
 * select. */
static void LOOP(adam)(const optim_ctx *x, const float *restrict g, int64_t lo, int64_t hi) {
    float *restrict p = x->p, *restrict m = x->m, *restrict v = x->v;
    float b1 = x->beta1, b2 = x->beta2, eps = x->eps, wd = x->wd, decay = x->a, step = x->b, sbc2 = x->c;
    if (x->flag1) {
        #pragma omp simd
        for (int64_t i = lo; i < hi; i++)
            ds_adam_elem(&p[i], &m[i], &v[i], g[i - lo], b1, b2, eps, wd, decay, step, sbc2, 1);
        return;
    }
    #pragma omp simd
    for (int64_t i = lo; i < hi; i++)
        ds_adam_elem(&p[i], &m[i], &v[i], g[i - lo], b1, b2, eps, wd, decay, step, sbc2, 0);
}

static void LOOP(adagrad)(const optim_ctx *x, const float *restrict g, int64_t lo, int64_t hi) {
    float *restrict p = x->p, *restrict sum = x->m;
    float clr = x->lr, eps = x->eps, wd = x->wd;
    #pragma omp simd
    for (int64_t i = lo; i < hi; i++) ds_adagrad_elem(&p[i], &sum[i], g[i - lo], clr, eps, wd);
}

static void LOOP(lion)(const optim_ctx *x, const float *restrict g, int64_t lo, int64_t hi) {
    float *restrict p = x->p, *restrict m = x->m;
    float lr = x->lr, b1 = x->beta1, b2 = x->beta2, decay = x->a;
    #pragma omp simd
    for (int64_t i = lo; i < hi; i++) ds_lion_elem(&p[i], &m[i], g[i - lo], lr, b1, b2, decay);
}

static const optim_loops LOOP(loops) = {
    .isa = CPU_OPTIM_STR(CPU_OPTIM_ISA), .scale = LOOP(scale), .shadow = LOOP(shadow), .sgd = LOOP(sgd),
    .adam = LOOP(adam), .adagrad = LOOP(adagrad), .lion = LOOP(lion),
};

#undef LOOP
