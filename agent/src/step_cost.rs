//! What a stage's forward pass costs, fitted from the passes it ran: a part
//! paid once per pass (the weights read once however many rows ride along,
//! the pass's bookkeeping) and a part per row. The step loop sizes prompt
//! slices with it; a head estimates how long queued work waits with it.
//!
//! ```text
//!  seconds ▲                      ·
//!          │              ·  ·        fitted: fixed + per_row × rows
//!          │       ·  ·
//!  fixed ──┼·· ·
//!          └──────────────────────► rows in the pass
//! ```
//!
//! A per-row average alone charges the fixed part to every row: after a few
//! decode-only passes of one or two rows a row looks many times dearer than
//! it is, and prompts that arrive while sequences decode run in slices of a
//! few tokens, one slow step each.
//!
//! The fit is a least-squares line over the recent passes, each weighted less
//! the older it is. It counts once its slope is known to a quarter of itself
//! (the slope's standard error, from the scatter about the line, the spread
//! of the sizes and how many passes the weights amount to): passes of one to
//! eight decoding sequences make a line when their times follow their sizes
//! more than their noise. While the recent passes do not determine one (all
//! about the same size, or the noise as large as the differences) the slope
//! of the last line that was stands, and the fixed part follows the recent
//! passes. Before any line, the cost counts per row alone (the cautious
//! estimate).

/// How much of its weight a pass keeps at each later pass: the fit follows
/// the last few dozen passes (a weight halves in about 14).
const KEEP: f64 = 0.95;

/// The spread of pass sizes (a standard deviation, in rows) below which no
/// line is fitted: passes of one size determine no slope.
const MIN_SPREAD_ROWS: f64 = 0.5;

/// The largest standard error of a line's slope, relative to the slope, at
/// which the line counts.
const MAX_SLOPE_ERROR: f64 = 0.25;

/// The fewest passes (the weights' effective number) a line is fitted to:
/// with fewer, noise alone passes the slope's test too often.
const MIN_PASSES: f64 = 8.0;

/// What a pass costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PassCost {
    /// Seconds every pass costs, whatever its size.
    pub fixed: f64,
    /// Seconds each row adds.
    pub per_row: f64,
}

impl PassCost {
    /// Seconds a pass of `rows` rows takes.
    pub fn seconds(&self, rows: usize) -> f64 {
        self.fixed + self.per_row * rows as f64
    }

    /// The most rows a pass of at most `seconds` holds (0 when even an empty
    /// pass takes longer).
    pub fn rows_within(&self, seconds: f64) -> usize {
        let spare = seconds - self.fixed;
        if spare.is_nan() || spare <= 0.0 {
            return 0;
        }
        if self.per_row.is_nan() || self.per_row <= 0.0 {
            return usize::MAX;
        }
        // `as` saturates: a huge quotient is usize::MAX.
        (spare / self.per_row) as usize
    }
}

/// The running fit: exponentially weighted sums over the passes.
#[derive(Debug, Clone, Default)]
pub struct CostFit {
    weight: f64,
    /// Sums with the squared weights (for their effective number and the
    /// slope's error).
    weight_weight: f64,
    weight_weight_rows: f64,
    weight_weight_rows_rows: f64,
    rows: f64,
    seconds: f64,
    rows_rows: f64,
    rows_seconds: f64,
    seconds_seconds: f64,
    /// The per-row cost of the last line fitted.
    slope: Option<f64>,
}

impl CostFit {
    /// Adds a pass of `rows` rows that took `seconds`; passes of no rows,
    /// and times that are not times, are ignored.
    pub fn add(&mut self, rows: usize, seconds: f64) {
        if rows == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let x = rows as f64;
        for sum in [
            &mut self.weight,
            &mut self.rows,
            &mut self.seconds,
            &mut self.rows_rows,
            &mut self.rows_seconds,
            &mut self.seconds_seconds,
        ] {
            *sum *= KEEP;
        }
        self.weight_weight = self.weight_weight * KEEP * KEEP + 1.0;
        self.weight_weight_rows = self.weight_weight_rows * KEEP * KEEP + x;
        self.weight_weight_rows_rows = self.weight_weight_rows_rows * KEEP * KEEP + x * x;
        self.weight += 1.0;
        self.rows += x;
        self.seconds += seconds;
        self.rows_rows += x * x;
        self.rows_seconds += x * seconds;
        self.seconds_seconds += seconds * seconds;
        if let Some(line) = self.line() {
            self.slope = Some(line.per_row);
        }
    }

    /// The means of rows and seconds, and the variance of rows.
    fn moments(&self) -> (f64, f64, f64) {
        let mean_rows = self.rows / self.weight;
        let mean_seconds = self.seconds / self.weight;
        let variance = self.rows_rows / self.weight - mean_rows * mean_rows;
        (mean_rows, mean_seconds, variance)
    }

    /// The least-squares line, when the passes determine one that makes
    /// sense. A line that falls with size, or passes dearer than linear in
    /// their rows (a negative fixed part), is noise or the wrong model.
    fn line(&self) -> Option<PassCost> {
        if self.weight <= 0.0 {
            return None;
        }
        let passes = self.weight * self.weight / self.weight_weight;
        let (mean_rows, mean_seconds, variance) = self.moments();
        if passes < MIN_PASSES || variance < MIN_SPREAD_ROWS * MIN_SPREAD_ROWS {
            return None;
        }
        let covariance = self.rows_seconds / self.weight - mean_rows * mean_seconds;
        let per_row = covariance / variance;
        let fixed = mean_seconds - per_row * mean_rows;
        // The scatter of the times about the line, and so the slope's error:
        // for weights w, var(slope) = σ² Σw²(x − x̄)² / (Σw(x − x̄)²)².
        let seconds_variance = self.seconds_seconds / self.weight - mean_seconds * mean_seconds;
        let spread_weight = self.weight * variance;
        let spread_weight_weight = (self.weight_weight_rows_rows
            - 2.0 * mean_rows * self.weight_weight_rows
            + mean_rows * mean_rows * self.weight_weight)
            .max(0.0);
        // σ² unbiased for weights: the residuals' weighted mean square over
        // 1 − Σw²/(Σw)² − Σw²(x − x̄)² / (Σw · Σw(x − x̄)²).
        let freedom = 1.0 - 1.0 / passes - spread_weight_weight / (self.weight * spread_weight);
        if freedom <= 0.0 {
            return None;
        }
        let scatter = (seconds_variance - per_row * covariance).max(0.0) / freedom;
        let slope_error = (scatter * spread_weight_weight).sqrt() / spread_weight;
        (per_row > 0.0 && fixed >= 0.0 && slope_error <= MAX_SLOPE_ERROR * per_row)
            .then_some(PassCost { fixed, per_row })
    }

    /// The cost the passes so far suggest (`None` before the first).
    pub fn cost(&self) -> Option<PassCost> {
        if self.weight <= 0.0 {
            return None;
        }
        if let Some(line) = self.line() {
            return Some(line);
        }
        let (mean_rows, mean_seconds, _) = self.moments();
        // The last line's slope through the recent passes.
        if let Some(per_row) = self.slope {
            let fixed = mean_seconds - per_row * mean_rows;
            if fixed >= 0.0 {
                return Some(PassCost { fixed, per_row });
            }
        }
        Some(PassCost {
            fixed: 0.0,
            per_row: mean_seconds / mean_rows,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 + 1e-6 * b.abs()
    }

    #[test]
    fn passes_of_mixed_sizes_give_the_fixed_and_the_per_row_cost() {
        // 20 ms a pass and 1 ms a row: decode-only passes of 1–3 rows and a
        // prompt slice now and then.
        let mut fit = CostFit::default();
        for i in 0..200 {
            let rows = if i % 10 == 0 { 256 } else { 1 + i % 3 };
            fit.add(rows, 0.020 + 0.001 * rows as f64);
        }
        let cost = fit.cost().unwrap();
        assert!(close(cost.fixed, 0.020), "{cost:?}");
        assert!(close(cost.per_row, 0.001), "{cost:?}");
        assert_eq!(cost.rows_within(0.200), 180);
        assert!(close(cost.seconds(100), 0.120));
    }

    #[test]
    fn a_per_row_average_would_charge_the_fixed_part_to_every_row() {
        // The same stage after a long run of 2-row decode passes: the line
        // still stands on the older, larger passes.
        let mut fit = CostFit::default();
        fit.add(256, 0.276);
        for _ in 0..60 {
            fit.add(2, 0.022);
        }
        let cost = fit.cost().unwrap();
        assert!(close(cost.fixed, 0.020), "{cost:?}");
        assert!(close(cost.per_row, 0.001), "{cost:?}");
        // Long after the line's larger passes have faded, its slope stands
        // and the fixed part follows the recent passes (slower now).
        for _ in 0..1000 {
            fit.add(2, 0.032);
        }
        assert_eq!(fit.line(), None);
        let cost = fit.cost().unwrap();
        // (The line moved a little while the slower passes came in.)
        assert!((cost.fixed - 0.030).abs() < 2e-4, "{cost:?}");
        assert!((cost.per_row - 0.001).abs() < 5e-5, "{cost:?}");
    }

    /// Numbers in [0, 1) from a fixed sequence.
    fn noise(n: usize) -> Vec<f64> {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 11) as f64 / (1u64 << 53) as f64
            })
            .collect()
    }

    #[test]
    fn passes_whose_times_are_mostly_noise_do_not_make_a_line() {
        // One to four rows, each 20 ms give or take 1 ms: the noise would
        // make the slope.
        let mut fit = CostFit::default();
        for (i, u) in noise(100).into_iter().enumerate() {
            fit.add(1 + i % 4, 0.019 + 0.002 * u);
        }
        assert_eq!(fit.line(), None);
        assert_eq!(fit.cost().unwrap().fixed, 0.0);
    }

    #[test]
    fn decode_passes_of_one_to_eight_rows_make_a_line_through_their_noise() {
        // 20 ms a pass and 2 ms a row, give or take 0.5 ms: decode-only
        // passes alone determine the line.
        let mut fit = CostFit::default();
        for (i, u) in noise(200).into_iter().enumerate() {
            let rows = 1 + (i * 5) % 8;
            fit.add(rows, 0.020 + 0.002 * rows as f64 + 0.001 * (u - 0.5));
        }
        let cost = fit.line().expect("a line");
        assert!((cost.per_row - 0.002).abs() < 3e-4, "{cost:?}");
        assert!((cost.fixed - 0.020).abs() < 2e-3, "{cost:?}");
    }

    #[test]
    fn passes_of_one_size_count_all_of_their_cost_per_row() {
        let mut fit = CostFit::default();
        assert_eq!(fit.cost(), None);
        for _ in 0..5 {
            fit.add(4, 0.040);
        }
        let cost = fit.cost().unwrap();
        assert_eq!(cost.fixed, 0.0);
        assert!(close(cost.per_row, 0.010), "{cost:?}");
        // Empty passes and non-times change nothing.
        fit.add(0, 1.0);
        fit.add(3, f64::NAN);
        fit.add(3, -1.0);
        assert!(close(fit.cost().unwrap().per_row, 0.010));
    }

    #[test]
    fn a_fit_that_makes_no_sense_falls_back_to_the_per_row_average() {
        // Larger passes faster than smaller ones (noise): no negative costs.
        let mut fit = CostFit::default();
        for _ in 0..10 {
            fit.add(10, 0.100);
            fit.add(100, 0.050);
        }
        assert_eq!(fit.line(), None);
        let cost = fit.cost().unwrap();
        assert_eq!(cost.fixed, 0.0);
        assert!(cost.per_row > 0.0);
        // Dearer than linear (a negative fixed part): the average as well.
        let mut fit = CostFit::default();
        for _ in 0..10 {
            fit.add(10, 0.001);
            fit.add(100, 0.100);
        }
        assert_eq!(fit.line(), None);
        assert_eq!(fit.cost().unwrap().fixed, 0.0);
        // Fewer than 8 passes (by the weights) make no line, however well
        // they line up.
        let mut fit = CostFit::default();
        for rows in [1, 20, 40, 60, 80, 100, 120, 150] {
            fit.add(rows, 0.020 + 0.001 * rows as f64);
        }
        assert_eq!(fit.line(), None);
    }

    #[test]
    fn rows_within_a_time_no_pass_fits_in_are_none() {
        let cost = PassCost {
            fixed: 0.3,
            per_row: 0.001,
        };
        assert_eq!(cost.rows_within(0.2), 0);
        let free = PassCost {
            fixed: 0.0,
            per_row: 0.0,
        };
        assert_eq!(free.rows_within(0.2), usize::MAX);
    }
}
