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

use std::sync::OnceLock;

/// The threads a loop runs on: the pool's workers and the caller.
pub(super) fn threads() -> usize {
    candle_core::utils::barrier_pool().n_workers() + 1
}

/// `f(i)` for every task `i` of `0..n`, on the pool; the results in task
/// order (which thread ran a task changes nothing in it). A call from
/// within the pool runs its tasks in place.
pub(super) fn run<T: Send + Sync, F: Fn(usize) -> T + Sync>(n: usize, f: F) -> Vec<T> {
    let slots: Vec<OnceLock<T>> = (0..n).map(|_| OnceLock::new()).collect();
    candle_core::utils::barrier_pool().execute_chunked(n, |tasks| {
        for i in tasks {
            // Each task runs once: its slot is empty.
            let _ = slots[i].set(f(i));
        }
    });
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
}
