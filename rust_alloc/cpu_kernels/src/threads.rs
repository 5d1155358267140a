//! A small persistent thread pool for the kernels, built for many short calls (a decode step
//! makes ~4 per layer): the calling thread works too, chunks are taken from an atomic
//! counter, and idle helpers spin a little before they sleep, so a call costs no thread
//! start and, back to back, no wake-up. Past the first few µs an idle helper yields the CPU
//! between checks, so it does not hold a core that another thread is waiting for.
//!
//! `EDGEPAGED_NUM_THREADS` sets the number of threads (caller included); the default is the
//! number of CPUs this process may run on. `EDGEPAGED_SPIN_US` sets how long an idle helper
//! spins before it sleeps (default 200 µs).

use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

struct Job {
    f: *const (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
    done: AtomicUsize,
}

struct Shared {
    job: AtomicPtr<Job>,
    epoch: AtomicU64,
    /// helpers that may be holding the current job pointer
    inside: AtomicUsize,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    spin: Duration,
}

struct Pool {
    shared: &'static Shared,
    threads: usize,
    /// one call at a time (the job slot is single)
    submit: Mutex<()>,
}

static POOL: OnceLock<Pool> = OnceLock::new();

fn env_usize(name: &str) -> Option<usize> { std::env::var(name).ok()?.trim().parse().ok() }

fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        let threads = env_usize("EDGEPAGED_NUM_THREADS")
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            job: AtomicPtr::new(std::ptr::null_mut()),
            epoch: AtomicU64::new(0),
            inside: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            spin: Duration::from_micros(env_usize("EDGEPAGED_SPIN_US").unwrap_or(200) as u64),
        }));
        for i in 1..threads {
            std::thread::Builder::new()
                .name(format!("edgepaged-quant-{i}"))
                .spawn(move || helper(shared))
                .expect("cannot start a kernel thread");
        }
        Pool { shared, threads, submit: Mutex::new(()) }
    })
}

/// Threads the kernels use, the calling one included.
pub fn num_threads() -> usize { pool().threads }

fn run_chunks(job: &Job) {
    // SAFETY: the submitter keeps `f` alive until every holder of the job has left.
    let f = unsafe { &*job.f };
    loop {
        let i = job.next.fetch_add(1, Relaxed);
        if i >= job.n {
            return;
        }
        f(i);
        job.done.fetch_add(1, Release);
    }
}

fn helper(s: &'static Shared) {
    let mut seen = s.epoch.load(SeqCst);
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.epoch.load(SeqCst) != seen {
                break;
            }
            spins += 1;
            if spins < 1 << 10 {
                std::hint::spin_loop();
                continue;
            }
            // then yield between checks: another thread that wants this core (torch's own
            // workers, the caller's next op) gets it, and a new call is still seen within µs
            if start.elapsed() < s.spin {
                std::thread::yield_now();
                continue;
            }
            // sleep until the next call (see `parallel_for` for the wake-up handshake)
            let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, SeqCst);
            while s.epoch.load(SeqCst) == seen {
                g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            s.sleepers.fetch_sub(1, SeqCst);
            break;
        }
        seen = s.epoch.load(SeqCst);
        s.inside.fetch_add(1, SeqCst);
        let p = s.job.load(SeqCst);
        if !p.is_null() {
            // SAFETY: non-null while `inside` > 0 keeps the submitter waiting.
            run_chunks(unsafe { &*p });
        }
        s.inside.fetch_sub(1, SeqCst);
    }
}

/// Run `f(0) .. f(n - 1)`, spread over the pool; returns when all have run.
/// `f` must not panic and must not call `parallel_for`.
pub(crate) fn parallel_for(n: usize, f: &(dyn Fn(usize) + Sync)) {
    if n == 0 {
        return;
    }
    let p = pool();
    if n == 1 || p.threads == 1 {
        (0..n).for_each(f);
        return;
    }
    let _one = p.submit.lock().unwrap_or_else(|e| e.into_inner());
    let s = p.shared;
    // SAFETY: a lifetime erasure only; the job and `f` outlive every helper's use of them:
    // this call waits below until no helper holds the job.
    let f: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
    let job = Job { f, n, next: AtomicUsize::new(0), done: AtomicUsize::new(0) };
    s.job.store(&job as *const Job as *mut Job, SeqCst);
    s.epoch.fetch_add(1, SeqCst);
    // A helper going to sleep counts itself in `sleepers` before it re-reads `epoch`, and we
    // bumped `epoch` before reading `sleepers`: one of us sees the other (SeqCst), and the
    // notify takes the lock, so it cannot fall between the helper's check and its wait.
    if s.sleepers.load(SeqCst) > 0 {
        let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
        s.wake.notify_all();
    }
    run_chunks(&job);
    let mut spins = 0u32;
    while job.done.load(Acquire) < n {
        spins += 1;
        if spins < 1 << 14 { std::hint::spin_loop() } else { std::thread::yield_now() }
    }
    // Retire the job, then wait for helpers that may still hold its pointer.
    s.job.store(std::ptr::null_mut(), SeqCst);
    let mut spins = 0u32;
    while s.inside.load(SeqCst) != 0 {
        spins += 1;
        if spins < 1 << 14 { std::hint::spin_loop() } else { std::thread::yield_now() }
    }
}
