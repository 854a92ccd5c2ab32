/* The kernels' thread pool: `bs_parallel(fn, ctx, n)` runs fn(ctx, 0) .. fn(ctx, n - 1)
   on the calling thread and on bs_set_threads(n) - 1 workers.

   Why not OpenMP: a team's join waits for every thread of the team, so when a server's
   other threads (HTTP, tokenizer, the client on a shared box) hold a core, the step waits
   for a descheduled worker, and libgomp's workers spin up to milliseconds after each
   region on cores those threads need. Here each task is claimed from a shared counter by
   whichever thread gets to it first: a worker that was not scheduled in time finds
   nothing left and the caller has done its share; the caller waits only for tasks a
   worker has already claimed. Workers spin ~50 us for the next job (the regions of one
   decode step follow each other closely), then sleep on a futex (between steps, while
   Python runs). Which thread runs a task never changes what it computes.

   One job at a time: a second thread calling while a job runs (two models' engines in one
   process), or a task calling again, runs its tasks alone instead of waiting. */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif

#define MAX_WORKERS 255
#define SPIN_NS 50000L

static struct {
    pthread_mutex_t lock;     /* held by the caller of the running job */
    _Atomic uint64_t state;   /* generation << 32 | the next unclaimed task */
    _Atomic uint32_t gen;     /* the futex word: the latest generation */
    _Atomic long done;        /* tasks of this generation finished */
    _Atomic int sleepers;     /* workers in futex_wait */
    _Atomic(bs_task) fn;
    _Atomic(void *) ctx;
    _Atomic long n;
    _Atomic int want;         /* bs_set_threads: caller + workers */
    int started;              /* workers running (under lock) */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static __thread int in_task; /* set on workers and inside a job: no nesting */

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Claim and run tasks of generation g until none is left. */
static void run(uint32_t g) {
    for (;;) {
        uint64_t s = atomic_load_explicit(&pool.state, memory_order_acquire);
        if ((uint32_t)(s >> 32) != g) return;
        long i = (long)(uint32_t)s;
        /* read before the claim: if the claim succeeds, job g was not finished, so no
           later job can have replaced these */
        long n = atomic_load_explicit(&pool.n, memory_order_relaxed);
        bs_task fn = atomic_load_explicit(&pool.fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&pool.ctx, memory_order_relaxed);
        if (i >= n) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.state, &s, s + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        fn(ctx, i);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
}

static void *worker(void *arg) {
    long index = (long)arg; /* workers 0 .. want - 2 take part */
    in_task = 1;
    uint32_t seen = atomic_load(&pool.gen);
    for (;;) {
        uint32_t g;
        long until = now_ns() + SPIN_NS;
        for (int spins = 0; (g = atomic_load(&pool.gen)) == seen; spins++) {
            RELAX();
            if ((spins & 255) == 255 && now_ns() > until) {
                atomic_fetch_add(&pool.sleepers, 1);
                while ((g = atomic_load(&pool.gen)) == seen)
                    syscall(SYS_futex, &pool.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&pool.sleepers, 1);
                break;
            }
        }
        seen = g;
        if (index < atomic_load(&pool.want) - 1) run(g);
    }
    return NULL;
}

/* A forked child has the caller's thread only: start again from no workers. */
static void after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pool.started = 0;
    atomic_store(&pool.sleepers, 0);
}

static void start_workers(int workers) {
    static int registered;
    if (!registered) registered = pthread_atfork(NULL, NULL, after_fork) == 0;
    while (pool.started < workers && pool.started < MAX_WORKERS) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&t, &attr, worker, (void *)(long)pool.started);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.started++;
    }
}

void bs_set_threads(long n) { atomic_store(&pool.want, n > 1 ? (int)(n < 256 ? n : 256) : 1); }

long bs_get_threads(void) {
    int want = atomic_load(&pool.want);
    return want > 1 ? want : 1;
}

void bs_parallel(bs_task fn, void *ctx, long n) {
    int want = atomic_load(&pool.want);
    if (n <= 0) return;
    if (n == 1 || want <= 1 || in_task || pthread_mutex_trylock(&pool.lock) != 0) {
        for (long i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    start_workers(want - 1);
    atomic_store_explicit(&pool.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&pool.n, n, memory_order_relaxed);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    uint32_t g = atomic_load(&pool.gen) + 1;
    atomic_store_explicit(&pool.state, (uint64_t)g << 32, memory_order_release);
    atomic_store(&pool.gen, g);
    if (atomic_load(&pool.sleepers) > 0)
        syscall(SYS_futex, &pool.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    in_task = 1;
    run(g);
    in_task = 0;
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < n) RELAX();
    pthread_mutex_unlock(&pool.lock);
}
