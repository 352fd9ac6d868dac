//! The engine's own parallel loops (attention, float products) run on
//! candle's compute pool, the one its quantized products run on. A second
//! pool beside it would compete with that pool's workers, which spin for a
//! while after each product before they sleep: on two cores, decoding after
//! a 1000-token prompt ran at two thirds of the speed while attention ran on
//! a pool of its own.
//!
//! ```text
//!  tasks 0..n ─► candle's pool (its workers and the calling thread take
//!                chunks of tasks from a shared cursor) ─► results, in task order
//! ```

use std::sync::{Mutex, OnceLock};

/// The threads a loop runs on: the pool's workers and the caller.
pub(super) fn threads() -> usize {
    candle_core::utils::barrier_pool().n_workers() + 1
}

/// `f(i)` for every task `i` of `0..n`, on the pool; the results in task
/// order (which thread ran a task changes nothing in it). Must not be
/// called from within a task (`f` computes alone). A task that panics
/// panics the caller once the pool is done, outside the pool's lock: a
/// panic unwinding through the pool would poison it for every stage of
/// the process.
pub(super) fn run<T: Send + Sync, F: Fn(usize) -> T + Sync>(n: usize, f: F) -> Vec<T> {
    let slots: Vec<OnceLock<T>> = (0..n).map(|_| OnceLock::new()).collect();
    let panicked: Mutex<Option<Box<dyn std::any::Any + Send>>> = Mutex::new(None);
    candle_core::utils::barrier_pool().execute_chunked(n, |tasks| {
        for i in tasks {
            let mut first = panicked.lock().unwrap_or_else(|e| e.into_inner());
            if first.is_some() {
                return;
            }
            drop(first);
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i))) {
                // Each task runs once: its slot is empty.
                Ok(value) => {
                    let _ = slots[i].set(value);
                }
                Err(panic) => {
                    first = panicked.lock().unwrap_or_else(|e| e.into_inner());
                    first.get_or_insert(panic);
                    return;
                }
            }
        }
    });
    if let Some(panic) = panicked.into_inner().unwrap_or_else(|e| e.into_inner()) {
        std::panic::resume_unwind(panic);
    }
    slots
        .into_iter()
        .map(|slot| slot.into_inner().expect("every task ran"))
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_task_runs_once_and_results_keep_their_order() {
        let ran = std::sync::atomic::AtomicUsize::new(0);
        let squares = super::run(1000, |i| {
            ran.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            i * i
        });
        assert_eq!(ran.into_inner(), 1000);
        assert!(squares.iter().enumerate().all(|(i, s)| *s == i * i));
        assert!(super::run(0, |i| i).is_empty());
        assert!(super::threads() >= 1);
    }

    #[test]
    fn a_task_that_panics_panics_the_caller_and_leaves_the_pool_working() {
        let result = std::panic::catch_unwind(|| {
            super::run(100, |i| {
                assert!(i != 37, "task 37 fails");
                i
            })
        });
        assert!(result.is_err());
        // The pool (candle's products' too) still runs.
        assert_eq!(super::run(10, |i| i + 1), (1..=10).collect::<Vec<_>>());
    }
}
